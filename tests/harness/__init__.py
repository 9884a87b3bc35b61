"""Test harness that runs real ``sglang.launch_server`` processes on CPU."""
