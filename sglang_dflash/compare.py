"""Comparing a greedy reply with a reference reply, exactly or (bfloat16) up to a near-tie of the reference.

In bfloat16 two correct forwards that group their arithmetic differently (a 16-token DFLASH verify and a 1-token
decode; SGLang's kernels and transformers' eager code) round differently, so a greedy choice between logits that are
equal or one or two bf16 steps apart can flip, and from there the replies continue differently. Measured on CPU
(24 prompts x 32 tokens, SmolLM2 bf16): 11 of 24 DFLASH replies parted from no-spec, always at a reference
top-2 gap of 0, 0.0625 or 0.125 nats; on the H200 a DFLASH reply also took the reference's third choice, within
0.125 nats of its first. A verification or sampling bug picks tokens the reference did not nearly tie.

The rule (one copy: the end-to-end tests and the serving benchmark's identity check use it): at the first token
where the two replies differ, the reply's token must be among the reference's ``TOPK`` choices there and no more
than ``TIE_NATS`` below the reference's own choice. Positions before that are compared as usual (logprobs within
``BF16_LOGPROB_ABS``). Pure Python: no torch, no sglang.
"""

from __future__ import annotations

from collections.abc import Sequence

TIE_NATS = 0.25
# Logprobs of the same token in two bf16 runs: SmolLM2's logits reach 16-32, where bf16 steps are 0.125, and the
# token's logit and the log-sum-exp can each move by a step or so (measured on CPU: up to 0.24 nats).
BF16_LOGPROB_ABS = 0.3
TOPK = 5  # how many top logprobs a reference reply carries (SGLang: top_logprobs_num)
REFERENCE_LOGPROBS = {"return_logprob": True, "top_logprobs_num": TOPK}  # SGLang /generate fields

# [(logprob, token id), ...] best first: the reference's choices at one position
TopChoices = Sequence[tuple[float, int]]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
    """Index of the first differing token of two replies (the shorter length if one extends the other), or None."""
    if list(a) == list(b):
        return None
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def near_tie_parting(ref_ids: Sequence[int], ids: Sequence[int], ref_top: Sequence[TopChoices]) -> int | None:
    """Index of the first token where ``ids`` leaves the reference ``ref_ids``, if it leaves it at a near-tie
    there (``ids``' token among ``ref_top[j]``, at most ``TIE_NATS`` below its best); None otherwise (equal
    replies, one a prefix of the other, no top choices recorded there, or a real parting)."""
    j = first_difference(ref_ids, ids)
    if j is None or j >= min(len(ref_ids), len(ids), len(ref_top)) or not ref_top[j]:
        return None
    best = ref_top[j][0][0]
    return next((j for lp, tok in ref_top[j] if tok == ids[j] and best - lp <= TIE_NATS), None)


def agreeing_length(ref_ids: Sequence[int], ids: Sequence[int], ref_top: Sequence[TopChoices],
                    near_ties: bool) -> int | None:
    """How many leading tokens ``ids`` shares with the reference: all of ``ref_ids`` when the replies are equal, the
    parting index when ``near_ties`` allows a near-tie parting there; None when ``ids`` is not accepted."""
    if list(ids) == list(ref_ids):
        return len(ref_ids)
    return near_tie_parting(ref_ids, ids, ref_top) if near_ties else None


def sglang_top(reply: dict) -> list[list[tuple[float, int]]]:
    """The top choices an SGLang /generate reply carries (``output_top_logprobs``), per output position."""
    return [[(lp, tok) for lp, tok, *_ in pos] for pos in reply["meta_info"].get("output_top_logprobs") or []]
