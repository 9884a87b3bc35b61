"""The test command: `python tests/run.py [--fast] [pytest args]` (installs what it needs on first use).

Two tiers, each one pytest process over ``tests/`` with the given pytest args: the fast tier (every test without
the ``server`` marker: no SGLang server starts, minutes on a CPU), then the server tier (``-m server``), run only
when the fast tier passed. ``--fast`` runs the fast tier alone. A tier that the args leave empty counts as passed.
"""

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_dflash.bootstrap import REPO, ensure_env  # noqa: E402

TIERS = (("fast", "not server"), ("server", "server"))
NO_TESTS_COLLECTED = 5  # pytest's exit code when the selection is empty


def main(argv: list[str]) -> int:
    ensure_env()
    fast_only = "--fast" in argv
    args = [a for a in argv if a != "--fast"]
    ran = False
    for name, marker in TIERS[:1] if fast_only else TIERS:
        print(f"== tests/run.py: {name} tier (-m {marker!r}) ==", flush=True)
        start = time.monotonic()
        code = subprocess.call([sys.executable, "-m", "pytest", "-q", "-ra", "-m", marker, "tests", *args], cwd=REPO)
        print(f"== tests/run.py: {name} tier exit code {code}, {time.monotonic() - start:.0f} s ==", flush=True)
        if code == NO_TESTS_COLLECTED:
            continue
        if code != 0:
            return code
        ran = True
    return 0 if ran else NO_TESTS_COLLECTED


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
