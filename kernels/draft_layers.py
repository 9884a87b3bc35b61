"""Fused elementwise ops of the draft forward: RMSNorm (with the residual add), per-head RMSNorm + RoPE,
and SiLU-and-mul.

In torch each is a chain of small kernels (an RMSNorm in float32 is seven; a per-head norm followed by
neox RoPE is twelve); at serving batch sizes the draft forward is launch-bound, so each becomes one
launch here. The refs are `sglang_dflash.model`'s own ops (statistics in float32, the norm rounded
to the input dtype before the weight multiplies, RoPE products rounded like torch's elementwise
ops), so the kernels differ from the core model only in the order of a float32 sum.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from sglang_dflash import model as core
from sglang_dflash.kernels import use_triton

__all__ = ["rms_norm_ref", "rms_norm", "norm_rope_ref", "norm_rope", "silu_mul_ref", "silu_mul"]

_FLOATS = (torch.float32, torch.float16, torch.bfloat16)


# ---------------------------------------------------------------- refs (the spec and the CPU path)

def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[N, H]``, weight ``[H]``, residual ``[N, H]`` or None -> (normed ``[N, H]``, new residual ``[N, H]``).

    The new residual is ``residual + x`` (in x's dtype), or x itself without a residual; the norm is taken
    of the new residual.
    """
    h = x if residual is None else residual + x
    return core.rms_norm(h, weight, eps).to(x.dtype), h


def norm_rope_ref(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """Per-head RMSNorm, then neox RoPE, in place. x ``[N, heads, D]`` (last dim contiguous), weight
    ``[heads, D]`` (row h normalizes head h), cos/sin ``[N, D]`` in x's dtype (`model.rope_cos_sin`).
    Returns x."""
    y = core.rms_norm(x, weight, eps).to(x.dtype)
    x.copy_(core.apply_rope(y, (cos[:, None, :], sin[:, None, :])))
    return x


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """x ``[N, 2I]`` = [gate | up] -> ``silu(gate) * up`` ``[N, I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---------------------------------------------------------------- kernels

@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, x_stride, res_stride, H, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    """One program per row; the row lives in registers (BLOCK >= H)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < H
    dt = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * res_stride + cols, mask=m, other=0.0)
        x = (r.to(tl.float32) + x.to(tl.float32)).to(dt)
        tl.store(res_out_ptr + row * H + cols, x, mask=m)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0)
    y = w.to(tl.float32) * (xf * inv).to(dt).to(tl.float32)
    tl.store(out_ptr + row * H + cols, y.to(dt), mask=m)


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, x_stride_n, x_stride_h, cs_stride, HEADS, eps,
                      HALF: tl.constexpr, HEADS_P2: tl.constexpr, HALF_P2: tl.constexpr):
    """One program per token, all its heads: [HEADS_P2, HALF_P2] tiles of the two halves of each head."""
    tok = tl.program_id(0).to(tl.int64)
    h = tl.arange(0, HEADS_P2)[:, None]
    j = tl.arange(0, HALF_P2)[None, :]
    m = (h < HEADS) & (j < HALF)
    dt = x_ptr.dtype.element_ty
    base = x_ptr + tok * x_stride_n + h * x_stride_h
    x1 = tl.load(base + j, mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF + j, mask=m, other=0.0).to(tl.float32)
    inv = tl.rsqrt((tl.sum(x1 * x1, axis=1) + tl.sum(x2 * x2, axis=1)) / (2 * HALF) + eps)[:, None]
    w1 = tl.load(w_ptr + h * (2 * HALF) + j, mask=m, other=0.0).to(tl.float32)
    w2 = tl.load(w_ptr + h * (2 * HALF) + HALF + j, mask=m, other=0.0).to(tl.float32)
    y1 = (w1 * (x1 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    y2 = (w2 * (x2 * inv).to(dt).to(tl.float32)).to(dt).to(tl.float32)
    jm = j < HALF
    c = tl.load(cos_ptr + tok * cs_stride + j, mask=jm, other=0.0).to(tl.float32)  # both halves are equal
    s = tl.load(sin_ptr + tok * cs_stride + j, mask=jm, other=0.0).to(tl.float32)
    o1 = (y1 * c).to(dt).to(tl.float32) + (-y2 * s).to(dt).to(tl.float32)
    o2 = (y2 * c).to(dt).to(tl.float32) + (y1 * s).to(dt).to(tl.float32)
    tl.store(base + j, o1.to(dt), mask=m)
    tl.store(base + HALF + j, o2.to(dt), mask=m)


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, x_stride, I, BLOCK: tl.constexpr):
    """Program (row, column block)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = cols < I
    dt = out_ptr.dtype.element_ty
    g = tl.load(x_ptr + row * x_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * x_stride + I + cols, mask=m, other=0.0).to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
    tl.store(out_ptr + row * I + cols, (act * u).to(dt), mask=m)


# ---------------------------------------------------------------- launchers

def _check(name: str, t, dims: int, dtype: Optional[torch.dtype], device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got shape {tuple(t.shape)}")
    if t.dtype not in _FLOATS or (dtype is not None and t.dtype != dtype):
        want = dtype if dtype is not None else "float32/float16/bfloat16"
        raise ValueError(f"{name} must be {want}, got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}; put all inputs on one device")
    if t.numel() and t.stride(-1) != 1:
        raise ValueError(f"{name} must have a contiguous last dim (stride 1), got strides {t.stride()}")


def _warps(block: int) -> int:
    return max(1, min(8, block // 256))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm of ``residual + x`` (or of x) in one launch; shapes and math: :func:`rms_norm_ref`.
    x and residual may be row-strided views. Returns new (normed, residual) tensors ``[N, H]``."""
    _check("x", x, 2, None, x.device)
    n, hidden = x.shape
    _check("weight", weight, 1, None, x.device)
    if weight.shape != (hidden,):
        raise ValueError(f"weight must have shape ({hidden},) (x's last dim), got {tuple(weight.shape)}")
    if residual is not None:
        _check("residual", residual, 2, x.dtype, x.device)
        if residual.shape != x.shape:
            raise ValueError(f"residual must have x's shape {tuple(x.shape)}, got {tuple(residual.shape)}")
    if not use_triton(x.device):
        return rms_norm_ref(x, weight, eps, residual)
    out = torch.empty((n, hidden), dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else x
    if n:
        block = triton.next_power_of_2(hidden)
        _rms_norm_kernel[(n,)](x, residual if residual is not None else x, weight, out, res_out, x.stride(0),
                               residual.stride(0) if residual is not None else 0, hidden, float(eps),
                               HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    return out, res_out


def norm_rope(x: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
              eps: float) -> torch.Tensor:
    """Per-head RMSNorm + neox RoPE of x ``[N, heads, D]`` in place, one launch (math:
    :func:`norm_rope_ref`); x may be a strided view (e.g. the q and k heads of a fused qkv output).
    Returns x."""
    _check("x", x, 3, None, x.device)
    n, heads, d = x.shape
    if d % 2:
        raise ValueError(f"head_dim must be even for RoPE, got {d}")
    _check("weight", weight, 2, None, x.device)
    if weight.shape != (heads, d) or not weight.is_contiguous():
        raise ValueError(f"weight must be a contiguous ({heads}, {d}) tensor (one norm weight row per head), "
                         f"got {tuple(weight.shape)}")
    for name, t in (("cos", cos), ("sin", sin)):
        _check(name, t, 2, x.dtype, x.device)
        if t.shape != (n, d):
            raise ValueError(f"{name} must have shape ({n}, {d}) (one row per token), got {tuple(t.shape)}")
    if cos.stride() != sin.stride():
        raise ValueError("cos and sin must have the same strides")
    if not use_triton(x.device):
        return norm_rope_ref(x, weight, cos, sin, eps)
    if n:
        _norm_rope_kernel[(n,)](x, weight, cos, sin, x.stride(0), x.stride(1), cos.stride(0), heads, float(eps),
                                HALF=d // 2, HEADS_P2=triton.next_power_of_2(heads),
                                HALF_P2=triton.next_power_of_2(d // 2), num_warps=4)
    return x


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of x ``[N, 2I]`` (a row-strided view allowed) in one launch -> ``[N, I]``."""
    _check("x", x, 2, None, x.device)
    n, width = x.shape
    if width % 2:
        raise ValueError(f"x must hold [gate | up] halves of equal width, got last dim {width}")
    if not use_triton(x.device):
        return silu_mul_ref(x)
    inter = width // 2
    out = torch.empty((n, inter), dtype=x.dtype, device=x.device)
    if n:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](x, out, x.stride(0), inter, BLOCK=block,
                                                         num_warps=_warps(block))
    return out
