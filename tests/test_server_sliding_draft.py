"""A drafter with sliding-window layers served by SGLang on CPU: the same accept lengths as the reference engine.

The bundled SmolLM2 drafter with its layers declared sliding (window 16, shorter than every prompt here, and
causal inside the block by z-lab's rule) runs in the SGLang server (DFLASH, torch_native, float32) and in
`sglang_dflash.hf.DFlashLM`. Greedy, both must emit the target's tokens; the draft decides only how many verify
steps a reply takes, so equal step counts per request show that both run the draft with the same attention.
The same drafter read as bidirectional inside the block (``is_causal: false``) takes other step counts in the
reference engine, so the comparison can tell the two readings apart.
"""

from __future__ import annotations

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from server_fixtures import COMMON_ARGS, bundled_drafter, dflash_args, launch_servers

pytestmark = pytest.mark.server
PEAK_GB = 6  # a server, the reference engine in this process (conftest's _server_budget)

WINDOW = 16
MAX_NEW_TOKENS = 32
QUESTIONS = ("Write a short poem about the sea.", "What is 17 times 23? Explain step by step.",
             "List three uses of Python.", "Explain what a hash map is.")


def _sliding_copy(src: Path, dst: Path, **extra) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(layer_types=["sliding_attention"] * cfg["num_hidden_layers"], sliding_window=WINDOW,
               use_sliding_window=True, **extra)
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from transformers import AutoTokenizer

    from sglang_dflash.assets import smollm2_path

    source = bundled_drafter()
    if source is None:
        pytest.fail("the bundled SmolLM2 drafter is missing from sglang_dflash/drafters/")
    tmp = tmp_path_factory.mktemp("sliding")
    target = smollm2_path()
    tok = AutoTokenizer.from_pretrained(target)
    prompts = [tok(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                           tokenize=False), add_special_tokens=False).input_ids for q in QUESTIONS]
    assert min(len(p) for p in prompts) > WINDOW + 8  # the window cuts the context off
    return target, _sliding_copy(source, tmp / "zlab"), _sliding_copy(source, tmp / "bidir", is_causal=False), prompts


def _reference_steps(target: Path, drafter: Path, prompts) -> tuple[list[list[int]], list[int]]:
    from transformers import AutoModelForCausalLM

    from sglang_dflash.hf import DFlashLM
    from sglang_dflash.model import load_draft

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    out = DFlashLM(model, load_draft(drafter, dtype=torch.float32)).generate(prompts, max_new_tokens=MAX_NEW_TOKENS)
    return out.sequences, [len(steps) for steps in out.accept_lens]


def test_sliding_drafter_server_matches_reference_engine(setup, tmp_path):
    target, zlab, bidir, prompts = setup
    specs = {"dflash": (target, [*COMMON_ARGS, "--disable-overlap-schedule", *dflash_args(zlab)])}
    with ThreadPoolExecutor(1) as pool:  # the reference engine runs while the server starts
        references = pool.submit(lambda: [_reference_steps(target, d, prompts) for d in (zlab, bidir)])
        with launch_servers(specs, log_dir=tmp_path) as servers:
            server = servers["dflash"]
            replies = [server.generate(p, {"temperature": 0, "max_new_tokens": MAX_NEW_TOKENS}) for p in prompts]
            log = server.log_text()
        (want_tokens, want_steps), (_, bidir_steps) = references.result()
    assert bidir_steps != want_steps, "the two readings of the sliding layers must differ on these prompts"
    assert sum(len(s) for s in want_tokens) > sum(want_steps) + len(prompts), "some drafts must be accepted"
    assert "DFLASH served by sglang-dflash" in log
    assert [r["output_ids"] for r in replies] == want_tokens
    assert [r["meta_info"]["spec_verify_ct"] for r in replies] == want_steps
