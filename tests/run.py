"""The test command: `python tests/run.py [--fast | --server] [--sglang VERSION] [pytest args]` (installs what it
needs on first use).

Stages, each one pytest run with the given pytest args, in order: on the default SGLang (`.venv`, or this
interpreter when it has everything) the fast tier (every test under ``tests/`` without the ``server`` marker: no
SGLang server starts, minutes on a CPU), then the server tier (``-m server``); then on the newest supported SGLang
(`bootstrap.NEWEST_SGLANG`, in `.venv-sglang-<version>`) the fast tier and the DFLASH server tests of greedy
identity, multi-turn chat and sampled distribution, and those of the hybrid targets (``test_server_arch.py``). The
first failing stage stops the run. ``--fast`` runs the default SGLang's fast tier alone, ``--server`` its server
tier alone, ``--sglang VERSION`` only the stages of that SGLang (``--fast`` / ``--server`` with it: its fast / server
tier). A stage that the args leave empty counts as passed.
A tier runs as ``SHARDS`` pytest processes side by side, each a share of the test modules (``--shard``,
``tests/conftest.py``): the fast tier's tests run on one core each; in the server tier the second process's modules
use the core that one server's scheduler, serving alone, leaves idle. All their SGLang servers at once would not fit a
24 GB CI machine, so the server tier's processes share a budget of ``SERVER_BUDGET_GB``: a module starts once its
``PEAK_GB`` of it is free (``tests/harness/budget.py``).
"""

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from harness import budget  # noqa: E402
from sglang_dflash.bootstrap import DEFAULT_SGLANG, NEWEST_SGLANG, REPO, ensure_env, setup_env  # noqa: E402

FAST = ["-m", "not server", "tests"]
# (SGLang pin, tier, pytest selection)
STAGES = (
    (DEFAULT_SGLANG, "fast", FAST),
    (DEFAULT_SGLANG, "server", ["-m", "server", "tests"]),
    (NEWEST_SGLANG, "fast", FAST),
    (NEWEST_SGLANG, "server", ["-m", "server", "tests/test_server_dflash.py", "tests/test_server_arch.py",
                               "-k", "greedy_matches or multi_turn or sampling_distribution or hybrid or "
                               "broken_state_commit"]),
)
NO_TESTS_COLLECTED = 5  # pytest's exit code when the selection is empty
SHARDS = {"fast": 2, "server": 2}
# GB that the server tier's modules hold at once, together (their PEAK_GB): the rest of a 24 GB machine is headroom
SERVER_BUDGET_GB = 20


def select(argv: list[str]) -> tuple[list[tuple[str, str, list[str]]], list[str]]:
    """The stages that ``--fast`` / ``--server`` (the default SGLang's fast / server tier, or with ``--sglang`` that
    SGLang's) and ``--sglang VERSION`` in `argv` keep, and the remaining (pytest) args."""
    args = list(argv)
    tiers = [t for t in ("fast", "server") if f"--{t}" in args]
    for t in tiers:
        args.remove(f"--{t}")
    if len(tiers) > 1:
        raise SystemExit("tests/run.py: --fast and --server exclude each other")
    pins = [DEFAULT_SGLANG] if tiers else [DEFAULT_SGLANG, NEWEST_SGLANG]
    if "--sglang" in args:
        i = args.index("--sglang")
        pins = [f"sglang=={args[i + 1]}"]
        del args[i:i + 2]
        if pins[0] not in (DEFAULT_SGLANG, NEWEST_SGLANG):
            raise SystemExit(f"tests/run.py: --sglang takes {DEFAULT_SGLANG} or {NEWEST_SGLANG} (the version only)")
    return [s for s in STAGES if s[0] in pins and (not tiers or s[1] in tiers)], args


def run_pytest(command: list[str], n: int, budget_gb: int = 0) -> int:
    """The pytest ``command``, as ``n`` processes side by side (``--shard k/n``) when ``n`` > 1: the first prints as it
    goes, the others' output follows when each ends; with ``budget_gb`` they share a server budget of that many GB
    (``tests/harness/budget.py``). Exit code: the first failing shard's; ``NO_TESTS_COLLECTED`` when every shard's
    selection was empty; else 0."""
    if n == 1:
        return subprocess.call(command, cwd=REPO)
    with tempfile.TemporaryDirectory(prefix="server-budget-") as slots:
        env = dict(os.environ)
        if budget_gb:
            env[budget.ENV_VAR] = str(budget.make_slots(slots, budget_gb))
        logs = [None] + [tempfile.TemporaryFile(mode="w+") for _ in range(1, n)]
        procs = [subprocess.Popen([*command, "--shard", f"{k + 1}/{n}"], cwd=REPO, env=env, stdout=log,
                                  stderr=subprocess.STDOUT if log else None) for k, log in enumerate(logs)]
        codes = [p.wait() for p in procs]
    for k, log in enumerate(logs[1:], start=2):
        log.seek(0)
        print(f"-- shard {k}/{n} --", flush=True)
        sys.stdout.write(log.read())
        sys.stdout.flush()
    failed = [c for c in codes if c not in (0, NO_TESTS_COLLECTED)]
    if failed:
        return failed[0]
    return NO_TESTS_COLLECTED if all(c == NO_TESTS_COLLECTED for c in codes) else 0


def main(argv: list[str]) -> int:
    stages, args = select(argv)
    if any(pin == DEFAULT_SGLANG for pin, _, _ in stages):
        ensure_env()
    ran = False
    for pin, name, selection in stages:
        python = sys.executable if pin == DEFAULT_SGLANG else setup_env(pin)
        print(f"== tests/run.py: {pin}, {name} tier ({' '.join(selection)}) ==", flush=True)
        start = time.monotonic()
        command = [str(python), "-m", "pytest", "-q", "-ra", *selection, *args]
        code = run_pytest(command, SHARDS[name], SERVER_BUDGET_GB if name == "server" else 0)
        print(f"== tests/run.py: {pin}, {name} tier exit code {code}, {time.monotonic() - start:.0f} s ==",
              flush=True)
        if code == NO_TESTS_COLLECTED:
            continue
        if code != 0:
            return code
        ran = True
    return 0 if ran else NO_TESTS_COLLECTED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
