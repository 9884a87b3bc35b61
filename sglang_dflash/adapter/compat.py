"""What differs between the SGLang releases sglang-dflash serves, decided once at import from the installed SGLang's
own symbols (never from its version string). One flag per change, named after what it detects; the adapter branches
on these and nowhere else.

The version range (`SUPPORTED_RANGE`) is the gate: `hooks.check_sglang_compat` refuses an SGLang outside it. Inside
it, the capabilities below pick each path:

* `SERVER_ARGS_DECLARED` (0.5.20+): server arguments are resolved by declarations (``declare_resolution``; plain
  writes raise) and read through a resolving view; before, resolution wrote the fields. `resolving` / `resolve`.
* `WORKER_TAKES_PS` (0.5.17): ``TpModelWorker`` and the speculative worker take the parallel state ``ps``; later
  releases read it from the runtime context. `worker_ps`.
* `KV_FIELDS_ON_REQ_KV` (0.5.23): a request's ``req_pool_idx`` / ``kv_committed_len`` live on ``req.kv``
  (``ReqKvInfo``), its sliding-window eviction cursors in a per-component dict; before, on the request and in
  ``req.kv.swa_evicted_seqlen``. `req_pool_idx`, `committed_len`, `truncate_kv`.
* `VERIFY_ARGS_KEYWORD_PLAN` (0.5.23): SGLang's KV-location plan. Every forward batch carries one
  (``kv_loc_plan``: its write window and reads, translated once per sub-pool by the runner's ``KVIndexTranslator``),
  and FlashInfer calls a verify input's ``generate_attn_arg_prefill`` with keyword-only ``translator`` / ``plan``
  / ``kind`` (no ``req_to_token``), the read stream coming from ``translator.pack_read_stream``. Served:
  `spec_inputs.DFlashBlockInput` defines the form of the installed release, and the step's own forward batches
  bind their plan (`bind_kv_plan`) before attention is planned; the step graphs, whose device-side layout reads
  ``req_to_token``, stay off (`step_graphs.capture`). Before, reads came from ``req_to_token`` alone.
* `KV_INDICES_KERNEL_MOVED` (0.5.23): ``create_flashinfer_kv_indices_triton`` lives in
  ``sglang.kernels.ops.attention.kv_indices``; imported from here.
* `CPU_SIGMOID_MUL_CALL`: how SGLang's CPU Qwen3.5 calls sgl-kernel's ``fused_sigmoid_mul_cpu`` (the gate of its
  attention output), read from the model's source (importing the model needs the op): ``"in_place"`` (0.5.23: a
  statement ``op(x, gate)``, x gated in place -- sgl-kernel's later ``(Tensor(a!) input, Tensor gate) -> ()``) or
  ``"returning"`` (0.5.17: the op bound as the model's ``fused_sigmoid_mul``, called ``(x, gate, inplace=True)`` for
  its result); None for neither. `cpu_linear_attn` registers its torch op in that form; with None a hybrid target
  is refused on CPU (`cpu_platform.check_hybrid_target`).
* `unchecked_flashinfer`: the step graphs' device-side FlashInfer plan (`kernels.attention_plan`) mirrors
  FlashInfer's private planning rule, checked on a GPU against `PLAN_CHECKED_FLASHINFER` only.
* Hook targets that moved (`DEFAULT_ATTN_BACKEND`, `CPU_BACKENDS`, `FREE_KV_ALIGNED_PARAMS`, `GEMMA4_CHECK`,
  `GRAPH_RESERVE`).
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import inspect
from pathlib import Path

import sglang
from sglang.srt import server_args as _server_args
from sglang.srt.arg_groups import overrides as _overrides
from sglang.srt.managers import schedule_batch as _schedule_batch
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.speculative import dflash_info as _dflash_info

# Releases this code serves (what pyproject allows; its test suite ran on both ends, on CPU).
SUPPORTED_RANGE = ("0.5.17", "0.5.23")

SERVER_ARGS_DECLARED = hasattr(_overrides, "declare_resolution")
# 0.5.17: SGLang's own start-up decisions wait in a stash applied at the end of resolution (last writer wins)
DECISIONS_STASHED = not SERVER_ARGS_DECLARED and hasattr(_overrides, "materialize_declarations")
WORKER_TAKES_PS = "ps" in inspect.signature(TpModelWorker.__init__).parameters
KV_FIELDS_ON_REQ_KV = "kv_committed_len" in getattr(_schedule_batch.ReqKvInfo, "__dataclass_fields__", {})
VERIFY_ARGS_KEYWORD_PLAN = "plan" in inspect.signature(
    _dflash_info.DFlashVerifyInput.generate_attn_arg_prefill).parameters

# the Triton kernel that gathers a request's KV slots into FlashInfer's paged layout (moved in 0.5.23)
KV_INDICES_KERNEL_MOVED = importlib.util.find_spec("sglang.kernels.ops.attention.kv_indices") is not None
if KV_INDICES_KERNEL_MOVED:
    from sglang.kernels.ops.attention.kv_indices import create_flashinfer_kv_indices_triton  # noqa: F401
else:
    from sglang.kernels.ops.attention.utils import create_flashinfer_kv_indices_triton  # noqa: F401


def sigmoid_mul_cpu_call(source: str) -> str | None:
    """How the model module ``source`` calls ``torch.ops.sgl_kernel.fused_sigmoid_mul_cpu`` (directly or through a
    name bound to it): "in_place" (a statement ``op(x, gate)``), "returning" (a call passing ``inplace=``), None
    for neither or both."""
    op = "fused_sigmoid_mul_cpu"
    tree = ast.parse(source)
    names = {t.id for n in ast.walk(tree) if isinstance(n, ast.Assign) and isinstance(n.value, ast.Attribute)
             and n.value.attr == op for t in n.targets if isinstance(t, ast.Name)}

    def calls_op(node) -> bool:
        f = getattr(node, "func", None)
        return isinstance(node, ast.Call) and (isinstance(f, ast.Name) and f.id in names
                                               or isinstance(f, ast.Attribute) and f.attr == op)

    forms = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Expr) and calls_op(n.value) and len(n.value.args) == 2 and not n.value.keywords:
            forms.add("in_place")
        elif calls_op(n) and any(k.arg == "inplace" for k in n.keywords):
            forms.add("returning")
    return forms.pop() if len(forms) == 1 else None


# how SGLang's CPU Qwen3.5 calls sgl-kernel's fused_sigmoid_mul_cpu (see the module docstring)
_QWEN3_5 = importlib.util.find_spec("sglang.srt.models.qwen3_5")
CPU_SIGMOID_MUL_CALL = sigmoid_mul_cpu_call(Path(_QWEN3_5.origin).read_text()) if _QWEN3_5 is not None else None

# SGLang's KV-location plan (`VERIFY_ARGS_KEYWORD_PLAN`): the id-space enum and the translator methods the adapter
# calls (dotted path -> parameter names; checked with the hooks)
if VERIFY_ARGS_KEYWORD_PLAN:
    from sglang.srt.mem_cache.kv_loc_plan import IdSpaceKind  # noqa: F401

    KV_PLAN_CALLS = {
        "sglang.srt.mem_cache.kv_index_translator.KVIndexTranslator.pack_read_stream": [
            "self", "plan", "req_pool_indices", "seq_lens", "indptr", "out", "kv_start_idx", "kind"],
        "sglang.srt.mem_cache.kv_index_translator.KVIndexTranslator.bind_own_plan": ["self", "forward_batch"],
    }
else:
    KV_PLAN_CALLS = {}

# FlashInfer releases whose split-kv planning rule `kernels.attention_plan` was checked against on a GPU
PLAN_CHECKED_FLASHINFER = ("0.6.15.post1",)

# hooked SGLang functions that moved: dotted path -> parameter names it must take
if SERVER_ARGS_DECLARED:
    DEFAULT_ATTN_BACKEND = ("sglang.srt.arg_groups.model_override_base.get_default_attn_backend",
                            ["server_args", "use_mla_backend", "model_config"])
    CPU_BACKENDS = ("sglang.srt.arg_groups.platform_hook.handle_cpu_backends", ["server_args"])
else:
    DEFAULT_ATTN_BACKEND = ("sglang.srt.server_args.ServerArgs._get_default_attn_backend",
                            ["self", "use_mla_backend", "model_config"])
    CPU_BACKENDS = ("sglang.srt.server_args.ServerArgs._handle_cpu_backends", ["self"])
FREE_KV_ALIGNED_PARAMS = ["self", "kv" if KV_FIELDS_ON_REQ_KV else "pool_idx", "target", "end"]
# SGLang's reserve for its graphs when it sizes --mem-fraction-static itself, which the step graphs' memory is added
# to (`server_args.step_graph_reserve_mb`); None where the step graphs are off (`VERIFY_ARGS_KEYWORD_PLAN`)
GRAPH_RESERVE = None if VERIFY_ARGS_KEYWORD_PLAN else ("sglang.srt.server_args.ServerArgs.reserve_for_graph_mb",
                                                       ["self"])
# the server-argument pass whose Gemma 4 branch refuses torch_native (0.5.17; later releases moved it, and the CPU
# set-up does not lift that check there: `cpu_platform`)
GEMMA4_CHECK = (("sglang.srt.server_args.ServerArgs._handle_model_specific_adjustments", ["self"])
                if hasattr(_server_args.ServerArgs, "_handle_model_specific_adjustments") else None)
WORKER_PARAMS = ["self", "server_args", "gpu_id", *(["ps"] if WORKER_TAKES_PS else []), "nccl_port",
                 "is_draft_worker"]


def version_tuple(version: str) -> tuple[int, ...]:
    """"0.5.23" -> (0, 5, 23) (a pre/post-release suffix of the last part is dropped)."""
    parts = []
    for p in version.split(".")[:3]:
        digits = "".join(ch for ch in p if ch.isdigit()) if not p.isdigit() else p
        parts.append(int(digits or 0))
    return tuple(parts)


def version_problem(version: str | None = None) -> str | None:
    """Why this SGLang ``version`` (default: the installed one) is outside `SUPPORTED_RANGE` (None inside)."""
    version = version or getattr(sglang, "__version__", "unknown")
    lo, hi = SUPPORTED_RANGE
    if version == "unknown" or not version_tuple(lo) <= version_tuple(version) <= version_tuple(hi):
        return f"sglang=={version} installed (supported: {lo} to {hi})"
    return None


# ---- server arguments during start-up resolution ----------------------------------------------------------
def resolving(server_args):
    """What resolution has decided so far for ``server_args`` (read every field through this during resolution),
    SGLang's own decisions for the model included (gpt-oss's attention backend, ...): on 0.5.17 they wait in a stash
    until resolution ends, and the fields still hold what the user typed."""
    if SERVER_ARGS_DECLARED:
        from sglang.srt.arg_groups.model_override_base import resolving_view

        return resolving_view(server_args)
    if DECISIONS_STASHED:
        return _overrides.resolved_view(server_args)
    return server_args


def resolve(server_args, **fields) -> None:
    """Set ``fields`` of ``server_args`` during start-up resolution."""
    if SERVER_ARGS_DECLARED:
        _overrides.declare_resolution(server_args, "sglang_dflash", **fields)
        return
    for name, value in fields.items():
        setattr(server_args, name, value)
    stash = getattr(server_args, "_resolved_overrides", None) if DECISIONS_STASHED else None
    if stash is not None:  # outlast a decision SGLang stashed earlier for the same field
        stash.append(("sglang_dflash", dict(fields)))


def published(server_args):
    """The resolved server arguments after start-up (from 0.5.20 raw fields hold what the user typed)."""
    if SERVER_ARGS_DECLARED:
        return _overrides.resolved_view(server_args)
    return server_args


def model_config(server_args):
    """The target's ModelConfig during start-up resolution."""
    if SERVER_ARGS_DECLARED:
        from sglang.srt.arg_groups.model_override_base import model_config_of

        return model_config_of(server_args)
    return server_args.get_model_config()


# ---- workers -----------------------------------------------------------------------------------------------
def worker_ps(ps) -> dict:
    """The parallel-state keyword of a worker constructor (empty where SGLang takes none)."""
    return {"ps": ps} if WORKER_TAKES_PS else {}


# ---- a request's KV fields -----------------------------------------------------------------------------------
def req_pool_idx(req) -> int:
    return req.kv.req_pool_idx if KV_FIELDS_ON_REQ_KV else req.req_pool_idx


def committed_len(req) -> int:
    return req.kv.kv_committed_len if KV_FIELDS_ON_REQ_KV else req.kv_committed_len


def truncate_kv(cache, req, keep: int) -> None:
    """Free a streaming-session request's KV past ``keep`` tokens and clamp its KV cursors to ``keep``."""
    kv = req.kv
    cache._free_kv_aligned(kv if KV_FIELDS_ON_REQ_KV else req.req_pool_idx, keep, kv.kv_allocated_len)
    kv.kv_allocated_len = min(kv.kv_allocated_len, keep)
    if KV_FIELDS_ON_REQ_KV:
        kv.kv_committed_len = min(kv.kv_committed_len, keep)
        kv.clamp_evicted_seqlens(keep)
    else:
        req.kv_committed_len = min(req.kv_committed_len, keep)
        kv.swa_evicted_seqlen = min(kv.swa_evicted_seqlen, keep)


# ---- the KV-location plan of a hand-built forward batch ----------------------------------------------------
def kv_translator(runner):
    """``runner``'s KVIndexTranslator (None where SGLang has no KV-location plan)."""
    return runner.kv_index_translator if VERIFY_ARGS_KEYWORD_PLAN else None


def bind_kv_plan(translator, forward_batch) -> None:
    """Give ``forward_batch``, built by hand, the plan ``ForwardBatch.init_new`` gives SGLang's own: its
    ``out_cache_loc`` as the write window, its rows and ``seq_lens`` (+ the verify block) as the reads. Call once its
    ``out_cache_loc`` holds the step's slots; nothing to do before `VERIFY_ARGS_KEYWORD_PLAN`."""
    if VERIFY_ARGS_KEYWORD_PLAN:
        translator.bind_own_plan(forward_batch)


# ---- FlashInfer ------------------------------------------------------------------------------------------------
def unchecked_flashinfer() -> str | None:
    """Why the device-side FlashInfer plan must not be used with the installed FlashInfer (None: it was checked)."""
    try:
        version = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "flashinfer-python is not installed"
    if version in PLAN_CHECKED_FLASHINFER:
        return None
    return (f"flashinfer-python {version}: the step graph's device-side plan was checked against "
            f"{', '.join(PLAN_CHECKED_FLASHINFER)} only")
