"""Serving on a host without an accelerator: what stock SGLang 0.5.17 needs there, set up by the plugin itself.

:func:`setup` runs from the plugin entry point (``plugin.register``), i.e. in the launcher (before it parses the
server arguments and spawns the scheduler and detokenizer processes) and again in every scheduler process. It acts
on a CPU-only host (no CUDA / ROCm / XPU / MPS device, no NPU / HPU / MUSA runtime) or when
``SGLANG_USE_CPU_ENGINE=1`` asks for SGLang's CPU engine, for every server (no-spec and DFLASH alike):

1. **CPU engine.** ``SGLANG_USE_CPU_ENGINE=1`` (SGLang's switch) goes into ``os.environ``, so every process the
   launcher spawns starts with it: the device defaults to ``cpu`` and layers take their CPU paths instead of imports
   that assume CUDA (the rotary embedding's ``vllm._custom_ops``). The launcher has evaluated SGLang's cached device
   checks at import, before any plugin loads; they are reset here.
2. **sgl_kernel.** ``import sgl_kernel`` (pulled in by SGLang's memory pool, in the scheduler before the plugin
   loads) first loads its native ``common_ops``, which links ``libcuda.so.1`` and fails without an NVIDIA driver;
   its loader's last resort is a plain ``import common_ops``. ``cpu_shim/`` (holding an empty ``common_ops``) is
   appended to ``sys.path``, which spawned processes inherit from the launcher; a working native build still wins.
   The three ``torch.ops.sgl_kernel`` CPU ops speculative decoding reaches on CPU, which only sgl-kernel's separate
   CPU build provides, are registered in plain torch (:data:`CPU_OPS`) unless that build is present.
3. **Attention backend.** SGLang defaults a CPU server to ``intel_amx``, whose kernels come with sgl-kernel's CPU
   build and need AMX tiles; where :func:`sglang.srt.utils.common.cpu_has_amx_support` is false, or for DFLASH
   served by sglang-dflash, the default becomes ``torch_native`` (logged). An explicit backend that cannot run on
   CPU is refused with one line naming it.
4. **KV pool.** SGLang sizes a CPU KV pool from ``--mem-fraction-static`` of the host's RAM (~60% of it); without
   ``--max-total-tokens`` the pool gets at most ``1 / KV_RAM_SHARE`` of the RAM available once the weights are
   loaded (logged with the size chosen; the same on every tensor-parallel rank: the smallest of theirs).
5. **Grammars.** xgrammar's token bitmask is allocated in pinned memory (needs a CUDA driver) and applied on GPU
   devices only; here it is allocated unpinned and CPU logits are masked with xgrammar's CPU kernel (same bitmask).
6. **Tensor parallelism** (``--tp-size N``, ranks on one host; logged). The ranks' collectives run on gloo:
   SGLang's PyNccl communicator is not created (with a CUDA build of torch it finds NCCL and then refuses CPU
   tensors). Each rank gets its own CPUs: SGLang binds rank r to NUMA node r and asserts N <= the number of nodes;
   with more ranks than nodes and no ``SGLANG_CPU_OMP_THREADS_BIND``, this host's CPUs are split into N contiguous
   groups (:func:`cpu_binding`). ``TORCH_COMPILE_DISABLE=1`` (unless set, or ``--enable-torch-compile``): the
   vocab-parallel embedding's masking is a ``torch.compile`` function, compiled to C++ on the first request
   (~40 s on 2 cores).
7. **Linear-attention conv state** (hybrid models: Qwen3.5 / Qwen3-Next Gated DeltaNet, Mamba). SGLang keeps the
   causal conv's state -- the last ``W - 1`` conv inputs of a request, saved by a prefill and read by the next decode
   or verify step -- in ``SGLANG_MAMBA_CONV_DTYPE``, bfloat16 unless set, whatever ``--dtype``. For a model served
   in float32 that rounds the inputs a continuation reads, so its next tokens part from a prefill of the same text
   (benchmarks/HYBRID.md). With ``--dtype float32`` and the variable unset it becomes ``float32`` (logged), in the
   launcher's environment, which the scheduler processes inherit.
8. **Multi-head latent attention** (DeepSeek-V2/V3-style targets). SGLang picks each MLA layer's attention method
   per backend; ``torch_native`` has no entry and gets the Triton backend's rule, which runs a prompt's first prefill
   as plain multi-head attention over the decompressed K/V -- attention that torch_native does not implement (it
   reads K/V from the KV pool, which holds the compressed latent: "Expected size ... [4, 24] but got: [4, 40]").
   On CPU, torch_native runs every MLA forward absorbed instead (queries against the latent cache, SGLang's decode
   path): the same attention.
9. **Sliding-window KV pool** (Gemma 4). SGLang 0.5.17 refuses torch_native for Gemma 4 (it accepts GPU / XPU
   backends only) and its torch_native backend reads a sliding layer's K/V at the full pool's slots, not at the
   slots of the sliding-window pool that holds them (`cpu_attention.swa_rows` translates them for every read). On
   CPU with torch_native the Gemma 4 check passes, logged.
10. **Unset intermediate sizes.** SGLang 0.5.17's CPU model loading pads every ``*intermediate_size`` field of the
   config to the tensor-parallel size and fails on one that is present but None (``None % int``; Gemma 4's
   ``moe_intermediate_size`` without MoE blocks); such a field is left alone, as later releases do.
11. **Hybrid targets where the ops' call form is unknown.** The CPU ops of `cpu_linear_attn` follow the installed
   release's call sites: 0.5.17 and 0.5.23 call them alike except Qwen3.5's attention-output gate
   (``fused_sigmoid_mul_cpu``: returning the gated tensor in 0.5.17, gating in place from 0.5.23 on; served in the
   found form, `compat.CPU_SIGMOID_MUL_CALL`). Served in the other form, a Qwen3.5 leaves its attention output
   ungated and gives other tokens than the model's from the first one on. (Qwen3-Next's GDN output norm, built on
   ``torch.get_device_module()``'s device -- CUDA with 0.5.23's torch on a host without a GPU --, is built on the
   CPU: `cpu_linear_attn.qwen3_next_gdn_on_cpu`.) Where SGLang's CPU Qwen3.5 calls the gate in neither form, a
   hybrid target on CPU is refused at start-up, naming the fix.
12. **DFLASH's synchronous scheduler, settled early.** DFLASH served by sglang-dflash runs the synchronous scheduler
   on CPU (`server_args.overlap_supported`); that is settled here, before SGLang's model-specific settings read it.
   There SGLang 0.5.23 resolves a hybrid target's radix-cache state strategy: under the overlap schedule it picks
   ``extra_buffer`` for Qwen3.5 (0.5.17: for Qwen3-Next), which it then refuses on CPU ("extra_buffer requires
   platform support for Mamba cache state snapshots"); under the synchronous one it picks ``no_buffer``. (A server
   without speculative decoding meets the same refusal unless given ``--disable-overlap-schedule``.)
"""

from __future__ import annotations

import ctypes
import importlib.util
import logging
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

CPU_ENGINE_ENV = "SGLANG_USE_CPU_ENGINE"
SHIM_DIR = Path(__file__).resolve().parent / "cpu_shim"
# Without --max-total-tokens a CPU KV pool gets at most 1/KV_RAM_SHARE of the RAM available after the weights load.
KV_RAM_SHARE = 8
# Attention backends that run on CPU (intel_amx only with sgl-kernel's CPU build).
CPU_BACKENDS = ("torch_native", "intel_amx")
CONV_DTYPE_ENV = "SGLANG_MAMBA_CONV_DTYPE"  # SGLang's dtype of the linear-attention conv state (default bfloat16)
# Runtimes of accelerators SGLang serves through their own platform code; their presence leaves the host alone.
_ACCELERATOR_RUNTIMES = ("torch_npu", "habana_frameworks", "torchada")

def accelerator_present() -> bool:
    """A device SGLang serves on other than the CPU: CUDA / ROCm, XPU or MPS, or an NPU / HPU / MUSA runtime."""
    import torch

    if torch.cuda.is_available() or torch.backends.mps.is_available():
        return True
    if hasattr(torch, "xpu") and torch.xpu.is_available():
        return True
    return any(importlib.util.find_spec(m) is not None for m in _ACCELERATOR_RUNTIMES)


def cpu_serving() -> bool:
    """True where SGLang serves on the CPU: the user asked for its CPU engine, or the host has no accelerator."""
    return os.environ.get(CPU_ENGINE_ENV) == "1" or (CPU_ENGINE_ENV not in os.environ and not accelerator_present())


def setup() -> bool:
    """Prepare this process for CPU serving (1 and 2 of the module docstring) where :func:`cpu_serving`, before
    anything imports sgl_kernel; returns whether it did. The hooks (3-7) follow with :func:`register_hooks`."""
    if not cpu_serving():
        return False
    _select_cpu_engine()
    if str(SHIM_DIR) not in sys.path:
        sys.path.append(str(SHIM_DIR))
    register_sgl_kernel_cpu_ops()
    return True


def _select_cpu_engine() -> None:
    """SGLANG_USE_CPU_ENGINE=1 for this process and its children; SGLang's cached device checks re-evaluated."""
    if os.environ.get(CPU_ENGINE_ENV) == "1":
        return
    os.environ[CPU_ENGINE_ENV] = "1"
    import sglang.srt.platforms as platforms
    from sglang.srt.platforms.cpu import CpuSRTPlatform
    from sglang.srt.platforms.interface import SRTPlatform
    from sglang.srt.utils import common

    common.is_cpu.cache_clear()
    common.get_device.cache_clear()
    resolved = platforms._current_platform
    if type(resolved) is SRTPlatform:
        # the "no accelerator" platform SGLang resolved at import; modules hold it by `from ... import
        # current_platform`, so it becomes the CPU platform in place
        resolved.__class__ = CpuSRTPlatform


# ------------------------------------------------------------------------------------------------ sgl_kernel CPU ops


def _copy_all_layer_kv_cache(data_ptrs, strides, tgt_loc, src_loc) -> None:
    """For every buffer i (base address ``data_ptrs[i]``, ``strides[i]`` bytes per slot): slot tgt <- slot src."""
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


def _assign_req_to_token_pool(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                              pool_len) -> None:
    """``req_to_token[req, start:end]`` = that request's packed ``out_cache_loc`` segment."""
    for r, s, e, p in _segments(req_pool_indices, start_offset, end_offset):
        req_to_token[r, s:e] = out_cache_loc[p: p + e - s].to(req_to_token.dtype)


def _assign_extend_cache_locs(req_pool_indices, req_to_token, start_offset, end_offset, out_cache_loc,
                              pool_len) -> None:
    """That request's packed ``out_cache_loc`` segment = ``req_to_token[req, start:end]``."""
    for r, s, e, p in _segments(req_pool_indices, start_offset, end_offset):
        out_cache_loc[p: p + e - s] = req_to_token[r, s:e].to(out_cache_loc.dtype)


# op name -> (schema, CPU implementation with the semantics of SGLang's Triton versions)
CPU_OPS = {
    "copy_all_layer_kv_cache_cpu": (
        "(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()", _copy_all_layer_kv_cache),
    "assign_req_to_token_pool_cpu": (
        "(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor out_cache_loc, int pool_len) -> ()", _assign_req_to_token_pool),
    "assign_extend_cache_locs_cpu": (
        "(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, Tensor end_offset, "
        "Tensor(a!) out_cache_loc, int pool_len) -> ()", _assign_extend_cache_locs),
}
_LIBRARY = None  # kept alive: dropping the torch.library.Library unregisters its ops


def register_sgl_kernel_cpu_ops(ops: dict | None = None) -> None:
    """Register ``ops`` (name -> (schema, CPU function); default :data:`CPU_OPS`) under ``torch.ops.sgl_kernel``
    where sgl_kernel (loaded first) lacks them."""
    global _LIBRARY
    import sgl_kernel  # noqa: F401  (a native build registers its own ops on import; those win)
    import torch

    ops = CPU_OPS if ops is None else ops
    missing = [name for name in ops if not hasattr(torch.ops.sgl_kernel, name)]
    if not missing:
        return
    if _LIBRARY is None:
        _LIBRARY = torch.library.Library("sgl_kernel", "FRAGMENT")
    for name in missing:
        schema, fn = ops[name]
        _LIBRARY.define(name + schema)
        _LIBRARY.impl(name, fn, "CPU")


# ------------------------------------------------------------------------------------------------ SGLang hooks


def register_hooks() -> None:
    """Hooks 3-7 of the module docstring (:func:`hooks`)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (hook, _params) in hooks().items():
        HookRegistry.register(target, hook, HookType.AROUND)


def _cpu_attention_backend(original, server_args) -> None:
    """SGLang's CPU default (intel_amx on x86) where it runs, else torch_native (logged): on a CPU without intel_amx
    support, and for DFLASH served by sglang-dflash (`server_args.default_attention_backend`). An explicit backend
    that cannot run on CPU is refused."""
    from sglang_dflash.adapter import compat

    chosen = compat.resolving(server_args).attention_backend
    original(server_args)
    view = compat.resolving(server_args)
    if view.device != "cpu":
        return
    _cpu_tensor_parallel(view)
    check_hybrid_target(view)
    conv_state_dtype(view)
    dflash_synchronous_scheduler(server_args)
    if chosen is not None:
        check_cpu_attention_backend(chosen)
        return
    if view.attention_backend != "intel_amx":
        return
    from sglang.srt.utils.common import cpu_has_amx_support

    from sglang_dflash.adapter.hooks import _ours_by_args
    from sglang_dflash.adapter.server_args import default_attention_backend

    if _ours_by_args(view):
        backend, why = default_attention_backend(view, "intel_amx"), "DFLASH served by sglang-dflash"
    elif not cpu_has_amx_support():
        backend, why = "torch_native", "no intel_amx support here: it needs AMX tiles and sgl-kernel's CPU build"
    else:
        return
    compat.resolve(server_args, attention_backend=backend)
    logger.info("sglang-dflash: CPU attention backend %s, not SGLang's default intel_amx (%s); --attention-backend "
                "chooses another.", backend, why)


def _cpu_tensor_parallel(server_args) -> None:
    """6 of the module docstring, in the launcher (the ranks it spawns inherit the environment)."""
    tp = server_args.tp_size
    if tp == 1:
        return
    from sglang.srt.utils.common import get_cpu_ids_by_node

    chosen = []
    if "SGLANG_CPU_OMP_THREADS_BIND" not in os.environ and tp > len(get_cpu_ids_by_node()):
        os.environ["SGLANG_CPU_OMP_THREADS_BIND"] = cpu_binding(sorted(os.sched_getaffinity(0)), tp)
        chosen.append(f"SGLANG_CPU_OMP_THREADS_BIND={os.environ['SGLANG_CPU_OMP_THREADS_BIND']} (CPUs per rank)")
    if "TORCH_COMPILE_DISABLE" not in os.environ and not server_args.enable_torch_compile:
        os.environ["TORCH_COMPILE_DISABLE"] = "1"
        chosen.append("TORCH_COMPILE_DISABLE=1 (no C++ compile of the vocab-parallel embedding at the first request)")
    logger.info("sglang-dflash: CPU tensor parallelism over %d ranks on gloo%s%s", tp, "; " if chosen else "",
                "; ".join(chosen))


def check_hybrid_target(server_args) -> None:
    """11 of the module docstring, in the launcher: a hybrid target on CPU only where `compat.CPU_SIGMOID_MUL_CALL`
    found the form of the installed release's call sites."""
    import sglang

    from sglang_dflash.adapter import compat, hybrid

    if compat.CPU_SIGMOID_MUL_CALL is not None:
        return
    model_config = compat.model_config(server_args)
    if hybrid.target_state_config(model_config) is None:
        return
    arch = model_config.hf_config.architectures[0]
    lo, hi = compat.SUPPORTED_RANGE
    raise ValueError(f"sglang-dflash: {arch} (a hybrid linear-attention target) on CPU: sglang=={sglang.__version__}'s "
                     "CPU Qwen3.5 calls sgl-kernel's fused_sigmoid_mul_cpu in a form the plugin's CPU ops do not "
                     f"serve. Install an SGLang from {lo} to {hi} to serve it on CPU, or serve it on a GPU.")


def dflash_synchronous_scheduler(raw_args) -> None:
    """12 of the module docstring, in the launcher (``raw_args``: the ServerArgs being resolved)."""
    from sglang_dflash.adapter import compat
    from sglang_dflash.adapter.hooks import _ours_by_args
    from sglang_dflash.adapter.server_args import synchronous_where_overlap_cannot_run

    if _ours_by_args(compat.resolving(raw_args)):
        synchronous_where_overlap_cannot_run(raw_args)


def conv_state_dtype(server_args) -> None:
    """7 of the module docstring, in the launcher: ``SGLANG_MAMBA_CONV_DTYPE=float32`` for a server in float32
    unless the variable is set."""
    if server_args.dtype not in ("float32", "float") or CONV_DTYPE_ENV in os.environ:
        return
    os.environ[CONV_DTYPE_ENV] = "float32"
    logger.info("sglang-dflash: --dtype float32 on CPU: %s=float32 (the conv state of linear-attention layers, "
                "bfloat16 by default in SGLang, holds float32 inputs)", CONV_DTYPE_ENV)


def cpu_binding(cpus: list[int], ranks: int) -> str:
    """SGLang's ``SGLANG_CPU_OMP_THREADS_BIND`` value splitting ``cpus`` into ``ranks`` contiguous groups (sizes
    differing by at most one; a CPU shared round-robin where there are fewer CPUs than ranks), e.g. "0-3|4-7"."""
    if len(cpus) < ranks:
        groups = [[cpus[r % len(cpus)]] for r in range(ranks)]
    else:
        q, extra = divmod(len(cpus), ranks)
        bounds = [r * q + min(r, extra) for r in range(ranks + 1)]
        groups = [cpus[bounds[r]: bounds[r + 1]] for r in range(ranks)]
    return "|".join(",".join(_ranges(g)) for g in groups)


def _ranges(cpus: list[int]) -> list[str]:
    """Sorted CPU ids -> "a-b" runs (a lone id as "a")."""
    runs = []
    for c in cpus:
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return [f"{a}-{b}" if b > a else str(a) for a, b in runs]


def _gloo_group(original, *args, **kwargs):
    """SGLang's ``init_model_parallel_group`` without a PyNccl communicator (CPU ranks talk through gloo)."""
    import inspect

    bound = inspect.signature(original).bind(*args, **kwargs)
    bound.arguments["use_pynccl"] = False
    return original(*bound.args, **bound.kwargs)


def check_cpu_attention_backend(backend: str) -> None:
    """Refuse an attention backend that cannot run on this CPU, naming it and the fix."""
    import torch

    if backend not in CPU_BACKENDS:
        raise ValueError(f"sglang-dflash: --attention-backend {backend} does not run on CPU. "
                         f"Use --attention-backend torch_native.")
    if backend == "intel_amx" and not hasattr(torch.ops.sgl_kernel, "decode_attention_cpu"):
        raise ValueError("sglang-dflash: --attention-backend intel_amx needs sgl-kernel's CPU build "
                         "(torch.ops.sgl_kernel.decode_attention_cpu), which is not installed. "
                         "Use --attention-backend torch_native.")


def _cpu_kv_budget(original, configurator, pre_model_load_memory) -> int:
    """KV pool bytes: SGLang's budget, on CPU without --max-total-tokens at most 1/KV_RAM_SHARE of the RAM
    available now (after the weights loaded)."""
    budget = original(configurator, pre_model_load_memory)
    from sglang.srt.runtime_context import get_schedule

    if configurator.device != "cpu" or get_schedule().max_total_tokens is not None:
        return budget
    import psutil

    available = psutil.virtual_memory().available
    cap = _min_over_ranks(available // KV_RAM_SHARE)
    if budget <= cap:
        return budget
    logger.info("sglang-dflash: CPU KV pool of %.2f GiB: 1/%d of the %.1f GiB of RAM available after loading the "
                "weights (SGLang's --mem-fraction-static would take %.2f GiB); --max-total-tokens N sets the pool "
                "size instead.", cap / 2**30, KV_RAM_SHARE, available / 2**30, budget / 2**30)
    return cap


def _min_over_ranks(n: int) -> int:
    """The smallest ``n`` of this server's ranks (``n`` itself on one rank): tensor-parallel ranks share one host's
    RAM and must size the same KV pool (each schedules on its own copy of the pool's state)."""
    from sglang.srt.distributed.parallel_state import get_world_group

    group = get_world_group()
    if group.world_size == 1:
        return n
    import torch

    t = torch.tensor([n], dtype=torch.int64)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN, group=group.cpu_group)
    return int(t.item())


def _unpinned_token_bitmask(original, vocab_size: int, batch_size: int):
    """xgrammar's token bitmask (all tokens allowed) in pageable memory: pinning needs a CUDA driver."""
    import torch
    from sglang.srt.constrained import xgrammar_backend

    return torch.full(xgrammar_backend.get_bitmask_shape(batch_size, vocab_size), -1,
                      dtype=xgrammar_backend.bitmask_dtype)


def _mask_logits(apply, logits, vocab_mask) -> None:
    """Apply the bitmask to CPU logits with xgrammar's CPU kernel; other devices go to SGLang's ``apply``."""
    if logits.device.type != "cpu":
        return apply(logits, vocab_mask)
    import xgrammar

    xgrammar.apply_token_bitmask_inplace(logits, vocab_mask.to(logits.device))


def _grammar_mask_method(original, grammar, logits, vocab_mask) -> None:
    _mask_logits(lambda lg, vm: original(grammar, lg, vm), logits, vocab_mask)


def _grammar_mask_static(original, logits, vocab_mask) -> None:
    _mask_logits(original, logits, vocab_mask)


def _mla_handler(original, registry, backend_name):
    """8 of the module docstring: the absorbed method for every MLA forward on torch_native (CPU servers only:
    the plugin registers its CPU hooks only there); SGLang's handler for any other backend."""
    if backend_name != "torch_native":
        return original(registry, backend_name)
    from sglang.srt.models.deepseek_common.attention_forward_methods.forward_methods import AttnForwardMethod

    return lambda attn, forward_batch: AttnForwardMethod.MLA


def _sdpa_at_swa_slots(original, backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices,
                       seq_lens, *args, **kwargs):
    """9 of the module docstring: SGLang's torch_native SDPA loops (extend and decode) reading a sliding layer's K/V
    at its slots in the sliding-window pool."""
    from sglang_dflash.adapter.cpu_attention import swa_rows

    req_to_token, req_pool_indices = swa_rows(backend.token_to_kv_pool, k_cache, req_to_token, req_pool_indices,
                                              seq_lens)
    return original(backend, query, output, k_cache, v_cache, req_to_token, req_pool_indices, seq_lens, *args,
                    **kwargs)


def _unset_intermediate_size(original, model_config, attr_name, intermediate_padding_size):
    """10 of the module docstring: the config unchanged where the field SGLang reads (the text config's, the HF
    config's or the model config's, in that order) is None."""
    hf = getattr(model_config, "hf_config", None)
    owner = next((c for c in (getattr(hf, "text_config", None), hf, model_config)
                  if c is not None and hasattr(c, attr_name)), None)
    if owner is not None and getattr(owner, attr_name) is None:
        return model_config
    return original(model_config, attr_name, intermediate_padding_size)


GEMMA4_ARCHS = ("Gemma4ForCausalLM", "Gemma4ForConditionalGeneration", "Gemma4UnifiedForConditionalGeneration")


def _gemma4_on_torch_native(original, server_args) -> None:
    """9 of the module docstring: SGLang's model-specific adjustments, whose Gemma 4 branch asserts a GPU / XPU
    attention backend, seeing a CPU server's torch_native as one it accepts (that branch does nothing else)."""
    from sglang.srt.arg_groups.overrides import attention_backends_of, resolved_view

    view = resolved_view(server_args)
    if (view.device != "cpu" or set(attention_backends_of(view)) != {"torch_native"}
            or server_args.get_model_config().hf_config.architectures[0] not in GEMMA4_ARCHS):
        return original(server_args)
    logger.info("sglang-dflash: Gemma 4 on CPU with torch_native (SGLang's check asks for a GPU / XPU backend; the "
                "plugin reads its sliding-window KV pool at the right slots)")
    server_args._resolved_attention_backends = lambda: ("triton", "triton")  # the instance's view, for this call
    original(server_args)
    del server_args._resolved_attention_backends


def hooks() -> dict:
    """dotted path -> (hook, parameter names of the hooked SGLang function; checked with the plugin's other hooks in
    `hooks.EXPECTED_SIGNATURES`)."""
    from sglang_dflash.adapter import compat

    gemma4 = {compat.GEMMA4_CHECK[0]: (_gemma4_on_torch_native, compat.GEMMA4_CHECK[1])} if compat.GEMMA4_CHECK else {}
    return {compat.CPU_BACKENDS[0]: (_cpu_attention_backend, compat.CPU_BACKENDS[1]), **gemma4, **_HOOKS}


_HOOKS = {
    "sglang.srt.mem_cache.kv_cache_configurator.KVCacheConfigurator._profile_available_bytes": (
        _cpu_kv_budget, ["self", "pre_model_load_memory"]),
    "sglang.srt.constrained.xgrammar_backend._allocate_token_bitmask": (
        _unpinned_token_bitmask, ["vocab_size", "batch_size"]),
    "sglang.srt.constrained.xgrammar_backend.XGrammarGrammar.apply_vocab_mask": (
        _grammar_mask_method, ["self", "logits", "vocab_mask"]),
    "sglang.srt.constrained.xgrammar_backend.XGrammarGrammarBackend.apply_vocab_mask": (
        _grammar_mask_static, ["logits", "vocab_mask"]),
    "sglang.srt.distributed.parallel_state.init_model_parallel_group": (
        _gloo_group, ["group_ranks", "local_rank", "backend", "use_pynccl"]),
    "sglang.srt.models.deepseek_common.attention_backend_handler.AttentionBackendRegistry.get_handler": (
        _mla_handler, ["backend_name"]),
    "sglang.srt.configs.update_config.update_intermediate_size": (
        _unset_intermediate_size, ["model_config", "attr_name", "intermediate_padding_size"]),
    **{f"sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_{mode}": (
        _sdpa_at_swa_slots, ["self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices",
                             "seq_lens"]) for mode in ("extend", "decode")},
}
