"""Architecture matrix: every family SGLang's DFLASH captures from, served by no-spec, SGLang's built-in DFLASH and
sglang-dflash, on small random targets built on the GPU machine (`random_checkpoints.FAMILIES`).

Per family, the three servers start side by side on one GPU (CUDA graphs, the overlap schedule, the radix cache),
each with the same random 2-layer z-lab-format draft. Checks:

* start-up: serves, or the first error line of its log;
* identity: 32 prompts sharing a ~200-token prefix, suffixes of 4 to 120 tokens, sent concurrently, 64 greedy
  tokens each, then a second round of the 32 conversations (turn 1 + reply + a new user turn: radix-cache hits of
  turn 1's KV and, on hybrid targets, of its linear-attention states). Each reply against no-spec's: identical,
  parted at a bf16 near-tie of no-spec (`sglang_dflash.compare`), or parted elsewhere;
* teacher-forced deficits: every emitted token scored by a no-spec prefill of the same text (its logprob below
  the prefill's top choice); counts over 0.5 and over 2 nats. On a bf16 hybrid target prefill, decode and verify
  kernels disagree by more than an identity check absorbs, so there the judgement is ours' deficit counts against
  no-spec's own decode (the noise floor) and the built-in's;
* accept length per verify step (from ``meta_info``), ours vs the built-in with the same draft;
* T=1 distribution: 1024 samples of 2 tokens (top_k 20) per server; the second token (a speculative step) compared
  with no-spec's by a chi-square test of homogeneity (p-value).

Hybrid families also serve ours with the README's plain command (``ours_plain``: without the explicit
radix-cache and scheduler flags, which the plugin then settles), and run controls through the test harness switches
(``tests/harness/sitecustomize``, not the product): ours with the state committed after the whole block (must show
an excess of large deficits), and ours with an oracle draft (ours' replies of both turns: at T=0 the same server
retraces them) that forces accept lengths 0..B-1, with the right and the broken commit; the oracle's servers run
the step eagerly (its drafts are chosen on the host each step, which a captured step cannot do).

    python benchmarks/arch_matrix.py --families llama,qwen3_next --out results/arch

Writes ``<out>/matrix.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dflash import Server  # noqa: E402
from random_checkpoints import FAMILIES, build_family  # noqa: E402

from sglang_dflash import compare  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
HARNESS = REPO / "tests" / "harness" / "sitecustomize"
HYBRID = ("qwen3_5", "qwen3_next")
# attention sinks, Gemma 4's attention, MLA: not on FlashInfer's MHA path
BACKEND = {"gpt_oss": "triton", "gemma4": "triton", "deepseek_v2": "triton"}
FLAGS = ["--sleep-on-idle", "--skip-server-warmup", "--mem-fraction-static", "0.9", "--max-total-tokens", "40000",
         "--max-running-requests", "48", "--cuda-graph-max-bs", "32", "--disable-prefill-cuda-graph"]
# Hybrid targets: SGLang's radix cache keeps a request's linear-attention state without checkpoints along a verify
# block only with ``no_buffer``, which SGLang serves with the synchronous scheduler; every server of such a family
# runs with these flags (what sglang-dflash resolves a hybrid target to where SGLang would pick ``extra_buffer``).
HYBRID_FLAGS = ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"]
NEW_TOKENS, SAMPLES = 64, 1024


def prompts(tokenizer, n: int = 32) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts: one ~200-token shared prefix plus suffixes of 4 .. 120 tokens; and the second turn's tokens."""
    words = ("the model reads a block of masked tokens and fills it in one pass while the target checks every "
             "position of the block and keeps the longest prefix it agrees with plus one token of its own ").split()
    text = " ".join(words[i % len(words)] + ("." if i % 11 == 10 else "") for i in range(170))
    shared = tokenizer.encode("System: " + text)[:200]
    tails = [tokenizer.encode(f" Question {i}: " + " ".join(words[(7 * i + j) % len(words)]
                                                         for j in range(4 + (i * 37) % 117)))
             for i in range(n)]
    return [shared + t[: 4 + (i * 37) % 117] for i, t in enumerate(tails)], tokenizer.encode(" User: and then?")


def generate(server: Server, ids: list[int], **params) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": NEW_TOKENS, "ignore_eos": True,
                                                  **params.pop("sampling", {})}, **params}
    r = requests.post(server.url + "/generate", json=body, timeout=600)
    r.raise_for_status()
    return r.json()


def conversations(server: Server, turn1: list[list[int]], follow: list[int], reference: bool) -> list[dict]:
    """Round 1 (all prompts concurrently), then round 2 (prompt + reply + ``follow``); replies of both rounds."""
    extra = compare.REFERENCE_LOGPROBS if reference else {}
    with cf.ThreadPoolExecutor(32) as ex:
        first = list(ex.map(lambda p: generate(server, p, **extra), turn1))
        second = list(ex.map(lambda a: generate(server, a[0] + a[1]["output_ids"] + follow, **extra),
                             zip(turn1, first)))
    for p, r in zip(turn1 + [p + r["output_ids"] + follow for p, r in zip(turn1, first)], first + second):
        r["prompt_ids"] = p
    return first + second


def deficits(scorer: Server, replies: list[dict]) -> list[float]:
    """Per emitted token: the no-spec prefill's top-1 logprob minus the token's logprob, over prompt + reply."""
    def score(r):
        p, o = r["prompt_ids"], r["output_ids"]
        out = requests.post(scorer.url + "/generate", json={
            "input_ids": p + o, "sampling_params": {"temperature": 0, "max_new_tokens": 1},
            "return_logprob": True, "logprob_start_len": len(p) - 1, "top_logprobs_num": 1}, timeout=600).json()
        toks, tops = out["meta_info"]["input_token_logprobs"][-len(o):], out["meta_info"]["input_top_logprobs"][-len(o):]
        return [t[0][0] - lp for (lp, tok, *_), t, want in zip(toks, tops, o) if lp is not None and tok == want]
    with cf.ThreadPoolExecutor(16) as ex:
        return [d for ds in ex.map(score, replies) for d in ds]


def samples(server: Server, prompt: list[int]) -> list[list[int]]:
    sampling = {"temperature": 1.0, "top_k": 20, "max_new_tokens": 2}
    with cf.ThreadPoolExecutor(64) as ex:
        return list(ex.map(lambda _: generate(server, prompt, sampling=sampling)["output_ids"], range(SAMPLES)))


def chi2_p(a: Counter, b: Counter) -> float:
    """p-value of a chi-square test that two samples of tokens share one distribution (rare tokens pooled)."""
    na, nb = sum(a.values()), sum(b.values())
    keys = [k for k in set(a) | set(b) if a[k] + b[k] >= 10]
    cells = [(a[k], b[k]) for k in keys] + [(na - sum(a[k] for k in keys), nb - sum(b[k] for k in keys))]
    cells = [c for c in cells if sum(c) > 0]
    stat = 0.0
    for x, y in cells:
        for observed, n in ((x, na), (y, nb)):
            expected = (x + y) * n / (na + nb)
            stat += (observed - expected) ** 2 / expected
    dof = len(cells) - 1
    if dof <= 0:
        return 1.0
    # Wilson-Hilferty approximation of the chi-square upper tail
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def accept_length(replies: list[dict]) -> float | None:
    steps = sum(r["meta_info"].get("spec_verify_ct", 0) for r in replies)
    return sum(r["meta_info"]["completion_tokens"] - 1 for r in replies) / steps if steps else None


def histogram(replies: list[dict]) -> dict:
    """Accepted drafts per step over all replies (SGLang's ``spec_correct_drafts_histogram``), where reported."""
    total = Counter()
    for r in replies:
        for k, v in enumerate(r["meta_info"].get("spec_correct_drafts_histogram") or []):
            total[k] += v
    return dict(sorted(total.items()))


def step_graphed(server: Server) -> bool:
    """Whether an sglang-dflash server captured its decode step as CUDA graphs (its start-up log line)."""
    return "decode step captured as CUDA graphs" in server.log.read_text(errors="replace")


def first_error(server: Server) -> str:
    lines = server.log.read_text(errors="replace").splitlines()
    hits = [ln for ln in lines if "Error" in ln or "error:" in ln]
    return (hits[-1] if hits else (server.error or "?"))[-300:]


def run_family(family: str, work: Path, controls: bool, startup: float) -> dict:
    from transformers import AutoTokenizer

    target, draft = build_family(family, work / family, "cuda")
    tok = AutoTokenizer.from_pretrained(target)
    turn1, follow = prompts(tok)
    flags = ["--attention-backend", BACKEND.get(family, "flashinfer"), *FLAGS, *(HYBRID_FLAGS if family in HYBRID else [])]
    harness = {"PYTHONPATH": f"{HARNESS}:{__import__('os').environ.get('PYTHONPATH', '')}"}
    specs = {"nospec": (None, "sglang_dflash", {}), "builtin": (draft, "builtin", {}), "ours": (draft, "sglang_dflash", {})}
    if controls:
        specs["ours_broken"] = (draft, "sglang_dflash", {**harness, "SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT": "1"})
    plain = [f for f in flags if f not in HYBRID_FLAGS]  # the README's command: the plugin settles the hybrid flags
    if family in HYBRID:
        specs["ours_plain"] = (draft, "sglang_dflash", {})
    row: dict = {"family": family, "arch": FAMILIES[family][2], "servers": {}}
    servers = {k: Server(f"{family}_{k}", target, d, impl, work, flags=plain if k == "ours_plain" else flags, env=env)
               for k, (d, impl, env) in specs.items()}
    try:
        deadline = time.time() + startup
        up = {k: s.wait(deadline) for k, s in servers.items()}
        for k, s in servers.items():
            row["servers"][k] = {"starts": up[k]} if up[k] else {"starts": False, "error": first_error(s)}
            if up[k] and k.startswith("ours"):
                row["servers"][k]["step_graph"] = step_graphed(s)
        if not up["nospec"]:
            return row
        replies = {k: conversations(s, turn1, follow, reference=k == "nospec") for k, s in servers.items() if up[k]}
        ref = replies["nospec"]
        if controls and up["ours"]:  # oracle draft: ours' own sequences (prompt + reply) of both turns
            oracle = work / family / "oracle.json"
            oracle.write_text(json.dumps([r["prompt_ids"] + r["output_ids"] for r in replies["ours"]]))
            for k, broken in (("ours_oracle", "0"), ("ours_oracle_broken", "1")):
                env = {**harness, "SGLANG_DFLASH_TEST_ORACLE_DRAFT": str(oracle),
                       "SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT": broken}
                servers[k] = Server(f"{family}_{k}", target, draft, "sglang_dflash", work,
                                    flags=[*flags, "--disable-cuda-graph"], env=env)
            for k in ("ours_oracle", "ours_oracle_broken"):
                ok = servers[k].wait(time.time() + startup)
                row["servers"][k] = ({"starts": ok, "step_graph": step_graphed(servers[k])} if ok
                                     else {"starts": False, "error": first_error(servers[k])})
                if ok:
                    replies[k] = conversations(servers[k], turn1, follow, reference=False)
        for k, rs in replies.items():
            d = deficits(servers["nospec"], rs)
            cell = row["servers"][k]
            cell.update(tokens=len(d), deficit_over_0_5=sum(x > 0.5 for x in d), deficit_over_2=sum(x > 2 for x in d),
                        accept_length=accept_length(rs), accept_histogram=histogram(rs))
            if k != "nospec":
                diff = [i for i, (a, b) in enumerate(zip(ref, rs)) if a["output_ids"] != b["output_ids"]]
                ties = [i for i in diff if compare.near_tie_parting(ref[i]["output_ids"], rs[i]["output_ids"],
                                                                     compare.sglang_top(ref[i])) is not None]
                cell.update(requests=len(rs), identical=len(rs) - len(diff), near_tie=len(ties),
                            parted=len(diff) - len(ties))
        draws = {k: samples(servers[k], turn1[0]) for k in ("nospec", "builtin", "ours") if up.get(k)}
        for k, ds in draws.items():
            if k != "nospec":
                row["servers"][k]["t1_p_token2"] = chi2_p(Counter(d[1] for d in draws["nospec"] if len(d) > 1),
                                                          Counter(d[1] for d in ds if len(d) > 1))
        return row
    finally:
        for s in servers.values():
            s.stop()


def print_table(rows: list[dict]) -> None:
    print("| family | server | starts | identical / near-tie / parted (of 64) | deficits >0.5 / >2 (tokens) "
          "| accept length | T=1 p (token 2) |")
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        for k, c in row["servers"].items():
            starts = "yes" if c["starts"] else f"no: {c.get('error', '')[:120]}"
            starts += {True: " (step graph)", False: " (eager step)"}.get(c.get("step_graph"), "")
            ident = f"{c['identical']} / {c['near_tie']} / {c['parted']}" if "identical" in c else "—"
            deff = f"{c['deficit_over_0_5']} / {c['deficit_over_2']} ({c['tokens']})" if "tokens" in c else "—"
            acc = f"{c['accept_length']:.2f}" if c.get("accept_length") else "—"
            p = f"{c['t1_p_token2']:.3f}" if "t1_p_token2" in c else "—"
            print(f"| {row['family']} | {k} | {starts} | {ident} | {deff} | {acc} | {p} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES))
    ap.add_argument("--out", required=True)
    ap.add_argument("--parallel", type=int, default=2, help="families served at once")
    ap.add_argument("--startup-timeout", type=float, default=400)
    ap.add_argument("--no-controls", action="store_true", help="skip the hybrid families' harness controls")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    families = args.families.split(",")
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise SystemExit(f"unknown families {unknown}; choose from {sorted(FAMILIES)}")
    rows = []
    with cf.ThreadPoolExecutor(args.parallel) as ex:
        futures = {f: ex.submit(run_family, f, out, f in HYBRID and not args.no_controls, args.startup_timeout)
                   for f in families}
        for f, fut in futures.items():
            try:
                rows.append(fut.result())
            except Exception as e:  # a family that breaks the script itself is reported, the others still run
                rows.append({"family": f, "servers": {}, "script_error": repr(e)[:500]})
            print(f"[matrix] {f} done", flush=True)
            (out / "matrix.json").write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "rows": rows}, indent=1))
    print_table([r for r in rows if r["servers"]])
    for r in rows:
        if "script_error" in r:
            print(f"{r['family']}: {r['script_error']}")


if __name__ == "__main__":
    main()
