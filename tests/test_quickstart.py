"""The quickstart's explanation on CPU quotes the latest GPU figures from benchmarks/RESULTS.md (one copy of the
numbers): the line must keep reading that file as it is written."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _quickstart():
    spec = importlib.util.spec_from_file_location("quickstart", REPO / "examples" / "quickstart.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # ensure_env() returns at once in the test environment
    return module


def test_latest_gpu_figures_come_from_the_first_serving_table_of_results():
    line = _quickstart().latest_gpu_figures()
    results = (REPO / "benchmarks" / "RESULTS.md").read_text().split("## Serving speed on the H200", 1)[1]
    run = re.search(r"^### (Run \d+) \(([\d-]+)", results, re.M)
    table = results[run.end():].split("\n\n|", 1)[1].split("\n\n", 1)[0]
    real_1 = re.search(r"^\| real \| 0 \| 1 \|(.*)$", table, re.M).group(1).split("|")
    bound_1 = re.search(r"^\| bound_accept_all \| 0 \| 1 \|(.*)$", table, re.M).group(1).split("|")
    ratio = 3  # no-spec, built-in, ours, ours/no-spec
    assert f"H200, {run.group(1)}, {run.group(2)}" in line, line
    assert f"{real_1[ratio].strip()} at 1 request," in line, line
    assert f"; {bound_1[ratio].strip()} at 1 request when every draft token is accepted" in line, line
