"""DFLASH with tensor parallelism on CPU: ``--tp-size 2`` served by sglang-dflash against a one-rank no-spec server.

SmolLM2-135M and its bundled drafter have 9 query heads over 3 KV heads, which 2 ranks cannot share; both are served
widened to 12 over 6 (`tp_models.widen_heads`: the same function, the drafter's acceptance kept). Two servers start
once for the module, concurrently: no-spec at ``--tp-size 1`` and DFLASH at ``--tp-size 2`` (the target sharded by
SGLang, the draft by sglang-dflash, the ranks on gloo). No TP environment is given to the servers: what a CPU host
needs for TP (gloo without PyNccl, CPUs per rank, no first-request compile) is the plugin's own set-up. The
in-process checks of the TP pieces (sharded draft == whole draft, one accept decision on every rank) are in
test_tp.py.
"""

from __future__ import annotations

from collections import Counter

import pytest

from server_fixtures import COMMON_ARGS, dflash_args, drafter_for_tests, launch_servers
from test_server_dflash import (EOS_QUESTIONS, MAX_NEW_TOKENS, P_VALUE_FLOOR, SAMPLING_N, SAMPLING_QUESTION, chat_ids,
                                generate_all, homogeneity_p_value, on_both, sample_pairs)
from tp_models import widen_heads

pytestmark = pytest.mark.server
PEAK_GB = 13  # no-spec + a DFLASH server of 2 ranks (conftest's _server_budget)

PROMPTS_PER_SET = 4


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(widened target, widened drafter, whether the drafter is the trained one)."""
    from sglang_dflash.assets import smollm2_path

    root = tmp_path_factory.mktemp("tp-models")
    drafter, bundled = drafter_for_tests(root, smollm2_path())
    return widen_heads(smollm2_path(), root / "target"), widen_heads(drafter, root / "drafter"), bundled


@pytest.fixture(scope="module")
def servers(models, tmp_path_factory):
    target, drafter, _ = models
    args = [*COMMON_ARGS, "--decode-log-interval", "1"]
    specs = {"nospec": (target, [*args, "--disable-overlap-schedule"]),
             "dflash": (target, [*args, *dflash_args(drafter), "--tp-size", "2"])}
    with launch_servers(specs, timeout=1200, log_dir=tmp_path_factory.mktemp("tp-server-logs")) as s:
        yield s


@pytest.fixture(scope="module")
def nospec(servers):
    return servers["nospec"]


@pytest.fixture(scope="module")
def dflash(servers):
    return servers["dflash"]


@pytest.fixture(scope="module")
def tokenizer(models):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(models[0])


def test_tp2_server_runs_sharded_with_the_plugins_cpu_setup(dflash, nospec, models):
    info = dflash.get_server_info()
    assert (info["tp_size"], info["speculative_algorithm"]) == (2, "DFLASH")
    assert nospec.get_server_info()["tp_size"] == 1
    log = dflash.log_text()
    assert "sglang-dflash: CPU tensor parallelism over 2 ranks on gloo" in log
    assert "TP0] DFLASH served by sglang-dflash" in log and "TP1] DFLASH served by sglang-dflash" in log


def test_greedy_matches_tp1_nospec(nospec, dflash, tokenizer, models):
    """Greedy replies (held-out prompts, concurrent, and short questions whose EOS lands inside a verify block) equal
    the one-rank no-spec server's token for token; the trained drafter gets drafts accepted across the ranks."""
    from sglang_dflash import data

    prompts = [ids for name in data.EVAL_DATASETS
               for ids in chat_ids(tokenizer, data.eval_prompts(name, PROMPTS_PER_SET, tokenizer))]
    prompts += chat_ids(tokenizer, data.apply_chat(list(EOS_QUESTIONS), tokenizer))
    payloads = [{"input_ids": ids, "sampling_params": {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS}}
                for ids in prompts]
    want, got = on_both(nospec, dflash, lambda s: generate_all(s, payloads, threads=8))
    for i, (w, g) in enumerate(zip(want, got)):
        assert g["output_ids"] == w["output_ids"], (i, w["output_ids"], g["output_ids"])
        assert g["text"] == w["text"] and g["meta_info"]["finish_reason"] == w["meta_info"]["finish_reason"], i
    assert sum(w["meta_info"]["finish_reason"]["type"] == "stop" for w in want) >= 3  # EOS cases stopped
    meta = [g["meta_info"] for g in got]
    assert all(1 <= m["spec_verify_ct"] <= max(1, m["completion_tokens"] - 1) for m in meta if m["completion_tokens"] > 1)
    accept_len = sum(m["completion_tokens"] for m in meta) / sum(m["spec_verify_ct"] for m in meta)
    if models[2]:  # the trained drafter (its decode steps averaged an accept length of 2.14 in the run that added this)
        assert accept_len > 1.8, accept_len


def test_multi_turn_with_prefix_hits_matches_tp1_nospec(nospec, dflash, models):
    """Three chat turns: each later turn reuses the cached earlier ones (the draft KV of the prefix included) and every
    reply equals the one-rank no-spec server's."""
    import openai

    def conversation(server):
        client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="none")
        messages = [{"role": "system", "content": "You are a geography tutor. Answer briefly."}]
        replies = []
        for question in ("What is the capital of Italy?", "And which river flows through it?",
                         "Name one famous building there."):
            messages.append({"role": "user", "content": question})
            r = client.chat.completions.create(model=str(models[0]), messages=messages, temperature=0, max_tokens=24)
            messages.append({"role": "assistant", "content": r.choices[0].message.content})
            replies.append(r)
        return replies

    want, got = on_both(nospec, dflash, conversation)
    for i, (w, g) in enumerate(zip(want, got)):
        assert g.choices[0].message.content == w.choices[0].message.content, i
        assert (g.usage.prompt_tokens, g.usage.completion_tokens) == (w.usage.prompt_tokens, w.usage.completion_tokens)
    for earlier, later in zip(got, got[1:]):
        assert later.usage.prompt_tokens_details.cached_tokens >= earlier.usage.prompt_tokens, later.usage


def test_sampled_first_tokens_follow_the_tp1_law(nospec, dflash, tokenizer):
    """At temperature 1 the 1st generated token (the target's prefill, sampled by SGLang on both ranks) and the 2nd
    (the first one a DFLASH verify step decides, rank 0's draw broadcast) follow the one-rank no-spec law: Pearson's
    homogeneity test over 300 samples per server gives p >= 1e-4 for each (test_server_dflash's bound), and rejects
    the greedy law as the control."""
    from sglang_dflash import data

    ids = chat_ids(tokenizer, data.apply_chat([SAMPLING_QUESTION], tokenizer))[0]
    params = {"temperature": 1.0, "max_new_tokens": 2, "ignore_eos": True}
    want, got = on_both(nospec, dflash, lambda s: sample_pairs(s, ids, params))
    for position in (0, 1):
        a, b = Counter(p[position] for p in want), Counter(p[position] for p in got)
        p = homogeneity_p_value(a, b)
        assert p >= P_VALUE_FLOOR, (position, p, a.most_common(5), b.most_common(5))
    second = Counter(t for _, t in got)
    top, count = Counter(t for _, t in want).most_common(1)[0]
    assert 0.3 * SAMPLING_N < count < 0.9 * SAMPLING_N  # an informative law
    greedy = dflash.generate(ids, {"temperature": 0.0, "max_new_tokens": 2, "ignore_eos": True})["output_ids"]
    assert greedy[1] == top
    assert homogeneity_p_value(Counter({greedy[1]: SAMPLING_N}), second) < P_VALUE_FLOOR
