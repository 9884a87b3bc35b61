"""DFlash draft model (torch only), parameter-compatible with z-lab checkpoints and SGLang's loader.

Shapes: ``b`` batch, ``C`` context tokens (committed tokens whose target features are known), ``Q`` block
query tokens, ``H`` hidden size, ``Hq``/``Hkv`` query/KV heads, ``D`` head dim.

Semantics (same as ``sglang/srt/models/dflash.py``):

* context features = concat of the target hidden states after ``target_layer_ids`` -> ``fc`` ->
  ``hidden_norm`` = ctx ``[b, C, H]``;
* every draft layer turns ctx into K/V with its own ``k_proj``/``v_proj`` (no input_layernorm), ``k_norm``
  per head, RoPE at the context token's position; these K/V are what a context KV cache stores;
* the block stream (the target's raw embeddings of ``[last token, MASK, ...]`` times ``input_embedding_scale``)
  runs pre-norm Qwen3 layers whose attention sees ``[context ; block]`` keys; what a layer sees is z-lab's rule
  (`DFlashDraftConfig.layer_attention`, `attention_mask`): full-attention layers see the whole block, sliding
  layers are causal inside the block with their window over context and block (``is_causal`` overrides the
  causal part for every layer);
* final ``norm``; logits come from the target's lm_head, then `draft_logits` (``output_multiplier``,
  ``final_logit_softcapping``).
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from .config import DFlashConfigError, DFlashDraftConfig, resolve_draft_dir

KV = tuple[torch.Tensor, torch.Tensor]
Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin) [b, L, 1, D] of `rope_cos_sin`

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3 RMSNorm over the last dim: statistics in float32 (for half types), the normalized x rounded to x's
    dtype before ``weight`` (broadcast against x, e.g. ``[D]`` or one row per layer) multiplies it."""
    dtype = x.dtype
    xf = x.to(torch.float32) if dtype in (torch.float16, torch.bfloat16) else x
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)


class RMSNorm(nn.Module):
    """Qwen3 RMSNorm over the last dim (`rms_norm`)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, causal: bool, window: Optional[int]) -> torch.Tensor:
    """z-lab's per-layer visibility. q_pos ``[b, Q]``, k_pos ``[b, K]`` absolute positions -> bool ``[b, Q, K]``
    (True = may attend): ``k <= q`` if causal; ``q - k < window`` with a window (and ``k - q < window`` when not
    causal)."""
    q, k = q_pos[:, :, None], k_pos[:, None, :]
    visible = torch.ones(torch.broadcast_shapes(q.shape, k.shape), dtype=torch.bool, device=q_pos.device)
    if causal:
        visible &= k <= q
    if window is not None:
        visible &= q - k < window
        if not causal:
            visible &= k - q < window
    return visible


def draft_logits(cfg: DFlashDraftConfig, logits: torch.Tensor) -> torch.Tensor:
    """The draft's logits from the target lm_head's output on draft hidden states: times ``output_multiplier``,
    then ``cap * tanh(logits / cap)`` with ``final_logit_softcapping`` (z-lab's ``compute_logits``). Identity for
    the defaults."""
    if cfg.output_multiplier != 1.0:
        logits = logits * cfg.output_multiplier
    cap = cfg.final_logit_softcapping
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def rope_inv_freq(cfg: DFlashDraftConfig) -> torch.Tensor:
    """Inverse RoPE frequencies ``[D/2]`` (float32) for rope types default / linear / llama3."""
    d = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
    rope_type, s = cfg.rope_type, cfg.rope_scaling
    if rope_type == "linear":
        inv_freq = inv_freq / float(s["factor"])
    elif rope_type == "llama3":
        factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
        old_len = float(s["original_max_position_embeddings"])
        wavelen = 2 * math.pi / inv_freq
        smooth = ((old_len / wavelen) - low) / (high - low)
        scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
        mid = (wavelen <= old_len / low) & (wavelen >= old_len / high)
        inv_freq = torch.where(mid, (1 - smooth) * inv_freq / factor + smooth * inv_freq, scaled)
    elif rope_type != "default":
        raise DFlashConfigError(f"rope type {rope_type!r} is not supported; use default, linear or llama3.")
    return inv_freq.to(torch.float32)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> Rope:
    """positions ``[b, L]`` -> neox-style (cos, sin) ``[b, L, 1, D]`` in ``dtype``, computed once per forward and
    shared by every layer, head and by queries and keys."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq  # [b, L, D/2]
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """Neox-style RoPE. x ``[b, L, heads, D]``, rope from `rope_cos_sin` -> ``[b, L, heads, D]``."""
    cos, sin = rope[0].to(x.dtype), rope[1].to(x.dtype)  # no-ops in the dtype they were made for
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class DFlashAttention(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig, layer_id: int):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.causal, self.sliding_window = cfg.layer_attention(layer_id)
        self.q_proj = nn.Linear(h, self.num_heads * d, bias=False)
        self.k_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, self.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(self.num_heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)

    def kv(self, x: torch.Tensor, rope: Rope) -> KV:
        """x ``[b, L, H]``, rope of its positions -> normed+roped k, v ``[b, L, Hkv, D]``."""
        b, n, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(b, n, self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).view(b, n, self.num_kv_heads, self.head_dim)
        return apply_rope(k, rope), v

    def qkv(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x ``[b, L, H]``, rope of its positions -> q ``[b, L, Hq, D]``, k, v ``[b, L, Hkv, D]`` (q, k normed +
        roped)."""
        b, n, _ = x.shape
        q = apply_rope(self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim)), rope)
        return (q, *self.kv(x, rope))

    def forward(
        self,
        x: torch.Tensor,
        rope: Rope,
        ctx_kv: KV,
        mask: Optional[torch.Tensor],
    ) -> torch.Tensor:
        """x ``[b, Q, H]`` (normed block stream), rope of the block positions, ctx_kv ``[b, C, Hkv, D]``, mask bool
        ``[b, Q, C+Q]`` or None."""
        b, q_len, _ = x.shape
        q, k_blk, v_blk = self.qkv(x, rope)
        k = torch.cat((ctx_kv[0], k_blk), dim=1).transpose(1, 2)
        v = torch.cat((ctx_kv[1], v_blk), dim=1).transpose(1, 2)
        attn_mask = None if mask is None else mask[:, None]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k, v, attn_mask=attn_mask, enable_gqa=self.num_heads != self.num_kv_heads
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, q_len, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashDecoderLayer(nn.Module):
    def __init__(self, cfg: DFlashDraftConfig, layer_id: int):
        super().__init__()
        self.self_attn = DFlashAttention(cfg, layer_id)
        self.mlp = DFlashMLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, rope, ctx_kv, mask):
        h = h + self.self_attn(self.input_layernorm(h), rope, ctx_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDraftModel(nn.Module):
    """The DFlash draft: ``layers.*``, ``norm``, ``fc`` ``[H, n_ids*H]``, ``hidden_norm``; no embeddings/lm_head."""

    def __init__(self, cfg: DFlashDraftConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(DFlashDecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.fc = nn.Linear(cfg.context_feature_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self._inv_freq = {torch.device("cpu"): rope_inv_freq(cfg)}  # float32 per device; not a buffer (no dtype casts)

    def inv_freq(self, device: torch.device) -> torch.Tensor:
        """RoPE inverse frequencies ``[D/2]`` (float32) on ``device``."""
        if device not in self._inv_freq:
            self._inv_freq[device] = self._inv_freq[torch.device("cpu")].to(device)
        return self._inv_freq[device]

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def project_context(self, target_hidden: torch.Tensor) -> torch.Tensor:
        """Concatenated target features ``[..., n_ids*H]`` -> ctx ``[..., H]`` (fc + hidden_norm)."""
        if target_hidden.shape[-1] != self.fc.in_features:
            raise ValueError(
                f"target_hidden last dim {target_hidden.shape[-1]} != len(target_layer_ids) * hidden_size = "
                f"{self.fc.in_features}; concatenate the target hidden states after layers "
                f"{self.cfg.target_layer_ids} (HF output_hidden_states[id + 1])."
            )
        return self.hidden_norm(self.fc(target_hidden.to(self.dtype)))

    def context_kv(self, ctx: torch.Tensor, positions: torch.Tensor) -> list[KV]:
        """ctx ``[b, C, H]``, positions ``[b, C]`` -> per layer (k, v) ``[b, C, Hkv, D]`` (k normed + roped).

        Every layer's K and V come from one GEMM over the stacked projections, followed by one
        k_norm and one RoPE over all layers (the same math as ``DFlashAttention.kv`` per layer):
        this runs once per committed token on the serving hot path.
        """
        ctx = ctx.to(self.dtype)
        attns = [layer.self_attn for layer in self.layers]
        n, hkv, d = len(attns), attns[0].num_kv_heads, attns[0].head_dim
        weight = torch.cat([w for a in attns for w in (a.k_proj.weight, a.v_proj.weight)])  # [n*2*hkv*d, H]
        kv = F.linear(ctx, weight).view(*ctx.shape[:-1], n, 2, hkv, d)
        k, v = kv[..., 0, :, :], kv[..., 1, :, :]  # [b, C, n, hkv, d]
        k = rms_norm(k, torch.stack([a.k_norm.weight for a in attns])[:, None, :], attns[0].k_norm.eps)
        k = apply_rope(k.flatten(2, 3), rope_cos_sin(positions, self.inv_freq(ctx.device), k.dtype)).view_as(v)
        return [(k[:, :, i], v[:, :, i]) for i in range(n)]

    def forward(
        self,
        block_embeds: torch.Tensor,
        block_positions: torch.Tensor,
        ctx_kv: Sequence[KV],
        attn_mask: Optional[torch.Tensor] = None,
        ctx_positions: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """Draft hidden states of a block (after the final norm).

        block_embeds ``[b, Q, H]`` (the target's raw embeddings of ``[last token, MASK, ...]``; scaled here by
        ``input_embedding_scale``), block_positions ``[b, Q]``, ctx_kv per layer ``[b, C, Hkv, D]``, attn_mask bool
        ``[b, Q, C+Q]`` (True = may attend; None = all context and block keys), further restricted per layer by
        `attention_mask` (causal / sliding layers) over the key positions ``[ctx_positions ; block_positions]``.
        ctx_positions ``[b, C]`` default: the context key in slot j sits at position j (a cache filled from
        position 0). Returns ``[b, Q, H]``.
        """
        if len(ctx_kv) != len(self.layers):
            raise ValueError(f"ctx_kv has {len(ctx_kv)} entries, expected one (k, v) per layer ({len(self.layers)}).")
        b, q_len, _ = block_embeds.shape
        ctx_len = ctx_kv[0][0].shape[1]
        masks = {}
        for mode in {(layer.self_attn.causal, layer.self_attn.sliding_window) for layer in self.layers}:
            masks[mode] = attn_mask
            if mode == (False, None):
                continue
            if ctx_positions is None:
                ctx_positions = torch.arange(ctx_len, device=block_positions.device).expand(b, ctx_len)
            key_pos = torch.cat((ctx_positions, block_positions), dim=1)  # [b, C+Q]
            visible = attention_mask(block_positions, key_pos, *mode)
            masks[mode] = visible if attn_mask is None else visible & attn_mask
        h = block_embeds.to(self.dtype)
        if self.cfg.input_embedding_scale != 1.0:
            h = h * self.cfg.input_embedding_scale
        rope = rope_cos_sin(block_positions, self.inv_freq(h.device), h.dtype)
        for layer, kv in zip(self.layers, ctx_kv):
            h = layer(h, rope, kv, masks[layer.self_attn.causal, layer.self_attn.sliding_window])
        return self.norm(h)


class DraftKVCache:
    """Per-layer context K/V of committed tokens, preallocated ``[b, max_len, Hkv, D]``; ``lens [b]``.

    Row i holds its committed tokens in slots ``0..lens[i]-1``, slot j = position j. The block is never cached,
    so a draft step costs O(block) compute.
    """

    def __init__(self, num_layers: int, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int,
                 device=None, dtype: torch.dtype = torch.float32):
        shape = (batch_size, max_len, num_kv_heads, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(num_layers)]
        self.lens = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: DFlashDraftModel, batch_size: int, max_len: int) -> "DraftKVCache":
        c = model.cfg
        return cls(c.num_hidden_layers, batch_size, max_len, c.num_key_value_heads, c.head_dim,
                   device=model.device, dtype=model.dtype)

    def append(self, layer_kvs: Sequence[KV], keep: torch.Tensor) -> None:
        """Append row i's tokens of layer_kvs (per layer ``[b, N, Hkv, D]``) that ``keep`` names, in order: ``[b]``
        counts (the first ``keep[i]``) or a ``[b, N]`` bool mask."""
        b, n = layer_kvs[0][0].shape[:2]
        keep = keep.to(self.lens.device)
        j = torch.arange(n, device=self.lens.device)
        valid = keep if keep.dtype == torch.bool else j[None, :] < keep[:, None]  # [b, N]
        n_new = valid.sum(1)
        if int((self.lens + n_new).max()) > self.max_len:
            raise ValueError(
                f"DraftKVCache overflow: need {int((self.lens + n_new).max())} slots, have {self.max_len}; "
                "allocate the cache with max_len >= prompt length + max_new_tokens + block_size."
            )
        rows = torch.arange(b, device=self.lens.device)[:, None].expand(b, n)[valid]
        slots = (self.lens[:, None] + valid.cumsum(1) - 1)[valid]
        for layer, (k, v) in enumerate(layer_kvs):
            self.k[layer][rows, slots] = k[valid].to(self.k[layer].dtype)
            self.v[layer][rows, slots] = v[valid].to(self.v[layer].dtype)
        self.lens += n_new

    def select(self, rows: torch.Tensor) -> None:
        """Keep only batch ``rows`` (e.g. drop finished requests)."""
        self.k = [k[rows] for k in self.k]
        self.v = [v[rows] for v in self.v]
        self.lens = self.lens[rows]

    def views(self, block_size: int) -> tuple[list[KV], torch.Tensor]:
        """Per-layer (k, v) ``[b, C, Hkv, D]`` with C = max(lens), and the bool mask ``[b, block_size, C+block_size]``
        (context slot j valid iff j < lens[i]; every block key valid)."""
        c = int(self.lens.max())
        kvs = [(k[:, :c], v[:, :c]) for k, v in zip(self.k, self.v)]
        b = self.lens.shape[0]
        ctx_ok = torch.arange(c, device=self.lens.device)[None, :] < self.lens[:, None]
        mask = torch.cat((ctx_ok, ctx_ok.new_ones(b, block_size)), dim=1)
        return kvs, mask[:, None, :].expand(b, block_size, c + block_size)


# -------------------------------------------------------------------- checkpoint I/O

def _read_state_dict(path: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise DFlashConfigError(
            f"no safetensors weights in {path!r}; a DFlash checkpoint needs model.safetensors (or shards + "
            "model.safetensors.index.json)."
        )
    state: dict[str, torch.Tensor] = {}
    for name in files:
        for key, tensor in load_file(os.path.join(path, name)).items():
            state[key.removeprefix("model.")] = tensor
    return state


def check_draft_state(model: DFlashDraftModel, state: dict[str, torch.Tensor], source: str) -> None:
    """Raise DFlashConfigError unless ``state`` holds exactly ``model``'s weights with its shapes."""
    cfg = model.cfg
    fc = state.get("fc.weight")
    if fc is not None and tuple(fc.shape) != (cfg.hidden_size, cfg.context_feature_size):
        raise DFlashConfigError(
            f"fc.weight has shape {tuple(fc.shape)} but len(target_layer_ids) * hidden_size = "
            f"{len(cfg.target_layer_ids)} * {cfg.hidden_size} = {cfg.context_feature_size} "
            f"(expected ({cfg.hidden_size}, {cfg.context_feature_size})); make dflash_config.target_layer_ids "
            "list exactly the target layers the draft was trained on."
        )
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DFlashConfigError(
            f"checkpoint {source!r} does not match the DFlash draft layout: missing {missing[:8]}, unexpected "
            f"{unexpected[:8]}; expected z-lab names (layers.*, norm, fc, hidden_norm; no embeddings/lm_head)."
        )
    bad = [k for k, t in expected.items() if tuple(state[k].shape) != tuple(t.shape)]
    if bad:
        raise DFlashConfigError(
            f"weight shapes do not match config.json for {bad[:8]} (e.g. {bad[0]}: checkpoint "
            f"{tuple(state[bad[0]].shape)} vs config {tuple(expected[bad[0]].shape)}); fix config.json."
        )


def load_draft(path: str | os.PathLike, device=None, dtype: Optional[torch.dtype] = None) -> DFlashDraftModel:
    """Load a z-lab format draft (config.json + safetensors, possibly sharded) from a directory or a Hugging Face
    Hub repo id (:func:`~sglang_dflash.config.resolve_draft_dir`). dtype None -> config torch_dtype."""
    path = resolve_draft_dir(path, weights=True)
    cfg = DFlashDraftConfig.from_pretrained(path)
    state = _read_state_dict(path)
    model = DFlashDraftModel(cfg)
    check_draft_state(model, state, path)
    if dtype is None:
        if cfg.torch_dtype not in _DTYPES:
            raise DFlashConfigError(f"torch_dtype={cfg.torch_dtype!r} is unknown; use one of {list(_DTYPES)}.")
        dtype = _DTYPES[cfg.torch_dtype]
    model.load_state_dict(state)
    return model.to(device=device, dtype=dtype).eval()


def save_draft(model: DFlashDraftModel, path: str | os.PathLike, max_shard_mb: float = 15) -> None:
    """Write ``config.json`` + safetensors in z-lab format; shards <= max_shard_mb with an index when sharded."""
    from safetensors.torch import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    cfg = model.cfg.replace(torch_dtype=_dtype_name(model.dtype))
    cfg.save_pretrained(path)
    for old in os.listdir(path):
        if old.endswith(".safetensors") or old == "model.safetensors.index.json":
            os.remove(os.path.join(path, old))
    limit = max_shard_mb * 1024 * 1024
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    total = 0
    for name, tensor in model.state_dict().items():
        nbytes = tensor.numel() * tensor.element_size()
        if shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
        total += nbytes
    if len(shards) == 1:
        save_file(shards[0], os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(path, fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2, sort_keys=True)
