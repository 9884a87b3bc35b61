"""Plot drafter training curves from one or more ``train_log.json`` files (consecutive runs are chained).

    python benchmarks/plot_train_log.py run1/train_log.json run2/train_log.json --out loss.png

Panels: weighted block cross-entropy, top-1 accuracy at block position 1, training-batch tau: ``tau`` (accept
length averaged over anchor positions) and, in logs that have it, ``tau_steps`` (harmonic mean, the estimate of
tokens per verify step). Lines are 25-step moving averages.
"""

from __future__ import annotations

import argparse
import json


def smooth(values: list[float], window: int = 25) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("logs", nargs="+")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    offset = 0
    for i, path in enumerate(a.logs):
        hist = json.load(open(path))["history"]
        steps = [offset + h["step"] for h in hist]
        for ax, key in ((axes[0], "loss"), (axes[1], "acc1"), (axes[2], "tau"), (axes[2], "tau_steps")):
            pts = [(s, h[key]) for s, h in zip(steps, hist) if key in h and h[key] == h[key]]
            if pts:
                ax.plot([p[0] for p in pts], smooth([p[1] for p in pts]), label=f"run {i + 1} {key}")
        offset = steps[-1]
    for ax, title in zip(axes, ("weighted CE", "top-1 acc, block position 1", "training-batch tau")):
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_yscale("log")
    for ax in axes:
        ax.legend()
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(a.out)


if __name__ == "__main__":
    main()
