"""Build the DFlash verify block for a ragged batch and gather its KV-cache slots.

For request ``i`` with ``seq_lens[i]`` tokens already in the KV cache (the last committed token
is NOT among them yet), the block is::

    input_ids[i*B : (i+1)*B]     = [last_tokens[i], MASK, ..., MASK]
    positions[i*B : (i+1)*B]     = seq_lens[i] + arange(B)
    out_cache_loc[i*B + j]       = req_to_token[req_pool_indices[i], seq_lens[i] + j]   (j < B)

SGLang's spec-v2 scheduler reserves the verify slots in ``req_to_token`` before the worker runs
(over-allocation), so the worker only READS them: ``req_to_token`` is never written here.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_dflash.kernels import use_triton

__all__ = ["build_block_ref", "build_block"]


def build_block_ref(
    last_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch specification of :func:`build_block` (no input validation).

    Args:
        last_tokens: ``[b]`` int64, last committed token per request.
        seq_lens: ``[b]`` int64, tokens already in the KV cache per request.
        block_size: ``B``.
        mask_token_id: id filling block positions ``1..B-1``.
        req_to_token: ``[R, max_ctx]`` int32 slot table (read only).
        req_pool_indices: ``[b]`` int64 rows of ``req_to_token``.

    Returns:
        input_ids ``[b*B]`` int64, positions ``[b*B]`` int64, out_cache_loc ``[b*B]`` int64.
    """
    b = last_tokens.shape[0]
    offsets = torch.arange(block_size, device=last_tokens.device, dtype=torch.int64)
    input_ids = torch.full((b, block_size), mask_token_id, dtype=torch.int64, device=last_tokens.device)
    input_ids[:, 0] = last_tokens
    positions = seq_lens.to(torch.int64).unsqueeze(1) + offsets
    rows = req_pool_indices.to(torch.int64).unsqueeze(1).expand(b, block_size)
    out_cache_loc = req_to_token[rows, positions].to(torch.int64).reshape(-1)
    return input_ids.reshape(-1), positions.reshape(-1), out_cache_loc


@triton.jit(do_not_specialize=["mask_token_id"])
def _build_block_kernel(
    last_tokens_ptr,
    seq_lens_ptr,
    input_ids_ptr,
    positions_ptr,
    out_cache_loc_ptr,
    req_to_token_ptr,
    req_pool_indices_ptr,
    req_to_token_stride0,
    req_to_token_stride1,
    mask_token_id,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    """One program per request; lanes ``0..BLOCK_P2-1`` cover the block (masked to BLOCK_SIZE)."""
    req = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P2)
    in_block = offs < BLOCK_SIZE
    base = req * BLOCK_SIZE

    last = tl.load(last_tokens_ptr + req)
    seq_len = tl.load(seq_lens_ptr + req)
    ids = tl.where(offs == 0, last, mask_token_id).to(tl.int64)
    pos = seq_len + offs.to(tl.int64)
    tl.store(input_ids_ptr + base + offs, ids, mask=in_block)
    tl.store(positions_ptr + base + offs, pos, mask=in_block)

    row = tl.load(req_pool_indices_ptr + req)
    loc = tl.load(req_to_token_ptr + row * req_to_token_stride0 + pos * req_to_token_stride1, mask=in_block, other=0)
    tl.store(out_cache_loc_ptr + base + offs, loc.to(tl.int64), mask=in_block)


def _check_1d(name: str, t: torch.Tensor, length: int, dtype: torch.dtype, device: torch.device) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}, got {t.dtype}; convert it with .to({dtype})")
    if t.shape != (length,):
        raise ValueError(f"{name} must have shape ({length},), got {tuple(t.shape)}")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but last_tokens is on {device}; put all inputs on one device")


def _validate(last_tokens, seq_lens, block_size, req_to_token, req_pool_indices, out) -> None:
    """Shapes, dtypes and devices, on the host only (no device sync). The block size and the value ranges are the
    caller's contract: the block size is checked once, when the draft config is read."""
    if not isinstance(last_tokens, torch.Tensor) or last_tokens.dim() != 1:
        raise ValueError("last_tokens must be a 1-D int64 tensor [batch]")
    b, device = last_tokens.shape[0], last_tokens.device
    _check_1d("last_tokens", last_tokens, b, torch.int64, device)
    _check_1d("seq_lens", seq_lens, b, torch.int64, device)
    _check_1d("req_pool_indices", req_pool_indices, b, torch.int64, device)
    if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
        raise ValueError(f"req_to_token must be a 2-D int32 tensor [pool_size, max_context_len], got "
                         f"{getattr(req_to_token, 'dtype', type(req_to_token).__name__)} of shape "
                         f"{tuple(getattr(req_to_token, 'shape', ()))}")
    if req_to_token.device != device:
        raise ValueError(f"req_to_token is on {req_to_token.device} but last_tokens is on {device}")
    if out is None:
        return
    if not isinstance(out, (tuple, list)) or len(out) != 3:
        raise ValueError("out must be a tuple (input_ids, positions, out_cache_loc)")
    for name, t in zip(("out input_ids", "out positions", "out out_cache_loc"), out):
        _check_1d(name, t, b * block_size, torch.int64, device)
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def build_block(
    last_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Build verify blocks for the whole batch in one launch (see module docstring and
    :func:`build_block_ref` for shapes).

    Dispatches to the Triton kernel on CUDA or under ``TRITON_INTERPRET=1``, else to the ref.
    ``out=(input_ids, positions, out_cache_loc)`` optionally supplies ``[b*B]`` int64 output buffers.
    The caller vouches for the values (not checked here): ``block_size`` in the range
    `sglang_dflash.config` allows, ``req_pool_indices`` rows of ``req_to_token`` and ``seq_lens + block_size``
    within its row.

    Returns:
        input_ids ``[b*B]`` int64, positions ``[b*B]`` int64, out_cache_loc ``[b*B]`` int64
        gathered from ``req_to_token``.
    """
    _validate(last_tokens, seq_lens, block_size, req_to_token, req_pool_indices, out)
    b, device = last_tokens.shape[0], last_tokens.device
    if not use_triton(device):
        got = build_block_ref(last_tokens, seq_lens, block_size, mask_token_id, req_to_token, req_pool_indices)
        if out is None:
            return got
        for dst, src in zip(out, got):
            dst.copy_(src)
        return out[0], out[1], out[2]

    n = b * block_size
    if out is None:
        out = tuple(torch.empty(n, dtype=torch.int64, device=device) for _ in range(3))
    if b == 0:
        return out[0], out[1], out[2]
    _build_block_kernel[(b,)](
        last_tokens.contiguous(),
        seq_lens.contiguous(),
        out[0],
        out[1],
        out[2],
        req_to_token,
        req_pool_indices.contiguous(),
        req_to_token.stride(0),
        req_to_token.stride(1),
        mask_token_id,
        BLOCK_SIZE=block_size,
        BLOCK_P2=triton.next_power_of_2(block_size),
        num_warps=1,  # a block is <= 64 lanes: one warp per request
    )
    return out[0], out[1], out[2]
