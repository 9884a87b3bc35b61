"""The worker's verify width per decode step: `sglang_dflash.policy.WidthPolicy`, fed without a host sync.

Each step's duration and accept lengths reach the policy when the host has them anyway: on CPU at once; on CUDA
through a timing event pair and a non-blocking copy of the accept lengths, read when the end event has completed
(`torch.cuda.Event.query`, checked at the next choice), so the overlap schedule keeps the host ahead. Under tensor
parallelism every rank takes the first rank's width (one host broadcast per step), since measured durations
differ between ranks. A pinned width (one candidate) costs nothing per step.
"""

from __future__ import annotations

import collections
import logging
import time

import torch

from sglang_dflash.policy import AdaptiveConfig, WidthPolicy

logger = logging.getLogger(__name__)
LOG_EVERY_S = 60.0


class StepWidths:
    """``choose(bs)`` before a step, ``finish(token, bs, width, accept_lens)`` after it (``token`` from
    ``choose``); ``counts``: steps per width since the last log line."""

    def __init__(self, cfg: AdaptiveConfig, block_size: int, device, tp_group=None):
        self.policy = WidthPolicy(block_size, cfg.widths, cfg.max_batch_size)
        self.fixed = len(self.policy.widths) == 1 and cfg.max_batch_size is None
        self.cuda = torch.device(device).type == "cuda"
        self.tp_group = tp_group
        self.pending: collections.deque = collections.deque()  # (start, end, accept_lens host copy, bs, width)
        self.counts: collections.Counter = collections.Counter()
        self.last_log = time.monotonic()

    def choose(self, bs: int) -> tuple[int, object]:
        """-> (width, token for `finish`)."""
        if self.fixed:
            return self.policy.widths[0], None
        self._drain()
        width = self.policy.choose(bs)
        if self.tp_group is not None:
            width = self.tp_group.broadcast_object(width, src=0)
        self.counts[width] += 1
        now = time.monotonic()
        if now - self.last_log >= LOG_EVERY_S:
            logger.info("sglang-dflash: verify widths of the last %.0f s (width: steps): %s", now - self.last_log,
                        dict(sorted(self.counts.items())))
            self.counts.clear()
            self.last_log = now
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            return width, start
        return width, time.perf_counter()

    def finish(self, token, bs: int, width: int, accept_lens: torch.Tensor) -> None:
        """After the step (and its accept) of ``bs`` rows at ``width``; ``accept_lens`` [bs] accepted drafts."""
        if self.fixed:
            return
        if not self.cuda:
            self.policy.observe(bs, width, accept_lens.tolist(), time.perf_counter() - token)
            return
        end = torch.cuda.Event(enable_timing=True)
        lens = torch.empty(accept_lens.shape, dtype=accept_lens.dtype, pin_memory=True)
        lens.copy_(accept_lens, non_blocking=True)
        end.record()
        self.pending.append((token, end, lens, bs, width))

    def _drain(self) -> None:
        while self.pending and self.pending[0][1].query():
            start, end, lens, bs, width = self.pending.popleft()
            self.policy.observe(bs, width, lens.tolist(), start.elapsed_time(end) / 1e3)
