"""Random checkpoints built on the machine that serves them: a realistic size for the serving benchmark, and one
small target per architecture family for the architecture matrix (`arch_matrix.py`).

``--shape``: a Qwen3-shaped target (random weights, bf16, the SmolLM2 tokenizer) and a random z-lab-format DFlash
draft shaped like it (5 layers, block 16, context from 5 target layers spread over the depth). With them
`bench_dflash.py`'s workloads measure engine cost at that size: `bound_accept_all` zeroes both final norms (every
draft accepted), `real` / `bound_accept_none` accept next to nothing (random draft).

    python benchmarks/random_checkpoints.py --shape qwen3-8b --out /tmp/q8b
    python benchmarks/bench_dflash.py --target /tmp/q8b/target --draft /tmp/q8b/draft --out results/q8b

``--family``: a small random bf16 target of one architecture family SGLang serves with DFLASH (`FAMILIES`: the
config carries every field SGLang's model class reads) and a 2-layer z-lab-format draft for it.

    python benchmarks/random_checkpoints.py --family qwen3_next --out /tmp/qn

Weights are drawn on ``--device`` (a GPU builds an 8B target in seconds); ``--shape tiny`` builds one small enough
for a CPU check of the script itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import transformers
from transformers import AutoTokenizer, Qwen3Config, Qwen3ForCausalLM

from sglang_dflash.assets import smollm2_path
from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.model import DFlashDraftModel, save_draft

SHAPES = {
    "qwen3-8b": dict(num_hidden_layers=36, hidden_size=4096, intermediate_size=12288, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128),
    "tiny": dict(num_hidden_layers=12, hidden_size=128, intermediate_size=256, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=32),
}
DRAFT_LAYERS, BLOCK_SIZE = 5, 16

# The families' common size: FlashInfer takes head_dim 64 (not 32); 8 layers, so hybrid ones have two full-attention
# layers among six linear-attention ones.
_SMALL = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
              intermediate_size=1024, max_position_embeddings=4096, rms_norm_eps=1e-6, tie_word_embeddings=False)
_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256, norm_topk_prob=True)
_HYBRID = dict(linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64,
               linear_conv_kernel_dim=4)


def _every(n: int, layers: int, hit: str, other: str) -> list[str]:
    """``layer_types``: ``hit`` at every ``n``-th layer (1-based), ``other`` elsewhere."""
    return [hit if (i + 1) % n == 0 else other for i in range(layers)]


# family -> (transformers config class, model class, architecture SGLang serves, config fields, extra attributes)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", "LlamaForCausalLM", dict(_SMALL, rope_theta=500_000.0), {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", "Qwen3ForCausalLM", dict(_SMALL, rope_theta=1_000_000.0), {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "Qwen3MoeForCausalLM",
                  dict(_SMALL, **_MOE, decoder_sparse_step=1, mlp_only_layers=[]), {}),
    # Qwen3.5 dense (SGLang's text-only class); Qwen3-Next: the same layers with MoE blocks and a shared expert.
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", "Qwen3_5ForCausalLM",
                dict(_SMALL, **_HYBRID, layer_types=_every(4, 8, "full_attention", "linear_attention")),
                {"full_attention_interval": 4}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", "Qwen3NextForCausalLM",
                   dict(_SMALL, **_HYBRID, **_MOE, shared_expert_intermediate_size=256, decoder_sparse_step=1,
                        mlp_only_layers=[], layer_types=_every(4, 8, "full_attention", "linear_attention")),
                   {"full_attention_interval": 4}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", "GptOssForCausalLM",
                dict(_SMALL, num_local_experts=8, num_experts_per_tok=2, intermediate_size=512, sliding_window=128,
                     swiglu_limit=7.0, layer_types=_every(2, 8, "full_attention", "sliding_attention")), {}),
    "gemma4": ("Gemma4TextConfig", "Gemma4ForCausalLM", "Gemma4ForCausalLM",
               dict(_SMALL, hidden_size_per_layer_input=64, global_head_dim=64, sliding_window=128,
                    layer_types=_every(4, 8, "full_attention", "sliding_attention")),
               {"swa_num_key_value_heads": 2, "swa_head_dim": 64}),  # SGLang's sliding-window pool reads these
    # MLA: DeepSeek-V2-Lite's layout and head sizes (SGLang's Triton MLA decode kernel does not compile for a latent
    # of 128), first layer dense, the rest MoE.
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", "DeepseekV2ForCausalLM",
                    dict({k: v for k, v in _SMALL.items() if k != "head_dim"}, q_lora_rank=None, kv_lora_rank=512,
                         qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, n_routed_experts=8,
                         num_experts_per_tok=2, moe_intermediate_size=256, n_shared_experts=1,
                         first_k_dense_replace=1, moe_layer_freq=1, topk_method="greedy", n_group=1, topk_group=1,
                         scoring_func="softmax", routed_scaling_factor=1.0, norm_topk_prob=False, ep_size=1,
                         num_key_value_heads=8), {}),
}


def spread_layers(num_layers: int, n: int) -> list[int]:
    """``n`` target layer ids from 1 to ``num_layers - 3``, evenly spaced (z-lab's drafters take theirs so)."""
    lo, hi = 1, num_layers - 3
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def build(shape: str, out: Path, device: str, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out/target`` and ``out/draft``; returns their paths."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    cfg = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=8192, rope_theta=1_000_000.0,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **SHAPES[shape])
    return _write(Qwen3ForCausalLM, cfg, tokenizer, out, device, seed, DRAFT_LAYERS, BLOCK_SIZE)


def build_family(family: str, out: Path, device: str, seed: int = 0, draft_layers: int = 2,
                 block_size: int = BLOCK_SIZE, **sizes) -> tuple[Path, Path]:
    """Write ``out/target`` (a random bf16 target of ``family``, `FAMILIES`; ``sizes`` override its config
    fields) and ``out/draft`` (a random ``draft_layers``-layer z-lab-format draft for it); returns their paths.
    The draft's attention is its own: Qwen3 layers with plain RoPE and head_dim 64, like z-lab's (a target's YaRN
    or MLA head sizes are not the draft's)."""
    cfg_cls, model_cls, arch, fields, attrs = FAMILIES[family]
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    cfg = getattr(transformers, cfg_cls)(vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                                         **{**fields, **sizes})
    for k, v in attrs.items():
        setattr(cfg, k, v)
    cfg.architectures = [arch]
    return _write(getattr(transformers, model_cls), cfg, tokenizer, out, device, seed, draft_layers, block_size,
                  rope_scaling=None, head_dim=64)


def _write(model_cls, cfg, tokenizer, out: Path, device: str, seed: int, draft_layers: int, block_size: int,
           **draft_fields) -> tuple[Path, Path]:
    """A random bf16 ``model_cls(cfg)`` with ``tokenizer`` to ``out/target``, and a random z-lab-format draft for
    it (``draft_layers`` layers on target layers spread over the depth, ``draft_fields`` over the target's shape)
    to ``out/draft``."""
    torch.manual_seed(seed)
    with torch.device(device):
        target = model_cls(cfg).to(torch.bfloat16)
    target.config.torch_dtype = "bfloat16"
    target_dir, draft_dir = out / "target", out / "draft"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    mask_id = tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map.get("pad_token", tokenizer.eos_token))
    dcfg = DFlashDraftConfig.from_target(cfg, num_hidden_layers=draft_layers, block_size=block_size,
                                         mask_token_id=int(mask_id),
                                         target_layer_ids=spread_layers(cfg.num_hidden_layers, draft_layers),
                                         torch_dtype="bfloat16", **draft_fields)
    with torch.device(device):
        draft = DFlashDraftModel(dcfg).to(torch.bfloat16)
    save_draft(draft, draft_dir)
    return target_dir, draft_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    what.add_argument("--family", choices=sorted(FAMILIES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    if args.family:
        target, draft = build_family(args.family, Path(args.out), args.device)
    else:
        target, draft = build(args.shape, Path(args.out), args.device)
    print(f"target {target}\ndraft {draft}")


if __name__ == "__main__":
    main()
