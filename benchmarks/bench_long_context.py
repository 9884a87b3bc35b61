"""One long prompt served by no-spec and by DFLASH, one server at a time, with the server's health watched.

For each server (no speculation, then sglang-dflash's DFLASH) the script starts ``sglang.launch_server`` exactly as
a user would (the plugin sets up a CPU-only machine itself), sends a short warm-up request, then one prompt of
``--prompt-tokens`` tokens (ShareGPT text, then a question) asking for ``--max-new-tokens`` greedy tokens, and
meanwhile asks ``/health`` and ``/health_generate`` every ``--health-every`` seconds (what a supervisor does).
After the long request a short request must still be answered (no crash, no leaked KV: SGLang checks its pools
when idle and stops the server on a leak), and DFLASH's output must equal no-spec's token for token.

Prints a table and writes ``<out>/results.json`` (per server: seconds, output ids, accept statistics, every health
answer with its time).

    python benchmarks/bench_long_context.py --out results/long_context
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from pathlib import Path

import requests
import torch
from transformers import AutoTokenizer

from bench_dflash import Server
from sglang_dflash import assets, data


def long_prompt(tokenizer, n_tokens: int) -> list[int]:
    """``n_tokens`` ids: ShareGPT conversations' text joined until the budget, then a summary request."""
    question = tokenizer.encode("\n\nSummarize the text above in three sentences.", add_special_tokens=False)
    ids: list[int] = []
    for record in data.iter_json_records(data.sharegpt_file()):
        for turn in data.user_turns(record):
            ids += tokenizer.encode(turn + "\n", add_special_tokens=False)
        if len(ids) >= n_tokens:
            break
    return ids[: n_tokens - len(question)] + question


class HealthWatch(threading.Thread):
    """Asks ``/health`` and ``/health_generate`` every ``every`` seconds until stopped; keeps each answer."""

    def __init__(self, url: str, every: float):
        super().__init__(daemon=True)
        self.url, self.every, self.answers, self.done = url, every, [], threading.Event()
        self.t0 = time.perf_counter()

    def run(self):
        while not self.done.is_set():
            for path in ("/health", "/health_generate"):
                t = time.perf_counter() - self.t0
                try:
                    code = requests.get(self.url + path, timeout=30).status_code
                except requests.RequestException as e:
                    code = type(e).__name__
                self.answers.append({"t": round(t, 1), "path": path, "status": code})
            self.done.wait(self.every)


def serve(name: str, target: Path, draft: Path | None, ids: list[int], args, out: Path) -> dict:
    flags = ["--dtype", "float32", "--sleep-on-idle"] if not torch.cuda.is_available() else \
        ["--mem-fraction-static", "0.5"]
    server = Server(name, target, draft, "sglang_dflash", out, flags=flags)
    try:
        if not server.wait(time.time() + args.startup_timeout):
            raise SystemExit(f"{name}: server {server.error}; see {server.log}")
        server.generate(ids[:32], 4)  # warm-up
        watch = HealthWatch(server.url, args.health_every)
        watch.start()
        t0 = time.perf_counter()
        reply = server.generate(ids, args.max_new_tokens)
        seconds = time.perf_counter() - t0
        watch.done.set()
        watch.join()
        after = server.generate(ids[:16], 8)  # still serving afterwards
        meta = reply["meta_info"]
        return {"seconds": seconds, "output_ids": reply["output_ids"], "completion_tokens": meta["completion_tokens"],
                "verify_steps": meta.get("spec_verify_ct", 0), "health": watch.answers,
                "served_after": len(after["output_ids"]) > 0 and server.proc.poll() is None}
    finally:
        server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--target", default=None, help="default: the bundled SmolLM2-135M-Instruct")
    ap.add_argument("--draft", default=None, help="default: the bundled drafter")
    ap.add_argument("--prompt-tokens", type=int, default=7991)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--health-every", type=float, default=5.0)
    ap.add_argument("--startup-timeout", type=float, default=900)
    ap.add_argument("--out", default="bench_long_context")
    args = ap.parse_args()
    target = Path(args.target) if args.target else assets.smollm2_path()
    draft = Path(args.draft) if args.draft else assets.bundled_drafter_path()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    ids = long_prompt(AutoTokenizer.from_pretrained(target), args.prompt_tokens)

    results = {"prompt_tokens": len(ids), "max_new_tokens": args.max_new_tokens,
               "device": "cuda" if torch.cuda.is_available() else "cpu", "servers": {}}
    for name, d in (("no-spec", None), ("DFLASH", draft)):
        print(f"{name}: starting", flush=True)
        results["servers"][name] = serve(name, target, d, ids, args, out)
        (out / "results.json").write_text(json.dumps(results, indent=1))
    ref = results["servers"]["no-spec"]
    print(f"\none prompt of {len(ids)} tokens, {args.max_new_tokens} new tokens (greedy), {results['device']}")
    print("| server | seconds | vs no-spec | accept length | health answers not 200 | served after | "
          "output == no-spec |\n|---|---|---|---|---|---|---|")
    for name, r in results["servers"].items():
        bad = [a for a in r["health"] if a["status"] != 200]
        tau = r["completion_tokens"] / r["verify_steps"] if r["verify_steps"] else 1.0
        print(f"| {name} | {r['seconds']:.1f} | {ref['seconds'] / r['seconds']:.2f}x | {tau:.2f} | "
              f"{len(bad)}/{len(r['health'])} | {r['served_after']} | {r['output_ids'] == ref['output_ids']} |")
    print(f"wrote {out / 'results.json'}")
    ok = all(r["served_after"] and r["output_ids"] == ref["output_ids"] for r in results["servers"].values())
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
