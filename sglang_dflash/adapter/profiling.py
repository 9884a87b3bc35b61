"""Timing of the DFLASH worker, off by default; two recorders.

`PhaseTimer` (`SGLANG_DFLASH_PROFILE=path.json`): times of the worker's decode calls and of their accept.
Off by default. When on, each phase is bracketed by a device synchronize, so the
numbers are exact per phase but the step runs without overlap
between calls; "scheduler" is the wall time between the end of one decode step and
the start of the next (everything SGLang does outside the worker), averaged over
back-to-back decode steps only: a prefill or idle step in between (`break_chain`)
or a gap over IDLE_GAP_S (the server waiting for requests) starts a new chain.

`StepTimeline` (`SGLANG_DFLASH_TIMELINE=path.json`, CUDA): where the time of a served step goes, measured
without synchronizing, so the overlap schedule runs as it does unprofiled. Every worker call (decode,
prefill, idle) is bracketed by two timing events on its stream and two host timestamps; once the events
have completed (polled, never waited for) the recorder adds up, per kind of call: its device time (first
to last event), its host time in the worker, and between consecutive calls the device idle time (the
stream waiting for the host to enqueue the next call) and the host time outside the worker.

Both are applied from outside the step by `instrument` (at the worker's start-up, when their variables are set).
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict, deque

import torch


IDLE_GAP_S = 0.1  # a longer gap between steps is the server idling, not scheduler work


class PhaseTimer:
    def __init__(self, device, path: str | None):
        self.path = path
        self.sync = torch.cuda.synchronize if str(device).startswith("cuda") else (lambda: None)
        self.totals = defaultdict(float)
        self.steps = 0
        self.tokens = 0
        self._last_end = None

    @classmethod
    def from_env(cls, device) -> "PhaseTimer":
        return cls(device, os.environ.get("SGLANG_DFLASH_PROFILE") or None)

    def start_step(self, batch_size: int):
        if self.path is None:
            return _null_phase
        self.sync()
        now = time.perf_counter()
        if self._last_end is not None and now - self._last_end < IDLE_GAP_S:
            self.totals["scheduler"] += now - self._last_end
            self.totals["scheduler_steps"] += 1
        self.steps += 1
        self.tokens += batch_size
        return self._phase

    @contextlib.contextmanager
    def _phase(self, name: str):
        t0 = time.perf_counter()
        yield
        self.sync()
        self.totals[name] += time.perf_counter() - t0

    def break_chain(self) -> None:
        """A non-decode step ran: the next decode step's gap is not scheduler time."""
        self._last_end = None

    def end_step(self) -> None:
        if self.path is None:
            return
        self._last_end = time.perf_counter()
        if self.steps % 20 == 0:
            phases = {k: 1e3 * v / self.steps for k, v in self.totals.items() if not k.startswith("scheduler")}
            if self.totals["scheduler_steps"]:
                phases["scheduler"] = 1e3 * self.totals["scheduler"] / self.totals["scheduler_steps"]
            summary = {"steps": self.steps, "requests_stepped": self.tokens, "ms_per_step": phases}
            with open(self.path, "w") as f:
                json.dump(summary, f, indent=1)


@contextlib.contextmanager
def _null_ctx():
    yield


def _null_phase(name: str):
    return _null_ctx()


class StepTimeline:
    """Device-event timeline of the worker's calls (see the module docstring). ``event`` makes a timing event
    (``torch.cuda.Event(enable_timing=True)``; tests pass a fake); ``path`` None turns every method into a no-op.
    ``begin(kind)`` -> mark, ``end(mark)``; the JSON (rewritten every ``WRITE_EVERY`` resolved calls) holds per
    key the count and the mean in ms: ``<kind>.device_ms``, ``<kind>.host_ms``, and for each consecutive pair
    ``<a>-><b>.device_idle_ms`` / ``<a>-><b>.host_between_ms`` (pairs further apart than IDLE_GAP_S on the host
    are the server waiting for requests and are left out)."""

    WRITE_EVERY = 20

    def __init__(self, path: str | None, event=None):
        self.path = path
        self.event = event
        self.pending = deque()  # (kind, host_start, host_end, start_event, end_event), in call order
        self.last = None  # (kind, host_end, end_event) of the last resolved call
        self.sums = defaultdict(float)
        self.counts = defaultdict(int)
        self.resolved = 0

    @classmethod
    def from_env(cls, device) -> "StepTimeline":
        path = os.environ.get("SGLANG_DFLASH_TIMELINE") or None
        if path is None:
            return cls(None)
        if not str(device).startswith("cuda"):
            raise ValueError("sglang-dflash: SGLANG_DFLASH_TIMELINE times the worker with CUDA events and needs a "
                             f"CUDA device (this worker runs on {device}); use SGLANG_DFLASH_PROFILE instead")
        return cls(path, lambda: torch.cuda.Event(enable_timing=True))

    def begin(self, kind: str):
        if self.path is None:
            return None
        ev = self.event()
        ev.record()
        return kind, time.perf_counter(), ev

    def end(self, mark) -> None:
        if mark is None:
            return
        ev = self.event()
        ev.record()
        kind, host_start, start_ev = mark
        self.pending.append((kind, host_start, time.perf_counter(), start_ev, ev))
        self._resolve_completed()

    def _add(self, key: str, ms: float) -> None:
        self.sums[key] += ms
        self.counts[key] += 1

    def _resolve_completed(self) -> None:
        while self.pending and self.pending[0][4].query():
            kind, host_start, host_end, start_ev, end_ev = self.pending.popleft()
            self._add(f"{kind}.device_ms", start_ev.elapsed_time(end_ev))
            self._add(f"{kind}.host_ms", 1e3 * (host_end - host_start))
            if self.last is not None and host_start - self.last[1] < IDLE_GAP_S:
                pair = f"{self.last[0]}->{kind}"
                self._add(f"{pair}.device_idle_ms", self.last[2].elapsed_time(start_ev))
                self._add(f"{pair}.host_between_ms", 1e3 * (host_start - self.last[1]))
            self.last = (kind, host_end, end_ev)
            self.resolved += 1
            if self.resolved % self.WRITE_EVERY == 0:
                self.write()

    def summary(self) -> dict:
        return {k: {"count": self.counts[k], "mean_ms": self.sums[k] / self.counts[k]} for k in sorted(self.sums)}

    def write(self) -> None:
        with open(self.path, "w") as f:
            json.dump({"calls": self.resolved, "timeline": self.summary()}, f, indent=1)


def instrument(worker) -> None:
    """Wrap the DFLASH ``worker`` with the recorders whose variables are set (nothing otherwise), once, at start-up.

    `PhaseTimer`: ``decode`` (one decode call: the step, graph or eager, and its accept), ``accept`` (the sampler's
    accept, inside decode; plain greedy batches have none) and ``scheduler`` (between back-to-back decode calls);
    a prefill or idle call breaks the chain. `StepTimeline`: every `forward_batch_generation` call."""
    timer = PhaseTimer.from_env(worker.device)
    if timer.path is not None:
        decode, prefill, idle, accept = worker.decode, worker.prefill, worker.idle, worker.sampler.accept

        def timed_decode(batch):
            phase = timer.start_step(batch.batch_size())
            with phase("decode"):
                result = decode(batch)
            timer.end_step()
            return result

        def timed_accept(*args):
            with timer._phase("accept"):
                return accept(*args)

        def breaking(call):
            def run(*args):
                timer.break_chain()
                return call(*args)
            return run

        worker.decode, worker.prefill, worker.idle = timed_decode, breaking(prefill), breaking(idle)
        worker.sampler.accept = timed_accept
    timeline = StepTimeline.from_env(worker.device)
    if timeline.path is not None:
        from sglang_dflash.adapter.worker import call_kind

        forward = worker.forward_batch_generation

        def traced(batch, *args, **kwargs):
            mark = timeline.begin(call_kind(batch))
            result = forward(batch, *args, **kwargs)
            timeline.end(mark)
            return result

        worker.forward_batch_generation = traced
