"""Verification rules: target filtering, greedy acceptance, and exactness of sampled verification."""

import math

import pytest
import torch

from sglang_dflash.verify import accept, greedy_predictions, sample_predictions, target_probs

# ---------------------------------------------------------------------------------------------
# target_probs: the one filtering rule
# ---------------------------------------------------------------------------------------------

BASE = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05])


def _probs(temperature=1.0, top_k=-1, top_p=1.0, min_p=0.0, logits=None):
    logits = BASE.log().unsqueeze(0) if logits is None else logits
    b = logits.shape[0]
    return target_probs(logits, torch.full((b,), temperature), torch.full((b,), top_k, dtype=torch.int64),
                        torch.full((b,), top_p), torch.full((b,), min_p))


def _renorm(*vals):
    t = torch.tensor(vals + (0.0,) * (5 - len(vals)))
    return (t / t.sum()).unsqueeze(0)


@pytest.mark.parametrize("kwargs, expected", [
    ({}, _renorm(0.5, 0.2, 0.15, 0.1, 0.05)),
    ({"top_k": 5}, _renorm(0.5, 0.2, 0.15, 0.1, 0.05)),
    ({"top_k": 0}, _renorm(0.5, 0.2, 0.15, 0.1, 0.05)),
    ({"top_k": 2}, _renorm(0.5, 0.2)),
    ({"top_k": 1}, _renorm(0.5)),
    ({"top_p": 0.69}, _renorm(0.5, 0.2)),       # mass before 3rd token is 0.7 > 0.69
    ({"top_p": 0.72}, _renorm(0.5, 0.2, 0.15)),  # mass before 3rd is 0.7 <= 0.72, before 4th 0.85
    ({"top_p": 0.1}, _renorm(0.5)),              # the most likely token is always kept
    ({"min_p": 0.3}, _renorm(0.5, 0.2, 0.15)),   # threshold 0.15, kept inclusively
    ({"min_p": 0.35}, _renorm(0.5, 0.2)),
    ({"top_k": 4, "top_p": 0.72, "min_p": 0.35}, _renorm(0.5, 0.2)),
    ({"temperature": 0.5}, _renorm(0.25, 0.04, 0.0225, 0.01, 0.0025)),
    ({"temperature": 0.5, "top_k": 2}, _renorm(0.25, 0.04)),
    ({"temperature": 0.0, "top_k": 3, "top_p": 0.5}, _renorm(1.0)),
])
def test_target_probs_filtering(kwargs, expected):
    probs = _probs(**kwargs)
    assert probs.dtype == torch.float32
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)


def test_target_probs_token_order_and_per_request_params():
    # Permuted vocabulary (token j has prob BASE[perm[j]]), [b=2, B=3, V=5] logits, params per request.
    perm = torch.tensor([3, 0, 4, 1, 2])
    logits = BASE.log()[perm].expand(2, 3, 5).clone()
    logits[1, 2] = torch.tensor([0.0, 1.0, 5.0, 2.0, 3.0])
    probs = target_probs(logits, torch.tensor([1.0, 0.0]), torch.tensor([2, 3]), torch.tensor([1.0, 1.0]),
                         torch.tensor([0.0, 0.0]))
    top2 = torch.tensor([0.0, 5 / 7, 0.0, 2 / 7, 0.0])  # tokens 1 (p=0.5) and 3 (p=0.2)
    torch.testing.assert_close(probs[0], top2.expand(3, 5), atol=1e-6, rtol=0)
    greedy_rows = torch.tensor([[0.0, 1, 0, 0, 0], [0.0, 1, 0, 0, 0], [0.0, 0, 1, 0, 0]])
    assert torch.equal(probs[1], greedy_rows)


def test_target_probs_rejects_bad_param_shapes():
    logits = torch.zeros(2, 4, 7)
    ok = (torch.ones(2), torch.full((2,), -1), torch.ones(2), torch.zeros(2))
    with pytest.raises(ValueError, match=r"temperature must be a tensor of shape \[batch\]=\(2,\)"):
        target_probs(logits, torch.ones(3), *ok[1:])
    with pytest.raises(ValueError, match="top_p must be a tensor"):
        target_probs(logits, ok[0], ok[1], 0.9, ok[3])
    with pytest.raises(ValueError, match=r"logits must be \[batch, \.\.\., vocab\]"):
        target_probs(torch.zeros(7), *ok)


# ---------------------------------------------------------------------------------------------
# Greedy verification
# ---------------------------------------------------------------------------------------------

def test_greedy_accept_hand_built():
    vocab = 10
    blocks = torch.tensor([
        [5, 1, 2, 3, 4],   # all four drafts match -> accept 4, bonus = target[4]
        [5, 1, 2, 3, 4],   # d_1 wrong -> accept 0
        [5, 1, 2, 3, 4],   # d_3 wrong -> accept 2
        [5, 1, 2, 3, 4],   # d_1 wrong but later ones "match": still stops at 0
        [0, 0, 0, 0, 0],   # repeated tokens, all match
    ])
    targets = torch.tensor([
        [1, 2, 3, 4, 9],
        [7, 2, 3, 4, 9],
        [1, 2, 8, 4, 9],
        [6, 2, 3, 4, 9],
        [0, 0, 0, 0, 3],
    ])
    logits = torch.nn.functional.one_hot(targets, vocab).float() * 4.0 - 2.0
    target_tokens = greedy_predictions(logits)
    assert target_tokens.dtype == torch.int64
    assert torch.equal(target_tokens, targets)
    accept_lens, bonus_tokens = accept(blocks, target_tokens)
    assert accept_lens.dtype == torch.int64 and bonus_tokens.dtype == torch.int64
    assert accept_lens.tolist() == [4, 0, 2, 0, 4]
    assert bonus_tokens.tolist() == [9, 7, 8, 6, 3]


def test_greedy_predictions_rejects_2d():
    with pytest.raises(ValueError, match=r"\[batch, block_size, vocab\]"):
        greedy_predictions(torch.zeros(3, 5))


def test_accept_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="must both be"):
        accept(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64))


def test_sampling_with_temperature_zero_is_greedy():
    """One-hot probs (temperature 0) make the rejection rule reproduce greedy verification exactly,
    also when mixed with sampled rows in one batch."""
    gen = torch.Generator().manual_seed(0)
    b, block_size, vocab = 64, 6, 11
    logits = torch.randn(b, block_size, vocab, generator=gen)
    greedy = greedy_predictions(logits)
    drafts = torch.randint(0, vocab, (b, block_size), generator=gen)
    drafts[::3, 1:] = greedy[::3, :-1]  # every third row fully right
    temperature = torch.zeros(b)
    temperature[1::2] = 1.0  # odd rows sample
    probs = target_probs(logits, temperature, torch.full((b,), -1), torch.ones(b), torch.zeros(b))
    target_tokens = sample_predictions(drafts, probs, gen)
    assert target_tokens.dtype == torch.int64
    even = torch.arange(0, b, 2)
    assert torch.equal(target_tokens[even], greedy[even])
    assert torch.equal(accept(drafts[even], target_tokens[even])[0], accept(drafts[even], greedy[even])[0])


def test_sample_predictions_rejects_bad_inputs():
    probs = torch.full((2, 4, 5), 0.2)
    with pytest.raises(ValueError, match=r"draft_tokens must be \[batch, block_size\]"):
        sample_predictions(torch.zeros(2, 3, dtype=torch.int64), probs)
    with pytest.raises(ValueError, match="draft_tokens must be int64"):
        sample_predictions(torch.zeros(2, 4, dtype=torch.int32), probs)


# ---------------------------------------------------------------------------------------------
# Sampling verification is exact: two emitted tokens vs the target's own joint distribution
# ---------------------------------------------------------------------------------------------
#
# Toy target: a Markov chain over V=6 tokens, next-token logits TABLE[prev]. Every request starts
# from token START and verifies a block [START, d_1, d_2] (B=3). The first two emitted tokens
# (t1, t2) come from the committed tokens of that step, or, when only the bonus was committed, t2
# is the first token emitted by a second verify step started from t1. Exactness means
# P(t1, t2) = P[START, t1] * P[t1, t2] with P = target_probs(TABLE).
#
# Bound: for n draws of a K-cell distribution p, E[TV] <= 0.5 * sum_k sqrt(p_k (1 - p_k) / n)
# (Jensen on each |empirical - p_k|). We assert TV < 4 * that. TV has bounded differences (1/n
# per draw), so by McDiarmid P(TV > E[TV] + t) <= exp(-2 n t^2); with n = 200k and the slack
# t = 3/4 of the asserted bound (>= 0.0048 in every case here), a correct rule fails a case with
# probability < 1e-4 (and the seeds are fixed, so the outcome is deterministic). Observed TVs are
# 0.001-0.004 against bounds of 0.006-0.021; the broken rules below give TV 0.18-0.97.

V = 6
START = 0
N_DRAWS = 200_000
TABLE = torch.randn(V, V, generator=torch.Generator().manual_seed(1234)) * 1.5
FILTERS = {"none": (-1, 1.0, 0.0), "top_k_top_p_min_p": (4, 0.85, 0.05), "top_p": (-1, 0.7, 0.0)}


def _params(n, temperature, filt):
    top_k, top_p, min_p = FILTERS[filt]
    return (torch.full((n,), temperature), torch.full((n,), top_k, dtype=torch.int64),
            torch.full((n,), top_p), torch.full((n,), min_p))


def _draft(prev, policy, step):
    """Deterministic point-mass draft token after ``prev`` [n] for draft position ``step`` (1 or 2)."""
    right = TABLE[prev].argmax(-1)
    wrong = TABLE[prev].argmin(-1)  # least likely: filtered to zero prob whenever filtering is on
    if policy == "right" or (policy == "half" and step == 1):
        return right
    if policy == "wrong" or policy == "half":
        return wrong
    assert policy == "scrambled"  # a fixed arbitrary function of the context
    return (prev * 5 + step * 3 + 1) % V


def _always_accept(drafts, probs, generator, draft_probs=None):
    tokens = sample_predictions(drafts, probs, generator, draft_probs=draft_probs)
    tokens[:, :-1] = drafts[:, 1:]
    return tokens


def _residual_ignores_proposal(drafts, probs, generator, draft_probs=None):
    """Broken: keeps a drawn draft with min(1, p / q) but on rejection draws from p instead of max(p - q, 0)."""
    q = draft_probs.gather(-1, drafts[:, 1:, None])[..., 0]
    keep = torch.rand(q.shape, generator=generator) * q < probs[:, :-1].gather(-1, drafts[:, 1:, None])[..., 0]
    fresh = torch.multinomial(probs.view(-1, V), 1, generator=generator).view(probs.shape[:2])
    fresh[:, :-1] = torch.where(keep, drafts[:, 1:], fresh[:, :-1])
    return fresh


def _resample_without_removing_draft(drafts, probs, generator, draft_probs=None):
    """Broken: on rejection draws from p_i itself instead of p_i with the draft token removed."""
    b, block_size, _ = probs.shape
    x = drafts[:, 1:]
    keep = torch.rand(b, block_size - 1, generator=generator) < probs[:, :-1].gather(-1, x[..., None])[..., 0]
    fresh = torch.multinomial(probs.view(-1, V), 1, generator=generator).view(b, block_size)
    fresh[:, :-1] = torch.where(keep, x, fresh[:, :-1])
    return fresh


# A proposal law unlike the target's ("sampled" policy: each draft drawn from it, after the previous draft)
Q_TABLE = TABLE * 0.6 + torch.randn(V, V, generator=torch.Generator().manual_seed(99))


def _verify_step(last, policy, params, rule, gen):
    """One verify step from ``last`` [n]; returns the block [n, 3], accept_lens [n], bonus [n]."""
    if policy == "sampled":
        q1 = torch.softmax(Q_TABLE[last], -1)
        d1 = torch.multinomial(q1, 1, generator=gen)[:, 0]
        q2 = torch.softmax(Q_TABLE[d1], -1)
        d2 = torch.multinomial(q2, 1, generator=gen)[:, 0]
        extra = {"draft_probs": torch.stack([q1, q2], dim=1)}
    else:
        d1 = _draft(last, policy, 1)
        d2 = _draft(d1, policy, 2)
        extra = {}
    block = torch.stack([last, d1, d2], dim=1)
    probs = target_probs(TABLE[block], *params)
    accept_lens, bonus = accept(block, rule(block, probs, gen, **extra))
    return block, accept_lens, bonus


def _emitted_pairs(policy, temperature, filt, rule, n=N_DRAWS, seed=0):
    gen = torch.Generator().manual_seed(seed)
    params = _params(n, temperature, filt)
    block, accept_lens, bonus = _verify_step(torch.full((n,), START), policy, params, rule, gen)
    t1 = torch.where(accept_lens >= 1, block[:, 1], bonus)
    block2, accept_lens2, bonus2 = _verify_step(t1, policy, params, rule, gen)
    second_step_first = torch.where(accept_lens2 >= 1, block2[:, 1], bonus2)
    t2 = torch.where(accept_lens >= 2, block[:, 2], torch.where(accept_lens == 1, bonus, second_step_first))
    return t1, t2


def _tv_and_bound(policy, temperature, filt, rule=sample_predictions):
    t1, t2 = _emitted_pairs(policy, temperature, filt, rule)
    empirical = torch.bincount(t1 * V + t2, minlength=V * V).double() / N_DRAWS
    p = target_probs(TABLE, *_params(V, temperature, filt)).double()  # p[prev, next]
    exact = (p[START].unsqueeze(1) * p).reshape(-1)
    tv = 0.5 * (empirical - exact).abs().sum().item()
    bound = 4 * 0.5 * (exact * (1 - exact) / N_DRAWS).sqrt().sum().item()
    return tv, bound


@pytest.mark.parametrize("filt", list(FILTERS))
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize("policy", ["right", "wrong", "half", "scrambled", "sampled"])
def test_sampled_verification_matches_target_distribution(policy, temperature, filt):
    tv, bound = _tv_and_bound(policy, temperature, filt)
    assert tv < bound, f"TV {tv:.5f} >= bound {bound:.5f}"


def test_draft_policies_exercise_both_outcomes():
    """The drafts above really get accepted and rejected (otherwise the test would be weak)."""
    gen = torch.Generator().manual_seed(3)
    params = _params(20_000, 1.0, "none")
    last = torch.full((20_000,), START)
    lens_right = _verify_step(last, "right", params, sample_predictions, gen)[1]
    lens_half = _verify_step(last, "half", params, sample_predictions, gen)[1]
    lens_wrong_filtered = _verify_step(last, "wrong", _params(20_000, 1.0, "top_k_top_p_min_p"),
                                       sample_predictions, gen)[1]
    assert set(lens_right.tolist()) == {0, 1, 2}
    assert set(lens_half.tolist()) <= {0, 1, 2} and (lens_half >= 1).any() and (lens_half <= 1).any()
    assert lens_wrong_filtered.eq(0).all()


@pytest.mark.parametrize("rule,policy", [(_always_accept, "right"), (_always_accept, "scrambled"),
                                         (_resample_without_removing_draft, "right"),
                                         (_resample_without_removing_draft, "scrambled"),
                                         (_always_accept, "sampled"), (_residual_ignores_proposal, "sampled")])
def test_bound_detects_broken_rules(rule, policy):
    tv, bound = _tv_and_bound(policy, 1.0, "none", rule=rule)
    assert tv > 2 * bound, f"broken rule {rule.__name__} not detected: TV {tv:.5f}, bound {bound:.5f}"
    assert math.isfinite(tv)


def test_adjust_block_logits_matches_token_by_token_rule():
    """Each block position gets exactly the adjustment plain decoding applies at that output length."""
    from sglang_dflash.adapter.sampling import adjust_block_logits

    g = torch.Generator().manual_seed(0)
    b, blk, v = 3, 5, 11
    logits = torch.randn(b, blk, v, generator=g)
    bias = torch.zeros(b, v)
    bias[0, 4], bias[2, 7] = 3.0, -2.5
    stops = [[2], [2, 9], [5]]
    pen = torch.zeros(b, v)
    for i, ids in enumerate(stops):
        pen[i, ids] = float("-inf")
    num_output = torch.tensor([1, 6, 2])
    min_new = torch.tensor([4, 0, 9])
    got = adjust_block_logits(logits.clone(), bias, pen, num_output, min_new)
    want = logits.clone()
    for i in range(b):
        for k in range(blk):
            want[i, k] += bias[i]
            if num_output[i] + k < min_new[i]:  # token-by-token: stop ids banned while the output is short
                want[i, k, stops[i]] = float("-inf")
    assert torch.equal(got, want)
    # request 0 may stop from position 3 on (1 + 3 = 4 tokens), request 2 never within this block
    assert torch.isinf(got[0, :3, 2]).all() and torch.isfinite(got[0, 3:, 2]).all()
    assert torch.isinf(got[2, :, 5]).all() and torch.isfinite(got[1]).all()
    only_bias = adjust_block_logits(logits.clone(), bias)
    assert torch.equal(only_bias, logits + bias[:, None, :])


def _penalized_reference(logits, counts, block_tokens, freq, pres, rep, bias=None):
    """Token-by-token rule: at block position k the outputs so far are the committed ones plus d_1..d_k;
    frequency and presence are subtracted, then tokens already output are scaled by the repetition penalty
    (SGLang: x * r where x < 0, else x / r), then logit_bias is added."""
    b, blk, v = logits.shape
    want = logits.clone()
    for i in range(b):
        for k in range(blk):
            c = counts[i].clone()
            for t in block_tokens[i, 1:k + 1].tolist():
                c[t] += 1
            x = want[i, k] - freq[i] * c - pres[i] * (c > 0).float()
            x = torch.where(c > 0, torch.where(x < 0, x * rep[i], x / rep[i]), x)
            want[i, k] = x + (bias[i] if bias is not None else 0.0)
    return want


@pytest.mark.parametrize("b,blk,v", [(3, 5, 11), (4, 7, 13), (1, 2, 5), (5, 16, 37)])
def test_block_penalties_match_token_by_token_rule(b, blk, v):
    """Frequency / presence / repetition penalties per block position equal the token-by-token rule, with
    draft tokens repeated inside the block and drafts that are already among the committed outputs."""
    from sglang_dflash.adapter.sampling import BlockPenalties, adjust_block_logits

    g = torch.Generator().manual_seed(b * 100 + blk)
    logits = torch.randn(b, blk, v, generator=g) * 3
    counts = torch.zeros(b, v)
    for i in range(b):
        for t in torch.randint(0, v, (4 + i,), generator=g).tolist():
            counts[i, t] += 1
    block_tokens = torch.randint(0, max(2, v // 3), (b, blk), generator=g)  # few distinct ids: repeats
    freq = torch.rand(b, generator=g) * 2 - 0.5
    pres = torch.rand(b, generator=g) * 2 - 0.5
    rep = 0.5 + torch.rand(b, generator=g) * 1.5
    freq[0], pres[0], rep[0] = 0.0, 0.0, 1.0  # a request without penalties in the same batch
    bias = torch.randn(b, v, generator=g)
    p = BlockPenalties(counts, block_tokens, freq, pres, rep)
    got = adjust_block_logits(logits.clone(), bias, penalties=p)
    want = _penalized_reference(logits, counts, block_tokens, freq, pres, rep, bias)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-5)
    assert torch.equal(got[0], logits[0] + bias[0])  # neutral values leave the row exactly unchanged
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_block_penalties_each_kind_alone_and_with_min_new_tokens():
    """Each penalty alone (the others neutral), combined with min_new_tokens: the stop ban stays -inf under the
    repetition scaling and every finite entry follows the token-by-token rule."""
    from sglang_dflash.adapter.sampling import BlockPenalties, adjust_block_logits

    g = torch.Generator().manual_seed(7)
    b, blk, v = 2, 6, 9
    logits = torch.randn(b, blk, v, generator=g)
    counts = torch.zeros(b, v)
    counts[0, 3], counts[1, [1, 4]] = 2, 1
    block_tokens = torch.tensor([[3, 5, 5, 2, 3, 8], [4, 4, 1, 6, 6, 6]])
    stops = torch.zeros(b, v)
    stops[:, 2] = float("-inf")
    zero, one = torch.zeros(b), torch.ones(b)
    for freq, pres, rep in ((one * 0.7, zero, one), (zero, one * 1.3, one), (zero, zero, one * 1.8)):
        p = BlockPenalties(counts, block_tokens, freq, pres, rep)
        got = adjust_block_logits(logits.clone(), None, stops, torch.tensor([3, 9]), torch.tensor([6, 0]), p)
        want = _penalized_reference(logits, counts, block_tokens, freq, pres, rep)
        want[0, :3, 2] = float("-inf")  # outputs 3, 4, 5 < min_new_tokens 6
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # position 2 of request 0 saw d_1 = d_2 = 5: frequency counts it twice, presence once
    p = BlockPenalties(counts, block_tokens, one * 0.7, one * 1.3, one)
    got = adjust_block_logits(logits.clone(), penalties=p)
    assert got[0, 2, 5].item() == pytest.approx(logits[0, 2, 5].item() - 2 * 0.7 - 1.3, abs=1e-6)
    assert got[0, 0, 5].item() == pytest.approx(logits[0, 0, 5].item(), abs=1e-7)  # not output before position 1


def test_output_counts_follow_growing_outputs_and_batch_changes():
    """OutputCounts equals a from-scratch bincount after every step: outputs grow, a request leaves and comes
    back, rows move, an output gets shorter."""
    from sglang_dflash.adapter.sampling import OutputCounts

    v = 17
    g = torch.Generator().manual_seed(3)
    outs = {k: torch.randint(0, v, (n,), generator=g).tolist() for k, n in (("a", 3), ("b", 1), ("c", 6))}
    oc = OutputCounts(v, "cpu")

    def check(keys, rows, bs):
        got = oc.gather(keys, [outs[k] for k in keys], rows, bs)
        want = torch.zeros(bs, v)
        for k, r in zip(keys, rows):
            want[r] = torch.bincount(torch.tensor(outs[k], dtype=torch.int64), minlength=v).float()
        assert torch.equal(got, want), (keys, rows)

    check(["a", "b", "c"], [0, 1, 3], 4)
    for step in range(4):
        for k in outs:
            outs[k] += torch.randint(0, v, (1 + step,), generator=g).tolist()  # a verify step commits 1..B tokens
        check(["a", "b", "c"] if step != 1 else ["c", "a"], [0, 1, 2] if step != 1 else [0, 1], 3)
    outs["b"] = outs["b"][:2]  # shorter than what was counted: rebuilt
    check(["b"], [0], 1)
    check([], [], 2)


def test_drawn_drafts_are_accepted_more_often_with_their_law_than_as_point_masses():
    """The same drafts drawn from q: the proposal rule keeps d_1 with probability sum_x min(p, q), the point-mass
    rule with sum_x q p (both exact); the first must show in the accept lengths."""
    gen = torch.Generator().manual_seed(5)
    n = 40_000
    params = _params(n, 1.0, "none")
    last = torch.full((n,), START)
    q1 = torch.softmax(Q_TABLE[last], -1)
    d1 = torch.multinomial(q1, 1, generator=gen)[:, 0]
    q2 = torch.softmax(Q_TABLE[d1], -1)
    d2 = torch.multinomial(q2, 1, generator=gen)[:, 0]
    block = torch.stack([last, d1, d2], dim=1)
    probs = target_probs(TABLE[block], *params)
    with_law = accept(block, sample_predictions(block, probs, gen, draft_probs=torch.stack([q1, q2], 1)))[0]
    as_points = accept(block, sample_predictions(block, probs, gen))[0]
    p1 = probs[0, 0]
    expect_law, expect_points = torch.minimum(p1, q1[0]).sum().item(), (p1 * q1[0]).sum().item()
    assert expect_law > expect_points + 0.05
    assert (with_law >= 1).double().mean().item() == pytest.approx(expect_law, abs=0.01)
    assert (as_points >= 1).double().mean().item() == pytest.approx(expect_points, abs=0.01)


def test_sample_predictions_rejects_a_draft_law_of_the_wrong_shape():
    probs = torch.full((2, 3, V), 1.0 / V)
    with pytest.raises(ValueError, match=r"draft_probs must be \[batch, block_size - 1, vocab\]"):
        sample_predictions(torch.zeros(2, 3, dtype=torch.int64), probs, draft_probs=torch.full((2, 3, V), 1.0 / V))


def test_candidate_filtered_law_is_target_probs_where_the_cut_falls_among_the_candidates():
    """`VocabSplit.filtered_softmax` (the draft's filtered law under tensor parallelism, decided on the K largest
    scores) equals `target_probs`' filtered law where top-k <= K, where the top-p / min-p cut falls among the K, and
    where min-p alone cuts past them; where a top-p cut lies past them (top-p 0.999, no top-k) its support holds
    `target_probs`' and it still sums to 1."""
    from sglang_dflash.verify import VocabSplit

    g = torch.Generator().manual_seed(5)
    V, K = 301, 8
    x = torch.randn(7, 3, V, generator=g) * 2.5
    top_k = torch.tensor([1, 5, 8, -1, -1, -1, -1])
    top_p = torch.tensor([1.0, 0.9, 1.0, 0.3, 1.0, 1.0, 0.999])
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0, 0.2, 0.01, 0.0])
    got = VocabSplit.whole(V).filtered_softmax(x, top_k, top_p, min_p, candidates=K)
    want = target_probs(x, torch.ones(7), top_k, top_p, min_p)
    support = (want > 0).sum(-1)
    assert (support[3:5] <= K).all() and (support[5:] > K).all()  # cuts among the K / past them
    torch.testing.assert_close(got[:6], want[:6], rtol=1e-5, atol=1e-7)
    assert ((got[6] > 0) | (want[6] == 0)).all() and ((got[6] > 0).sum(-1) > K).all()  # a superset of the support
    torch.testing.assert_close(got[6].sum(-1), torch.ones(3))
    # top-k 1 rows are the argmax's point mass (greedy requests of a mixed batch)
    assert torch.equal(got[0].argmax(-1), x[0].argmax(-1)) and torch.equal(got[0].max(-1).values, torch.ones(3))
