"""DFLASH on targets beyond dense attention, served on CPU in float32 where greedy output is exact: hybrid Gated
DeltaNet + full attention (a tiny random Qwen3.5, and Qwen3-Next's MoE layout), a sliding-window target (Gemma 4,
SGLang's sliding-window KV pool) and multi-head latent attention (DeepSeek-V2, an MLA KV pool, MoE layers).

What makes them serve on CPU is the plugin's CPU set-up: the GDN ops of ``sglang_dflash.adapter.cpu_linear_attn``
(with a float32 conv state: SGLang's default bfloat16 one makes a continuation part from a longer prefill, see
``benchmarks/HYBRID.md``), and ``sglang_dflash.adapter.cpu_platform`` items 8-10 (SGLang 0.5.17 refuses torch_native
for Gemma 4, reads a sliding layer's K/V at the full pool's slots, fails on Gemma 4's unset
``moe_intermediate_size``, and runs an MLA prompt's first prefill as plain multi-head attention, which torch_native
cannot do over the compressed cache). The draft keeps its context K/V in its own pool at the target's full-pool
token slots.

The reference is the target's greedy output computed by transformers (for the hybrids: prefill + token-by-token
recurrent decode in its torch GDN); it is also the oracle draft's knowledge (``SGLANG_DFLASH_TEST_ORACLE_DRAFT``, see
``harness/sitecustomize``), which makes the accepted drafts per step cycle through 0 .. B-1. Each DFLASH server must
reproduce every output token for token: several prompts sent concurrently (verify steps over mixed batches), then
second turns that extend the first turns' conversations (radix-cache hits; for the hybrids they restore the
linear-attention state saved with a finished request), with every accept length occurring. The Qwen3.5 server also
prefills in chunks and has SGLang retract running requests every few forwards (a retracted request's
linear-attention state is rebuilt from its tokens). The Gemma 4 server's sliding-window pool is smaller than what
the first turns allocate (``--swa-full-tokens-ratio``), so its slots part from the full pool's: a sliding layer read
at the full pool's slots then fails. The control: a Qwen3.5 server with the state committed after the whole verify
block (``SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT``) must fail the same comparison.

The servers that the selected tests read (their ``reads`` marker) start at once in one fixture (server start-ups
dominate the suite's time on 2 cores): on SGLang 0.5.23 the test command selects the hybrid tests (Gemma 4 meets
SGLang's own refusal of torch_native there).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import pytest

from harness.models import make_tiny_deepseek_v2, make_tiny_gemma4, make_tiny_qwen3_5
from harness.server import DEVICE
from server_fixtures import dflash_args, launch_servers, make_random_drafter

pytestmark = [pytest.mark.server,
              pytest.mark.skipif(DEVICE != "cpu", reason="float32 identity with transformers: CPU only")]
PEAK_GB = 15  # 5 servers at once (conftest's _server_budget)

BLOCK_SIZE = 4
FOLLOW_UP = [11, 12, 13, 14, 15, 16, 17]  # the user's second turn, appended to turn 1's prompt and reply
STARTUP = 900.0  # s: a CPU server shares 2 cores with the rest of the suite
ARGS = ["--dtype", "float32", "--max-running-requests", "8"]
CHUNK = 32  # --chunked-prefill-size of the hybrid servers: the long prompts and the second turns take several chunks
# first turns (token ids of the SmolLM2 vocabulary): short and long prompts
HYBRID_PROMPTS = [
    [1, 9, 3, 4, 5],
    list(range(100, 140)),
    [7] * 30,
    list(range(1000, 1300, 7)),
    list(range(20000, 20090, 3)) * 2,
    [42, 4242, 424, 24, 2424, 4],
]
# Gemma 4 / DeepSeek-V2: the same less the 60-token one (the seeds below were picked for these); Gemma 4's window is
# 16 tokens
PROMPTS = [p for p in HYBRID_PROMPTS if len(p) != 60]
# Gemma 4's full pool 2048 tokens, its sliding-window pool 10% of it (204): less than the first turns allocate
SWA_ARGS = ["--max-total-tokens", "2048", "--swa-full-tokens-ratio", "0.1"]
# SGLang 0.5.17 picks the extra_buffer radix-cache strategy for Qwen3-Next under the overlap schedule, then refuses
# it on CPU ("extra_buffer needs CUDA"; 0.5.23 likewise for Qwen3.5); DFLASH on CPU settles the synchronous scheduler
# first (cpu_platform item 12), so the Qwen3.5 servers leave the strategy to SGLang and the Qwen3-Next one names it
NEXT_ARGS = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]


@dataclass
class Family:
    """A tiny random target (``build(out_dir, tokenizer_dir, seed=...)``) served with a random draft."""

    build: object
    seed: int
    prompts: list[list[int]]
    max_new_tokens: int
    args: list[str]
    build_kwargs: dict = field(default_factory=dict)
    # draft config fields over the target's (a target's YaRN or MLA head sizes are not a z-lab draft's)
    draft_fields: dict = field(default_factory=dict)


FAMILIES = {
    "qwen3_5": Family(make_tiny_qwen3_5, 0, HYBRID_PROMPTS, 24, ["--chunked-prefill-size", str(CHUNK)]),
    "qwen3_next": Family(make_tiny_qwen3_5, 0, HYBRID_PROMPTS, 24, ["--chunked-prefill-size", str(CHUNK), *NEXT_ARGS],
                         {"num_experts": 4}),
    # the seeds leave every greedy choice of the reference a top-1 margin of > 4e-3 (float32 rounding ~1e-5 here)
    "gemma4": Family(make_tiny_gemma4, 2, PROMPTS, 20, SWA_ARGS, draft_fields={"rope_scaling": None, "head_dim": 16}),
    # its draft reads the target's layers out of order and one twice, as z-lab's default choice does on small
    # targets (`SGLangDFlashDraft.read_captured_layers`)
    "deepseek_v2": Family(make_tiny_deepseek_v2, 1, PROMPTS, 20, [],
                          draft_fields={"rope_scaling": None, "head_dim": 16, "target_layer_ids": [1, 0, 1]}),
}
# server name -> (family, extra environment)
SERVERS = {
    "qwen3_5": ("qwen3_5", {"SGLANG_TEST_RETRACT": "1"}),
    "qwen3_5_broken": ("qwen3_5", {"SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT": "1"}),
    "qwen3_next": ("qwen3_next", {}),
    "gemma4": ("gemma4", {}),
    "deepseek_v2": ("deepseek_v2", {}),
}


def transformers_greedy(model_dir, prompts, max_new_tokens: int) -> list[list[int]]:
    """transformers' greedy continuation (``max_new_tokens``, no EOS stop) of each prompt, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outs = []
    for p in prompts:
        with torch.no_grad():
            ids = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None)
        outs.append(ids[0, len(p):].tolist())
    return outs


def conversations(server, family: Family):
    """Turn 1 of every prompt concurrently, then every turn 2 (turn 1's prompt + reply + FOLLOW_UP) concurrently.
    Returns ([(prompt, output_ids)] for all requests, [meta_info])."""
    def run(prompt):
        out = server.generate(prompt, {"max_new_tokens": family.max_new_tokens, "temperature": 0, "ignore_eos": True})
        return prompt, out["output_ids"], out["meta_info"]

    with ThreadPoolExecutor(len(family.prompts)) as pool:
        first = list(pool.map(run, family.prompts))
        second = list(pool.map(run, [p + o + FOLLOW_UP for p, o, _ in first]))
    results = first + second
    return [(p, o) for p, o, _ in results], [m for _, _, m in results]


@pytest.fixture(scope="module")
def served(request, tmp_path_factory):
    """The servers of `SERVERS` that this module's selected tests read (their ``reads`` marker), started at once,
    each after serving :func:`conversations`; for each of their families first a tiny random target, a random draft,
    the reference (both turns, transformers) and the oracle draft's file of it: name -> (reference [(prompt,
    output_ids)], outputs, meta_infos, log text)."""
    from sglang_dflash.assets import smollm2_path

    wanted = {s for item in request.session.items if item.module is request.module
              for s in item.get_closest_marker("reads").args}
    built = {}
    for name in sorted({SERVERS[s][0] for s in wanted}):
        fam = FAMILIES[name]
        root = tmp_path_factory.mktemp(name)
        target = fam.build(root / "target", smollm2_path(), seed=fam.seed, **fam.build_kwargs)
        draft = make_random_drafter(root / "draft", target, block_size=BLOCK_SIZE, **fam.draft_fields)
        first = transformers_greedy(target, fam.prompts, fam.max_new_tokens)
        follow = [p + o + FOLLOW_UP for p, o in zip(fam.prompts, first)]
        reference = list(zip(fam.prompts, first)) + list(zip(follow, transformers_greedy(target, follow,
                                                                                          fam.max_new_tokens)))
        oracle = root / "oracle.json"
        oracle.write_text(json.dumps([p + o for p, o in reference]))
        built[name] = (target, draft, reference, oracle)
    specs = {}
    for name in sorted(wanted):
        fam, env = SERVERS[name]
        target, draft, _, oracle = built[fam]
        specs[name] = (target, [*ARGS, *FAMILIES[fam].args, *dflash_args(draft)],
                       {"SGLANG_DFLASH_TEST_ORACLE_DRAFT": str(oracle), **env})
    with launch_servers(specs, timeout=STARTUP, log_dir=tmp_path_factory.mktemp("arch-logs")) as servers:
        with ThreadPoolExecutor(len(servers)) as pool:
            runs = dict(zip(servers, pool.map(lambda n: conversations(servers[n], FAMILIES[SERVERS[n][0]]), servers)))
        return {name: (built[SERVERS[name][0]][2], *runs[name], server.log_text()) for name, server in servers.items()}


def accept_counts(metas) -> Counter:
    """Accepted drafts per verify step over all requests (SGLang's per-request histograms)."""
    total = Counter()
    for m in metas:
        for n, count in enumerate(m.get("spec_correct_drafts_histogram") or []):
            total[n] += count
    return total


def differences(run) -> list[str]:
    """The requests of ``run`` whose DFLASH output is not the target's, one line each."""
    reference, got = run[0], run[1]
    return [f"prompt of {len(prompt)} tokens: DFLASH {have} != the target's {want}"
            for (prompt, want), (_, have) in zip(reference, got) if have != want]


def assert_identical_with_every_accept_length(run):
    _, _, metas, log = run
    assert "TEST: oracle draft" in log and "DFLASH served by sglang-dflash" in log
    bad = differences(run)
    assert not bad, "\n".join(bad)
    counts = accept_counts(metas)
    assert set(range(BLOCK_SIZE)) <= set(counts), f"accept lengths seen {dict(counts)}; want each of 0..{BLOCK_SIZE - 1}"


@pytest.mark.reads("qwen3_5")
def test_hybrid_dflash_greedy_identical_with_every_accept_length_under_retraction(served):
    """Qwen3.5 (Gated DeltaNet + full attention), chunked prefill, SGLang retracting running requests every few
    forwards (``SGLANG_TEST_RETRACT``): a retracted request is prefilled again later, its linear-attention state
    rebuilt from its tokens."""
    run = served["qwen3_5"]
    assert "SGLANG_MAMBA_CONV_DTYPE=float32" in run[3]
    assert re.search(r"#retracted_reqs: [1-9]", run[3]), "nothing was retracted"
    assert_identical_with_every_accept_length(run)


@pytest.mark.reads("qwen3_next")
def test_qwen3_next_moe_hybrid_dflash_greedy_identical_with_every_accept_length(served):
    """The same on Qwen3-Next's layout: MoE blocks (top-2 of 4 experts and a gated shared expert, SGLang's native
    CPU MoE) between the Gated DeltaNet and full-attention layers."""
    assert "SGLANG_MAMBA_CONV_DTYPE=float32" in served["qwen3_next"][3]
    assert_identical_with_every_accept_length(served["qwen3_next"])


@pytest.mark.reads("qwen3_5_broken")
def test_broken_state_commit_fails_identity(served):
    """The control: committing each request's state after the whole block (not after its accepted tokens) must
    change the output."""
    assert "TEST: broken state commit" in served["qwen3_5_broken"][3]
    assert differences(served["qwen3_5_broken"]), "a state committed after the whole block went unnoticed"


@pytest.mark.reads("gemma4")
def test_gemma4_sliding_window_dflash_greedy_identical_with_every_accept_length(served):
    run = served["gemma4"]
    log = run[3]
    assert "Gemma 4 on CPU with torch_native" in log
    pool = re.search(r"SWAKVPool mem usage: .* swa size: (\d+), full size: (\d+)", log)
    assert pool, "no sliding-window KV pool in the log"
    turn1 = sum(len(p) + FAMILIES["gemma4"].max_new_tokens for p in PROMPTS)
    assert int(pool[1]) < turn1 < int(pool[2]), f"sliding-window pool {pool[1]}, full pool {pool[2]}: want the " \
        f"first turns ({turn1} tokens) to overflow the first only"
    assert_identical_with_every_accept_length(run)


@pytest.mark.reads("deepseek_v2")
def test_deepseek_v2_mla_dflash_greedy_identical_with_every_accept_length(served):
    assert_identical_with_every_accept_length(served["deepseek_v2"])
