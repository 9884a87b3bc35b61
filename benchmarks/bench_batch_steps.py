"""Time per decode step at given batch sizes: no-spec against DFLASH with nothing accepted, widths pinned.

Each server (one at a time) gets ``--concurrency`` concurrent requests (greedy unless ``--temperature``) of
``--new-tokens`` tokens each (``ignore_eos``), after one warm-up round (comma lists of both are cells, which every
server runs in one start-up, lowest concurrency first); with a random draft nothing is accepted, so
every DFLASH step commits one token per request and wall time / ``--new-tokens`` is the time of one step at that
batch size. ``w1`` pins the verify width to 1 (a plain decode step plus the draft's context K/V), ``w2`` / ``w4`` /
``w8`` pin those widths, ``fixed`` verifies the whole block, ``adaptive`` is the default server (the width policy
chooses; `--servers nospec,w1,adaptive`). The difference of ``w1`` / ``fixed`` to no-spec is the DFLASH path's own
per-step cost (host work and launches at a small target; the verify itself at a large one), with acceptance and
the width policy out of the picture. With ``--held-out`` and a trained draft the requests are real prompts: a step
then commits what it accepts, ms per step reads as ms per committed token, and the table adds the requests' accept
length (tokens per decode step, from their ``meta_info``) beside the tokens per batch step (which falls below it when
sampled requests drift apart and a pass ends on steps of its last requests).

    python benchmarks/bench_batch_steps.py --out DIR                  # random_checkpoints.py's tiny shape, built here
    python benchmarks/bench_batch_steps.py --target T --draft D --out DIR --concurrency 64
    python benchmarks/bench_batch_steps.py --target T --draft TRAINED --held-out --concurrency 16,64 --temperature 0,1 \
        --servers nospec,adaptive,w4,fixed --out DIR

Prints a table per cell (and each DFLASH server's decode steps per verify width over the timed passes) and writes
``<out>/results.json`` (``cells`` -> ``t0_c64`` -> ``servers`` -> name; ``startup`` per server);
``--kernel-profile STEPS`` adds each server's GPU time per step by kernel category and its top kernels (SGLang's
torch profiler over one more pass); ``--host-profile SECONDS`` samples the scheduler process's Python stacks with
py-spy for that long under the same load, idle waits included (collapsed stacks in ``<out>/<cell>/host_<server>.txt``),
and prints the functions whose share of the samples differs most from no-spec's.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import re
import shutil
import statistics
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import requests
import torch

from bench_dflash import (SERVER_FLAGS, Server, describe_kernel_profile, held_out_texts, read_kernel_profile,
                          start_kernel_profile)
from random_checkpoints import build

WIDTHS = {"w1": '{"widths": [1]}', "w2": '{"widths": [2]}', "w4": '{"widths": [4]}', "w8": '{"widths": [8]}',
          "fixed": '{"adaptive": false}', "adaptive": '{}'}


def flags(concurrency: int) -> list[str]:
    if torch.cuda.is_available():
        return [*SERVER_FLAGS, "--cuda-graph-max-bs", str(concurrency), "--max-running-requests", str(concurrency)]
    return ["--dtype", "float32", "--sleep-on-idle", "--max-running-requests", str(concurrency)]


def load(server: Server, concurrency: int, new_tokens: int, prompt_len: int = 5, temperature: float = 0.0,
         prompts: list[list[int]] | None = None) -> tuple[float, float | None]:
    """(seconds, `accept_length` of the replies) for ``concurrency`` concurrent requests of ``new_tokens`` tokens at
    ``temperature`` (above 0: DFLASH accepts by sampling), request i on ``prompts[i % len(prompts)]`` or else a
    distinct synthetic prompt of ``prompt_len`` tokens."""
    def one(i: int) -> dict:
        synthetic = [10 + i, 20 + i] + [30 + (7 * j) % 1000 for j in range(prompt_len - 2)]
        ids = prompts[i % len(prompts)] if prompts else synthetic
        r = requests.post(server.url + "/generate", timeout=1800, json={
            "input_ids": ids,
            "sampling_params": {"temperature": temperature, "max_new_tokens": new_tokens, "ignore_eos": True}})
        r.raise_for_status()
        return r.json()["meta_info"]

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as ex:
        metas = list(ex.map(one, range(concurrency)))
    seconds = time.perf_counter() - t0
    done = [m["completion_tokens"] for m in metas]
    if done != [new_tokens] * concurrency:
        raise SystemExit(f"{server.name}: replies of {sorted(set(done))} tokens, expected {new_tokens}")
    return seconds, accept_length(metas)


def accept_length(metas: list[dict]) -> float | None:
    """Tokens a request commits per decode step, pooled over replies' ``meta_info`` (the first token of each comes
    from the prefill; ``spec_verify_ct`` counts its decode steps); None without speculation (no step count)."""
    if not metas or any(not m.get("spec_verify_ct") for m in metas):
        return None
    return sum(m["completion_tokens"] - 1 for m in metas) / sum(m["spec_verify_ct"] for m in metas)


def startup_report(log: str, seconds: float) -> dict:
    """What a server's start-up ``log`` says about its CUDA graph captures: SGLang's (``[what, seconds]`` each, in
    log order) and the DFLASH step's (graphs planned; graphs, seconds and GB once done), with the ``seconds`` the
    start took (or had taken when it was given up)."""
    sglang = [[m[1], float(m[2])] for m in re.finditer(r"Capture ([\w ]+?) CUDA graph end\. elapsed=([\d.]+) s", log)]
    planned = re.search(r"sglang-dflash: capturing the decode step: .*?, (\d+) graphs", log)
    done = re.search(r"decode step captured as CUDA graphs .*?; (\d+) graphs in ([\d.]+) s "
                     r"\(the first, with its kernels' first compilation: ([\d.]+) s; eager warm-ups ([\d.]+) s, "
                     r"recording ([\d.]+) s\), (-?[\d.]+) GB", log)
    return {"seconds": seconds, "sglang_captures": sglang, "step_graphs_planned": planned and int(planned[1]),
            "step_graphs": done and {"graphs": int(done[1]), "seconds": float(done[2]), "first_seconds": float(done[3]),
                                     "warmup_seconds": float(done[4]), "record_seconds": float(done[5]),
                                     "gb": float(done[6])}}


def describe_startup(r: dict) -> str:
    parts = [f"start-up {r['seconds']:.0f} s"]
    if r["sglang_captures"]:
        parts.append("SGLang's graphs " + ", ".join(f"{what} {sec:.1f} s" for what, sec in r["sglang_captures"]))
    if r["step_graphs"]:
        g = r["step_graphs"]
        parts.append(f"decode step {g['graphs']} graphs in {g['seconds']:.1f} s (first {g['first_seconds']:.1f} s; "
                     f"warm-ups {g['warmup_seconds']:.1f} s, recording {g['record_seconds']:.1f} s), {g['gb']:.2f} GB")
    elif r["step_graphs_planned"]:
        parts.append(f"decode step capture of {r['step_graphs_planned']} graphs begun, not finished")
    return "; ".join(parts)


def held_out_prompts(target: Path, n: int) -> list[list[int]]:
    """``n`` held-out prompts (MT-Bench, HumanEval, GSM8K interleaved), chat-templated token ids of ``target``."""
    from transformers import AutoTokenizer

    from sglang_dflash.data import apply_chat

    tok = AutoTokenizer.from_pretrained(target)
    return [tok.encode(p, add_special_tokens=False) for p in apply_chat(held_out_texts(-(-n // 3)), tok)[:n]]


def tokens_per_step(widths: dict[str, int], new_tokens: int, repeats: int) -> float:
    """Tokens per request per batch decode step over ``repeats`` passes of ``new_tokens`` tokens (the first of each
    comes from the prefill), from a DFLASH server's steps per width in them; 1.0 for no-spec ({}). Below the
    requests' `accept_length` when they drift apart (sampled acceptance): the last requests of a pass then run
    steps of their own."""
    steps = sum(widths.values())
    return (new_tokens - 1) * repeats / steps if steps else 1.0


def verify_widths(server: Server) -> dict[str, int]:
    """A DFLASH server's decode steps per verify width since start-up (``/get_server_info``); {} for no-spec."""
    info = requests.get(server.url + "/get_server_info", timeout=30).json()
    return info["internal_states"][0].get("dflash_verify_widths", {}).get("steps_per_width", {})


def steps_between(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """Steps per width taken between two `verify_widths` readings."""
    return {w: n - before.get(w, 0) for w, n in after.items() if n > before.get(w, 0)}


def scheduler_pid(server: Server) -> int:
    """The pid of ``server``'s scheduler process (SGLang names it ``sglang::scheduler``)."""
    import psutil

    for child in psutil.Process(server.proc.pid).children(recursive=True):
        if "scheduler" in " ".join(child.cmdline()) or "scheduler" in child.name():
            return child.pid
    raise SystemExit(f"{server.name}: no scheduler process under pid {server.proc.pid}")


def host_profile(server: Server, seconds: float, out: Path, load_once) -> Path:
    """py-spy's collapsed stacks of ``server``'s scheduler over ``seconds`` while ``load_once()`` runs back to back."""
    py_spy = shutil.which("py-spy")
    if py_spy is None:
        raise SystemExit("--host-profile needs py-spy on PATH (pip install py-spy)")
    path = out / f"host_{server.name}.txt"
    spy = subprocess.Popen([py_spy, "record", "-p", str(scheduler_pid(server)), "-d", str(int(seconds)), "-r", "500",
                            "-f", "raw", "-o", str(path), "--nonblocking", "--idle"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.STDOUT)
    stop = threading.Event()

    def keep_loaded():
        while not stop.is_set():
            load_once()

    loader = threading.Thread(target=keep_loaded)
    loader.start()
    spy.wait()
    stop.set()
    loader.join()
    return path


def inclusive_shares(path: Path) -> dict[str, float]:
    """Share of the scheduler loop's samples in each function (inclusive: a frame counts once per sample) of a
    py-spy raw file (the scheduler's event-loop thread only: its other threads mostly sleep)."""
    counts, total = collections.Counter(), 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        if not n.isdigit() or "Scheduler.event_loop" not in stack:
            continue
        total += int(n)
        for frame in {re.sub(r" \((?:[^()]*/)?([^/()]+/)?([^/()]+):\d+\)$", r" (\1\2)", f) for f in stack.split(";")}:
            counts[frame] += int(n)
    return {k: v / max(total, 1) for k, v in counts.items()}


def cells_of(temperatures: str, concurrencies: str) -> list[tuple[float, int]]:
    """``--temperature`` x ``--concurrency`` (comma lists) as (temperature, concurrency) cells, lowest concurrency
    first: every server runs all of them in one start-up."""
    bad = (f"--concurrency {concurrencies!r} / --temperature {temperatures!r}: give positive request counts and "
           "temperatures >= 0, e.g. --concurrency 16,64 --temperature 0,1")
    try:
        temps = [float(t) for t in temperatures.split(",")]
        concs = [int(c) for c in concurrencies.split(",")]
    except ValueError:
        raise SystemExit(bad) from None
    if min(concs) < 1 or min(temps) < 0:
        raise SystemExit(bad)
    return [(t, c) for c in sorted(set(concs)) for t in dict.fromkeys(temps)]


def cell_name(temperature: float, concurrency: int) -> str:
    return f"t{temperature:g}_c{concurrency}"


def run_cell(server: Server, args, temperature: float, concurrency: int, prompts, out: Path) -> dict:
    """One warm-up pass, ``args.repeats`` timed passes (and the profiles asked for) of one cell on a running server;
    -> the cell's figures for this server; its profiles go to ``out``."""
    out.mkdir(exist_ok=True)
    one_pass = functools.partial(load, server, concurrency, args.new_tokens, args.prompt_len, temperature,
                                 prompts and prompts[:concurrency])
    one_pass()  # warm-up
    widths_before = verify_widths(server)
    passes, accepts = zip(*[one_pass() for _ in range(args.repeats)])
    widths = steps_between(widths_before, verify_widths(server))
    ms = statistics.median(passes) / args.new_tokens * 1e3
    per_step = tokens_per_step(widths, args.new_tokens, args.repeats)
    r = {"seconds": list(passes), "ms_per_step": ms, "steps_per_width": widths,
         "accept_length": statistics.mean(accepts) if None not in accepts else 1.0, "tokens_per_step": per_step,
         "ms_per_decode_step": ms * per_step}
    if args.kernel_profile:
        trace_dir = start_kernel_profile(server, args.kernel_profile, out)
        one_pass()
        r["kernel_profile"] = read_kernel_profile(trace_dir, args.kernel_profile)
    if args.host_profile:
        host_profile(server, args.host_profile, out, one_pass)
    spread = ", ".join(f"{s:.2f}" for s in passes)
    print(f"{server.name} {cell_name(temperature, concurrency)}: {ms:.2f} ms per step (passes {spread} s)"
          + (f", decode steps per verify width {widths}" if widths else ""), flush=True)
    return r


def report(results: dict, cell: dict, args, out: Path) -> None:
    """The table of one cell (and its kernel / host profiles)."""
    servers = cell["servers"]
    ref = servers.get("nospec", {}).get("ms_per_step")
    context = "held-out prompts" if args.held_out else f"{args.prompt_len}-token prompts"
    print(f"\n{cell['concurrency']} concurrent requests x {args.new_tokens} tokens after {context}, "
          f"temperature {cell['temperature']:g}, {results['device']}")
    print("| server | ms per step (per token) | vs no-spec | accept length | tokens per batch step | "
          "ms per batch step |\n|---|---|---|---|---|---|")
    for name, r in servers.items():
        ratio = f"{ref / r['ms_per_step']:.2f}x" if ref else "—"
        print(f"| {name} | {r['ms_per_step']:.2f} | {ratio} | {r['accept_length']:.2f} | {r['tokens_per_step']:.2f} | "
              f"{r['ms_per_decode_step']:.2f} |")
    for name, r in servers.items():
        prof = r.get("kernel_profile")
        if prof is None:
            continue
        print("\n" + describe_kernel_profile(name, prof))
        for k in prof.get("top_kernels", []):
            print(f"  {k['us_per_step']:7.1f} us  {k['per_step']:5.1f}x  {k['name']}")
    if args.host_profile and "nospec" in servers:
        ref_shares = inclusive_shares(out / "host_nospec.txt")
        for name in servers:
            if name == "nospec":
                continue
            shares = inclusive_shares(out / f"host_{name}.txt")
            print(f"\nhost profile, scheduler process: % of samples in each function, no-spec vs {name} "
                  f"(largest differences)")
            keys = sorted(set(shares) | set(ref_shares), key=lambda k: -abs(shares.get(k, 0) - ref_shares.get(k, 0)))
            for k in keys[:40]:
                print(f"  {100 * ref_shares.get(k, 0):5.1f} {100 * shares.get(k, 0):5.1f}  {k[:160]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="default: a random tiny target built under --out")
    ap.add_argument("--draft", default=None, help="a draft for --target that accepts nothing (e.g. a random one)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--concurrency", default="64", help="requests at once; a comma list runs each on every server")
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=5, help="tokens per prompt (>= 2): the context each step reads")
    ap.add_argument("--held-out", action="store_true",
                    help="prompts from the held-out MT-Bench / HumanEval / GSM8K sets (chat template) instead of "
                         "synthetic ones: with a trained --draft, the steps of a real workload (a step then commits "
                         "its accepted tokens, and ms per step reads as ms per committed token)")
    ap.add_argument("--temperature", default="0",
                    help="above 0 the steps include DFLASH's sampled accept (no-spec samples too); a comma list "
                         "runs each on every server")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--servers", default="nospec,w1,fixed")
    ap.add_argument("--startup-timeout", type=float, default=600)
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                    help="after the timed passes, profile STEPS decode steps of one more pass (SGLang's torch "
                         "profiler, GPU only) and report each server's GPU time per step and its top kernels")
    ap.add_argument("--host-profile", type=float, default=0, metavar="SECONDS",
                    help="after the timed passes, sample the scheduler's Python stacks with py-spy for SECONDS under "
                         "the same load and compare each server's functions with no-spec's")
    args = ap.parse_args()
    cells = cells_of(args.temperature, args.concurrency)
    most = max(c for _, c in cells)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.target:
        target, draft = Path(args.target), Path(args.draft)
    else:
        target, draft = build("tiny", out / "models", "cuda" if torch.cuda.is_available() else "cpu")
    prompts = held_out_prompts(target, most) if args.held_out else None
    results = {"date": time.strftime("%Y-%m-%d"), "args": vars(args),
               "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu", "startup": {},
               "cells": {cell_name(t, c): {"temperature": t, "concurrency": c, "servers": {}} for t, c in cells}}
    for name in args.servers.split(","):
        extra = [] if name == "nospec" else ["--speculative-adaptive-config", WIDTHS[name]]
        t0 = time.time()
        server = Server(name, target, None if name == "nospec" else draft, "sglang_dflash", out,
                        extra=extra, flags=flags(most))
        try:
            ready = server.wait(t0 + args.startup_timeout)
            results["startup"][name] = startup_report(server.log.read_text(errors="replace"), time.time() - t0)
            print(f"{name}: {describe_startup(results['startup'][name])}", flush=True)
            if not ready:
                raise SystemExit(f"{name}: {server.error}; see {server.log}")
            for cell, r in results["cells"].items():
                r["servers"][name] = run_cell(server, args, r["temperature"], r["concurrency"], prompts, out / cell)
                (out / "results.json").write_text(json.dumps(results, indent=1))
        finally:
            server.stop()
    for cell, r in results["cells"].items():
        report(results, r, args, out / cell)


if __name__ == "__main__":
    main()
