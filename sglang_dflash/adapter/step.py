"""The DFLASH decode step, written once.

    build block -> plan attention -> draft forward -> propose -> target verify -> commit draft KV -> greedy accept

`decode_step` runs these phases over the tensors of a `StepBatch` and returns one `StepResult`. The same
function runs eagerly (`DFlashWorker`: CPU, Triton, batches larger than every capture) and is what
`step_graphs.StepGraphs` captures, once per batch size, over static `StepBatch` tensors. What differs is who
plans the attention, a strategy chosen once per call site:

* `HostPlan`: each backend's ``init_forward_metadata`` from the committed lengths on the host (any backend);
* `step_graphs.DevicePlan`: FlashInfer's paged layout and split-kv plan written on the device inside the graph.

Both forwards are TARGET_VERIFY-shaped batches over one block of B tokens per request: the draft's block is
``[bonus, MASK x (B-1)]``, the target's ``[bonus, d_1 .. d_{B-1}]``, at positions ``seq_len + arange(B)`` and at the
request's reserved KV slots, so both models' K/V land at the same token slots. The result's accept is the greedy
one (the target's argmax); a batch that needs more (sampling, grammars, penalties, custom processors) accepts on
``StepResult.logits`` with `sampling.BlockSampler`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from sglang.srt.layers.dp_attention import set_dp_buffer_len, set_is_extend_in_batch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_dflash.adapter.sampling import greedy_accept
from sglang_dflash.adapter.spec_inputs import DFlashBlockInput
from sglang_dflash.adapter.tp import vocab_argmax
from sglang_dflash.kernels.block_builder import build_block

# SGLang reserves KV slot 0 for padding: padded rows of a captured step write there.
PADDING_SLOT = 0


def padded_rows(n: int, captured: Sequence[int]) -> int | None:
    """The smallest captured size >= n (sorted ``captured``), or None when n exceeds them all."""
    i = bisect.bisect_left(captured, n)
    return captured[i] if i < len(captured) else None


@dataclass
class StepModels:
    """What the step runs: the two models, their attention backends, the target's embeddings and lm_head, the
    draft's logit rule (`sglang_dflash.model.draft_logits`), the shared ``req_to_token`` and the draft-KV writer
    ``commit_kv(aux_hidden [N, n_ids*H], positions [N], cache_loc [N])``. Under tensor parallelism
    ``lm_head_weight`` ``[V_local, H]`` scores ids ``vocab_start ..`` and ``vocab_group`` is the TP group the
    vocabulary is split over (None: one rank holds it all)."""

    draft_model: torch.nn.Module
    target_model: torch.nn.Module
    draft_backend: object
    target_backend: object
    embed: torch.nn.Module
    lm_head_weight: torch.Tensor
    draft_logits: Callable[[torch.Tensor], torch.Tensor]
    commit_kv: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
    req_to_token: torch.Tensor
    mask_token_id: int
    block_size: int
    paged_verify: bool  # FlashInfer / Triton read seq_lens as the committed prefix; torch_native needs extend lens
    vocab_start: int = 0
    vocab_group: Optional[object] = None


@dataclass
class StepResult:
    """One decode step of ``bs`` requests (n = bs * B rows)."""

    draft_tokens: torch.Tensor  # [bs, B]: column 0 the bonus token, 1.. the drafts
    logits: torch.Tensor  # [n, V] verify logits
    accept_lens: torch.Tensor  # [bs] greedy
    bonus_tokens: torch.Tensor  # [bs]
    committed: torch.Tensor  # [bs, B] (-1 padded)
    new_seq_lens: torch.Tensor  # [bs]


class StepBatch:
    """The tensors one step reads and writes, and the two ForwardBatches over them.

    Inputs: ``bonus`` ``[bs]``, ``seq_lens`` ``[bs]`` int64 committed lengths, ``req_pool_indices`` ``[bs]`` int64
    and, for padded captures, ``valid`` ``[bs]`` bool (False rows write their KV to the padding slot). Block tensors
    ``input_ids`` / ``positions`` / ``loc`` / ``verify_ids`` ``[bs * B]``; ``accept_out``: the buffers the greedy
    accept writes (None: fresh tensors). ``seq_lens_cpu`` (host plans only) are the committed lengths on the host.
    """

    def __init__(self, m: StepModels, bonus, seq_lens, req_pool_indices, valid=None, seq_lens_cpu=None,
                 accept_out=None, logits_buffer=None):
        bs, B = seq_lens.shape[0], m.block_size
        dev = seq_lens.device
        self.bs, self.bonus, self.seq_lens, self.req_pool_indices, self.valid = bs, bonus, seq_lens, req_pool_indices, valid
        self.accept_out = accept_out
        self.input_ids, self.positions, self.loc, self.verify_ids = (
            torch.zeros(bs * B, dtype=torch.int64, device=dev) for _ in range(4))
        if seq_lens_cpu is None:  # captured: the capture's lengths (a device plan rewrites them per replay)
            seq_lens_cpu = torch.ones(bs, dtype=torch.int64)
        self.draft_fb = block_forward_batch(m, self, self.input_ids, seq_lens_cpu, CaptureHiddenMode.NULL)
        self.target_fb = block_forward_batch(m, self, self.verify_ids, seq_lens_cpu, CaptureHiddenMode.FULL)
        self.target_fb.next_token_logits_buffer = logits_buffer


def block_forward_batch(m: StepModels, b: StepBatch, input_ids: torch.Tensor, seq_lens_cpu: torch.Tensor,
                        capture: CaptureHiddenMode) -> ForwardBatch:
    """A TARGET_VERIFY ForwardBatch over one block per request of ``b`` (``input_ids`` ``[bs * B]``)."""
    bs, B = b.bs, m.block_size
    seq_lens_cpu = seq_lens_cpu.to(torch.int64)
    spec_info = DFlashBlockInput(draft_token=input_ids, positions=b.positions, draft_token_num=B,
                                 capture_hidden_mode=capture)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
        req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens if m.paged_verify else b.seq_lens + B,
        out_cache_loc=b.loc, seq_lens_sum=int(seq_lens_cpu.sum()) + bs * B, seq_lens_cpu=seq_lens_cpu + B,
        positions=b.positions, spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=spec_info,
        capture_hidden_mode=capture,
    )
    if not m.paged_verify:
        fb.extend_prefix_lens = b.seq_lens.to(torch.int32)
        fb.extend_seq_lens = torch.full((bs,), B, dtype=torch.int32, device=b.seq_lens.device)
        fb.extend_prefix_lens_cpu = seq_lens_cpu.tolist()
        fb.extend_seq_lens_cpu = [B] * bs
        fb.extend_num_tokens = bs * B
    return fb


class HostPlan:
    """Plans both forwards' attention on the host with each backend's ``init_forward_metadata``."""

    def __call__(self, m: StepModels, b: StepBatch) -> None:
        m.draft_backend.init_forward_metadata(b.draft_fb)
        m.target_backend.init_forward_metadata(b.target_fb)


def propose(m: StepModels, hidden: torch.Tensor, input_ids: torch.Tensor, bs: int) -> torch.Tensor:
    """Draft hidden states [bs * B, H] and block input_ids [bs * B] -> draft_tokens [bs, B]: column 0 = the
    bonus token, 1.. = argmax of the draft's logits (the target's lm_head, then ``m.draft_logits``; over every
    rank's vocabulary shard under tensor parallelism, `tp.vocab_argmax`)."""
    B = m.block_size
    scores = m.draft_logits(torch.matmul(hidden.view(bs, B, -1)[:, 1:], m.lm_head_weight.t()))
    drafts = scores.argmax(dim=-1) if m.vocab_group is None else vocab_argmax(scores, m.vocab_start, m.vocab_group)
    return torch.cat([input_ids.view(bs, B)[:, :1], drafts], dim=1)


def decode_step(m: StepModels, b: StepBatch, plan: Callable[[StepModels, StepBatch], None]) -> StepResult:
    """One DFLASH decode step of ``b`` with attention planned by ``plan`` (`HostPlan` or a device plan)."""
    bs, B = b.bs, m.block_size
    ids, pos, slots = build_block(b.bonus, b.seq_lens, B, m.mask_token_id, m.req_to_token, b.req_pool_indices,
                                  out=(b.input_ids, b.positions, b.loc))
    if b.valid is not None:
        slots.view(bs, B).masked_fill_(~b.valid[:, None], PADDING_SLOT)
    plan(m, b)
    set_dp_buffer_len(None, bs * B, False, None)
    set_is_extend_in_batch(False)
    with forward_context(ForwardContext(attn_backend=m.draft_backend)):
        hidden = m.draft_model(ids, pos, b.draft_fb, input_embeds=m.embed(ids)).hidden_states
    draft_tokens = propose(m, hidden, ids, bs)
    b.verify_ids.copy_(draft_tokens.view(-1))
    with forward_context(ForwardContext(attn_backend=m.target_backend)):
        out = m.target_model(b.verify_ids, pos, b.target_fb)
    m.commit_kv(out.hidden_states, pos, slots)
    logits = out.next_token_logits
    accept = greedy_accept(draft_tokens, logits, b.seq_lens, out=b.accept_out)
    return StepResult(draft_tokens, logits, *accept)
