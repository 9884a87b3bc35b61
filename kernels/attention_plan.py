"""FlashInfer's split-kv prefill plan for the verify block, computed on the device.

FlashInfer plans a batch on the host (``PrefillSplitQOKVIndptr`` in ``attention/scheduler.cuh``): it
needs every request's kv length there, so a decode step could only be planned after the previous
step's committed lengths reached the host. For the DFlash block (``block_size`` query rows per
request, paged kv of ``seq_lens + block_size`` tokens, page size 1, CUDA-graph mode, no sliding
window) this kernel writes the same plan into the wrapper's int workspace from ``seq_lens`` on the
device, inside the step's CUDA graph:

* kv chunk size ``S``: the smallest ``S >= min_kv_chunk`` (binary search up to the longest kv) with
  ``sum_i tiles_q * ceil(kv_i / S) <= max_batch_size_if_split``; ``n_i = ceil(max(kv_i, 1) / S)``;
* work items ``(request, q_tile, kv_tile)`` in request-major order, one per CTA of the captured grid of
  ``padded_batch_size``; items past the last are masked out by ``block_valid_mask``;
* ``o_indptr[i] = block_size * sum_{k<i} n_k`` (the partial outputs), ``merge_indptr[r]`` for the
  ``bs * block_size + 1`` row boundaries (row ``t`` of request ``i`` merges ``n_i`` partials).

The capture-time plan fixes everything else (grid size, ``cta_tile_q``, workspace offsets, total rows).

The same kernel writes FlashInfer's *decode* plan (``DecodePlan``, CUDA-graph mode, CUDA-core decode kernel) for one
new token per request (`decode_plan`): one query row and one q tile per request, and the captured grid
``max_grid_size // num_kv_heads`` as the item budget (FlashInfer splits while ``items * num_kv_heads >
max_grid_size``); where FlashInfer planned no split (``bs * num_kv_heads >= max_grid_size``) a chunk no kv length
reaches gives its one item per request.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sglang_dflash.kernels import use_triton

__all__ = ["split_kv_plan_ref", "split_kv_plan", "decode_plan_ref", "decode_plan"]

NO_SPLIT_CHUNK = 1 << 30  # a kv chunk no request reaches: one work item per request


def _ceil_div(a, b):
    return (a + b - 1) // b


def split_kv_plan_ref(seq_lens: torch.Tensor, block_size: int, tiles_q: int, max_batch_size_if_split: int,
                      padded_batch_size: int, min_kv_chunk: int) -> dict[str, torch.Tensor]:
    """Pure-torch specification (FlashInfer's host rule for this layout).

    Args:
        seq_lens: ``[bs]`` int64 committed tokens per request (kv length = seq_lens + block_size).
        block_size: query rows per request.
        tiles_q: q tiles per request (``ceil(block_size * gqa_group / cta_tile_q)``).
        max_batch_size_if_split: FlashInfer's CTA budget (``2 * num_SMs // num_kv_heads``).
        padded_batch_size: the captured grid (>= the number of work items).
        min_kv_chunk: smallest kv chunk (``128 // page_size``).

    Returns int32 tensors: request_indices, qo_tile_indices, kv_tile_indices ``[padded_batch_size]`` (0 past the
    last item), o_indptr ``[bs + 1]``, merge_indptr ``[bs * block_size + 1]``, kv_chunk_size ``[1]``, and uint8
    block_valid_mask ``[padded_batch_size]``.
    """
    kv = [max(int(s) + block_size, 1) for s in seq_lens.tolist()]
    low, high = min_kv_chunk, max(kv + [1])
    while low < high:
        mid = (low + high) // 2
        if sum(tiles_q * _ceil_div(k, mid) for k in kv) > max_batch_size_if_split:
            low = mid + 1
        else:
            high = mid
    chunks = [_ceil_div(k, low) for k in kv]
    items = [(i, q, c) for i, n in enumerate(chunks) for q in range(tiles_q) for c in range(n)]
    if len(items) > padded_batch_size:
        raise ValueError(f"{len(items)} work items exceed the captured grid of {padded_batch_size}")
    pad = [(0, 0, 0)] * (padded_batch_size - len(items))
    req, qt, kt = (torch.tensor([it[j] for it in items + pad], dtype=torch.int32) for j in range(3))
    o_indptr = torch.tensor([0] + [block_size * n for n in chunks], dtype=torch.int64).cumsum(0)
    merge = [0]
    for n in chunks:
        merge += [merge[-1] + n * (t + 1) for t in range(block_size)]
    return dict(request_indices=req, qo_tile_indices=qt, kv_tile_indices=kt, o_indptr=o_indptr.to(torch.int32),
                merge_indptr=torch.tensor(merge, dtype=torch.int32),
                kv_chunk_size=torch.tensor([low], dtype=torch.int32),
                block_valid_mask=(torch.arange(padded_batch_size) < len(items)).to(torch.uint8))


@triton.jit
def _split_kv_plan_kernel(seq_lens_ptr, scratch_ptr, req_ptr, qtile_ptr, kvtile_ptr, o_indptr_ptr, merge_ptr,
                          valid_ptr, chunk_ptr, bs, padded, max_items, min_chunk,
                          BLOCK_SIZE: tl.constexpr, TILES_Q: tl.constexpr, BS_P2: tl.constexpr,
                          LOG2_BS: tl.constexpr, ITEMS_BLOCK: tl.constexpr, ROWS_BLOCK: tl.constexpr):
    """One program: the binary search and the per-request sums in registers, then the item and row arrays
    through a per-request scratch (request starts and chunk counts)."""
    i = tl.arange(0, BS_P2)
    live = i < bs
    kv = tl.maximum(tl.load(seq_lens_ptr + i, mask=live, other=0).to(tl.int32) + BLOCK_SIZE, 1)
    kv = tl.where(live, kv, 0)
    low = min_chunk
    high = tl.maximum(tl.max(kv, axis=0), 1)
    while low < high:
        mid = (low + high) // 2
        items = tl.sum(TILES_Q * ((kv + mid - 1) // mid), axis=0)
        over = items > max_items
        low = tl.where(over, mid + 1, low)
        high = tl.where(over, high, mid)
    n = tl.where(live, (kv + low - 1) // low, 0)
    ends = tl.cumsum(TILES_Q * n, axis=0)  # inclusive: items of requests 0..i
    total = tl.sum(TILES_Q * n, axis=0)
    o_start = tl.cumsum(BLOCK_SIZE * n, axis=0) - BLOCK_SIZE * n
    tl.store(chunk_ptr, low)
    tl.store(o_indptr_ptr + i, o_start, mask=live)
    tl.store(o_indptr_ptr + bs, tl.sum(BLOCK_SIZE * n, axis=0))
    tl.store(scratch_ptr + i, ends, mask=live)
    tl.store(scratch_ptr + BS_P2 + i, n, mask=live)
    tl.store(scratch_ptr + 2 * BS_P2 + i, o_start, mask=live)
    tl.debug_barrier()

    for j0 in range(0, padded, ITEMS_BLOCK):
        j = j0 + tl.arange(0, ITEMS_BLOCK)
        in_grid = j < padded
        # request of item j: the first r with ends[r] > j (binary search over the inclusive ends)
        lo = tl.zeros([ITEMS_BLOCK], dtype=tl.int32)
        hi = tl.zeros([ITEMS_BLOCK], dtype=tl.int32) + bs
        for _ in tl.static_range(LOG2_BS):
            active = lo < hi
            mid = (lo + hi) // 2
            e = tl.load(scratch_ptr + mid, mask=active, other=0)
            right = active & (e <= j)
            lo = tl.where(right, mid + 1, lo)
            hi = tl.where(active & ~right, mid, hi)
        valid = in_grid & (j < total)
        r = tl.where(valid, lo, 0)
        nr = tl.load(scratch_ptr + BS_P2 + r, mask=valid, other=1)
        start = tl.load(scratch_ptr + r, mask=valid, other=0) - TILES_Q * nr
        w = j - start
        tl.store(req_ptr + j, r, mask=in_grid)
        tl.store(qtile_ptr + j, tl.where(valid, w // nr, 0), mask=in_grid)
        tl.store(kvtile_ptr + j, tl.where(valid, w % nr, 0), mask=in_grid)
        tl.store(valid_ptr + j, valid.to(tl.uint8), mask=in_grid)

    rows = bs * BLOCK_SIZE
    for r0 in range(0, rows + 1, ROWS_BLOCK):
        row = r0 + tl.arange(0, ROWS_BLOCK)
        req = tl.minimum(row // BLOCK_SIZE, bs - 1)
        t = row - req * BLOCK_SIZE  # BLOCK_SIZE for the end boundary (row == rows)
        nr = tl.load(scratch_ptr + BS_P2 + req, mask=row <= rows, other=0)
        o = tl.load(scratch_ptr + 2 * BS_P2 + req, mask=row <= rows, other=0)
        tl.store(merge_ptr + row, o + t * nr, mask=row <= rows)


def split_kv_plan(seq_lens: torch.Tensor, block_size: int, tiles_q: int, max_batch_size_if_split: int,
                  padded_batch_size: int, min_kv_chunk: int, out: dict[str, torch.Tensor],
                  scratch: torch.Tensor) -> None:
    """Write the plan of :func:`split_kv_plan_ref` into ``out`` (same keys; int32 views into FlashInfer's int
    workspace, block_valid_mask uint8) in one launch, without a host sync. ``scratch``: int32, at least
    ``3 * next_power_of_2(bs)`` long."""
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int64:
        raise ValueError(f"seq_lens must be a 1-D int64 tensor [bs], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    bs = seq_lens.shape[0]
    if bs == 0:
        raise ValueError("split_kv_plan needs at least one request")
    if tiles_q * bs > padded_batch_size:
        raise ValueError(f"{bs} requests x {tiles_q} q tiles exceed the captured grid of {padded_batch_size}")
    sizes = dict(request_indices=padded_batch_size, qo_tile_indices=padded_batch_size,
                 kv_tile_indices=padded_batch_size, o_indptr=bs + 1, merge_indptr=bs * block_size + 1,
                 kv_chunk_size=1, block_valid_mask=padded_batch_size)
    for name, size in sizes.items():
        t = out.get(name)
        dtype = torch.uint8 if name == "block_valid_mask" else torch.int32
        if not isinstance(t, torch.Tensor) or t.dtype != dtype or t.shape != (size,) or t.device != seq_lens.device:
            raise ValueError(f"out[{name!r}] must be a {dtype} tensor of shape ({size},) on {seq_lens.device}")
    bs_p2 = triton.next_power_of_2(bs)
    if scratch.dtype != torch.int32 or scratch.numel() < 3 * bs_p2:
        raise ValueError(f"scratch must be int32 with at least {3 * bs_p2} entries")
    if not use_triton(seq_lens.device):
        for name, t in split_kv_plan_ref(seq_lens, block_size, tiles_q, max_batch_size_if_split, padded_batch_size,
                                         min_kv_chunk).items():
            out[name].copy_(t)
        return
    _split_kv_plan_kernel[(1,)](
        seq_lens, scratch, out["request_indices"], out["qo_tile_indices"], out["kv_tile_indices"], out["o_indptr"],
        out["merge_indptr"], out["block_valid_mask"], out["kv_chunk_size"], bs, padded_batch_size,
        max_batch_size_if_split, min_kv_chunk, BLOCK_SIZE=block_size, TILES_Q=tiles_q, BS_P2=bs_p2,
        LOG2_BS=bs_p2.bit_length() + 1, ITEMS_BLOCK=128, ROWS_BLOCK=1024, num_warps=4)


def decode_plan_ref(seq_lens: torch.Tensor, max_grid_size: int, num_kv_heads: int, split_kv: bool,
                    min_kv_chunk: int) -> dict[str, torch.Tensor]:
    """Pure-torch specification of FlashInfer's decode plan (``DecodePlan`` with ``enable_cuda_graph``, page size 1;
    ``PartitionPagedKVCacheBinarySearchMinNumPagePerBatch`` and ``DecodeSplitKVIndptr`` in
    ``attention/scheduler.cuh``) for one new token per request.

    Args:
        seq_lens: ``[bs]`` int64 committed tokens per request (kv length = seq_lens + 1).
        max_grid_size: the decode kernel's CTAs resident at once (blocks per SM x SMs).
        num_kv_heads: the grid's second dimension.
        split_kv: FlashInfer's choice at capture (``bs * num_kv_heads < max_grid_size``).
        min_kv_chunk: smallest kv chunk (``128 // page_size``).

    Returns int32 tensors request_indices, kv_tile_indices ``[padded]`` (0 past the last item), o_indptr ``[bs + 1]``,
    kv_chunk_size ``[1]`` and uint8 block_valid_mask ``[padded]``, where padded = ``max_grid_size // num_kv_heads``
    with split kv, else bs (one item per request; kv_chunk_size and block_valid_mask are then not read).
    """
    kv = [max(int(s) + 1, 1) for s in seq_lens.tolist()]
    if split_kv:
        padded, low, high = max_grid_size // num_kv_heads, min_kv_chunk, max(kv + [1])
        while low < high:
            mid = (low + high) // 2
            if sum(_ceil_div(k, mid) for k in kv) * num_kv_heads > max_grid_size:
                low = mid + 1
            else:
                high = mid
    else:
        padded, low = len(kv), NO_SPLIT_CHUNK
    chunks = [_ceil_div(k, low) for k in kv]
    items = [(i, c) for i, n in enumerate(chunks) for c in range(n)]
    if len(items) > padded:
        raise ValueError(f"{len(items)} work items exceed the captured grid of {padded}")
    pad = [(0, 0)] * (padded - len(items))
    req, kt = (torch.tensor([it[j] for it in items + pad], dtype=torch.int32) for j in range(2))
    return dict(request_indices=req, kv_tile_indices=kt,
                o_indptr=torch.tensor([0] + chunks, dtype=torch.int64).cumsum(0).to(torch.int32),
                kv_chunk_size=torch.tensor([low], dtype=torch.int32),
                block_valid_mask=(torch.arange(padded) < len(items)).to(torch.uint8))


def decode_plan(seq_lens: torch.Tensor, padded_batch_size: int, split_kv: bool, min_kv_chunk: int,
                out: dict[str, torch.Tensor], scratch: torch.Tensor) -> None:
    """Write the plan of :func:`decode_plan_ref` (grid ``padded_batch_size``) into ``out`` in one launch, without a
    host sync: `split_kv_plan`'s kernel with one query row and one q tile per request. ``out`` holds
    `split_kv_plan`'s keys: decode_plan_ref's five, plus qo_tile_indices ``[padded_batch_size]`` and merge_indptr
    ``[bs + 1]`` that the decode kernel does not read."""
    split_kv_plan(seq_lens, 1, 1, padded_batch_size, padded_batch_size, min_kv_chunk if split_kv else NO_SPLIT_CHUNK,
                  out, scratch)
