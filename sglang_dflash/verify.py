"""Linear-block verification rules for DFlash (torch only).

A verify block row is ``[last committed token, d_1, ..., d_{B-1}]``. The target runs one
forward over the row; its output at position ``i`` predicts the token after ``d_i``
(``d_0`` = the last committed token). Position ``i`` (0..B-2) is checked against draft token
``d_{i+1}``; position ``B-1`` only ever supplies a bonus token.

Both greedy and sampling verification produce ``target_tokens [b, B]`` and then share ONE
acceptance rule (:func:`accept`): ``accept_lens[r]`` = number of leading ``i`` with
``d_{i+1} == target_tokens[r, i]``, ``bonus_tokens[r] = target_tokens[r, accept_lens[r]]``,
committed tokens = ``d_1 .. d_{accept_len}, bonus``. For greedy, ``target_tokens`` is the argmax;
for sampling, :func:`sample_predictions` applies the exact rejection rule for a point-mass draft,
which makes the committed tokens distributed exactly as sampling from the target alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch

__all__ = ["BlockPenalties", "OutputCounts", "adjust_block_logits", "target_probs", "greedy_predictions", "sample_predictions", "accept"]


def _check_per_request(name: str, t: torch.Tensor, b: int, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor) or t.shape != (b,):
        got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
        raise ValueError(f"{name} must be a tensor of shape [batch]=({b},), got {got}; "
                         f"pass one value per request")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but logits are on {device}; move it to {device}")


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
) -> torch.Tensor:
    """Exact rejection sampling of target tokens for a point-mass (deterministic) draft.

    At position ``i`` in ``0..B-2`` with draft token ``x = d_{i+1}``: keep ``x`` with probability
    ``p_i(x)``; otherwise draw from ``p_i`` with ``x`` removed and renormalised. Position ``B-1``
    is drawn from ``p_{B-1}``. Each ``target_tokens[:, i]`` is therefore distributed exactly as
    ``p_i``, and equals ``x`` with the largest possible probability; :func:`accept` then commits
    tokens distributed exactly as the target's own sampling.

    Args:
        draft_tokens: ``[b, B]`` int64, the verify block rows (column 0 = last committed token).
        probs: ``[b, B, V]`` target probabilities from :func:`target_probs` for those rows.
        generator: optional ``torch.Generator`` on ``probs.device``.

    Returns:
        target_tokens: ``[b, B]`` int64.
    """
    if probs.dim() != 3 or draft_tokens.shape != probs.shape[:2]:
        raise ValueError(f"draft_tokens must be [batch, block_size] and probs [batch, block_size, vocab]; "
                         f"got {tuple(draft_tokens.shape)} and {tuple(probs.shape)}")
    if draft_tokens.dtype != torch.int64:
        raise ValueError(f"draft_tokens must be int64, got {draft_tokens.dtype}; use .long()")
    b, block_size, _ = probs.shape

    drafts = draft_tokens[:, 1:].unsqueeze(-1)  # [b, B-1, 1]
    p_draft = probs[:, :-1].gather(-1, drafts).squeeze(-1)  # [b, B-1]
    u = torch.rand((b, block_size - 1), generator=generator, device=probs.device, dtype=probs.dtype)
    keep = u < p_draft

    residual = probs.clone()
    residual[:, :-1].scatter_(-1, drafts, 0.0)
    # Exponential race: argmax_j q_j / E_j with E_j ~ Exp(1) is distributed as q / sum(q);
    # zero-probability tokens score 0 and are never picked (E is clamped away from 0).
    race = torch.empty_like(residual).exponential_(generator=generator)
    race.clamp_(min=torch.finfo(race.dtype).tiny)
    resampled = (residual / race).argmax(dim=-1)  # [b, B]

    target_tokens = resampled
    target_tokens[:, :-1] = torch.where(keep, draft_tokens[:, 1:], resampled[:, :-1])
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
