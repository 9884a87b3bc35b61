"""SGLang serving on a machine without a GPU: the plugin's own CPU set-up (``sglang_dflash.adapter.cpu_platform``),
no test harness environment and no sitecustomize."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from harness.server import SITECUSTOMIZE_DIR


def _clean_env() -> dict[str, str]:
    """This process's environment without what the test harness adds: no SGLANG_* variable, no sitecustomize."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_")}
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != SITECUSTOMIZE_DIR]
    env.pop("PYTHONPATH", None)
    if paths:
        env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


def test_cpu_setup_selects_sglang_cpu_engine_and_registers_sgl_kernel_ops():
    """In a process that imported SGLang's server args first (as the launcher does before plugins load), the set-up
    selects SGLang's CPU engine, makes sgl_kernel importable without a GPU driver, and registers the sgl_kernel CPU
    ops speculative decoding reaches, with the semantics of SGLang's Triton versions."""
    code = r"""
import os
import sglang.srt.server_args  # caches SGLang's device checks, as in the launcher
from sglang_dflash.adapter import cpu_platform
assert cpu_platform.setup()
assert os.environ["SGLANG_USE_CPU_ENGINE"] == "1"
import sglang.srt.platforms as platforms
from sglang.srt.platforms.cpu import CpuSRTPlatform
from sglang.srt.utils.common import get_device, is_cpu
assert is_cpu() and get_device() == "cpu", (is_cpu(), get_device())
assert platforms._current_platform is None or isinstance(platforms._current_platform, CpuSRTPlatform)

import torch
from sgl_kernel import assign_extend_cache_locs_cpu, assign_req_to_token_pool_cpu, copy_all_layer_kv_cache_cpu
k = torch.arange(40, dtype=torch.float32).view(10, 2, 2)
v = -k - 1
ptrs = torch.tensor([k.data_ptr(), v.data_ptr()], dtype=torch.uint64)
want_k, want_v = k.clone(), v.clone()
tgt, src = torch.tensor([0, 1, 7]), torch.tensor([1, 0, 3])  # includes a swap: gather before scatter
want_k[tgt], want_v[tgt] = k[src].clone(), v[src].clone()
copy_all_layer_kv_cache_cpu(ptrs, torch.tensor([16, 16]), tgt, src)
assert torch.equal(k, want_k) and torch.equal(v, want_v), (k, v)

r2t = torch.zeros(3, 8, dtype=torch.int32)
idx, start, end = torch.tensor([2, 0]), torch.tensor([1, 0]), torch.tensor([3, 3])
assign_req_to_token_pool_cpu(idx, r2t, start, end, torch.tensor([7, 8, 9, 10, 11]), 8)
assert r2t.tolist() == [[9, 10, 11, 0, 0, 0, 0, 0], [0] * 8, [0, 7, 8, 0, 0, 0, 0, 0]], r2t
out = torch.zeros(5, dtype=torch.int64)
assign_extend_cache_locs_cpu(idx, r2t, start, end, out, 8)
assert out.tolist() == [7, 8, 9, 10, 11], out
print("ok")
"""
    env = _clean_env()
    from sglang_dflash.adapter.cpu_platform import accelerator_present

    if accelerator_present():  # a GPU host serves on CPU when asked
        env["SGLANG_USE_CPU_ENGINE"] = "1"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stderr[-3000:]
