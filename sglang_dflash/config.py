"""DFlash draft-model configuration (z-lab checkpoint format).

A z-lab DFlash directory (e.g. ``z-lab/Qwen3-8B-DFlash-b16``) holds a ``config.json`` that is a Qwen3
config plus the DFlash fields::

    {"architectures": ["DFlashDraftModel"], "model_type": "qwen3",
     "block_size": 16, "num_target_layers": 36,
     "dflash_config": {"target_layer_ids": [1, 9, 17, 25, 33], "mask_token_id": 151669},
     "layer_types": [...], "sliding_window": null, ...}

and safetensors weights ``layers.*``, ``norm``, ``fc``, ``hidden_norm`` (no embeddings / lm_head: the
draft borrows the target's). This module is torch-free.

Every key z-lab's reference model (``dflash/model.py``) reads is honoured: the ``dflash_config`` keys in
``DFLASH_CONFIG_KEYS`` (each also accepted at the top level, where z-lab looks next), ``layer_types`` /
``sliding_window`` / ``is_causal`` (per-layer attention, :meth:`DFlashDraftConfig.layer_attention`), and the
Qwen3 fields. Keys of other drafter families (DFlash2's convolutions and candidate selector) are refused.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

MIN_BLOCK_SIZE = 2
MAX_BLOCK_SIZE = 64

DFLASH_ARCHITECTURE = "DFlashDraftModel"
LAYER_TYPES = ("full_attention", "sliding_attention")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")
# dflash_config keys z-lab's DFlashDraftModel reads (z-lab: dflash_config first, then the top-level config).
DFLASH_CONFIG_KEYS = ("target_layer_ids", "mask_token_id", "block_size", "num_target_layers",
                      "input_embedding_scale", "output_multiplier", "final_logit_softcapping")
# Keys that belong to z-lab's DFlash2 drafters (grouped causal convolutions, candidate selector): not served.
DFLASH2_KEYS = ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")


class DFlashConfigError(ValueError):
    """A DFlash draft config / checkpoint is malformed or does not fit the target model."""


_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def resolve_draft_dir(path: str | os.PathLike, revision: Optional[str] = None, weights: bool = False) -> str:
    """The local directory of the draft at ``path``.

    A local directory (or ``config.json`` file) is returned as is. Anything shaped like a Hugging Face Hub repo
    id (``org/name``, e.g. ``z-lab/Qwen3-8B-DFlash-b16``) that is not a local path is fetched into the HF cache
    through transformers (``HF_HUB_OFFLINE=1``: from the cache only): its ``config.json`` and, with ``weights``,
    its safetensors (index + shards); the snapshot directory is returned."""
    path = os.fspath(path)
    if os.path.exists(path) or not _HUB_ID.match(path):
        return path
    from transformers.utils import cached_file

    try:
        config = cached_file(path, "config.json", revision=revision)
        if weights:
            index = cached_file(path, "model.safetensors.index.json", revision=revision,
                                _raise_exceptions_for_missing_entries=False)
            if index is None:
                shards = ["model.safetensors"]
            else:
                with open(index) as f:
                    shards = sorted(set(json.load(f)["weight_map"].values()))
            for shard in shards:
                cached_file(path, shard, revision=revision)
    except OSError as e:
        raise DFlashConfigError(
            f"{path!r} is not a local directory, and fetching it as a Hugging Face Hub repo failed ({e}). Pass a "
            "directory containing a z-lab style config.json and safetensors weights, or the id of such a Hub repo "
            "(e.g. z-lab/Qwen3-8B-DFlash-b16)."
        ) from e
    return os.path.dirname(config)


def select_target_layers(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """Target layers whose outputs feed the draft: ``[L//2]`` for one, else ``round(linspace(1, L-3, n))``."""
    if num_target_layers < 1 or num_draft_layers < 1:
        raise DFlashConfigError(
            f"select_target_layers needs positive layer counts, got num_target_layers={num_target_layers}, "
            f"num_draft_layers={num_draft_layers}; pass the real layer counts of the target and draft models."
        )
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end < start:
        raise DFlashConfigError(
            f"default target layer selection needs a target with >= 4 layers, got {num_target_layers}; "
            "set dflash_config.target_layer_ids explicitly."
        )
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


def _get(cfg: Any, key: str, default: Any = None) -> Any:
    if isinstance(cfg, dict):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _text_config(cfg: Any) -> Any:
    """The language-model part of a (possibly multimodal) target config."""
    if isinstance(cfg, dict):
        return cfg.get("text_config") or cfg
    get_text_config = getattr(cfg, "get_text_config", None)
    return get_text_config() if callable(get_text_config) else cfg


def _rope_from_dict(d: dict) -> tuple[float, Optional[dict]]:
    """(rope_theta, rope_scaling) from legacy ``rope_theta``/``rope_scaling`` or v5 ``rope_parameters``."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling")
    if scaling is None and params.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    return float(theta), scaling


@dataclass
class DFlashDraftConfig:
    """Hyper-parameters of a DFlash draft model (a stack of non-causal Qwen3 layers)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int
    num_target_layers: int
    mask_token_id: int
    block_size: int = 16
    target_layer_ids: Optional[list[int]] = None  # None -> select_target_layers(num_target_layers, num_hidden_layers)
    head_dim: Optional[int] = None  # None -> hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: Optional[dict] = None
    max_position_embeddings: int = 40960
    layer_types: Optional[list[str]] = None  # None -> all "full_attention"
    sliding_window: Optional[int] = None  # the window of sliding layers (None: they are causal, unwindowed)
    is_causal: Optional[bool] = None  # None -> sliding layers causal, full layers bidirectional (layer_attention)
    input_embedding_scale: float = 1.0  # block embeddings are the target's raw embeddings times this
    output_multiplier: float = 1.0  # draft logits = lm_head(hidden) * this, then the soft cap
    final_logit_softcapping: Optional[float] = None  # > 0: draft logits = cap * tanh(logits / cap)
    attention_bias: bool = False
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    torch_dtype: str = "bfloat16"
    extra: dict = field(default_factory=dict, compare=False)  # unknown config.json keys, written back by to_dict

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_layer_ids is None:
            self.target_layer_ids = select_target_layers(self.num_target_layers, self.num_hidden_layers)
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.layer_types is None:
            self.layer_types = ["full_attention"] * self.num_hidden_layers
        self.layer_types = list(self.layer_types)
        self._validate()

    def _validate(self) -> None:
        err = DFlashConfigError
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise err(
                f"block_size={self.block_size} is out of range; set block_size in config.json to an integer in "
                f"[{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}] (16 for z-lab checkpoints)."
            )
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "vocab_size", "num_target_layers", "head_dim"):
            if int(getattr(self, name)) < 1:
                raise err(f"{name}={getattr(self, name)} must be a positive integer; fix it in config.json.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise err(
                f"num_attention_heads={self.num_attention_heads} is not a multiple of num_key_value_heads="
                f"{self.num_key_value_heads}; fix the head counts in config.json."
            )
        if not self.target_layer_ids:
            raise err("dflash_config.target_layer_ids is empty; list at least one target layer id or remove the key.")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            raise err(
                f"dflash_config.target_layer_ids {bad} out of range for num_target_layers={self.num_target_layers}; "
                f"ids must be in [0, {self.num_target_layers - 1}]."
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise err(
                f"dflash_config.mask_token_id={self.mask_token_id} is >= vocab_size={self.vocab_size} (or negative); "
                "use a token id inside the target vocabulary (e.g. a reserved/added special token)."
            )
        if len(self.layer_types) != self.num_hidden_layers:
            raise err(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers={self.num_hidden_layers}; "
                "give one entry per draft layer."
            )
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise err(f"unknown layer_types {unknown}; each entry must be one of {list(LAYER_TYPES)}.")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise err(f"sliding_window={self.sliding_window} must be a positive integer (or null); fix config.json.")
        if self.is_causal is not None and not isinstance(self.is_causal, bool):
            raise err(f"is_causal={self.is_causal!r} must be true, false or absent; fix it in config.json.")
        if not self.input_embedding_scale > 0 or not self.output_multiplier > 0:
            raise err(
                f"dflash_config.input_embedding_scale={self.input_embedding_scale} and output_multiplier="
                f"{self.output_multiplier} must be positive numbers; fix them in config.json."
            )
        if self.final_logit_softcapping is not None and self.final_logit_softcapping < 0:
            raise err(
                f"dflash_config.final_logit_softcapping={self.final_logit_softcapping} must be positive (or null "
                "for none); fix it in config.json."
            )
        if self.hidden_act != "silu":
            raise err(f"hidden_act={self.hidden_act!r} is not supported; DFlash drafts use 'silu'.")
        if self.attention_bias:
            raise err("attention_bias=true is not supported; DFlash drafts have bias-free projections.")
        rope_type = self.rope_type
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise err(
                f"rope_scaling type {rope_type!r} is not supported; use one of {list(SUPPORTED_ROPE_TYPES)} "
                "or set rope_scaling to null."
            )

    @property
    def rope_type(self) -> str:
        if not self.rope_scaling:
            return "default"
        return self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))

    def layer_attention(self, layer_id: int) -> tuple[bool, Optional[int]]:
        """(causal, window) of draft layer ``layer_id``, as z-lab's reference defines them.

        causal: ``is_causal`` when the config sets it (for every layer), else True exactly for sliding layers.
        window: ``sliding_window`` for sliding layers (None when the config disables it), else None. A block query at position p sees a key at
        position k iff ``k <= p`` (causal layers only) and ``p - k < window`` (sliding layers; a non-causal
        sliding layer also needs ``k - p < window``); positions are absolute, context and block alike."""
        sliding = self.layer_types[layer_id] == "sliding_attention"
        causal = sliding if self.is_causal is None else self.is_causal
        return causal, (self.sliding_window if sliding else None)

    @property
    def context_feature_size(self) -> int:
        """Width of the concatenated target features fed to ``fc``: ``len(target_layer_ids) * hidden_size``."""
        return len(self.target_layer_ids) * self.hidden_size

    # ---------------------------------------------------------------- (de)serialisation

    @classmethod
    def from_dict(cls, d: dict) -> "DFlashDraftConfig":
        """Parse a z-lab ``config.json`` dict; raises DFlashConfigError naming problem and fix."""
        err = DFlashConfigError
        archs = d.get("architectures")
        if not archs:
            raise err(
                "config.json has no 'architectures'; this is not a DFlash draft checkpoint. Point the draft path "
                f"at a directory whose config.json has architectures: [\"{DFLASH_ARCHITECTURE}\"]."
            )
        if DFLASH_ARCHITECTURE not in archs:
            raise err(
                f"unknown architecture {archs}; expected [\"{DFLASH_ARCHITECTURE}\"]. Point the draft path at a "
                "z-lab style DFlash checkpoint (not the target model)."
            )
        dcfg = d.get("dflash_config") or {}
        foreign = sorted(k for k in DFLASH2_KEYS if k in dcfg or k in d)
        if foreign:
            raise err(
                f"config.json sets {foreign}, keys of z-lab's DFlash2 drafters (causal convolutions and a candidate "
                "selector), which sglang-dflash does not serve; use a DFlashDraftModel checkpoint."
            )
        unknown = sorted(set(dcfg) - set(DFLASH_CONFIG_KEYS))
        if unknown:
            raise err(
                f"dflash_config has keys {unknown} that sglang-dflash does not know (it knows "
                f"{list(DFLASH_CONFIG_KEYS)}); a drafter whose semantics depend on them cannot be served exactly. "
                "Remove them if they are inert, or use a drafter without them."
            )

        def value(key, default=None):  # z-lab's lookup: dflash_config, then the top level
            return dcfg.get(key, d.get(key, default))

        if value("mask_token_id") is None:
            raise err(
                "config.json lacks dflash_config.mask_token_id; add it (the id of the mask token in the target "
                "vocabulary)."
            )
        num_target_layers = value("num_target_layers")
        if num_target_layers is None:
            raise err("config.json lacks num_target_layers; set it to the number of layers of the target model.")
        block_size = value("block_size")
        if block_size is None:
            raise err(f"config.json lacks block_size; set it to an integer in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}].")
        missing = [k for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                               "vocab_size") if k not in d]
        if missing:
            raise err(f"config.json lacks required fields {missing}; write a complete Qwen3-style config.")
        rope_theta, rope_scaling = _rope_from_dict(d)
        known = {f for f in cls.__dataclass_fields__} - {"extra"} | {
            "architectures", "model_type", "dflash_config", "rope_parameters", "dtype", "use_sliding_window",
            "max_window_layers", "transformers_version", "attention_dropout", "use_cache",
        }
        layer_types = d.get("layer_types")
        return cls(
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_hidden_layers=int(d["num_hidden_layers"]),
            num_attention_heads=int(d["num_attention_heads"]),
            num_key_value_heads=int(d.get("num_key_value_heads", d["num_attention_heads"])),
            vocab_size=int(d["vocab_size"]),
            num_target_layers=int(num_target_layers),
            mask_token_id=int(value("mask_token_id")),
            block_size=int(block_size),
            target_layer_ids=value("target_layer_ids"),
            head_dim=d.get("head_dim"),
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
            layer_types=list(layer_types) if layer_types is not None else None,
            # Qwen3Config's reading, which z-lab's model inherits: the window only with use_sliding_window
            # (default 4096 when the key is absent), otherwise none
            sliding_window=d.get("sliding_window", 4096) if d.get("use_sliding_window", False) else None,
            is_causal=d.get("is_causal"),
            input_embedding_scale=float(value("input_embedding_scale", 1.0)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=(None if value("final_logit_softcapping") is None
                                     else float(value("final_logit_softcapping"))),
            attention_bias=bool(d.get("attention_bias", False)),
            hidden_act=d.get("hidden_act", "silu"),
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16").removeprefix("torch."),
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, revision: Optional[str] = None) -> "DFlashDraftConfig":
        """Read ``path/config.json`` (``path`` may also be the json file itself, or a Hugging Face Hub repo id:
        :func:`resolve_draft_dir`)."""
        path = resolve_draft_dir(path, revision)
        cfg_file = path if path.endswith(".json") else os.path.join(path, "config.json")
        if not os.path.isfile(cfg_file):
            raise DFlashConfigError(
                f"no config.json at {cfg_file!r}; not a DFlash checkpoint. Pass a directory containing a z-lab "
                "style config.json and safetensors weights."
            )
        with open(cfg_file) as f:
            return cls.from_dict(json.load(f))

    @classmethod
    def from_target(
        cls,
        target_config: Any,
        *,
        num_hidden_layers: int,
        mask_token_id: int,
        block_size: int = 16,
        target_layer_ids: Optional[list[int]] = None,
        **overrides: Any,
    ) -> "DFlashDraftConfig":
        """A draft config shaped like ``target_config`` (HF config or dict): same widths, heads, vocab, RoPE."""
        t = _text_config(target_config)
        tdict = t if isinstance(t, dict) else t.to_dict()
        rope_theta, rope_scaling = _rope_from_dict(tdict)
        kwargs = dict(
            hidden_size=int(tdict["hidden_size"]),
            intermediate_size=int(tdict["intermediate_size"]),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=int(tdict["num_attention_heads"]),
            num_key_value_heads=int(tdict.get("num_key_value_heads") or tdict["num_attention_heads"]),
            head_dim=tdict.get("head_dim"),
            vocab_size=int(tdict["vocab_size"]),
            num_target_layers=int(tdict["num_hidden_layers"]),
            mask_token_id=mask_token_id,
            block_size=block_size,
            target_layer_ids=target_layer_ids,
            rms_norm_eps=float(tdict.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(tdict.get("max_position_embeddings", 40960)),
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_dict(self) -> dict:
        """The z-lab ``config.json`` dict (Qwen3 fields + DFlash fields)."""
        d = dict(self.extra)
        d.update(
            architectures=[DFLASH_ARCHITECTURE],
            model_type="qwen3",
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            hidden_act=self.hidden_act,
            attention_bias=self.attention_bias,
            attention_dropout=0.0,
            rms_norm_eps=self.rms_norm_eps,
            rope_theta=self.rope_theta,
            rope_scaling=self.rope_scaling,
            max_position_embeddings=self.max_position_embeddings,
            vocab_size=self.vocab_size,
            layer_types=list(self.layer_types),
            sliding_window=self.sliding_window,
            use_sliding_window=self.sliding_window is not None,
            max_window_layers=self.num_hidden_layers,
            tie_word_embeddings=self.tie_word_embeddings,
            torch_dtype=self.torch_dtype,
            use_cache=True,
            block_size=self.block_size,
            num_target_layers=self.num_target_layers,
            dflash_config={"target_layer_ids": list(self.target_layer_ids), "mask_token_id": self.mask_token_id},
        )
        if self.is_causal is not None:
            d["is_causal"] = self.is_causal
        for key, default in (("input_embedding_scale", 1.0), ("output_multiplier", 1.0),
                             ("final_logit_softcapping", None)):
            if getattr(self, key) != default:
                d["dflash_config"][key] = getattr(self, key)
        return d

    def save_pretrained(self, path: str | os.PathLike) -> None:
        """Write ``path/config.json``."""
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(self.to_dict(), f, indent=2, sort_keys=True)

    # ---------------------------------------------------------------- target compatibility

    def validate_target(self, target_config: Any) -> None:
        """Check this draft fits ``target_config`` (transformers PretrainedConfig or dict).

        Raises DFlashConfigError for: hidden-size mismatch, target_layer_ids out of the target's range,
        mask_token_id >= target vocab, vocab-size mismatch.
        """
        t = _text_config(target_config)
        hidden = _get(t, "hidden_size")
        layers = _get(t, "num_hidden_layers")
        vocab = _get(t, "vocab_size")
        if hidden != self.hidden_size:
            raise DFlashConfigError(
                f"hidden size mismatch: draft hidden_size={self.hidden_size}, target hidden_size={hidden}; "
                "use a draft trained for this target model."
            )
        bad = [i for i in self.target_layer_ids if not 0 <= i < layers]
        if bad:
            raise DFlashConfigError(
                f"dflash_config.target_layer_ids {bad} out of range for the target's {layers} layers; "
                "use a draft trained for this target or fix target_layer_ids/num_target_layers."
            )
        if not 0 <= self.mask_token_id < vocab:
            raise DFlashConfigError(
                f"dflash_config.mask_token_id={self.mask_token_id} is >= the target vocab size {vocab}; "
                "pick a mask token inside the target vocabulary (e.g. a reserved special token)."
            )
        if vocab != self.vocab_size:
            raise DFlashConfigError(
                f"vocab size mismatch: draft vocab_size={self.vocab_size}, target vocab_size={vocab}; "
                "the draft shares the target's embeddings/lm_head, so use a draft trained for this target."
            )

    def replace(self, **changes: Any) -> "DFlashDraftConfig":
        """A validated copy with ``changes`` applied."""
        d = asdict(self)
        d.update(changes)
        return DFlashDraftConfig(**d)
