"""Apply the DFlash acceptance rule to a batch of verify blocks and pack the committed tokens.

The rule itself lives in :func:`sglang_dflash.verify.accept`; this module adds the packed output
the scheduler needs, in one launch for the whole batch. All outputs are int64.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from sglang_dflash.kernels import use_triton
from sglang_dflash.verify import accept

__all__ = ["accept_ref", "accept_tokens"]


def accept_ref(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Pure-torch specification of :func:`accept_tokens` (no input validation).

    Args:
        draft_tokens: ``[b, B]`` int64 verify rows ``[last, d_1, ..., d_{B-1}]``.
        target_tokens: ``[b, B]`` int64 target predictions for those rows.
        seq_lens: ``[b]`` int64 tokens in the KV cache before the verify block.

    Returns:
        accept_lens ``[b]`` int64 (``0..B-1``), bonus_tokens ``[b]`` int64,
        committed ``[b, B]`` int64 = ``d_1 .. d_{accept_len}, bonus`` then ``-1`` padding,
        new_seq_lens ``[b]`` int64 = ``seq_lens + accept_lens + 1`` (the last committed token
        and the accepted drafts now have KV; the bonus token does not yet).
    """
    accept_lens, bonus_tokens = accept(draft_tokens, target_tokens)
    b, block_size = draft_tokens.shape
    offsets = torch.arange(block_size, device=draft_tokens.device)
    next_drafts = torch.cat([draft_tokens[:, 1:], draft_tokens.new_full((b, 1), -1)], dim=1)
    lens = accept_lens.unsqueeze(1)
    committed = torch.where(offsets < lens, next_drafts, torch.full_like(next_drafts, -1))
    committed = torch.where(offsets == lens, bonus_tokens.unsqueeze(1), committed)
    new_seq_lens = seq_lens.to(torch.int64) + accept_lens + 1
    return accept_lens, bonus_tokens, committed, new_seq_lens


@triton.jit
def _accept_kernel(
    draft_ptr,
    target_ptr,
    seq_lens_ptr,
    accept_lens_ptr,
    bonus_ptr,
    committed_ptr,
    new_seq_lens_ptr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_P2: tl.constexpr,
):
    """One program per request; lane ``i`` compares ``d_{i+1}`` with ``target[i]``."""
    req = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_P2)
    in_block = offs < BLOCK_SIZE
    has_draft = offs + 1 < BLOCK_SIZE
    base = req * BLOCK_SIZE

    # every load up front: one round trip to memory
    target = tl.load(target_ptr + base + offs, mask=in_block, other=0)
    next_draft = tl.load(draft_ptr + base + offs + 1, mask=has_draft, other=0)
    seq_len = tl.load(seq_lens_ptr + req)
    # First mismatch; lane B-1 has no draft, so accept_len <= B-1.
    accept_len = tl.min(tl.where((next_draft == target) & has_draft, BLOCK_P2, offs), axis=0)
    bonus = tl.sum(tl.where(offs == accept_len, target, 0), axis=0)
    # Accepted drafts equal the target tokens at their lanes, so the packed row is target[:accept_len+1].
    committed = tl.where(offs <= accept_len, target, -1)

    tl.store(committed_ptr + base + offs, committed.to(tl.int64), mask=in_block)
    tl.store(accept_lens_ptr + req, accept_len.to(tl.int64))
    tl.store(bonus_ptr + req, bonus.to(tl.int64))
    tl.store(new_seq_lens_ptr + req, seq_len + accept_len.to(tl.int64) + 1)


def _validate(draft_tokens, target_tokens, seq_lens, out) -> None:
    if not isinstance(draft_tokens, torch.Tensor) or draft_tokens.dim() != 2:
        raise ValueError("draft_tokens must be a 2-D int64 tensor [batch, block_size]")
    b, block_size = draft_tokens.shape
    device = draft_tokens.device
    expected = [("draft_tokens", draft_tokens, (b, block_size)), ("target_tokens", target_tokens, (b, block_size)),
                ("seq_lens", seq_lens, (b,))]
    if out is not None:
        if len(out) != 4:
            raise ValueError("out must be a tuple (accept_lens, bonus_tokens, committed, new_seq_lens)")
        expected += [(f"out {name}", t, shape) for name, t, shape in zip(
            ("accept_lens", "bonus_tokens", "committed", "new_seq_lens"), out, [(b,), (b,), (b, block_size), (b,)])]
    for name, t, shape in expected:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != torch.int64:
            raise ValueError(f"{name} must be int64, got {t.dtype}; convert it with .long()")
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but draft_tokens is on {device}; put all inputs on one device")
        if name.startswith("out ") and not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")


def accept_tokens(
    draft_tokens: torch.Tensor,
    target_tokens: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    out: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Accept, pick the bonus token and pack committed tokens for the batch in one launch
    (shapes and semantics: :func:`accept_ref`; all outputs int64).

    Dispatches to the Triton kernel on CUDA or under ``TRITON_INTERPRET=1``, else to the ref.
    ``out`` optionally supplies the four output buffers. No index is read from the inputs, so
    there is no value check (and no device sync).

    Returns:
        accept_lens ``[b]``, bonus_tokens ``[b]``, committed ``[b, B]``, new_seq_lens ``[b]``.
    """
    _validate(draft_tokens, target_tokens, seq_lens, out)
    b, block_size = draft_tokens.shape
    device = draft_tokens.device
    if not use_triton(device):
        results = accept_ref(draft_tokens, target_tokens, seq_lens)
        if out is None:
            return results
        for dst, src in zip(out, results):
            dst.copy_(src)
        return out[0], out[1], out[2], out[3]

    if out is None:
        out = (torch.empty(b, dtype=torch.int64, device=device), torch.empty(b, dtype=torch.int64, device=device),
               torch.empty(b, block_size, dtype=torch.int64, device=device),
               torch.empty(b, dtype=torch.int64, device=device))
    if b > 0:
        _accept_kernel[(b,)](
            draft_tokens.contiguous(),
            target_tokens.contiguous(),
            seq_lens.contiguous(),
            out[0],
            out[1],
            out[2],
            out[3],
            BLOCK_SIZE=block_size,
            BLOCK_P2=triton.next_power_of_2(block_size),
            num_warps=1,  # a block is <= 64 lanes: one warp per request, reductions in registers
        )
    return out[0], out[1], out[2], out[3]
