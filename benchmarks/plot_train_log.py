"""Plot drafter training curves from one or more ``train_log.json`` files (consecutive runs are chained).

    python benchmarks/plot_train_log.py run1/train_log.json run2/train_log.json --out loss.png

Panels: weighted block cross-entropy, top-1 accuracy at block position 1, training-batch tau: ``tau`` (accept
length averaged over anchor positions) and, in logs that have it, ``tau_steps`` (harmonic mean, the estimate of
tokens per verify step); lines are 25-step moving averages. In logs that have it, a fourth panel shows the
per-position acceptance (the fraction of blocks whose draft position k is accepted, i.e. whose leading-correct
count is >= k) against k, averaged over the first and the last ``--window`` steps of each run.
"""

from __future__ import annotations

import argparse
import json
import math


def smooth(values: list[float], window: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def mean_acceptance(history: list[dict]) -> list[float]:
    """Per-position acceptance averaged over ``history`` rows (rows without blocks, all NaN, are skipped)."""
    rows = [h["accept"] for h in history if "accept" in h and not all(math.isnan(x) for x in h["accept"])]
    if not rows:
        return []
    return [sum(col) / len(rows) for col in zip(*rows)]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", required=True)
    ap.add_argument("--window", type=int, default=100, help="steps averaged for the acceptance panel")
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(20, 4))
    offset = 0
    for i, path in enumerate(a.logs):
        with open(path) as f:
            hist = json.load(f)["history"]
        steps = [offset + h["step"] for h in hist]
        for ax, key in ((axes[0], "loss"), (axes[1], "acc1"), (axes[2], "tau"), (axes[2], "tau_steps")):
            pts = [(s, h[key]) for s, h in zip(steps, hist) if key in h and h[key] == h[key]]
            if pts:
                ax.plot([p[0] for p in pts], smooth([p[1] for p in pts]), label=f"run {i + 1} {key}")
        for rows, style, when in ((hist[: a.window], "--", "first"), (hist[-a.window:], "-", "last")):
            acc = mean_acceptance(rows)
            if acc:
                axes[3].plot(range(1, len(acc) + 1), acc, style, marker=".", color=f"C{i % 10}",
                             label=f"run {i + 1}, {when} {len(rows)} steps (tau {1 + sum(acc):.2f})")
        offset = steps[-1] if steps else offset
    titles = ("weighted CE", "top-1 acc, block position 1", "training-batch tau", "acceptance by draft position")
    for ax, title in zip(axes, titles):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    axes[3].set_xlabel("draft position k (accepted iff leading-correct count >= k)")
    axes[3].set_ylim(0, 1)
    for ax in axes:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
