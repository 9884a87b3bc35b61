"""The draft's semantics pinned to z-lab's: hand-computed attention masks per layer type, the core model against
z-lab's reference implementation (the `dflash` package, 0.1.0) with the same weights, every `dflash_config` key,
tau counted both ways, training with the semantics a drafter is served with, and the `kernels` folder not
shadowing Hugging Face's `kernels` package."""

from __future__ import annotations

import copy
import os
import subprocess
import sys
from importlib.machinery import PathFinder
from pathlib import Path

import pytest
import torch

from sglang_dflash.config import DFLASH_CONFIG_KEYS, DFlashConfigError, DFlashDraftConfig
from sglang_dflash.eval import server_tau, tau_per_request, tau_per_step
from sglang_dflash.model import DFlashDraftModel, attention_mask, draft_logits

REPO = Path(__file__).resolve().parent.parent


def _visible(q_pos, k_pos, causal, window) -> list[list[int]]:
    m = attention_mask(torch.tensor([q_pos]), torch.tensor([k_pos]), causal, window)[0]
    return [[k_pos[j] for j in range(len(k_pos)) if m[i, j]] for i in range(len(q_pos))]


# A block of 4 queries at positions 4..7 over keys 0..7 (context 0..3, block 4..7).
Q, K = [4, 5, 6, 7], list(range(8))


def test_mask_full_attention_sees_everything():
    assert _visible(Q, K, causal=False, window=None) == [K] * 4


def test_mask_causal():
    assert _visible(Q, K, causal=True, window=None) == [[0, 1, 2, 3, 4], [0, 1, 2, 3, 4, 5],
                                                         [0, 1, 2, 3, 4, 5, 6], K]


def test_mask_causal_sliding_window_3():
    # z-lab's sliding layer: a query sees itself and the 2 keys before it
    assert _visible(Q, K, causal=True, window=3) == [[2, 3, 4], [3, 4, 5], [4, 5, 6], [5, 6, 7]]


def test_mask_bidirectional_sliding_window_2():
    # is_causal: false on a sliding layer: |q - k| < 2 on both sides
    assert _visible(Q, K, causal=False, window=2) == [[3, 4, 5], [4, 5, 6], [5, 6, 7], [6, 7]]


@pytest.mark.parametrize("is_causal, expected", [
    (None, [(False, None), (True, 6)]),  # z-lab's default: sliding layers causal, full ones bidirectional
    (True, [(True, None), (True, 6)]),
    (False, [(False, None), (False, 6)]),
])
def test_layer_attention_rule(is_causal, expected):
    cfg = _cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=6, is_causal=is_causal)
    assert [cfg.layer_attention(i) for i in range(2)] == expected


# ------------------------------------------------------------------ the core model against z-lab's own code

def _cfg(**overrides) -> DFlashDraftConfig:
    kw = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=8, vocab_size=64, num_target_layers=8, mask_token_id=63, block_size=6, target_layer_ids=[1, 4],
              rope_theta=10000.0, torch_dtype="float32")
    kw.update(overrides)
    return DFlashDraftConfig(**kw)


def _random_model(cfg: DFlashDraftConfig, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            else:
                p.mul_(4.0)  # sharper attention: a changed mask changes the output clearly
    return model


def _zlab_model(cfg: DFlashDraftConfig, state: dict):
    from dflash.model import DFlashDraftModel as ZLabDraft
    from transformers import Qwen3Config

    d = cfg.to_dict()
    d.pop("architectures"), d.pop("model_type")
    zcfg = Qwen3Config(**d)
    zcfg._attn_implementation = "sdpa"
    model = ZLabDraft(zcfg).eval()
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected and all("rotary" in k for k in missing), (missing, unexpected)
    return model


def _both(cfg: DFlashDraftConfig, ctx_len: int = 11, seed: int = 0):
    """(ours, z-lab's) draft hidden states [1, B, H] of one block after a context of ctx_len tokens."""
    ours = _random_model(cfg, seed)
    zlab = _zlab_model(cfg, ours.state_dict())
    g = torch.Generator().manual_seed(seed + 1)
    target_hidden = torch.randn(1, ctx_len, cfg.context_feature_size, generator=g)
    embeds = torch.randn(1, cfg.block_size, cfg.hidden_size, generator=g)  # raw target embeddings of the block
    ctx_pos = torch.arange(ctx_len)[None]
    block_pos = torch.arange(ctx_len, ctx_len + cfg.block_size)[None]
    with torch.no_grad():
        mine = ours(embeds, block_pos, ours.context_kv(ours.project_context(target_hidden), ctx_pos))
        # z-lab's generate scales the raw embeddings by input_embedding_scale before the draft forward
        theirs = zlab(position_ids=torch.cat((ctx_pos, block_pos), dim=1), target_hidden=target_hidden,
                      noise_embedding=embeds * cfg.input_embedding_scale)
    return mine, theirs


def _err(a, b) -> float:
    return float((a - b).abs().max() / b.abs().max())


ZLAB_CASES = {
    "full": dict(layer_types=["full_attention"] * 2),
    "sliding (causal by default)": dict(layer_types=["sliding_attention"] * 2, sliding_window=4),
    "mixed": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4),
    "is_causal true": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4, is_causal=True),
    "is_causal false": dict(layer_types=["sliding_attention"] * 2, sliding_window=3, is_causal=False),
    "sliding, no window": dict(layer_types=["sliding_attention"] * 2, sliding_window=None),
    "input_embedding_scale": dict(layer_types=["full_attention", "sliding_attention"], sliding_window=4,
                                  input_embedding_scale=2.5),
}


@pytest.mark.parametrize("case", list(ZLAB_CASES))
def test_draft_equals_zlab_reference(case):
    mine, theirs = _both(_cfg(**ZLAB_CASES[case]))
    assert _err(mine, theirs) < 1e-5, case


def test_zlab_comparison_tells_the_readings_apart():
    """The check above can fail: the previous reading of a sliding layer (bidirectional inside the block, window on
    the left only) gives another output than z-lab's causal sliding layer with the same weights."""
    zlab_reading = ZLAB_CASES["sliding (causal by default)"]
    mine, theirs = _both(_cfg(**zlab_reading))
    other, _ = _both(_cfg(**zlab_reading, is_causal=False))  # window 4 < block 6: left-window bidirectional
    assert _err(mine, theirs) < 1e-5
    assert _err(other, theirs) > 1e-2


def test_draft_logits_equal_zlab_compute_logits():
    cfg = _cfg(output_multiplier=0.2, final_logit_softcapping=3.0)
    zlab = _zlab_model(cfg, _random_model(cfg).state_dict())
    head = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    hidden = 5 * torch.randn(2, 3, cfg.hidden_size)
    with torch.no_grad():
        want = zlab.compute_logits(hidden, head)
        got = draft_logits(cfg, head(hidden))
        assert torch.allclose(got, want, atol=1e-6)
        assert float(got.abs().max()) < 3.0 < float(head(hidden).abs().max())  # the cap really applied
        assert torch.equal(draft_logits(_cfg(), head(hidden)), head(hidden))  # defaults: identity


# ------------------------------------------------------------------ every dflash_config key

def _zlab_dict(**dflash_config) -> dict:
    d = _cfg(layer_types=["full_attention", "sliding_attention"], sliding_window=4).to_dict()
    d["dflash_config"].update(dflash_config)
    return d


def test_every_dflash_config_key_is_read():
    d = _zlab_dict(block_size=8, num_target_layers=8, input_embedding_scale=1.5, output_multiplier=0.5,
                   final_logit_softcapping=30.0)
    d["is_causal"] = True
    cfg = DFlashDraftConfig.from_dict(d)
    assert (cfg.block_size, cfg.input_embedding_scale, cfg.output_multiplier, cfg.final_logit_softcapping,
            cfg.is_causal) == (8, 1.5, 0.5, 30.0, True)
    assert set(DFLASH_CONFIG_KEYS) == {"target_layer_ids", "mask_token_id", "block_size", "num_target_layers",
                                       "input_embedding_scale", "output_multiplier", "final_logit_softcapping"}
    again = DFlashDraftConfig.from_dict(cfg.to_dict())  # written back, not dropped
    assert again == cfg and again.is_causal is True and again.final_logit_softcapping == 30.0


def test_sliding_window_only_with_use_sliding_window():
    """Qwen3Config's reading (z-lab's model inherits it): without use_sliding_window the window is off and sliding
    layers are causal, unwindowed; with it and no sliding_window key the window is 4096."""
    d = _zlab_dict()
    d["use_sliding_window"] = False
    off = DFlashDraftConfig.from_dict(d)
    assert off.sliding_window is None and off.layer_attention(1) == (True, None)
    d["use_sliding_window"] = True
    del d["sliding_window"]
    assert DFlashDraftConfig.from_dict(d).layer_attention(1) == (True, 4096)


def test_dflash_keys_at_top_level_as_zlab_reads_them():
    d = _zlab_dict()
    dc = d.pop("dflash_config")
    d.update(dc, output_multiplier=0.25)
    cfg = DFlashDraftConfig.from_dict(d)
    assert cfg.mask_token_id == 63 and cfg.target_layer_ids == [1, 4] and cfg.output_multiplier == 0.25


@pytest.mark.parametrize("dflash_config, message", [
    ({"selector_rank": 256}, r"DFlash2 drafters"),
    ({"conv_kernel_size": 2}, r"DFlash2 drafters"),
    ({"some_new_knob": 1}, r"dflash_config has keys \['some_new_knob'\]"),
    ({"output_multiplier": 0.0}, r"must be positive"),
    ({"final_logit_softcapping": -1.0}, r"must be positive"),
])
def test_unserved_dflash_config_keys_are_refused(dflash_config, message):
    with pytest.raises(DFlashConfigError, match=message):
        DFlashDraftConfig.from_dict(_zlab_dict(**dflash_config))


def test_is_causal_must_be_a_bool():
    d = copy.deepcopy(_zlab_dict())
    d["is_causal"] = "yes"
    with pytest.raises(DFlashConfigError, match="is_causal='yes'"):
        DFlashDraftConfig.from_dict(d)


# ------------------------------------------------------------------ tau, both ways

def test_tau_per_step_and_per_request():
    steps = [[16, 16], [1, 1, 1, 1, 1, 1]]  # an easy request and a hard one
    assert tau_per_step(steps) == 38 / 8
    assert tau_per_request(steps) == (16 + 1) / 2  # z-lab: mean over requests of each request's mean
    metas = [{"completion_tokens": 33, "spec_verify_ct": 2}, {"completion_tokens": 7, "spec_verify_ct": 6}]
    assert server_tau(metas) == {"tau": 38 / 8, "tau_per_request": 8.5}


# ------------------------------------------------------------------ training uses the served semantics

def test_training_forward_equals_serving_forward_with_sliding_layers():
    """dflash_loss's multi-anchor forward (block-diagonal mask, then the layers' own rule) gives the block the
    same hidden states as the inference forward over its context alone, for causal sliding layers."""
    from sglang_dflash.train import block_attention_mask

    cfg = _cfg(layer_types=["sliding_attention", "full_attention"], sliding_window=3, block_size=4)
    model = _random_model(cfg)
    g = torch.Generator().manual_seed(3)
    t = 20
    feats = torch.randn(1, t, cfg.context_feature_size, generator=g)
    anchors = torch.tensor([[5, 12]])
    embeds = torch.randn(1, 2 * cfg.block_size, cfg.hidden_size, generator=g)
    pos = (anchors[:, :, None] + torch.arange(cfg.block_size)).view(1, -1)
    with torch.no_grad():
        ctx_kv = model.context_kv(model.project_context(feats), torch.arange(t)[None])
        trained = model(embeds, pos, ctx_kv, attn_mask=block_attention_mask(anchors, t, cfg.block_size))
        for j, a in enumerate(anchors[0].tolist()):
            sl = slice(j * cfg.block_size, (j + 1) * cfg.block_size)
            kv = [(k[:, :a], v[:, :a]) for k, v in ctx_kv]
            served = model(embeds[:, sl], pos[:, sl], kv)
            assert _err(trained[:, sl], served) < 1e-5


def test_train_config_with_sliding_layers():
    from transformers import LlamaConfig

    from sglang_dflash.train import TrainArgs, build_draft_config

    class Tok:
        mask_token_id = 5

    target = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=8,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    cfg = build_draft_config(target, Tok(), TrainArgs(num_draft_layers=3, sliding_window=64, num_sliding_layers=2))
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"]
    assert [cfg.layer_attention(i) for i in range(3)] == [(False, None), (True, 64), (True, 64)]


# ------------------------------------------------------------------ the kernels folder vs Hugging Face's kernels

def test_repo_root_on_sys_path_does_not_break_transformers(tmp_path):
    """Python started in the repository root has the top-level `kernels/` folder importable as `kernels`; transformers
    probes for Hugging Face's `kernels` package when it loads a model. Loading must work even where triton is
    missing (blocked here), and `import kernels` must not give this project's folder."""
    script = f"""
import sys
sys.modules["triton"] = None  # as on a machine without triton
sys.path.insert(0, {str(REPO)!r})
import importlib.util, torch
from transformers import LlamaConfig, LlamaForCausalLM, AutoModelForCausalLM
cfg = LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=1, head_dim=8)
LlamaForCausalLM(cfg).save_pretrained({str(tmp_path)!r})
model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r})
print(model(torch.tensor([[1, 2, 3]])).logits.shape)
try:
    import kernels
    where = kernels.__file__
except ImportError as e:
    where = "ImportError: " + str(e)
print("kernels:", where)
"""
    out = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "torch.Size([1, 3, 32])" in out.stdout
    where = out.stdout.split("kernels:", 1)[1].strip()
    installed = PathFinder.find_spec("kernels", [p for p in sys.path if os.path.abspath(p or os.curdir) != str(REPO)])
    if installed is not None:
        assert where == installed.origin, where  # Hugging Face's package, not this folder
    else:
        assert where.startswith("ImportError:") and "sglang_dflash.kernels" in where, where


def test_kernels_folder_without_an_installed_kernels_package(tmp_path):
    """With no other `kernels` on sys.path, importing this folder by that name says what to import instead."""
    script = f"""
import sys
sys.path[:] = [{str(REPO)!r}] + [p for p in sys.path if "site-packages" not in p]
try:
    import kernels
    print("imported", kernels.__file__)
except ImportError as e:
    print("ImportError:", e)
"""
    out = subprocess.run([sys.executable, "-S", "-c", script], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert "ImportError:" in out.stdout and "import it as sglang_dflash.kernels" in out.stdout, out.stdout + out.stderr
