"""The DFlash draft model as an SGLang model class, run by a draft `ModelRunner`.

Weights, projections, norms, RoPE and MLP are the core `DFlashDraftModel`; this class
only routes each layer's attention through SGLang's `RadixAttention`, whose KV pool
is indexed by the same token slots as the target's. Two entry points:

* `forward(...)`: one block per request (TARGET_VERIFY-shaped batch). Block K/V are
  written at the verify slots; queries attend to [context ; block] with no causal
  mask inside the block (ENCODER_ONLY layers).
* `write_context_kv(aux_hidden, positions, cache_loc)`: context K/V of committed
  tokens, computed from the target's captured hidden states and written at their
  slots -- so a radix-cache prefix hit serves the draft as well as the target.
"""

from __future__ import annotations

from typing import Iterable, Tuple

import torch
from torch import nn

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.layers.radix_attention import AttentionType, RadixAttention
from sglang.srt.model_executor.forward_batch_info import ForwardBatch

from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.model import DFlashDraftModel, check_draft_state, rope_cos_sin


class SGLangDFlashDraft(nn.Module):
    """SGLang-loadable wrapper; `config` is the draft's HF config (z-lab format)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__()
        if quant_config is not None:
            raise ValueError("sglang-dflash: quantized DFlash drafts are not supported; use a bf16/fp16 draft.")
        self.config = config
        self.dcfg = DFlashDraftConfig.from_dict(config.to_dict())
        self.core = DFlashDraftModel(self.dcfg)
        c = self.dcfg
        self.attn = nn.ModuleList(
            [
                RadixAttention(
                    num_heads=c.num_attention_heads,
                    head_dim=c.head_dim,
                    scaling=c.head_dim**-0.5,
                    num_kv_heads=c.num_key_value_heads,
                    layer_id=i,
                    sliding_window_size=(
                        c.sliding_window - 1 if c.layer_types[i] == "sliding_attention" else -1
                    ),
                    attn_type=AttentionType.ENCODER_ONLY,
                )
                for i in range(c.num_hidden_layers)
            ]
        )

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
        """input_embeds [N, H] (target embeddings of the block) -> hidden [N, H]."""
        if input_embeds is None:
            raise ValueError("sglang-dflash draft forward needs input_embeds (the target's embeddings).")
        h = input_embeds.to(self.core.dtype)
        rope = rope_cos_sin(positions.long()[None], self.core.inv_freq(h.device), h.dtype)
        for layer, attn in zip(self.core.layers, self.attn):
            q, k, v = layer.self_attn.qkv(layer.input_layernorm(h)[None], rope)
            o = attn(q[0].flatten(1), k[0].flatten(1), v[0].flatten(1), forward_batch)
            h = h + layer.self_attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return LogitsProcessorOutput(next_token_logits=None, hidden_states=self.core.norm(h))

    @torch.no_grad()
    def write_context_kv(
        self, aux_hidden: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor, kv_pool
    ) -> None:
        """aux_hidden [N, n_ids*H], positions [N], cache_loc [N] -> draft KV at those slots."""
        if aux_hidden.shape[0] == 0:
            return
        ctx = self.core.project_context(aux_hidden.to(self.core.fc.weight.dtype))
        for i, (k, v) in enumerate(self.core.context_kv(ctx[None], positions[None].long())):
            kv_pool.set_kv_buffer(self.attn[i], cache_loc, k[0], v[0])

    def load_weights(self, weights: Iterable[Tuple[str, torch.Tensor]]) -> None:
        """Load through the core's checks; extra tensors (e.g. rotary caches of some exports) are ignored."""
        expected = self.core.state_dict()
        state = {k: w for k, w in ((n.removeprefix("model."), w) for n, w in weights) if k in expected}
        check_draft_state(self.core, state, self.config.name_or_path or "draft")
        self.core.load_state_dict(state)


EntryClass = [SGLangDFlashDraft]
