"""Linear-block verification rules for DFlash (torch only).

A verify block row is ``[last committed token, d_1, ..., d_{B-1}]``. The target runs one
forward over the row; its output at position ``i`` predicts the token after ``d_i``
(``d_0`` = the last committed token). Position ``i`` (0..B-2) is checked against draft token
``d_{i+1}``; position ``B-1`` only ever supplies a bonus token.

Both greedy and sampling verification produce ``target_tokens [b, B]`` and then share ONE
acceptance rule (:func:`accept`): ``accept_lens[r]`` = number of leading ``i`` with
``d_{i+1} == target_tokens[r, i]``, ``bonus_tokens[r] = target_tokens[r, accept_lens[r]]``,
committed tokens = ``d_1 .. d_{accept_len}, bonus``. For greedy, ``target_tokens`` is the argmax;
for sampling, :func:`sample_predictions` applies the exact rejection rule for the draft's proposal (a point mass,
or drafts drawn from the draft's own law), which makes the committed tokens distributed exactly as sampling from the
target alone.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["VocabSplit", "target_probs", "draw", "greedy_predictions", "sample_predictions", "accept"]


class VocabSplit:
    """Where a vocabulary-sized last dimension lives: whole on this process (``group`` None, `VocabSplit.whole`), or
    split over the ranks of ``group`` in ascending contiguous shards of ``total`` ids, this rank holding ids
    ``[start, start + size)`` (tensor parallelism's vocab-parallel lm_head). ``group.all_gather(t [1, ...], dim=0)``
    -> ``[ranks, ...]`` (SGLang's GroupCoordinator). The rules below take this rank's shard and return the same
    result on every rank, equal to the whole vocabulary's. Random draws stay in step across ranks: each rank draws
    the whole vocabulary's noise with the same generator state (as SGLang's sampler relies on) and uses its shard."""

    def __init__(self, start: int, size: int, total: int, group=None) -> None:
        self.start, self.size, self.total, self.group = start, size, total, group

    @classmethod
    def whole(cls, total: int) -> "VocabSplit":
        return cls(0, total, total)

    def local(self, t: torch.Tensor) -> torch.Tensor:
        """``[..., total]`` -> this rank's ``[..., size]`` (a view)."""
        return t if self.group is None else t[..., self.start:self.start + self.size]

    def gathered(self, t: torch.Tensor) -> torch.Tensor:
        """``[...]`` on each rank -> ``[ranks, ...]``."""
        return self.group.all_gather(t.unsqueeze(0).contiguous(), dim=0)

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """Per-rank partial sums ``[...]`` -> their total over the ranks ``[...]``."""
        return t if self.group is None else self.gathered(t).sum(dim=0)

    def at(self, t: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``t [..., size]`` (this rank's shard) at global ``ids [...]`` -> ``[...]``."""
        if self.group is None:
            return t.gather(-1, ids.unsqueeze(-1)).squeeze(-1)
        local = ids - self.start
        mine = (local >= 0) & (local < self.size)
        got = t.gather(-1, local.clamp(0, self.size - 1).unsqueeze(-1)).squeeze(-1)
        return self.sum(torch.where(mine, got, torch.zeros_like(got)))

    def argmax(self, scores: torch.Tensor) -> torch.Tensor:
        """This rank's scores ``[..., size]`` -> the argmax over the whole vocabulary ``[...]`` int64 (the first
        maximum: the lowest id within a rank, then the lowest rank)."""
        if self.group is None:
            return scores.argmax(dim=-1)
        value, index = scores.max(dim=-1)
        values, indices = self.gathered(value), self.gathered(index + self.start)
        return indices.gather(0, values.argmax(dim=0, keepdim=True)).squeeze(0)

    def softmax(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's shard of ``softmax(x)`` over the whole vocabulary: ``[..., size]`` float32."""
        x = x.to(torch.float32)
        if self.group is None:
            return torch.softmax(x, dim=-1)
        return torch.exp(x - self._logsumexp(x).unsqueeze(-1))

    def filtered_softmax(self, x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor,
                         candidates: int = 64) -> torch.Tensor:
        """This rank's shard ``[b, ..., size]`` of ``softmax(x)`` over the whole vocabulary under `target_probs`'
        top-k / top-p / min-p rule (``[b]`` each), decided on the ``candidates`` largest scores of the whole
        vocabulary (gathered from every rank's own largest): exact where top-k is at most ``candidates`` or the top-p
        cut falls among them, up to ties at the cut; where the cut lies beyond them, every token past them that
        min-p keeps stays in. Renormalised. (A proposal law, so it need not be exact: `sample_predictions` is exact
        for any law it is given.)"""
        x = x.to(torch.float32)
        bcast = (x.shape[0],) + (1,) * (x.dim() - 1)
        lse = self._logsumexp(x).unsqueeze(-1)
        mine = x.topk(min(candidates, x.shape[-1]), dim=-1).values
        if self.group is not None:
            mine = torch.movedim(self.gathered(mine), 0, -2).flatten(-2)
        cand = mine.topk(min(candidates, mine.shape[-1]), dim=-1).values  # [b, ..., K] descending
        K = cand.shape[-1]
        pc = torch.exp(cand - lse)
        k = top_k.view(bcast).to(torch.int64)
        k = torch.where((k < 1) | (k > self.total), torch.full_like(k, self.total), k)
        keep = ((torch.arange(K, device=x.device) < k) & (pc.cumsum(-1) - pc <= top_p.to(torch.float32).view(bcast))
                & (pc >= min_p.to(torch.float32).view(bcast) * pc[..., :1]))
        kept = keep.sum(-1, keepdim=True)  # a prefix of the candidates, at least the first
        cut = cand.gather(-1, kept - 1)
        cut = torch.where((kept == K) & (k > K), torch.full_like(cut, -torch.inf), cut)
        floor = cand[..., :1] + torch.log(min_p.to(torch.float32).view(bcast))
        law = torch.where((x >= cut) & (x >= floor), torch.exp(x - lse), torch.zeros_like(x))
        return law / self.sum(law.sum(-1)).unsqueeze(-1)

    def _logsumexp(self, x: torch.Tensor) -> torch.Tensor:
        """logsumexp of ``x [..., size]`` over the whole vocabulary ``[...]``."""
        lse = torch.logsumexp(x, dim=-1)
        return lse if self.group is None else torch.logsumexp(self.gathered(lse), dim=0)


def _check_per_request(name: str, t: torch.Tensor, b: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (b,):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [batch]=({b},), got {got}; "
                         f"pass one value per request")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logits are on {device}; move it to {device}")


def target_probs(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    *,
    needs_filter: Optional[bool] = None,
    any_greedy: Optional[bool] = None,
) -> torch.Tensor:
    """Target sampling distribution after SGLang's filtering rule (the one copy of it).

    Args:
        logits: ``[b, V]`` or ``[b, B, V]`` (any number of middle dims); float.
        temperature: ``[b]``; ``0`` means greedy (the row becomes one-hot at the argmax).
        top_k: ``[b]`` integer; keep the ``top_k`` most likely tokens (``< 1`` or ``>= V``: all).
        top_p: ``[b]`` in ``(0, 1]``; keep a token if the mass of strictly more likely tokens
            (in sorted order) is ``<= top_p`` (SGLang's rule; the most likely token is always kept).
        min_p: ``[b]`` in ``[0, 1]``; keep a token if its prob ``>= min_p * max prob``.
        needs_filter / any_greedy: host-side hints (e.g. from SGLang's SamplingBatchInfo) that some row
            filters / has temperature 0; None -> read from the tensors (one device sync each).

    Order: ``softmax(logits / temperature)``, then the top-k, top-p and min-p masks (all computed
    on that softmax), then renormalise.

    Returns:
        probs: float32, same shape as ``logits``; each row sums to 1.
    """
    if logits.dim() < 2:
        raise ValueError(f"logits must be [batch, ..., vocab], got shape {tuple(logits.shape)}")
    b, vocab = logits.shape[0], logits.shape[-1]
    for name, t in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p), ("min_p", min_p)):
        _check_per_request(name, t, b, logits.device)
    bcast = (b,) + (1,) * (logits.dim() - 1)

    temp = temperature.to(torch.float32).view(bcast)
    greedy = temp <= 0
    scaled = logits.to(torch.float32) / torch.where(greedy, torch.ones_like(temp), temp)
    probs = torch.softmax(scaled, dim=-1)

    k = top_k.view(bcast).to(torch.int64)
    k = torch.where((k < 1) | (k > vocab), torch.full_like(k, vocab), k)
    # The sort (and its ~5 vocab-sized temporaries) only when some row actually filters.
    if needs_filter is None:
        needs_filter = bool(((k < vocab) | (top_p.view(bcast) < 1) | (min_p.view(bcast) > 0)).any())
    if needs_filter:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = (
            (rank < k)
            & (mass_before <= top_p.to(torch.float32).view(bcast))
            & (sorted_probs >= min_p.to(torch.float32).view(bcast) * sorted_probs[..., :1])
        )
        del sorted_probs, mass_before
        keep = torch.zeros_like(keep_sorted).scatter_(-1, order, keep_sorted)
        probs = probs.masked_fill_(~keep, 0.0)
        probs = probs / probs.sum(dim=-1, keepdim=True)

    if any_greedy is None:
        any_greedy = bool(greedy.any())
    if any_greedy:
        one_hot = torch.zeros_like(probs).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)
        probs = torch.where(greedy, one_hot, probs)
    return probs


def draw(weights: torch.Tensor, generator: Optional[torch.Generator] = None,
         vocab: Optional[VocabSplit] = None) -> torch.Tensor:
    """One token per row of ``weights [..., V]`` (non-negative, not necessarily normalised), drawn with probability
    ``weights / weights.sum(-1)`` -> ``[...]`` int64. An exponential race, ``argmax_j w_j / E_j`` with
    ``E_j ~ Exp(1)``: no host sync and no data-dependent shape, so it runs inside a CUDA graph; zero-weight tokens
    score 0 and are never drawn (E is clamped away from 0). With ``vocab``, ``weights`` is this rank's shard
    ``[..., vocab.size]`` and the race runs over the whole vocabulary's (the same token on every rank)."""
    if vocab is None or vocab.group is None:
        vocab = VocabSplit.whole(weights.shape[-1])
    race = vocab.local(weights.new_empty(weights.shape[:-1] + (vocab.total,)).exponential_(generator=generator))
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    return vocab.argmax(weights / race)


def greedy_predictions(target_logits: torch.Tensor) -> torch.Tensor:
    """Greedy target tokens: ``target_logits [b, B, V] -> target_tokens [b, B]`` int64 (argmax)."""
    if target_logits.dim() != 3:
        raise ValueError(f"target_logits must be [batch, block_size, vocab], got shape "
                         f"{tuple(target_logits.shape)}")
    return target_logits.argmax(dim=-1).to(torch.int64)


def sample_predictions(
    draft_tokens: torch.Tensor,
    probs: torch.Tensor,
    generator: Optional[torch.Generator] = None,
    draft_probs: Optional[torch.Tensor] = None,
    vocab: Optional[VocabSplit] = None,
) -> torch.Tensor:
    """Exact speculative sampling of the target tokens of a verify block.

    At position ``i`` in ``0..B-2`` with draft token ``x = d_{i+1}`` drawn from the proposal ``q_i``: keep ``x``
    with probability ``min(1, p_i(x) / q_i(x))``; otherwise draw from ``max(p_i - q_i, 0)`` renormalised. Without
    ``draft_probs`` the proposal is a point mass on ``x`` (a deterministic draft): keep ``x`` with probability
    ``p_i(x)``, otherwise draw from ``p_i`` with ``x`` removed. Position ``B-1`` is drawn from ``p_{B-1}``. Each
    ``target_tokens[:, i]`` is therefore distributed exactly as ``p_i`` (for any proposal that does not see the
    target's draws), and :func:`accept` commits tokens distributed exactly as the target's own sampling.

    Args:
        draft_tokens: ``[b, B]`` int64, the verify block rows (column 0 = last committed token).
        probs: ``[b, B, V]`` target probabilities from :func:`target_probs` for those rows.
        generator: optional ``torch.Generator`` on ``probs.device``.
        draft_probs: ``[b, B-1, V]`` the laws ``d_1 .. d_{B-1}`` were drawn from, or None (point masses); under a
            split ``vocab``, this rank's shard ``[b, B-1, vocab.size]`` (``probs`` stays whole).
        vocab: the `VocabSplit` of ``draft_probs`` (None: the whole vocabulary).

    Returns:
        target_tokens: ``[b, B]`` int64 (the same on every rank of ``vocab``).
    """
    if probs.dim() != 3 or draft_tokens.shape != probs.shape[:2]:
        raise ValueError(f"draft_tokens must be [batch, block_size] and probs [batch, block_size, vocab]; "
                         f"got {tuple(draft_tokens.shape)} and {tuple(probs.shape)}")
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64, got {draft_tokens.dtype}; use .long()")
    b, block_size, V = probs.shape
    if vocab is None or vocab.group is None or draft_probs is None:
        vocab = VocabSplit.whole(V)
    if vocab.total != V:
        raise ValueError(f"probs cover {V} ids but the split vocabulary has {vocab.total}; pass the whole vocabulary's "
                         "target probabilities")
    if draft_probs is not None and draft_probs.shape != (b, block_size - 1, vocab.size):
        raise ValueError(f"draft_probs must be [batch, block_size - 1, vocab] = {(b, block_size - 1, vocab.size)}, "
                         f"got {tuple(draft_probs.shape)}")

    drafts = draft_tokens[:, 1:]  # [b, B-1]
    p_draft = probs[:, :-1].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)  # [b, B-1]
    u = torch.rand((b, block_size - 1), generator=generator, device=probs.device, dtype=probs.dtype)
    residual = vocab.local(probs).clone()
    if draft_probs is None:
        keep = u < p_draft
        residual[:, :-1].scatter_(-1, drafts.unsqueeze(-1), 0.0)
    else:
        q = draft_probs.to(probs.dtype)
        keep = u * vocab.at(q, drafts) < p_draft
        own = vocab.local(probs[:, :-1])
        residual[:, :-1] = (own - q).clamp_(min=0.0)
        # p == q leaves no residual, and then no rejection either: any row serves
        empty = vocab.sum(residual[:, :-1].sum(-1)).unsqueeze(-1) <= 0
        residual[:, :-1] = torch.where(empty, own, residual[:, :-1])
    resampled = draw(residual, generator, vocab)  # [b, B]

    target_tokens = resampled
    target_tokens[:, :-1] = torch.where(keep, drafts, resampled[:, :-1])
    return target_tokens


def accept(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The acceptance rule shared by greedy and sampling verification.

    Args:
        draft_tokens: ``[b, B]`` verify block rows ``[last, d_1, ..., d_{B-1}]``.
        target_tokens: ``[b, B]`` target predictions for those rows.

    Returns:
        accept_lens: ``[b]`` int64, number of leading ``i`` with ``d_{i+1} == target_tokens[:, i]``
            (``0..B-1``).
        bonus_tokens: ``[b]`` int64, ``target_tokens[:, accept_lens]``. Committed tokens are
            ``d_1 .. d_{accept_len}`` followed by the bonus token.
    """
    if draft_tokens.dim() != 2 or draft_tokens.shape != target_tokens.shape:
        raise ValueError(f"draft_tokens and target_tokens must both be [batch, block_size]; got "
                         f"{tuple(draft_tokens.shape)} and {tuple(target_tokens.shape)}")
    matches = draft_tokens[:, 1:] == target_tokens[:, :-1]
    accept_lens = matches.to(torch.int64).cumprod(dim=-1).sum(dim=-1)
    bonus_tokens = target_tokens.gather(1, accept_lens.unsqueeze(1)).squeeze(1).to(torch.int64)
    return accept_lens, bonus_tokens
