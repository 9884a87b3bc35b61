"""Extend attention for DFLASH's runners on CPU: only the new queries, each layer masked as it is defined.

SGLang's `TorchNativeAttnBackend` runs an extend of ``n`` new tokens over a ``seq_len``-token request as a
``seq_len``-query attention (the earlier rows are padding), so a 16-token verify at a long context costs a
prefill, and it windows only causal layers. `DFlashCPUAttnBackend` computes a verify block's ``n`` new queries
alone, with the visibility rule of `sglang_dflash.model.attention_mask` (causal for DECODER layers, the layer's
window for sliding layers: z-lab's draft semantics, and a causal window for targets). Prefill chunks of causal
layers (SGLang's fused causal kernel is faster there than masked rows), decode, cross attention and encoder
batches go to the base class unchanged. It is installed on the DFLASH worker's target and draft runners
only (`install`); a no-spec server keeps SGLang's backend.

A sliding-window target (Gemma 4) keeps its sliding layers' K/V in the sliding-window half of SGLang's `SWAKVPool`,
at slots of its own; ``req_to_token`` holds the full pool's. SGLang's `TorchNativeAttnBackend` writes there (through
the translated ``swa_out_cache_loc``) but reads at the untranslated slots. `swa_rows` translates them for every
read: here, and in SGLang's own backend through the CPU set-up's hooks (`cpu_platform`), for no-spec servers too.
"""

from __future__ import annotations

import torch
from torch.nn.functional import scaled_dot_product_attention

from sglang.srt.layers.attention.torch_native_backend import TorchNativeAttnBackend
from sglang.srt.layers.radix_attention import AttentionType
from sglang.srt.mem_cache.memory_pool import KVWriteLoc
from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

from sglang_dflash.adapter.hybrid import full_attention_backend
from sglang_dflash.model import attention_mask


QUERY_CHUNK = 256  # query rows per attention call: bounds the explicit-mask scores of a long prefill


class DFlashCPUAttnBackend(TorchNativeAttnBackend):
    """`TorchNativeAttnBackend` whose extend attends from the new tokens only."""

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        """q ``[N, Hq*D]`` (N = sum of extend lengths), k/v ``[N, Hkv, D]`` -> o ``[N, Hq*D]``; k/v written at
        ``out_cache_loc`` first. Request i's queries sit at positions ``extend_prefix_lens[i] + arange(n_i)`` and
        see its keys ``0 .. seq_lens[i] - 1`` as `attention_mask` allows."""
        if layer.is_cross_attention or forward_batch.encoder_lens is not None or layer.qk_head_dim != layer.v_head_dim:
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if not forward_batch.forward_mode.is_target_verify() and layer.attn_type != AttentionType.ENCODER_ONLY:
            # a prefill chunk of a causal layer: SGLang's own causal kernel is faster than masked rows here
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache and k is not None and v is not None:
            self.token_to_kv_pool.set_kv_buffer(
                layer, KVWriteLoc(forward_batch.out_cache_loc, self.swa_out_cache_loc), k, v)
        causal = layer.attn_type != AttentionType.ENCODER_ONLY
        window = layer.sliding_window_size + 1 if layer.sliding_window_size is not None \
            and layer.sliding_window_size > -1 else None
        k_cache = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        v_cache = self.token_to_kv_pool.get_value_buffer(layer.layer_id)
        q = q.view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        o = torch.empty_like(q)
        req_to_token, req_rows = swa_rows(self.token_to_kv_pool, k_cache, self.req_to_token_pool.req_to_token,
                                          forward_batch.req_pool_indices, forward_batch.seq_lens)
        start = 0
        for i in range(forward_batch.batch_size):
            n = int(forward_batch.extend_seq_lens_cpu[i])
            prefix = int(forward_batch.extend_prefix_lens_cpu[i])
            kv_len = prefix + n
            slots = req_to_token[req_rows[i], :kv_len]
            keys = k_cache[slots].transpose(0, 1).to(q.dtype)
            values = v_cache[slots].transpose(0, 1).to(q.dtype)
            if causal and n == 1 and (window is None or kv_len <= window):
                # one query that sees every key (a width-1 step): SGLang's own decode call, 4-d and without a mask
                # (torch's CPU flash kernel; the 3-d masked call below takes the math path, ~3x slower)
                out = scaled_dot_product_attention(
                    q[start : start + 1].transpose(0, 1)[None], keys[None], values[None], scale=layer.scaling,
                    enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
                o[start : start + 1] = out[0].transpose(0, 1)
                start += 1
                continue
            k_pos = torch.arange(kv_len, device=q.device)[None]
            for c in range(0, n, QUERY_CHUNK):  # a long prefill in row chunks: scores [Hq, chunk, kv_len] at most
                rows = min(QUERY_CHUNK, n - c)
                q_pos = torch.arange(prefix + c, prefix + c + rows, device=q.device)[None]
                out = scaled_dot_product_attention(
                    q[start + c : start + c + rows].transpose(0, 1), keys, values,
                    attn_mask=attention_mask(q_pos, k_pos, causal, window), scale=layer.scaling,
                    enable_gqa=layer.tp_q_head_num != layer.tp_k_head_num)
                o[start + c : start + c + rows] = out.transpose(0, 1)
            start += n
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)


def swa_rows(pool, k_cache: torch.Tensor, req_to_token: torch.Tensor, req_pool_indices: torch.Tensor,
             seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(table, rows) such that ``table[rows[i], :seq_lens[i]]`` are request i's slots in ``k_cache``: ``req_to_token``
    and ``req_pool_indices`` [bs] unchanged, unless ``k_cache`` is a sliding-window layer's buffer of an `SWAKVPool`
    ``pool``: then the batch's rows of ``req_to_token`` up to the longest ``seq_lens`` [bs], translated to that pool's
    slots (``[bs, max_len]``; a token whose window K/V SGLang has freed maps to the pool's dummy slot 0, outside
    every window that reads it), and ``arange(bs)``."""
    if not (isinstance(pool, SWAKVPool) and k_cache.data_ptr() in {
            pool.swa_kv_pool.get_key_buffer(i).data_ptr() for i in range(pool.swa_layer_nums)}):
        return req_to_token, req_pool_indices
    bs = req_pool_indices.shape[0]
    width = int(seq_lens.max()) if bs else 0
    full = req_to_token[req_pool_indices.to(torch.int64), :width].to(torch.int64)
    return pool.translate_loc_from_full_to_swa(full), torch.arange(bs, device=req_pool_indices.device)


def install(runner) -> None:
    """Serve ``runner``'s extends with `DFlashCPUAttnBackend` (it must be a CPU runner on torch_native). A hybrid
    target's backend (``HybridLinearAttnBackend``) gets it for its full-attention layers."""
    old = full_attention_backend(runner.attn_backend)
    hybrid = old is not runner.attn_backend
    if type(old) is not TorchNativeAttnBackend:
        raise ValueError(f"sglang-dflash: the CPU runner uses {type(old).__name__}; DFLASH on CPU needs "
                         "--attention-backend torch_native.")
    new = DFlashCPUAttnBackend(runner)
    if hybrid:
        runner.attn_backend.full_attn_backend = new
        runner.attn_backend.attn_backend_list[0] = new
        return
    runner.attn_backend = new
    if runner.decode_attn_backend is old:
        runner.decode_attn_backend = new
    runner.decode_attn_backend_group = [new if b is old else b for b in runner.decode_attn_backend_group]
