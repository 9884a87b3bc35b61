"""The accept decision for a verify block under SGLang's sampling parameters, and its logprobs.

`step_accept_kind` says which accept a decode batch takes: the step's own (greedy, or sampled with the requests'
`StepSampling`: drafts drawn from the draft's law, speculative sampling, inside the step), or `BlockSampler.accept`
after a greedy step, for batches whose logits need more. `BlockSampler.accept`: given a decode batch, its draft tokens
``[bs, B]`` and the verify logits ``[bs * B, V]``, it applies what token-by-token decoding would apply at each block
position -- the grammar's vocab mask after the drafts before that position, frequency / presence / repetition penalties
(the drafts before a position count as output), ``min_new_tokens``, ``logit_bias``, custom logit processors -- and
accepts greedily or by speculative sampling: every verify row's token is drawn by the target's own SGLang sampler
(`sample_rows`) and a draft is accepted when it equals its row's draw. `BlockSampler.attach_logprobs` writes the
committed tokens' logprobs as SGLang's sampler defines them (for either accept). `reads_output_history` tells when the
logits depend on the output so far.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

from sglang_dflash.kernels.accept import accept_tokens
from sglang_dflash.verify import VocabSplit, target_probs


@dataclass
class BlockPenalties:
    """SGLang's output-token penalties for a verify batch.

    output_counts ``[b, V]`` float: occurrences of each token among a request's committed output tokens (block
    slot 0, the last committed token, included). block_tokens ``[b, B]``: the verify rows (slot 0 + drafts).
    frequency / presence / repetition ``[b]`` (neutral values 0 / 0 / 1 leave a row unchanged).
    """

    output_counts: torch.Tensor
    block_tokens: torch.Tensor
    frequency: torch.Tensor
    presence: torch.Tensor
    repetition: torch.Tensor


class OutputCounts:
    """Per-request counts of output tokens for the penalties, kept between verify steps.

    Each call brings a request's ``[V]`` row up to date with the tokens output since the previous call (O(new
    tokens) per step instead of O(all output tokens)); a request missing from a call is forgotten and rebuilt from
    its whole output if it comes back, as is one whose output got shorter.
    """

    def __init__(self, vocab_size: int, device) -> None:
        self.vocab_size, self.device = vocab_size, torch.device(device)
        self._rows: dict = {}  # key -> (number of output tokens counted, row [V] float32)

    def gather(self, keys: Sequence, outputs: Sequence[Sequence[int]], rows: Sequence[int],
               batch_size: int) -> torch.Tensor:
        """-> ``[batch_size, V]`` float32: row ``rows[j]`` counts ``outputs[j]`` (request ``keys[j]``), others 0."""
        counts = torch.zeros((batch_size, self.vocab_size), dtype=torch.float32, device=self.device)
        kept_at, kept, new_rows, new_toks = [], [], [], []
        for key, out, row in zip(keys, outputs, rows):
            done, cached = self._rows.get(key, (0, None))
            if cached is None or done > len(out):
                done = 0
            else:
                kept_at.append(row)
                kept.append(cached)
            new = out[done:]
            new_rows += [row] * len(new)
            new_toks += new
        if kept:
            counts.index_copy_(0, torch.tensor(kept_at, device=self.device), torch.stack(kept))
        if new_toks:
            counts.index_put_((torch.tensor(new_rows, dtype=torch.int64).to(self.device),
                               torch.tensor(new_toks, dtype=torch.int64).to(self.device)),
                              torch.ones(len(new_toks), device=self.device), accumulate=True)
        self._rows = {key: (len(out), counts[row]) for key, out, row in zip(keys, outputs, rows)}
        return counts


def _draft_occurrences(p: BlockPenalties) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (idx, seen, first_new, fresh), each ``[b, B, B-1]`` over (block position k, draft slot i+1):
    idx = draft token ``d_{i+1}``; seen = ``i+1 <= k`` (position k counts that draft as an output token);
    first_new = seen, no earlier draft slot holds the token and it is not among the committed outputs;
    fresh = the token is not among the committed outputs and occurs in ``d_1..d_k`` (the same for every slot
    holding it, so values scattered to one token agree)."""
    drafts = p.block_tokens[:, 1:]  # [b, B-1]
    b, n = drafts.shape
    k = torch.arange(n + 1, device=drafts.device)
    i = torch.arange(n, device=drafts.device)
    seen = (i[None, :] < k[:, None]).expand(b, -1, -1)  # [b, B, B-1]
    same = drafts[:, :, None] == drafts[:, None, :]  # [b, i, j]
    earlier = (same & (i[None, :] < i[:, None])).any(-1)  # [b, B-1]: an earlier slot has this token
    in_outputs = p.output_counts.gather(1, drafts) > 0  # [b, B-1]
    first_new = seen & ~(earlier | in_outputs)[:, None, :]
    # token of slot i occurs in d_1..d_k  <=>  its first slot j satisfies j < k
    first_slot = torch.where(same, i[None, None, :], n).min(-1).values  # [b, B-1]
    fresh = (first_slot[:, None, :] < k[None, :, None]) & ~in_outputs[:, None, :]
    return drafts[:, None, :].expand(b, n + 1, n), seen, first_new, fresh


def _apply_additive_penalties(logits: torch.Tensor, p: BlockPenalties, occ) -> None:
    """Frequency and presence penalties, per block position (draft tokens before a position count)."""
    idx, seen, first_new, _ = occ
    counts = p.output_counts.to(logits.dtype)
    freq = p.frequency.to(logits.dtype)
    pres = p.presence.to(logits.dtype)
    logits.sub_((freq[:, None] * counts + pres[:, None] * (counts > 0))[:, None, :])
    extra = freq[:, None, None] * seen + pres[:, None, None] * first_new
    logits.scatter_add_(2, idx, -extra.to(logits.dtype))


def _apply_repetition_penalty(logits: torch.Tensor, p: BlockPenalties, occ) -> None:
    """SGLang's scaling rule (``x * r`` where ``x < 0``, else ``x / r``) on tokens already output, per position."""
    idx, _, _, fresh = occ
    rep = p.repetition.to(logits.dtype)

    def scale(x, r):
        return torch.where(x < 0, x * r, x / r)

    base = (p.output_counts > 0)[:, None, :]
    logits.copy_(torch.where(base, scale(logits, rep[:, None, None]), logits))
    vals = logits.gather(2, idx)
    logits.scatter_(2, idx, torch.where(fresh, scale(vals, rep[:, None, None]), vals))


def adjust_block_logits(
    logits: torch.Tensor,
    logit_bias: Optional[torch.Tensor] = None,
    stop_penalties: Optional[torch.Tensor] = None,
    num_output: Optional[torch.Tensor] = None,
    min_new_tokens: Optional[torch.Tensor] = None,
    penalties: Optional[BlockPenalties] = None,
) -> torch.Tensor:
    """Apply, in place, what plain decoding adds to the logits of each block position before sampling.

    logits ``[b, B, V]``: row k predicts output token ``num_output + k`` (block slot 0 is the last committed
    token, already counted in ``num_output``). In SGLang's order: ``penalties`` (frequency and presence, then
    min_new_tokens, then the repetition scaling; at position k the drafts ``d_1..d_k`` count as output tokens,
    which is exact for every position whose verdict is used), then logit_bias ``[b, V]`` on every position.
    min_new_tokens: ``stop_penalties`` ``[b, V]`` (``-inf`` at a request's stop/EOS ids, 0 elsewhere) is added
    where ``num_output + k < min_new_tokens`` (``num_output``, ``min_new_tokens`` ``[b]``), i.e. exactly where
    token-by-token decoding would still forbid stopping. Returns ``logits``.
    """
    b, blk, _ = logits.shape
    occ = None
    if penalties is not None:
        occ = _draft_occurrences(penalties)
        _apply_additive_penalties(logits, penalties, occ)
    if stop_penalties is not None:
        k = torch.arange(blk, device=logits.device)
        active = (num_output.view(b, 1) + k) < min_new_tokens.view(b, 1)  # [b, B]
        logits.add_(torch.where(active[:, :, None], stop_penalties.to(logits.dtype)[:, None, :], 0.0))
    if penalties is not None:
        _apply_repetition_penalty(logits, penalties, occ)
    if logit_bias is not None:
        logits.add_(logit_bias.to(logits.dtype)[:, None, :])
    return logits


@dataclass
class StepSampling:
    """The sampling parameters a step draws and accepts with, per request (SGLang's SamplingBatchInfo values):
    ``temperature`` ``[bs]`` float32 (> 0; SGLang serves a greedy request of a mixed batch as top-k 1),
    ``top_k`` ``[bs]`` int64, ``top_p`` / ``min_p`` ``[bs]`` float32. ``filtered`` (host, fixed per captured graph):
    some request has top-k / top-p / min-p, so the probabilities go through the sort of `verify.target_probs`."""

    temperature: torch.Tensor
    top_k: torch.Tensor
    top_p: torch.Tensor
    min_p: torch.Tensor
    filtered: bool

    @classmethod
    def of(cls, info: SamplingBatchInfo, filtered: bool) -> "StepSampling":
        """The values of SGLang's ``info`` (views, no copy)."""
        return cls(info.temperatures.view(-1), info.top_ks, info.top_ps, info.min_ps, filtered)

    def head(self, n: int, filtered: bool) -> "StepSampling":
        """Views of the first n rows, with ``filtered`` (a step graph's inputs for n requests)."""
        return StepSampling(self.temperature[:n], self.top_k[:n], self.top_p[:n], self.min_p[:n], filtered)

    def copy_(self, info: SamplingBatchInfo) -> None:
        """Write ``info``'s values for its n requests into the first n rows (the static inputs of a step graph)."""
        src = self.of(info, self.filtered)
        n = src.temperature.shape[0]
        for name in ("temperature", "top_k", "top_p", "min_p"):
            getattr(self, name)[:n].copy_(getattr(src, name))

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """logits ``[bs, n, V]`` -> float32 probabilities under each request's parameters (`verify.target_probs`)."""
        return target_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p,
                            needs_filter=self.filtered, any_greedy=False)

    def draft_law(self, scores: torch.Tensor, vocab: VocabSplit) -> torch.Tensor:
        """The law drafts are drawn from: draft scores ``[bs, n, V_local]`` -> float32 ``[bs, n, V_local]``, `probs`
        (the requests' own parameters) over a whole vocabulary; over a split one (tensor parallelism), this rank's
        shard of the softmax at the requests' temperature, with the filters decided on the whole vocabulary's 64
        largest scores (`VocabSplit.filtered_softmax`: a sort of the whole vocabulary would need it on one rank)."""
        if vocab.group is None:
            return self.probs(scores)
        x = scores.to(torch.float32) / self.temperature.view(-1, 1, 1)
        if not self.filtered:
            return vocab.softmax(x)
        return vocab.filtered_softmax(x, self.top_k, self.top_p, self.min_p)


# How a decode step accepts: its own greedy accept; its own sampled accept, without or with the top-k / top-p /
# min-p sort (`StepSampling.filtered`); or the greedy step followed by `BlockSampler.accept` on its logits.
GREEDY, SAMPLED, FILTERED, BLOCK = "greedy", "sampled", "filtered", "block"


def step_accept_kind(batch) -> str:
    """`GREEDY` / `SAMPLED` / `FILTERED` / `BLOCK` for a decode ``batch`` (host flags only, no sync). BLOCK where
    the logits need more than the requests' temperature and filters (grammars, penalties, min_new_tokens, logit
    bias, custom processors) and for seeded sampling (deterministic inference: SGLang's seeded draw)."""
    if plain_greedy(batch):
        return GREEDY
    info = batch.sampling_info
    if (info.is_all_greedy or info.logit_bias is not None or info.sampling_seed is not None
            or reads_output_history(batch)):
        return BLOCK
    return FILTERED if info.need_top_k_sampling or info.need_top_p_sampling or info.need_min_p_sampling else SAMPLED


# ---------------------------------------------------------------- the accept decision of a verify block

Accepted = tuple  # accept_tokens' (accept_lens [bs], bonus_tokens [bs], committed [bs, B], new_seq_lens [bs])


def greedy_accept(draft_tokens: torch.Tensor, logits: torch.Tensor, seq_lens: torch.Tensor, out=None) -> Accepted:
    """draft_tokens [bs, B], verify logits [bs * B, V] (or [bs, B, V]), seq_lens [bs] int64 -> `accept_tokens`'
    result with the target's argmax as its choice (written into ``out``, four buffers in that order, when given)."""
    bs, B = draft_tokens.shape
    return accept_tokens(draft_tokens, logits.view(bs, B, -1).argmax(dim=-1), seq_lens, out=out)


def plain_greedy(batch) -> bool:
    """True when accept is the target's argmax alone: all greedy, no grammar, logit bias, min_new_tokens,
    penalties or custom logit processors (what `BlockSampler.accept` would otherwise apply)."""
    info = batch.sampling_info
    return info.is_all_greedy and info.logit_bias is None and not reads_output_history(batch)


def reads_output_history(batch) -> bool:
    """True when the verify logits of ``batch`` depend on its requests' output so far or their grammar states
    (what `BlockSampler.accept` applies beyond the plain target logits, logit_bias aside)."""
    if batch.has_grammar or batch.sampling_info.has_custom_logit_processor:
        return True
    short, penalized = _short_and_penalized(batch.reqs)
    return bool(short or penalized)


class BlockSampler:
    """The accept decision for verify blocks, drawing with ``sampler`` (the target runner's SGLang `Sampler`); keeps
    the penalties' per-request output counts between steps."""

    def __init__(self, device, sampler) -> None:
        self.device, self.sampler = device, sampler
        self.output_counts: Optional[OutputCounts] = None  # made at the first penalized step (logits width)

    def accept(self, batch, draft_tokens: torch.Tensor, logits: torch.Tensor) -> Accepted:
        """draft_tokens [bs, B], verify logits [bs * B, V] (adjusted in place) -> `accept_tokens`' result."""
        bs, B = draft_tokens.shape
        if batch.has_grammar:
            apply_grammar(batch, draft_tokens, logits, self.device)
        self.adjust_logits(batch, logits.view(bs, B, -1), draft_tokens)
        info = batch.sampling_info
        if info.has_custom_logit_processor:
            apply_custom_processors(info, draft_tokens, logits)
        seq_lens = batch.seq_lens.to(torch.int64)
        if info.is_all_greedy:
            return greedy_accept(draft_tokens, logits, seq_lens)
        # the sampler works in place on the logits: attach_logprobs reads them afterwards
        rows = sample_rows(self.sampler, info, logits.clone() if batch.return_logprob else logits, seq_lens, B)
        return accept_tokens(draft_tokens, rows.view(bs, B), seq_lens)

    def adjust_logits(self, batch, logits: torch.Tensor, draft_tokens: torch.Tensor) -> None:
        """Penalties, min_new_tokens and logit_bias on the verify logits ``[bs, B, V]``, in place, per block
        position as plain decoding applies them (accept and attach_logprobs both see them); draft_tokens
        ``[bs, B]`` are the verify rows. The forward's sampling_info carries no penalizer state (SGLang strips
        it for the forward), so the penalties count each request's output ids (kept between steps by
        OutputCounts, updated with the tokens committed since) and min_new_tokens
        from SGLang's definition of a request's stop ids (sampling stop_token_ids, the tokenizer's additional
        stop ids and its EOS)."""
        bias = batch.sampling_info.logit_bias
        reqs = batch.reqs
        short, penalized = _short_and_penalized(reqs)
        if bias is None and not short and not penalized:
            return
        bs, _, vocab = logits.shape
        stop_penalties = num_output = min_new = penalties = None
        if short:
            stop_penalties = torch.zeros((bs, vocab), dtype=torch.float32)
            for i in short:
                tok = reqs[i].tokenizer
                ids = set(reqs[i].sampling_params.stop_token_ids or ()) | set(getattr(tok, "additional_stop_token_ids", None) or ())
                if getattr(tok, "eos_token_id", None) is not None:
                    ids.add(tok.eos_token_id)
                stop_penalties[i, [t for t in ids if 0 <= t < vocab]] = float("-inf")
            stop_penalties = stop_penalties.to(self.device)
            num_output, min_new = torch.tensor([[len(r.output_ids), r.sampling_params.min_new_tokens] for r in reqs],
                                               dtype=torch.int64).to(self.device).unbind(1)  # one copy
        if penalized:
            if self.output_counts is None or self.output_counts.vocab_size != vocab:
                self.output_counts = OutputCounts(vocab, self.device)
            counts = self.output_counts.gather([reqs[i].rid for i in penalized], [reqs[i].output_ids for i in penalized],
                                               penalized, bs)
            params = torch.tensor([[r.sampling_params.frequency_penalty, r.sampling_params.presence_penalty,
                                    r.sampling_params.repetition_penalty] for r in reqs], dtype=torch.float32)
            penalties = BlockPenalties(counts, draft_tokens, *params.to(self.device).unbind(1))  # one copy
        adjust_block_logits(logits, bias, stop_penalties, num_output, min_new, penalties)

    @staticmethod
    def attach_logprobs(batch, logits_output, committed: torch.Tensor) -> None:
        """Decode logprobs of the committed tokens, as SGLang's sampler defines them: log_softmax of the
        temperature-scaled logits at each token's verify position. committed [bs, B] (-1 padded); the
        scheduler reads the first accept_len+1 entries of each row (and of each top-k / token-ids list)."""
        bs, B = committed.shape
        temps = batch.sampling_info.temperatures.view(bs, 1, 1).float()
        logp = torch.log_softmax(logits_output.next_token_logits.view(bs, B, -1).float() / temps, dim=-1)
        logits_output.next_token_logprobs = logp.gather(-1, committed.clamp(min=0)[..., None]).squeeze(-1)
        flat = logp.view(bs * B, -1)
        top_nums = [n for n in batch.top_logprobs_nums for _ in range(B)]
        if any(top_nums):
            vals, idx = flat.topk(max(top_nums), dim=-1)
            logits_output.next_token_top_logprobs_val = [vals[r, :k] for r, k in enumerate(top_nums)]
            logits_output.next_token_top_logprobs_idx = [idx[r, :k] for r, k in enumerate(top_nums)]
        token_ids = [ids for ids in batch.token_ids_logprobs for _ in range(B)]
        if any(ids is not None for ids in token_ids):
            logits_output.next_token_token_ids_logprobs_val = [
                flat[r, ids] if ids is not None else flat.new_empty(0) for r, ids in enumerate(token_ids)]
            logits_output.next_token_token_ids_logprobs_idx = [ids or [] for ids in token_ids]


def sample_rows(sampler, info: SamplingBatchInfo, logits: torch.Tensor, seq_lens: torch.Tensor, width: int
                ) -> torch.Tensor:
    """Each verify row's token drawn by SGLang's ``sampler`` as plain decoding draws it: logits ``[bs * width, V]``
    (adjusted already; overwritten), request ``i``'s parameters in ``info`` (temperature, top-k / top-p / min-p, a
    sampling seed) on its ``width`` rows, row ``(i, k)`` at position ``seq_lens[i] + k`` (what a seeded draw hashes,
    as for the token plain decoding feeds there). -> ``[bs * width]`` int64.

    With a point-mass draft this is exact speculative sampling: draft ``d`` at row ``k`` is accepted when the row's
    draw equals it (probability ``p_k(d)``), and a rejected row's draw is distributed as ``p_k`` without ``d``,
    renormalised -- the residual. Greedy rows of a mixed batch are SGLang's top-k 1 rows."""
    rep = lambda t: None if t is None else t.repeat_interleave(width, dim=0)  # noqa: E731
    rows = SamplingBatchInfo(
        temperatures=rep(info.temperatures), top_ps=rep(info.top_ps), top_ks=rep(info.top_ks),
        min_ps=rep(info.min_ps), is_all_greedy=False, is_any_greedy=info.is_any_greedy,
        need_top_p_sampling=info.need_top_p_sampling, need_top_k_sampling=info.need_top_k_sampling,
        need_min_p_sampling=info.need_min_p_sampling, vocab_size=info.vocab_size,
        sampling_seed=rep(info.sampling_seed), device=info.device)
    positions = (seq_lens[:, None] + torch.arange(width, device=seq_lens.device)).view(-1)
    ids = sampler(LogitsProcessorOutput(next_token_logits=logits), rows, False, [], [], positions)
    return ids.to(torch.int64)


def apply_grammar(batch, draft_tokens: torch.Tensor, logits: torch.Tensor, device) -> None:
    """Constrained decoding (regex / JSON schema / EBNF / structural tags): block position k of a request with a
    grammar gets the vocab mask of its grammar after ``d_1..d_k``, built by SGLang's chain traversal (the FSM
    accepts the drafts one by one and rolls back). Positions after a draft the grammar forbids keep every
    token allowed; their verdict is never used, because the masked target cannot pick that draft.
    draft_tokens ``[bs, B]``; logits ``[bs * B, V]`` in place. The scheduler advances each FSM over the
    committed tokens afterwards and cuts a run at the token that completes the grammar."""
    mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=GrammarTree.from_linear_chain(draft_tokens),
                                    sampling_info=batch.sampling_info, device=device, barrier=None)
    if mask is not None:
        mask.apply(logits)


def apply_custom_processors(info, draft_tokens: torch.Tensor, logits: torch.Tensor) -> None:
    """SGLang's custom logit processors (``--enable-custom-logit-processor``) on every block position, last, as
    SGLang's sampler applies them. Row (i, k) gets request i's custom params; a processor that reads the request
    (``__req__``) sees a shallow copy whose ``output_ids`` end with the drafts d_1..d_k, the history plain
    decoding shows it at that position. draft_tokens ``[bs, B]``; logits ``[bs * B, V]`` in place."""
    B = draft_tokens.shape[1]
    drafts = draft_tokens[:, 1:].tolist()
    for processor, mask in info.custom_logit_processor.values():
        reqs = mask.nonzero(as_tuple=True)[0].tolist()
        rows = torch.tensor([i * B + k for i in reqs for k in range(B)], device=logits.device)
        params = [params_after(info.custom_params[i], drafts[i][:k]) for i in reqs for k in range(B)]
        logits[rows] = processor(logits[rows], params)


def params_after(params: dict | None, drafts: list[int]) -> dict | None:
    """A request's custom params at the block position after ``drafts``: ``__req__`` (SGLang's Req, which history-
    dependent processors read) replaced by a shallow copy with the drafts appended to its output_ids."""
    if not drafts or not params or params.get("__req__") is None:
        return params
    req = copy.copy(params["__req__"])
    req.output_ids = copy.copy(req.output_ids)  # a list or an array('q'), as SGLang keeps it
    req.output_ids.extend(drafts)
    return {**params, "__req__": req}


def _short_and_penalized(reqs) -> tuple[list[int], list[int]]:
    """Indices of the requests still under their min_new_tokens, and of those with a penalty."""
    short = [i for i, r in enumerate(reqs) if r.sampling_params.min_new_tokens > len(r.output_ids)]
    penalized = [i for i, r in enumerate(reqs) if _has_penalty(r.sampling_params)]
    return short, penalized


def _has_penalty(sp) -> bool:
    """A request with a frequency, presence or repetition penalty (SGLang's neutral values: 0, 0, 1)."""
    return bool(sp.frequency_penalty) or bool(sp.presence_penalty) or sp.repetition_penalty != 1.0
