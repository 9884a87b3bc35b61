"""Time the verify-step kernels against their torch refs and an empty Triton launch (the floor).

For batch 1/16/64/256 and block 8/16, on CUDA:
  * ``build_block`` and ``accept_tokens``: the Triton launcher and the torch ref;
  * ``split_kv_plan`` (FlashInfer's split-kv plan of the verify block, on the device) and its ref, which
    plans on the host from the lengths copied there (no graph time: it syncs);
  * the draft forward's fused ops on the bundled drafter's shapes (batch x block tokens; hidden 576,
    9 + 3 q/k heads of 64, intermediate 1536): ``rms_norm`` (with the residual add), ``norm_rope``,
    ``silu_mul``, each against its torch ref (the core model's op chain);
  * an empty ``@triton.jit`` kernel with the same grid and warps (one per program);
each timed three ways (median microseconds per call):
  * ``bench_us``: ``triton.testing.do_bench``, device events around each call, with do_bench's
    L2 flush before it (the flush runs while the host launches, so launch overhead is partly hidden);
  * ``graph_us``: ``triton.testing.do_bench_cudagraph``, per-call time under CUDA-graph replay
    (device time alone);
  * ``host_us``: wall clock over 200 back-to-back eager calls and one synchronize (what an eager
    caller pays: Python launch overhead or device time, whichever is larger).
The whole sweep runs twice; the JSON keeps both passes, the table shows the lower value of the two.
Every kernel's output is first checked to equal its ref exactly (outputs poisoned before the run).

Usage: ``python benchmarks/bench_kernels.py --out results.json``. Without a GPU it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch
import triton

BATCHES = [1, 16, 64, 256]
BLOCKS = [8, 16]
MAX_CTX = 4096
MASK_ID = 151_669
POISON = -777


@triton.jit
def _empty_kernel(x_ptr):
    """Does nothing: its launch time is the floor for any one-launch kernel."""
    pass


def _build_inputs(b, block_size, device, gen):
    return dict(
        last_tokens=torch.randint(0, 150_000, (b,), generator=gen).to(device),
        seq_lens=torch.randint(0, MAX_CTX - block_size + 1, (b,), generator=gen).to(device),
        req_to_token=torch.randint(0, 2**31 - 1, (b + 8, MAX_CTX), generator=gen, dtype=torch.int32).to(device),
        req_pool_indices=torch.randperm(b + 8, generator=gen)[:b].to(device),
    )


def _accept_inputs(b, block_size, device, gen):
    draft = torch.randint(0, 4, (b, block_size), generator=gen)
    target = torch.randint(0, 4, (b, block_size), generator=gen)
    lens = torch.randint(0, block_size, (b,), generator=gen)
    for r in range(b):
        a = int(lens[r])
        target[r, :a] = draft[r, 1 : a + 1]
    return draft.to(device), target.to(device), torch.randint(0, 10_000, (b,), generator=gen).to(device)


def _check_build(build_block, build_block_ref, x, block_size):
    b = x["last_tokens"].shape[0]
    r2t_ref = x["req_to_token"].cpu().clone()
    expected = build_block_ref(*(x[k].cpu() for k in ("last_tokens", "seq_lens")), block_size, MASK_ID,
                               r2t_ref, x["req_pool_indices"].cpu())
    out = tuple(torch.full((b * block_size,), POISON, device=x["last_tokens"].device) for _ in range(3))
    got = build_block(x["last_tokens"], x["seq_lens"], block_size, MASK_ID, x["req_to_token"],
                      x["req_pool_indices"], out=out)
    ok = all(torch.equal(g.cpu(), e) for g, e in zip(got, expected)) and torch.equal(x["req_to_token"].cpu(), r2t_ref)
    if not ok:
        raise SystemExit(f"build_block kernel != ref at batch {b}, block {block_size}")


def _check_accept(accept_tokens, accept_ref, inputs):
    b, block_size = inputs[0].shape
    device = inputs[0].device
    expected = accept_ref(*(t.cpu() for t in inputs))
    out = (torch.full((b,), POISON, device=device), torch.full((b,), POISON, device=device),
           torch.full((b, block_size), POISON, device=device), torch.full((b,), POISON, device=device))
    got = accept_tokens(*inputs, out=out)
    if not all(torch.equal(g.cpu(), e) for g, e in zip(got, expected)):
        raise SystemExit(f"accept_tokens kernel != ref at batch {b}, block {block_size}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="write all timings as JSON to this path")
    parser.add_argument("--rep-ms", type=int, default=50, help="do_bench repetition time per measurement (ms)")
    args = parser.parse_args()

    if not torch.cuda.is_available():
        print("bench_kernels.py needs a CUDA GPU to time the Triton kernels; none found, nothing measured.")
        return 0

    from triton.testing import do_bench, do_bench_cudagraph

    from sglang_dflash.kernels import (accept_ref, accept_tokens, build_block, build_block_ref, norm_rope,
                                       norm_rope_ref, rms_norm, rms_norm_ref, silu_mul, silu_mul_ref)
    from sglang_dflash.kernels.attention_plan import split_kv_plan, split_kv_plan_ref

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    results = []

    def host_us(fn, calls=200, rounds=5):
        fn()
        torch.cuda.synchronize()
        per_call = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            per_call.append((time.perf_counter() - start) / calls * 1e6)
        return statistics.median(per_call)

    def timed(pass_idx, kernel, b, block_size, impl, fn, graph_ok=True):
        bench = do_bench(fn, warmup=25, rep=args.rep_ms, return_mode="median") * 1e3
        graph = do_bench_cudagraph(fn, rep=args.rep_ms, return_mode="median") * 1e3 if graph_ok else None
        results.append(dict(pass_idx=pass_idx, kernel=kernel, batch=b, block_size=block_size, impl=impl,
                            bench_us=bench, graph_us=graph, host_us=host_us(fn)))

    cases = []
    for b in BATCHES:
        for block_size in BLOCKS:
            x = _build_inputs(b, block_size, device, gen)
            _check_build(build_block, build_block_ref, x, block_size)
            acc = _accept_inputs(b, block_size, device, gen)
            _check_accept(accept_tokens, accept_ref, acc)
            cases.append((b, block_size, x, acc))
    print(f"kernels equal refs on all {len(cases)} (batch, block) cases", flush=True)

    sms = torch.cuda.get_device_properties(device).multi_processor_count
    budget = 2 * sms // 3  # 3 kv heads
    scratch = torch.zeros(3 * 256, dtype=torch.int32, device=device)

    def plan_out(b, block_size):
        padded = max(budget, b)
        i32 = lambda n: torch.empty(n, dtype=torch.int32, device=device)  # noqa: E731
        return padded, dict(request_indices=i32(padded), qo_tile_indices=i32(padded), kv_tile_indices=i32(padded),
                            o_indptr=i32(b + 1), merge_indptr=i32(b * block_size + 1), kv_chunk_size=i32(1),
                            block_valid_mask=torch.empty(padded, dtype=torch.uint8, device=device))

    def plan_ref_to_device(seq_lens, block_size, padded, out):
        for key, t in split_kv_plan_ref(seq_lens.cpu(), block_size, 1, budget, padded, 128).items():
            out[key].copy_(t, non_blocking=True)

    bf16 = torch.bfloat16
    dummy = torch.empty(1, device=device)
    for pass_idx in range(2):
        for b, block_size, x, acc in cases:
            bargs = (x["last_tokens"], x["seq_lens"], block_size, MASK_ID, x["req_to_token"], x["req_pool_indices"])
            timed(pass_idx, "build_block", b, block_size, "triton", lambda: build_block(*bargs))
            timed(pass_idx, "build_block", b, block_size, "torch_ref", lambda: build_block_ref(*bargs))
            timed(pass_idx, "accept_tokens", b, block_size, "triton", lambda: accept_tokens(*acc))
            timed(pass_idx, "accept_tokens", b, block_size, "torch_ref", lambda: accept_ref(*acc))
            timed(pass_idx, "empty_launch", b, block_size, "triton",
                  lambda: _empty_kernel[(b,)](dummy, num_warps=1))  # the launch config of ours
            padded, pout = plan_out(b, block_size)
            seq = x["seq_lens"]
            split_kv_plan(seq, block_size, 1, budget, padded, 128, pout, scratch)
            want = split_kv_plan_ref(seq.cpu(), block_size, 1, budget, padded, 128)
            assert all(torch.equal(pout[k].cpu(), want[k]) for k in want), "split_kv_plan != its ref"
            timed(pass_idx, "split_kv_plan", b, block_size, "triton",
                  lambda: split_kv_plan(seq, block_size, 1, budget, padded, 128, pout, scratch))
            timed(pass_idx, "split_kv_plan", b, block_size, "host_ref",
                  lambda: plan_ref_to_device(seq, block_size, padded, pout), graph_ok=False)
            n = b * block_size
            h, res = torch.randn(n, 576, device=device, dtype=bf16), torch.randn(n, 576, device=device, dtype=bf16)
            w = torch.ones(576, device=device, dtype=bf16)
            timed(pass_idx, "rms_norm", b, block_size, "triton", lambda: rms_norm(h, w, 1e-5, res))
            timed(pass_idx, "rms_norm", b, block_size, "torch_ref", lambda: rms_norm_ref(h, w, 1e-5, res))
            qkv = torch.randn(n, 15 * 64, device=device, dtype=bf16)
            qk = qkv[:, : 12 * 64].view(n, 12, 64)
            hw = torch.ones(12, 64, device=device, dtype=bf16)
            cos, sin = torch.randn(n, 64, device=device, dtype=bf16), torch.randn(n, 64, device=device, dtype=bf16)
            timed(pass_idx, "norm_rope", b, block_size, "triton", lambda: norm_rope(qk, hw, cos, sin, 1e-5))
            timed(pass_idx, "norm_rope", b, block_size, "torch_ref", lambda: norm_rope_ref(qk, hw, cos, sin, 1e-5))
            gu = torch.randn(n, 2 * 1536, device=device, dtype=bf16)
            timed(pass_idx, "silu_mul", b, block_size, "triton", lambda: silu_mul(gu))
            timed(pass_idx, "silu_mul", b, block_size, "torch_ref", lambda: silu_mul_ref(gu))

    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                python=platform.python_version(), rep_ms=args.rep_ms,
                note="median microseconds per call; see the module docstring for bench/graph/host")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(meta=meta, results=results), f, indent=2)

    best = {}
    for r in results:
        key = (r["kernel"], r["batch"], r["block_size"], r["impl"])
        cur = best.setdefault(key, dict(r))
        for col in ("bench_us", "graph_us", "host_us"):
            if r[col] is not None and r[col] < cur[col]:
                cur[col] = r[col]

    def fmt(v):
        return f"{v:10.2f}" if v is not None else f"{'-':>10}"

    print(f"# {meta['device']}  torch {meta['torch']}  triton {meta['triton']}  (median us per call, best of 2 passes)")
    header = f"{'kernel':<14}{'batch':>6}{'block':>6}  {'impl':<14}{'bench_us':>10}{'graph_us':>10}{'host_us':>10}"
    print(header)
    print("-" * len(header))
    for (kernel, b, block_size, impl), r in best.items():
        print(f"{kernel:<14}{b:>6}{block_size:>6}  {impl:<14}{fmt(r['bench_us'])}{fmt(r['graph_us'])}{fmt(r['host_us'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
