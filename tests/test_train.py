"""Trainer: block masks/labels exact, a tiny CPU run lowers the weighted loss, output loads in the core loader."""

import json
import math
import os
import random

import pytest
import torch

from conftest import TINY_MASK_ID, make_tiny_target
from sglang_dflash import data
from sglang_dflash.config import DFlashDraftConfig, select_target_layers
from sglang_dflash.model import load_draft
from sglang_dflash.train import (Batch, TrainArgs, TrainError, block_attention_mask, block_labels, cosine_lr,
                                 default_gamma, generate_responses, loss_weights, main, make_batch, train)


class CharTokenizer:
    """Tiny tokenizer for the 128-token random targets: one id per character, no chat template."""

    pad_token_id = 0
    eos_token_id = 2
    chat_template = None
    mask_token_id = TINY_MASK_ID

    def __call__(self, text, add_special_tokens=False):
        return type("Enc", (), {"input_ids": [3 + ord(c) % 100 for c in text]})()

    def get_vocab(self):
        return {}


PROMPTS = [f"tell me about item {i} please" for i in range(24)]


class NoGenerate(torch.nn.Module):
    """A stand-in for ``target`` whose generate fails: every response must come from the cache."""

    def __init__(self, target):
        super().__init__()
        self.p = torch.nn.Parameter(torch.zeros(1))
        self.generation_config = target.generation_config

    def generate(self, *a, **k):
        raise AssertionError("cached responses must not be generated again")


def test_block_attention_mask_exact():
    anchors = torch.tensor([[2, 4]])
    m = block_attention_mask(anchors, ctx_len=5, block_size=2)
    want_ctx = torch.tensor([[1, 1, 0, 0, 0]] * 2 + [[1, 1, 1, 1, 0]] * 2, dtype=torch.bool)
    want_blk = torch.tensor([[1, 1, 0, 0], [1, 1, 0, 0], [0, 0, 1, 1], [0, 0, 1, 1]], dtype=torch.bool)
    assert m.shape == (1, 4, 9)
    assert torch.equal(m[0, :, :5], want_ctx) and torch.equal(m[0, :, 5:], want_blk)


def test_block_labels_and_weights():
    ids = torch.tensor([[10, 11, 12, 13, 14, 0]])
    batch = Batch(ids, (ids > 0).long(), torch.tensor([5]), torch.tensor([[1, 3]]), torch.tensor([[True, True]]))
    pos, labels, ok = block_labels(batch, 3)
    assert pos.tolist() == [[[1, 2, 3], [3, 4, 5]]]
    assert labels.tolist() == [[[11, 12, 13], [13, 14, 0]]]
    assert ok.tolist() == [[[False, True, True], [False, True, False]]]
    w = loss_weights(4, gamma=2.0)
    assert torch.allclose(w, torch.tensor([1.0, 1.0, math.exp(-0.5), math.exp(-1.0)]))
    assert default_gamma(16) == 7.0 and default_gamma(8) == 4.0


def test_make_batch_anchors_in_response():
    recs = [{"prompt_ids": [5, 6, 7], "response_ids": [8, 9, 10, 2]}, {"prompt_ids": [5], "response_ids": [9, 2]}]
    b = make_batch(recs, anchors_per_seq=3, max_seq_len=64, pad_id=0, rng=random.Random(0))
    assert b.input_ids.tolist() == [[5, 6, 7, 8, 9, 10, 2], [5, 9, 2, 0, 0, 0, 0]]
    assert b.seq_lens.tolist() == [7, 3]
    assert sorted(b.anchors[0].tolist()) == [3, 4, 5] and b.anchor_valid[0].all()
    assert b.anchors[1, 0].item() == 1 and b.anchor_valid[1].tolist() == [True, False, False]


def test_cosine_schedule():
    assert cosine_lr(0, 100, 10, 1.0) == pytest.approx(0.1)
    assert cosine_lr(10, 100, 10, 1.0) == pytest.approx(1.0)
    assert cosine_lr(100, 100, 10, 1.0) == pytest.approx(0.0)


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("drafter")
    target = make_tiny_target("llama", initializer_range=0.2)  # peaked, repetitive greedy outputs: learnable
    args = TrainArgs(block_size=8, num_draft_layers=2, steps=40, batch_size=8, anchors_per_seq=8, lr=3e-3,
                     max_new_tokens=32, gen_batch_size=8, seed=3)
    train(target, CharTokenizer(), PROMPTS, out, args, progress=False)
    return target, out, args


def test_tiny_run_lowers_loss_and_loads(tiny_run):
    target, out, _ = tiny_run
    log = json.loads((out / "train_log.json").read_text())
    losses = [h["loss"] for h in log["history"]]
    assert len(losses) == 40 and log["steps_run"] == 40
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)
    for h in log["history"]:  # harmonic (tokens-per-step estimate) <= arithmetic mean of the block lengths
        assert 0.0 <= h["acc"] <= 1.0 and 0.0 <= h["acc1"] <= 1.0, h
        if h["tau"] == h["tau"]:
            assert 1.0 <= h["tau_steps"] <= h["tau"] + 1e-9 <= 8.0 + 1e-9, h
            # per-position acceptance: non-increasing fractions whose sum is the mean accepted length
            acc = h["accept"]
            assert len(acc) == 7 and all(1.0 >= a >= b >= 0.0 for a, b in zip(acc, acc[1:])), h
            assert 1.0 + sum(acc) == pytest.approx(h["tau"], abs=1e-9), h
    assert log["finished"] is True and log["steps_done"] == 40
    assert max(h["accept"][0] for h in log["history"]) > 0.2  # the drafter learned position 1 at least
    cfg = DFlashDraftConfig.from_pretrained(out)
    assert cfg.target_layer_ids == select_target_layers(6, 2)
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (8, TINY_MASK_ID, 6)
    cfg.validate_target(target.config)
    draft = load_draft(out)
    assert draft.dtype == torch.bfloat16
    names = set(draft.state_dict())
    assert "fc.weight" in names and not any("embed" in n or "lm_head" in n for n in names)


def test_responses_cache_resumes(tiny_run, tmp_path):
    target, out, args = tiny_run
    cache = out / "responses.jsonl"
    lines = cache.read_text().splitlines()
    assert len(lines) == len(PROMPTS)

    recs = generate_responses(NoGenerate(target), CharTokenizer(), PROMPTS, cache, max_new_tokens=32)
    assert len(recs) == len(PROMPTS) and {r["key"] for r in recs} == {json.loads(x)["key"] for x in lines}
    # a partial cache regenerates only the missing prompts, with the same greedy result
    part = tmp_path / "part.jsonl"
    part.write_text("\n".join(lines[:10]) + "\n")
    again = generate_responses(target, CharTokenizer(), PROMPTS, part, max_new_tokens=32, batch_size=8)
    assert again == recs
    assert len(part.read_text().splitlines()) == len(PROMPTS)
    # an interrupted run's torn last record is dropped and the cache rewritten, so appends stay readable
    torn = tmp_path / "torn.jsonl"
    torn.write_text("\n".join(lines[:10]) + "\n" + lines[10][:25])
    assert generate_responses(target, CharTokenizer(), PROMPTS, torn, max_new_tokens=32, batch_size=8) == recs
    assert [json.loads(x) for x in torn.read_text().splitlines()] == [json.loads(x) for x in lines[:10]] + recs[10:]
    # a gzip cache: written compressed, resumed after being cut in the middle of its stream, same records
    import gzip

    packed = tmp_path / "part.jsonl.gz"
    generate_responses(target, CharTokenizer(), PROMPTS[:12], packed, max_new_tokens=32, batch_size=8)
    data = packed.read_bytes()
    assert data[:2] == b"\x1f\x8b"  # gzip magic
    packed.write_bytes(data[: len(data) // 2])
    assert generate_responses(target, CharTokenizer(), PROMPTS, packed, max_new_tokens=32, batch_size=8) == recs
    with gzip.open(packed, "rt") as f:
        assert sorted(json.loads(x)["key"] for x in f) == sorted(r["key"] for r in recs)


def test_samples_per_prompt_extend_a_greedy_cache(tmp_path):
    """Several sampled responses per prompt, keyed prompt-major (sample 0 by the prompt alone, so a cache of greedy
    responses serves it and only the other samples are drawn); a rerun draws nothing; at temperature 0 more than
    one sample is refused with the fix named."""
    target = make_tiny_target("llama", initializer_range=0.2)
    cache, prompts = tmp_path / "responses.jsonl", PROMPTS[:4]
    greedy = generate_responses(target, CharTokenizer(), prompts, cache, max_new_tokens=16, batch_size=8,
                                progress=False)
    recs = generate_responses(target, CharTokenizer(), prompts, cache, max_new_tokens=16, batch_size=8,
                              temperature=1.0, samples_per_prompt=3, seed=5, progress=False)
    assert len(recs) == 12 and len(cache.read_text().splitlines()) == 12
    assert [r["key"] for r in recs[:3]] == [greedy[0]["key"], greedy[0]["key"] + "-1", greedy[0]["key"] + "-2"]
    assert recs[0::3] == greedy  # the greedy records kept as sample 0
    for i in range(4):
        trio = recs[3 * i:3 * i + 3]
        assert all(r["prompt_ids"] == greedy[i]["prompt_ids"] for r in trio)
        assert trio[1]["response_ids"] != trio[2]["response_ids"], trio  # two draws, not one copied
    # the draws follow the seed: the same samples again from a fresh cache of the greedy records
    fresh = tmp_path / "fresh.jsonl"
    fresh.write_text("".join(json.dumps(r) + "\n" for r in greedy))
    assert generate_responses(target, CharTokenizer(), prompts, fresh, max_new_tokens=16, batch_size=8,
                              temperature=1.0, samples_per_prompt=3, seed=5, progress=False) == recs
    assert generate_responses(NoGenerate(target), CharTokenizer(), prompts, cache, temperature=1.0, samples_per_prompt=3,
                              progress=False) == recs
    with pytest.raises(TrainError, match=r"--samples-per-prompt 2 at --gen-temperature 0.0.*--gen-temperature > 0"):
        generate_responses(target, CharTokenizer(), prompts, cache, samples_per_prompt=2, progress=False)


def test_samples_through_a_response_server_carry_their_own_seeds(monkeypatch, tmp_path):
    """``--response-server``: one request per (prompt, sample), each with ``sampling_seed`` = seed + its sample
    index, and the EOS the server matched kept as the last token."""
    import sys
    import types

    target = make_tiny_target("llama")
    posted = []

    def post(url, json, timeout):
        posted.append(json)
        n = len(json["input_ids"])
        return types.SimpleNamespace(status_code=200, json=lambda: [
            {"output_ids": [10 + i, 11], "meta_info": {"finish_reason": {"type": "stop", "matched": 2}}}
            for i in range(n)])

    monkeypatch.setitem(sys.modules, "requests", types.SimpleNamespace(post=post))
    recs = generate_responses(target, CharTokenizer(), PROMPTS[:3], tmp_path / "r.jsonl", server_url="http://x:1/",
                              temperature=0.8, samples_per_prompt=2, seed=7, batch_size=4, progress=False)
    assert len(recs) == 6 and all(r["response_ids"][-2:] == [11, 2] for r in recs)
    sent = [(ids, params) for body in posted for ids, params in zip(body["input_ids"], body["sampling_params"])]
    assert len(sent) == 6 and all(p["temperature"] == 0.8 and p["top_k"] == -1 for _, p in sent)
    by_prompt = {}
    for ids, params in sent:
        by_prompt.setdefault(tuple(ids), []).append(params["sampling_seed"])
    assert sorted(map(sorted, by_prompt.values())) == [[7, 8]] * 3


def test_cli_refuses_samples_at_temperature_zero(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--target", "smollm2", "--out", "x", "--samples-per-prompt", "3"])
    assert e.value.code == 2
    assert "--samples-per-prompt 3 at --gen-temperature 0.0" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--target", "/no/such/model"], "sglang_dflash.train: --target /no/such/model: no such directory"),
    (["--target", "~/no/such/model"],
     f"sglang_dflash.train: --target {os.path.expanduser('~')}/no/such/model: no such directory"),
    (["--target", "smollm2", "--shard-target"], "sglang_dflash.train: --shard-target shards the target over "
                                                "torchrun's processes"),
])
def test_cli_names_a_bad_target_or_a_shard_without_ranks(argv, message):
    """One line naming the problem, before any weights are read (no torchrun here: one process)."""
    with pytest.raises(SystemExit) as e:
        main([*argv, "--out", "x"])
    assert str(e.value).startswith(message)


def test_eval_cli_names_a_missing_target():
    from sglang_dflash import eval as dflash_eval

    with pytest.raises(SystemExit) as e:
        dflash_eval.main(["--target", "/no/such/model", "--draft", "bundled"])
    assert str(e.value).startswith("sglang_dflash.eval: --target /no/such/model: no such directory")


def test_training_is_deterministic(tiny_run, tmp_path):
    target, out, args = tiny_run
    short = TrainArgs(**{**args.__dict__, "steps": 4})
    logs = []
    for run in range(2):
        d = tmp_path / f"r{run}"
        train(target, CharTokenizer(), PROMPTS, d, short, cache_path=out / "responses.jsonl", progress=False)
        logs.append([h["loss"] for h in json.loads((d / "train_log.json").read_text())["history"]])
    assert logs[0] == logs[1]


def test_final_norm_starts_from_target(tiny_run, tmp_path):
    target, out, args = tiny_run
    saved = target.base_model.norm.weight.detach().clone()
    with torch.no_grad():
        target.base_model.norm.weight.copy_(torch.linspace(0.5, 2.0, target.config.hidden_size))
    try:
        train(target, CharTokenizer(), PROMPTS, tmp_path / "d", TrainArgs(**{**args.__dict__, "steps": 1, "lr": 0.0}),
              cache_path=out / "responses.jsonl", progress=False)
        norm = load_draft(tmp_path / "d", dtype=torch.float32).norm.weight
        assert torch.equal(norm, target.base_model.norm.weight.to(torch.bfloat16).float())
    finally:
        with torch.no_grad():
            target.base_model.norm.weight.copy_(saved)


def test_init_from_continues_and_refuses_other_config(tiny_run, tmp_path):
    target, out, args = tiny_run
    log = json.loads((out / "train_log.json").read_text())["history"]
    cont = TrainArgs(**{**args.__dict__, "steps": 3, "init_from": str(out)})
    d = tmp_path / "cont"
    train(target, CharTokenizer(), PROMPTS, d, cont, cache_path=out / "responses.jsonl", progress=False)
    first = json.loads((d / "train_log.json").read_text())["history"][0]["loss"]
    start = log[0]["loss"]
    end = sum(h["loss"] for h in log[-5:]) / 5
    assert abs(first - end) < 0.5 * abs(start - end), (start, end, first)  # starts where the saved run ended
    other = TrainArgs(**{**args.__dict__, "steps": 1, "init_from": str(out), "num_draft_layers": 1})
    with pytest.raises(ValueError, match="num_hidden_layers"):
        train(target, CharTokenizer(), PROMPTS, tmp_path / "bad", other, cache_path=out / "responses.jsonl",
              progress=False)


def test_user_turns_and_prompt_file(tmp_path):
    conv = {"conversations": [{"from": "human", "value": "first"}, {"from": "gpt", "value": "answer"},
                              {"from": "human", "value": "second"}, {"from": "gpt", "value": "more"}]}
    oa = {"messages": [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]}
    assert data.user_turns(conv) == ["first", "second"]
    assert data.user_turns(oa) == ["hi"]
    assert data.user_turns({"prompt": "p"}) == ["p"] and data.user_turns("raw") == ["raw"]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps([conv, {"conversations": [{"from": "gpt", "value": "x"}]}, oa])[:-40])  # truncated
    assert data.load_prompt_file(path) == ["first"]
    assert data.load_prompt_file(path, all_turns=True) == ["first", "second"]


def test_extra_prompt_sets_and_specs(tmp_path):
    keys = data.eval_exclusion_keys()
    gpqa, aime = data.training_prompts("gpqa"), data.training_prompts("aime2025")
    assert (len(gpqa), len(aime)) == (196, 30)  # 198 GPQA Diamond requests, two longer than max_chars=2000
    assert all(t.startswith("Answer the following multiple choice question") for t in gpqa)
    both = data.training_prompts("gpqa, aime2025", seed=1)
    assert sorted(both) == sorted(gpqa + aime) and both != gpqa + aime  # pooled, then shuffled
    # a prompt file in the spec: its eval-set prompts and duplicates are dropped
    mt = data.mtbench_prompts(1)[0]
    path = tmp_path / "p.jsonl"
    path.write_text("\n".join(json.dumps({"prompt": t}) for t in [mt, "write a haiku about rivers", aime[0]]))
    assert sorted(data.training_prompts(f"aime2025,{path}")) == sorted(aime + ["write a haiku about rivers"])
    assert not any(data.normalize(t) in keys for t in both)
    for bad, msg in (("gsm8k", "'gsm8k' is an evaluation set"), ("nosuchset", "unknown prompt set 'nosuchset'"),
                     (",", "no prompt set named")):
        with pytest.raises(data.DataError, match=msg):
            data.training_prompts(bad)


def test_plot_train_log(tiny_run, tmp_path):
    import importlib.util
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "plot_train_log.py"
    spec = importlib.util.spec_from_file_location("plot_train_log", script)
    plot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(plot)
    _, out, _ = tiny_run
    history = json.loads((out / "train_log.json").read_text())["history"]
    last = plot.mean_acceptance(history[-10:])
    assert len(last) == 7 and last == pytest.approx([sum(h["accept"][k] for h in history[-10:]) / 10
                                                     for k in range(7)])
    png = tmp_path / "curves.png"
    plot.main([str(out / "train_log.json"), str(out / "train_log.json"), "--out", str(png), "--window", "10"])
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.real_model
def test_training_prompts_exclude_eval_sets():
    train_texts = data.training_prompts()
    keys = data.eval_exclusion_keys()
    assert len(train_texts) > 40000  # every user turn
    assert 5000 < len(data.training_prompts(all_turns=False)) < len(train_texts)
    assert not any(data.normalize(t) in keys for t in train_texts)
    assert len({data.normalize(t) for t in train_texts}) == len(train_texts)
    assert len(data.mtbench_prompts()) == 80 and len(data.humaneval_prompts()) == 164
    assert len(data.gsm8k_prompts()) == 1319
