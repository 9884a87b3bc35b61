"""Route `--speculative-algorithm DFLASH` to sglang-dflash through SGLang's hook registry.

`SGLANG_DFLASH_IMPL` selects the implementation: `sglang_dflash` (default) or
`builtin` (SGLang's own DFLASH, kept selectable for comparison). The installed SGLang
must be in `compat.SUPPORTED_RANGE`, and every SGLang symbol we hook is checked against
the signature `compat` expects of it; otherwise DFLASH is refused with an error naming
the supported range instead of half-working.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

from sglang_dflash.adapter import compat, cpu_platform

logger = logging.getLogger(__name__)

IMPL_ENV = "SGLANG_DFLASH_IMPL"
IMPLS = ("sglang_dflash", "builtin")

# dotted path -> parameter names it must accept (in order, after self)
EXPECTED_SIGNATURES = {
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker": ["self", "server_args"],
    "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.handle_server_args": ["self", "server_args"],
    "sglang.srt.managers.tp_worker.TpModelWorker.__init__": compat.WORKER_PARAMS,
    "sglang.srt.mem_cache.allocation.alloc_token_slots": ["tree_cache", "num_tokens"],
    "sglang.srt.speculative.draft_worker_common.build_draft_tp_worker": [
        "server_args", "gpu_id", "nccl_port", "target_model_config", "algo_label", "attention_backend_override"],
    "sglang.srt.model_executor.model_runner.ModelRunner.forward": ["self", "forward_batch"],
    "sglang.srt.speculative.dflash_utils.validate_dflash_request": ["req", "enable_overlap"],
    "sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding": ["server_args"],
    compat.DEFAULT_ATTN_BACKEND[0]: compat.DEFAULT_ATTN_BACKEND[1],
    "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation": [
        "self", "batch", "forward_batch", "pp_proxy_tensors", "is_verify", "skip_attn_backend_init",
        "capture_hidden_mode"],
    "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch": ["self", "batch", "last_batch"],
    "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture": ["self"],
    "sglang.srt.managers.scheduler.Scheduler.get_internal_state": ["self", "recv_req"],
    "sglang.srt.session.session_controller.Session._concat_token_arrays": ["last_req", "req", "session_params"],
    "sglang.srt.session.streaming_session.StreamingSession._trim_overshoot": ["self", "req", "finished_len"],
    "sglang.srt.session.streaming_session.StreamingSession._free_kv_aligned": compat.FREE_KV_ALIGNED_PARAMS,
    # used (not hooked) by the worker's constrained decoding
    "sglang.srt.speculative.spec_utils.build_grammar_vocab_mask": ["reqs", "tree", "sampling_info", "device", "barrier"],
    "sglang.srt.speculative.spec_utils.GrammarTree.from_linear_chain": ["verify_ids_2d"],
    # used (not hooked) by the whole-step CUDA graphs (step_graphs)
    "sglang.srt.layers.attention.flashinfer_backend.FlashInferAttnBackend.init_forward_metadata_out_graph": [
        "self", "forward_batch", "in_capture"],
    # used (not hooked) by the verify attention's layout and the step's own batches (SGLang 0.5.23+)
    **compat.KV_PLAN_CALLS,
    **({compat.GRAPH_RESERVE[0]: compat.GRAPH_RESERVE[1]} if compat.GRAPH_RESERVE else {}),
    # the CPU set-up's hooks
    **{target: params for target, (_hook, params) in cpu_platform.hooks().items()},
}


@functools.cache
def selected_impl() -> str:
    """`IMPL_ENV`'s choice, read once per process (at plugin load: `install`)."""
    impl = os.environ.get(IMPL_ENV, "sglang_dflash").strip().lower()
    if impl not in IMPLS:
        raise ValueError(f"{IMPL_ENV}={impl!r} is not one of {IMPLS}.")
    return impl


def check_sglang_compat() -> list[str]:
    """Return a list of problems (empty when every hooked symbol matches)."""
    import pkgutil

    problems = []
    version = compat.version_problem()
    if version:
        problems.append(version)
    for path, expected in EXPECTED_SIGNATURES.items():
        try:
            obj = pkgutil.resolve_name(path)
        except (ImportError, AttributeError) as e:
            problems.append(f"{path} missing ({e})")
            continue
        params = list(inspect.signature(obj).parameters)
        if params[: len(expected)] != expected and not set(expected) <= set(params):
            problems.append(f"{path}{inspect.signature(obj)} (expected parameters {expected})")
    return problems


def install() -> bool:
    """Register the DFLASH hooks; False (DFLASH refused, logged) where this SGLang is not one of the supported."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    impl = selected_impl()
    problems = check_sglang_compat()
    if problems:
        lo, hi = compat.SUPPORTED_RANGE
        message = (
            f"sglang-dflash supports SGLang {lo} to {hi}; this SGLang differs: " + "; ".join(problems)
            + f". Install 'sglang>={lo},<={hi}', or set {IMPL_ENV}=builtin to use SGLang's own DFLASH."
        )

        def refuse(original, cls, name):
            if name is not None and name.upper() == "DFLASH" and selected_impl() != "builtin":
                raise RuntimeError(message)
            return original(cls, name)

        HookRegistry.register(
            "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.from_string", refuse, HookType.AROUND
        )
        logger.error(message)
        return False

    HookRegistry.register(
        "sglang.srt.arg_groups.speculative_hook.handle_speculative_decoding", _check_draft_first, HookType.BEFORE
    )
    HookRegistry.register(compat.DEFAULT_ATTN_BACKEND[0], _default_attn_backend, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.handle_server_args",
        _handle_server_args, HookType.AROUND,
    )
    if compat.GRAPH_RESERVE:
        HookRegistry.register(compat.GRAPH_RESERVE[0], _reserve_step_graphs, HookType.AROUND)
    HookRegistry.register(
        "sglang.srt.speculative.spec_info.SpeculativeAlgorithm.create_worker",
        _create_worker, HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.speculative.dflash_utils.validate_dflash_request", _validate_request, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.is_disable_overlap_for_batch", _sync_for_history, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.model_executor.runner.decode_cuda_graph_runner.DecodeCudaGraphRunner.capture",
        _warm_up_without_decode_graphs, HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.managers.scheduler.Scheduler.get_internal_state", _report_verify_widths, HookType.AROUND
    )
    HookRegistry.register(
        "sglang.srt.session.session_controller.Session._concat_token_arrays", _session_history_through_stop,
        HookType.AROUND,
    )
    HookRegistry.register(
        "sglang.srt.session.streaming_session.StreamingSession._trim_overshoot", _streaming_session_keeps_computed_kv,
        HookType.AROUND,
    )
    logger.info("sglang-dflash plugin loaded: DFLASH -> %s (%s=%s)",
                "sglang-dflash" if impl == "sglang_dflash" else "SGLang built-in", IMPL_ENV, impl)
    return True


def _ours(algo) -> bool:
    return algo.is_dflash() and selected_impl() == "sglang_dflash"


def _ours_by_args(server_args) -> bool:
    """`_ours` from raw server args (before SGLang has parsed the algorithm name)."""
    return (server_args.speculative_algorithm or "").upper() == "DFLASH" and selected_impl() == "sglang_dflash"


def _handle_server_args(original, algo, server_args):
    if not _ours(algo):
        return original(algo, server_args)
    from sglang_dflash.adapter import hybrid
    from sglang_dflash.adapter.server_args import resolve_server_args

    resolve_server_args(server_args)
    hybrid.resolve_server_args(server_args)


def _reserve_step_graphs(original, server_args):
    """SGLang's reserve for its graphs (MB, when it sizes --mem-fraction-static itself), and for DFLASH served by
    sglang-dflash the decode step's graphs too (`server_args.step_graph_reserve_mb`)."""
    reserved = original(server_args)
    if not _ours_by_args(server_args):
        return reserved
    from sglang_dflash.adapter.server_args import step_graph_reserve_mb

    return reserved + step_graph_reserve_mb(server_args)


def _default_attn_backend(original, server_args, *args, **kwargs):
    """With no --attention-backend, SGLang picks a default per GPU (fa3 on Hopper); for DFLASH served by
    sglang-dflash, one this worker supports instead (`default_attention_backend`), logged."""
    backend = original(server_args, *args, **kwargs)
    if not _ours_by_args(server_args):
        return backend
    from sglang_dflash.adapter.server_args import default_attention_backend

    model_config = kwargs["model_config"] if "model_config" in kwargs else args[1]
    chosen = default_attention_backend(server_args, backend, bool(getattr(model_config, "has_attention_sinks", False)))
    if chosen != backend:
        logger.info("sglang-dflash: no --attention-backend given and SGLang's default here (%s) is not one "
                    "sglang-dflash serves DFLASH with; using %s.", backend, chosen)
    return chosen


def _check_draft_first(server_args):
    """Before SGLang reads the draft's config (it would fail with a generic message), check it is a DFlash draft."""
    if _ours_by_args(server_args):
        from sglang_dflash.adapter.server_args import load_draft_config

        load_draft_config(server_args)


def _create_worker(original, algo, server_args):
    if not _ours(algo):
        return original(algo, server_args)
    from sglang_dflash.adapter.worker import DFlashWorker

    return DFlashWorker


@functools.cache
def _serving_dflash() -> bool:
    """True in a scheduler process of a server whose DFLASH is ours (decided once per process: the hooks that ask
    run on every scheduler iteration)."""
    from sglang.srt.runtime_context import get_spec

    algo = get_spec().speculative_algorithm
    return str(getattr(algo, "name", algo) or "").upper() == "DFLASH" and selected_impl() == "sglang_dflash"


def _warm_up_without_decode_graphs(original, runner):
    """SGLang's decode-mode graphs of the DFLASH runners (the target's verify, the draft's) are never replayed: the
    decode step calls the models itself (`step`, captured by `step_graphs`). Only the runner's one-time kernel
    warm-up runs (workspaces, autotune); the runner keeps its batch sizes and attention graph state, which
    `step_graphs` uses."""
    if not _serving_dflash():
        return original(runner)
    runner.warmup()
    logger.info("sglang-dflash: SGLang's %s decode graphs not captured (the DFLASH decode step does not replay them)",
                "draft" if runner.model_runner.is_draft_worker else "target")


def _sync_for_history(original, scheduler, batch, last_batch):
    """Under the overlap schedule a decode step is launched before the previous step's result is applied, so the
    requests' output ids (and grammar states) lag one step. A DFLASH batch whose verify logits depend on them
    (penalties, min_new_tokens, custom logit processors, grammars: `sampling.reads_output_history`) has that result
    applied first, as SGLang does for its own grammar sync."""
    sync = original(scheduler, batch, last_batch)
    if sync or batch is None or not batch.forward_mode.is_decode() or not _serving_dflash():
        return sync
    from sglang_dflash.adapter.sampling import reads_output_history

    return reads_output_history(batch)


def _report_verify_widths(original, scheduler, recv_req):
    """``/get_server_info``'s ``internal_states`` of a DFLASH server served here carry ``dflash_verify_widths``
    (`widths.StepWidths.report`: the candidate widths and decode steps per width)."""
    out = original(scheduler, recv_req)
    if _serving_dflash():
        out.internal_state["dflash_verify_widths"] = scheduler.draft_worker.widths.report()
    return out


def _session_history_through_stop(original, last_req, req, session_params):
    """A (non-streaming) session turn continues from the previous turn's reply, i.e. its output through the stop.
    One DFLASH step can commit tokens past a stop (the rest of its accepted block): SGLang cuts them from the
    reply (``finished_len``) and, in streaming sessions, from the request, but this history took them along, so
    the next turn saw tokens the client never did. Cut them here first."""
    end = last_req.finished_len
    if end is not None and len(last_req.output_ids) > end and _serving_dflash():
        del last_req.output_ids[end:]
    return original(last_req, req, session_params)


def _streaming_session_keeps_computed_kv(original, cache, req, finished_len):
    """A streaming session keeps a finished turn's KV for the next turn, up to the end of its output. The last
    output token of a DFLASH turn is the bonus of its last verify step, whose KV was never computed (its slot holds
    the rejected draft's, or nothing): keep one token less, so that the next turn's prefill computes it, as a
    no-spec turn leaves it."""
    original(cache, req, finished_len)
    if finished_len > 0 and _serving_dflash():
        compat.truncate_kv(cache, req, len(req.origin_input_ids) + finished_len - 1)


# Requests whose logits the verify step cannot reproduce are refused up front (with the reason) rather than
# sampled from the wrong law. Served: penalties, logit_bias, min_new_tokens, grammars and custom logit processors,
# each per block position (sampling.BlockSampler.accept).
# return_logprob is served: prompt logprobs by the target's prefill, decode logprobs by BlockSampler.attach_logprobs.


def request_error(req) -> str | None:
    """Why sglang-dflash cannot serve `req` exactly (None when it can)."""
    fix = "Drop it, or serve without --speculative-algorithm DFLASH."
    if getattr(req, "return_hidden_states", False):
        return f"sglang-dflash: return_hidden_states is not supported with DFLASH. {fix}"
    return None


def _validate_request(original, req, enable_overlap):
    if selected_impl() != "sglang_dflash":
        return original(req, enable_overlap)
    return request_error(req)
