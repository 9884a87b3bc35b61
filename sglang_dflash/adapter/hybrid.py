"""Hybrid targets: models whose layers mix full attention with a recurrent state (Gated DeltaNet / Mamba), e.g.
Qwen3.5 (``qwen3_5``) and Qwen3-Next (``qwen3_next``).

A linear-attention layer keeps one state per request instead of per-token K/V. A verify forward of a block of B
tokens runs with SGLang's hybrid backend in TARGET_VERIFY mode, which leaves the request's state untouched (the
conv state is rolled over the whole block) and records the state after every block position in the pool's scratch
(``intermediate_ssm`` / ``intermediate_conv_window``, row i = the i-th request of the batch). Once the accept is
known, `commit_verified_states` makes the state of each request the one after its committed tokens: the bonus and
its ``a`` accepted drafts, i.e. block position ``a`` (0 .. B-1); the same whether the step ran eagerly or as a
captured graph (`GraphStates`: the graph's own linear-attention metadata). Everything else SGLang does for these
models as for any other: the prefill (chunked or not) advances the state itself, the radix cache (``no_buffer``)
stores a request's state with its committed tokens (``kv_committed_len``: the bonus of the last step is not among
them, and neither is it in the state), a retracted request is prefilled again.

Start-up (`resolve_server_args`, in the launcher): SGLang sizes the state pool with the scratch of
``max_running_requests`` verify blocks, so that number must be known (SGLang's own DFLASH sets 48; so does this
one, logged). The radix cache's ``extra_buffer`` strategies (SGLang's automatic choice for some architectures, e.g.
Qwen3-Next and Qwen3.5, under the overlap schedule) track states at intervals along a verify, which this worker does
not do: left to SGLang, the strategy becomes ``no_buffer`` with the synchronous scheduler (SGLang's own choice for
the other hybrid architectures), logged; asked for by the user, it is refused with the fix.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DEFAULT_MAX_RUNNING_REQUESTS = 48  # SGLang's own for speculative decoding
EXTRA_BUFFER = ("extra_buffer", "extra_buffer_lazy")  # radix-cache strategies with state checkpoints along a verify


def target_state_config(model_config):
    """The target's linear-attention state config (SGLang's ``mambaish_config``), None for a pure-attention one."""
    from sglang.srt.configs.hybrid_arch import mambaish_config

    return mambaish_config(model_config)


def resolve_server_args(raw_args) -> None:
    """Launcher-side settings for a hybrid target (nothing for others): ``max_running_requests``; a radix-cache
    strategy this worker cannot serve is refused naming it and the fix (`check_state_strategy`)."""
    from sglang_dflash.adapter import compat

    server_args = compat.resolving(raw_args)
    model_config = compat.model_config(server_args)
    if target_state_config(model_config) is None:
        return
    from sglang.srt.arg_groups.overrides import resolved_view

    arch = model_config.hf_config.architectures[0]
    if server_args.max_running_requests is None:
        compat.resolve(raw_args, max_running_requests=DEFAULT_MAX_RUNNING_REQUESTS)
        logger.info("sglang-dflash: hybrid target %s: --max-running-requests %d (SGLang sizes the linear-attention "
                    "state pool, with one verify block of scratch per request, from it); pass the flag to choose.",
                    arch, DEFAULT_MAX_RUNNING_REQUESTS)
    view = resolved_view(raw_args)
    if (raw_args.mamba_radix_cache_strategy == "auto" and not view.disable_radix_cache
            and view.mamba_radix_cache_strategy in EXTRA_BUFFER):
        compat.resolve(raw_args, mamba_radix_cache_strategy="no_buffer", disable_overlap_schedule=True)
        logger.info("sglang-dflash: hybrid target %s: --mamba-radix-cache-strategy no_buffer with the synchronous "
                    "scheduler (the extra_buffer strategy's state checkpoints along a verify block are not tracked); "
                    "--disable-radix-cache keeps the overlap schedule instead.", arch)
    check_state_strategy(resolved_view(raw_args), arch)


def check_state_strategy(server_args, arch: str) -> None:
    """Refuse the radix cache's ``extra_buffer`` state strategies (``server_args`` or SGLang's resolved view of
    them): their state checkpoints along a verify block are not tracked by this worker."""
    from sglang_dflash.adapter.server_args import _fail

    strategy = server_args.mamba_radix_cache_strategy
    if strategy in EXTRA_BUFFER and not server_args.disable_radix_cache:
        _fail(f"--mamba-radix-cache-strategy {strategy} is not supported with DFLASH on {arch}: its state "
              "checkpoints along a verify block are not tracked",
              "Pass --mamba-radix-cache-strategy no_buffer --disable-overlap-schedule, or --disable-radix-cache.")


def commit_verified_states(caches, state_indices: torch.Tensor, steps: torch.Tensor) -> None:
    """Make each request's linear-attention state the one after block position ``steps[i]``.

    ``caches``: the pool's ``MambaPool.SpeculativeState`` over all its layers: ``temporal`` ``[L, slots, ...]``,
    ``intermediate_ssm`` ``[L, rows, B, ...]``, ``conv`` / ``intermediate_conv_window`` lists of
    ``[L, slots, dim, W-1]`` / ``[L, rows, B, dim, W-1]``. ``state_indices`` ``[bs]``: request i's state slot (its
    scratch row is i); ``steps`` ``[bs]`` int64 in ``0 .. B-1``. No host synchronisation."""
    rows = torch.arange(steps.shape[0], device=steps.device)
    slots = state_indices.to(torch.int64)
    caches.temporal[:, slots] = caches.intermediate_ssm[:, rows, steps].to(caches.temporal.dtype)
    for conv, windows in zip(caches.conv, caches.intermediate_conv_window):
        conv[:, slots] = windows[:, rows, steps].to(conv.dtype)


class StateCommit:
    """Commits the verify states of a hybrid target after each accept (`commit_verified_states`). A request's state
    slot is read from its request-pool row, as SGLang's linear-attention backend plans it (`state_slots`), so an
    eager step and a replayed step graph commit alike."""

    def __init__(self, target_backend):
        self.pool = target_backend.linear_attn_backend.req_to_token_pool

    def __call__(self, accept_lens: torch.Tensor, req_pool_indices: torch.Tensor) -> None:
        """``accept_lens`` ``[bs]``: accepted drafts per request (the state after block position accept_lens[i]);
        ``req_pool_indices`` ``[bs]``: the requests' pool rows."""
        commit_verified_states(self.pool.get_speculative_mamba2_params_all_layers(),
                               state_slots(self.pool, req_pool_indices), accept_lens.to(torch.int64))


def full_attention_backend(backend):
    """The backend of a runner's full-attention layers: a hybrid target's ``HybridLinearAttnBackend`` child
    (``full_attn_backend``), else ``backend`` itself."""
    return getattr(backend, "full_attn_backend", backend)


def state_slots(pool, req_pool_indices: torch.Tensor) -> torch.Tensor:
    """``[bs]`` the linear-attention state slots of the requests at ``req_pool_indices`` (physical ids, as the
    kernels read them; SGLang's ``HybridReqToTokenPool``)."""
    return pool.translate_mamba_indices(pool.get_mamba_indices(req_pool_indices))


class GraphStates:
    """The linear-attention metadata of a captured decode step (`step_graphs`): the verify's query offsets (fixed
    by batch size and width) and the state slot of each row, written on the device inside the graph from the
    request-pool rows (padded rows -1, which SGLang's kernels skip). The graph's own buffers, so it shares none
    with SGLang's per-runner graphs."""

    def __init__(self, target_backend, qo_indptr: torch.Tensor, bs: int, width: int):
        """``qo_indptr`` int32 ``[>= bs + 1]``: ``arange(0, .., width)``."""
        from sglang.srt.layers.attention.mamba.mamba2_metadata import ForwardMetadata

        self.linear_backend = target_backend.linear_attn_backend
        self.pool = self.linear_backend.req_to_token_pool
        slots = torch.full((bs,), -1, dtype=torch.int32, device=qo_indptr.device)
        self.metadata = ForwardMetadata(query_start_loc=qo_indptr[: bs + 1], mamba_cache_indices=slots,
                                        is_target_verify=True, draft_token_num=width)

    def install(self) -> None:
        """Make this graph's metadata the one the target's linear-attention layers read (before warm-up and
        capture)."""
        self.linear_backend.forward_metadata = self.metadata

    def write(self, req_pool_indices: torch.Tensor, valid: torch.Tensor) -> None:
        """In the graph: ``req_pool_indices`` ``[bs]`` int64, ``valid`` ``[bs]`` bool (False: a padded row)."""
        slots = state_slots(self.pool, req_pool_indices).to(torch.int32)
        self.metadata.mamba_cache_indices.copy_(torch.where(valid, slots, -1))


def state_commit(target_runner) -> StateCommit | None:
    """A `StateCommit` for a hybrid target runner, None for a pure-attention one. A hybrid target whose backend
    does not keep per-position verify states cannot be served, and is refused."""
    if target_state_config(target_runner.model_config) is None:
        return None
    check_state_strategy(target_runner.server_args, target_runner.model_config.hf_config.architectures[0])
    backend = target_runner.attn_backend
    linear = getattr(backend, "linear_attn_backend", None)
    pool = getattr(linear, "req_to_token_pool", None)
    if linear is None or not hasattr(pool, "get_speculative_mamba2_params_all_layers"):
        raise ValueError(f"sglang-dflash: the hybrid target's attention backend {type(backend).__name__} keeps no "
                         "per-position linear-attention states for verification. Serve this target without "
                         "--speculative-algorithm DFLASH.")
    caches = pool.get_speculative_mamba2_params_all_layers()
    if getattr(caches, "intermediate_ssm", None) is None:
        raise ValueError("sglang-dflash: the linear-attention state pool has no verify scratch (intermediate_ssm; "
                         "--enable-linear-replayssm-spec drops it). Remove --enable-linear-replayssm-spec.")
    return StateCommit(backend)


def add_dflash_capture(target) -> None:
    """SGLang 0.5.17's text-only Qwen3.5 classes (``qwen3_5_text``: ``Qwen3_5ForCausalLM``,
    ``Qwen3_5MoeForCausalLM``) wrap a body that captures layer inputs but expose no ``set_dflash_layers_to_capture``;
    give such an instance the method SGLang's other Qwen3.5/Qwen3-Next wrappers have (layer i's output is the
    input of layer i + 1; the wrapper returns the captured states with the logits)."""
    body = getattr(target, "model", None)
    if type(target).__module__ != "sglang.srt.models.qwen3_5_text" or hasattr(target, "set_dflash_layers_to_capture"):
        return

    def set_dflash_layers_to_capture(layer_ids: list[int]) -> None:
        target.capture_aux_hidden_states = True
        body.set_dflash_layers_to_capture([i + 1 for i in layer_ids])

    target.set_dflash_layers_to_capture = set_dflash_layers_to_capture
