"""Plain-torch versions of the sgl-kernel CPU ops that SGLang's hybrid linear-attention models call on CPU.

On a CPU SGLang's Qwen3.5 / Qwen3-Next models and its Gated DeltaNet backend (``GDNAttnBackend``) call
``torch.ops.sgl_kernel.*_cpu`` ops that only sgl-kernel's separate CPU build provides (several are looked up when
the model module is imported, so without them the model class is missing altogether). `register_ops` defines the
missing ones here, in float32 torch with the semantics of SGLang's Triton kernels for the same call sites; a native
CPU build, when installed, keeps its own. Where releases call an op differently, it is registered in the installed
release's form (`compat` detects it): ``fused_sigmoid_mul_cpu`` (Qwen3.5's attention-output gate) gates in place
as a statement ``op(x, gate)`` from 0.5.23 on (`compat.CPU_SIGMOID_MUL_CALL`), and returns the gated tensor
(``inplace=`` chooses) in 0.5.17. `causal_conv1d_update_with_windows` additionally serves the verify forward
of speculative decoding (SGLang's CPU wrapper takes no per-step window buffer), `rms_norm_gated` and
`fused_rms_norm_gated` the gated RMSNorms and `gate_sigmoid_mul_add` Qwen3-Next's shared-expert gate (Triton
kernels without sgl-kernel's CPU build), `mamba_pool_on_cpu` the state pool's verify scratch (allocated on
"cuda" by SGLang 0.5.17) and `qwen3_next_gdn_on_cpu` the device of Qwen3-Next's GDN output norm (from
``torch.get_device_module()``, which names CUDA on a host without a GPU with torch 2.14, SGLang 0.5.23's);
`plugin.register` installs them on a CPU host (`register_hooks`).

Layouts (SGLang's): the recurrent state pool is ``[slots, HV, V, K]`` (one ``V x K`` matrix per value head; the
recurrence below runs on its transpose ``h [K, V]``), the conv state pool ``[slots, dim, W - 1]``, the verify
scratch ``intermediate_ssm [rows, steps, HV, V, K]`` and ``intermediate_conv_window [rows, steps, dim, W - 1]``
(row i belongs to the i-th request of the batch). Query/key heads ``H`` are shared by ``HV / H`` value heads.

Every path computes a token with the same float32 arithmetic (`_conv_token`, `_delta_step`): a token gives the same
state and output whether it comes through a prefill, a decode step or a verify block.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6


# ------------------------------------------------------------------------------------------------ math


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def gdn_gating(A_log, a, b, dt_bias, softplus_beta: float = 1.0, softplus_threshold: float = 20.0):
    """g = -exp(A_log) * softplus(a + dt_bias), beta = sigmoid(b); a, b ``[T, HV]`` -> two float32 ``[T, HV]``."""
    x = a.float() + dt_bias.float()
    g = -torch.exp(A_log.float()) * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)
    return g, torch.sigmoid(b.float())


def _delta_step(h, q, k, v, g, beta):
    """One token of the gated delta rule for N rows: h ``[N, HV, K, V]``, q/k ``[N, HV, K]`` (normalised, q
    scaled), v ``[N, HV, V]``, g/beta ``[N, HV]`` -> (new h, output ``[N, HV, V]``)."""
    h = h * torch.exp(g)[..., None, None]
    v = (v - (h * k[..., None]).sum(-2)) * beta[..., None]
    h = h + k[..., None] * v[..., None, :]
    return h, (h * q[..., None]).sum(-2)


def _prepare_qk(q, k, hv: int, l2norm: bool, scale: float):
    """q/k ``[T, H, K]`` -> float32 ``[T, HV, K]`` (each key head serves ``HV / H`` value heads)."""
    q, k = q.float(), k.float()
    if l2norm:
        q, k = _l2norm(q), _l2norm(k)
    rep = hv // q.shape[-2]
    return (q * scale).repeat_interleave(rep, dim=-2), k.repeat_interleave(rep, dim=-2)


def _segments(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    c = cu_seqlens.tolist()
    return list(zip(c[:-1], c[1:]))


def gated_delta_rule(q, k, v, g, beta, state_pool, state_indices, cu_seqlens, *, scale: float, l2norm: bool,
                     update_state: bool = True, intermediate=None, intermediate_rows=None) -> torch.Tensor:
    """The recurrence over packed sequences: q/k ``[T, H, K]``, v ``[T, HV, V]``, g/beta ``[T, HV]``, ``cu_seqlens``
    ``[N + 1]``, each sequence starting from ``state_pool[state_indices[i]]`` (``[HV, V, K]``; a negative index
    starts from zeros and is not written). Returns o ``[T, HV, V]`` in v's dtype. ``update_state``: write each final
    state back. ``intermediate`` ``[rows, steps, HV, V, K]``: the state after every token of sequence i goes to
    ``intermediate[intermediate_rows[i], t]``. Sequences of one length advance together."""
    T, HV, V = v.shape
    K = q.shape[-1]
    qf, kf = _prepare_qk(q, k, HV, l2norm, scale)
    vf = v.float()
    out = torch.empty(T, HV, V, dtype=torch.float32)
    segs = _segments(cu_seqlens)
    idx = state_indices.tolist()
    rows = intermediate_rows.tolist() if intermediate_rows is not None else None
    by_len: dict[int, list[int]] = {}
    for i, (s, e) in enumerate(segs):
        by_len.setdefault(e - s, []).append(i)
    for n, members in by_len.items():
        if n == 0:
            continue
        starts = torch.tensor([segs[i][0] for i in members])
        slots = torch.tensor([idx[i] for i in members])
        valid = slots >= 0
        h = torch.zeros(len(members), HV, K, V, dtype=torch.float32)
        if valid.any():
            h[valid] = state_pool[slots[valid]].float().transpose(-1, -2)
        for t in range(n):
            tok = starts + t
            h, o = _delta_step(h, qf[tok], kf[tok], vf[tok], g[tok].float(), beta[tok].float())
            out[tok] = o
            if intermediate is not None:
                r = torch.tensor([rows[i] for i in members])
                intermediate[r[valid], t] = h[valid].transpose(-1, -2).to(intermediate.dtype)
        if update_state and valid.any():
            state_pool[slots[valid]] = h[valid].transpose(-1, -2).to(state_pool.dtype)
    return out.to(v.dtype)


def _conv_token(window: torch.Tensor, weight: torch.Tensor, bias, silu: bool) -> torch.Tensor:
    """window ``[..., dim, W]`` (oldest first), weight ``[dim, W]`` -> ``[..., dim]``."""
    y = (window.float() * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    return F.silu(y) if silu else y


def conv_update(x, conv_state, weight, bias, silu: bool, state_indices, pad_slot_id: int = -1,
                windows=None, window_rows=None) -> torch.Tensor:
    """Causal depthwise conv over new tokens: x ``[bs, dim]`` or ``[bs, dim, L]``, sequence i continuing from
    ``conv_state[state_indices[i]]`` (``[dim, W - 1]``, rolled forward over all L tokens; rows at ``pad_slot_id``
    are skipped). ``windows`` ``[rows, steps, dim, W - 1]``: the conv state after every token of sequence i goes to
    ``windows[window_rows[i], t]``. Returns x's shape, strides and dtype."""
    squeeze = x.dim() == 2
    xs = x.unsqueeze(-1) if squeeze else x
    bs, dim, L = xs.shape
    slots = (state_indices if state_indices is not None else torch.arange(bs)).long()
    live = slots != pad_slot_id
    out = torch.zeros_like(xs, dtype=torch.float32)  # x's strides, as SGLang's kernel (callers view its transpose)
    state = conv_state[slots[live]].float()
    rows = window_rows.long()[live] if windows is not None else None
    xl = xs[live].float()
    for t in range(L):
        window = torch.cat([state, xl[..., t : t + 1]], dim=-1)
        out[live, :, t] = _conv_token(window, weight, bias, silu)
        state = window[..., 1:]
        if windows is not None:
            windows[rows, t] = state.to(windows.dtype)
    conv_state[slots[live]] = state.to(conv_state.dtype)
    out = out.to(x.dtype)
    return out.squeeze(-1) if squeeze else out


def conv_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state, silu: bool,
                 pad_slot_id: int = -1) -> torch.Tensor:
    """Causal depthwise conv over packed prompts: x ``[dim, T]``, sequence i = columns
    ``query_start_loc[i] : query_start_loc[i + 1]``, continuing from ``conv_states[cache_indices[i]]`` where
    ``has_initial_state[i]`` (else zeros), whose state is then the last ``W - 1`` inputs. Returns ``[dim, T]``."""
    dim, _ = x.shape
    W = weight.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float32)
    init = has_initial_state.tolist() if has_initial_state is not None else None
    for i, (s, e) in enumerate(_segments(query_start_loc)):
        slot = int(cache_indices[i])
        if slot == pad_slot_id or e == s:
            continue
        prev = conv_states[slot].float() if init is not None and init[i] else torch.zeros(dim, W - 1)
        full = torch.cat([prev, x[:, s:e].float()], dim=-1)
        out[:, s:e] = _conv_token(full.unfold(-1, W, 1), weight[:, None, :], bias[:, None] if bias is not None
                                  else None, silu)
        conv_states[slot] = full[:, -(W - 1):].to(conv_states.dtype)
    return out.to(x.dtype)


def gemma_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """SGLang's ``GemmaRMSNorm.forward_native`` over the last dim: x * rsqrt(mean(x^2) + eps) * (1 + w)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * (1.0 + weight.float())).to(x.dtype)


# ------------------------------------------------------------------------------------------------ the ops


def _fused_gdn_gating(A_log, a, b, dt_bias):
    g, beta = gdn_gating(A_log, a, b, dt_bias)
    return g.unsqueeze(0), beta.unsqueeze(0)


def _chunk_gated_delta_rule(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, head_first,
                            use_qk_l2norm_in_kernel, initial_state_indices):
    if head_first:
        raise NotImplementedError("sglang-dflash: chunk_gated_delta_rule_cpu with head_first=True")
    o = gated_delta_rule(q[0], k[0], v[0], g[0], beta[0], initial_state, initial_state_indices, cu_seqlens,
                         scale=q.shape[-1] ** -0.5, l2norm=use_qk_l2norm_in_kernel)
    return o.unsqueeze(0), initial_state[initial_state_indices.long()].clone()


def _fused_sigmoid_gating_delta_rule_update(A_log, dt_bias, q, k, v, a, b, initial_state_source,
                                            initial_state_indices, cu_seqlens, use_qk_l2norm_in_kernel,
                                            softplus_beta, softplus_threshold, is_kda=False,
                                            disable_state_update=False, intermediate_states_buffer=None,
                                            intermediate_state_indices=None, cache_steps=None,
                                            retrieve_parent_token=None, scale=None):
    if is_kda or retrieve_parent_token is not None:
        raise NotImplementedError("sglang-dflash: the CPU gated delta rule serves GDN over linear blocks only "
                                  "(no KDA, no EAGLE trees)")
    T = q.shape[1]
    g, beta = gdn_gating(A_log, a.reshape(T, -1), b.reshape(T, -1), dt_bias, softplus_beta, softplus_threshold)
    o = gated_delta_rule(q[0], k[0], v[0], g, beta, initial_state_source, initial_state_indices, cu_seqlens,
                         scale=scale if scale is not None else q.shape[-1] ** -0.5, l2norm=use_qk_l2norm_in_kernel,
                         update_state=not disable_state_update, intermediate=intermediate_states_buffer,
                         intermediate_rows=intermediate_state_indices)
    return o.unsqueeze(0)


def _causal_conv1d_fwd(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                       silu_activation, pad_slot_id, is_vnni):
    return conv_prefill(x, weight, bias, conv_states, query_start_loc, cache_indices, has_initial_state,
                        silu_activation, pad_slot_id)


def _causal_conv1d_update(x, conv_state, weight, bias, silu_activation, cache_seqlens, conv_state_indices,
                          pad_slot_id, is_vnni):
    if cache_seqlens is not None:
        raise NotImplementedError("sglang-dflash: causal_conv1d_update_cpu with a circular conv state")
    return conv_update(x, conv_state, weight, bias, silu_activation, conv_state_indices, pad_slot_id)


def _split_qkvzba_contiguous(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """[q | k | v | z] and [b | a] per token -> (qkv ``[T, 2*Hqk*Dqk + Hv*Dv]``, z ``[T, Hv, Dv]``, b, a ``[T, Hv]``)."""
    qkv_dim = 2 * num_heads_qk * head_qk + num_heads_v * head_v
    z = mixed_qkvz[:, qkv_dim:].reshape(-1, num_heads_v, head_v).contiguous()
    return (mixed_qkvz[:, :qkv_dim].contiguous(), z, mixed_ba[:, :num_heads_v].contiguous(),
            mixed_ba[:, num_heads_v:].contiguous())


def _split_qkvzba_interleaved(mixed_qkvz, mixed_ba, num_heads_qk, num_heads_v, head_qk, head_v):
    """Qwen3-Next's per-key-head groups [q | k | v x r | z x r] and [b x r | a x r] (r = Hv / Hqk) -> the outputs
    of `_split_qkvzba_contiguous`."""
    T, r = mixed_qkvz.shape[0], num_heads_v // num_heads_qk
    g = mixed_qkvz.view(T, num_heads_qk, -1)
    q, k, v, z = torch.split(g, [head_qk, head_qk, r * head_v, r * head_v], dim=-1)
    ba = mixed_ba.view(T, num_heads_qk, 2 * r)
    qkv = torch.cat([q.reshape(T, -1), k.reshape(T, -1), v.reshape(T, -1)], dim=-1)
    return (qkv, z.reshape(T, num_heads_v, head_v).contiguous(), ba[..., :r].reshape(T, -1).contiguous(),
            ba[..., r:].reshape(T, -1).contiguous())


def _fused_qk_gemma_rmsnorm(q, k, q_weight, k_weight, eps, head_dim):
    return (gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
            gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps))


def _fused_qk_gemma_rmsnorm_with_gate(q_gate, k, q_weight, k_weight, eps, head_dim, num_heads):
    """q_gate ``[T, num_heads * 2 * head_dim]`` interleaved per head as [q_h | gate_h] -> (q, k, gate), each
    ``[rows, head_dim]`` contiguous, q and k Gemma-RMS-normalised."""
    qg = q_gate.reshape(q_gate.shape[0], num_heads, 2 * head_dim)
    q, gate = qg[..., :head_dim], qg[..., head_dim:]
    return (gemma_rmsnorm(q.reshape(-1, head_dim), q_weight, eps),
            gemma_rmsnorm(k.reshape(-1, head_dim), k_weight, eps), gate.reshape(-1, head_dim).contiguous())


def _sigmoid_gate(x, gate):
    """sigmoid(gate) in x's dtype; gate ``[T, D]`` or ``[T, heads, D / heads]`` (a strided view) for x ``[T, D]``."""
    return torch.sigmoid(gate.reshape(x.shape).float()).to(x.dtype)


def _fused_sigmoid_mul(x, gate, inplace=False):
    """0.5.17's form: x * sigmoid(gate), into x where ``inplace``."""
    g = _sigmoid_gate(x, gate)
    return x.mul_(g) if inplace else x * g


def _fused_sigmoid_mul_in_place(x, gate) -> None:
    """0.5.23's form: x *= sigmoid(gate)."""
    x.mul_(_sigmoid_gate(x, gate))


# `compat.CPU_SIGMOID_MUL_CALL` -> (schema, implementation) of fused_sigmoid_mul_cpu
SIGMOID_MUL_FORMS = {
    "returning": ("(Tensor(a!) x, Tensor gate, bool inplace=False) -> Tensor", _fused_sigmoid_mul),
    "in_place": ("(Tensor(a!) x, Tensor gate) -> ()", _fused_sigmoid_mul_in_place),
}


# op name -> (schema, implementation)
OPS = {
    "fused_gdn_gating_cpu": ("(Tensor A_log, Tensor a, Tensor b, Tensor dt_bias) -> (Tensor, Tensor)",
                             _fused_gdn_gating),
    "chunk_gated_delta_rule_cpu": (
        "(Tensor q, Tensor k, Tensor v, Tensor g, Tensor beta, Tensor(a!) initial_state, bool output_final_state, "
        "Tensor cu_seqlens, bool head_first, bool use_qk_l2norm_in_kernel, Tensor initial_state_indices) "
        "-> (Tensor, Tensor)", _chunk_gated_delta_rule),
    "fused_sigmoid_gating_delta_rule_update_cpu": (
        "(Tensor A_log, Tensor dt_bias, Tensor q, Tensor k, Tensor v, Tensor a, Tensor b, "
        "Tensor(a!) initial_state_source, Tensor initial_state_indices, Tensor cu_seqlens, "
        "bool use_qk_l2norm_in_kernel, float softplus_beta, float softplus_threshold, bool is_kda=False, "
        "bool disable_state_update=False, Tensor(b!)? intermediate_states_buffer=None, "
        "Tensor? intermediate_state_indices=None, int? cache_steps=None, Tensor? retrieve_parent_token=None, "
        "float? scale=None) -> Tensor", _fused_sigmoid_gating_delta_rule_update),
    "causal_conv1d_fwd_cpu": (
        "(Tensor x, Tensor weight, Tensor? bias, Tensor(a!) conv_states, Tensor query_start_loc, "
        "Tensor cache_indices, Tensor? has_initial_state, bool silu_activation, int pad_slot_id, bool is_vnni) "
        "-> Tensor", _causal_conv1d_fwd),
    "causal_conv1d_update_cpu": (
        "(Tensor x, Tensor(a!) conv_state, Tensor weight, Tensor? bias, bool silu_activation, Tensor? cache_seqlens, "
        "Tensor? conv_state_indices, int pad_slot_id, bool is_vnni) -> Tensor", _causal_conv1d_update),
    "fused_qkvzba_split_reshape_cat_contiguous_cpu": (
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)", _split_qkvzba_contiguous),
    "fused_qkvzba_split_reshape_cat_cpu": (
        "(Tensor mixed_qkvz, Tensor mixed_ba, int num_heads_qk, int num_heads_v, int head_qk, int head_v) "
        "-> (Tensor, Tensor, Tensor, Tensor)", _split_qkvzba_interleaved),
    "fused_qk_gemma_rmsnorm_cpu": (
        "(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim) -> (Tensor, Tensor)",
        _fused_qk_gemma_rmsnorm),
    "fused_qk_gemma_rmsnorm_with_gate_cpu": (
        "(Tensor q_gate, Tensor k, Tensor q_weight, Tensor k_weight, float eps, int head_dim, int num_heads) "
        "-> (Tensor, Tensor, Tensor)", _fused_qk_gemma_rmsnorm_with_gate),
}  # + fused_sigmoid_mul_cpu in the installed release's form (`SIGMOID_MUL_FORMS`, `ops`)


def causal_conv1d_update_with_windows(original, mixed_qkv, conv_states, conv_weights, bias, activation,
                                      conv_state_indices=None, intermediate_conv_window=None,
                                      intermediate_state_indices=None, retrieve_next_token=None,
                                      retrieve_next_sibling=None, retrieve_parent_token=None):
    """Around ``sgl_kernel.mamba.causal_conv1d_update_cpu``: the verify forward of speculative decoding passes the
    per-step window buffer (``intermediate_conv_window``), which the CPU wrapper does not take; `conv_update` keeps
    those windows. Other calls go to the wrapper unchanged."""
    if intermediate_conv_window is None:
        return original(mixed_qkv, conv_states, conv_weights, bias, activation, conv_state_indices)
    if retrieve_parent_token is not None or retrieve_next_token is not None:
        raise NotImplementedError("sglang-dflash: the CPU conv verify serves linear blocks only (no EAGLE trees)")
    return conv_update(mixed_qkv, conv_states, conv_weights, bias, activation in ("silu", "swish"),
                       conv_state_indices, windows=intermediate_conv_window, window_rows=intermediate_state_indices)


def rms_norm_gated(original, norm, x, z=None):
    """Around SGLang's gated RMSNorm (``fla.layernorm_gated.RMSNorm.forward``): on CPU without sgl-kernel's CPU
    build its Triton kernel cannot run; SGLang's torch reference of the same norm (``rms_norm_ref``) does."""
    from sglang.kernels.ops.attention.fla import layernorm_gated

    if x.device.type != "cpu" or layernorm_gated._use_cpu:
        return original(norm, x, z)
    if norm.activation not in ("swish", "silu"):
        raise NotImplementedError(f"sglang-dflash: gated RMSNorm with activation {norm.activation!r} on CPU")
    return layernorm_gated.rms_norm_ref(x, norm.weight, norm.bias, z=z, eps=norm.eps, group_size=norm.group_size,
                                        norm_before_gate=norm.norm_before_gate)


def fused_rms_norm_gated(original, norm, x, g, residual=None, prenorm=False, residual_in_fp32=False):
    """Around SGLang's fused gated RMSNorm (``fla.fused_norm_gate.FusedRMSNormGated.forward``, Qwen3-Next's GDN
    output norm): on CPU without sgl-kernel's CPU build its Triton kernel cannot run; the kernel's arithmetic in
    float32 torch instead: x ``[..., D]`` RMS-normalised over D, times the weight, times act(g) (swish: g *
    sigmoid(g); sigmoid: sigmoid(g))."""
    from sglang.kernels.ops.attention.fla import fused_norm_gate

    if x.device.type != "cpu" or fused_norm_gate._use_cpu:
        return original(norm, x, g, residual=residual, prenorm=prenorm, residual_in_fp32=residual_in_fp32)
    if residual is not None or prenorm:
        raise NotImplementedError("sglang-dflash: the fused gated RMSNorm with a residual on CPU")
    xf, gf = x.float(), g.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + norm.eps)
    if norm.weight is not None:
        y = y * norm.weight.float()
    y = y * (gf * torch.sigmoid(gf) if norm.activation in ("swish", "silu") else torch.sigmoid(gf))
    return y.to(x.dtype)


def gate_sigmoid_mul_add(original, hidden_states, gate_weight, shared_output, final_hidden_states):
    """Around SGLang's fused shared-expert gate of its Qwen2-MoE-family blocks (Qwen3-Next's; a Triton kernel):
    on CPU ``final_hidden_states [T, D] += sigmoid(hidden_states [T, D] @ gate_weight [D]) * shared_output [T, D]``
    in torch, in place like the kernel."""
    if hidden_states.device.type != "cpu":
        return original(hidden_states, gate_weight, shared_output, final_hidden_states)
    gate = torch.sigmoid(hidden_states.float() @ gate_weight.float()).unsqueeze(1)
    final_hidden_states.add_((gate * shared_output.float()).to(final_hidden_states.dtype))


# ------------------------------------------------------------------------------------------------ registration

def ops(call: str | None) -> dict:
    """:data:`OPS` and ``fused_sigmoid_mul_cpu`` in the form ``call`` (`SIGMOID_MUL_FORMS`; None: left out -- a
    hybrid target is then refused on CPU, `cpu_platform.check_hybrid_target`)."""
    return {**OPS, **({"fused_sigmoid_mul_cpu": SIGMOID_MUL_FORMS[call]} if call is not None else {})}


def register_ops() -> None:
    """Define the `ops` of the installed SGLang (`compat.CPU_SIGMOID_MUL_CALL`) that ``torch.ops.sgl_kernel`` lacks
    (`cpu_platform.register_sgl_kernel_cpu_ops`: a native CPU build registers its own, which win)."""
    from sglang_dflash.adapter import compat
    from sglang_dflash.adapter.cpu_platform import register_sgl_kernel_cpu_ops

    register_sgl_kernel_cpu_ops(ops(compat.CPU_SIGMOID_MUL_CALL))


class _TorchOn:
    """``torch`` for a constructor building on ``device``: every ``zeros`` allocated there, and
    ``get_device_module()`` (no argument) naming that device's module."""

    def __init__(self, device):
        self._device = torch.device(device)

    def __getattr__(self, name):
        return getattr(torch, name)

    def zeros(self, *args, **kwargs):
        return torch.zeros(*args, **{**kwargs, "device": self._device})

    def get_device_module(self, device=None):
        return torch.get_device_module(self._device if device is None else device)


def _constructed_on(module, device, original, obj, /, *args, **kwargs):
    """``original(obj, *args, **kwargs)`` (a constructor) with ``module``'s ``torch`` building on ``device``."""
    module.torch = _TorchOn(device)
    try:
        return original(obj, *args, **kwargs)
    finally:
        module.torch = torch


def mamba_pool_on_cpu(original, pool, *args, device, **kwargs):
    """Around ``MambaPool.__init__``: SGLang 0.5.17 allocates the verify scratch of speculative decoding
    (``intermediate_ssm``, ``intermediate_conv_window``) with ``device="cuda"`` written out; for a CPU pool every
    allocation of the constructor goes to the CPU (later releases allocate on the pool's device already)."""
    from sglang.srt.mem_cache import memory_pool

    if str(device) != "cpu":
        return original(pool, *args, device=device, **kwargs)
    return _constructed_on(memory_pool, device, original, pool, *args, device=device, **kwargs)


def qwen3_next_gdn_on_cpu(original, layer, *args, **kwargs):
    """Around Qwen3-Next's ``Qwen3GatedDeltaNet.__init__`` (hooked on a CPU server only): its output norm is built
    on ``torch.get_device_module().current_device()``, i.e. on CUDA where torch (2.14, SGLang 0.5.23's) names its
    compiled-in accelerator on a host without a GPU; here it names the CPU."""
    from sglang.srt.models import qwen3_next

    return _constructed_on(qwen3_next, "cpu", original, layer, *args, **kwargs)


# dotted path -> (hook, parameter names of the hooked function; checked by `register_hooks`: these live in
# sgl_kernel, importable only after `cpu_platform.setup` on a host without a GPU driver)
HOOKS = {
    "sgl_kernel.mamba.causal_conv1d_update_cpu": (
        causal_conv1d_update_with_windows,
        ["mixed_qkv", "conv_states", "conv_weights", "bias", "activation", "conv_state_indices"]),
    "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward": (rms_norm_gated, ["self", "x", "z"]),
    "sglang.kernels.ops.attention.fla.fused_norm_gate.FusedRMSNormGated.forward": (
        fused_rms_norm_gated, ["self", "x", "g", "residual", "prenorm", "residual_in_fp32"]),
    "sglang.srt.models.qwen2_moe.fused_gate_sigmoid_mul_add": (
        gate_sigmoid_mul_add, ["hidden_states", "gate_weight", "shared_output", "final_hidden_states"]),
    "sglang.srt.mem_cache.memory_pool.MambaPool.__init__": (mamba_pool_on_cpu, ["self"]),
    "sglang.srt.models.qwen3_next.Qwen3GatedDeltaNet.__init__": (qwen3_next_gdn_on_cpu, ["self", "config"]),
}


def register_hooks() -> None:
    """The :data:`HOOKS` (AROUND), for a CPU server; a hooked function whose parameters differ from those it was
    written for is refused (another SGLang / sgl-kernel version)."""
    import inspect
    import pkgutil

    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, (hook, params) in HOOKS.items():
        found = list(inspect.signature(pkgutil.resolve_name(target)).parameters)
        if found[: len(params)] != params:
            raise RuntimeError(f"sglang-dflash: {target} takes {found}, not {params}: this SGLang / sgl-kernel is not "
                               "one sglang-dflash supports (compat.SUPPORTED_RANGE).")
        HookRegistry.register(target, hook, HookType.AROUND)
