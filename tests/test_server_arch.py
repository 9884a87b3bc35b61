"""DFLASH on two more target architectures, served on CPU in float32: Gemma 4 (``harness.models.make_tiny_gemma4``:
sliding-window and full-attention layers, SGLang's sliding-window KV pool) and DeepSeek-V2 (``make_tiny_deepseek_v2``:
multi-head latent attention, an MLA KV pool; MoE layers).

What makes them serve on CPU is the plugin's CPU set-up (``sglang_dflash.adapter.cpu_platform``, items 8-10): SGLang
0.5.17 refuses torch_native for Gemma 4, its torch_native backend reads a sliding layer's K/V at the full pool's slots,
its CPU loading fails on Gemma 4's unset ``moe_intermediate_size``, and it runs an MLA prompt's first prefill as plain
multi-head attention, which torch_native cannot do over the compressed cache. The draft keeps its context K/V in its
own (ordinary) pool at the target's full-pool token slots.

The reference is the target's greedy output computed by transformers; it is also the oracle draft's knowledge
(``SGLANG_DFLASH_TEST_ORACLE_DRAFT``, see ``harness/sitecustomize``), which makes the accepted drafts per step cycle
through 0 .. B-1. Each DFLASH server must reproduce every output token for token: several prompts sent concurrently,
then second turns that extend the first turns' conversations (radix-cache hits), with every accept length occurring.
The Gemma 4 server's sliding-window pool is made smaller than what the first turns allocate
(``--swa-full-tokens-ratio``), so its slots part from the full pool's: a sliding layer read at the full pool's slots
then fails (checked by hand: an index past the sliding-window pool's end).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import pytest

from harness.models import make_tiny_deepseek_v2, make_tiny_gemma4
from harness.server import DEVICE
from server_fixtures import dflash_args, launch_servers, mask_token_id

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(DEVICE != "cpu", reason="float32 identity with transformers: CPU only")]

BLOCK_SIZE = 4
MAX_NEW_TOKENS = 20
ARGS = ["--dtype", "float32", "--max-running-requests", "8"]
# first turns (token ids of the SmolLM2 vocabulary); Gemma 4's window is 16 tokens
PROMPTS = [
    [1, 9, 3, 4, 5],
    list(range(100, 140)),
    [7] * 30,
    list(range(1000, 1300, 7)),
    [42, 4242, 424, 24, 2424, 4],
]
FOLLOW_UP = [11, 12, 13, 14, 15, 16, 17]  # the user's second turn, appended to turn 1's prompt and reply
STARTUP = 900.0  # s: a CPU server shares 2 cores with the rest of the suite
# full pool 2048 tokens, sliding-window pool 10% of it (204): less than the first turns allocate
SWA_ARGS = ["--max-total-tokens", "2048", "--swa-full-tokens-ratio", "0.1"]
# family -> (checkpoint builder, seed, extra server args); the seeds leave every greedy choice of the reference a
# top-1 margin of > 4e-3 (float32 rounding differences are ~1e-5 here)
FAMILIES = {
    "gemma4": (make_tiny_gemma4, 2, SWA_ARGS),
    "deepseek_v2": (make_tiny_deepseek_v2, 1, []),
}


def make_drafter(out_dir, target_dir):
    """A random 1-layer z-lab-format draft for the target at ``target_dir`` (``server_fixtures.make_random_drafter``'s,
    with its own attention like z-lab's drafters: plain RoPE, head_dim 16 -- not DeepSeek's YaRN or MLA head sizes)."""
    import torch
    from transformers import AutoConfig

    from sglang_dflash.config import DFlashDraftConfig
    from sglang_dflash.model import DFlashDraftModel, save_draft

    cfg = DFlashDraftConfig.from_target(AutoConfig.from_pretrained(target_dir), num_hidden_layers=1,
                                        mask_token_id=mask_token_id(), block_size=BLOCK_SIZE, rope_scaling=None,
                                        head_dim=16)
    torch.manual_seed(0)
    save_draft(DFlashDraftModel(cfg).to(torch.bfloat16), out_dir)
    return out_dir


def transformers_greedy(model_dir, prompts) -> list[list[int]]:
    """transformers' greedy continuation (MAX_NEW_TOKENS, no EOS stop) of each prompt, in float32."""
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


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per family: a tiny random target, a random draft, the reference (both turns, transformers) and the oracle
    file; then the families' DFLASH servers, started at once, each after serving :func:`conversations`:
    name -> (reference [(prompt, output_ids)], outputs, meta_infos, log text)."""
    from sglang_dflash.assets import smollm2_path

    specs, references = {}, {}
    for name, (build, seed, extra) in FAMILIES.items():
        root = tmp_path_factory.mktemp(name)
        target = build(root / "target", smollm2_path(), seed=seed)
        draft = make_drafter(root / "draft", target)
        first = transformers_greedy(target, PROMPTS)
        follow = [p + o + FOLLOW_UP for p, o in zip(PROMPTS, first)]
        references[name] = list(zip(PROMPTS, first)) + list(zip(follow, transformers_greedy(target, follow)))
        oracle = root / "oracle.json"
        oracle.write_text(json.dumps([p + o for p, o in references[name]]))
        specs[name] = (target, [*ARGS, *extra, *dflash_args(draft)], {"SGLANG_DFLASH_TEST_ORACLE_DRAFT": str(oracle)})
    with launch_servers(specs, timeout=STARTUP, log_dir=tmp_path_factory.mktemp("arch-logs")) as servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            runs = dict(zip(servers, pool.map(conversations, servers.values())))
        return {name: (references[name], *runs[name], server.log_text()) for name, server in servers.items()}


def accept_counts(metas) -> Counter:
    """Accepted drafts per verify step over all requests (SGLang's per-request histograms)."""
    total = Counter()
    for m in metas:
        for n, count in enumerate(m.get("spec_correct_drafts_histogram") or []):
            total[n] += count
    return total


def _assert_identical_with_every_accept_length(run):
    reference, got, metas, log = run
    assert "TEST: oracle draft" in log and "DFLASH served by sglang-dflash" in log
    for (prompt, want), (_, have) in zip(reference, got):
        assert have == want, f"prompt of {len(prompt)} tokens: DFLASH {have} != the target's {want}"
    counts = accept_counts(metas)
    assert set(range(BLOCK_SIZE)) <= set(counts), f"accept lengths seen {dict(counts)}; want each of 0..{BLOCK_SIZE - 1}"


def test_gemma4_sliding_window_dflash_greedy_identical_with_every_accept_length(served):
    run = served["gemma4"]
    log = run[3]
    assert "Gemma 4 on CPU with torch_native" in log
    pool = re.search(r"SWAKVPool mem usage: .* swa size: (\d+), full size: (\d+)", log)
    assert pool, "no sliding-window KV pool in the log"
    turn1 = sum(len(p) + MAX_NEW_TOKENS for p in PROMPTS)
    assert int(pool[1]) < turn1 < int(pool[2]), f"sliding-window pool {pool[1]}, full pool {pool[2]}: want the " \
        f"first turns ({turn1} tokens) to overflow the first only"
    _assert_identical_with_every_accept_length(run)


def test_deepseek_v2_mla_dflash_greedy_identical_with_every_accept_length(served):
    _assert_identical_with_every_accept_length(served["deepseek_v2"])
