"""The plugin's torch versions of SGLang's CPU linear-attention ops (``sglang_dflash.adapter.cpu_linear_attn``)
against transformers' torch references of Qwen3.5's Gated DeltaNet, and the hybrid state commit
(``sglang_dflash.adapter.hybrid.commit_verified_states``) on a verify block's recorded states."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.adapter import cpu_linear_attn as L
from sglang_dflash.adapter.hybrid import GraphStates, StateCommit, commit_verified_states

qwen3_5 = pytest.importorskip("transformers.models.qwen3_5.modeling_qwen3_5")
# the torch conv update: `torch_causal_conv1d_update` (SiLU built in) before transformers 5.19, then
# `causal_conv1d_update` (activation as asked); both take ``activation``
conv1d_update = getattr(qwen3_5, "torch_causal_conv1d_update", None) or qwen3_5.causal_conv1d_update

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
    y = conv1d_update(d["x"][None], conv_state, d["w"], d["bias"], activation="silu")
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


def test_attention_gate_serves_the_installed_qwen3_5_call():
    """Qwen3.5's attention-output gate as the installed SGLang's CPU model calls it: ``attn_output =
    fused_sigmoid_mul(attn_output, gate, inplace=True)`` through its CPU binding (0.5.17: the op itself; 0.5.23: a
    wrapper calling ``op(x, gate)`` for its effect on x) gives x * sigmoid(gate) -- with the op registered in the
    form `compat.CPU_SIGMOID_MUL_CALL` found in the model's source."""
    import importlib.util

    from sglang_dflash.adapter import compat, cpu_platform

    cpu_platform.setup()
    L.register_ops()
    # a copy of the model module executed now, on the CPU path (the one SGLang holds may come from another test)
    origin = importlib.util.find_spec("sglang.srt.models.qwen3_5").origin
    spec = importlib.util.spec_from_file_location("qwen3_5_on_cpu", origin)
    qwen3_5 = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qwen3_5)

    assert compat.CPU_SIGMOID_MUL_CALL in L.SIGMOID_MUL_FORMS and qwen3_5._is_cpu
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(qwen3_5.fused_sigmoid_mul(x.clone(), gate, inplace=True), x * torch.sigmoid(gate),
                               rtol=0, atol=0)


def test_each_gate_form_serves_its_own_call_only():
    """The two forms of ``fused_sigmoid_mul_cpu`` called as the other release calls it: 0.5.23's statement
    ``op(x, gate)`` leaves x ungated with 0.5.17's form (whose ``inplace`` defaults to False), and 0.5.17's
    ``y = op(x, gate, inplace=True)`` gets no tensor from 0.5.23's."""
    returning, in_place = L.SIGMOID_MUL_FORMS["returning"][1], L.SIGMOID_MUL_FORMS["in_place"][1]
    x, gate = torch.randn(3, 8), torch.randn(3, 8)
    gated = x * torch.sigmoid(gate)
    y = x.clone()
    in_place(y, gate)
    assert torch.equal(y, gated)
    assert torch.equal(returning(x.clone(), gate, inplace=True), gated)
    y = x.clone()
    returning(y, gate)
    assert torch.equal(y, x)
    with pytest.raises(TypeError):
        in_place(x.clone(), gate, inplace=True)


GATE_0_5_17 = """
if _is_cpu:
    fused_sigmoid_mul = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu
def self_attention(attn_output, gate):
    attn_output = fused_sigmoid_mul(attn_output, gate, inplace=True)
"""
GATE_0_5_23 = """
if _is_cpu:
    _fused_sigmoid_mul_cpu = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu

    def fused_sigmoid_mul(x, gate, inplace=True):
        if not inplace:
            x = x.clone()
        _fused_sigmoid_mul_cpu(x, gate)
        return x
def self_attention(attn_output, gate):
    attn_output = fused_sigmoid_mul(attn_output, gate, inplace=True)
"""


@pytest.mark.parametrize("source, form", [
    (GATE_0_5_17, "returning"), (GATE_0_5_23, "in_place"),
    ("y = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate, inplace=False)", "returning"),
    ("torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate)", "in_place"),
    ("y = torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, gate)", None),  # a third form: neither
    ("y = torch.sigmoid(gate) * x", None),  # no call
    (GATE_0_5_17 + GATE_0_5_23, None),  # both
])
def test_gate_call_form_read_from_the_model_source(source, form):
    from sglang_dflash.adapter import compat

    assert compat.sigmoid_mul_cpu_call(source) == form


def test_qwen3_next_gdn_is_built_on_the_cpu():
    """Qwen3-Next's GDN layer builds its output norm on ``torch.get_device_module().current_device()``; during its
    constructor (`qwen3_next_gdn_on_cpu`) that names the CPU, whatever accelerator torch was built for, and the
    module's ``torch`` is torch again afterwards."""
    from sglang_dflash.adapter import cpu_platform

    cpu_platform.setup()
    L.register_ops()
    from sglang.srt.models import qwen3_next

    seen = []
    L.qwen3_next_gdn_on_cpu(lambda layer: seen.append(qwen3_next.torch.get_device_module().current_device()), None)
    assert seen == ["cpu"] and qwen3_next.torch is torch


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


class _StatePool:
    """SGLang's ``HybridReqToTokenPool`` as the commit and the step graphs read it: request row -> virtual state
    slot (``get_mamba_indices``), virtual -> physical (``translate_mamba_indices``; identity in SGLang's static
    pool, a lookup in its unified one), and the verify scratch."""

    def __init__(self, mapping, physical, caches=None):
        self.mapping, self.physical, self.caches = torch.tensor(mapping), torch.tensor(physical), caches

    def get_mamba_indices(self, rows):
        return self.mapping[rows]

    def translate_mamba_indices(self, ids):
        return self.physical[ids]

    def get_speculative_mamba2_params_all_layers(self):
        return self.caches


def test_graph_states_write_each_rows_state_slot_and_the_verify_offsets():
    """A captured step's linear-attention metadata (`hybrid.GraphStates`): query offsets 0, w, 2w, ..; each row's
    physical state slot from its request-pool row; padded rows -1 (SGLang's kernels skip them)."""
    pool = _StatePool(mapping=[4, 2, 0, 3, 1], physical=[10, 11, 12, 13, 14])
    backend = SimpleNamespace(linear_attn_backend=SimpleNamespace(req_to_token_pool=pool, forward_metadata=None))
    states = GraphStates(backend, torch.arange(0, 9 * 3, 3, dtype=torch.int32), bs=4, width=3)
    states.install()
    assert backend.linear_attn_backend.forward_metadata is states.metadata
    assert states.metadata.query_start_loc.tolist() == [0, 3, 6, 9, 12]
    states.write(torch.tensor([3, 1, 0, 0]), torch.tensor([True, True, False, False]))
    assert states.metadata.mamba_cache_indices.tolist() == [13, 12, -1, -1]
    assert states.metadata.mamba_cache_indices.dtype == torch.int32
    states.write(torch.tensor([0, 4, 2, 1]), torch.ones(4, dtype=torch.bool))  # rewritten in place each step
    assert states.metadata.mamba_cache_indices.tolist() == [14, 11, 10, 12]


def test_state_commit_reads_the_slots_from_the_request_rows():
    """`hybrid.StateCommit` (eager step and step graph alike): request i's state after its accepted position goes to
    the physical slot of its request-pool row."""
    Lyr, B = 2, 4
    caches = SimpleNamespace(temporal=torch.zeros(Lyr, 6, HV, V, K), intermediate_ssm=torch.randn(Lyr, 3, B, HV, V, K),
                             conv=[torch.zeros(Lyr, 6, DIM, W - 1)],
                             intermediate_conv_window=[torch.randn(Lyr, 3, B, DIM, W - 1)])
    pool = _StatePool(mapping=[2, 0, 1], physical=[5, 1, 3], caches=caches)
    commit = StateCommit(SimpleNamespace(linear_attn_backend=SimpleNamespace(req_to_token_pool=pool)))
    commit(torch.tensor([2, 0]), torch.tensor([1, 2]))  # rows 1, 2 -> virtual 0, 1 -> physical 5, 1
    assert torch.equal(caches.temporal[:, 5], caches.intermediate_ssm[:, 0, 2])
    assert torch.equal(caches.temporal[:, 1], caches.intermediate_ssm[:, 1, 0])
    assert torch.equal(caches.conv[0][:, 1], caches.intermediate_conv_window[0][:, 1, 0])
    assert not caches.temporal[:, [0, 2, 3, 4]].any()


# ------------------------------------------------------------------------------------------------ continuation
# A prefill of n tokens then m decode steps must leave the same outputs and states as a prefill of n + m tokens,
# through the registered ops called as SGLang's GDN backend calls them (sgl_kernel.mamba's CPU wrappers; q/k/v
# split from the conv output; conv input as the transposed view of [T, dim]), with the state pools in the dtypes
# SGLang allocates them in (`mamba2_state_dtype`) for a float32 server set up by the plugin.

QKV = 2 * H * K + HV * V  # the conv's channels: [q | k | v]


def _split(y, T):
    q, k, v = torch.split(y, [H * K, H * K, HV * V], dim=-1)
    return q.reshape(1, T, H, K), k.reshape(1, T, H, K), v.reshape(1, T, HV, V)


class GDNLayer:
    """One Gated DeltaNet core (conv + gated delta rule) on SGLang's pools: ``conv`` ``[slots, QKV, W - 1]``,
    ``ssm`` ``[slots, HV, V, K]``."""

    def __init__(self, params, conv_dtype, ssm_dtype=torch.float32, slots=8):
        from sgl_kernel import mamba

        self.p, self.mamba = params, mamba
        self.conv = torch.zeros(slots, QKV, W - 1, dtype=conv_dtype)
        self.ssm = torch.zeros(slots, HV, V, K, dtype=ssm_dtype)

    def extend(self, x, a, b, lens, slots, prefix):
        """A prefill (or a later chunk of one, where ``prefix``) of the packed sequences ``lens`` -> o [T, HV, V]."""
        p, T = self.p, x.shape[0]
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        idx = torch.tensor(slots, dtype=torch.int32)
        y = self.mamba.causal_conv1d_fn_cpu(x.transpose(0, 1), p["w"], p["bias"], "silu", self.conv,
                                            torch.tensor(prefix), idx, cu, list(lens)).transpose(0, 1)
        g, beta = torch.ops.sgl_kernel.fused_gdn_gating_cpu(p["A_log"], a, b, p["dt_bias"])
        o, _, _ = self.mamba.chunk_gated_delta_rule_cpu(*_split(y, T), g, beta, self.ssm, cu, False, True, idx)
        return o[0]

    def decode(self, x, a, b, slots):
        """One decode step of len(slots) requests (one token each) -> o [bs, HV, V]."""
        p, bs = self.p, x.shape[0]
        idx = torch.tensor(slots, dtype=torch.int32)
        y = self.mamba.causal_conv1d_update_cpu(x, self.conv, p["w"], p["bias"], "silu", idx)
        o = torch.ops.sgl_kernel.fused_sigmoid_gating_delta_rule_update_cpu(
            p["A_log"], p["dt_bias"], *_split(y, bs), a, b, self.ssm, idx, torch.arange(bs + 1, dtype=torch.int32),
            True, 1.0, 20.0)
        return o[0]


def _params(seed=0):
    g = torch.Generator().manual_seed(seed)
    return dict(w=torch.randn(QKV, W, generator=g) * 0.5, bias=torch.randn(QKV, generator=g) * 0.1,
                A_log=torch.rand(HV, generator=g) * 2, dt_bias=torch.ones(HV))


def _tokens(n, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, QKV, generator=g), torch.randn(n, HV, generator=g), torch.randn(n, HV, generator=g)


def continuation_gap(conv_dtype, lens, m, chunk=None):
    """Max |difference| of outputs and states between (prefill of lens[i] tokens -- in two chunks where ``chunk``
    -- then m decode steps of the whole batch) and a prefill of lens[i] + m tokens of each sequence alone."""
    from sglang_dflash.adapter import cpu_platform

    cpu_platform.setup()
    L.register_ops()
    p = _params()
    seqs = [_tokens(n + m, seed=i) for i, n in enumerate(lens)]
    slots = [(3 * i + 1) % 8 for i in range(len(lens))]
    layer = GDNLayer(p, conv_dtype)
    for lo, hi in ([(lambda n: 0, lambda n: n)] if chunk is None else
                   [(lambda n: 0, lambda n: min(n, chunk)), (lambda n: min(n, chunk), lambda n: n)]):
        batch = [i for i, n in enumerate(lens) if hi(n) > lo(n)]  # the sequences this prefill chunk extends
        layer.extend(*(torch.cat([seqs[i][j][lo(lens[i]):hi(lens[i])] for i in batch]) for j in range(3)),
                     [hi(lens[i]) - lo(lens[i]) for i in batch], [slots[i] for i in batch],
                     [lo(lens[i]) > 0 for i in batch])
    outs = [layer.decode(*(torch.stack([q[j][n + t] for q, n in zip(seqs, lens)]) for j in range(3)), slots)
            for t in range(m)]
    gap = 0.0
    for i, (n, (x, a, b)) in enumerate(zip(lens, seqs)):
        whole = GDNLayer(p, conv_dtype)
        o = whole.extend(x, a, b, [n + m], [5], [False])
        got = torch.stack([outs[t][i] for t in range(m)])
        gap = max(gap, (got - o[n:]).abs().max().item(),
                  (layer.ssm[slots[i]] - whole.ssm[5]).abs().max().item(),
                  (layer.conv[slots[i]].float() - whole.conv[5].float()).abs().max().item())
    return gap


def cpu_launcher_setup(dtype: str, monkeypatch) -> None:
    """What the plugin does to a CPU server's arguments in the launcher (its ``_handle_cpu_backends`` hook), for
    ``--dtype dtype``; its environment is what the scheduler processes inherit. The stand-in arguments name no
    model: the check of the target's kind (`cpu_platform.check_hybrid_target`, tested in test_adapter.py) is
    skipped."""
    from sglang_dflash.adapter import cpu_platform

    monkeypatch.setattr(cpu_platform, "check_hybrid_target", lambda server_args: None)
    cpu_platform._cpu_attention_backend(lambda args: None, SimpleNamespace(
        device="cpu", dtype=dtype, tp_size=1, attention_backend="torch_native", enable_torch_compile=False,
        speculative_algorithm=None, disable_overlap_schedule=False))


@pytest.fixture
def conv_env(monkeypatch):
    """SGLANG_MAMBA_CONV_DTYPE unset, restored afterwards."""
    monkeypatch.setenv("SGLANG_MAMBA_CONV_DTYPE", "unset")
    monkeypatch.delenv("SGLANG_MAMBA_CONV_DTYPE")
    return monkeypatch


def test_float32_server_keeps_float32_conv_states(conv_env):
    """SGLang's conv state is bfloat16 unless SGLANG_MAMBA_CONV_DTYPE says otherwise; the plugin makes it float32
    for a float32 CPU server, leaving other dtypes and an explicit setting alone."""
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype

    assert mamba2_state_dtype().conv == torch.bfloat16
    cpu_launcher_setup("bfloat16", conv_env)
    assert mamba2_state_dtype().conv == torch.bfloat16
    cpu_launcher_setup("float32", conv_env)
    assert (mamba2_state_dtype().conv, mamba2_state_dtype().temporal) == (torch.float32, torch.float32)
    conv_env.setenv("SGLANG_MAMBA_CONV_DTYPE", "float16")
    cpu_launcher_setup("float32", conv_env)
    assert mamba2_state_dtype().conv == torch.float16


@pytest.mark.parametrize("lens, chunk", [([1], None), ([5], None), ([64], None), ([70], None), ([130], None),
                                         ([5, 70, 1, 33], None), ([70, 40, 7], 32)])
def test_prefill_then_decode_equals_a_longer_prefill(conv_env, lens, chunk):
    """In the conv state dtype of a float32 CPU server (SGLang's ``mamba2_state_dtype`` after the plugin's set-up)."""
    from sglang.srt.configs.mamba_utils import mamba2_state_dtype

    cpu_launcher_setup("float32", conv_env)
    assert continuation_gap(mamba2_state_dtype().conv, lens, m=4, chunk=chunk) < 1e-5


def test_a_bfloat16_conv_state_parts_a_continuation_from_a_longer_prefill():
    """SGLang's default conv state dtype, for a float32 model: the cause of the partings in benchmarks/HYBRID.md."""
    assert continuation_gap(torch.bfloat16, [5, 70], m=4) > 1e-3


@pytest.mark.parametrize("rows", [1, 7])
def test_fused_gated_rmsnorm_matches_qwen3_next_reference(rows):
    """Qwen3-Next's GDN output norm on CPU (`fused_rms_norm_gated`, around SGLang's Triton-only
    ``FusedRMSNormGated``) against transformers' ``Qwen3NextRMSNormGated``: weight * rmsnorm(x) * silu(gate)."""
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNormGated

    from sglang_dflash.adapter.cpu_linear_attn import fused_rms_norm_gated

    torch.manual_seed(rows)
    ref = Qwen3NextRMSNormGated(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.normal_()
    x, gate = torch.randn(rows, 48) * 3, torch.randn(rows, 48)
    norm = SimpleNamespace(eps=1e-6, weight=ref.weight.detach(), activation="silu")
    got = fused_rms_norm_gated(None, norm, x, gate)
    torch.testing.assert_close(got, ref(x, gate), rtol=1e-5, atol=1e-5)
    sigmoid = fused_rms_norm_gated(None, SimpleNamespace(eps=1e-6, weight=None, activation="sigmoid"), x, gate)
    torch.testing.assert_close(sigmoid, x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * torch.sigmoid(gate))
