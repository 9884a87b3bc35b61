"""CUDA graphs for the decode step's `commit_kv` (draft context K/V of the verified block).

Eagerly, `commit_kv` is ~40 small kernels (context projection, one K/V GEMM for all draft layers,
k_norm, RoPE, one KV-pool store per layer) whose launch cost exceeds their GPU time. Its decode-step
shape is fixed by the batch size (`bs * block_size` rows), so it is captured once per batch size the
verify graphs were captured for and replayed; larger batches and prefill run eagerly.
"""

from __future__ import annotations

import bisect
from typing import Callable, Sequence

import torch

CommitFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]

# SGLang reserves KV slot 0 for padding: padded rows of a replay write there.
PADDING_SLOT = 0


def padded_rows(n: int, captured_rows: Sequence[int]) -> int | None:
    """The smallest captured row count >= n (sorted ``captured_rows``), or None when n exceeds them all."""
    i = bisect.bisect_left(captured_rows, n)
    return captured_rows[i] if i < len(captured_rows) else None


class CommitGraphs:
    """``fn(aux [N, W], positions [N], cache_loc [N])`` captured for N in ``bs * block_size`` (bs in ``batch_sizes``).

    A call with n rows copies its inputs into static buffers, points rows n.. of the chosen graph at the padding
    slot and replays it; n beyond the largest capture runs ``fn`` eagerly.
    """

    def __init__(self, fn: CommitFn, batch_sizes: Sequence[int], block_size: int, width: int,
                 dtype: torch.dtype, loc_dtype: torch.dtype, device: torch.device):
        self.fn = fn
        self.rows = sorted({int(bs) * block_size for bs in batch_sizes})
        n_max = self.rows[-1]
        self.aux = torch.zeros((n_max, width), dtype=dtype, device=device)
        self.positions = torch.zeros((n_max,), dtype=torch.int64, device=device)
        self.cache_loc = torch.full((n_max,), PADDING_SLOT, dtype=loc_dtype, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (JIT, workspaces) outside capture
            fn(self.aux, self.positions, self.cache_loc)
        torch.cuda.current_stream(device).wait_stream(side)
        pool = None
        for n in reversed(self.rows):  # largest first: the smaller ones reuse its memory pool
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                fn(self.aux[:n], self.positions[:n], self.cache_loc[:n])
            pool = graph.pool()
            self.graphs[n] = graph

    def __call__(self, aux: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor) -> None:
        n = aux.shape[0]
        m = padded_rows(n, self.rows)
        if m is None:
            self.fn(aux, positions, cache_loc)
            return
        self.aux[:n].copy_(aux)
        self.positions[:n].copy_(positions)
        self.cache_loc[:n].copy_(cache_loc)
        if m > n:
            self.cache_loc[n:m].fill_(PADDING_SLOT)
        self.graphs[m].replay()
