"""DFLASH on a hybrid target (Gated DeltaNet + full attention): a tiny random Qwen3.5-shaped model
(``harness.models.make_tiny_qwen3_5``; once with Qwen3-Next's MoE blocks) served on CPU in float32, where SGLang's GDN paths run on the plugin's torch
ops (``sglang_dflash.adapter.cpu_linear_attn``) and greedy output is exact.

The reference is the target's greedy output computed by transformers (prefill + token-by-token recurrent decode
in its torch GDN). The server keeps the linear-attention conv state in float32 (the plugin's CPU set-up for a
float32 server; SGLang's default bfloat16 conv state makes a continuation part from a longer prefill, see
``benchmarks/HYBRID.md``). The reference is also the oracle draft's knowledge
(``SGLANG_DFLASH_TEST_ORACLE_DRAFT``, see ``harness/sitecustomize``), which makes the accepted drafts per step cycle
through 0 .. B-1. The DFLASH server must reproduce every output token for token -- several prompts sent concurrently (verify steps over mixed batches), prompts longer than the prefill chunk
(chunked prefill), and second turns that extend the first turns' conversations (radix-cache hits that restore the
linear-attention state saved with a finished request) -- with every accept length occurring, and again while
SGLang retracts running requests. The control: the same
DFLASH server with the state committed after the whole verify block (``SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT``)
must fail the same comparison.
"""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.models import make_tiny_qwen3_5
from harness.server import DEVICE
from server_fixtures import dflash_args, launch_servers, make_random_drafter

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(DEVICE != "cpu", reason="float32 hybrid identity: CPU only (see test docstring)")]

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 24
CHUNK = 32  # --chunked-prefill-size: the long prompts and the second turns are prefilled in chunks
ARGS = ["--dtype", "float32", "--chunked-prefill-size", str(CHUNK), "--max-running-requests", "8"]
# first turns: short and long prompts (token ids of the SmolLM2 vocabulary)
PROMPTS = [
    [1, 9, 3, 4, 5],
    list(range(100, 140)),
    [7] * 30,
    list(range(1000, 1300, 7)),
    list(range(20000, 20090, 3)) * 2,
    [42, 4242, 424, 24, 2424, 4],
]
FOLLOW_UP = [11, 12, 13, 14, 15, 16, 17]  # the user's second turn, appended to turn 1's prompt and reply
STARTUP = 900.0  # s: a CPU server shares 2 cores with the rest of the suite


def _models(root, num_experts: int = 0):
    """A tiny random target (Qwen3.5 dense, or Qwen3-Next with ``num_experts`` MoE experts), a random draft."""
    from sglang_dflash.assets import smollm2_path

    target = make_tiny_qwen3_5(root / "target", smollm2_path(), num_experts=num_experts)
    draft = make_random_drafter(root / "draft", target, block_size=BLOCK_SIZE)
    return target, draft, root


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("hybrid"))


@pytest.fixture(scope="module")
def next_models(tmp_path_factory):
    return _models(tmp_path_factory.mktemp("qwen3-next"), num_experts=4)


def conversations(server):
    """Turn 1 of every prompt concurrently, then every turn 2 (turn 1's prompt + reply + FOLLOW_UP) concurrently.
    Returns ([(prompt, output_ids)] for all requests, [meta_info])."""
    def run(prompt):
        out = server.generate(prompt, {"max_new_tokens": MAX_NEW_TOKENS, "temperature": 0, "ignore_eos": True})
        return prompt, out["output_ids"], out["meta_info"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        first = list(pool.map(run, PROMPTS))
        second = list(pool.map(run, [p + o + FOLLOW_UP for p, o, _ in first]))
    results = first + second
    return [(p, o) for p, o, _ in results], [m for _, _, m in results]


def transformers_greedy(model_dir, prompts) -> list[list[int]]:
    """transformers' greedy continuation (MAX_NEW_TOKENS, no EOS stop) of each prompt: prefill + recurrent decode
    with its torch Gated DeltaNet."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=MAX_NEW_TOKENS, do_sample=False, eos_token_id=None)
        outs.append(ids[0, len(p):].tolist())
    return outs


@pytest.fixture(scope="module")
def reference(models):
    return _reference(models)


@pytest.fixture(scope="module")
def next_reference(next_models):
    return _reference(next_models)


def _reference(models):
    """The target's greedy outputs for both turns (transformers), and the oracle draft's file of them."""
    target, _, root = models
    first = transformers_greedy(target, PROMPTS)
    follow = [p + o + FOLLOW_UP for p, o in zip(PROMPTS, first)]
    outputs = list(zip(PROMPTS, first)) + list(zip(follow, transformers_greedy(target, follow)))
    oracle = root / "oracle.json"
    oracle.write_text(json.dumps([p + o for p, o in outputs]))
    return outputs, oracle


def accept_counts(metas) -> Counter:
    """Accepted drafts per verify step over all requests (SGLang's per-request histograms)."""
    total = Counter()
    for m in metas:
        for n, count in enumerate(m.get("spec_correct_drafts_histogram") or []):
            total[n] += count
    return total


@pytest.fixture(scope="module")
def served(models, reference, next_models, next_reference, tmp_path_factory):
    """The module's four DFLASH servers, started at once, each after serving :func:`conversations`:
    name -> (outputs, meta_infos, log text). ``plain``, ``retract`` (SGLang retracts running requests every few
    forwards) and ``broken`` (the state committed after the whole block) serve the Qwen3.5 target, ``next`` the
    Qwen3-Next one; every one drafts with the oracle of its target's reference."""
    oracle = {"SGLANG_DFLASH_TEST_ORACLE_DRAFT": str(reference[1])}
    # SGLang 0.5.17 picks the extra_buffer radix-cache strategy for Qwen3-Next on CPU too, then refuses it there
    # ("extra_buffer needs CUDA"), with or without speculative decoding; no_buffer it takes without the overlap
    # schedule only
    next_args = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
    qwen3_5 = [*ARGS, *dflash_args(models[1])]
    specs = {"plain": (models[0], qwen3_5, oracle),
             "retract": (models[0], qwen3_5, {**oracle, "SGLANG_TEST_RETRACT": "1"}),
             "broken": (models[0], qwen3_5, {**oracle, "SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT": "1"}),
             "next": (next_models[0], [*ARGS, *dflash_args(next_models[1]), *next_args],
                      {"SGLANG_DFLASH_TEST_ORACLE_DRAFT": str(next_reference[1])})}
    with launch_servers(specs, timeout=STARTUP, log_dir=tmp_path_factory.mktemp("hybrid-logs")) as servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            runs = dict(zip(servers, pool.map(conversations, servers.values())))
        return {name: (*runs[name], server.log_text()) for name, server in servers.items()}


def test_hybrid_dflash_greedy_identical_with_every_accept_length(served, reference):
    _assert_identical_with_every_accept_length(served["plain"], reference)


def test_qwen3_next_moe_hybrid_dflash_greedy_identical_with_every_accept_length(served, next_reference):
    """The same on Qwen3-Next's layout: MoE blocks (top-2 of 4 experts and a gated shared expert, SGLang's native
    CPU MoE) between the Gated DeltaNet and full-attention layers."""
    _assert_identical_with_every_accept_length(served["next"], next_reference)


def _assert_identical_with_every_accept_length(run, reference):
    got, metas, log = run
    assert "TEST: oracle draft" in log and "SGLANG_MAMBA_CONV_DTYPE=float32" in log
    for (prompt, want), (_, have) in zip(reference[0], got):
        assert have == want, f"prompt of {len(prompt)} tokens: DFLASH {have} != the target's {want}"
    counts = accept_counts(metas)
    assert set(range(BLOCK_SIZE)) <= set(counts), f"accept lengths seen {dict(counts)}; want each of 0..{BLOCK_SIZE - 1}"


def test_hybrid_dflash_greedy_identical_under_retraction(served, reference):
    """SGLang retracts running requests every few forwards (``SGLANG_TEST_RETRACT``): a retracted request is
    prefilled again later, its linear-attention state rebuilt from its tokens; the output must not change."""
    got, _, log = served["retract"]
    assert re.search(r"#retracted_reqs: [1-9]", log), "nothing was retracted"
    for (prompt, want), (_, have) in zip(reference[0], got):
        assert have == want, f"prompt of {len(prompt)} tokens: DFLASH {have} != the target's {want}"


def test_broken_state_commit_fails_identity(served, reference):
    """The control: committing each request's state after the whole block (not after its accepted tokens) must
    change the output."""
    got, _, log = served["broken"]
    assert "TEST: broken state commit" in log
    differ = sum(have != want for (_, want), (_, have) in zip(reference[0], got))
    assert differ > 0, "a state committed after the whole block went unnoticed"
