"""Side-by-side serving speed: no speculation vs SGLang's built-in DFLASH vs sglang-dflash.

One command, one GPU. Every server is started up front (in parallel, each with a slice of
GPU memory; idle servers sleep; `--serial-workloads`: one workload's servers at a time), then each is driven alone with SGLang's own load generator
(`python -m sglang.bench_serving`) at every concurrency. Workloads:

* real:  the target + trained drafter on held-out MT-Bench / HumanEval / GSM8K prompts,
         temperature 0 and 1;
* bound_accept_all: target and draft with final norms zeroed (both always emit token 0:
         every draft token is accepted), isolating engine overhead at the best case;
* bound_accept_none: the real target with a random drafter (nothing accepted).

At temperature 0 the benchmark checks that all servers of a workload produce identical tokens, and where they do
not, that each reply parts from no-spec only at a bf16 near-tie of it (``sglang_dflash.compare``).
Every cell (server x temperature x concurrency) runs `--repeats` times, the passes interleaved over all cells
so that a slow spell of the machine hits every server alike; the table reports the median pass and the spread
of ours ((max - min) / median). `--profile` and `--timeline` add diagnostics (see their help); `--kernel-profile`
traces where a decode step's GPU time goes on every server. `--prefill-graph-tokens` captures SGLang's prefill CUDA
graph on every server (default: eager prefill).
Writes `<out>/results.json` (every pass and the medians), `<out>/throughput.png`, server logs, and prints a
table last.

    python benchmarks/bench_dflash.py --target T --draft D --out results/

At a realistic size: `benchmarks/random_checkpoints.py --shape qwen3-8b --out M` builds a random Qwen3-8B-shaped
target and a 5-layer z-lab-format draft on the GPU machine; pass M/target and M/draft, and `--serial-workloads`
(one H200 does not hold every 8B server at once).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib.util
import types
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import requests
import torch
from safetensors.torch import load_file, save_file

from sglang_dflash import compare
from sglang_dflash.eval import server_tau

REPO = Path(__file__).resolve().parent.parent
# Servers share one GPU and start together: every one sees the whole card free at start, so the KV pool is
# capped by token count (--max-total-tokens) instead of by memory fraction.
SERVER_FLAGS = ["--attention-backend", "flashinfer", "--sleep-on-idle",
                "--skip-server-warmup", "--mem-fraction-static", "0.9", "--max-total-tokens", "65536"]
# Prompt lengths (tokens) SGLang's prefill CUDA graph is captured for, on every server, or "none" (eager prefill).
# SGLang captures it by default for ~50 lengths up to 4096. The benchmark's default is eager: SGLang's breakable
# prefill graph does not replay an extend with a radix-cache prefix hit, and the identity check (and every pass after
# the first) sends the low-concurrency prompts again, so those prefills run eagerly either way; capturing
# 32,64,128,256,512 took 185 s per server with eleven servers starting at once (H200, serving run 10).
PREFILL_GRAPH_TOKENS = "none"


# sglang-dflash servers besides "ours" (adaptive verify width, the default): the envelope every cell compares with
OURS_ADAPTIVE_CONFIG = {"ours_fixed": '{"adaptive": false}', "ours_w4": '{"widths": [4]}', "ours_w8": '{"widths": [8]}'}
# Diagnostic servers, not in the envelope: ours pinned at width 1 (a plain decode step with the draft's context K/V).
OURS_DIAGNOSTIC_CONFIG = {"ours_w1": '{"widths": [1]}'}


def server_flags(base: str, prefill_graph_tokens: str) -> list[str]:
    """Every server's flags: ``base`` (space-separated) plus the prefill CUDA graph choice, captured for the
    comma-separated lengths ``prefill_graph_tokens`` or, for ``none``, off (the prefill runs eagerly)."""
    flags = base.split()
    if prefill_graph_tokens == "none":
        return [*flags, "--disable-prefill-cuda-graph"]
    sizes = sorted(int(t) for t in prefill_graph_tokens.split(","))
    if not sizes or sizes[0] < 1:
        raise ValueError(f"--prefill-graph-tokens {prefill_graph_tokens!r}: give positive token counts "
                         "(e.g. 32,64,128) or 'none'")
    return [*flags, "--cuda-graph-bs-prefill", *map(str, sizes)]


# ---- synthetic bound models -------------------------------------------------------------
def zero_final_norm(src: Path, dst: Path, key: str) -> Path:
    """Copy a HF/draft dir and zero the weight `key` (the final RMSNorm): logits become constant."""
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(src, dst)
    for f in dst.glob("*.safetensors"):
        tensors = load_file(f)
        if key in tensors:
            tensors[key] = torch.zeros_like(tensors[key])
            save_file(tensors, f, metadata={"format": "pt"})
            return dst
    raise KeyError(f"{key} not found in {src}")


def random_draft(like: Path, dst: Path) -> Path:
    from sglang_dflash.config import DFlashDraftConfig
    from sglang_dflash.model import DFlashDraftModel, save_draft

    torch.manual_seed(0)
    model = DFlashDraftModel(DFlashDraftConfig.from_pretrained(like)).to(torch.bfloat16)
    save_draft(model, dst)
    return dst


# ---- servers ----------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    PORT_RETRIES = 3  # servers starting together pick their internal ports at random: one may take another's port

    def __init__(self, name, model, draft, impl, out: Path, extra=(), flags=SERVER_FLAGS, env=None):
        """``env``: variables set for this server's process only (on top of this process's environment)."""
        self.name, self.model, self.draft, self.impl = name, model, draft, impl
        self.log = out / f"server_{name}.log"
        self.args = [*flags, *extra]
        self.env = {**os.environ, **(env or {})}
        if draft is not None:
            self.args += ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(draft)]
            self.env["SGLANG_DFLASH_IMPL"] = impl
        self.retries = self.PORT_RETRIES
        self.error = None
        self._launch()

    def _launch(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(self.model), "--port",
                    str(self.port), *self.args]
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=self.env,
                                     start_new_session=True)

    def wait(self, deadline: float) -> bool:
        while time.time() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text(errors="replace")[-4000:]
                if "address already in use" in tail and self.retries > 0:
                    self.retries -= 1
                    print(f"[bench] {self.name}: port {self.port} taken, starting again on another", flush=True)
                    self._launch()
                    continue
                self.error = f"exited with {self.proc.returncode}: " + " | ".join(tail.strip().splitlines()[-3:])
                return False
            try:
                if requests.get(self.url + "/health_generate", timeout=5).status_code == 200:
                    return True
            except requests.RequestException:
                pass
            time.sleep(2)
        self.error = "startup timeout"
        return False

    def generate(self, input_ids, max_new_tokens, reference=False):
        """Greedy /generate; a ``reference`` reply carries the top logprobs compare.near_tie_parting reads."""
        r = requests.post(self.url + "/generate", json={
            "input_ids": input_ids, "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens},
            **(compare.REFERENCE_LOGPROBS if reference else {})}, timeout=600)
        r.raise_for_status()
        return r.json()

    def stop(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)


# ---- load ---------------------------------------------------------------------------------
def held_out_texts(per_set: int, prompts_dir: str | None = None) -> list[str]:
    """The first ``per_set`` user texts of MT-Bench, HumanEval and GSM8K (the held-out sets), interleaved one of
    each in turn; from the installed packages, or ``prompts_dir/{mtbench,humaneval,gsm8k}.jsonl`` of
    ``{"prompt": ...}`` (``python -m sglang_dflash.data --out``)."""
    from sglang_dflash import data

    if prompts_dir:
        sets = [[json.loads(line)["prompt"] for line in open(Path(prompts_dir) / f"{name}.jsonl")][:per_set]
                for name in ("mtbench", "humaneval", "gsm8k")]
    else:
        sets = [data.mtbench_prompts(per_set), data.humaneval_prompts(per_set), data.gsm8k_prompts(per_set)]
    return [p for trio in zip(*sets) for p in trio]


def write_dataset(prompts: list[str], path: Path) -> Path:
    with open(path, "w") as f:
        for p in prompts:
            f.write(json.dumps({"conversations": [{"role": "user", "content": p},
                                                  {"role": "assistant", "content": "ok"}]}) + "\n")
    return path


_STOPPING = False  # set by SIGTERM: the in-process load generator's catch-all must not swallow the exit


def server_groups(workloads: list[str], impls: list[str], profile: bool, serial: bool) -> list[list[tuple]]:
    """The (workload, impl) servers, in groups that run one after another: one group of every server, or one per
    workload (``serial``). All together, bound_accept_none shares the real workload's no-spec server (same
    target); one workload at a time, it has its own."""
    plan = [(w, impl) for w in workloads for impl in impls
            if serial or not (impl == "nospec" and w == "bound_accept_none")]
    if profile:  # the real workload and the every-token-accepted bound (16 tokens per step)
        plan += [(w, "ours_profiled") for w in ("real", "bound_accept_all") if w in workloads]
    return [[key for key in plan if key[0] == w] for w in workloads] if serial else [plan]


def _stop(*_):
    global _STOPPING
    _STOPPING = True
    sys.exit(143)


def bench_serving(server: Server, tokenizer: Path, dataset: Path, conc: int, num_prompts: int, out_len: int,
                  temperature: float, out: Path) -> dict:
    """One `sglang.bench_serving` run, in-process (its CLI entry point with our argv)."""
    if "datasets" not in sys.modules and importlib.util.find_spec("datasets") is None:
        # sglang.benchmark imports HF `datasets` for its multimodal sets only; the custom set never calls it.
        sys.modules["datasets"] = types.ModuleType("datasets")
        sys.modules["datasets"].load_dataset = None
    from sglang.benchmark.serving import cli_main

    result_file = out / f"bs_{server.name}_c{conc}_t{temperature:g}.jsonl"
    # The bound_accept_all models always emit token 0, a special token: with SGLang's default
    # skip_special_tokens its text stays empty, bench_serving never sees a first chunk and reports TTFT 0 with
    # the whole latency in TPOT. Special tokens are kept in the text for every workload (same params as
    # bench_serving's own, plus this one), so TTFT and TPOT are measured alike everywhere.
    sampling = {"temperature": temperature, "max_new_tokens": out_len, "ignore_eos": False,
                "skip_special_tokens": False}
    argv = ["bench_serving", "--backend", "sglang", "--base-url", server.url,
            "--tokenizer", str(tokenizer), "--dataset-name", "custom", "--dataset-path", str(dataset),
            "--apply-chat-template", "--num-prompts", str(num_prompts), "--max-concurrency", str(conc),
            "--sharegpt-output-len", str(out_len), "--temperature", str(temperature), "--disable-tqdm",
            "--disable-ignore-eos", "--seed", "1", "--output-file", str(result_file),
            "--extra-request-body", json.dumps({"sampling_params": sampling})]
    saved = sys.argv
    sys.argv = argv
    try:
        cli_main()
    except BaseException as e:  # a failed run is recorded, the benchmark goes on (unless it is being stopped)
        if _STOPPING:
            raise
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        sys.argv = saved
    if not result_file.exists():
        return {"error": "bench_serving wrote no result"}
    row = json.loads(result_file.read_text().strip().splitlines()[-1])
    return {k: row.get(k) for k in ("output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms",
                                    "accept_length", "completed", "total_output_tokens", "duration")}


def pass_order(cells: list) -> list:
    """Cells (workload, impl, server, temperature, concurrency) of a pass: by concurrency, lowest first (stable, plan
    order within), so that a time budget cuts the costliest cells and every server's 1-request cells run (run 10's
    budget, spent in plan order, left the real workload's DFLASH servers unmeasured)."""
    return sorted(cells, key=lambda cell: cell[4])


def timeline_delta(before: dict, after: dict) -> dict:
    """Two snapshots of a server's StepTimeline summary ({key: {count, mean_ms}}) -> the calls in between, same form
    (the server rewrites its file every 20 calls, so a cell's last few calls may count towards the next cell)."""
    got = {}
    for key, a in after.items():
        b = before.get(key, {"count": 0, "mean_ms": 0.0})
        n = a["count"] - b["count"]
        if n > 0:
            got[key] = {"count": n, "mean_ms": (a["mean_ms"] * a["count"] - b["mean_ms"] * b["count"]) / n}
    return got


def check_identical(servers: list[Server], prompts_ids: list[list[int]], max_new_tokens: int) -> dict:
    """Greedy replies of every server to every prompt against the first server's (the reference, with top
    logprobs): per server the prompts whose reply differs, and of those the ones that part at a near-tie of the
    reference (sglang_dflash.compare: bf16 rounding, not an error); ``identical`` means no difference at all,
    ``identical_up_to_near_ties`` no other difference; ``tau`` per speculative server, per step and per request
    (z-lab's definition), from these replies (sglang_dflash.eval.server_tau)."""
    outs = {}
    for k, s in enumerate(servers):
        with cf.ThreadPoolExecutor(16) as ex:
            outs[s.name] = list(ex.map(lambda ids: s.generate(ids, max_new_tokens, reference=k == 0), prompts_ids))
    ref = outs[servers[0].name]
    mismatches, near_ties = {}, {}
    for s in servers[1:]:
        mismatches[s.name] = [i for i, (a, b) in enumerate(zip(ref, outs[s.name])) if a["output_ids"] != b["output_ids"]]
        near_ties[s.name] = [i for i in mismatches[s.name] if compare.near_tie_parting(
            ref[i]["output_ids"], outs[s.name][i]["output_ids"], compare.sglang_top(ref[i])) is not None]
    taus = {s.name: server_tau([o["meta_info"] for o in outs[s.name]]) for s in servers
            if any(o["meta_info"].get("spec_verify_ct") for o in outs[s.name])}
    return {"reference": servers[0].name, "num_prompts": len(prompts_ids), "mismatched_prompt_indices": mismatches,
            "near_tie_prompt_indices": near_ties, "identical": all(not v for v in mismatches.values()),
            "identical_up_to_near_ties": all(len(near_ties[n]) == len(v) for n, v in mismatches.items()),
            "tau": taus}


# ---- kernel profile -----------------------------------------------------------------------
# Kernel-name patterns of the categories a decode step's GPU time is reported in (first match wins).
KERNEL_CATEGORIES = (
    ("sglang-dflash triton", ("_build_block_kernel", "_accept_kernel")),
    ("norm", ("rmsnorm", "RMSNorm", "norm_kernel", "Norm")),
    ("attention", ("BatchPrefill", "BatchDecode", "MergeStates", "Attention", "attention")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "cublas", "Gemm", "splitK")),
    ("rope", ("rope", "rotary", "Rotary")),
    ("kv store", ("store_kv", "set_kv", "kv_buffer", "copy_to_kv")),
    ("memcpy / memset", ("Memcpy", "Memset", "memcpy", "memset")),
    ("reduce / argmax", ("reduce", "argmax", "ArgMax", "max_kernel", "softmax")),
    ("elementwise", ("elementwise", "vectorized", "act_and_mul", "silu", "index", "cat", "fill")),
)


def kernel_category(name: str) -> str:
    for category, patterns in KERNEL_CATEGORIES:
        if any(p in name for p in patterns):
            return category
    return "other"


# CUDA runtime calls in which the host waits for the device: the calls that stop the host running ahead of the GPU.
HOST_WAITS = ("cudaStreamSynchronize", "cudaEventSynchronize", "cudaDeviceSynchronize", "cudaMemcpy",
              "cudaStreamWaitEvent")


def summarize_trace(events: list[dict], steps: int, top: int = 20) -> dict:
    """Chrome-trace events of ``steps`` decode steps -> GPU time per step: busy (sum of kernel / memcpy / memset
    durations), span (first start to last end), launches, per-category and top-kernel microseconds (all / steps);
    ``host_waits``: calls and microseconds per step of the runtime calls where the host may wait for the device
    (`HOST_WAITS`; ``cudaMemcpy`` without ``Async``)."""
    gpu = [e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu or steps < 1:
        return {"error": "no GPU events in the trace"}
    start = min(e["ts"] for e in gpu)
    end = max(e["ts"] + e["dur"] for e in gpu)
    by_cat, by_name = {}, {}
    for e in gpu:
        cat = kernel_category(e["name"])
        by_cat[cat] = by_cat.get(cat, 0.0) + e["dur"]
        n = by_name.setdefault(e["name"][:90], [0, 0.0])
        n[0] += 1
        n[1] += e["dur"]
    busy = sum(e["dur"] for e in gpu)
    names = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
    waits = {}
    for e in events:
        name = e.get("name", "")
        if e.get("ph") == "X" and e.get("cat") == "cuda_runtime" and name in HOST_WAITS:
            w = waits.setdefault(name, [0, 0.0])
            w[0] += 1
            w[1] += e.get("dur", 0)
    return {
        "steps": steps,
        "busy_us_per_step": busy / steps,
        "span_us_per_step": (end - start) / steps,
        "launches_per_step": len(gpu) / steps,
        "categories_us_per_step": {c: v / steps for c, v in sorted(by_cat.items(), key=lambda kv: -kv[1])},
        "top_kernels": [{"name": k, "per_step": c / steps, "us_per_step": d / steps} for k, (c, d) in names],
        "host_waits": {k: {"per_step": c / steps, "us_per_step": d / steps} for k, (c, d) in sorted(waits.items())},
    }


def kernel_profile(server: "Server", prompt_ids: list[int], steps: int, tokens_per_step: int, out: Path,
                   timeout: float = 120) -> dict:
    """Profile ``steps`` decode steps of one request (greedy, ``(steps + 4) * tokens_per_step`` new tokens, EOS
    ignored) on an otherwise idle ``server`` (`start_kernel_profile`) and summarize them (`read_kernel_profile`)."""
    trace_dir = start_kernel_profile(server, steps, out)
    requests.post(server.url + "/generate", json={"input_ids": prompt_ids, "sampling_params": {
        "temperature": 0, "max_new_tokens": (steps + 4) * tokens_per_step, "ignore_eos": True}},
        timeout=600).raise_for_status()
    return read_kernel_profile(trace_dir, steps, timeout)


def start_kernel_profile(server: "Server", steps: int, out: Path) -> Path:
    """Start SGLang's torch profiler (``/start_profile``: GPU activity only, by stage) on ``server`` for its next
    ``steps`` decode steps; returns the folder its traces go to."""
    trace_dir = out / f"profile_{server.name}"
    shutil.rmtree(trace_dir, ignore_errors=True)
    r = requests.post(server.url + "/start_profile", json={
        "output_dir": str(trace_dir), "num_steps": steps, "activities": ["GPU"], "profile_by_stage": True,
        "with_stack": False, "record_shapes": False}, timeout=30)
    r.raise_for_status()
    return trace_dir


def describe_kernel_profile(name: str, prof: dict) -> str:
    """One line of a `summarize_trace` result (or its error) of server ``name``."""
    if "error" in prof:
        return f"kernel profile {name}: {prof['error']}"
    cats = ", ".join(f"{c} {v:.0f}" for c, v in prof["categories_us_per_step"].items())
    waits = ", ".join(f"{k} {v['per_step']:.1f}x {v['us_per_step']:.0f} us"
                      for k, v in prof.get("host_waits", {}).items()) or "none"
    return (f"kernel profile {name} ({prof['steps']} decode steps): GPU busy {prof['busy_us_per_step']:.0f} us "
            f"of a {prof['span_us_per_step']:.0f} us span per step, {prof['launches_per_step']:.0f} launches; "
            f"us per step: {cats}; host waits per step: {waits}")


def read_kernel_profile(trace_dir: Path, steps: int, timeout: float = 120) -> dict:
    """`summarize_trace` of the decode trace in ``trace_dir`` once the profiler has written it."""
    import gzip

    deadline = time.time() + timeout
    while time.time() < deadline:
        found = sorted(trace_dir.glob("*DECODE.trace.json.gz")) if trace_dir.exists() else []
        if found:
            time.sleep(1.0)  # let the writer finish
            events = json.loads(gzip.decompress(found[0].read_bytes()))["traceEvents"]
            return summarize_trace(events, steps)
        time.sleep(1.0)
    return {"error": f"no decode trace in {trace_dir} after {timeout:g} s"}


# ---- main ---------------------------------------------------------------------------------
def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--out", default="bench_out")
    ap.add_argument("--concurrency", default="1,4,16,64")
    ap.add_argument("--temperatures", default="0,1")
    ap.add_argument("--prompts-per-level", type=int, default=2, help="num_prompts = max(8, this * concurrency)")
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--accept-all-output-len", type=int, default=None,
                    help="output length of the bound_accept_all workload, all its servers (default --output-len): at "
                         "16 tokens per step a short output is a handful of steps, so per-request costs weigh on "
                         "that figure (the reference figures in the docs used 512)")
    ap.add_argument("--work", default=None, help="where the synthetic bound models go (default OUT/models)")
    ap.add_argument("--prompts-dir", default=None, help="held-out prompt files instead of the dataset packages")
    ap.add_argument("--workloads", default="real,bound_accept_all,bound_accept_none")
    ap.add_argument("--impls", default="nospec,builtin,ours,ours_fixed",
                    help="servers per workload: nospec, builtin, ours (adaptive verify width, the default), "
                         "ours_fixed (every step verifies the block), ours_w4 / ours_w8 (width pinned); diagnostic: "
                         "ours_w1 (width 1: a plain decode step plus the draft's context K/V)")
    ap.add_argument("--profile", action="store_true", help="extra sglang-dflash server with per-phase timing")
    ap.add_argument("--timeline", action="store_true",
                    help="the sglang-dflash servers record where a step's time goes (device busy / idle, host in and "
                         "out of the worker; CUDA events, no synchronization: SGLANG_DFLASH_TIMELINE)")
    ap.add_argument("--kernel-profile", type=int, default=0, metavar="STEPS",
                    help="before the load, profile STEPS decode steps of one request on every server (SGLang's torch "
                         "profiler, GPU only) and report where a step's GPU time goes")
    ap.add_argument("--repeats", type=int, default=3, help="passes per cell (median reported; every pass runs "
                    "its cells by concurrency, lowest first, so a time budget cuts the costliest)")
    ap.add_argument("--startup-timeout", type=float, default=480)
    ap.add_argument("--time-budget", type=float, default=None,
                    help="seconds of load after which no further cell starts (the rest are reported as not run); "
                         "with --serial-workloads, per workload")
    ap.add_argument("--server-flags", default=" ".join(SERVER_FLAGS), help="flags every server gets")
    ap.add_argument("--serial-workloads", action="store_true",
                    help="start one workload's servers at a time (its own no-spec server for bound_accept_none), "
                         "stopping them before the next workload's: for targets of which one GPU cannot hold "
                         "every server at once (e.g. the 8B shape). Passes are then interleaved within a workload only")
    ap.add_argument("--prefill-graph-tokens", default=PREFILL_GRAPH_TOKENS,
                    help="prompt lengths SGLang's prefill CUDA graph is captured for on every server (comma-separated, "
                         "e.g. 32,64,128,256,512), or 'none' (default) for eager prefill")
    args = ap.parse_args()

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work).resolve() if args.work else out / "models"
    work.mkdir(parents=True, exist_ok=True)
    target, draft = Path(args.target), Path(args.draft)
    concs = [int(c) for c in args.concurrency.split(",")]
    temps = [float(t) for t in args.temperatures.split(",")]
    impls = args.impls.split(",")
    workloads = args.workloads.split(",")

    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target)
    n = max(8, args.prompts_per_level * max(concs))
    prompts = held_out_texts((n + 2) // 3, args.prompts_dir)
    dataset = write_dataset(prompts, out / "prompts.jsonl")
    check_ids = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
                 for p in prompts[:24]]
    check_ids = [list(ids["input_ids"]) if hasattr(ids, "keys") else list(ids) for ids in check_ids]

    models = {"real": (target, draft)}
    if "bound_accept_all" in workloads:
        models["bound_accept_all"] = (zero_final_norm(target, work / "zero_target", "model.norm.weight"),
                                      zero_final_norm(draft, work / "zero_draft", "norm.weight"))
    if "bound_accept_none" in workloads:
        models["bound_accept_none"] = (target, random_draft(draft, work / "random_draft"))

    groups = server_groups(workloads, impls, args.profile, args.serial_workloads)

    def start(w, impl):
        tgt, drf = models[w]
        env_impl = {"builtin": "builtin"}.get(impl, "sglang_dflash")
        extra = ["--cuda-graph-max-bs", str(max(concs))] if torch.cuda.is_available() else []
        env = {}
        if impl == "ours_profiled":
            # phases are timed with device syncs, which would serialize the overlap schedule anyway: the profiled
            # server runs the synchronous scheduler (so it also shows what the overlap schedule buys)
            env["SGLANG_DFLASH_PROFILE"] = str(out / f"phases_{w}.json")
            extra = [*extra, "--disable-overlap-schedule"]
        config = {**OURS_ADAPTIVE_CONFIG, **OURS_DIAGNOSTIC_CONFIG}.get(impl)
        if config is not None:
            extra = [*extra, "--speculative-adaptive-config", config]
        if impl == "ours" and args.timeline:
            env["SGLANG_DFLASH_TIMELINE"] = str(out / f"timeline_{w}.json")
        return Server(f"{w}_{impl}", tgt, None if impl == "nospec" else drf, env_impl, out, extra,
                      server_flags(args.server_flags, args.prefill_graph_tokens), env)

    # a benchmark stopped from outside (SIGTERM, e.g. a time limit) still stops its servers and reports what it has
    signal.signal(signal.SIGTERM, _stop)
    results = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available()
               else "cpu", "args": vars(args), "servers": {}, "runs": [], "identity": {},
               "kernel_profile": {}}
    passes: dict = {}
    load_start = None
    timeline_seen = {}  # workload -> the last timeline snapshot of its sglang-dflash server
    try:
        for group in groups:
            servers = {}
            try:
                servers = {key: start(*key) for key in group}
                deadline = time.time() + args.startup_timeout
                for key, s in servers.items():
                    ok = s.wait(deadline)
                    results["servers"][s.name] = {"ok": ok, "error": s.error, "cmd": " ".join(s.cmd)}
                    print(f"[bench] {s.name}: {'up' if ok else 'FAILED: ' + str(s.error)}", flush=True)
                up = {k: s for k, s in servers.items() if results["servers"][s.name]["ok"]}
                for w in dict.fromkeys(w for w, _ in group):
                    members = [up[(w2, i)] for (w2, i) in up
                               if w2 == w or (w == "bound_accept_none" and (w2, i) == ("real", "nospec"))]
                    members.sort(key=lambda s: s.name.endswith("nospec"), reverse=True)
                    if len(members) > 1:
                        results["identity"][w] = check_identical(members, check_ids, 64)
                        print(f"[bench] identity {w}: {results['identity'][w]}", flush=True)
                if args.kernel_profile:
                    for (w, impl), s in up.items():
                        if impl == "ours_profiled":
                            continue
                        # the most tokens a step commits: enough steps
                        per_step = 1 if impl in ("nospec", "ours_w1") else 16
                        results["kernel_profile"][s.name] = kernel_profile(s, check_ids[0], args.kernel_profile,
                                                                           per_step, out)
                        print(f"[bench] kernel profile {s.name}: "
                              f"{json.dumps(results['kernel_profile'][s.name])[:400]}", flush=True)
                cells = [(w, impl, s, temp, conc) for (w, impl), s in up.items() for temp in temps for conc in concs
                         if (w == "real" or temp == 0) and (impl != "ours_profiled" or conc in (1, 16))]
                passes.update({cell[:2] + cell[3:]: [] for cell in cells})
                # one budget for the whole run; with --serial-workloads one per workload, so a later workload's
                # start-up does not spend the load time of its cells
                load_start = time.time() if args.serial_workloads or load_start is None else load_start
                for rep in range(args.repeats):
                    for w, impl, s, temp, conc in pass_order(cells):
                        if args.time_budget is not None and time.time() - load_start > args.time_budget:
                            print(f"[bench] time budget of {args.time_budget:g} s spent: pass {rep + 1} stops "
                                  f"before {w} {impl} c={conc} T={temp}", flush=True)
                            break
                        r = bench_serving(s, target, dataset, conc, max(8, args.prompts_per_level * conc),
                                          args.accept_all_output_len or args.output_len if w == "bound_accept_all"
                                          else args.output_len, temp, out)
                        tl_path = out / f"timeline_{w}.json"
                        if impl == "ours" and tl_path.exists():  # this cell's share of the cumulative timeline
                            snap = json.loads(tl_path.read_text())["timeline"]
                            r["timeline"] = timeline_delta(timeline_seen.get(w, {}), snap)
                            timeline_seen[w] = snap
                        passes[(w, impl, temp, conc)].append(r)
                        print(f"[bench] pass {rep + 1}/{args.repeats} {w:18s} {impl:14s} c={conc:3d} T={temp} -> "
                              f"{r.get('output_throughput') or r.get('error', '')[:300]}", flush=True)
                        results["runs"] = [median_row(rows, w, impl, temp, conc)
                                           for (w, impl, temp, conc), rows in passes.items() if rows]
                        (out / "results.json").write_text(json.dumps(results, indent=1))
            finally:
                for s in servers.values():
                    s.stop()
    finally:
        results["phases"] = {w: json.loads((out / f"phases_{w}.json").read_text())
                             for w in workloads if (out / f"phases_{w}.json").exists()}
        results["timeline"] = {w: json.loads((out / f"timeline_{w}.json").read_text())
                               for w in workloads if (out / f"timeline_{w}.json").exists()}
        (out / "results.json").write_text(json.dumps(results, indent=1))
        plot(results, out / "throughput.png")
        print_table(results)

METRICS = ("output_throughput", "mean_tpot_ms", "median_tpot_ms", "mean_ttft_ms", "accept_length", "duration")


def median_row(passes: list[dict], workload: str, impl: str, temperature: float, concurrency: int) -> dict:
    """One cell: the median of each metric over its passes (failed passes excluded), the passes themselves, and
    the throughput spread (max - min) / median."""
    ok = [p for p in passes if p.get("output_throughput")]
    row = {"workload": workload, "impl": impl, "concurrency": concurrency, "temperature": temperature,
           "passes": passes, "num_ok": len(ok)}
    if not ok:
        row["error"] = passes[-1].get("error", "no successful pass") if passes else "not run"
        return row
    for key in METRICS:
        vals = [p[key] for p in ok if p.get(key) is not None]
        if vals:
            row[key] = statistics.median(vals)
    tputs = [p["output_throughput"] for p in ok]
    row["spread"] = (max(tputs) - min(tputs)) / row["output_throughput"]
    return row


def _tput(results, w, impl, conc, temp):
    for r in results["runs"]:
        if (r["workload"], r["impl"], r["concurrency"], r["temperature"]) == (w, impl, conc, temp):
            return (r.get("output_throughput"), r.get("accept_length"), r.get("mean_tpot_ms"), r.get("spread"),
                    r.get("mean_ttft_ms"))
    return None, None, None, None, None


def print_table(results) -> None:
    """ours ms/step = TPOT x accept length: the time between two of our decode steps as a client sees it."""
    rows = sorted({(r["workload"], r["temperature"], r["concurrency"]) for r in results["runs"]})
    print(f"\nmedian of {results['args']['repeats']} passes per cell; spread = (max - min) / median of ours")
    print("ours = adaptive verify width; envelope = the best of no-spec and ours at fixed widths measured in the run")
    print("| workload | T | conc | no-spec tok/s | built-in tok/s (τ) | ours tok/s (τ) | ours/no-spec | ours/built-in "
          "| ours/envelope | fixed / w4 / w8 tok/s | ours TTFT ms | ours TPOT ms | ours ms/step | no-spec TPOT ms "
          "| spread | ours sync+profiled tok/s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for w, t, c in rows:
        ns, _, ns_tpot, _, _ = _tput(results, w, "nospec", c, t)
        if ns is None and w == "bound_accept_none":  # all servers at once: the real workload's no-spec server
            ns, _, ns_tpot, _, _ = _tput(results, "real", "nospec", c, t)
        bi, bi_tau, _, _, _ = _tput(results, w, "builtin", c, t)
        ours, ours_tau, ours_tpot, spread, ours_ttft = _tput(results, w, "ours", c, t)
        prof = _tput(results, w, "ours_profiled", c, t)[0]
        f = lambda x: "—" if x is None else f"{x:,.0f}"
        ms = lambda x: "—" if x is None else f"{x:.2f}"
        tau = lambda x: "" if x is None else f" ({x:.2f})"
        ratio = lambda a, b: "—" if not a or not b else f"{a / b:.2f}x"
        step = None if ours_tpot is None or ours_tau is None else ours_tpot * ours_tau
        fixed = [_tput(results, w, impl, c, t)[0] for impl in OURS_ADAPTIVE_CONFIG]
        envelope = max([x for x in [ns, *fixed] if x] or [0]) or None
        print(f"| {w} | {t:g} | {c} | {f(ns)} | {f(bi)}{tau(bi_tau)} | {f(ours)}{tau(ours_tau)} | "
              f"{ratio(ours, ns)} | {ratio(ours, bi)} | {ratio(ours, envelope)} | {' / '.join(map(f, fixed))} | "
              f"{ms(ours_ttft)} | {ms(ours_tpot)} | {ms(step)} | "
              f"{ms(ns_tpot)} | {'—' if spread is None else f'{spread:.0%}'} | {f(prof)} |")
    for w, t, c in rows:
        for impl in OURS_DIAGNOSTIC_CONFIG:
            tput, tau_, tpot, _, _ = _tput(results, w, impl, c, t)
            if tput is not None:
                print(f"{impl} ({OURS_DIAGNOSTIC_CONFIG[impl]}), {w} T={t:g} c={c}: {tput:,.0f} tok/s (τ {tau_:.2f}), "
                      f"TPOT {tpot:.2f} ms")
    for w, phases in results.get("phases", {}).items():
        print(f"\nsglang-dflash per-phase ms/step, {w} (synchronous scheduler, synchronized phases):",
              json.dumps(phases["ms_per_step"]))
    for w, tl in results.get("timeline", {}).items():
        print(f"\nsglang-dflash timeline, {w} (all cells of the server; mean ms, count):",
              json.dumps({k: (round(v["mean_ms"], 3), v["count"]) for k, v in tl["timeline"].items()}))
    for name, prof in results.get("kernel_profile", {}).items():
        print("\n" + describe_kernel_profile(name, prof))
    print("identity at T=0 (exact / up to bf16 near-ties):",
          {w: (v["identical"], v["identical_up_to_near_ties"]) for w, v in results["identity"].items()})
    for w, v in results["identity"].items():
        for name, tau in v.get("tau", {}).items():
            print(f"tau {w} {name} (identity prompts, T=0): per step {tau['tau']:.3f}, "
                  f"per request (z-lab) {tau['tau_per_request']:.3f}")


def plot(results, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = sorted({(r["workload"], r["temperature"]) for r in results["runs"]})
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5 * len(panels), 4), squeeze=False)
    for ax, (w, t) in zip(axes[0], panels):
        for impl in ("nospec", "builtin", "ours", *OURS_ADAPTIVE_CONFIG):
            src_w = "real" if (w == "bound_accept_none" and impl == "nospec") else w
            pts = sorted((r["concurrency"], r["output_throughput"]) for r in results["runs"]
                         if r["workload"] == src_w and r["impl"] == impl and r["temperature"] == t
                         and r.get("output_throughput"))
            if pts:
                ax.plot(*zip(*pts), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{w}, T={t:g}")
        ax.set_xlabel("concurrency")
        ax.set_ylabel("output tok/s")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    main()
