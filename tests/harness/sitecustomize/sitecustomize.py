"""Test-only start-up hook of the CPU test servers: switches for testing paths a CPU server does not take by itself.

Put this directory first on PYTHONPATH of an ``sglang.launch_server`` subprocess; Python imports ``sitecustomize``
automatically at start-up, in the server and in every process it spawns. Nothing in the package imports it. What a
CPU server needs to run at all (SGLang's CPU engine, sgl_kernel without a GPU driver, its CPU ops, xgrammar on CPU)
is the plugin's own set-up (``sglang_dflash.adapter.cpu_platform``), not this file's.

1. SGLang's overlap scheduler (FutureMap, the scheduler's batch pinning) calls ``Tensor.record_stream`` with the
   device's current stream, which torch accepts only for CUDA streams ("unknown parameter type"). On CPU there is
   one stream and nothing to record, so a CPU tensor's ``record_stream`` is a no-op here. With
   ``SGLANG_DFLASH_TEST_CPU_OVERLAP=1`` sglang-dflash's ``overlap_supported`` then answers True on CPU, so DFLASH
   runs SGLang's overlap schedule there (the plugin itself turns it off on CPU); the launcher logs
   ``TEST: overlap schedule on CPU`` once.

2. ``SGLANG_DFLASH_TEST_NO_HOST_LENGTHS=1``: SGLang's overlap scheduler does not mirror the committed lengths to the
   host (``decide_needs_cpu_seq_lens`` returns False), as for a GPU server whose decode step is one CUDA graph
   planned on the device (`DFlashWorker.spec_v2_attn_backends`); the CPU step then reads them itself, as a GPU batch
   larger than every capture does. The scheduler logs ``TEST: no host mirror of committed lengths`` once.

5. ``SGLANG_DFLASH_TEST_WIDTHS=16,1,3``: sglang-dflash's verify width cycles through these widths, one per decode
   step, whatever the policy would choose (the server must run adaptive, i.e. more than one candidate width); the
   scheduler logs ``TEST: verify widths cycle [...]`` once.
"""

import itertools
import os
import sys

import torch


# 1. record_stream: a no-op for CPU tensors (see the module docstring)
_record_stream = torch.Tensor.record_stream


def _record_stream_cpu_noop(self, stream):
    if self.device.type == "cpu":
        return None
    return _record_stream(self, stream)


torch.Tensor.record_stream = _record_stream_cpu_noop


class _PatchAfterImport:
    """Meta-path finder that runs a patch right after one module executes."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # find the real spec, then stay out of the way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


# 2. the scheduler's host mirror of the committed lengths off (see the module docstring)
def _patch_overlap_utils(module) -> None:
    def decide_needs_cpu_seq_lens(server_args, attn_backends) -> bool:
        print("TEST: no host mirror of committed lengths", file=sys.stderr, flush=True)
        return False

    module.decide_needs_cpu_seq_lens = decide_needs_cpu_seq_lens


def _patch_server_args(module) -> None:
    def overlap_supported(server_args) -> bool:
        print("TEST: overlap schedule on CPU", file=sys.stderr, flush=True)
        return True

    module.overlap_supported = overlap_supported


if os.environ.get("SGLANG_DFLASH_TEST_CPU_OVERLAP") == "1":
    sys.meta_path.insert(0, _PatchAfterImport("sglang_dflash.adapter.server_args", _patch_server_args))


# 5. verify widths forced to cycle (see the module docstring)
def _patch_policy(module) -> None:
    cycle = [int(w) for w in os.environ["SGLANG_DFLASH_TEST_WIDTHS"].split(",")]
    widths = itertools.cycle(cycle)
    print(f"TEST: verify widths cycle {cycle}", file=sys.stderr, flush=True)
    module.WidthPolicy.choose = lambda self, bs: next(widths)


if os.environ.get("SGLANG_DFLASH_TEST_WIDTHS"):
    sys.meta_path.insert(0, _PatchAfterImport("sglang_dflash.policy", _patch_policy))
if os.environ.get("SGLANG_DFLASH_TEST_NO_HOST_LENGTHS") == "1":
    sys.meta_path.insert(0, _PatchAfterImport("sglang.srt.managers.overlap_utils", _patch_overlap_utils))
