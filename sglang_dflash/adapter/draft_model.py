"""The DFlash draft model as an SGLang model class, run by a draft `ModelRunner`.

Weights and math are the core `DFlashDraftModel`'s; this class routes each layer's attention
through SGLang's `RadixAttention`, whose KV pool is indexed by the same token slots as the
target's, and runs the rest in few launches: fused q/k/v and gate/up GEMMs (the core's Linear
weights are views into them) and the fused ops of `sglang_dflash.kernels.draft_layers`. The
fused tables are built when the weights are loaded, on their device. Two entry points:

* `forward(...)`: one block per request (TARGET_VERIFY-shaped batch). Block K/V are
  written at the verify slots; queries attend to [context ; block] as z-lab's layer
  types say (`DFlashDraftConfig.layer_attention`): bidirectional layers run as
  ENCODER_ONLY, causal ones (sliding layers by default) as DECODER, sliding layers
  with their window. The backend applies the window: SGLang's torch_native on CPU
  (exact), its sliding-window wrappers on GPU (`get_attention_sliding_window_size`).
* `write_context_kv(aux_hidden, positions, cache_loc)`: context K/V of committed
  tokens, computed from the target's captured hidden states and written at their
  slots -- so a radix-cache prefix hit serves the draft as well as the target.

`capture_target_layers` makes the target return the hidden states ``write_context_kv`` reads.

Under tensor parallelism the draft is sharded with the target's TP group (`tp.DraftShard`): ``core`` is this
rank's slice (its heads and intermediate rows; ``core.cfg`` the local shapes, ``dcfg`` the whole draft's), and
o_proj / down_proj outputs are all-reduced.
"""

from __future__ import annotations

from typing import Iterable, Tuple

import torch
import torch.nn.functional as F
from torch import nn

from sglang.srt.distributed import tensor_model_parallel_all_reduce
from sglang.srt.distributed.parallel_state import model_parallel_is_initialized
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch
from sglang.srt.runtime_context import get_parallel

from sglang_dflash.adapter import hybrid
from sglang_dflash.adapter.tp import DraftShard
from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.kernels.draft_layers import norm_rope, rms_norm, silu_mul
from sglang_dflash.model import DFlashDraftModel, check_draft_state, rope_cos_sin


class SGLangDFlashDraft(nn.Module):
    """SGLang-loadable wrapper; `config` is the draft's HF config (z-lab format)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("sglang-dflash: quantized DFlash drafts are not supported; use a bf16/fp16 draft.")
        self.config = config
        self.dcfg = DFlashDraftConfig.from_dict(config.to_dict())
        # this rank's slice under SGLang's TP group (the whole draft where none is initialized, e.g. outside a server)
        rank, size = (get_parallel().tp_rank, get_parallel().tp_size) if model_parallel_is_initialized() else (0, 1)
        self.shard = DraftShard.of(self.dcfg, rank, size)
        self.core = DFlashDraftModel(self.shard.local_config(self.dcfg))
        c = self.core.cfg  # this rank's head counts
        self.attn = nn.ModuleList()
        for i in range(c.num_hidden_layers):
            causal, window = c.layer_attention(i)
            if window is not None and not causal and window < c.block_size:
                raise ValueError(
                    f"sglang-dflash: draft layer {i} is a non-causal sliding layer with sliding_window={window} < "
                    f"block_size={c.block_size}; SGLang's attention backends window only the left side. Use a "
                    "window of at least the block size, or causal sliding layers."
                )
            self.attn.append(RadixAttention(
                num_heads=c.num_attention_heads, head_dim=c.head_dim, scaling=c.head_dim**-0.5,
                num_kv_heads=c.num_key_value_heads, layer_id=i,
                sliding_window_size=-1 if window is None else window - 1,  # SGLang's window excludes the query
                attn_type=AttentionType.DECODER if causal else AttentionType.ENCODER_ONLY,
            ))
        self.aux_chunks: torch.Tensor | None = None  # `read_captured_layers`
        self._fuse_weights()

    def read_captured_layers(self, captured: list[int]) -> None:
        """The target returns the hidden states of its layers ``captured`` (ascending, each once), which the draft
        reads in ``target_layer_ids`` order, repeats included (z-lab concatenates them so): when the two differ,
        `write_context_kv` gathers its input's chunks by ``aux_chunks`` [len(target_layer_ids)]."""
        ids = list(self.dcfg.target_layer_ids)
        self.aux_chunks = None if ids == captured else torch.tensor(
            [captured.index(i) for i in ids], device=self.ctx_kv_weight.device)

    def _fuse_weights(self) -> None:
        """Lay the weights out for few launches per layer: q/k/v and gate/up become row slices of one matrix
        per layer (the core's Linear weights are views into it, so nothing is duplicated), the q/k norm weights a
        per-head table, and every layer's context K/V projection one matrix [all layers' K ; all layers' V] with
        its own per-head k-norm table (copies: the context path projects all layers in one GEMM)."""
        c, layers = self.core.cfg, self.core.layers
        hq, hkv, d = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.qkv_weight, self.gate_up_weight, self.qk_norm_weight = [], [], []
        for layer in layers:
            a, mlp = layer.self_attn, layer.mlp
            self.qkv_weight.append(_fused(a.q_proj, a.k_proj, a.v_proj))
            self.gate_up_weight.append(_fused(mlp.gate_proj, mlp.up_proj))
            self.qk_norm_weight.append(torch.cat([a.q_norm.weight.detach().expand(hq, d),
                                                  a.k_norm.weight.detach().expand(hkv, d)]).contiguous())
        attns = [layer.self_attn for layer in layers]
        self.ctx_kv_weight = torch.cat([a.k_proj.weight.detach() for a in attns]
                                       + [a.v_proj.weight.detach() for a in attns])
        self.ctx_k_norm_weight = torch.cat([a.k_norm.weight.detach().expand(hkv, d) for a in attns]).contiguous()

    def get_attention_sliding_window_size(self):
        """SGLang's window (keys before the query) when a layer slides, else None: read by the draft ModelRunner,
        which then builds sliding-window-aware attention (two FlashInfer wrappers; the decode step runs eagerly)."""
        windows = {a.sliding_window_size for a in self.attn} - {-1}
        if len(windows) > 1:
            raise ValueError(f"sglang-dflash: draft layers slide with different windows {sorted(windows)}; SGLang "
                             "serves one window per model. Use one sliding_window for every sliding layer.")
        return windows.pop() if windows else None

    def _rope(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N] -> (cos, sin) [N, D] in ``dtype`` (one table per forward, shared by every layer)."""
        cos, sin = rope_cos_sin(positions.long()[None], self.core.inv_freq(positions.device), dtype)
        return cos[0, :, 0], sin[0, :, 0]

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        forward_batch: ForwardBatch,
        input_embeds: torch.Tensor = None,
        get_embedding: bool = False,
        pp_proxy_tensors=None,
    ) -> LogitsProcessorOutput:
        """input_embeds [N, H] (target embeddings of the block) -> hidden [N, H].

        Per layer: add+RMSNorm, one qkv GEMM, one q/k norm+RoPE launch, attention, o_proj, add+RMSNorm, one
        gate/up GEMM, SiLU-and-mul, down_proj (the core's math; `sglang_dflash.kernels.draft_layers`)."""
        if input_embeds is None:
            raise ValueError("sglang-dflash draft forward needs input_embeds (the target's embeddings).")
        c = self.core.cfg
        n, d = input_embeds.shape[0], c.head_dim
        q_width, qk_heads = c.num_attention_heads * d, c.num_attention_heads + c.num_key_value_heads
        x = input_embeds.to(self.core.dtype)
        if c.input_embedding_scale != 1.0:
            x = x * c.input_embedding_scale
        cos, sin = self._rope(positions, x.dtype)
        residual = None
        for i, (layer, attn) in enumerate(zip(self.core.layers, self.attn)):
            h, residual = rms_norm(x, layer.input_layernorm.weight, layer.input_layernorm.eps, residual)
            qkv = F.linear(h, self.qkv_weight[i])
            norm_rope(qkv[:, : qk_heads * d].view(n, qk_heads, d), self.qk_norm_weight[i], cos, sin,
                      layer.self_attn.q_norm.eps)
            q, k, v = qkv.split([q_width, qk_heads * d - q_width, qkv.shape[1] - qk_heads * d], dim=1)
            o = attn(q, k, v, forward_batch)
            h, residual = rms_norm(self._reduce(layer.self_attn.o_proj(o)), layer.post_attention_layernorm.weight,
                                   layer.post_attention_layernorm.eps, residual)
            x = self._reduce(layer.mlp.down_proj(silu_mul(F.linear(h, self.gate_up_weight[i]))))
        hidden, _ = rms_norm(x, self.core.norm.weight, self.core.norm.eps, residual)
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=hidden)

    @torch.no_grad()
    def write_context_kv(
        self, aux_hidden: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor, kv_pool
    ) -> None:
        """aux_hidden [N, n_captured*H] (`read_captured_layers`), positions [N], cache_loc [N] -> draft KV at
        those slots: fc + hidden_norm, one GEMM for every layer's K and V, one k-norm+RoPE launch over every
        layer's K heads."""
        n = aux_hidden.shape[0]
        if n == 0:
            return
        core, c = self.core, self.core.cfg
        if self.aux_chunks is not None:
            aux_hidden = aux_hidden.view(n, -1, c.hidden_size)[:, self.aux_chunks].flatten(1)
        hkv, d, layers = c.num_key_value_heads, c.head_dim, c.num_hidden_layers
        ctx, _ = rms_norm(F.linear(aux_hidden.to(core.fc.weight.dtype), core.fc.weight), core.hidden_norm.weight,
                          core.hidden_norm.eps)
        kv = F.linear(ctx, self.ctx_kv_weight)  # [N, 2 * layers * hkv * d]: every layer's K, then every V
        k = kv[:, : layers * hkv * d].view(n, layers * hkv, d)
        v = kv[:, layers * hkv * d :].view(n, layers * hkv, d)
        cos, sin = self._rope(positions, k.dtype)
        norm_rope(k, self.ctx_k_norm_weight, cos, sin, core.layers[0].self_attn.k_norm.eps)
        for i, attn in enumerate(self.attn):
            kv_pool.set_kv_buffer(attn, cache_loc, k[:, i * hkv : (i + 1) * hkv], v[:, i * hkv : (i + 1) * hkv])

    def _reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum a row-parallel layer's partial outputs over the TP group (identity on one rank)."""
        return x if self.shard.size == 1 else tensor_model_parallel_all_reduce(x)

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load through the core's checks (against the whole draft's shapes), then keep this rank's slice; extra
        tensors (e.g. rotary caches of some exports) are ignored."""
        expected = self.core.state_dict()
        state = {k: w for k, w in ((n.removeprefix("model."), w) for n, w in weights) if k in expected}
        if self.shard.size == 1:
            full = self.core
        else:
            with torch.device("meta"):
                full = DFlashDraftModel(self.dcfg)
        check_draft_state(full, state, self.config.name_or_path or "draft")
        self.core.load_state_dict(self.shard.slice_state(state, self.dcfg.head_dim))
        self._fuse_weights()


def _fused(*linears: nn.Linear) -> torch.Tensor:
    """The Linears' weights stacked by rows into one matrix; each Linear's weight becomes a view into it."""
    fused = torch.cat([lin.weight.detach() for lin in linears])
    start = 0
    for lin in linears:
        rows = lin.weight.shape[0]
        lin.weight.data = fused[start : start + rows]
        start += rows
    return fused


def capture_target_layers(target, layer_ids: list[int], num_layers: int) -> list[int]:
    """Make the ``target`` model (``num_layers`` layers) return with its logits the hidden states after its layers
    ``layer_ids``, which the draft reads (`SGLangDFlashDraft.write_context_kv`'s ``aux_hidden``). SGLang's models
    return them in layer order, each layer once: returns that order (`SGLangDFlashDraft.read_captured_layers`)."""
    hybrid.add_dflash_capture(target)
    if not hasattr(target, "set_dflash_layers_to_capture"):
        raise ValueError(
            f"sglang-dflash: target architecture {type(target).__name__} cannot expose the hidden "
            "states of intermediate layers (no set_dflash_layers_to_capture). Use a Llama/Qwen-family target."
        )
    if max(layer_ids) >= num_layers - 1:
        raise ValueError(
            f"sglang-dflash: draft target_layer_ids {layer_ids} include the target's last layer "
            f"({num_layers - 1}); SGLang captures hidden states before a layer runs, so the last layer's output "
            "cannot be captured. Use a draft trained on earlier layers."
        )
    captured = sorted(set(layer_ids))
    target.set_dflash_layers_to_capture(captured)
    return captured


EntryClass = [SGLangDFlashDraft]

