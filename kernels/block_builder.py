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

from sglang_dflash.config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from sglang_dflash.kernels import use_triton

__all__ = ["build_block_ref", "build_block"]


def build_block_ref(
    last_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    req_to_token: Optional[torch.Tensor] = None,
    req_pool_indices: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Pure-torch specification of :func:`build_block` (no input validation).

    Args:
        last_tokens: ``[b]`` int64, last committed token per request.
        seq_lens: ``[b]`` int64, tokens already in the KV cache per request.
        block_size: ``B``.
        mask_token_id: id filling block positions ``1..B-1``.
        req_to_token: ``[R, max_ctx]`` int32 slot table (read only), or None (no slot gathering).
        req_pool_indices: ``[b]`` int64 rows of ``req_to_token``, or None.

    Returns:
        input_ids ``[b*B]`` int64, positions ``[b*B]`` int64, out_cache_loc ``[b*B]`` int64
        (None without ``req_to_token``).
    """
    b = last_tokens.shape[0]
    offsets = torch.arange(block_size, device=last_tokens.device, dtype=torch.int64)
    input_ids = torch.full((b, block_size), mask_token_id, dtype=torch.int64, device=last_tokens.device)
    input_ids[:, 0] = last_tokens
    positions = seq_lens.to(torch.int64).unsqueeze(1) + offsets
    out_cache_loc = None
    if req_to_token is not None:
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
    GATHER_SLOTS: tl.constexpr,
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

    if GATHER_SLOTS:
        row = tl.load(req_pool_indices_ptr + req)
        loc = tl.load(req_to_token_ptr + row * req_to_token_stride0 + pos * req_to_token_stride1,
                      mask=in_block, other=0)
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


def _validate(last_tokens, seq_lens, block_size, mask_token_id, req_to_token, req_pool_indices, out,
              check_values) -> None:
    if not isinstance(last_tokens, torch.Tensor) or last_tokens.dim() != 1:
        raise ValueError("last_tokens must be a 1-D int64 tensor [batch]")
    b, device = last_tokens.shape[0], last_tokens.device
    _check_1d("last_tokens", last_tokens, b, torch.int64, device)
    _check_1d("seq_lens", seq_lens, b, torch.int64, device)
    if not isinstance(block_size, int) or not MIN_BLOCK_SIZE <= block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"block_size must be an int in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}], got {block_size!r}")
    if not isinstance(mask_token_id, int) or mask_token_id < 0:
        raise ValueError(f"mask_token_id must be a non-negative int token id, got {mask_token_id!r}")

    gather = req_to_token is not None
    if gather != (req_pool_indices is not None):
        raise ValueError("req_to_token and req_pool_indices go together: pass both to gather the verify "
                         "cache slots (out_cache_loc), or neither to only build input_ids/positions")
    if gather:
        _check_1d("req_pool_indices", req_pool_indices, b, torch.int64, device)
        if not isinstance(req_to_token, torch.Tensor) or req_to_token.dim() != 2 or req_to_token.dtype != torch.int32:
            raise ValueError(f"req_to_token must be a 2-D int32 tensor [pool_size, max_context_len], got "
                             f"{getattr(req_to_token, 'dtype', type(req_to_token).__name__)} of shape "
                             f"{tuple(getattr(req_to_token, 'shape', ()))}")
        if req_to_token.device != device:
            raise ValueError(f"req_to_token is on {req_to_token.device} but last_tokens is on {device}")
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise ValueError("out must be a tuple (input_ids, positions, out_cache_loc); out_cache_loc is None "
                             "when req_to_token is not given")
        names = ("out input_ids", "out positions", "out out_cache_loc")
        if not gather and out[2] is not None:
            raise ValueError("out out_cache_loc must be None when req_to_token is not given (no slots are "
                             "gathered); pass req_to_token and req_pool_indices to fill it")
        for name, t in zip(names, out if gather else out[:2]):
            _check_1d(name, t, b * block_size, torch.int64, device)
            if not t.is_contiguous():
                raise ValueError(f"{name} must be contiguous")

    capturing = device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    if not check_values or capturing or b == 0:
        return
    # min/max of every index tensor in one host copy (one device sync), then exact checks on the host.
    stats = [seq_lens] + ([req_pool_indices] if gather else [])
    bounds = torch.stack([v for t in stats for v in torch.aminmax(t)]).tolist()
    seq_min, seq_max = bounds[0], bounds[1]
    if seq_min < 0:
        raise ValueError(f"seq_lens must be >= 0 (tokens already in the KV cache), got {seq_min}")
    if gather:
        pool_min, pool_max = bounds[2:]
        pool_size, max_ctx = req_to_token.shape
        if pool_min < 0 or pool_max >= pool_size:
            raise ValueError(f"req_pool_indices must be in [0, {pool_size}) (rows of req_to_token), "
                             f"got values in [{pool_min}, {pool_max}]")
        if seq_max + block_size > max_ctx:
            raise ValueError(f"seq_lens + block_size must be <= req_to_token.shape[1] = {max_ctx}, got "
                             f"{seq_max} + {block_size}; the verify block would be read past the request's "
                             f"context (raise the context length or lower block_size)")


def build_block(
    last_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    mask_token_id: int,
    req_to_token: Optional[torch.Tensor] = None,
    req_pool_indices: Optional[torch.Tensor] = None,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]] = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Build verify blocks for the whole batch in one launch (see module docstring and
    :func:`build_block_ref` for shapes).

    Dispatches to the Triton kernel on CUDA or under ``TRITON_INTERPRET=1``, else to the ref.
    ``out=(input_ids, positions, out_cache_loc)`` optionally supplies ``[b*B]`` int64 output
    buffers (``out_cache_loc`` None when ``req_to_token`` is not given). ``check_values`` checks
    index ranges (one device sync); it is skipped while a CUDA graph is being captured.

    Returns:
        input_ids ``[b*B]`` int64, positions ``[b*B]`` int64, out_cache_loc ``[b*B]`` int64
        gathered from ``req_to_token`` (None without it).
    """
    _validate(last_tokens, seq_lens, block_size, mask_token_id, req_to_token, req_pool_indices, out, check_values)
    b, device = last_tokens.shape[0], last_tokens.device
    gather = req_to_token is not None
    if not use_triton(device):
        got = build_block_ref(last_tokens, seq_lens, block_size, mask_token_id, req_to_token, req_pool_indices)
        if out is None:
            return got
        for dst, src in zip(out, got):
            if src is not None:
                dst.copy_(src)
        return out[0], out[1], out[2]

    n = b * block_size
    if out is None:
        out = (torch.empty(n, dtype=torch.int64, device=device), torch.empty(n, dtype=torch.int64, device=device),
               torch.empty(n, dtype=torch.int64, device=device) if gather else None)
    if b == 0:
        return out[0], out[1], out[2]
    _build_block_kernel[(b,)](
        last_tokens.contiguous(),
        seq_lens.contiguous(),
        out[0],
        out[1],
        out[2] if gather else last_tokens,
        req_to_token if gather else last_tokens,
        req_pool_indices.contiguous() if gather else last_tokens,
        req_to_token.stride(0) if gather else 0,
        req_to_token.stride(1) if gather else 0,
        mask_token_id,
        BLOCK_SIZE=block_size,
        BLOCK_P2=triton.next_power_of_2(block_size),
        GATHER_SLOTS=gather,
        num_warps=1,  # a block is <= 64 lanes: one warp per request
    )
    return out[0], out[1], out[2]
