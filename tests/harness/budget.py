"""A budget of SGLang servers shared by the pytest processes of one test run, so that side by side they never hold
more servers than the machine's memory fits.

``tests/run.py`` runs the server tier as several pytest processes and passes them a directory of slot files, one per
GB of the budget (:func:`make_slots`), in ``$SGLANG_DFLASH_TEST_SERVER_SLOTS``. A test module declares the most memory
its tests hold at once (``PEAK_GB``); ``tests/conftest.py`` holds that many slots (:func:`held`) while it runs. A slot
is held by an exclusive ``flock`` on its file, which dies with the process: a killed process frees its slots. A module
takes all its slots at once or none (it never holds some while waiting for others, so no two processes wait on each
other), and one waiter at a time (``queue``) takes them, so a module asking for many is not starved by smaller ones
taken in between. Without the environment variable (a plain ``pytest`` run) there is no budget.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from collections.abc import Iterator
from pathlib import Path

ENV_VAR = "SGLANG_DFLASH_TEST_SERVER_SLOTS"
POLL_S = 0.5


def make_slots(directory: str | os.PathLike, n: int) -> Path:
    """Write ``n`` slot files (and the waiters' ``queue`` file) into ``directory``; returns it."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for path in [directory / "queue", *(directory / f"slot-{i}" for i in range(n))]:
        path.touch()
    return directory


def _take(path: Path) -> int | None:
    """A descriptor of ``path`` holding its exclusive lock, or None when another process holds it."""
    fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def _release(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)  # closing the only descriptor drops its lock
    fds.clear()


@contextlib.contextmanager
def held(n: int, directory: str | os.PathLike | None = None) -> Iterator[int]:
    """Hold ``n`` slots of the budget in ``directory`` (default ``$SGLANG_DFLASH_TEST_SERVER_SLOTS``) inside the
    ``with`` block, waiting until all ``n`` are free at once; yields the number held (0: no budget, nothing held)."""
    directory = directory or os.environ.get(ENV_VAR)
    if not directory or n <= 0:
        yield 0
        return
    slots = sorted(Path(directory).glob("slot-*"))
    if n > len(slots):
        raise ValueError(f"{n} slots asked of a budget of {len(slots)} ({directory})")
    fds: list[int] = []
    try:
        queue = os.open(Path(directory) / "queue", os.O_RDWR | os.O_CLOEXEC)
        try:
            fcntl.flock(queue, fcntl.LOCK_EX)  # first in line
            while True:
                for slot in slots:
                    fd = _take(slot)
                    if fd is not None:
                        fds.append(fd)
                        if len(fds) == n:
                            break
                if len(fds) == n:
                    break
                _release(fds)  # all or none
                time.sleep(POLL_S)
        finally:
            os.close(queue)
        yield n
    finally:
        _release(fds)
