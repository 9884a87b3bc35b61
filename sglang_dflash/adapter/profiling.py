"""Per-phase timing of the DFLASH decode step (`SGLANG_DFLASH_PROFILE=path.json`).

Off by default: `PhaseTimer.from_env` then returns a timer whose phases are no-op
context managers. When on, each phase is bracketed by a device synchronize, so the
numbers are exact per phase but the step runs without CUDA-graph-level overlap
between phases; "scheduler" is the wall time between the end of one decode step and
the start of the next (everything SGLang does outside the worker), averaged over
back-to-back decode steps only: a prefill or idle step in between (`break_chain`)
or a gap over IDLE_GAP_S (the server waiting for requests) starts a new chain.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections import defaultdict

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
