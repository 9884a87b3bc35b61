"""The near-tie rule (sglang_dflash.compare) on hand-built replies: what the bf16 comparisons of the end-to-end tests
and the serving benchmark accept."""

from sglang_dflash import compare


def _reply(ids, tops=None):
    return {"output_ids": ids, "meta_info": {} if tops is None else {"output_top_logprobs": tops}}


def _parting(want: dict, got: dict) -> int | None:
    return compare.near_tie_parting(want["output_ids"], got["output_ids"], compare.sglang_top(want))


def test_near_tie_parting_rule():
    tops = [[(-0.1, 5, None), (-3.0, 6, None)],
            [(-1.00, 7, None), (-1.0625, 8, None), (-1.125, 2, None), (-1.5, 3, None)],
            [(-0.5, 9, None), (-2.0, 1, None)]]
    want = _reply([5, 7, 9], tops)
    assert _parting(want, _reply([5, 8, 4])) == 1  # the runner-up, 0.0625 behind
    assert _parting(want, _reply([5, 2, 4])) == 1  # the third choice, 0.125 behind
    assert _parting(want, _reply([5, 3, 9])) is None  # among the top choices, but 0.5 behind
    assert _parting(want, _reply([5, 4, 9])) is None  # not among the top choices
    assert _parting(want, _reply([6, 7, 9])) is None  # a 2.9-nat gap is no tie
    assert _parting(want, _reply([5, 7, 9])) is None  # no parting at all
    assert _parting(want, _reply([5, 7])) is None  # a prefix: cut short, not parted
    assert _parting(_reply([5, 7, 9]), _reply([5, 8, 9])) is None  # no logprobs to judge by
    # agreeing_length: the shared length the end-to-end helpers compare logprobs over
    top = compare.sglang_top(want)
    assert compare.agreeing_length([5, 7, 9], [5, 7, 9], top, near_ties=False) == 3
    assert compare.agreeing_length([5, 7, 9], [5, 8, 4], top, near_ties=True) == 1
    assert compare.agreeing_length([5, 7, 9], [5, 8, 4], top, near_ties=False) is None  # float32: exact only
    assert compare.agreeing_length([5, 7, 9], [6, 7, 9], top, near_ties=True) is None
