"""The plugin's torch versions of SGLang's CPU linear-attention ops (``sglang_dflash.adapter.cpu_linear_attn``)
against transformers' torch references of Qwen3.5's Gated DeltaNet, and the hybrid state commit
(``sglang_dflash.adapter.hybrid.commit_verified_states``) on a verify block's recorded states."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.adapter import cpu_linear_attn as L
from sglang_dflash.adapter.hybrid import commit_verified_states

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")

H, HV, K, V, DIM, W = 2, 4, 8, 8, 12, 4


def inputs(T, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return dict(q=r(T, H, K), k=r(T, H, K), v=r(T, HV, V), a=r(T, HV), b=r(T, HV), A_log=torch.rand(HV, generator=g)
                * 2, dt_bias=torch.ones(HV), x=r(DIM, T), w=r(DIM, W), bias=r(DIM))


def reference(d, T):
    """transformers' recurrent gated delta rule and conv update over one sequence from zero states."""
    g, beta = L.gdn_gating(d["A_log"], d["a"], d["b"], d["dt_bias"])
    rep = HV // H
    o, h = qwen3_5.torch_recurrent_gated_delta_rule(
        d["q"][None].repeat_interleave(rep, 2), d["k"][None].repeat_interleave(rep, 2), d["v"][None], g[None],
        beta[None], None, True, True)
    conv_state = torch.zeros(1, DIM, W - 1)
    y = qwen3_5.torch_causal_conv1d_update(d["x"][None], conv_state, d["w"], d["bias"])
    return o[0], h[0], y[0], conv_state[0]


@pytest.mark.parametrize("T", [1, 5, 13])
def test_prefill_decode_verify_match_transformers(T):
    d = inputs(T)
    ref_o, ref_h, ref_y, ref_conv = reference(d, T)
    g, beta = L.gdn_gating(d["A_log"], d["a"], d["b"], d["dt_bias"])
    cu = torch.tensor([0, T])

    pool = torch.zeros(3, HV, V, K)  # prefill into slot 2
    o = L.gated_delta_rule(d["q"], d["k"], d["v"], g, beta, pool, torch.tensor([2]), cu, scale=K ** -0.5, l2norm=True)
    torch.testing.assert_close(o, ref_o, rtol=0, atol=1e-5)
    torch.testing.assert_close(pool[2].transpose(-1, -2), ref_h, rtol=0, atol=1e-5)

    dec = torch.zeros(3, HV, V, K)  # one token at a time
    outs = [L.gated_delta_rule(d["q"][t:t + 1], d["k"][t:t + 1], d["v"][t:t + 1], g[t:t + 1], beta[t:t + 1], dec,
                               torch.tensor([0]), torch.tensor([0, 1]), scale=K ** -0.5, l2norm=True)
            for t in range(T)]
    torch.testing.assert_close(torch.cat(outs), o, rtol=0, atol=1e-6)
    torch.testing.assert_close(dec[0], pool[2], rtol=0, atol=1e-6)

    ver, scratch = torch.zeros(3, HV, V, K), torch.zeros(2, T, HV, V, K)  # verify: states recorded, pool untouched
    ov = L.gated_delta_rule(d["q"], d["k"], d["v"], g, beta, ver, torch.tensor([1]), cu, scale=K ** -0.5,
                            l2norm=True, update_state=False, intermediate=scratch, intermediate_rows=torch.tensor([1]))
    assert torch.equal(ov, o) and not ver.any()
    assert torch.equal(scratch[1, -1], pool[2])

    conv = torch.zeros(2, DIM, W - 1)
    y = L.conv_prefill(d["x"], d["w"], d["bias"], conv, cu, torch.tensor([1]), torch.tensor([False]), True)
    torch.testing.assert_close(y, ref_y, rtol=0, atol=1e-5)
    torch.testing.assert_close(conv[1], ref_conv, rtol=0, atol=0)
    conv2, windows = torch.zeros(2, DIM, W - 1), torch.zeros(3, T, DIM, W - 1)
    y2 = L.conv_update(d["x"][None], conv2, d["w"], d["bias"], True, torch.tensor([0]), windows=windows,
                       window_rows=torch.tensor([2]))
    torch.testing.assert_close(y2[0], y, rtol=0, atol=1e-6)
    packed = d["x"].T.contiguous()  # SGLang's verify passes [bs, dim, T] as a transposed view and views it back
    y3 = L.conv_update(packed.view(1, T, DIM).transpose(1, 2), torch.zeros(2, DIM, W - 1), d["w"], d["bias"], True,
                       torch.tensor([0]), windows=torch.zeros(1, T, DIM, W - 1), window_rows=torch.tensor([0]))
    torch.testing.assert_close(y3.transpose(1, 2).view(T, DIM), y.T, rtol=0, atol=1e-6)
    assert torch.equal(windows[2, -1], conv[1]) and torch.equal(conv2[0], conv[1])


def test_registered_ops_serve_sglangs_call_signatures():
    from sglang_dflash.adapter import cpu_platform

    cpu_platform.setup()
    L.register_ops()
    ops = torch.ops.sgl_kernel
    d = inputs(6, seed=1)
    g, beta = ops.fused_gdn_gating_cpu(d["A_log"], d["a"], d["b"], d["dt_bias"])
    assert g.shape == beta.shape == (1, 6, HV)
    pool = torch.zeros(2, HV, V, K)
    o, _ = ops.chunk_gated_delta_rule_cpu(d["q"][None], d["k"][None], d["v"][None], g, beta, pool, True,
                                          torch.tensor([0, 6]), False, True, torch.tensor([1]))
    scratch = torch.zeros(1, 6, HV, V, K)
    ov = ops.fused_sigmoid_gating_delta_rule_update_cpu(
        A_log=d["A_log"], dt_bias=d["dt_bias"], q=d["q"][None], k=d["k"][None], v=d["v"][None], a=d["a"], b=d["b"],
        initial_state_source=torch.zeros(2, HV, V, K), initial_state_indices=torch.tensor([0]),
        cu_seqlens=torch.tensor([0, 6]), use_qk_l2norm_in_kernel=True, softplus_beta=1.0, softplus_threshold=20.0,
        is_kda=False, disable_state_update=True, intermediate_states_buffer=scratch,
        intermediate_state_indices=torch.tensor([0]), cache_steps=6, retrieve_parent_token=None)
    assert torch.equal(ov, o) and torch.equal(scratch[0, -1], pool[1])
    qkvz, ba = torch.randn(3, 2 * 2 * 4 + 2 * 2 * 4), torch.randn(3, 4)
    qkv, z, b, a = ops.fused_qkvzba_split_reshape_cat_contiguous_cpu(qkvz, ba, 2, 2, 4, 4)
    assert torch.equal(torch.cat([qkv, z.reshape(3, -1)], -1), qkvz) and torch.equal(torch.cat([b, a], -1), ba)
    x = torch.randn(3, 8)
    assert torch.equal(ops.fused_sigmoid_mul_cpu(x.clone(), x, True), x * torch.sigmoid(x))


def test_commit_takes_the_state_after_the_accepted_tokens():
    """The state after block position ``steps[i]`` of request i (scratch row i) lands in its slot, for every layer,
    ssm and conv; a commit at the whole block gives different states."""
    Lyr, slots, B = 2, 5, 4
    caches = SimpleNamespace(temporal=torch.zeros(Lyr, slots, HV, V, K), intermediate_ssm=torch.randn(Lyr, 3, B, HV, V, K),
                             conv=[torch.zeros(Lyr, slots, DIM, W - 1)],
                             intermediate_conv_window=[torch.randn(Lyr, 3, B, DIM, W - 1)])
    state_indices, steps = torch.tensor([4, 1, 2]), torch.tensor([0, 3, 1])
    commit_verified_states(caches, state_indices, steps)
    for i in range(3):
        assert torch.equal(caches.temporal[:, state_indices[i]], caches.intermediate_ssm[:, i, steps[i]])
        assert torch.equal(caches.conv[0][:, state_indices[i]], caches.intermediate_conv_window[0][:, i, steps[i]])
    assert not caches.temporal[:, [0, 3]].any()
    whole = caches.temporal.clone()
    commit_verified_states(caches, state_indices, torch.full_like(steps, B - 1))
    assert not torch.equal(whole, caches.temporal)
