"""The adaptive verify width (`sglang_dflash.policy`): its settings, its acceptance estimate and its choices on
simulated steps whose cost and acceptance are known, so the best width is known exactly."""

from __future__ import annotations

import json
import random

import pytest

from sglang_dflash.policy import AdaptiveConfig, PolicyConfigError, WidthPolicy, bucket


def test_config_defaults_and_pins(tmp_path):
    assert AdaptiveConfig.parse(None, 16).widths == (1, 2, 4, 8, 16)
    assert AdaptiveConfig.parse(None, 6).widths == (1, 2, 4, 6)
    assert AdaptiveConfig.parse('{"adaptive": false}', 16).widths == (16,)
    assert AdaptiveConfig.parse('{"widths": [8, 4, 8]}', 16).widths == (4, 8)
    path = tmp_path / "adaptive.json"
    path.write_text(json.dumps({"widths": [1, 16], "max_batch_size": 32}))
    cfg = AdaptiveConfig.parse(str(path), 16)
    assert (cfg.widths, cfg.max_batch_size) == ((1, 16), 32)


@pytest.mark.parametrize("value, match", [
    ('{"widths": [0, 4]}', r"widths must be a non-empty list of integers in \[1, 16\]"),
    ('{"widths": [32]}', r"in \[1, 16\] \(the block size\), got \[32\]"),
    ('{"widths": []}', "non-empty list"),
    ('{"adaptive": "yes"}', "adaptive must be true or false"),
    ('{"max_batch_size": -1}', "max_batch_size must be a non-negative integer"),
    ('{"candidate_steps": [1, 3]}', r"unknown keys \['candidate_steps'\] for DFLASH"),
    ('[1, 2]', "must be a JSON object"),
    ('{"widths": [1,', "not valid JSON"),
    ("/no/such/file.json", "neither a JSON object nor a file"),
])
def test_config_errors_name_the_fix(value, match):
    with pytest.raises(PolicyConfigError, match=match):
        AdaptiveConfig.parse(value, 16)


def test_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9, 64, 65)] == [1, 2, 4, 4, 8, 8, 16, 64, 128]


def test_survival_counts_only_rows_that_verified_the_position():
    p = WidthPolicy(8, (1, 4, 8), decay=1.0, prior=0.5)
    p.observe(2, 4, [3, 0], 0.01)  # width 4 verifies positions 1..3
    p.observe(2, 8, [7, 5], 0.01)
    s = p.survival()
    # position 1: rows with L>=1 are 3,7,5 of 4 rows; position 4..7 seen only by the width-8 step
    assert s[:4] == [1.0, 0.75, 0.75, 0.75]
    assert s[4:6] == [0.75, 0.75]  # 2/2 = 1.0, capped by S_3
    assert s[6] == pytest.approx(0.5) and s[7] == pytest.approx(0.5)  # only the L=7 row reaches 6 and 7
    assert p.expected_tokens(4) == pytest.approx(3.25)


def test_unseen_positions_take_the_prior_below_the_last_estimate():
    p = WidthPolicy(8, (1, 2, 8), prior=0.5)
    p.observe(1, 2, [1], 0.01)
    assert p.survival()[:4] == [1.0, 1.0, 0.5, 0.25]


def simulate(policy: WidthPolicy, bs: int, step_time, accept_prob: float, steps: int, seed: int = 0,
             noise: float = 0.0) -> dict:
    """Run ``steps`` steps: accept lengths with i.i.d. per-position acceptance, durations from ``step_time(w)`` (the
    policy observes them times ``1 + N(0, noise)``); -> committed tokens, true seconds and steps per width."""
    rng = random.Random(seed)
    tokens = seconds = 0.0
    used: dict = {}
    for _ in range(steps):
        w = policy.choose(bs)
        lens = []
        for _ in range(bs):
            n = 0
            while n < w - 1 and rng.random() < accept_prob:
                n += 1
            lens.append(n)
        t = step_time(w)
        policy.observe(bs, w, lens, t * max(0.05, 1 + rng.gauss(0, noise)) if noise else t)
        tokens += sum(lens) + bs
        seconds += t
        used[w] = used.get(w, 0) + 1
    return {"tok_per_s": tokens / seconds, "used": used}


def best_fixed(bs: int, step_time, accept_prob: float, widths) -> tuple[int, float]:
    """The width with the most expected tokens per second, computed exactly."""
    def rate(w):
        return bs * sum(accept_prob ** k for k in range(w)) / step_time(w)
    w = max(widths, key=rate)
    return w, rate(w)


# (name, step time per width, acceptance per position): the regimes of the issue
REGIMES = {
    "nothing accepted, verify costs": (lambda w: 1.0 + 0.2 * (w > 1) + 0.05 * w, 0.0),
    "everything accepted, flat cost": (lambda w: 1.0 + 0.01 * w, 1.0),
    "high acceptance, compute-bound verify": (lambda w: 1.0 + 0.3 * w, 0.9),
    "medium acceptance, cheap verify": (lambda w: 1.0 + 0.02 * w, 0.7),
}


@pytest.mark.parametrize("regime", list(REGIMES))
def test_policy_reaches_the_best_width(regime):
    """Over 2000 steps the adaptive rate is within 5% of the best fixed width's exact rate (exploration included),
    and the width used most is within 10% of it (high acceptance, compute-bound: widths 8 and 4, 7% apart, share
    the steps: the policy's estimates of P(accept >= k) for positions it does not verify stay where they were)."""
    step_time, prob = REGIMES[regime]
    widths = (1, 2, 4, 8, 16)
    p = WidthPolicy(16, widths)
    got = simulate(p, 4, step_time, prob, 2000)
    best_w, best_rate = best_fixed(4, step_time, prob, widths)
    assert got["tok_per_s"] >= 0.95 * best_rate, (got, best_w, best_rate)
    most = max(got["used"], key=got["used"].get)
    assert 4 * sum(prob ** k for k in range(most)) / step_time(most) >= 0.9 * best_rate, got["used"]


@pytest.mark.parametrize("noise", [0.3, 0.6])
@pytest.mark.parametrize("regime", ["medium acceptance, cheap verify", "high acceptance, compute-bound verify",
                                    "everything accepted, flat cost"])
def test_policy_holds_under_noisy_step_times(regime, noise):
    """Step times observed with 30% / 60% relative noise (a host-bound server's spread between steps): the adaptive
    rate stays within 5% of the best fixed width's exact rate, over three seeds."""
    step_time, prob = REGIMES[regime]
    widths = (1, 2, 4, 8, 16)
    best_w, best_rate = best_fixed(16, step_time, prob, widths)
    for seed in range(3):
        got = simulate(WidthPolicy(16, widths), 16, step_time, prob, 3000, seed=seed, noise=noise)
        assert got["tok_per_s"] >= 0.95 * best_rate, (seed, got, best_w, best_rate)


def test_policy_follows_a_change_of_acceptance():
    """Acceptance collapses after 300 steps: the policy moves from the whole block to plain decode steps."""
    step_time = lambda w: 1.0 + 0.2 * (w > 1) + 0.05 * w  # noqa: E731
    p = WidthPolicy(16, (1, 2, 4, 8, 16))
    first = simulate(p, 2, step_time, 0.95, 300, seed=1)
    assert max(first["used"], key=first["used"].get) == 16
    later = simulate(p, 2, step_time, 0.0, 300, seed=2)
    assert later["used"].get(1, 0) >= 250, later["used"]


def test_batch_ceiling_and_pinned_width():
    p = WidthPolicy(16, (1, 4, 16), max_batch_size=8)
    assert {p.choose(9) for _ in range(20)} == {1}
    assert WidthPolicy(16, (16,)).choose(64) == 16
    assert WidthPolicy(16, (16,), max_batch_size=32).choose(33) == 1


def test_every_width_is_measured_once_and_new_buckets_borrow_times():
    """The first bucket tries each width once; a new bucket starts from the nearest bucket's times (no second round
    of trials) and re-measures them first when exploring."""
    p = WidthPolicy(16, (1, 4, 16), explore_every=4)
    first = []
    for _ in range(3):
        w = p.choose(3)
        first.append(w)
        p.observe(3, w, [0, 0, 0], {1: 1.0, 4: 1.5, 16: 3.0}[w])
    assert sorted(first) == [1, 4, 16]
    for _ in range(3):  # nothing accepted: plain decode, from borrowed times
        assert p.choose(20) == 1
        p.observe(20, 1, [0] * 20, 1.0)
    assert p.choose(20) in (4, 16)  # the 4th step of the bucket re-measures a borrowed width


def test_a_new_bucket_measures_plain_decode_before_speculating():
    """The last request of a batch (the reference engine's step times on a 2-core CPU, ms; of every 8 rows 5 accept
    a draft, 3 two, 1 three: E(4) = 2.125): at 8 rows width 4 is the best (1.15x plain decoding), at 1 row plain
    decoding is (width 4 0.875x). The 1-row bucket measures width 1 itself instead of borrowing 8 rows' time, so
    its tail decodes plainly (before, width 1 kept the borrowed 76 ms, which made width 4's measured 85 ms look 2x
    better than plain decoding, and the tail ran width 4)."""
    times = {(8, 1): 76, (8, 4): 140, (8, 16): 280, (1, 1): 35, (1, 4): 85, (1, 16): 120}
    pattern, steps = [0, 0, 0, 1, 1, 2, 2, 3], [0]
    p = WidthPolicy(16, (1, 4, 16))

    def step(bs):
        w = p.choose(bs)
        p.observe(bs, w, [min(pattern[(i + steps[0]) % 8], w - 1) for i in range(bs)], times[(bs, w)])
        steps[0] += 1
        return w

    head = [step(8) for _ in range(40)]
    assert head[-30:].count(4) >= 28, head
    tail = [step(1) for _ in range(30)]
    assert p.costs[(1, 1)].seconds == 35
    assert tail.count(1) >= 28, tail


@pytest.mark.parametrize("lag", [1, 2])
def test_each_width_is_tried_once_when_its_time_comes_back_late(lag):
    """Under the overlap schedule a step's time reaches the policy ``lag`` steps later: a width on trial is not
    tried again meanwhile (before, every width was tried ``lag + 1`` times), and the policy still settles on the
    best width (everything accepted, flat cost: the whole block); the best's neighbour (8) is measured twice."""
    p = WidthPolicy(16, (1, 2, 4, 8, 16))
    pending, chosen = [], []
    for _ in range(40):
        w = p.choose(1)
        chosen.append(w)
        pending.append(w)
        if len(pending) > lag:
            done = pending.pop(0)
            p.observe(1, done, [done - 1], 1.0 + 0.01 * done)
    assert sorted(chosen[:5]) == [1, 2, 4, 8, 16], chosen
    assert chosen.count(1) == 1 and chosen.count(2) == 1 and chosen.count(4) == 1 and chosen.count(8) == 2, chosen
    assert chosen[-20:] == [16] * 20, chosen


def test_host_bound_steps_with_nothing_accepted_stay_plain_decode():
    """When the host sets the step time, every width measures one figure plus noise (here +-3%, the wider ones
    also 1% more on the device). With nothing accepted every width commits one token a step: the policy must stay
    at width 1 (before, whichever width's noise came out lowest won, so wide steps that cost the draft forward
    ran a third of the time), and exploration aside use nothing wider."""
    rng = random.Random(3)
    p = WidthPolicy(16, (1, 2, 4, 8, 16))
    host_bound = lambda w: 6.0 * (1 + 0.03 * rng.uniform(-1, 1)) * (1 + 0.01 * (w > 1))  # noqa: E731
    got = simulate(p, 1, host_bound, 0.0, 640)
    wide = sum(n for w, n in got["used"].items() if w > 1)
    # the first trials, the best's neighbour once more, one re-measurement per period
    assert wide <= 4 + 1 + 640 // p.explore_every, got["used"]


def test_nothing_accepted_at_a_large_batch_re_measures_only_the_next_width():
    """64 requests, nothing accepted, a verify that costs 20% of a decode step more per extra position (width 16: 4
    decode steps; one H100, SmolLM2, 64 requests: a width-16 step is a few decode steps): over 3,000 steps the
    policy commits >= 99% of plain decoding's tokens per second. Only width 2, whose steps keep P(accept >= 1)
    current, is re-measured; a wider step commits at most 1 + (w - 1) P(accept >= 1) tokens, so it cannot win
    (before, every wide width was re-measured in turn: 97.8%)."""
    cost = lambda w: 1.0 + 0.2 * (w - 1)  # noqa: E731
    p = WidthPolicy(16, (1, 2, 4, 8, 16))
    got = simulate(p, 64, cost, 0.0, 3000)
    assert got["tok_per_s"] >= 0.99 * 64 / cost(1), got
    assert all(got["used"].get(w, 0) == 1 for w in (4, 8, 16)), got["used"]  # their first trial only


@pytest.mark.parametrize("bs", [1, 16])
def test_policy_finds_acceptance_that_returns(bs):
    """600 steps with nothing accepted, then a drafter accepted 95% per position: within 200 steps the policy is
    back at the whole block (the re-measured next width sees P(accept >= 1) rise, which reopens the wider widths; the
    rule that re-measured every width in turn was at widths 4-8 then, at 1 request after 165 plain steps)."""
    step_time = lambda w: 1.0 + 0.2 * (w > 1) + 0.05 * w  # noqa: E731
    p = WidthPolicy(16, (1, 2, 4, 8, 16))
    assert simulate(p, bs, step_time, 0.0, 600, seed=1)["used"][1] >= 580
    simulate(p, bs, step_time, 0.95, 200, seed=2)
    later = simulate(p, bs, step_time, 0.95, 100, seed=3)
    assert later["used"].get(16, 0) >= 80, later["used"]


def test_a_stalled_first_measurement_is_taken_again():
    """A host stall during a width's only measurement made it look 4x slower than it is: a width next to the best is
    measured once more before it is written off, and the smaller time counts (before, the whole block stayed
    behind width 8 until its time had decayed through ten re-measurements, ~600 steps); later a stall counts as
    twice the estimate at most."""
    p = WidthPolicy(16, (1, 2, 4, 8, 16))
    first = []
    for _ in range(12):  # everything accepted, every width 1.0 s, but the first whole-block step stalled
        w = p.choose(1)
        p.observe(1, w, [w - 1], 4.0 if w == 16 and 16 not in first else 1.0)
        first.append(w)
    assert first.count(16) >= 2 and first[-4:] == [16] * 4, first
    assert p.costs[(1, 16)].seconds == 1.0
    p.observe(1, 16, [15], 100.0)  # a long stall of the width in use
    assert p.costs[(1, 16)].seconds == pytest.approx(1.2) and p.choose(1) == 16


def serve(policy, passes: int, requests: int, tokens: int, step_time, accept: list[float], rng, stalls=(0.0, 1.0),
          noise: float = 0.1) -> float:
    """``passes`` rounds of ``requests`` requests of ``tokens`` tokens each (a finished request leaves the batch),
    with width ``policy`` (an int: fixed); position k accepted with probability ``accept[k]``; a step of ``bs`` rows
    at width w takes ``step_time(bs, w)``, observed times ``1 + N(0, noise)`` and, with probability ``stalls[0]``,
    ``stalls[1]`` times longer (a host stall). -> committed tokens per second."""
    done = seconds = 0.0
    for _ in range(passes):
        left = [tokens] * requests
        while any(left):
            active = [i for i, n in enumerate(left) if n]
            w = policy if isinstance(policy, int) else policy.choose(len(active))
            lens = []
            for _ in active:
                n = 0
                while n < w - 1 and rng.random() < accept[n]:
                    n += 1
                lens.append(n)
            t = step_time(len(active), w)
            if not isinstance(policy, int):
                seen = t * max(0.05, 1 + rng.gauss(0, noise)) * (stalls[1] if rng.random() < stalls[0] else 1.0)
                policy.observe(len(active), w, lens, seen)
            for i, n in zip(active, lens):
                c = min(n + 1, left[i])
                left[i] -= c
                done += c
            seconds += t
    return done / seconds


@pytest.mark.parametrize("stalls", [(0.05, 4.0), (0.15, 3.0)])
@pytest.mark.parametrize("cost", ["host-bound", "compute-bound"])
def test_policy_holds_when_host_stalls_lengthen_some_steps(cost, stalls):
    """A real drafter (P(accept) 0.6 at the first position, x0.88 per position: tau ~2), 16 requests x 128 tokens,
    three passes after one warm-up pass, 5% of the observed steps 4x longer or 15% 3x (host stalls): over 16 seeds the
    adaptive rate averages >= 0.93 of the best fixed width's rate in the same conditions and no seed falls below
    0.85 (the policy before stalled first measurements were taken again: 0.92-0.95 on average, worst 0.80-0.84)."""
    step_time = {"host-bound": lambda bs, w: 3.2e-3 + 0.02e-3 * w + 0.01e-3 * bs,
                 "compute-bound": lambda bs, w: 4.8e-3 + 0.12e-3 * bs * w / 16}[cost]
    accept = [0.6 * 0.88 ** k for k in range(16)]
    widths = (1, 2, 4, 8, 16)
    ratios = []
    for seed in range(16):
        best = max(serve(w, 3, 16, 128, step_time, accept, random.Random(seed), stalls) for w in widths)
        p = WidthPolicy(16, widths)
        serve(p, 1, 16, 128, step_time, accept, random.Random(seed + 100), stalls)
        ratios.append(serve(p, 3, 16, 128, step_time, accept, random.Random(seed), stalls) / best)
    assert sum(ratios) / len(ratios) >= 0.93 and min(ratios) >= 0.85, [round(r, 3) for r in ratios]
