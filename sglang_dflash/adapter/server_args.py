"""Server-argument resolution for DFLASH served by sglang-dflash (runs in the launcher)."""

from __future__ import annotations

import logging

from sglang_dflash.adapter import compat
from sglang_dflash.adapter.tp import check_draft_divides
from sglang_dflash.config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE, DFlashConfigError, DFlashDraftConfig
from sglang_dflash.policy import AdaptiveConfig, PolicyConfigError, possible_widths

logger = logging.getLogger(__name__)

_SUPPORTED_BACKENDS = ("flashinfer", "triton", "torch_native")
# SGLang features that DFLASH served by sglang-dflash does not implement (field, flag; refused when set; a field this
# SGLang lacks is skipped)
_UNSERVED_FEATURES = (
    ("enable_unified_memory", "--enable-unified-memory"),
    ("speculative_use_block_verification", "--speculative-use-block-verification"),
    ("speculative_draft_sink_size", "--speculative-draft-sink-size"),
    ("speculative_draft_kv_cache_dtype", "--speculative-draft-kv-cache-dtype"),
)


def _fail(problem: str, fix: str):
    raise ValueError(f"sglang-dflash: {problem}. {fix}")


def load_draft_config(server_args) -> DFlashDraftConfig:
    """The draft's DFlashDraftConfig, or a clear error naming the problem and the fix."""
    if server_args.speculative_draft_model_path is None:
        _fail("--speculative-algorithm DFLASH needs a draft model",
              "Add --speculative-draft-model-path DIR (a z-lab format DFlash draft).")
    try:
        return DFlashDraftConfig.from_pretrained(server_args.speculative_draft_model_path,
                                                 server_args.speculative_draft_model_revision)
    except (DFlashConfigError, OSError) as e:
        raise ValueError(f"sglang-dflash: cannot use draft {server_args.speculative_draft_model_path!r}: {e}") from e


def default_attention_backend(server_args, sglang_choice: str | None, attention_sinks: bool = False) -> str:
    """The attention backend DFLASH runs with when the user chose none: SGLang's choice (its default, or the one it
    picks for the model) where sglang-dflash serves it; otherwise (fa3 on Hopper, trtllm_mha / fa4 on Blackwell,
    aiter on ROCm, intel_amx on x86 CPUs) torch_native on CPU, triton for a target with ``attention_sinks`` (gpt-oss:
    FlashInfer has none) or without FlashInfer, else flashinfer."""
    if sglang_choice in _SUPPORTED_BACKENDS:
        return sglang_choice
    if _on_cpu(server_args):
        return "torch_native"
    from sglang.srt.utils import is_flashinfer_available, is_hip

    return "flashinfer" if is_flashinfer_available() and not is_hip() and not attention_sinks else "triton"


def attention_sinks(server_args) -> bool:
    """Whether the target has attention sinks (SGLang's ModelConfig: gpt-oss, some MiMo-V2)."""
    return bool(getattr(compat.model_config(server_args), "has_attention_sinks", False))


def block_size(server_args, dcfg: DFlashDraftConfig) -> int:
    """The block size served: --speculative-dflash-block-size or --speculative-num-draft-tokens, else the draft's."""
    block = server_args.speculative_dflash_block_size or server_args.speculative_num_draft_tokens
    if (server_args.speculative_dflash_block_size and server_args.speculative_num_draft_tokens
            and server_args.speculative_dflash_block_size != server_args.speculative_num_draft_tokens):
        _fail("--speculative-dflash-block-size and --speculative-num-draft-tokens differ", "Pass only one of them.")
    block = int(block or dcfg.block_size)
    if not MIN_BLOCK_SIZE <= block <= MAX_BLOCK_SIZE:
        _fail(f"block size {block} is out of range [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}]",
              "Pass --speculative-dflash-block-size within that range.")
    return block


def adaptive_config(server_args, block: int) -> AdaptiveConfig:
    """--speculative-adaptive-config for ``block``, or a clear error."""
    try:
        return AdaptiveConfig.parse(server_args.speculative_adaptive_config, block)
    except PolicyConfigError as e:
        raise ValueError(f"sglang-dflash: {e}") from None


def step_graph_reserve_mb(raw_args) -> float:
    """GPU memory (MB) for the decode step's CUDA graphs (`step_graphs.capture_bytes`), which SGLang's own reserve
    (the memory it leaves outside --mem-fraction-static when it sizes that fraction itself) does not count; logged.
    0 where the step is not captured (CPU, decode CUDA graphs off, an attention backend other than FlashInfer)."""
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_dflash.adapter import step_graphs

    server_args = compat.resolving(raw_args)
    decode = server_args.cuda_graph_config.decode
    if _on_cpu(server_args) or server_args.speculative_draft_model_path is None or decode.backend == Backend.DISABLED:
        return 0.0
    # SGLang settles the attention backend after sizing memory: the one DFLASH will run on unless SGLang's default
    # there is another one sglang-dflash serves (triton on a GPU without FlashInfer: no step graphs, nothing reserved)
    backend = raw_args.attention_backend or default_attention_backend(server_args, None, attention_sinks(server_args))
    if backend != "flashinfer":
        return 0.0
    dcfg = load_draft_config(server_args)
    block = block_size(server_args, dcfg)
    adaptive = adaptive_config(server_args, block)
    widths = possible_widths(adaptive.widths, adaptive.max_batch_size)
    sizes = list(decode.bs)  # SGLang's decode runners capture these (before a clamp to the request pool): the step too
    nbytes = step_graphs.capture_bytes(sizes, widths, block, dcfg.vocab_size, dcfg.num_target_layers,
                                       adaptive.max_batch_size)
    logger.info("sglang-dflash: %.1f GB of GPU memory kept outside --mem-fraction-static for the decode step's CUDA "
                "graphs (batch sizes up to %d x verify widths %s)", nbytes / 1e9, max(sizes), widths)
    return nbytes / (1 << 20)


def resolve_server_args(raw_args) -> None:
    """Validate flags and the draft checkpoint; fix block size, steps and scheduling mode (``raw_args``: the
    ServerArgs being resolved; read through `compat.resolving`, written through `compat.resolve`)."""
    server_args = compat.resolving(raw_args)
    dcfg = load_draft_config(server_args)

    if server_args.pp_size != 1:
        _fail(f"pipeline parallelism (--pp-size {server_args.pp_size}) is not supported (the draft needs the target "
              "hidden states of layers on every stage)", "Use --pp-size 1 with tensor parallelism (--tp-size N) "
              "instead, and --dp-size M for replicas.")
    check_draft_divides(dcfg, server_args.tp_size)
    if (server_args.disaggregation_mode or "null") != "null":
        _fail(f"--disaggregation-mode {server_args.disaggregation_mode} is not supported (the draft KV of the prompt "
              "is not transferred with the target's)", "Serve DFLASH without prefill/decode disaggregation.")
    # DP attention: --enable-dp-attention, or from SGLang 0.5.23 --attn-dp-size N (the old spelling resolves to it
    # before this runs)
    if server_args.enable_dp_attention or (getattr(server_args, "attn_dp_size", None) or 1) > 1:
        _fail("data-parallel attention (--enable-dp-attention / --attn-dp-size) is not supported",
              "Remove the flag; --dp-size M alone serves M replicas, each sharded over --tp-size N.")
    if raw_args.page_size not in (None, 1):
        _fail(f"--page-size {raw_args.page_size} is not supported", "Use --page-size 1.")
    if server_args.page_size not in (None, 1):  # SGLang's choice for the model or its backend
        logger.info("sglang-dflash: page size 1 instead of the %d SGLang picks here (DFLASH served by sglang-dflash "
                    "keeps the draft KV at the target's token slots, page size 1)", server_args.page_size)
        compat.resolve(raw_args, page_size=1)
    if server_args.speculative_draft_window_size is not None:
        _fail("--speculative-draft-window-size is not supported", "Remove the flag.")
    if server_args.enable_lora or server_args.lora_paths:
        _fail("LoRA adapters (--enable-lora / --lora-paths) are not applied by the DFLASH verify forward",
              "Serve LoRA adapters without --speculative-algorithm DFLASH.")
    for field, flag in _UNSERVED_FEATURES:
        if getattr(server_args, field, None) not in (None, False):
            _fail(f"{flag} is not supported by DFLASH served by sglang-dflash", f"Remove {flag}.")
    backend = raw_args.attention_backend  # what the user typed
    if backend is not None and backend not in _SUPPORTED_BACKENDS:
        _fail(f"--attention-backend {backend} is not supported", f"Use one of {_SUPPORTED_BACKENDS}.")
    chosen = server_args.attention_backend  # and SGLang's choice for the model (gpt-oss: fa3 on Hopper)
    if backend is None and chosen is not None and chosen not in _SUPPORTED_BACKENDS:
        ours = default_attention_backend(server_args, chosen, attention_sinks(server_args))
        logger.info("sglang-dflash: SGLang picks the %s attention backend for this model here, which sglang-dflash "
                    "does not serve DFLASH with; using %s (--attention-backend chooses).", chosen, ours)
        compat.resolve(raw_args, attention_backend=ours)
    if server_args.speculative_eagle_topk not in (None, 1) or server_args.speculative_num_steps not in (None, 1):
        _fail("DFLASH verifies one linear block: --speculative-eagle-topk/--speculative-num-steps must be 1",
              "Remove those flags.")

    block = block_size(server_args, dcfg)
    if server_args.speculative_adaptive:
        logger.info("sglang-dflash: --speculative-adaptive is SGLang's EAGLE switch; DFLASH served by sglang-dflash "
                    "chooses its verify width per step unless --speculative-adaptive-config says otherwise")
        compat.resolve(raw_args, speculative_adaptive=False)
    adaptive = adaptive_config(server_args, block)
    logger.info("sglang-dflash: verify widths %s (%s)", list(adaptive.widths),
                "chosen per step" if len(adaptive.widths) > 1 else "fixed")
    if block > dcfg.block_size:
        logger.warning("sglang-dflash: block size %d exceeds the %d the draft was trained with.", block,
                       dcfg.block_size)

    compat.resolve(raw_args, speculative_num_steps=1, speculative_eagle_topk=1, speculative_num_draft_tokens=block,
                   speculative_dflash_block_size=block)
    synchronous_where_overlap_cannot_run(raw_args)


def synchronous_where_overlap_cannot_run(raw_args) -> None:
    """DFLASH where SGLang's overlap schedule cannot run (`overlap_supported`) gets the synchronous scheduler, logged:
    here, and on a CPU host earlier (`cpu_platform.dflash_synchronous_scheduler`)."""
    server_args = compat.resolving(raw_args)
    if server_args.disable_overlap_schedule or overlap_supported(server_args):
        return
    logger.info("sglang-dflash: SGLang's overlap schedule needs CUDA streams; DFLASH on %s runs the synchronous "
                "scheduler.", server_args.device)
    compat.resolve(raw_args, disable_overlap_schedule=True)


def overlap_supported(server_args) -> bool:
    """SGLang's overlap schedule (the host prepares step N+1 while the device runs step N) runs on CUDA. On CPU its
    FutureMap records tensors on streams, which torch does not support there."""
    return not _on_cpu(server_args)


def _on_cpu(server_args) -> bool:
    """DFLASH is served on CPU (``--device cpu``; SGLang's default device is CUDA)."""
    return (server_args.device or "cuda") == "cpu"
