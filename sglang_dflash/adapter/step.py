"""The DFLASH decode step, written once.

    build block -> plan attention -> draft forward -> propose -> target verify -> commit draft KV -> accept

`decode_step` runs these phases over the tensors of a `StepBatch` and returns one `StepResult`. The same
functions run eagerly (`DFlashWorker`: CPU, Triton, batches larger than every capture) and are what
`step_graphs.StepGraphs` captures per batch size and width over static `StepBatch` tensors, as three graphs:
`draft_phase` (block, plan, draft forward, proposal), `verify_phase` (target forward, draft context K/V; one graph
shared by the greedy and sampled steps) and `accept_phase`. What differs is who
plans the attention, a strategy chosen once per call site:

* `HostPlan`: each backend's ``init_forward_metadata`` from the committed lengths on the host (any backend; on
  SGLang 0.5.23 each batch is first bound to its KV-location plan, `compat.bind_kv_plan`);
* `step_graphs.DevicePlan`: FlashInfer's paged layout and split-kv plan written on the device inside the graph.

Both forwards are TARGET_VERIFY-shaped batches at the request's reserved KV slots, so both models' K/V land at the
same token slots: the draft's block is ``[bonus, MASK x (B-1)]`` at positions ``seq_len + arange(B)``; the target
verifies the first ``w`` of them, ``[bonus, d_1 .. d_{w-1}]``, where ``w`` is the step's verify width
(`StepBatch.width`, `sglang_dflash.policy`; B unless chosen otherwise). Width 1 is a plain decode step: no draft
forward, the target decodes the bonus token and the draft's context K/V for it is still written; where the step graphs
plan FlashInfer's decode wrapper on the device (`step_graphs.decode_kernel`) that forward is a DECODE batch, on the
decode kernel SGLang's own decode step runs (`StepBatch` ``decode_kernel``).

The accept is the step's own in two cases: greedy (the target's argmax), and sampling under the requests'
temperature / top-k / top-p / min-p (`sampling.StepSampling`): each draft d_k is drawn from the draft's law q_k
(`StepSampling.draft_law`), and the verify keeps it with probability min(1, p_k(d_k) / q_k(d_k)), else draws from
max(p_k - q_k, 0) (`sglang_dflash.verify`, the one copy of the rule; under tensor parallelism over the ranks'
vocabulary shards, `verify.VocabSplit`). A batch whose logits need more (grammars, penalties, min_new_tokens, logit
bias, custom processors, seeded sampling) runs the greedy step and accepts on ``StepResult.logits`` with
`sampling.BlockSampler`.
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

from sglang_dflash.adapter import compat
from sglang_dflash.adapter.sampling import StepSampling, greedy_accept
from sglang_dflash.adapter.spec_inputs import DFlashBlockInput
from sglang_dflash.kernels.accept import accept_tokens
from sglang_dflash.kernels.block_builder import build_block
from sglang_dflash.verify import VocabSplit, draw, sample_predictions

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
    ``commit_kv(aux_hidden [N, n_ids*H], positions [N], cache_loc [N])``. ``lm_head_weight`` ``[V_local, H]`` scores
    the ids of ``vocab`` held here (under tensor parallelism a shard of the vocabulary; `VocabSplit.whole` on one
    rank). ``draft_kv_translator`` / ``target_kv_translator``: the
    runners' KVIndexTranslator, through which a hand-built batch gets its KV-location plan (`compat.kv_translator`;
    None on SGLang without one)."""

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
    vocab: VocabSplit
    draft_kv_translator: Optional[object] = None
    target_kv_translator: Optional[object] = None


@dataclass
class StepResult:
    """One decode step of ``bs`` requests at verify width ``w`` (n = bs * w rows)."""

    draft_tokens: torch.Tensor  # [bs, w]: column 0 the bonus token, 1.. the verified drafts
    logits: torch.Tensor  # [n, V] verify logits
    accept_lens: torch.Tensor  # [bs] greedy
    bonus_tokens: torch.Tensor  # [bs]
    committed: torch.Tensor  # [bs, w] (-1 padded)
    new_seq_lens: torch.Tensor  # [bs]


class StepBatch:
    """The tensors one step reads and writes, and the two ForwardBatches over them.

    Inputs: ``bonus`` ``[bs]``, ``seq_lens`` ``[bs]`` int64 committed lengths, ``req_pool_indices`` ``[bs]`` int64 and,
    for padded captures, ``valid`` ``[bs]`` bool (False rows write their KV to the padding slot). ``width``: the
    target's verify width w (1..B; 1 = plain decode, no draft forward). ``sampling``: the requests' `StepSampling`
    (drafts drawn, speculative-sampling accept), or None (argmax drafts, greedy accept). ``decode_kernel`` (width 1
    only): the target's forward is a DECODE batch (kv length seq_lens + 1), else TARGET_VERIFY. Draft block tensors
    ``input_ids`` / ``positions`` / ``loc`` ``[bs * B]`` (absent at width 1); the target's ``verify_ids`` /
    ``verify_positions`` / ``verify_loc`` ``[bs * w]`` (the draft's own tensors at w = B); ``accept_out``: the buffers
    the accept writes (None: fresh tensors). ``seq_lens_cpu`` (host plans only) are the committed lengths on the
    host.
    """

    def __init__(self, m: StepModels, bonus, seq_lens, req_pool_indices, valid=None, seq_lens_cpu=None,
                 accept_out=None, logits_buffer=None, width: int | None = None,
                 sampling: StepSampling | None = None, decode_kernel: bool = False):
        bs, B = seq_lens.shape[0], m.block_size
        self.sampling = sampling
        w = self.width = B if width is None else width
        if decode_kernel and w != 1:
            raise ValueError(f"a DECODE batch verifies one token per request, not {w}")
        dev = seq_lens.device
        self.bs, self.bonus, self.seq_lens, self.req_pool_indices, self.valid = bs, bonus, seq_lens, req_pool_indices, valid
        self.accept_out = accept_out
        zeros = lambda n: torch.zeros(n, dtype=torch.int64, device=dev)  # noqa: E731
        if seq_lens_cpu is None:  # captured: the capture's lengths (a device plan rewrites them per replay)
            seq_lens_cpu = torch.ones(bs, dtype=torch.int64)
        self.draft_fb = None
        if w > 1:
            self.input_ids, self.positions, self.loc = zeros(bs * B), zeros(bs * B), zeros(bs * B)
            self.draft_fb = block_forward_batch(m, self, self.input_ids, self.positions, self.loc, B, seq_lens_cpu,
                                               CaptureHiddenMode.NULL)
        shared = w == B
        self.verify_ids = zeros(bs * w)
        self.verify_positions = self.positions if shared else zeros(bs * w)
        self.verify_loc = self.loc if shared else zeros(bs * w)
        self.target_fb = block_forward_batch(m, self, self.verify_ids, self.verify_positions, self.verify_loc, w,
                                             seq_lens_cpu, CaptureHiddenMode.FULL, decode_kernel)
        self.target_fb.next_token_logits_buffer = logits_buffer


def block_forward_batch(m: StepModels, b: StepBatch, input_ids: torch.Tensor, positions: torch.Tensor,
                        loc: torch.Tensor, width: int, seq_lens_cpu: torch.Tensor,
                        capture: CaptureHiddenMode, decode: bool = False) -> ForwardBatch:
    """A TARGET_VERIFY ForwardBatch over ``width`` tokens per request of ``b`` (``input_ids`` / ``positions`` /
    ``loc`` ``[bs * width]``), or with ``decode`` a DECODE batch of one token per request (SGLang's decode lengths:
    the committed ones + 1)."""
    bs, B = b.bs, width
    seq_lens_cpu = seq_lens_cpu.to(torch.int64)
    if decode:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=input_ids, req_pool_indices=b.req_pool_indices,
            seq_lens=b.seq_lens + 1, out_cache_loc=loc, seq_lens_sum=int(seq_lens_cpu.sum()) + bs,
            seq_lens_cpu=seq_lens_cpu + 1, positions=positions, spec_algorithm=SpeculativeAlgorithm.DFLASH,
            capture_hidden_mode=capture)
    spec_info = DFlashBlockInput(draft_token=input_ids, positions=positions, draft_token_num=B,
                                 capture_hidden_mode=capture)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
        req_pool_indices=b.req_pool_indices, seq_lens=b.seq_lens if m.paged_verify else b.seq_lens + B,
        out_cache_loc=loc, seq_lens_sum=int(seq_lens_cpu.sum()) + bs * B, seq_lens_cpu=seq_lens_cpu + B,
        positions=positions, spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=spec_info,
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
    """Plans both forwards' attention on the host with each backend's ``init_forward_metadata``, each batch first
    bound to its KV-location plan (`compat.bind_kv_plan`: its block slots are written by then)."""

    def __call__(self, m: StepModels, b: StepBatch) -> None:
        if b.draft_fb is not None:
            compat.bind_kv_plan(m.draft_kv_translator, b.draft_fb)
            m.draft_backend.init_forward_metadata(b.draft_fb)
        compat.bind_kv_plan(m.target_kv_translator, b.target_fb)
        m.target_backend.init_forward_metadata(b.target_fb)


def propose(m: StepModels, hidden: torch.Tensor, input_ids: torch.Tensor, bs: int, width: int | None = None,
            sampling: StepSampling | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draft hidden states [bs * B, H] and block input_ids [bs * B] -> (draft_tokens [bs, w], their law) (w =
    ``width``, default B): column 0 = the bonus token, 1.. = the drafts of block positions 1..w-1 from the draft's
    logits there (the target's lm_head, then ``m.draft_logits``), over ``m.vocab`` (every rank's shard under tensor
    parallelism). Greedy (``sampling`` None): the argmax, law None. Sampling: a draw from the draft's law
    (`StepSampling.draft_law`), returned as ``[bs, w-1, V_local]`` float32. Only the verified positions are scored."""
    B = m.block_size
    w = B if width is None else width
    scores = m.draft_logits(torch.matmul(hidden.view(bs, B, -1)[:, 1:w], m.lm_head_weight.t()))
    law = None
    if sampling is not None:
        law = sampling.draft_law(scores, m.vocab)
        drafts = draw(law, vocab=m.vocab)
    else:
        drafts = m.vocab.argmax(scores)
    return torch.cat([input_ids.view(bs, B)[:, :1], drafts], dim=1), law


def draft_phase(m: StepModels, b: StepBatch, plan: Callable[[StepModels, StepBatch], None]
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Build the block, plan both forwards' attention (``plan``: `HostPlan` or a device plan), run the draft and
    write the verify rows into ``b.verify_ids`` -> (draft_tokens ``[bs, w]``, their law ``[bs, w-1, V_local]`` or
    None: `propose`). Width 1: the bonus token alone, no draft forward."""
    bs, B, w = b.bs, m.block_size, b.width
    if b.draft_fb is not None:
        ids, pos, slots = build_block(b.bonus, b.seq_lens, B, m.mask_token_id, m.req_to_token, b.req_pool_indices,
                                      out=(b.input_ids, b.positions, b.loc))
        if b.valid is not None:
            slots.view(bs, B).masked_fill_(~b.valid[:, None], PADDING_SLOT)
        if w < B:
            b.verify_positions.view(bs, w).copy_(pos.view(bs, B)[:, :w])
            b.verify_loc.view(bs, w).copy_(slots.view(bs, B)[:, :w])
    else:  # plain decode: the target's one token per request
        build_block(b.bonus, b.seq_lens, 1, m.mask_token_id, m.req_to_token, b.req_pool_indices,
                    out=(b.verify_ids, b.verify_positions, b.verify_loc))
        if b.valid is not None:
            b.verify_loc.masked_fill_(~b.valid, PADDING_SLOT)
    plan(m, b)
    if b.draft_fb is None:
        return b.verify_ids.view(bs, 1), None
    set_is_extend_in_batch(False)
    set_dp_buffer_len(None, bs * B, False, None)
    with forward_context(ForwardContext(attn_backend=m.draft_backend)):
        hidden = m.draft_model(ids, pos, b.draft_fb, input_embeds=m.embed(ids)).hidden_states
    draft_tokens, law = propose(m, hidden, ids, bs, w, b.sampling)
    b.verify_ids.copy_(draft_tokens.view(-1))
    return draft_tokens, law


def verify_phase(m: StepModels, b: StepBatch) -> torch.Tensor:
    """The target's forward over ``b.verify_ids`` (attention planned by `draft_phase`), the draft's context K/V of
    those rows written -> verify logits ``[bs * w, V]``."""
    set_is_extend_in_batch(False)
    set_dp_buffer_len(None, b.bs * b.width, False, None)
    with forward_context(ForwardContext(attn_backend=m.target_backend)):
        out = m.target_model(b.verify_ids, b.verify_positions, b.target_fb)
    m.commit_kv(out.hidden_states, b.verify_positions, b.verify_loc)
    return out.next_token_logits


def accept_phase(m: StepModels, b: StepBatch, draft_tokens: torch.Tensor, logits: torch.Tensor,
                 law: torch.Tensor | None) -> tuple:
    """-> (accept_lens, bonus_tokens, committed, new_seq_lens) (`StepResult`): greedy (``b.sampling`` None) or
    speculative sampling against the drafts' ``law``."""
    if b.sampling is None:
        return greedy_accept(draft_tokens, logits, b.seq_lens, out=b.accept_out)
    target_tokens = sample_predictions(draft_tokens, b.sampling.probs(logits.view(b.bs, b.width, -1)),
                                       draft_probs=law, vocab=m.vocab)
    return accept_tokens(draft_tokens, target_tokens, b.seq_lens, out=b.accept_out)


def decode_step(m: StepModels, b: StepBatch, plan: Callable[[StepModels, StepBatch], None]) -> StepResult:
    """One DFLASH decode step of ``b`` at its verify width with attention planned by ``plan`` (`HostPlan` or a
    device plan): `draft_phase`, `verify_phase`, `accept_phase` (what `step_graphs` captures as three graphs)."""
    draft_tokens, law = draft_phase(m, b, plan)
    logits = verify_phase(m, b)
    return StepResult(draft_tokens, logits, *accept_phase(m, b, draft_tokens, logits, law))
