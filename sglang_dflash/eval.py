"""Acceptance-length evaluation of a DFlash drafter with the reference engine :class:`sglang_dflash.hf.DFlashLM`.

Two tau figures, labelled apart everywhere:

* ``tau`` (per step): mean over every (request, verify step) of ``accept_len + 1``, tokens committed per target
  verify forward, bonus included (`tau_per_step`);
* ``tau_per_request`` (z-lab's benchmark, how published tau figures are computed): for each request the mean of
  the tokens its output gained per verify step, then the mean over requests (`tau_per_request`).

CLI::

    python -m sglang_dflash.eval --target smollm2 --draft bundled --datasets mtbench,humaneval,gsm8k \\
        --block-sizes 8,16 --temperatures 0,1 --num-prompts 40 --max-new-tokens 256 --out eval.json --plot eval.png
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

from .data import EVAL_DATASETS, apply_chat, eval_prompts, load_prompt_file


def tau_per_step(steps: Sequence[Sequence[int]]) -> float:
    """Mean over every (request, step) of ``steps[request][step]`` (tokens per verify step); 0.0 if none."""
    flat = [n for row in steps for n in row]
    return sum(flat) / len(flat) if flat else 0.0


def tau_per_request(steps: Sequence[Sequence[int]]) -> float:
    """z-lab's tau: the mean over requests (with at least one step) of each request's mean tokens per step."""
    means = [sum(row) / len(row) for row in steps if row]
    return sum(means) / len(means) if means else 0.0


def server_tau(meta_infos: Sequence[dict]) -> dict:
    """Both tau figures from SGLang replies' ``meta_info`` (``completion_tokens``, ``spec_verify_ct``): a request's
    decode steps produced ``completion_tokens - 1`` tokens (the first comes from the prefill). Returns
    ``{"tau": per step, "tau_per_request": z-lab's}``."""
    rows = [(m["completion_tokens"] - 1, m["spec_verify_ct"]) for m in meta_infos if m.get("spec_verify_ct")]
    steps = sum(n for _, n in rows)
    return {"tau": sum(t for t, _ in rows) / steps if steps else 0.0,
            "tau_per_request": sum(t / n for t, n in rows) / len(rows) if rows else 0.0}


def dataset_prompts(name: str, num_prompts: Optional[int], tokenizer, prompts_dir: Optional[str] = None) -> list[str]:
    """Chat-formatted prompts of eval set ``name`` (from the installed packages, or ``prompts_dir/name.jsonl``)."""
    if prompts_dir is None:
        return eval_prompts(name, num_prompts, tokenizer)
    path = Path(prompts_dir) / f"{name}.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; write it with: python -m sglang_dflash.data --out {prompts_dir}")
    texts = load_prompt_file(path)
    return apply_chat(texts if num_prompts is None else texts[:num_prompts], tokenizer)


def evaluate(
    target,
    tokenizer,
    draft,
    datasets: Sequence[str] = EVAL_DATASETS,
    block_sizes: Sequence[int] = (16,),
    temperatures: Sequence[float] = (0.0,),
    num_prompts: Optional[int] = 40,
    max_new_tokens: int = 256,
    batch_size: int = 64,
    seed: int = 0,
    prompts_dir: Optional[str] = None,
    progress: bool = True,
    on_row: Optional[Callable[[list[dict]], None]] = None,
) -> list[dict]:
    """tau for every (dataset, block size, temperature). ``target``/``draft`` are loaded models on one device.

    Each row: dataset, block_size, temperature, tau (per step), tau_per_request (z-lab's), num_prompts,
    num_verify_steps (request-steps), new_tokens,
    accept_hist (counts of accept_len = 0..B-1), seconds. ``on_row(rows_so_far)`` is called after each row.
    """
    from .hf import DFlashLM

    prompts = {}
    for name in datasets:
        texts = dataset_prompts(name, num_prompts, tokenizer, prompts_dir)
        prompts[name] = [tokenizer(t, add_special_tokens=False).input_ids for t in texts]
    rows = []
    for block_size in block_sizes:  # config-major order: a cut-short run still has every dataset of the first config
        lm = DFlashLM(target, draft, block_size=block_size)
        for temp in temperatures:
            for name in datasets:
                t0 = time.perf_counter()
                accept_lens: list[int] = []
                committed: list[list[int]] = []
                new_tokens = 0
                for start in range(0, len(prompts[name]), batch_size):
                    out = lm.generate(prompts[name][start:start + batch_size], max_new_tokens=max_new_tokens,
                                      temperature=float(temp), seed=seed + start)
                    accept_lens.extend(a for row in out.accept_lens for a in row)
                    committed.extend(out.committed)
                    new_tokens += out.num_new_tokens
                tau = tau_per_step([[a + 1 for a in accept_lens]])
                tau_req = tau_per_request(committed)
                hist = torch.bincount(torch.tensor(accept_lens, dtype=torch.long), minlength=block_size).tolist()
                row = dict(dataset=name, block_size=block_size, temperature=float(temp), tau=round(tau, 4),
                           tau_per_request=round(tau_req, 4),
                           num_prompts=len(prompts[name]), num_verify_steps=len(accept_lens), new_tokens=new_tokens,
                           accept_hist=hist, seconds=round(time.perf_counter() - t0, 2))
                rows.append(row)
                if on_row is not None:
                    on_row(rows)
                if progress:
                    print(f"[eval] {name:10s} block={block_size:2d} temp={temp:g} tau per step={tau:.3f} "
                          f"per request (z-lab)={tau_req:.3f} "
                          f"steps={len(accept_lens)} tokens={new_tokens} ({row['seconds']}s)", flush=True)
    return rows


def plot(rows: list[dict], path: str | os.PathLike, title: str = "DFlash acceptance length") -> None:
    """Grouped bars: tau per dataset, one bar per (block size, temperature)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(dict.fromkeys(r["dataset"] for r in rows))
    configs = list(dict.fromkeys((r["block_size"], r["temperature"]) for r in rows))
    width = 0.8 / max(1, len(configs))
    fig, ax = plt.subplots(figsize=(1.8 + 1.6 * len(datasets), 3.6))
    for j, (bs, temp) in enumerate(configs):
        vals = [next((r["tau"] for r in rows if r["dataset"] == d and r["block_size"] == bs
                      and r["temperature"] == temp), 0.0) for d in datasets]
        xs = [i + (j - (len(configs) - 1) / 2) * width for i in range(len(datasets))]
        bars = ax.bar(xs, vals, width, label=f"B={bs}, T={temp:g}")
        ax.bar_label(bars, fmt="%.2f", fontsize=7)
    ax.set_xticks(range(len(datasets)), datasets)
    ax.set_ylabel("tau (tokens / verify step)")
    ax.set_title(title)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    from .assets import bundled_drafter_path
    from .model import load_draft
    from .train import TrainError, load_target

    p = argparse.ArgumentParser(description="Measure DFlash acceptance length (tau) per dataset.")
    p.add_argument("--target", required=True, help="HF model dir/id, or 'smollm2'")
    p.add_argument("--draft", required=True, help="drafter dir, or 'bundled' (the committed SmolLM2 drafter)")
    p.add_argument("--datasets", default=",".join(EVAL_DATASETS))
    p.add_argument("--block-sizes", default="16")
    p.add_argument("--temperatures", default="0")
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompts-dir", default=None, help="read DIR/<dataset>.jsonl instead of the installed packages")
    p.add_argument("--device", default=None)
    p.add_argument("--out", default=None, help="results JSON")
    p.add_argument("--plot", default=None, help="bar chart PNG")
    a = p.parse_args(argv)
    try:
        target, tok = load_target(a.target, a.device)
    except TrainError as e:  # a missing target directory: one line, no traceback
        raise SystemExit(f"sglang_dflash.eval: {e}") from None
    draft_path = bundled_drafter_path() if a.draft == "bundled" else Path(a.draft)
    draft = load_draft(draft_path, device=target.device, dtype=target.dtype)
    datasets = [d for d in a.datasets.split(",") if d]
    result = {
        "target": a.target,
        "draft": str(draft_path),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "device": torch.cuda.get_device_name(target.device) if target.device.type == "cuda" else "cpu",
        "dtype": str(target.dtype).removeprefix("torch."),
        "settings": {"num_prompts": a.num_prompts, "max_new_tokens": a.max_new_tokens, "seed": a.seed},
        "results": [],
    }

    def write(rows: list[dict]) -> None:
        if a.out:
            result["results"] = rows
            Path(a.out).write_text(json.dumps(result, indent=1))

    rows = evaluate(target, tok, draft, datasets, [int(x) for x in a.block_sizes.split(",")],
                    [float(x) for x in a.temperatures.split(",")], a.num_prompts, a.max_new_tokens,
                    a.batch_size, a.seed, a.prompts_dir, on_row=write)
    if a.plot:
        plot(rows, a.plot, title=f"DFlash tau: {Path(str(draft_path)).name}")
    print(json.dumps([{k: r[k] for k in ("dataset", "block_size", "temperature", "tau", "tau_per_request")} for r in rows]))


if __name__ == "__main__":
    main()
