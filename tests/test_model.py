"""DFlashDraftModel vs an independent naive float64 implementation; incremental context KV; checkpoint I/O."""

from __future__ import annotations

import json
import math
import os

import pytest
import torch

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.model import DFlashDraftModel, DraftKVCache, load_draft, rope_cos_sin, save_draft


def _cfg(**overrides) -> DFlashDraftConfig:
    kw = dict(
        hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, vocab_size=64, num_target_layers=8, mask_token_id=63, block_size=4, target_layer_ids=[1, 4],
        rope_theta=10000.0, layer_types=["full_attention", "sliding_attention", "full_attention"],
        sliding_window=5, torch_dtype="float32",
    )
    kw.update(overrides)
    return DFlashDraftConfig(**kw)


def _random_model(cfg: DFlashDraftConfig, seed: int = 0) -> DFlashDraftModel:
    torch.manual_seed(seed)
    model = DFlashDraftModel(cfg).eval()
    with torch.no_grad():  # non-trivial norm weights
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


# ------------------------------------------------------------------ naive reference (float64, loops)

def _rms(x, w, eps):
    return w * (x / torch.sqrt((x * x).mean() + eps))


def _rope_vec(x, pos, theta):
    """One head vector x [D] at integer position pos; pairs (i, i + D/2) rotate by pos * theta^(-2i/D)."""
    d = x.shape[0]
    out = x.clone()
    for i in range(d // 2):
        ang = pos * theta ** (-2.0 * i / d)
        c, s = math.cos(ang), math.sin(ang)
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return out


def naive_draft(sd, cfg, target_hidden, ctx_pos, block_embeds, block_pos, allowed):
    """One row. target_hidden [C, n*H], ctx_pos [C], block_embeds [Q, H], block_pos [Q], allowed [Q, C+Q] bool."""
    W = {k: v.double() for k, v in sd.items()}
    eps, nh, nkv, d = cfg.rms_norm_eps, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    ctx = [_rms(W["fc.weight"] @ t.double(), W["hidden_norm.weight"], eps) for t in target_hidden]
    h = [e.double() for e in block_embeds]
    for li in range(cfg.num_hidden_layers):
        p = f"layers.{li}."
        a = p + "self_attn."
        x = [_rms(v, W[p + "input_layernorm.weight"], eps) for v in h]
        keys, vals, kpos = [], [], []  # per token: [nkv][D]
        for src, pos, normed in [(ctx, ctx_pos, ctx), (x, block_pos, x)]:
            for tok, ps in zip(normed, pos):
                kk = (W[a + "k_proj.weight"] @ tok).view(nkv, d)
                vv = (W[a + "v_proj.weight"] @ tok).view(nkv, d)
                keys.append([_rope_vec(_rms(kk[j], W[a + "k_norm.weight"], eps), int(ps), cfg.rope_theta)
                             for j in range(nkv)])
                vals.append([vv[j] for j in range(nkv)])
                kpos.append(int(ps))
        sliding = cfg.layer_types[li] == "sliding_attention"  # z-lab: sliding layers are causal in the block
        window = cfg.sliding_window if sliding else None
        causal = sliding if cfg.is_causal is None else cfg.is_causal
        new_h = []
        for qi, (tok, qp) in enumerate(zip(x, block_pos)):
            qq = (W[a + "q_proj.weight"] @ tok).view(nh, d)
            heads = []
            for hd in range(nh):
                qv = _rope_vec(_rms(qq[hd], W[a + "q_norm.weight"], eps), int(qp), cfg.rope_theta)
                g = hd // (nh // nkv)
                scores, vs = [], []
                for ki in range(len(keys)):
                    if not allowed[qi, ki]:
                        continue
                    if causal and kpos[ki] > int(qp):
                        continue
                    if window is not None and (int(qp) - kpos[ki] >= window
                                               or (not causal and kpos[ki] - int(qp) >= window)):
                        continue
                    scores.append(float(qv @ keys[ki][g]) / math.sqrt(d))
                    vs.append(vals[ki][g])
                m = max(scores)
                wts = [math.exp(s - m) for s in scores]
                heads.append(sum(w * v for w, v in zip(wts, vs)) / sum(wts))
            attn = W[a + "o_proj.weight"] @ torch.cat(heads)
            r = h[qi] + attn
            y = _rms(r, W[p + "post_attention_layernorm.weight"], eps)
            gate, up = W[p + "mlp.gate_proj.weight"] @ y, W[p + "mlp.up_proj.weight"] @ y
            new_h.append(r + W[p + "mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up))
        h = new_h
    return torch.stack([_rms(v, W["norm.weight"], eps) for v in h])


def _rel_err(a, b):
    return float((a.double() - b.double()).abs().max() / b.double().abs().max())


# ------------------------------------------------------------------ tests

def test_parameter_names_are_zlab_names():
    model = DFlashDraftModel(_cfg(num_hidden_layers=1, layer_types=None))
    names = set(model.state_dict())
    per_layer = {f"layers.0.self_attn.{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm", "k_norm")}
    per_layer |= {f"layers.0.mlp.{n}.weight" for n in ("gate_proj", "up_proj", "down_proj")}
    per_layer |= {"layers.0.input_layernorm.weight", "layers.0.post_attention_layernorm.weight"}
    assert names == per_layer | {"norm.weight", "fc.weight", "hidden_norm.weight"}
    assert tuple(model.fc.weight.shape) == (32, 64)


@pytest.mark.parametrize("with_mask", [False, True])
def test_matches_naive_reference(with_mask):
    cfg = _cfg()
    model = _random_model(cfg)
    b, C, Q, H = 2, 9, cfg.block_size, cfg.hidden_size
    g = torch.Generator().manual_seed(1)
    target_hidden = torch.randn(b, C, cfg.context_feature_size, generator=g)
    offset = torch.tensor([[0], [37]])  # non-trivial positions; row 1's context starts at 37
    ctx_pos = torch.arange(C)[None] + offset
    block_pos = C + torch.arange(Q)[None] + offset
    block_embeds = torch.randn(b, Q, H, generator=g)
    allowed = torch.ones(b, Q, C + Q, dtype=torch.bool)
    if with_mask:  # ragged context (row 0 has 6 valid context tokens) + a block-diagonal-like hole
        allowed[0, :, 6:C] = False
        allowed[1, :2, C + 2:] = False
    with torch.no_grad():
        ctx = model.project_context(target_hidden)
        ctx_kv = model.context_kv(ctx, ctx_pos)
        out = model(block_embeds, block_pos, ctx_kv, allowed if with_mask else None, ctx_positions=ctx_pos)
    assert out.shape == (b, Q, H)
    for i in range(b):
        ref = naive_draft(model.state_dict(), cfg, target_hidden[i], ctx_pos[i], block_embeds[i], block_pos[i],
                          allowed[i])
        assert _rel_err(out[i], ref) <= 1e-5


def test_sliding_window_changes_output():
    """Guard that the sliding-window layer is really restricting attention in the case above."""
    cfg = _cfg()
    full = cfg.replace(layer_types=["full_attention"] * 3, sliding_window=None)
    m1, m2 = _random_model(cfg), DFlashDraftModel(full)
    m2.load_state_dict(m1.state_dict())
    g = torch.Generator().manual_seed(2)
    th, emb = torch.randn(1, 9, 64, generator=g), torch.randn(1, 4, 32, generator=g)
    pos_c, pos_b = torch.arange(9)[None], torch.arange(9, 13)[None]
    with torch.no_grad():
        o1 = m1(emb, pos_b, m1.context_kv(m1.project_context(th), pos_c))
        o2 = m2(emb, pos_b, m2.context_kv(m2.project_context(th), pos_c))
    assert _rel_err(o1, o2) > 1e-3


def test_rope_scaling_linear_equals_scaled_positions():
    base = _cfg(layer_types=None, sliding_window=None)
    lin = base.replace(rope_scaling={"rope_type": "linear", "factor": 2.0})
    m1, m2 = _random_model(base), DFlashDraftModel(lin)
    m2.load_state_dict(m1.state_dict())
    ctx = torch.randn(1, 6, 32)
    pos = torch.arange(0, 12, 2)[None]
    with torch.no_grad():
        k1 = m1.context_kv(ctx, pos // 2)[0][0]
        k2 = m2.context_kv(ctx, pos)[0][0]
    assert _rel_err(k2, k1) <= 1e-6


def test_incremental_context_kv_matches_recompute():
    """Appending committed tokens step by step (ragged per row) == computing the whole context at once."""
    cfg = _cfg()
    model = _random_model(cfg, seed=3)
    b, Q = 3, cfg.block_size
    g = torch.Generator().manual_seed(4)
    lens = [11, 5, 8]
    feats = torch.randn(b, max(lens), cfg.context_feature_size, generator=g)
    embeds = torch.randn(b, Q, cfg.hidden_size, generator=g)
    cache = DraftKVCache.for_model(model, b, max_len=16)
    chunks = [torch.tensor([4, 1, 3]), torch.tensor([0, 2, 1]), torch.tensor([7, 2, 4])]  # sums == lens
    done = torch.zeros(b, dtype=torch.long)
    with torch.no_grad():
        for n_new in chunks:
            n = int(n_new.max())
            idx = (done[:, None] + torch.arange(n)[None]).clamp(max=max(lens) - 1)
            chunk = torch.gather(feats, 1, idx[..., None].expand(b, n, feats.shape[-1]))
            cache.append(model.context_kv(model.project_context(chunk), done[:, None] + torch.arange(n)[None]), n_new)
            done += n_new
        assert cache.lens.tolist() == lens
        kvs, mask = cache.views(Q)
        block_pos = cache.lens[:, None] + torch.arange(Q)[None]
        inc = model(embeds, block_pos, kvs, mask)
        for i, n in enumerate(lens):
            pos = torch.arange(n)[None]
            full_kv = model.context_kv(model.project_context(feats[i : i + 1, :n]), pos)
            ref = model(embeds[i : i + 1], block_pos[i : i + 1], full_kv)
            assert _rel_err(inc[i], ref[0]) <= 1e-6
    assert mask.shape == (b, Q, max(lens) + Q)
    assert mask[1].sum(-1).tolist() == [5 + Q] * Q


def test_cache_overflow_message():
    model = DFlashDraftModel(_cfg())
    cache = DraftKVCache.for_model(model, 1, max_len=3)
    kv = model.context_kv(torch.zeros(1, 4, 32), torch.arange(4)[None])
    with pytest.raises(ValueError, match="DraftKVCache overflow: need 4 slots, have 3"):
        cache.append(kv, torch.tensor([4]))


@pytest.mark.parametrize("max_shard_mb", [15, 0.01])
def test_save_load_round_trip(tmp_path, max_shard_mb):
    cfg = _cfg()
    model = _random_model(cfg, seed=5)
    save_draft(model, tmp_path, max_shard_mb=max_shard_mb)
    files = sorted(os.listdir(tmp_path))
    if max_shard_mb == 15:
        assert files == ["config.json", "model.safetensors"]
    else:
        shards = [f for f in files if f.endswith(".safetensors")]
        assert len(shards) > 2 and "model.safetensors.index.json" in files
        for f in shards:
            assert os.path.getsize(tmp_path / f) <= 0.01 * 1024 * 1024 + 4096  # one tensor may exceed; none here
        index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
        assert set(index["weight_map"]) == set(model.state_dict())
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["architectures"] == ["DFlashDraftModel"] and written["dflash_config"]["target_layer_ids"] == [1, 4]
    loaded = load_draft(tmp_path)
    assert loaded.cfg == cfg and loaded.dtype == torch.float32
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[k], v), k
    half = load_draft(tmp_path, dtype=torch.bfloat16)
    assert half.dtype == torch.bfloat16 and half.inv_freq(torch.device("cpu")).dtype == torch.float32


@pytest.mark.parametrize("max_shard_mb", [15, 0.01])
def test_hub_repo_id_loads_from_the_hf_cache(tmp_path, max_shard_mb):
    """A draft named by its Hugging Face Hub id (as users pass z-lab's checkpoints) resolves through the HF cache:
    offline (HF_HUB_OFFLINE=1) from a cache laid out as huggingface_hub writes it; a missing repo fails with both
    readings of the path named. In a subprocess: huggingface_hub reads its cache/offline settings at import."""
    import subprocess
    import sys

    model = _random_model(_cfg(), seed=7)
    snapshot = tmp_path / "hub" / "models--someone--tiny-dflash" / "snapshots" / ("ab" * 20)
    save_draft(model, snapshot, max_shard_mb=max_shard_mb)
    (snapshot.parent.parent / "refs").mkdir()
    (snapshot.parent.parent / "refs" / "main").write_text("ab" * 20)
    torch.save(model.state_dict(), tmp_path / "want.pt")
    code = f"""
import torch
from sglang_dflash.config import DFlashConfigError, DFlashDraftConfig
from sglang_dflash.model import load_draft
assert DFlashDraftConfig.from_pretrained("someone/tiny-dflash").block_size == 4
want = torch.load({str(tmp_path / "want.pt")!r})
got = load_draft("someone/tiny-dflash").state_dict()
assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
for missing, words in (("someone/missing-dflash", ("not a local directory", "Hub repo")),
                       ({str(tmp_path / "no_such_dir")!r}, ("no config.json at",))):
    try:
        DFlashDraftConfig.from_pretrained(missing)
        raise SystemExit("no error for " + missing)
    except DFlashConfigError as e:
        assert all(w in str(e) for w in words), str(e)
print("HUB_OK")
"""
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0 and "HUB_OK" in out.stdout, out.stderr[-3000:]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_context_kv_equals_per_layer_projection(dtype):
    """context_kv (one GEMM + one norm + one RoPE for all layers) == each layer's own kv()."""
    model = _random_model(_cfg()).to(dtype)
    ctx = torch.randn(2, 9, model.cfg.hidden_size, dtype=dtype)
    positions = torch.arange(9).expand(2, 9) + torch.tensor([[3], [40]])
    fused = model.context_kv(ctx, positions)
    rope = rope_cos_sin(positions, model.inv_freq(ctx.device), dtype)
    for (k, v), layer in zip(fused, model.layers):
        k_ref, v_ref = layer.self_attn.kv(ctx, rope)
        assert torch.equal(v, v_ref)
        torch.testing.assert_close(k, k_ref, rtol=0, atol=0)


def test_one_rope_table_per_forward_equals_rope_per_head_and_layer(monkeypatch):
    """The block forward computes the RoPE table once and shares it across layers, queries and keys (it ran once
    per projection and layer before); the output equals per-call tables exactly."""
    from sglang_dflash import model as model_mod

    model = _random_model(_cfg()).to(torch.bfloat16)
    ctx = torch.randn(2, 7, model.cfg.hidden_size, dtype=torch.bfloat16)
    kv = model.context_kv(ctx, torch.arange(7).expand(2, 7))
    emb = torch.randn(2, 4, model.cfg.hidden_size, dtype=torch.bfloat16)
    pos = torch.arange(7, 11).expand(2, 4)
    calls = []
    real = model_mod.rope_cos_sin
    monkeypatch.setattr(model_mod, "rope_cos_sin", lambda *a: calls.append(a) or real(*a))
    shared = model(emb, pos, kv)
    assert len(calls) == 1
    per_call = []

    def fresh(x, rope):  # what every projection used to do: its own table from the positions
        per_call.append(1)
        cos, sin = real(pos, model.inv_freq(x.device), x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return x * cos + torch.cat((-x2, x1), dim=-1) * sin

    monkeypatch.setattr(model_mod, "apply_rope", fresh)
    assert torch.equal(model(emb, pos, kv), shared)
    assert len(per_call) == 2 * model.cfg.num_hidden_layers
