"""The worker's verify width per decode step: `sglang_dflash.policy.WidthPolicy`, fed without a host sync.

A step's cost is what it holds the server for: the larger of its device time (a timing event pair on CUDA, the
wall time of the step on CPU) and its host interval, the time between two width choices (the scheduler's work
between steps included, which no device timer sees and which sets the step time of small models). Which step an
interval belongs to depends on the schedule: without overlap the host waits for step N before it chooses for
N+1, so the interval from choice N to N+1 is step N's; under SGLang's overlap schedule the host launches step N,
then waits for step N-1's result, so that interval is step N-1's (``lag`` 1). A prefill in the interval voids it
(`interrupt`). Each step reaches the policy once the host has its figures anyway:
the host interval at the next choice, and on CUDA the accept lengths through a non-blocking copy read when the end
event has completed (`torch.cuda.Event.query`), so the overlap schedule keeps the host ahead. Under tensor
parallelism every rank takes the first rank's width (one host broadcast per step), since measured durations
differ between ranks. A pinned width (one candidate, no batch ceiling) costs a step count only.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass

import torch

from sglang_dflash.policy import AdaptiveConfig, WidthPolicy, possible_widths

logger = logging.getLogger(__name__)
LOG_EVERY_S = 60.0
MAX_HOST_BUFFERS = 64


@dataclass
class _Step:
    """A finished step waiting for its figures: device timing (CUDA events, or host seconds on CPU), the accept
    lengths (a pinned host copy on CUDA), and the host interval to the next choice (None: not known yet)."""

    start: object
    end: object
    lens: object
    bs: int
    width: int
    host_s: float | None = None


class StepWidths:
    """``choose(bs)`` before a step, ``finish(accept_lens)`` after it, ``interrupt()`` when a prefill runs between
    steps; ``counts``: steps per width since the last log line, ``totals`` since start-up (`report`)."""

    def __init__(self, cfg: AdaptiveConfig, block_size: int, device, tp_group=None, overlap: bool = False):
        self.lag = 1 if overlap else 0
        self.policy = WidthPolicy(block_size, cfg.widths, cfg.max_batch_size)
        self.fixed = len(self.policy.widths) == 1 and cfg.max_batch_size is None
        self.cuda = torch.device(device).type == "cuda"
        self.tp_group = tp_group
        self.pending: collections.deque[_Step] = collections.deque()
        self.recent: collections.deque[_Step] = collections.deque(maxlen=2)  # the last steps, newest last
        self.chosen_at: float | None = None
        self.current: tuple[object, int] | None = None  # the chosen step's (device timing start, width)
        self.interval_void = False  # a prefill ran since the last choice
        self.counts: collections.Counter = collections.Counter()
        self.totals: collections.Counter = collections.Counter()
        self.last_log = time.monotonic()
        self.host_buffers: list[torch.Tensor] = []  # pinned accept-length copies of drained steps, for reuse

    def report(self) -> dict:
        """What ``/get_server_info`` shows: the candidate widths, whether they are chosen per step, the batch-size
        ceiling, and decode steps per width since start-up."""
        return {"widths": list(self.policy.widths), "adaptive": not self.fixed,
                "max_batch_size": self.policy.max_batch_size,
                "steps_per_width": {str(w): n for w, n in sorted(self.totals.items())}}

    def possible_widths(self) -> list[int]:
        """Every width `choose` can return (the candidates, and 1 above a batch-size ceiling)."""
        return possible_widths(self.policy.widths, self.policy.max_batch_size)

    def choose(self, bs: int) -> int:
        """The verify width of the next step, of ``bs`` requests."""
        if self.fixed:
            self.totals[self.policy.widths[0]] += 1
            return self.policy.widths[0]
        now = time.perf_counter()
        if self.chosen_at is not None:
            if self.interval_void:  # the steps still without an interval keep their device time
                for step in self.recent:
                    step.host_s = 0.0 if step.host_s is None else step.host_s
                self.recent.clear()
            elif len(self.recent) > self.lag:
                self.recent[-1 - self.lag].host_s = now - self.chosen_at
        self.chosen_at, self.interval_void = now, False
        self._drain()
        width = self.policy.choose(bs)
        if self.tp_group is not None:
            width = self.tp_group.broadcast_object(width, src=0)
        self.counts[width] += 1
        self.totals[width] += 1
        if time.monotonic() - self.last_log >= LOG_EVERY_S:
            self._log()
        start = now
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        self.current = (start, width)
        return width

    def finish(self, accept_lens: torch.Tensor) -> None:
        """After the chosen step (and its accept); ``accept_lens`` [bs] accepted drafts."""
        if self.fixed:
            return
        (start, width), bs = self.current, accept_lens.shape[0]
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            lens = self._host_buffer(accept_lens)
            lens.copy_(accept_lens, non_blocking=True)
            end.record()
        else:
            end, lens = time.perf_counter(), accept_lens.tolist()
        step = _Step(start, end, lens, bs, width)
        self.recent.append(step)
        self.pending.append(step)

    def interrupt(self) -> None:
        """Another forward (a prefill) runs before the next step: the current host interval is no step's."""
        self.interval_void = True

    def _drain(self) -> None:
        while self.pending and self.pending[0].host_s is not None and (not self.cuda or self.pending[0].end.query()):
            s = self.pending.popleft()
            if self.cuda:
                device_s, lens = s.start.elapsed_time(s.end) / 1e3, s.lens.tolist()
                if len(self.host_buffers) < MAX_HOST_BUFFERS:
                    self.host_buffers.append(s.lens)
            else:
                device_s, lens = s.end - s.start, s.lens
            self.policy.observe(s.bs, s.width, lens, max(device_s, s.host_s))

    def _host_buffer(self, like: torch.Tensor) -> torch.Tensor:
        """A pinned host tensor shaped like ``like``: a drained step's when one fits (pinning a new one each step
        costs the host more than the step's other bookkeeping)."""
        for i, buf in enumerate(self.host_buffers):
            if buf.shape == like.shape and buf.dtype == like.dtype:
                return self.host_buffers.pop(i)
        return torch.empty(like.shape, dtype=like.dtype, pin_memory=True)

    def _log(self) -> None:
        now = time.monotonic()
        logger.info("sglang-dflash: verify widths of the last %.0f s (width: steps): %s", now - self.last_log,
                    dict(sorted(self.counts.items())))
        self.counts.clear()
        self.last_log = now
