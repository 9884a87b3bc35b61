"""Random checkpoints of a realistic size for the serving benchmark, built on the machine that serves them.

A Qwen3-shaped target (random weights, bf16, the SmolLM2 tokenizer) and a random z-lab-format DFlash draft shaped
like it (5 layers, block 16, context from 5 target layers spread over the depth). With them `bench_dflash.py`'s
workloads measure engine cost at that size: `bound_accept_all` zeroes both final norms (every draft accepted),
`real` / `bound_accept_none` accept next to nothing (random draft).

    python benchmarks/random_checkpoints.py --shape qwen3-8b --out /tmp/q8b
    python benchmarks/bench_dflash.py --target /tmp/q8b/target --draft /tmp/q8b/draft --out results/q8b

Weights are drawn on ``--device`` (a GPU builds an 8B target in seconds); ``--shape tiny`` builds one small enough
for a CPU check of the script itself.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
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


def spread_layers(num_layers: int, n: int) -> list[int]:
    """``n`` target layer ids from 1 to ``num_layers - 3``, evenly spaced (z-lab's drafters take theirs so)."""
    lo, hi = 1, num_layers - 3
    return [round(lo + i * (hi - lo) / (n - 1)) for i in range(n)]


def build(shape: str, out: Path, device: str, seed: int = 0) -> tuple[Path, Path]:
    """Write ``out/target`` and ``out/draft``; returns their paths."""
    tokenizer = AutoTokenizer.from_pretrained(smollm2_path())
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tokenizer), max_position_embeddings=8192, rope_theta=1_000_000.0,
                      tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=tokenizer.bos_token_id,
                      eos_token_id=tokenizer.eos_token_id, torch_dtype="bfloat16", **SHAPES[shape])
    with torch.device(device):
        target = Qwen3ForCausalLM(cfg).to(torch.bfloat16)
    target_dir, draft_dir = out / "target", out / "draft"
    target.save_pretrained(target_dir)
    tokenizer.save_pretrained(target_dir)
    mask_id = tokenizer.convert_tokens_to_ids(tokenizer.special_tokens_map.get("pad_token", tokenizer.eos_token))
    dcfg = DFlashDraftConfig.from_target(cfg, num_hidden_layers=DRAFT_LAYERS, block_size=BLOCK_SIZE,
                                         mask_token_id=int(mask_id),
                                         target_layer_ids=spread_layers(cfg.num_hidden_layers, DRAFT_LAYERS),
                                         torch_dtype="bfloat16")
    with torch.device(device):
        draft = DFlashDraftModel(dcfg).to(torch.bfloat16)
    save_draft(draft, draft_dir)
    return target_dir, draft_dir


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    target, draft = build(args.shape, Path(args.out), args.device)
    print(f"target {target}\ndraft {draft}")


if __name__ == "__main__":
    main()
