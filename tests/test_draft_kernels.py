"""The draft forward's fused kernels (RMSNorm with residual, per-head norm + RoPE, SiLU-and-mul) vs their torch
refs, the refs vs the core model's modules, and the SGLang draft model's fused forward and context-KV path vs the
core model (attention replaced by a plain torch attention over the same keys).

Triton runs happen in one ``TRITON_INTERPRET=1`` subprocess (see test_kernels.py for why), in float32 and float16:
the interpreter rounds bfloat16 differently from torch, so bfloat16 is compared on the GPU only.
"""

import os
import sys

import pytest
import torch
import torch.nn.functional as F

from conftest import interpreted_results, make_draft_config
from sglang_dflash.kernels import draft_layers as dl
from sglang_dflash.kernels import norm_rope, norm_rope_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref
from sglang_dflash.model import RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq

DTYPES = (torch.float32, torch.float16)
ROWS = (1, 5, 33)
HIDDEN = (7, 64, 577)  # odd widths: masked lanes
HEADS = ((9, 3), (4, 4), (1, 1))  # (q heads, kv heads)
HEAD_DIMS = (8, 64, 6)  # 6: a half of 3 lanes


def _rand(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g) * scale).to(dtype)


def _rope(n, d, dtype, g):
    positions = torch.randint(0, 40_000, (n,), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    cos, sin = rope_cos_sin(positions[None], inv_freq, dtype)
    return cos[0, :, 0], sin[0, :, 0]


def _norm_cases():
    for dt in DTYPES:
        for n in ROWS:
            for h in HIDDEN:
                yield dt, n, h


def _norm_inputs(dt, n, h):
    g = torch.Generator().manual_seed(n * 1000 + h)
    wide = _rand((n, h + 5), dt, g)  # x is a row-strided view
    return wide[:, 2 : 2 + h], _rand((n, h), dt, g), 1 + _rand((h,), dt, g, 0.1)


def _rope_cases():
    for dt in DTYPES:
        for n in ROWS:
            for hq, hkv in HEADS:
                for d in HEAD_DIMS:
                    yield dt, n, hq, hkv, d


def _rope_inputs(dt, n, hq, hkv, d):
    """A fused qkv output [n, (hq + 2 hkv) * d] (the q and k heads are normed + roped in place, v untouched)."""
    g = torch.Generator().manual_seed(n * 100 + hq * 10 + d)
    qkv = _rand((n, (hq + 2 * hkv) * d), dt, g, 3.0)
    weight = 1 + _rand((hq + hkv, d), dt, g, 0.1)
    return qkv, weight, *_rope(n, d, dt, g)


def _silu_cases():
    for dt in DTYPES:
        for n in ROWS:
            for i in (3, 640, 1537):
                yield dt, n, i


def _silu_inputs(dt, n, i):
    g = torch.Generator().manual_seed(n + i)
    return _rand((n, 2 * i + 4), dt, g, 2.0)[:, : 2 * i]


def _worker(out_path):
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    for name in ("_rms_norm_kernel", "_norm_rope_kernel", "_silu_mul_kernel"):
        assert isinstance(getattr(dl, name), InterpretedFunction)

    def _ref_called(*args, **kwargs):
        raise AssertionError("launcher fell back to the torch ref")

    dl.rms_norm_ref = dl.norm_rope_ref = dl.silu_mul_ref = _ref_called
    results = {}
    for dt, n, h in _norm_cases():
        x, res, w = _norm_inputs(dt, n, h)
        results[f"norm-{dt}-{n}-{h}"] = rms_norm(x, w, 1e-6, res)
        results[f"norm-nores-{dt}-{n}-{h}"] = rms_norm(x, w, 1e-6)[0]
    for dt, n, hq, hkv, d in _rope_cases():
        qkv, w, cos, sin = _rope_inputs(dt, n, hq, hkv, d)
        norm_rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), w, cos, sin, 1e-6)
        results[f"rope-{dt}-{n}-{hq}-{hkv}-{d}"] = qkv
    for dt, n, i in _silu_cases():
        results[f"silu-{dt}-{n}-{i}"] = silu_mul(_silu_inputs(dt, n, i))
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory.mktemp("triton") / "results.pt")


def _close(got, want, dt):
    """float16: the kernels round like the refs; a float32 sum in another order (or exp's last bit, in SiLU) may
    move a result by an ulp or two, rarely. float32: a few ulps."""
    if dt == torch.float16:
        diff = (got.float() - want.float()).abs()
        ulp = want.float().abs().clamp(min=2**-14) * 2**-9
        assert bool((diff <= ulp).all()), f"max diff {diff.max()}"
        assert float((got != want).float().mean()) < 0.01
    else:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dt, n, h", list(_norm_cases()))
def test_rms_norm_kernel_matches_ref(triton_results, dt, n, h):
    x, res, w = _norm_inputs(dt, n, h)
    want, want_res = rms_norm_ref(x, w, 1e-6, res)
    got, got_res = triton_results[f"norm-{dt}-{n}-{h}"]
    assert got.dtype == dt and got.shape == (n, h) and got.is_contiguous()
    assert torch.equal(got_res, want_res)  # the residual add is one rounded add
    _close(got, want, dt)
    _close(triton_results[f"norm-nores-{dt}-{n}-{h}"], rms_norm_ref(x, w, 1e-6)[0], dt)


@pytest.mark.parametrize("dt, n, hq, hkv, d", list(_rope_cases()))
def test_norm_rope_kernel_matches_ref_in_place_on_the_qk_heads(triton_results, dt, n, hq, hkv, d):
    qkv, w, cos, sin = _rope_inputs(dt, n, hq, hkv, d)
    want = qkv.clone()
    norm_rope_ref(want[:, : (hq + hkv) * d].view(n, hq + hkv, d), w, cos, sin, 1e-6)
    got = triton_results[f"rope-{dt}-{n}-{hq}-{hkv}-{d}"]
    assert torch.equal(got[:, (hq + hkv) * d :], qkv[:, (hq + hkv) * d :])  # v heads untouched
    _close(got, want, dt)


@pytest.mark.parametrize("dt, n, i", list(_silu_cases()))
def test_silu_mul_kernel_matches_ref(triton_results, dt, n, i):
    x = _silu_inputs(dt, n, i)
    got = triton_results[f"silu-{dt}-{n}-{i}"]
    assert got.shape == (n, i) and got.dtype == dt
    _close(got, silu_mul_ref(x), dt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bfloat16 kernels are compared on a GPU")
def test_kernels_match_refs_in_bfloat16_on_gpu():
    """bfloat16 on the device: each result within a few bf16 ulps of the ref (for RoPE, of the head's largest value:
    its outputs are differences of rounded products) and, on average, within half an ulp. (On the H200 about a fifth
    of the RoPE outputs differ from torch's by an ulp; the norm and SiLU outputs almost never.)"""
    dev, dt = torch.device("cuda"), torch.bfloat16

    def close(got, want, scale=None):
        diff = (got.float() - want.float()).abs()
        scale = want.float().abs() if scale is None else scale
        assert bool((diff <= scale * 2**-6).all()), f"max diff {diff.max()}"
        assert float(diff.mean()) <= float(scale.mean()) * 2**-9, f"mean diff {diff.mean()}"

    for n, h in ((1, 576), (37, 576), (300, 4096)):
        x, res, w = (t.to(dev) for t in _norm_inputs(dt, n, h))
        got, got_res = rms_norm(x, w, 1e-5, res)
        want, want_res = rms_norm_ref(x, w, 1e-5, res)
        assert torch.equal(got_res, want_res)
        close(got, want)
    for n, hq, hkv, d in ((16, 9, 3, 64), (1024, 32, 8, 128), (48, 15, 15, 64)):
        qkv, w, cos, sin = (t.to(dev) for t in _rope_inputs(dt, n, hq, hkv, d))
        want = qkv.clone()
        norm_rope_ref(want[:, : (hq + hkv) * d].view(n, hq + hkv, d), w, cos, sin, 1e-6)
        norm_rope(qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d), w, cos, sin, 1e-6)
        heads = want.view(n, hq + 2 * hkv, d).float().abs().amax(-1, keepdim=True).expand(n, hq + 2 * hkv, d)
        close(qkv, want, heads.reshape(n, -1))
        assert torch.equal(qkv[:, (hq + hkv) * d :], want[:, (hq + hkv) * d :])
    for n, i in ((16, 1536), (1024, 12288)):
        x = _silu_inputs(dt, n, i).to(dev)
        close(silu_mul(x), silu_mul_ref(x))


# ---------------------------------------------------------------- refs = the core model's math

@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_refs_are_the_core_models_math(dt):
    g = torch.Generator().manual_seed(0)
    n, h, heads, d = 6, 48, 5, 16
    norm = RMSNorm(h, 1e-6).to(dt)
    norm.weight.data = 1 + _rand((h,), dt, g, 0.1)
    x, res = _rand((n, h), dt, g), _rand((n, h), dt, g)
    out, new_res = rms_norm_ref(x, norm.weight, 1e-6, res)
    assert torch.equal(new_res, res + x) and torch.equal(out, norm(res + x))

    head_norm = RMSNorm(d, 1e-6).to(dt)
    head_norm.weight.data = 1 + _rand((d,), dt, g, 0.1)
    q = _rand((1, n, heads, d), dt, g, 3.0)
    positions = torch.randint(0, 5000, (1, n), generator=g)
    cfg_inv = 1.0 / (10000 ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    rope = rope_cos_sin(positions, cfg_inv, dt)
    want = apply_rope(head_norm(q), rope)[0]
    got = norm_rope_ref(q[0].clone(), head_norm.weight.expand(heads, d).contiguous(), rope[0][0, :, 0],
                        rope[1][0, :, 0], 1e-6)
    assert torch.equal(got, want)

    gu = _rand((n, 2 * h), dt, g)
    assert torch.equal(silu_mul_ref(gu), F.silu(gu[:, :h]) * gu[:, h:])


def test_cpu_without_interpreter_uses_the_refs(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)

    def _kernel_called(*args, **kwargs):
        raise AssertionError("kernel launched on CPU without TRITON_INTERPRET=1")

    for name in ("_rms_norm_kernel", "_norm_rope_kernel", "_silu_mul_kernel"):
        monkeypatch.setattr(dl, name, _kernel_called)
    x, res, w = _norm_inputs(torch.float32, 5, 64)
    assert all(torch.equal(a, b) for a, b in zip(rms_norm(x, w, 1e-6, res), rms_norm_ref(x, w, 1e-6, res)))
    qkv, w, cos, sin = _rope_inputs(torch.float32, 5, 9, 3, 8)
    want = norm_rope_ref(qkv[:, :96].clone().view(5, 12, 8), w, cos, sin, 1e-6)
    assert torch.equal(norm_rope(qkv[:, :96].view(5, 12, 8), w, cos, sin, 1e-6), want)
    x = _silu_inputs(torch.float32, 5, 3)
    assert torch.equal(silu_mul(x), silu_mul_ref(x))


@pytest.mark.parametrize("call, match", [
    (lambda: rms_norm(torch.zeros(3, 4), torch.ones(5), 1e-6), r"weight must have shape \(4,\)"),
    (lambda: rms_norm(torch.zeros(3, 4), torch.ones(4), 1e-6, torch.zeros(3, 4, dtype=torch.float16)),
     "residual must be torch.float32"),
    (lambda: rms_norm(torch.zeros(3, 4), torch.ones(4), 1e-6, torch.zeros(2, 4)), "residual must have x's shape"),
    (lambda: rms_norm(torch.zeros(4, 3).t(), torch.ones(4), 1e-6), "contiguous last dim"),
    (lambda: rms_norm(torch.zeros(3, 4, dtype=torch.int64), torch.ones(4), 1e-6), "x must be float32/float16"),
    (lambda: norm_rope(torch.zeros(2, 3, 5), torch.ones(3, 5), torch.zeros(2, 5), torch.zeros(2, 5), 1e-6),
     "head_dim must be even"),
    (lambda: norm_rope(torch.zeros(2, 3, 4), torch.ones(4), torch.zeros(2, 4), torch.zeros(2, 4), 1e-6),
     "weight must be 2-D"),
    (lambda: norm_rope(torch.zeros(2, 3, 4), torch.ones(2, 4), torch.zeros(2, 4), torch.zeros(2, 4), 1e-6),
     r"weight must be a contiguous \(3, 4\) tensor"),
    (lambda: norm_rope(torch.zeros(2, 3, 4), torch.ones(3, 4), torch.zeros(3, 4), torch.zeros(2, 4), 1e-6),
     r"cos must have shape \(2, 4\)"),
    (lambda: silu_mul(torch.zeros(2, 5)), "halves of equal width"),
])
def test_validation_names_the_problem(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


# ---------------------------------------------------------------- the SGLang draft model vs the core

class _TorchAttention(torch.nn.Module):
    """Stands in for RadixAttention: block queries attend to [this layer's context K/V ; block K/V], no mask."""

    def __init__(self, layer_id, heads, kv_heads, d, ctx):
        super().__init__()
        self.layer_id, self.heads, self.kv_heads, self.d, self.ctx = layer_id, heads, kv_heads, d, ctx

    def forward(self, q, k, v, forward_batch):
        n = q.shape[0]
        ck, cv = self.ctx[self.layer_id]
        keys = torch.cat([ck, k.reshape(n, self.kv_heads, self.d)])
        vals = torch.cat([cv, v.reshape(n, self.kv_heads, self.d)])
        out = F.scaled_dot_product_attention(q.reshape(1, n, self.heads, self.d).transpose(1, 2),
                                             keys[None].transpose(1, 2), vals[None].transpose(1, 2),
                                             enable_gqa=self.heads != self.kv_heads)
        return out.transpose(1, 2).reshape(n, self.heads * self.d)


class _KVPool:
    def __init__(self):
        self.writes = {}

    def set_kv_buffer(self, layer, loc, k, v):
        self.writes[layer.layer_id] = (loc, k.clone(), v.clone())


def test_sglang_draft_fused_forward_and_context_kv_equal_the_core(tiny_qwen3):
    from sglang_dflash.adapter.draft_model import SGLangDFlashDraft
    from sglang_dflash.model import DFlashDraftModel

    cfg = make_draft_config(tiny_qwen3.config, num_hidden_layers=3)
    torch.manual_seed(3)
    core = DFlashDraftModel(cfg).eval()
    for p in core.parameters():  # norms away from 1, so a wrong norm weight shows
        p.data += 0.1 * torch.randn_like(p)
    model = SGLangDFlashDraft(_hf(cfg))
    model.load_weights([(f"model.{k}", v) for k, v in core.state_dict().items()])
    # the fused q/k/v and gate/up matrices hold the loaded weights, and the core's Linears are views into them
    a0 = model.core.layers[0].self_attn
    assert a0.q_proj.weight.data_ptr() == model.qkv_weight[0].data_ptr()
    assert torch.equal(model.core.state_dict()["layers.0.self_attn.k_proj.weight"],
                       core.state_dict()["layers.0.self_attn.k_proj.weight"])

    ctx_len, n = 11, cfg.block_size
    hidden = torch.randn(ctx_len, cfg.context_feature_size)
    ctx_pos = torch.arange(ctx_len)
    pool = _KVPool()
    loc = torch.arange(ctx_len) + 100
    model.write_context_kv(hidden, ctx_pos, loc, pool)
    want = core.context_kv(core.project_context(hidden[None]), ctx_pos[None])
    for i, (k, v) in enumerate(want):
        got_loc, got_k, got_v = pool.writes[i]
        assert torch.equal(got_loc, loc)
        torch.testing.assert_close(got_k, k[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(got_v, v[0], rtol=1e-5, atol=1e-5)

    ctx = {i: (pool.writes[i][1], pool.writes[i][2]) for i in range(cfg.num_hidden_layers)}
    model.attn = torch.nn.ModuleList(
        _TorchAttention(i, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, ctx)
        for i in range(cfg.num_hidden_layers))
    embeds = torch.randn(n, cfg.hidden_size)
    positions = torch.arange(ctx_len, ctx_len + n)
    got = model(None, positions, None, input_embeds=embeds).hidden_states
    want = core(embeds[None], positions[None], [(k, v) for k, v in want])[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_context_kv_reads_layers_in_target_layer_ids_order_repeats_included(tiny_qwen3):
    """z-lab concatenates the target's hidden states in ``target_layer_ids`` order, repeats included (its default
    layer choice repeats layers of small targets); SGLang's targets return each captured layer once, in layer
    order. The context K/V must be the core's on z-lab's concatenation."""
    from sglang_dflash.adapter.draft_model import SGLangDFlashDraft, capture_target_layers
    from sglang_dflash.model import DFlashDraftModel

    class Target:
        def set_dflash_layers_to_capture(self, ids):
            self.ids = ids

    cfg = make_draft_config(tiny_qwen3.config, num_hidden_layers=2, target_layer_ids=[3, 1, 3])
    target = Target()
    captured = capture_target_layers(target, list(cfg.target_layer_ids), cfg.num_target_layers)
    assert captured == target.ids == [1, 3]
    torch.manual_seed(4)
    core = DFlashDraftModel(cfg).eval()
    model = SGLangDFlashDraft(_hf(cfg))
    model.load_weights([(f"model.{k}", v) for k, v in core.state_dict().items()])
    model.read_captured_layers(captured)
    assert model.aux_chunks.tolist() == [1, 0, 1]
    h = cfg.hidden_size
    by_layer = {1: torch.randn(7, h), 3: torch.randn(7, h)}
    pos, loc, pool = torch.arange(7), torch.arange(7) + 50, _KVPool()
    model.write_context_kv(torch.cat([by_layer[1], by_layer[3]], dim=1), pos, loc, pool)
    zlab = torch.cat([by_layer[i] for i in cfg.target_layer_ids], dim=1)
    for i, (k, v) in enumerate(core.context_kv(core.project_context(zlab[None]), pos[None])):
        torch.testing.assert_close(pool.writes[i][1], k[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(pool.writes[i][2], v[0], rtol=1e-5, atol=1e-5)


def _hf(cfg):
    from transformers import PretrainedConfig

    return PretrainedConfig(**cfg.to_dict())


if __name__ == "__main__":
    _worker(sys.argv[1])
