"""Tensor parallelism for DFLASH (``--tp-size N``): the draft sharded with the target's TP group.

The target is sharded by SGLang. The draft runs on the same TP group, sharded as SGLang shards the target's
layers (`DraftShard`): each rank holds its slice of the attention heads (q, and k/v -- replicated when the draft
has fewer KV heads than ranks) and of the MLP's intermediate dimension; o_proj and down_proj are row-parallel,
their partial sums all-reduced; ``fc``, the norms and the RoPE tables are replicated. Each rank's draft KV pool
holds its own KV heads at the target's token slots, as the target's pool does. The draft's embeddings and lm_head
are the target's, vocab-parallel: the draft's argmax, its sampled law and draws, and the sampled accept's residual
draw run over the ranks' vocabulary shards (`verify.VocabSplit`: each rank's best (value, id) gathered, the first
maximum winning as a full-vocabulary argmax picks it; softmax normalisers gathered).

Why sharded rather than replicated: a replicated draft costs every rank the whole draft's weights, its full KV
heads (the pool SGLang sizes for a draft worker holds ``num_kv_heads // tp`` heads) and the whole draft forward;
sharded, both scale down with N for two all-reduces per draft layer, the pattern of every target layer.

Every rank makes the same accept decision: the verify logits are the target's, gathered over the vocabulary by
SGLang's logits processor (the same tensor on every rank), so the greedy accept agrees by construction. The step's
own sampled accept draws the same random numbers on every rank (the same seed and the same draws, the whole
vocabulary's noise on each: what SGLang's own sampler relies on) and reduces over the shards, so its result is the
same on every rank too. An accept through SGLang's sampler after the step (`sampling.BlockSampler`: grammars,
penalties, ...) is broadcast from the group's first rank (`agree_on_accept`).
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import torch

from sglang_dflash.config import DFlashDraftConfig


@dataclasses.dataclass(frozen=True)
class DraftShard:
    """Rank ``rank`` of ``size``'s slice of a draft: query heads ``[q0, q1)``, KV heads ``[kv0, kv1)``, MLP
    intermediate rows ``[f0, f1)``."""

    rank: int
    size: int
    q0: int
    q1: int
    kv0: int
    kv1: int
    f0: int
    f1: int

    @classmethod
    def of(cls, cfg: DFlashDraftConfig, rank: int, size: int) -> "DraftShard":
        """The slice of ``cfg``'s draft for ``rank`` (raises ValueError naming the problem when ``size`` does not
        divide the draft)."""
        check_draft_divides(cfg, size)
        hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
        nq, nf = hq // size, inter // size
        if hkv >= size:
            nkv = hkv // size
            kv0 = rank * nkv
        else:  # fewer KV heads than ranks: each KV head on size // hkv consecutive ranks (SGLang's replication)
            nkv, kv0 = 1, rank * hkv // size
        return cls(rank, size, rank * nq, (rank + 1) * nq, kv0, kv0 + nkv, rank * nf, (rank + 1) * nf)

    def local_config(self, cfg: DFlashDraftConfig) -> DFlashDraftConfig:
        """``cfg`` with this rank's head counts and intermediate size (``cfg`` itself for one rank)."""
        if self.size == 1:
            return cfg
        return dataclasses.replace(cfg, num_attention_heads=self.q1 - self.q0, num_key_value_heads=self.kv1 - self.kv0,
                                   intermediate_size=self.f1 - self.f0, extra=dict(cfg.extra))

    def slice_state(self, state: dict[str, torch.Tensor], head_dim: int) -> dict[str, torch.Tensor]:
        """A full draft state dict (z-lab names, no ``model.`` prefix) -> this rank's (views): q/k/v and gate/up
        rows, o_proj and down_proj columns; every other tensor whole."""
        if self.size == 1:
            return state
        d = head_dim
        rows = {"self_attn.q_proj.weight": (0, self.q0 * d, self.q1 * d),
                "self_attn.k_proj.weight": (0, self.kv0 * d, self.kv1 * d),
                "self_attn.v_proj.weight": (0, self.kv0 * d, self.kv1 * d),
                "self_attn.o_proj.weight": (1, self.q0 * d, self.q1 * d),
                "mlp.gate_proj.weight": (0, self.f0, self.f1),
                "mlp.up_proj.weight": (0, self.f0, self.f1),
                "mlp.down_proj.weight": (1, self.f0, self.f1)}
        out = {}
        for name, w in state.items():
            suffix = name.split(".", 2)[-1] if name.startswith("layers.") else None
            if suffix in rows:
                dim, a, b = rows[suffix]
                w = w.narrow(dim, a, b - a)
            out[name] = w
        return out


def check_draft_divides(cfg: DFlashDraftConfig, tp_size: int) -> None:
    """Raise ValueError (one line naming the fix) unless ``tp_size`` ranks can share ``cfg``'s draft: its query
    heads and intermediate size divisible by ``tp_size``, its KV heads divisible by ``tp_size`` or dividing it."""
    hq, hkv, inter = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    problems = []
    if hq % tp_size:
        problems.append(f"num_attention_heads={hq}")
    if hkv % tp_size and tp_size % hkv:
        problems.append(f"num_key_value_heads={hkv}")
    if inter % tp_size:
        problems.append(f"intermediate_size={inter}")
    if problems:
        raise ValueError(f"sglang-dflash: the draft's {', '.join(problems)} cannot be split over --tp-size {tp_size} "
                         "(the draft is sharded with the target's tensor-parallel group). Use a --tp-size that divides "
                         "them.")


def agree_on_accept(accepted: tuple, group) -> tuple:
    """The accept result of a verify step ``(accept_lens [bs], bonus_tokens [bs], committed [bs, B],
    new_seq_lens [bs])`` as the group's first rank decided it, on every rank of ``group`` (one broadcast)."""
    accept_lens, bonus, committed, new_seq_lens = accepted
    bs = committed.shape[0]
    packed = torch.cat([accept_lens.view(bs, 1).to(torch.int64), bonus.view(bs, 1).to(torch.int64),
                        new_seq_lens.view(bs, 1).to(torch.int64), committed.to(torch.int64)], dim=1).contiguous()
    group.broadcast(packed, src=0)
    return (packed[:, 0].to(accept_lens.dtype), packed[:, 1].to(bonus.dtype), packed[:, 3:].to(committed.dtype),
            packed[:, 2].to(new_seq_lens.dtype))


def tp_group() -> Optional[object]:
    """SGLang's tensor-parallel group of this process when it has more than one rank, else None."""
    from sglang.srt.distributed import get_tp_group

    group = get_tp_group()
    return group if group.world_size > 1 else None


def lm_head_shard(lm_head) -> tuple[torch.Tensor, int, bool]:
    """The target's (vocab-parallel) lm_head -> (this rank's weight rows of real vocabulary ids ``[V_local, H]``,
    a view without the padding rows; the first id they score; whether the vocabulary is split over ranks)."""
    shard = getattr(lm_head, "shard_indices", None)
    if shard is None:  # a plain (unsharded) head
        return lm_head.weight, 0, False
    if shard.num_added_elements:
        raise ValueError("sglang-dflash: a target lm_head with added vocabulary (LoRA extra tokens) is not supported "
                         "by DFLASH. Serve the target without added vocabulary.")
    weight = lm_head.weight[: shard.num_org_elements]
    return weight, int(shard.org_vocab_start_index), int(getattr(lm_head, "tp_size", 1)) > 1
