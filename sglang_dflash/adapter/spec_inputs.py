"""Per-batch speculative state that SGLang's scheduler carries between DFLASH steps.

`DFlashDraftState` rides on `ScheduleBatch.spec_info` between steps: the bonus token
of every request (committed, but its KV not yet written) and the KV reservation the
scheduler made for the next verify block. Under SGLang's overlap schedule the bonus
tokens and committed lengths travel through the scheduler's FutureMap instead
(`future_indices` set): the next step reads them from there once they exist on the
device. `DFlashBlockInput` is the `spec_info` of the two per-step forwards (draft block,
target verify): both are linear blocks of `block_size` tokens per request appended
after `seq_lens` committed tokens. `decode_result` / `prefill_result` / `idle_result`:
what the worker hands the scheduler, the next step's `DFlashDraftState` included.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import numpy as np
import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.mem_cache.allocation import alloc_token_slots
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.speculative.spec_info import SpecInput, SpecInputType

from sglang_dflash.adapter import compat
from sglang_dflash.adapter.compat import committed_len, create_flashinfer_kv_indices_triton, req_pool_idx


@dataclass
class DFlashDraftState(SpecInput):
    """Carried state: `bonus_tokens [bs]` (int64), one per request. `future_indices [bs]` (overlap schedule):
    the FutureMap rows the scheduler resolves `bonus_tokens` and `seq_lens` from before the next step."""

    bonus_tokens: torch.Tensor
    block_size: int
    future_indices: Optional[torch.Tensor] = None
    # FutureMap relay fields of other algorithms (EAGLE's top-k, hidden states); DFLASH relays the bonus only
    topk_p: Optional[torch.Tensor] = None
    topk_index: Optional[torch.Tensor] = None
    hidden_states: Optional[torch.Tensor] = None

    def __post_init__(self):
        super().__init__(spec_input_type=SpecInputType.DFLASH_DRAFT)
        self.num_tokens_per_req = 1
        self.num_tokens_for_logprob_per_req = 1

    def prepare_for_decode(self, batch) -> None:
        """Reserve KV slots so `req_to_token[r, seq_len : seq_len + block_size]` exist.

        Each request keeps two blocks of headroom past its committed length (so a step
        never allocates inside the forward; two, because under SGLang's overlap schedule
        the committed length seen here lags the running step's by up to a block, and the
        next block starts after it), capped at its `req_to_token` row: near the
        context limit only the one block the step needs fits there (SGLang sizes rows to
        context length + 4 + block_size). When a request falls below that, every request
        below three blocks is topped up to three in the same allocation, if the pool has
        the slots free (else only the two SGLang's `check_decode_mem` counted on): the
        reservation then runs once every few steps, not every step, and its host work
        (allocation, index copy, `req_to_token` write) with it. Slots a request does not
        commit stay reserved to it and are released with the request.
        """
        bs = batch.batch_size()
        if bs == 0:
            return
        row_width = batch.req_to_token_pool.req_to_token.shape[1]
        # numpy on the host: this runs every step, and numpy's small-array ops cost a fraction of torch's
        committed = np.fromiter((int(committed_len(r)) for r in batch.reqs), dtype=np.int64, count=bs)
        allocated = np.fromiter((int(r.kv.kv_allocated_len) for r in batch.reqs), dtype=np.int64, count=bs)

        def headroom(blocks: int) -> np.ndarray:  # allocated lengths ``blocks`` blocks past the committed ones
            return np.maximum(allocated, np.minimum(committed + blocks * self.block_size, row_width))

        reserved = headroom(2)
        if (reserved > allocated).any():
            ahead = headroom(3)
            if int((ahead - allocated).sum()) <= batch.token_to_kv_pool_allocator.available_size():
                reserved = ahead
            need = reserved - allocated
            total = int(need.sum())
            slots = alloc_token_slots(batch.tree_cache, total)
            # rows/cols of req_to_token[req_pool_idx, allocated : reserved] for every request, built on the host
            # from the requests' own indices (no device read)
            rows = np.repeat(np.fromiter((req_pool_idx(r) for r in batch.reqs), dtype=np.int64, count=bs), need)
            cols = np.arange(total) + np.repeat(allocated - (np.cumsum(need) - need), need)
            req_to_token = batch.req_to_token_pool.req_to_token
            index = host_to_device(torch.from_numpy(np.stack([rows, cols])), req_to_token.device)
            req_to_token[index[0], index[1]] = slots.to(req_to_token.dtype)
            for req, n in zip(batch.reqs, reserved.tolist()):
                req.kv.kv_allocated_len = n
        batch.seq_lens_cpu = torch.from_numpy(committed)
        batch.seq_lens_sum = int(committed.sum())

    def filter_batch(self, new_indices: torch.Tensor, new_indices_cpu: Optional[List[int]] = None):
        if self.future_indices is not None:  # the bonus tokens are resolved from these rows
            self.future_indices = self.future_indices[new_indices]
            return
        self.bonus_tokens = self.bonus_tokens[new_indices]

    def merge_batch(self, other: "DFlashDraftState"):
        if self.future_indices is not None or other.future_indices is not None:
            if self.future_indices is None or other.future_indices is None:
                raise RuntimeError("sglang-dflash: merging a batch relayed through the FutureMap with one that is not")
            self.future_indices = torch.cat([self.future_indices, other.future_indices])
            return
        self.bonus_tokens = torch.cat([self.bonus_tokens, other.bonus_tokens])


@dataclass
class DFlashBlockInput(SpecInput):
    """`spec_info` of a TARGET_VERIFY-mode forward over one linear block per request.

    Used for both the draft forward (its ENCODER_ONLY layers make the block
    bidirectional) and the target verify (causal: no custom mask, no tree).
    `draft_token [bs * block_size]`, `positions [bs * block_size]`.
    """

    draft_token: torch.Tensor
    positions: torch.Tensor
    draft_token_num: int
    capture_hidden_mode: CaptureHiddenMode = CaptureHiddenMode.FULL
    topk: int = 1
    custom_mask: Optional[torch.Tensor] = None

    def __post_init__(self):
        super().__init__(spec_input_type=SpecInputType.DFLASH_VERIFY)
        self.num_tokens_per_req = int(self.draft_token_num)
        self.num_tokens_for_logprob_per_req = int(self.draft_token_num)

    # FlashInfer's paged layout of the blocks: what its verify attention reads (request i: its committed prefix,
    # then the block). One form per SGLang release (`compat.VERIFY_ARGS_KEYWORD_PLAN`), chosen here once.
    if compat.VERIFY_ARGS_KEYWORD_PLAN:
        def generate_attn_arg_prefill(self, *, req_pool_indices: torch.Tensor, paged_kernel_lens: torch.Tensor,
                                      paged_kernel_lens_sum: int, translator, plan,
                                      kv_start_idx: Optional[torch.Tensor] = None,
                                      kv_indices_buf: Optional[torch.Tensor] = None,
                                      kind=compat.IdSpaceKind.FULL):
            """-> (kv_indices, kv_indptr ``[bs + 1]``, qo_indptr ``[bs + 1]``, None), int32. Request i reads its
            ``paged_kernel_lens[i]`` committed tokens from ``kv_start_idx[i]`` (0: None), then the block, as
            ``translator`` reads the ``kind`` sub-pool under ``plan``; kv_indices: ``kv_indices_buf`` when given,
            else ``paged_kernel_lens_sum + bs * block`` long."""
            B = self.draft_token_num
            bs = req_pool_indices.shape[0]
            kv_indptr = torch.empty((bs + 1,), dtype=torch.int32, device=req_pool_indices.device)
            kv_lens = block_kv_indptr(paged_kernel_lens, B, kv_indptr)
            kv_indices = kv_indices_buf if kv_indices_buf is not None else torch.empty(
                paged_kernel_lens_sum + B * bs, dtype=torch.int32, device=req_pool_indices.device)
            translator.pack_read_stream(plan, req_pool_indices=req_pool_indices, seq_lens=kv_lens, indptr=kv_indptr,
                                        out=kv_indices, kv_start_idx=kv_start_idx, kind=kind)
            return kv_indices, kv_indptr, block_qo_indptr(bs, B, req_pool_indices.device), None
    else:
        def generate_attn_arg_prefill(self, req_pool_indices: torch.Tensor, paged_kernel_lens: torch.Tensor,
                                      paged_kernel_lens_sum: int, req_to_token: torch.Tensor,
                                      kv_start_idx: Optional[torch.Tensor] = None):
            """-> (kv_indices, kv_indptr ``[bs + 1]``, qo_indptr ``[bs + 1]``, None), int32: `write_block_kv_layout`
            of the rows ``req_pool_indices`` of ``req_to_token``; kv_indices ``paged_kernel_lens_sum + bs * block``
            long."""
            B = self.draft_token_num
            bs = req_pool_indices.shape[0]
            device = req_pool_indices.device
            kv_indptr = torch.empty((bs + 1,), dtype=torch.int32, device=device)
            kv_indices = torch.empty(paged_kernel_lens_sum + B * bs, dtype=torch.int32, device=device)
            write_block_kv_layout(req_to_token, req_pool_indices, paged_kernel_lens, B, kv_indptr, kv_indices,
                                  kv_start_idx)
            return kv_indices, kv_indptr, block_qo_indptr(bs, B, device), None


def block_qo_indptr(bs: int, block_size: int, device) -> torch.Tensor:
    """qo_indptr ``[bs + 1]`` int32 of ``block_size`` queries per request."""
    return torch.arange(0, (bs + 1) * block_size, block_size, dtype=torch.int32, device=device)


def block_kv_indptr(prefix_lens: torch.Tensor, block_size: int, kv_indptr: torch.Tensor) -> torch.Tensor:
    """Write kv_indptr ``[bs + 1]`` int32 of request i reading ``prefix_lens[i] + block_size`` keys (in place, no host
    sync); return those lengths ``[bs]``."""
    bs = prefix_lens.shape[0]
    kv_lens = prefix_lens + block_size
    kv_indptr[:1].zero_()
    torch.cumsum(kv_lens, dim=0, dtype=torch.int32, out=kv_indptr[1 : bs + 1])
    return kv_lens


def write_block_kv_layout(req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, prefix_lens: torch.Tensor,
                          block_size: int, kv_indptr: torch.Tensor, kv_indices: torch.Tensor,
                          kv_start_idx: Optional[torch.Tensor] = None) -> None:
    """FlashInfer's paged layout of one linear block per request, in place and without a host sync, read straight
    from ``req_to_token`` (SGLang before `compat.VERIFY_ARGS_KEYWORD_PLAN`, and the step graphs): request i reads
    ``req_to_token[req_pool_indices[i], s : s + prefix_lens[i] + block_size]``, s = ``kv_start_idx[i]`` (0: None).
    kv_indptr ``[bs + 1]`` int32; kv_indices int32, at least ``sum(prefix_lens) + bs * block_size`` long."""
    bs = req_pool_indices.shape[0]
    kv_lens = block_kv_indptr(prefix_lens, block_size, kv_indptr)
    create_flashinfer_kv_indices_triton[(bs,)](
        req_to_token, req_pool_indices, kv_lens, kv_indptr, kv_start_idx, kv_indices, req_to_token.size(1)
    )


def host_to_device(t: torch.Tensor, device) -> torch.Tensor:
    """Host tensor ``t`` on ``device``, on CUDA through pinned memory without the host waiting for the copy. A
    blocking copy waits for all the current stream holds: under SGLang's overlap schedule the scheduler's stream
    waits for the running step (its write-after-read barrier), so the host would stop until that step ends and the
    GPU would then idle while the host prepares the next one."""
    device = torch.device(device)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t.to(device)


# ---- the worker's results ----------------------------------------------------------------------------------
def decode_result(logits: torch.Tensor, accepted: tuple, width: int, block_size: int,
                  graphed: bool) -> GenerationBatchResult:
    """A decode step's result from its verify ``logits`` ``[bs * width, V]`` and ``accepted`` = (accept_lens,
    bonus_tokens, committed ``[bs, width]`` (-1 padded), new_seq_lens), the others ``[bs]``."""
    accept_lens, bonus, committed, new_seq_lens = accepted
    return GenerationBatchResult(
        logits_output=LogitsProcessorOutput(next_token_logits=logits),
        next_token_ids=committed.reshape(-1),
        accept_lens=(accept_lens + 1).to(torch.int32),
        can_run_cuda_graph=graphed,
        next_draft_input=DFlashDraftState(bonus_tokens=bonus, block_size=block_size),
        speculative_num_draft_tokens=width,  # the stride of next_token_ids / logprobs per request
        new_seq_lens=new_seq_lens,
    )


def prefill_result(out: GenerationBatchResult, batch, block_size: int) -> GenerationBatchResult:
    """The target's extend result ``out`` of ``batch`` as DFLASH's: its next tokens are the bonus tokens; the
    captured hidden states (written to the draft's KV by then) are dropped."""
    out.logits_output.hidden_states = None
    out.new_seq_lens = batch.seq_lens
    out.next_draft_input = DFlashDraftState(bonus_tokens=out.next_token_ids.to(torch.int64), block_size=block_size)
    return out


def idle_result(device, block_size: int) -> GenerationBatchResult:
    """An idle step's (empty) result."""
    empty = torch.empty((0,), dtype=torch.int64, device=device)
    return GenerationBatchResult(
        next_token_ids=empty, accept_lens=empty.to(torch.int32), new_seq_lens=empty,
        next_draft_input=DFlashDraftState(bonus_tokens=empty, block_size=block_size),
        speculative_num_draft_tokens=block_size,
    )


def extend_positions(batch) -> torch.Tensor:
    """Positions ``[N]`` int64 (host) of the N tokens an extend ``batch`` appends: ``prefix_lens[i] +
    arange(extend_lens[i])`` per request, concatenated."""
    prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
    lens = torch.tensor(batch.extend_lens, dtype=torch.int64)
    return torch.repeat_interleave(prefix, lens) + (
        torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens))
