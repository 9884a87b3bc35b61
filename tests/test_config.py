"""DFlashDraftConfig: z-lab config.json parsing, defaults, and every malformed case's message."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from sglang_dflash.config import DFlashConfigError, DFlashDraftConfig, select_target_layers
from sglang_dflash.model import DFlashDraftModel, load_draft, save_draft

# Trimmed copy of the shape of z-lab/Qwen3-8B-DFlash-b16/config.json (tiny sizes).
ZLAB_CONFIG = {
    "architectures": ["DFlashDraftModel"],
    "model_type": "qwen3",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "block_size": 16,
    "bos_token_id": 151643,
    "dflash_config": {"mask_token_id": 120, "target_layer_ids": [1, 3, 5]},
    "eos_token_id": 151645,
    "head_dim": 8,
    "hidden_act": "silu",
    "hidden_size": 32,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_types": ["full_attention", "sliding_attention"],
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "num_target_layers": 8,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": 4,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "use_sliding_window": True,
    "vocab_size": 128,
}

TARGET = {"hidden_size": 32, "num_hidden_layers": 8, "vocab_size": 128}


def test_select_target_layers_rule():
    assert select_target_layers(36, 5) == [1, 9, 17, 25, 33]
    assert select_target_layers(28, 1) == [14]
    assert select_target_layers(30, 2) == [1, 27]
    assert select_target_layers(6, 3) == [1, 2, 3]
    with pytest.raises(DFlashConfigError, match="needs a target with >= 4 layers"):
        select_target_layers(3, 2)


def test_zlab_config_parses():
    cfg = DFlashDraftConfig.from_dict(ZLAB_CONFIG)
    assert cfg.block_size == 16 and cfg.num_target_layers == 8
    assert cfg.target_layer_ids == [1, 3, 5] and cfg.mask_token_id == 120
    assert cfg.layer_types == ["full_attention", "sliding_attention"] and cfg.sliding_window == 4
    assert cfg.head_dim == 8 and cfg.rope_theta == 1e6 and cfg.rope_scaling is None
    assert cfg.context_feature_size == 3 * 32
    d = cfg.to_dict()
    for key in ("architectures", "model_type", "block_size", "num_target_layers", "dflash_config", "layer_types",
                "sliding_window", "hidden_size", "bos_token_id", "initializer_range"):
        assert d[key] == ZLAB_CONFIG[key], key
    assert DFlashDraftConfig.from_dict(d) == cfg


def test_default_layer_ids_and_types():
    d = copy.deepcopy(ZLAB_CONFIG)
    del d["dflash_config"]["target_layer_ids"], d["layer_types"], d["sliding_window"], d["head_dim"]
    cfg = DFlashDraftConfig.from_dict(d)
    assert cfg.target_layer_ids == select_target_layers(8, 2) == [1, 5]
    assert cfg.layer_types == ["full_attention"] * 2 and cfg.head_dim == 8


def test_rope_parameters_v5_style():
    d = copy.deepcopy(ZLAB_CONFIG)
    del d["rope_theta"], d["rope_scaling"]
    d["rope_parameters"] = {"rope_type": "linear", "rope_theta": 5000.0, "factor": 2.0}
    cfg = DFlashDraftConfig.from_dict(d)
    assert cfg.rope_theta == 5000.0 and cfg.rope_scaling == {"rope_type": "linear", "factor": 2.0}


def test_reparse_from_transformers_config(tmp_path):
    """SGLang hands the adapter a transformers Qwen3Config (v5: rope_parameters, dtype); to_dict() re-parses."""
    from transformers import AutoConfig

    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    hf = AutoConfig.from_pretrained(tmp_path)
    d = hf.to_dict()
    d["dtype"] = hf.dtype  # may be a torch.dtype object
    assert DFlashDraftConfig.from_dict(d) == DFlashDraftConfig.from_dict(ZLAB_CONFIG)


def test_from_pretrained_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(ZLAB_CONFIG))
    assert DFlashDraftConfig.from_pretrained(tmp_path).target_layer_ids == [1, 3, 5]


def _with(**changes):
    d = copy.deepcopy(ZLAB_CONFIG)
    for key, value in changes.items():
        if key.startswith("dflash_"):
            d["dflash_config"][key.removeprefix("dflash_")] = value
        elif value is None:
            d.pop(key)
        else:
            d[key] = value
    return d


@pytest.mark.parametrize(
    "bad, message",
    [
        (_with(block_size=1), r"block_size=1 is out of range; set block_size .* \[2, 64\]"),
        (_with(block_size=65), r"block_size=65 is out of range"),
        (_with(architectures=["Qwen3ForCausalLM"]), r"unknown architecture \['Qwen3ForCausalLM'\]; expected"),
        (_with(architectures=None), r"no 'architectures'; this is not a DFlash draft checkpoint"),
        (_with(dflash_target_layer_ids=[1, 8]), r"target_layer_ids \[8\] out of range for num_target_layers=8"),
        (_with(dflash_target_layer_ids=[]), r"target_layer_ids is empty"),
        (_with(dflash_mask_token_id=128), r"mask_token_id=128 is >= vocab_size=128"),
        (_with(num_target_layers=None), r"lacks num_target_layers"),
        (_with(block_size=None), r"lacks block_size"),
        (_with(sliding_window=0), r"sliding_window=0 must be a positive integer"),
        (_with(layer_types=["full_attention"]), r"layer_types has 1 entries but num_hidden_layers=2"),
        (_with(layer_types=["full_attention", "chunked"]), r"unknown layer_types \['chunked'\]"),
        (_with(rope_scaling={"rope_type": "yarn", "factor": 4.0}), r"rope_scaling type 'yarn' is not supported"),
        (_with(hidden_act="gelu"), r"hidden_act='gelu' is not supported"),
        (_with(num_key_value_heads=3), r"not a multiple of num_key_value_heads=3"),
    ],
)
def test_malformed_config_messages(bad, message):
    with pytest.raises(DFlashConfigError, match=message):
        DFlashDraftConfig.from_dict(bad)


def test_missing_mask_token_id():
    d = copy.deepcopy(ZLAB_CONFIG)
    del d["dflash_config"]["mask_token_id"]
    with pytest.raises(DFlashConfigError, match="lacks dflash_config.mask_token_id"):
        DFlashDraftConfig.from_dict(d)


def test_missing_config_json(tmp_path):
    with pytest.raises(DFlashConfigError, match="no config.json at .*not a DFlash checkpoint"):
        DFlashDraftConfig.from_pretrained(tmp_path)
    with pytest.raises(DFlashConfigError, match="no config.json"):
        load_draft(tmp_path)


def test_validate_target_messages(tiny_qwen3):
    cfg = DFlashDraftConfig.from_dict(ZLAB_CONFIG)
    cfg.validate_target(TARGET)
    with pytest.raises(DFlashConfigError, match="hidden size mismatch: draft hidden_size=32, target hidden_size=64"):
        cfg.validate_target({**TARGET, "hidden_size": 64})
    with pytest.raises(DFlashConfigError, match=r"target_layer_ids \[5\] out of range for the target's 4 layers"):
        cfg.validate_target({**TARGET, "num_hidden_layers": 4})
    with pytest.raises(DFlashConfigError, match="mask_token_id=120 is >= the target vocab size 100"):
        cfg.validate_target({**TARGET, "vocab_size": 100})
    with pytest.raises(DFlashConfigError, match="vocab size mismatch: draft vocab_size=128, target vocab_size=256"):
        cfg.validate_target({**TARGET, "vocab_size": 256})
    # transformers config objects work too (tiny_qwen3 has 6 layers: id 5 in range)
    cfg.validate_target(tiny_qwen3.config)


def test_fc_width_mismatch_on_load(tmp_path):
    cfg = DFlashDraftConfig.from_dict(ZLAB_CONFIG)
    save_draft(DFlashDraftModel(cfg), tmp_path)
    d = json.loads((tmp_path / "config.json").read_text())
    d["dflash_config"]["target_layer_ids"] = [1, 3]  # checkpoint fc was trained on 3 layers
    (tmp_path / "config.json").write_text(json.dumps(d))
    with pytest.raises(DFlashConfigError, match=r"fc.weight has shape \(32, 96\) but len\(target_layer_ids\) \* "
                                                 r"hidden_size = 2 \* 32 = 64"):
        load_draft(tmp_path)


def test_no_weights_and_foreign_weights(tmp_path):
    cfg = DFlashDraftConfig.from_dict(ZLAB_CONFIG)
    cfg.save_pretrained(tmp_path)
    with pytest.raises(DFlashConfigError, match="no safetensors weights"):
        load_draft(tmp_path)
    from safetensors.torch import save_file

    state = DFlashDraftModel(cfg).state_dict()
    state["embed_tokens.weight"] = torch.zeros(128, 32)
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(DFlashConfigError, match=r"unexpected \['embed_tokens.weight'\]"):
        load_draft(tmp_path)
