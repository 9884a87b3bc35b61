"""Checkpoints whose attention heads split over 2 tensor-parallel ranks, computing what the originals compute.

SmolLM2-135M (the bundled target) and its bundled drafter have 9 query heads over 3 KV heads, which 2 ranks
cannot share. :func:`widen_heads` rewrites a checkpoint with every KV head duplicated ``copies`` times and each
original query group spread over the copies, padded with zero query heads whose o_proj columns are zero: a zero
query head attends uniformly and its output is multiplied by zero, so the widened model computes the original
function (SmolLM2: 12 query heads over 6 KV heads, every other weight unchanged). The bundled drafter, trained
on SmolLM2's hidden states, keeps its acceptance on the widened target.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")


def widened_heads(heads: int, kv_heads: int, copies: int) -> tuple[int, int, list[int | None]]:
    """(new query heads, new KV heads, for each new query head the original query head it copies or None for a
    zero head). New KV head j copies original KV head j // copies."""
    group = heads // kv_heads
    per_copy = math.ceil(group / copies)  # query heads per new KV head
    order: list[int | None] = []
    for k in range(kv_heads):
        slots = [k * group + i for i in range(group)] + [None] * (per_copy * copies - group)
        order += slots
    return per_copy * copies * kv_heads, kv_heads * copies, order


def _widen_layer(w: dict[str, torch.Tensor], prefix: str, d: int, kv_heads: int, copies: int,
                 order: list[int | None]) -> None:
    q, k, v, o = (w[f"{prefix}{p}.weight"] for p in ATTN)
    zero_rows, zero_cols = q.new_zeros(d, q.shape[1]), o.new_zeros(o.shape[0], d)
    w[f"{prefix}q_proj.weight"] = torch.cat([q[i * d:(i + 1) * d] if i is not None else zero_rows for i in order])
    w[f"{prefix}o_proj.weight"] = torch.cat([o[:, i * d:(i + 1) * d] if i is not None else zero_cols for i in order],
                                            dim=1)
    for name, t in (("k_proj", k), ("v_proj", v)):
        w[f"{prefix}{name}.weight"] = torch.cat([t[j * d:(j + 1) * d] for j in range(kv_heads) for _ in range(copies)])


def widen_heads(src: str | Path, out: str | Path, copies: int = 2) -> Path:
    """Copy the checkpoint directory ``src`` (a Llama-style target or a DFlash draft: ``*.safetensors`` with
    ``...self_attn.{q,k,v,o}_proj.weight`` per layer) to ``out`` with each KV head duplicated ``copies`` times
    (module docstring); config.json gets the new head counts and an explicit ``head_dim``."""
    src, out = Path(src), Path(out)
    shutil.copytree(src, out)
    cfg = json.loads((out / "config.json").read_text())
    heads, kv_heads = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    d = cfg.get("head_dim") or cfg["hidden_size"] // heads
    new_heads, new_kv, order = widened_heads(heads, kv_heads, copies)
    files = {path: list(load_file(path)) for path in sorted(out.glob("*.safetensors"))}  # a layer may span files
    w = {n: t for path in files for n, t in load_file(path).items()}
    for prefix in sorted({n[: -len("q_proj.weight")] for n in w if n.endswith("self_attn.q_proj.weight")}):
        _widen_layer(w, prefix, d, kv_heads, copies, order)
    for path, names in files.items():
        save_file({n: w[n].contiguous() for n in names}, path, metadata={"format": "pt"})
    cfg.update(num_attention_heads=new_heads, num_key_value_heads=new_kv, head_dim=d)
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out
