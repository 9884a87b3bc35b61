"""DFLASH's CPU extend attention (`sglang_dflash.adapter.cpu_attention.DFlashCPUAttnBackend.forward_extend`) against
a plain softmax over the keys each query may see: verify blocks of several tokens, width-1 steps (one query that
sees every key, run without a mask like SGLang's decode attention), sliding windows shorter and longer than the
context, grouped-query heads, odd lengths."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from sglang.srt.layers.radix_attention import AttentionType

from sglang_dflash.adapter.cpu_attention import DFlashCPUAttnBackend

HQ, HKV, D, SLOTS = 6, 2, 8, 200


class _Pool:
    def __init__(self, g):
        self.k = torch.randn(SLOTS, HKV, D, generator=g)
        self.v = torch.randn(SLOTS, HKV, D, generator=g)

    def set_kv_buffer(self, layer, loc, k, v):
        self.k[loc.loc], self.v[loc.loc] = k, v

    def get_key_buffer(self, layer_id):
        return self.k

    def get_value_buffer(self, layer_id):
        return self.v


def _backend(g, req_to_token):
    backend = object.__new__(DFlashCPUAttnBackend)  # its runner-free parts: the pools and the row table
    backend.token_to_kv_pool, backend.swa_out_cache_loc = _Pool(g), None
    backend.req_to_token_pool = SimpleNamespace(req_to_token=req_to_token)
    return backend


def reference(q, keys, values, q_pos, window):
    """Causal softmax attention of queries at ``q_pos`` over keys at 0 .. len-1 (window: q - k < window)."""
    k_pos = torch.arange(keys.shape[0])
    seen = (k_pos[None] <= q_pos[:, None]) & ((q_pos[:, None] - k_pos[None] < window) if window else True)
    rep = HQ // HKV
    scores = torch.einsum("qhd,khd->hqk", q, keys.repeat_interleave(rep, 1)) * D ** -0.5
    probs = scores.masked_fill(~seen[None], float("-inf")).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, values.repeat_interleave(rep, 1))


@pytest.mark.parametrize("window", [None, 5, 64])
@pytest.mark.parametrize("new", [[1, 1, 1], [3, 1, 4]])
def test_verify_attention_matches_softmax_over_visible_keys(new, window):
    g = torch.Generator().manual_seed(len(new) + sum(new) + (window or 0))
    prefix = [6, 17, 1]
    req_to_token = torch.randperm(SLOTS - 1, generator=g)[: 3 * 40].view(3, 40) + 1
    backend = _backend(g, req_to_token)
    rows = torch.tensor([2, 0, 1])
    n_total = sum(new)
    q = torch.randn(n_total, HQ * D, generator=g)
    k, v = torch.randn(n_total, HKV, D, generator=g), torch.randn(n_total, HKV, D, generator=g)
    out_loc = torch.cat([req_to_token[r, p : p + n] for r, p, n in zip(rows.tolist(), prefix, new)])
    layer = SimpleNamespace(is_cross_attention=False, qk_head_dim=D, v_head_dim=D, attn_type=AttentionType.DECODER,
                            sliding_window_size=None if window is None else window - 1, layer_id=0,
                            tp_q_head_num=HQ, tp_k_head_num=HKV, scaling=D ** -0.5)
    fb = SimpleNamespace(encoder_lens=None, forward_mode=SimpleNamespace(is_target_verify=lambda: True),
                         out_cache_loc=out_loc, req_pool_indices=rows, batch_size=3,
                         seq_lens=torch.tensor([p + n for p, n in zip(prefix, new)]),
                         extend_seq_lens_cpu=new, extend_prefix_lens_cpu=prefix)
    out = backend.forward_extend(q, k, v, layer, fb).view(n_total, HQ, D)
    start = 0
    for r, p, n in zip(rows.tolist(), prefix, new):
        slots = req_to_token[r, : p + n]
        want = reference(q[start : start + n].view(n, HQ, D), backend.token_to_kv_pool.k[slots],
                         backend.token_to_kv_pool.v[slots], torch.arange(p, p + n), window)
        torch.testing.assert_close(out[start : start + n], want, atol=1e-5, rtol=1e-5)
        start += n
