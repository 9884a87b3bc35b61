"""SmolLM2 GGUF -> HF conversion: the converted dir must generate exactly what the GGUF model generates."""

import json

import pytest
import torch

from sglang_dflash import assets

pytestmark = pytest.mark.real_model

PROMPT = "Write a short Python function that returns the n-th Fibonacci number."


@pytest.fixture(scope="module")
def converted():
    return assets.smollm2_path()


def test_config_and_tokenizer(converted):
    from transformers import AutoTokenizer

    cfg = json.loads((converted / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["pad_token_id"]) == (1, 2, 2)
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["vocab_size"]) == (30, 576, 49152)
    gen = json.loads((converted / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 2
    tok = AutoTokenizer.from_pretrained(converted)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.convert_tokens_to_ids(assets.SMOLLM2_MASK_TOKEN) == assets.SMOLLM2_MASK_TOKEN_ID
    text = "Hello  world!\n\tdef f(x): return 12345 ... é"
    ids = tok(text).input_ids
    assert ids[:3] == [19556, 216, 905] and ids[-7:-2] == [33, 34, 35, 36, 37]
    assert tok.decode(ids) == text
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert chat.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_greedy_matches_gguf(converted):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = assets.smollm2_gguf_path()
    ref = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(converted)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                tokenize=True, return_dict=True)["input_ids"]])
    mask = torch.ones_like(ids)
    kw = dict(attention_mask=mask, max_new_tokens=48, do_sample=False, pad_token_id=2)
    want = ref.generate(ids, **kw)[0, ids.shape[1]:].tolist()
    got = model.generate(ids, **kw)[0, ids.shape[1]:].tolist()
    assert len(got) >= 24
    assert got == want


def test_cached_and_cli(converted, capsys):
    assert assets.smollm2_path() == converted
    assets.main([])
    assert capsys.readouterr().out.strip() == str(converted)
    assets.main(["--paths"])  # shell assignments for the README's serving example
    assert capsys.readouterr().out.splitlines() == [f"TARGET={converted}",
                                                    f"DRAFTER={assets.bundled_drafter_path()}"]


def test_missing_out_dir_is_rejected(tmp_path):
    (tmp_path / "junk").write_text("x")
    with pytest.raises(FileExistsError, match="delete it"):
        assets.smollm2_path(tmp_path)


def test_bundled_drafter_loads_and_fits_target(converted):
    from transformers import AutoConfig

    from sglang_dflash.model import load_draft

    path = assets.bundled_drafter_path()
    draft = load_draft(path)
    cfg = draft.cfg
    assert (cfg.block_size, cfg.mask_token_id, cfg.num_target_layers) == (16, assets.SMOLLM2_MASK_TOKEN_ID, 30)
    assert cfg.target_layer_ids == [1, 8, 14, 20, 27]
    cfg.validate_target(AutoConfig.from_pretrained(converted))
    shards = sorted(path.glob("*.safetensors"))
    assert len(shards) == 3 and all(p.stat().st_size <= 15 * 1024 * 1024 for p in shards)
