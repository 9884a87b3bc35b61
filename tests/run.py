"""The test command: `python tests/run.py [pytest args]` (installs what it needs on first use)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_dflash.bootstrap import REPO, ensure_env  # noqa: E402

ensure_env()
import pytest  # noqa: E402

os.chdir(REPO)
sys.exit(pytest.main(["-q", "-ra", "tests", *sys.argv[1:]]))
