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


def test_dflash_progress_follows_the_reference_engine_batch(tiny_llama):
    """The DFlash progress (and its ETA) follows the batch from the target's forwards alone: before every forward
    its running rows are the engine's, and at the end every row has committed all its tokens."""
    import torch

    from sglang_dflash.hf import DFlashLM, target_generate_baseline
    from sglang_dflash.model import DFlashDraftModel

    from conftest import make_draft_config

    qs = _quickstart()
    prompts = [[1, 5, 9, 3], [1, 7], [1, 4, 4, 8, 2, 6], [1, 11, 12]]
    free = target_generate_baseline(tiny_llama, prompts, max_new_tokens=24, stop_token_ids=[]).sequences
    stop = free[0][6]  # row 0 stops after 7 tokens (or earlier); the others where (if) they meet it
    base = target_generate_baseline(tiny_llama, prompts, max_new_tokens=24, stop_token_ids=[stop])
    assert len({len(s) for s in base.sequences}) > 1, base.sequences  # rows leave the batch at different steps
    torch.manual_seed(0)
    lm = DFlashLM(tiny_llama, DFlashDraftModel(make_draft_config(tiny_llama.config, block_size=4)).eval())
    steps = qs.DFlashSteps([len(s) for s in base.sequences], qs.Progress("DFlash", base.num_new_tokens, "tokens"))
    batch_sizes = []

    def forward(block, logits):
        batch_sizes.append((block.shape[0], len(steps.rows)))
        steps.forward(block, logits)

    with qs._progress_hook(lm.target, forward):
        out = lm.generate(prompts, max_new_tokens=24, stop_token_ids=[stop])
    assert out.sequences == base.sequences
    assert all(engine == followed for engine, followed in batch_sizes), batch_sizes
    assert len(batch_sizes) == out.num_verify_steps + 1  # the prefill, then one forward per verify step
    assert steps.rows == [] and steps.left == [0] * len(prompts)
    assert steps.progress.done == base.num_new_tokens
