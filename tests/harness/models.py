"""Tiny random checkpoints with a real tokenizer, written to disk for server tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

# Files copied from a tokenizer directory; any that are absent are skipped.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)


def copy_tokenizer(tokenizer_dir: str | Path, out_dir: str | Path) -> list[str]:
    """Copy the tokenizer files of ``tokenizer_dir`` into ``out_dir``; returns the names copied."""
    tokenizer_dir, out_dir = Path(tokenizer_dir), Path(out_dir)
    copied = [n for n in TOKENIZER_FILES if (tokenizer_dir / n).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(
            f"{tokenizer_dir} has no tokenizer.json; pass a Hugging Face model directory "
            "(e.g. sglang_dflash.assets.smollm2_path())"
        )
    out_dir.mkdir(parents=True, exist_ok=True)
    for name in copied:
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    return copied


def make_tiny_llama(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    intermediate_size: int = 128,
    init_std: float = 0.2,
) -> Path:
    """Write a random float32 ``LlamaForCausalLM`` (untied lm_head) plus tokenizer to ``out_dir``.

    ``vocab_size`` is the tokenizer's length. ``init_std`` is large on purpose: the logits of a
    0.02-init model are nearly flat, so greedy argmax would hinge on float rounding and two
    correct implementations could disagree; at 0.2 the top-1 margin is far above float32 noise.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir = Path(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        initializer_range=init_std,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        torch_dtype="float32",
    )
    gen = torch.Generator().manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _randomize(model: torch.nn.Module, seed: int, init_std: float) -> None:
    """Matrices (``dim >= 2``) N(0, ``init_std``); 1-D parameters keep the model's own init (norm weights, scalars)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen) * init_std)


def _save_random(model_cls, cfg, out_dir: Path, seed: int, init_std: float) -> Path:
    """``model_cls(cfg)`` in float32 with `_randomize`d matrices, saved to ``out_dir`` (safetensors)."""
    torch.manual_seed(seed)
    model = model_cls(cfg).to(torch.float32)
    _randomize(model, seed, init_std)
    model.config.torch_dtype = "float32"
    model.save_pretrained(out_dir, safe_serialization=True)
    return out_dir


def _layer_types(num_hidden_layers: int, full_attention_interval: int, other: str) -> list[str]:
    """``full_attention`` every ``full_attention_interval``-th layer (1-based), ``other`` elsewhere."""
    if num_hidden_layers % full_attention_interval:
        raise ValueError(f"num_hidden_layers={num_hidden_layers} is not a multiple of "
                         f"full_attention_interval={full_attention_interval}")
    return ["full_attention" if (i + 1) % full_attention_interval == 0 else other for i in range(num_hidden_layers)]


def make_tiny_qwen3_5(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    full_attention_interval: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    linear_num_key_heads: int = 2,
    linear_num_value_heads: int = 4,
    linear_head_dim: int = 16,
    intermediate_size: int = 128,
    init_std: float = 0.2,
    num_experts: int = 0,
) -> Path:
    """Write a random float32 hybrid ``Qwen3_5ForCausalLM`` (``model_type`` ``qwen3_5_text``: Gated DeltaNet
    layers with a full-attention layer every ``full_attention_interval``, dense MLPs -- the Qwen3.5 dense family,
    Qwen3-Next-shaped without the MoE) plus tokenizer to ``out_dir``. With ``num_experts`` > 0 the same layers
    carry Qwen3-Next's MoE blocks instead (``Qwen3NextForCausalLM``: top-2 of ``num_experts`` experts of
    ``intermediate_size`` plus a gated shared expert).

    The config carries both ``layer_types`` (what transformers reads) and ``full_attention_interval`` (what SGLang's
    ``Qwen3NextConfig`` derives its layer types from). Matrices (embeddings, projections, the depthwise conv) are
    N(0, ``init_std``) like :func:`make_tiny_llama`; the 1-D parameters keep transformers' init (RMSNorm weights,
    ``A_log`` = log U(0, 16), ``dt_bias`` = 1), so the recurrent decays stay in their trained range.
    """
    from transformers import (AutoTokenizer, Qwen3_5ForCausalLM, Qwen3_5TextConfig, Qwen3NextConfig,
                              Qwen3NextForCausalLM)

    layer_types = _layer_types(num_hidden_layers, full_attention_interval, "linear_attention")
    out_dir = Path(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    moe = dict(num_experts=num_experts, num_experts_per_tok=2, moe_intermediate_size=intermediate_size,
               shared_expert_intermediate_size=intermediate_size, decoder_sparse_step=1, mlp_only_layers=[],
               norm_topk_prob=True) if num_experts else {}
    config_cls, model_cls = (Qwen3NextConfig, Qwen3NextForCausalLM) if num_experts else (Qwen3_5TextConfig,
                                                                                          Qwen3_5ForCausalLM)
    cfg = config_cls(
        **moe,
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads, head_dim=head_dim, linear_num_key_heads=linear_num_key_heads,
        linear_num_value_heads=linear_num_value_heads, linear_key_head_dim=linear_head_dim,
        linear_value_head_dim=linear_head_dim, linear_conv_kernel_dim=4, layer_types=layer_types,
        max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    cfg.full_attention_interval = full_attention_interval
    cfg.architectures = [model_cls.__name__]
    return _save_random(model_cls, cfg, out_dir, seed, init_std)


def make_tiny_gemma4(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 4,
    full_attention_interval: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    head_dim: int = 16,
    hidden_size_per_layer_input: int = 16,
    sliding_window: int = 16,
    intermediate_size: int = 128,
    init_std: float = 0.2,
) -> Path:
    """Write a random float32 ``Gemma4ForCausalLM`` (``model_type`` ``gemma4_text``) plus tokenizer to ``out_dir``:
    ``sliding_attention`` layers (window ``sliding_window``) with a ``full_attention`` layer every
    ``full_attention_interval``, per-layer input embeddings of ``hidden_size_per_layer_input``, untied lm_head.
    SGLang serves it on its sliding-window KV pool (separate full and SWA pools); the config also carries the
    ``swa_num_key_value_heads`` / ``swa_head_dim`` that pool reads. Both layer types have ``head_dim`` and
    ``num_key_value_heads``: SGLang 0.5.17 reads a ``gemma4_text`` config's ``head_dim`` as the full-attention
    layers' (it swaps transformers' ``head_dim`` / ``global_head_dim`` only in the multimodal ``gemma4`` config), so a
    text-only checkpoint with a larger ``global_head_dim`` would not load there.
    Matrices N(0, ``init_std``) as :func:`make_tiny_llama` (a robust greedy argmax); 1-D parameters keep
    transformers' init."""
    from transformers import AutoTokenizer, Gemma4ForCausalLM, Gemma4TextConfig

    layer_types = _layer_types(num_hidden_layers, full_attention_interval, "sliding_attention")
    out_dir = Path(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    cfg = Gemma4TextConfig(
        vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size=hidden_size,
        intermediate_size=intermediate_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        global_head_dim=head_dim, hidden_size_per_layer_input=hidden_size_per_layer_input,
        sliding_window=sliding_window, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        layer_types=layer_types,
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    cfg.swa_num_key_value_heads, cfg.swa_head_dim = num_key_value_heads, head_dim
    cfg.architectures = ["Gemma4ForCausalLM"]
    return _save_random(Gemma4ForCausalLM, cfg, out_dir, seed, init_std)


def make_tiny_deepseek_v2(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    seed: int = 0,
    *,
    hidden_size: int = 64,
    num_hidden_layers: int = 3,
    num_attention_heads: int = 4,
    kv_lora_rank: int = 32,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 16,
    intermediate_size: int = 128,
    n_routed_experts: int = 4,
    moe_intermediate_size: int = 32,
    init_std: float = 0.2,
) -> Path:
    """Write a random float32 ``DeepseekV2ForCausalLM`` (multi-head latent attention, DeepSeek-V2-Lite's layout: no
    query LoRA, the first layer dense, the others MoE with top-2 of ``n_routed_experts`` plus a shared expert) plus
    tokenizer to ``out_dir``. RoPE is DeepSeek's YaRN (factor 4), as in DeepSeek-V2's own configs: SGLang's CPU
    rotary embedding for MLA takes no other; ``mscale_all_dim`` 0 keeps SGLang's softmax scale (which it multiplies
    by YaRN's ``mscale(mscale_all_dim)**2``) equal to transformers' (which does not). Matrices N(0, ``init_std``) as
    :func:`make_tiny_llama`; 1-D parameters keep transformers' init."""
    from transformers import AutoTokenizer, DeepseekV2Config, DeepseekV2ForCausalLM

    out_dir = Path(out_dir)
    copy_tokenizer(tokenizer_dir, out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    cfg = DeepseekV2Config(
        vocab_size=len(tok), hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers, num_attention_heads=num_attention_heads,
        num_key_value_heads=num_attention_heads, q_lora_rank=None, kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim, qk_rope_head_dim=qk_rope_head_dim, v_head_dim=v_head_dim,
        head_dim=qk_rope_head_dim, n_routed_experts=n_routed_experts, num_experts_per_tok=2,
        moe_intermediate_size=moe_intermediate_size, n_shared_experts=1, first_k_dense_replace=1, moe_layer_freq=1,
        topk_method="greedy", n_group=1, topk_group=1, scoring_func="softmax", routed_scaling_factor=1.0,
        norm_topk_prob=False, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=False,
        rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=512,
                             beta_fast=32.0, beta_slow=1.0, mscale=1.0, mscale_all_dim=0.0),
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
    )
    cfg.architectures = ["DeepseekV2ForCausalLM"]
    return _save_random(DeepseekV2ForCausalLM, cfg, out_dir, seed, init_std)
