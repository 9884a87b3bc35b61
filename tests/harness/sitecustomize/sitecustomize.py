"""Test-only start-up hook that lets stock SGLang run on a machine without a GPU driver.

Put this directory first on PYTHONPATH of an ``sglang.launch_server`` subprocess; Python
imports ``sitecustomize`` automatically at start-up, in the server and in every process it
spawns. Nothing in the package imports it.

1. ``import sgl_kernel`` (pulled in by sglang's layers) loads its native ``common_ops``
   extension, which links against ``libcuda.so.1`` and so fails without an NVIDIA driver
   ("Could not load any common_ops library"). Its loader's last resort is a plain
   ``import common_ops``; registering an empty module under that name turns the load into a
   no-op. With ``SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native`` no
   ``sgl_kernel`` op is called on the non-speculative path: every layer takes ``forward_native``.

2. With ``--speculative-algorithm`` set, SGLang's CPU path calls three ``torch.ops.sgl_kernel``
   ops that only the separate sgl-kernel CPU build provides:
   ``copy_all_layer_kv_cache_cpu`` (KV pool init warm-up and ``move_kv_cache``),
   ``assign_req_to_token_pool_cpu`` (``alloc_for_spec_decode``) and
   ``assign_extend_cache_locs_cpu`` (``assign_extend_cache_locs_func``). They are registered
   here as plain-torch CPU kernels, with the semantics of SGLang's Triton versions.

3. Grammar-constrained decoding (xgrammar backend) allocates its token bitmask in pinned memory (needs a CUDA
   driver) and applies it only on GPU devices ("Unsupported device: cpu"). When
   ``sglang.srt.constrained.xgrammar_backend`` is imported, its allocator is replaced by an unpinned one and
   CPU logits are masked with xgrammar's own CPU ``apply_token_bitmask_inplace`` (same bitmask semantics).

4. SGLang's overlap scheduler (FutureMap, the scheduler's batch pinning) calls ``Tensor.record_stream`` with the
   device's current stream, which torch accepts only for CUDA streams ("unknown parameter type"). On CPU there is
   one stream and nothing to record, so a CPU tensor's ``record_stream`` is a no-op here; with it the overlap
   schedule runs on CPU (sglang-dflash allows it with ``SGLANG_DFLASH_CPU_OVERLAP=1``).

5. ``SGLANG_DFLASH_TEST_NO_HOST_LENGTHS=1``: SGLang's overlap scheduler does not mirror the committed lengths to the
   host (``decide_needs_cpu_seq_lens`` returns False), as for a GPU server whose decode step is one CUDA graph
   planned on the device (`DFlashWorker.spec_v2_attn_backends`); the CPU step then reads them itself, as a GPU batch
   larger than every capture does. The scheduler logs ``TEST: no host mirror of committed lengths`` once.
"""

import os

import ctypes
import sys
import types

if "common_ops" not in sys.modules:
    _stub = types.ModuleType("common_ops")
    _stub.__file__ = __file__  # the loader logs the module's __file__
    sys.modules["common_ops"] = _stub

import torch  # noqa: E402  (every process this hook runs in imports torch anyway)


def _copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc):
    """For every buffer i (base address data_ptrs[i], strides[i] bytes per slot): slot tgt <- slot src."""
    tgt, src = tgt_loc.tolist(), src_loc.tolist()
    for base, stride in zip(data_ptrs.tolist(), strides.tolist()):
        rows = [ctypes.string_at(base + s * stride, stride) for s in src]  # gather, then scatter
        for t, row in zip(tgt, rows):
            ctypes.memmove(base + t * stride, row, stride)


def _segments(req_pool_indices, start_offset, end_offset):
    """(req row, kv start, kv end, offset into the packed locs) per request."""
    out, pos = [], 0
    for r, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist()):
        out.append((r, s, e, pos))
        pos += e - s
    return out


def _assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """req_to_token[req, start:end] = packed out_cache_loc segment of that request."""
    for r, s, e, p in _segments(req_pool_indices, start_offset, end_offset):
        req_to_token[r, s:e] = out_cache_loc[p : p + e - s].to(req_to_token.dtype)


def _assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc, pool_len):
    """Packed out_cache_loc segment of each request = req_to_token[req, start:end]."""
    for r, s, e, p in _segments(req_pool_indices, start_offset, end_offset):
        out_cache_loc[p : p + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)


_CPU_OPS = {
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()",
        _copy_all_layer_kv_cache,
    ),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()",
        _assign_req_to_token_pool,
    ),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()",
        _assign_extend_cache_locs,
    ),
}

_LIB = torch.library.Library("sgl_kernel", "FRAGMENT")  # kept alive: dropping it unregisters the ops
for _name, (_schema, _fn) in _CPU_OPS.items():
    if not hasattr(torch.ops.sgl_kernel, _name):  # a real sgl-kernel CPU build wins
        _LIB.define(_name + _schema)
        _LIB.impl(_name, _fn, "CPU")


_XGRAMMAR = "sglang.srt.constrained.xgrammar_backend"


def _patch_xgrammar_backend(module) -> None:
    import xgrammar

    def allocate(vocab_size: int, batch_size: int) -> torch.Tensor:
        return torch.full(module.get_bitmask_shape(batch_size, vocab_size), -1, dtype=module.bitmask_dtype)

    def on_cpu(apply):
        import inspect

        sig = inspect.signature(apply)

        def wrapped(*args, **kwargs):
            bound = sig.bind(*args, **kwargs).arguments
            logits, vocab_mask = bound["logits"], bound["vocab_mask"]
            if logits.device.type == "cpu":
                xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))
            else:
                apply(*args, **kwargs)
        return wrapped

    module._allocate_token_bitmask = allocate
    module.XGrammarGrammar.apply_vocab_mask = on_cpu(module.XGrammarGrammar.apply_vocab_mask)
    module.XGrammarGrammarBackend.apply_vocab_mask = staticmethod(
        on_cpu(module.XGrammarGrammarBackend.__dict__["apply_vocab_mask"].__func__))


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


sys.meta_path.insert(0, _PatchAfterImport(_XGRAMMAR, _patch_xgrammar_backend))


# 4. record_stream: a no-op for CPU tensors (see the module docstring)
_record_stream = torch.Tensor.record_stream


def _record_stream_cpu_noop(self, stream):
    if self.device.type == "cpu":
        return None
    return _record_stream(self, stream)


torch.Tensor.record_stream = _record_stream_cpu_noop


# 5. the scheduler's host mirror of the committed lengths off (see the module docstring)
def _patch_overlap_utils(module) -> None:
    def decide_needs_cpu_seq_lens(server_args, attn_backends) -> bool:
        print("TEST: no host mirror of committed lengths", file=sys.stderr, flush=True)
        return False

    module.decide_needs_cpu_seq_lens = decide_needs_cpu_seq_lens


if os.environ.get("SGLANG_DFLASH_TEST_NO_HOST_LENGTHS") == "1":
    sys.meta_path.insert(0, _PatchAfterImport("sglang.srt.managers.overlap_utils", _patch_overlap_utils))
