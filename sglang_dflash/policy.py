"""Adaptive verify width: how many block positions the target verifies in the next decode step.

A DFLASH step with verify width ``w`` verifies ``[bonus, d_1 .. d_{w-1}]`` per request and commits ``1 + L``
tokens, ``L <= w - 1`` the accepted drafts; ``w = 1`` is a plain decode step (no draft forward). Speculation pays
while the tokens it commits outgrow what the wider step costs, which stops at large batches (the verify turns
compute-bound) and with drafts that are rarely accepted. `WidthPolicy` picks, per step, the width that
maximizes expected committed tokens per second of step time:

    E(w) = 1 + sum_{k=1}^{w-1} S_k,   S_k = P(L >= k)        (per request; the batch's mean)
    w*   = argmax_w  E(w) / t(bs, w)

``S_k`` is estimated from the accept lengths of recent steps (counts over the rows that verified position k, decayed
only when a step verifies it again, so a narrow phase keeps what wider steps saw; a position no step verified yet
takes the prior, capped by ``S_{k-1}``), ``t(bs, w)`` from measured step times per (batch-size bucket, width), taken
non-decreasing in ``w`` (a wider step does all a narrower one does and more, so a wider width measured no slower is
charged the narrower one's time: when the step is bound by the host, the times of every width are one figure plus
noise, and noise must not buy a width that commits nothing more). A width's time is the smaller of its first two
measurements (a width next to the best, measured once, is measured again before it is written off: a host stall
lengthens a step, never shortens it), then a moving average in which a stall counts as twice the estimate at most.
A new bucket starts from the nearest measured bucket's times, each replaced by the first measurement there, except
the narrowest width's (plain decode), which every bucket measures itself: the baseline a wider width must beat (a
larger bucket's, borrowed, made a smaller bucket's wide steps look cheap next to it); a width measured in neither
is tried once (also when its time comes back steps later, as under the
overlap schedule); every ``explore_every`` steps of a bucket the width measured longest ago is tried again, so a
change in either the acceptance or the cost is seen, among the widths that could still win: those up to the best's
wider neighbour (whose steps keep ``S_1`` current), and a wider one only while ``1 + (w - 1) S_1`` (an upper bound of
``E(w)``) over the narrower widths' time (a lower bound of its own) beats the best's rate. With nothing accepted
only the neighbour is re-measured: a wide step that cannot win costs several decode steps at a large batch. Above
``max_batch_size`` requests every step is a plain decode step. Plain Python (no tensors): the caller hands in
accept lengths and seconds it already has on the host.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field


class PolicyConfigError(ValueError):
    """A ``--speculative-adaptive-config`` for DFLASH that cannot be used; the message names the fix."""


@dataclass
class AdaptiveConfig:
    """DFLASH's adaptive-width settings (``--speculative-adaptive-config``, a JSON object or a path to one):

    ``adaptive`` (default true): choose the width per step; false: every step verifies the whole block.
    ``widths``: candidate verify widths (default 1, 2, 4, 8 and the block size; each in [1, block size];
    1 = plain decode). A single width pins it. ``max_batch_size``: above this many running requests every step is
    a plain decode step (default: no ceiling).
    """

    adaptive: bool = True
    widths: tuple[int, ...] | None = None
    max_batch_size: int | None = None
    KEYS = ("adaptive", "widths", "max_batch_size")

    @classmethod
    def parse(cls, value: str | None, block_size: int) -> "AdaptiveConfig":
        """``value``: None, a JSON object, or the path of a JSON file; widths resolved against ``block_size``."""
        if not value:
            raw = {}
        else:
            text = value
            if not value.lstrip().startswith(("{", "[")):
                if not os.path.isfile(value):
                    raise PolicyConfigError(f"--speculative-adaptive-config {value!r} is neither a JSON object nor a "
                                            "file; pass e.g. '{\"widths\": [1, 4, 16]}' or the path of such a file.")
                with open(value) as f:
                    text = f.read()
            try:
                raw = json.loads(text)
            except json.JSONDecodeError as e:
                raise PolicyConfigError(f"--speculative-adaptive-config is not valid JSON ({e}).") from None
            if not isinstance(raw, dict):
                raise PolicyConfigError("--speculative-adaptive-config must be a JSON object with keys "
                                        f"{', '.join(cls.KEYS)}.")
        unknown = sorted(set(raw) - set(cls.KEYS))
        if unknown:
            raise PolicyConfigError(f"--speculative-adaptive-config: unknown keys {unknown} for DFLASH; it reads "
                                    f"{', '.join(cls.KEYS)}.")
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise PolicyConfigError(f"--speculative-adaptive-config: adaptive must be true or false, got {adaptive!r}.")
        widths = raw.get("widths")
        if widths is None:
            widths = [w for w in (1, 2, 4, 8) if w < block_size] + [block_size]
        if (not isinstance(widths, list) or not widths
                or not all(isinstance(w, int) and not isinstance(w, bool) and 1 <= w <= block_size for w in widths)):
            raise PolicyConfigError(f"--speculative-adaptive-config: widths must be a non-empty list of integers in "
                                    f"[1, {block_size}] (the block size), got {widths!r}.")
        cap = raw.get("max_batch_size")
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 0):
            raise PolicyConfigError(f"--speculative-adaptive-config: max_batch_size must be a non-negative integer, "
                                    f"got {cap!r}.")
        return cls(adaptive=adaptive, widths=tuple(sorted(set(widths))) if adaptive else (block_size,),
                   max_batch_size=cap)


def possible_widths(widths, max_batch_size: int | None) -> list[int]:
    """Every width a policy over candidate ``widths`` can choose: those, and 1 (plain decode) above a batch-size
    ceiling."""
    return sorted({*widths, *([1] if max_batch_size is not None else [])})


def bucket(bs: int) -> int:
    """Batch sizes share step-time estimates within powers of two: 1, 2, 3-4, 5-8, ..."""
    return 1 << max(bs - 1, 0).bit_length()


@dataclass
class _Cost:
    seconds: float
    last_step: int  # the bucket's step count when last measured
    samples: int = 1  # steps measured in this bucket (0: borrowed from another bucket)


@dataclass
class WidthPolicy:
    """Chooses the verify width per step (module docstring). ``decay``: weight of the older observations per
    observed row (a step of ``bs`` rows multiplies it by ``decay ** bs``, at least 0.5 per step); ``prior``: S_k before any data; ``explore_every``: steps of a bucket between re-measurements."""

    block_size: int
    widths: tuple[int, ...]
    max_batch_size: int | None = None
    decay: float = 0.97
    prior: float = 0.5
    explore_every: int = 64
    hits: list[float] = field(init=False)
    seen: list[float] = field(init=False)
    costs: dict = field(init=False, default_factory=dict)  # (bucket, width) -> _Cost
    steps: dict = field(init=False, default_factory=dict)  # bucket -> steps chosen for it
    trying: set = field(init=False, default_factory=set)  # (bucket, width) chosen to be measured, no time back yet

    def __post_init__(self):
        if not self.widths or any(not 1 <= w <= self.block_size for w in self.widths):
            raise ValueError(f"widths {self.widths} must lie in [1, {self.block_size}]")
        self.widths = tuple(sorted(set(self.widths)))
        self.hits = [0.0] * self.block_size  # index k: decayed rows with L >= k among those that verified k
        self.seen = [0.0] * self.block_size

    def survival(self) -> list[float]:
        """S_0..S_{B-1}: estimated P(accept length >= k); S_0 = 1, non-increasing."""
        s = [1.0]
        for k in range(1, self.block_size):
            est = self.hits[k] / self.seen[k] if self.seen[k] > 1e-3 else self.prior * s[-1]
            s.append(min(est, s[-1]))
        return s

    def expected_tokens(self, width: int) -> float:
        """E(width): expected tokens committed per request by a step of this width."""
        return sum(self.survival()[:width])

    def choose(self, bs: int) -> int:
        """The width for the next step of ``bs`` requests."""
        if self.max_batch_size is not None and bs > self.max_batch_size:
            return 1
        if len(self.widths) == 1:
            return self.widths[0]
        b = bucket(bs)
        n = self.steps[b] = self.steps.get(b, 0) + 1
        if n == 1:
            self._borrow_costs(b)
        measured = [w for w in self.widths if (b, w) in self.costs]
        untried = [w for w in self.widths if (b, w) not in self.costs and (b, w) not in self.trying]
        if untried:  # tried once each; a trial's time may arrive steps later (the overlap schedule)
            self.trying.add((b, untried[-1]))
            return untried[-1]
        if not measured:  # every width on trial, no time back yet
            return self.widths[-1]
        s = self.survival()
        best, best_rate, floor, below = measured[0], -1.0, 0.0, {}
        for w in measured:  # narrowest first: a tie keeps the narrower width
            below[w] = floor  # no step of width w costs less than a narrower one
            floor = max(floor, self.costs[(b, w)].seconds)  # t(bs, w) taken non-decreasing in w
            rate = sum(s[:w]) / floor
            if rate > best_rate:
                best, best_rate = w, rate
        i = self.widths.index(best)
        if n % self.explore_every == 0:  # E(w) <= 1 + (w - 1) S_1: re-measure only a width that could still win
            reach = self.widths[min(i + 1, len(self.widths) - 1)]
            could_win = [w for w in measured if w <= reach or 1 + (w - 1) * s[1] > best_rate * below[w]]
            return min(could_win, key=lambda w: self.costs[(b, w)].last_step)
        for w in self.widths[max(i - 1, 0):i + 2]:  # a neighbour of the best measured once: once more first
            cost = self.costs.get((b, w))
            if w != best and cost is not None and cost.samples == 1 and (b, w) not in self.trying:
                self.trying.add((b, w))
                return w
        return best

    def _borrow_costs(self, b: int) -> None:
        """A new bucket starts from the nearest measured bucket's step times but the narrowest width's (marked
        measured longest ago, so the periodic exploration replaces them first) instead of trying every width again."""
        known = {k for k, _ in self.costs}
        if not known:
            return
        near = min(known, key=lambda k: abs(k.bit_length() - b.bit_length()))
        for w in self.widths[1:]:  # the narrowest (plain decode when 1) is measured here: the baseline to beat
            if (near, w) in self.costs:
                self.costs[(b, w)] = _Cost(self.costs[(near, w)].seconds, -1, samples=0)

    def observe(self, bs: int, width: int, accept_lens: list[int], seconds: float) -> None:
        """A finished step: its width, the accepted draft count of each of its ``bs`` rows, its duration."""
        b = bucket(bs)
        self.trying.discard((b, width))
        old = self.costs.get((b, width))
        if old is None or old.samples == 0:  # the first time measured here (a borrowed time is replaced)
            estimate = seconds
        elif old.samples == 1:  # the second: a host stall lengthens a step, never shortens it
            estimate = min(old.seconds, seconds)
        else:  # a stall counts as twice the estimate at most
            estimate = 0.8 * old.seconds + 0.2 * min(seconds, 2 * old.seconds)
        samples = 1 if old is None else old.samples + 1
        self.costs[(b, width)] = _Cost(estimate, self.steps.get(b, 0), samples)
        if width <= 1:
            return
        keep = max(self.decay ** len(accept_lens), 0.5)  # only the positions this step verified age
        for k in range(1, width):
            self.seen[k] = self.seen[k] * keep + len(accept_lens)
            self.hits[k] = self.hits[k] * keep + sum(length >= k for length in accept_lens)
