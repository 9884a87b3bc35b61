"""Scaled training on the CPU: two ``torchrun`` processes (gloo) follow one process over the same global batch,
with the target replicated or sharded over them, and a run split by stops and ``--resume`` continues the exact
schedule of an uninterrupted one.

Run as a script (``python -m torch.distributed.run ... tests/test_train_ddp.py OUT ARGS_JSON``) this file is the
torchrun worker: each rank builds the same tiny target and calls ``train``.
"""

import json
import os
import shutil
import subprocess
import sys
import time

import pytest
import torch

from conftest import make_tiny_target
from sglang_dflash.model import load_draft
from sglang_dflash.train import (TrainArgs, TrainError, cache_part_path, init_distributed, latest_checkpoint,
                                 shard_target, train)
from test_train import PROMPTS, CharTokenizer

ARGS = dict(block_size=8, num_draft_layers=2, steps=6, batch_size=8, anchors_per_seq=8, lr=3e-3, max_new_tokens=32,
            gen_batch_size=8, seed=3, checkpoint_every=0)


def _target():
    return make_tiny_target("llama", initializer_range=0.2)  # as test_train's tiny_run: learnable outputs


def _history(out):
    return json.loads((out / "train_log.json").read_text())["history"]


def _state(ckpt):
    return torch.load(ckpt / "trainer_state.pt", map_location="cpu", weights_only=True)


def _cache(path):
    return {rec["key"]: rec for rec in map(json.loads, path.read_text().splitlines())}


def _torchrun(out, **overrides):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
           str(out), json.dumps({**ARGS, **overrides})]
    proc = subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]


def test_two_processes_follow_one_process(tmp_path):
    one, two = tmp_path / "one", tmp_path / "two"
    train(_target(), CharTokenizer(), PROMPTS, one, TrainArgs(**ARGS), progress=False)
    # the 2-rank run finds 10 of the 24 responses cached: the ranks generate the rest in shards, rank 0 merges
    two.mkdir()
    lines = (one / "responses.jsonl").read_text().splitlines()
    (two / "responses.jsonl").write_text("\n".join(lines[:10]) + "\n")
    t0 = time.time()
    _torchrun(two, grad_accum=2, stop_at_step=3)  # 2 ranks x 2 micro-batches of 2 sequences; stops after step 3
    assert latest_checkpoint(two).name == "checkpoint-3" and not (two / "model.safetensors").exists()
    assert json.loads((two / "train_log.json").read_text())["finished"] is False
    _torchrun(two, grad_accum=2, resume=True)
    print(f"two torchrun runs: {time.time() - t0:.0f} s")
    assert _cache(two / "responses.jsonl") == _cache(one / "responses.jsonl")
    assert not cache_part_path(two / "responses.jsonl", 0).exists()
    assert not cache_part_path(two / "responses.jsonl", 1).exists()

    h1, h2 = _history(one), _history(two)
    assert [h["step"] for h in h2] == [h["step"] for h in h1] == list(range(1, 7))
    for a, b in zip(h1, h2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
        assert b["lr"] == a["lr"]
        assert b["accept"] == pytest.approx(a["accept"], abs=1e-9) and b["tau"] == pytest.approx(a["tau"])
    # same checkpoint format, same weights
    c1, c2 = latest_checkpoint(one), latest_checkpoint(two)
    assert c1.name == c2.name == "checkpoint-6"
    assert sorted(p.name for p in c1.iterdir()) == sorted(p.name for p in c2.iterdir())
    s1, s2 = _state(c1), _state(c2)
    assert s1.keys() == s2.keys() and s2["world_size"] == 2 and len(s2["rng"]) == 2
    for name, w in s1["model"].items():
        torch.testing.assert_close(s2["model"][name], w, rtol=1e-5, atol=1e-6)
    d1, d2 = load_draft(one), load_draft(two)
    assert d1.cfg.to_dict() == d2.cfg.to_dict()
    for (name, w1), w2 in zip(d1.state_dict().items(), d2.state_dict().values()):
        torch.testing.assert_close(w2.float(), w1.float(), rtol=2 ** -7, atol=1e-6, msg=name)


def test_sharded_target_follows_one_process(tmp_path):
    """--shard-target: two ranks that each hold half of every target layer (FSDP2, all-gathered per forward) train
    as one process with the whole target does. The worker also checks the shards' sizes and that a sharded target
    refuses to generate in-process (each rank would run its own number of forwards)."""
    one, two = tmp_path / "one", tmp_path / "two"
    train(_target(), CharTokenizer(), PROMPTS, one, TrainArgs(**ARGS), progress=False)
    two.mkdir()
    shutil.copy(one / "responses.jsonl", two / "responses.jsonl")
    _torchrun(two, shard_target=True)
    h1, h2 = _history(one), _history(two)
    assert [h["step"] for h in h2] == [h["step"] for h in h1] == list(range(1, 7))
    for a, b in zip(h1, h2):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5), (a, b)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4), (a, b)
    for (name, w1), w2 in zip(load_draft(one).state_dict().items(), load_draft(two).state_dict().values()):
        torch.testing.assert_close(w2.float(), w1.float(), rtol=2 ** -7, atol=1e-6, msg=name)


def test_shard_target_needs_a_process_group():
    with pytest.raises(TrainError, match="torchrun --nproc-per-node N"):
        shard_target(_target(), torch.device("cpu"))


def test_resume_continues_the_exact_schedule(tmp_path):
    target, tok = _target(), CharTokenizer()
    full, split = tmp_path / "full", tmp_path / "split"
    args = TrainArgs(**{**ARGS, "steps": 8})
    train(target, tok, PROMPTS, full, args, progress=False)
    cache = full / "responses.jsonl"
    # stop by time (after the first step), by step, then run to the end
    train(target, tok, PROMPTS, split, TrainArgs(**{**args.__dict__, "stop_after_seconds": 0.0}), cache_path=cache,
          progress=False)
    assert latest_checkpoint(split).name == "checkpoint-1"
    train(target, tok, PROMPTS, split, TrainArgs(**{**args.__dict__, "resume": True, "stop_at_step": 4}),
          cache_path=cache, progress=False)
    assert latest_checkpoint(split).name == "checkpoint-4" and len(_history(split)) == 4
    assert not (split / "checkpoint-1" / "trainer_state.pt").exists()  # older state pruned, drafter kept
    assert load_draft(split / "checkpoint-1").cfg.block_size == 8
    train(target, tok, PROMPTS, split, TrainArgs(**{**args.__dict__, "resume": True}), cache_path=cache,
          progress=False)
    assert [h["loss"] for h in _history(split)] == [h["loss"] for h in _history(full)]
    assert _history(split) == _history(full)
    s_full, s_split = _state(full / "checkpoint-8"), _state(split / "checkpoint-8")
    for name, w in s_full["model"].items():
        assert torch.equal(s_split["model"][name], w), name
    for name, w in load_draft(full).state_dict().items():
        assert torch.equal(load_draft(split).state_dict()[name], w), name
    # a finished run resumes to nothing; a resume with other settings is refused
    train(target, tok, PROMPTS, split, TrainArgs(**{**args.__dict__, "resume": True}), cache_path=cache,
          progress=False)
    assert _history(split) == _history(full)
    with pytest.raises(TrainError, match="'lr': \\(0.003, 0.001\\)"):
        train(target, tok, PROMPTS, split, TrainArgs(**{**args.__dict__, "resume": True, "lr": 1e-3}),
              cache_path=cache, progress=False)


def test_batch_must_split_over_micro_batches(tmp_path):
    with pytest.raises(TrainError, match="--batch-size 6 must be a multiple of world size x --grad-accum = 1 x 4"):
        train(_target(), CharTokenizer(), PROMPTS, tmp_path, TrainArgs(**{**ARGS, "batch_size": 6, "grad_accum": 4}),
              progress=False)


if __name__ == "__main__":  # torchrun worker
    import torch.distributed as dist

    from torch.distributed.tensor import DTensor

    init_distributed("cpu")
    args = json.loads(sys.argv[2])
    target = _target()
    if args.pop("shard_target", False):
        full = target.base_model.layers[0].mlp.up_proj.weight.shape
        shard_target(target, torch.device("cpu"))
        w = target.base_model.layers[0].mlp.up_proj.weight
        assert isinstance(w, DTensor) and w.to_local().shape == (full[0] // 2, full[1]), (full, w.to_local().shape)
        assert not isinstance(target.get_input_embeddings().weight, DTensor)
        with torch.no_grad():  # the gathered weights are given back after a forward
            target.base_model(input_ids=torch.tensor([[1, 2, 3]]))
        assert isinstance(target.base_model.layers[0].mlp.up_proj.weight, DTensor)
        try:
            train(target, CharTokenizer(), PROMPTS, sys.argv[1] + "-uncached", TrainArgs(**args), progress=False)
            raise AssertionError("a sharded target generated in-process")
        except TrainError as e:
            assert "no cached response" in str(e) and "--response-server" in str(e), e
    train(target, CharTokenizer(), PROMPTS, sys.argv[1], TrainArgs(**args), progress=False)
    dist.destroy_process_group()
