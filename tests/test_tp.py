"""Tensor parallelism without a server: two CPU processes form SGLang's TP group over gloo (set up by the plugin's
CPU hooks, as in a ``--tp-size 2`` server) and run sglang-dflash's TP pieces against their unsharded versions:

* the sharded draft (`SGLangDFlashDraft` under TP 2: each rank's heads and MLP rows, o_proj/down_proj all-reduced)
  gives the unsharded core draft's hidden states, and each rank's context K/V are the core's for its KV heads
  (also with one KV head replicated on both ranks);
* the draft's proposal over the vocab-parallel lm_head (`step.propose` over a `verify.VocabSplit`) equals the
  full-vocabulary argmax of the draft logits, soft-capped logits with ties included;
* the sampled step over the shards (the draft's law and draws, `verify.sample_predictions`' accept and residual
  draw) gives, token for token, what the whole vocabulary gives with the same random state, on both ranks;
* sampled accepts drawn with different random states per rank differ, and `tp.agree_on_accept` makes every rank
  take rank 0's (SGLang's sampler after the step);
* the CPU KV budget is the smallest of the ranks'.

Each rank writes what it computed; the test compares them across ranks. ``python tests/test_tp.py RANK PORT OUT``
is one rank.
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

TP = 2
DRAFTS = {"kv2": dict(num_attention_heads=4, num_key_value_heads=2),
          "kv1": dict(num_attention_heads=4, num_key_value_heads=1)}  # KV head replicated on both ranks


def _draft_config(heads: dict, **extra):
    from sglang_dflash.config import DFlashDraftConfig

    return DFlashDraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, vocab_size=128,
                             num_target_layers=6, mask_token_id=5, head_dim=16, block_size=8, **heads, **extra)


class _BlockAttention(torch.nn.Module):
    """Stands in for RadixAttention: the block's queries attend to [context K/V of this layer ; block K/V]."""

    def __init__(self, radix, ctx):
        super().__init__()
        self.layer_id, self.ctx = radix.layer_id, ctx
        self.heads, self.kv_heads, self.d = radix.tp_q_head_num, radix.tp_k_head_num, radix.head_dim

    def forward(self, q, k, v, forward_batch):
        n = q.shape[0]
        ck, cv = self.ctx[self.layer_id]
        keys = torch.cat([ck, k.reshape(n, self.kv_heads, self.d)])[None].transpose(1, 2)
        vals = torch.cat([cv, v.reshape(n, self.kv_heads, self.d)])[None].transpose(1, 2)
        out = F.scaled_dot_product_attention(q.reshape(1, n, self.heads, self.d).transpose(1, 2), keys, vals,
                                             enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).reshape(n, self.heads * self.d)


class _KVPool:
    def __init__(self):
        self.writes = {}

    def set_kv_buffer(self, layer, loc, k, v):
        self.writes[layer.layer_id] = (k.clone(), v.clone())


def _draft_checks(rank: int, out: dict) -> None:
    """The sharded draft vs the core draft with the same weights (rank-local slices checked here)."""
    from transformers import PretrainedConfig

    from sglang_dflash.adapter.draft_model import SGLangDFlashDraft
    from sglang_dflash.model import DFlashDraftModel

    for name, heads in DRAFTS.items():
        cfg = _draft_config(heads)
        torch.manual_seed(0)  # the same weights on both ranks
        core = DFlashDraftModel(cfg).eval()
        for p in core.parameters():
            p.data += 0.1 * torch.randn_like(p)
        model = SGLangDFlashDraft(PretrainedConfig(**cfg.to_dict()))
        s = model.shard
        assert (s.rank, s.size) == (rank, TP)
        model.load_weights([(f"model.{k}", v) for k, v in core.state_dict().items()])
        assert model.core.layers[0].self_attn.q_proj.weight.shape == (cfg.num_attention_heads // TP * 16, 64)

        ctx_len, n = 11, cfg.block_size
        hidden = torch.randn(ctx_len, cfg.context_feature_size)
        ctx_pos = torch.arange(ctx_len)
        pool = _KVPool()
        model.write_context_kv(hidden, ctx_pos, torch.arange(ctx_len), pool)
        want = core.context_kv(core.project_context(hidden[None]), ctx_pos[None])
        for i, (k, v) in enumerate(want):
            got_k, got_v = pool.writes[i]
            torch.testing.assert_close(got_k, k[0, :, s.kv0:s.kv1], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(got_v, v[0, :, s.kv0:s.kv1], rtol=1e-5, atol=1e-5)

        model.attn = torch.nn.ModuleList(_BlockAttention(a, pool.writes) for a in model.attn)
        embeds = torch.randn(n, cfg.hidden_size)
        positions = torch.arange(ctx_len, ctx_len + n)
        got = model(None, positions, None, input_embeds=embeds).hidden_states
        ref = core(embeds[None], positions[None], list(want))[0]
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
        out[f"draft_{name}_hidden"] = got
        out[f"draft_{name}_kv_heads"] = torch.tensor([s.kv0, s.kv1])


def _propose_checks(rank: int, group, out: dict) -> None:
    """step.propose over this rank's half of the lm_head == the full-vocabulary proposal."""
    import functools
    from types import SimpleNamespace

    from sglang_dflash.adapter.step import propose
    from sglang_dflash.model import draft_logits
    from sglang_dflash.verify import VocabSplit

    cfg = _draft_config(DRAFTS["kv2"], final_logit_softcapping=2.0)  # saturating cap: ties across the shards
    bs, B, H, V = 3, cfg.block_size, 64, 128
    g = torch.Generator().manual_seed(1)
    weight = torch.randn(V, H, generator=g)
    hidden = torch.randn(bs * B, H, generator=g) * 8  # large logits: the cap saturates, maxima tie across shards
    ids = torch.randint(0, V, (bs * B,), generator=g)
    full = SimpleNamespace(block_size=B, lm_head_weight=weight, draft_logits=functools.partial(draft_logits, cfg),
                           vocab=VocabSplit.whole(V))
    half = V // TP
    split = VocabSplit(rank * half, half, V, group)
    mine = SimpleNamespace(**{**vars(full), "lm_head_weight": weight[rank * half:(rank + 1) * half], "vocab": split})
    scores = draft_logits(cfg, hidden.view(bs, B, H)[:, 1:] @ weight.t())
    assert (scores[..., :half].amax(-1) == scores[..., half:].amax(-1)).sum() >= 3  # ties between the ranks
    want, law = propose(full, hidden, ids, bs)
    assert law is None
    assert torch.equal(want[:, 1:], scores.argmax(-1)) and torch.equal(want[:, 0], ids.view(bs, B)[:, 0])
    got, _ = propose(mine, hidden, ids, bs)
    assert torch.equal(got, want), (got, want)
    out["proposal"] = got
    # first-maximum rule across ranks on exact ties
    scores = torch.zeros(4, half)
    scores[:, 5] = 1.0  # every rank's best is its local id 5 with the same value
    assert split.argmax(scores).tolist() == [5] * 4


def _split_sampling_checks(rank: int, group, out: dict) -> None:
    """The sampled step over this rank's vocabulary shard (`step.propose` + `verify.sample_predictions` with a
    `VocabSplit`, as `step.decode_step` runs them) == the whole vocabulary's with the same random state."""
    import functools
    from types import SimpleNamespace

    from sglang_dflash.adapter.sampling import StepSampling
    from sglang_dflash.adapter.step import propose
    from sglang_dflash.model import draft_logits
    from sglang_dflash.verify import VocabSplit, sample_predictions

    cfg = _draft_config(DRAFTS["kv2"])
    bs, B, H, V = 6, cfg.block_size, 64, 128
    half = V // TP
    g = torch.Generator().manual_seed(3)  # the same inputs on both ranks
    weight = torch.randn(V, H, generator=g)
    hidden = torch.randn(bs * B, H, generator=g) * 0.5
    ids = torch.randint(0, V, (bs * B,), generator=g)
    sampling = StepSampling(torch.tensor([0.6, 1.0, 1.0, 1.4, 0.9, 2.0]), torch.full((bs,), -1), torch.ones(bs),
                            torch.zeros(bs), filtered=False)
    full = SimpleNamespace(block_size=B, lm_head_weight=weight, draft_logits=functools.partial(draft_logits, cfg),
                           vocab=VocabSplit.whole(V))
    split = VocabSplit(rank * half, half, V, group)
    mine = SimpleNamespace(**{**vars(full), "lm_head_weight": weight[rank * half:(rank + 1) * half], "vocab": split})

    # filtered: top-k 1 (a greedy row of a mixed batch), top-k 3, top-p 0.5, min-p 0.1 -- cuts among the 64
    # candidates, where the shards' law is the whole vocabulary's
    filtered = StepSampling(sampling.temperature, torch.tensor([1, 3, -1, -1, 10, -1]), torch.tensor(
        [1.0, 1.0, 0.5, 1.0, 0.9, 1.0]), torch.tensor([0.0, 0.0, 0.0, 0.1, 0.0, 0.0]), filtered=True)
    for params in (filtered, sampling):
        torch.manual_seed(7)
        want, want_law = propose(full, hidden, ids, bs, B, params)
        torch.manual_seed(7)
        got, got_law = propose(mine, hidden, ids, bs, B, params)
        torch.testing.assert_close(got_law, want_law[..., rank * half:(rank + 1) * half], rtol=1e-5, atol=1e-7)
        assert torch.equal(got, want), (got, want)
        support = (want_law > 0).sum(-1)
        assert (support[0] == 1).all() == params.filtered and (support[1] <= 3).all() == params.filtered
    # a split draw whose ranks draw only their own shard's noise from the same state: correlated shards, other tokens
    torch.manual_seed(7)
    race = torch.empty_like(got_law).exponential_()
    assert not torch.equal(split.argmax(got_law / race), want[:, 1:])

    scores = draft_logits(cfg, hidden.view(bs, B, H) @ weight.t())  # target logits near the draft's: some accepted
    logits = torch.cat([scores[:, 1:], torch.randn(bs, 1, V, generator=g)], dim=1)
    logits = logits + 0.7 * torch.randn(bs, B, V, generator=g)
    probs = sampling.probs(logits)
    results = []
    for law in (got_law, want_law[..., rank * half:(rank + 1) * half]):
        torch.manual_seed(8)
        whole = sample_predictions(want, probs, draft_probs=want_law)
        torch.manual_seed(8)
        results.append(sample_predictions(want, probs, draft_probs=law, vocab=split))
        assert torch.equal(results[-1], whole), (results[-1], whole)
    matches = (want[:, 1:] == whole[:, :-1]).to(torch.int64).cumprod(-1).sum(-1)
    assert 0 < matches.sum() and (matches < B - 1).any(), matches  # accepts and rejections both
    out["split_drafts"], out["split_targets"] = got, results[0]


def _accept_checks(rank: int, group, out: dict) -> None:
    """Sampled accepts of the same logits with per-rank random states, before and after agree_on_accept."""
    from sglang_dflash.adapter.tp import agree_on_accept
    from sglang_dflash.kernels.accept import accept_tokens
    from sglang_dflash.verify import sample_predictions, target_probs

    bs, B, V = 16, 8, 128
    g = torch.Generator().manual_seed(2)  # the same logits and drafts on both ranks
    logits = torch.randn(bs, B, V, generator=g)
    drafts = torch.randint(0, V, (bs, B), generator=g)
    drafts[:, 1:] = logits[:, :-1].argmax(-1)  # likely drafts, so that accept lengths vary
    seq_lens = torch.randint(10, 50, (bs,), generator=g)
    probs = target_probs(logits, torch.ones(bs), torch.full((bs,), -1), torch.ones(bs), torch.zeros(bs),
                         needs_filter=False, any_greedy=False)
    torch.manual_seed(100 + rank)  # diverged random states
    own = accept_tokens(drafts, sample_predictions(drafts, probs), seq_lens)
    agreed = agree_on_accept(tuple(t.clone() for t in own), group)
    for name, t in zip(("accept_lens", "bonus", "committed", "new_seq_lens"), own):
        out[f"own_{name}"] = t
    for name, t in zip(("accept_lens", "bonus", "committed", "new_seq_lens"), agreed):
        out[f"agreed_{name}"] = t


def _rank(rank: int, port: int, out_dir: Path) -> None:
    from sglang.srt.distributed import parallel_state as ps
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_dflash.adapter import cpu_platform

    cpu_platform.setup()
    cpu_platform.register_hooks()  # as in a CPU server's ranks: TP groups on gloo, no PyNccl
    HookRegistry.apply_hooks()
    ps.init_distributed_environment(world_size=TP, rank=rank, local_rank=rank, backend="gloo",
                                    distributed_init_method=f"tcp://127.0.0.1:{port}")
    if "tensor_model_parallel_size" in inspect.signature(ps.initialize_model_parallel).parameters:
        ps.initialize_model_parallel(tensor_model_parallel_size=TP)
    else:  # 0.5.20+: the groups are built at the published widths
        from sglang.test.test_utils import publish_build_topology

        publish_build_topology(world_rank=rank, tp_size=TP, device="cpu")
        ps.initialize_model_parallel(backend="gloo")
    group = ps.get_tp_group()
    assert group.world_size == TP and group.pynccl_comm is None
    assert cpu_platform._min_over_ranks(1000 + 7 * rank) == 1000  # one KV pool size for every rank
    out: dict = {}
    _draft_checks(rank, out)
    _propose_checks(rank, group, out)
    _split_sampling_checks(rank, group, out)
    _accept_checks(rank, group, out)
    torch.save(out, out_dir / f"rank{rank}.pt")


def test_two_gloo_ranks_shard_the_draft_and_agree(tmp_path):
    from harness.server import free_port

    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")])}
    procs = [subprocess.Popen([sys.executable, __file__, str(r), str(port), str(tmp_path)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(TP)]
    logs = [p.communicate(timeout=600)[0] for p in procs]
    for r, (p, log) in enumerate(zip(procs, logs)):
        assert p.returncode == 0, f"rank {r} failed:\n{log[-4000:]}"
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in range(TP))
    # every rank computed the same draft hidden states and proposal
    for name in DRAFTS:
        assert torch.equal(r0[f"draft_{name}_hidden"], r1[f"draft_{name}_hidden"])
    assert r0["draft_kv2_kv_heads"].tolist() == [0, 1] and r1["draft_kv2_kv_heads"].tolist() == [1, 2]
    assert r0["draft_kv1_kv_heads"].tolist() == r1["draft_kv1_kv_heads"].tolist() == [0, 1]
    assert torch.equal(r0["proposal"], r1["proposal"])
    assert torch.equal(r0["split_drafts"], r1["split_drafts"]) and torch.equal(r0["split_targets"], r1["split_targets"])
    # diverged random states gave different accepts; agree_on_accept gives rank 0's on both
    assert not torch.equal(r0["own_committed"], r1["own_committed"])
    assert r0["own_accept_lens"].tolist() != [0] * 16  # drafts got accepted
    for name in ("accept_lens", "bonus", "committed", "new_seq_lens"):
        assert torch.equal(r0[f"agreed_{name}"], r0[f"own_{name}"]), name
        assert torch.equal(r1[f"agreed_{name}"], r0[f"own_{name}"]), name
        assert r1[f"agreed_{name}"].dtype == r1[f"own_{name}"].dtype, name


def test_cpu_binding_splits_the_cpus_per_rank():
    from sglang_dflash.adapter.cpu_platform import cpu_binding

    assert cpu_binding([0, 1], 2) == "0|1"
    assert cpu_binding([0, 1, 2, 3, 4], 2) == "0-2|3-4"
    assert cpu_binding([0, 1, 2, 3, 8, 9, 10, 11], 2) == "0-3|8-11"
    assert cpu_binding([0, 2, 4, 5], 2) == "0,2|4-5"
    assert cpu_binding([3], 2) == "3|3"


if __name__ == "__main__":
    _rank(int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]))
