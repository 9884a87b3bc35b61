"""The serving benchmark's aggregation of repeated passes (the benchmark itself runs on a GPU)."""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import pytest
import torch



def _bench_module(name: str):
    """``benchmarks/<name>.py`` as a module (the benchmarks are scripts, not a package)."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent.parent / "benchmarks" /
                                                  f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench = _bench_module("bench_dflash")


def test_median_row_takes_the_median_of_successful_passes_and_their_spread():
    passes = [{"output_throughput": 300.0, "mean_tpot_ms": 3.0, "accept_length": 1.9},
              {"error": "RuntimeError: boom"},
              {"output_throughput": 100.0, "mean_tpot_ms": 9.0, "accept_length": 1.7},
              {"output_throughput": 200.0, "mean_tpot_ms": 5.0, "accept_length": 1.8}]
    row = bench.median_row(passes, "real", "ours", 0.0, 16)
    assert (row["workload"], row["impl"], row["temperature"], row["concurrency"]) == ("real", "ours", 0.0, 16)
    assert row["num_ok"] == 3 and row["passes"] is passes
    assert row["output_throughput"] == 200.0 and row["mean_tpot_ms"] == 5.0 and row["accept_length"] == 1.8
    assert row["spread"] == pytest.approx(1.0)  # (300 - 100) / 200
    even = bench.median_row(passes[2:] + passes[:1] + [{"output_throughput": 400.0}], "real", "ours", 0.0, 16)
    assert even["output_throughput"] == 250.0  # mean of the two middle passes
    failed = bench.median_row([{"error": "x"}], "real", "ours", 1.0, 4)
    assert failed["num_ok"] == 0 and failed["error"] == "x" and "output_throughput" not in failed


def test_table_reports_medians_and_spread(capsys):
    results = {"args": {"repeats": 3}, "identity": {}, "runs": [
        bench.median_row([{"output_throughput": v} for v in vals], "real", impl, 0.0, 1)
        for impl, vals in (("nospec", [500.0, 520.0, 480.0]), ("builtin", [400.0, 380.0, 390.0]),
                           ("ours", [450.0, 300.0, 600.0]), ("ours_fixed", [420.0, 430.0, 410.0]),
                           ("ours_w8", [520.0, 510.0, 530.0]))]}
    results["phases"] = {"real": {"ms_per_step": {"step_graph": 2.5}},
                         "bound_accept_all": {"ms_per_step": {"step_graph": 2.0}}}
    bench.print_table(results)
    out = capsys.readouterr().out
    assert "median of 3 passes per cell" in out
    assert 'per-phase ms/step, bound_accept_all (synchronous scheduler, synchronized phases): {"step_graph": 2.0}' in out
    # the envelope: the best of no-spec (500) and the fixed widths (420, 520, none at 4)
    assert "| real | 0 | 1 | 500 | 390 | 450 | 0.90x | 1.15x | 0.87x | 420 / — / 520 | — | — | — | — | 67% | — |\n" \
        in out
    timed = {"args": {"repeats": 1}, "identity": {}, "runs": [
        bench.median_row([{"output_throughput": 1000.0, "mean_tpot_ms": 0.25, "mean_ttft_ms": 20.0,
                           "accept_length": 16.0}], "bound_accept_all", "ours", 0.0, 1),
        bench.median_row([{"output_throughput": 100.0, "mean_tpot_ms": 1.5}], "bound_accept_all", "nospec", 0.0, 1)]}
    bench.print_table(timed)
    assert ("| bound_accept_all | 0 | 1 | 100 | — | 1,000 (16.00) | 10.00x | — | 10.00x | — / — / — | 20.00 | 0.25 | "
            "4.00 | 1.50 | 0% | — |\n") \
        in capsys.readouterr().out


class _FakeServer:
    """Replies from a table: prompt (tuple) -> output ids; the reference's carry top logprobs."""

    def __init__(self, name, replies, tops=None):
        self.name, self.replies, self.tops, self.asked = name, replies, tops or {}, []

    def generate(self, input_ids, max_new_tokens, reference=False):
        self.asked.append(reference)
        out = {"output_ids": self.replies[tuple(input_ids)], "meta_info": {}}
        if reference:
            out["meta_info"]["output_top_logprobs"] = self.tops[tuple(input_ids)]
        return out


def test_identity_check_separates_near_tie_partings_from_real_ones():
    prompts = [[1], [2], [3]]
    tops = {(1,): [[(-0.1, 5, None), (-3.0, 6, None)]] * 3,
            (2,): [[(-0.1, 5, None), (-3.0, 6, None)], [(-1.0, 7, None), (-1.0625, 8, None)], [(-0.5, 9, None)]],
            (3,): [[(-0.1, 5, None), (-3.0, 6, None)]] * 3}
    nospec = _FakeServer("nospec", {(1,): [5, 5, 5], (2,): [5, 7, 9], (3,): [5, 5, 5]}, tops)
    tie = _FakeServer("ours", {(1,): [5, 5, 5], (2,): [5, 8, 4], (3,): [5, 5, 5]})  # the runner-up, 0.0625 behind
    wrong = _FakeServer("builtin", {(1,): [5, 5, 5], (2,): [5, 7, 9], (3,): [6, 5, 5]})  # 2.9 nats behind
    got = bench.check_identical([nospec, tie, wrong], prompts, 3)
    assert nospec.asked == [True] * 3 and tie.asked == wrong.asked == [False] * 3
    assert got["mismatched_prompt_indices"] == {"ours": [1], "builtin": [2]}
    assert got["near_tie_prompt_indices"] == {"ours": [1], "builtin": []}
    assert got["identical"] is False and got["identical_up_to_near_ties"] is False
    assert bench.check_identical([nospec, tie], prompts, 3)["identical_up_to_near_ties"] is True
    same = bench.check_identical([nospec, _FakeServer("x", nospec.replies)], prompts, 3)
    assert same["identical"] is True and same["identical_up_to_near_ties"] is True


def test_server_env_reaches_its_own_process_only(monkeypatch, tmp_path):
    """Per-server variables (profiling, timeline) go to that server's process, not to this
    process's environment, so the servers started after it do not inherit them."""
    import os

    spawned = []
    monkeypatch.setattr(bench.subprocess, "Popen", lambda cmd, **kw: spawned.append(kw["env"]))
    monkeypatch.setattr(bench, "free_port", lambda: 1)
    monkeypatch.delenv("SGLANG_DFLASH_TIMELINE", raising=False)
    bench.Server("a", "T", "D", "sglang_dflash", tmp_path, env={"SGLANG_DFLASH_TIMELINE": "t.json"})
    bench.Server("b", "T", None, "sglang_dflash", tmp_path)
    assert spawned[0]["SGLANG_DFLASH_TIMELINE"] == "t.json" and spawned[0]["SGLANG_DFLASH_IMPL"] == "sglang_dflash"
    assert "SGLANG_DFLASH_TIMELINE" not in spawned[1] and "SGLANG_DFLASH_TIMELINE" not in os.environ


def test_a_server_whose_port_was_taken_starts_again_on_another_port(monkeypatch, tmp_path):
    """Servers starting together pick internal ports at random; one that lost its HTTP port to another is
    started again on a fresh port (a bounded number of times); any other early exit is reported with its log."""
    ports = iter([101, 102, 103, 104, 105])
    monkeypatch.setattr(bench, "free_port", lambda: next(ports))

    class Proc:
        def __init__(self, cmd, stdout, **kw):
            self.port = int(cmd[cmd.index("--port") + 1])
            stdout.write("ERROR: [Errno 98] error while attempting to bind: address already in use\n"
                         if self.port < 103 else "ValueError: bad draft\n")
            stdout.close()
            self.returncode = 1

        def poll(self):
            return 1

    monkeypatch.setattr(bench.subprocess, "Popen", Proc)
    s = bench.Server("a", "T", "D", "sglang_dflash", tmp_path)
    assert not s.wait(time.time() + 5)
    assert s.port == 103 and s.retries == 1 and "ValueError: bad draft" in s.error
    monkeypatch.setattr(bench.Server, "PORT_RETRIES", 1)
    s = bench.Server("b", "T", "D", "sglang_dflash", tmp_path)  # 104, then 105: both fail for another reason
    assert not s.wait(time.time() + 5) and s.port == 104 and "bad draft" in s.error


def test_server_groups_share_the_real_no_spec_server_only_when_all_run_together():
    wl, impls = ["real", "bound_accept_all", "bound_accept_none"], ["nospec", "ours"]
    together = bench.server_groups(wl, impls, profile=False, serial=False)
    assert together == [[("real", "nospec"), ("real", "ours"), ("bound_accept_all", "nospec"),
                         ("bound_accept_all", "ours"), ("bound_accept_none", "ours")]]
    serial = bench.server_groups(wl, impls, profile=True, serial=True)
    assert serial == [[("real", "nospec"), ("real", "ours"), ("real", "ours_profiled")],
                      [("bound_accept_all", "nospec"), ("bound_accept_all", "ours"), ("bound_accept_all", "ours_profiled")],
                      [("bound_accept_none", "nospec"), ("bound_accept_none", "ours")]]


def test_passes_run_the_lowest_concurrency_first():
    cells = [("real", "nospec", None, 0.0, 1), ("real", "nospec", None, 0.0, 64), ("real", "ours", None, 0.0, 16),
             ("real", "ours", None, 0.0, 1), ("bound_accept_all", "ours", None, 0.0, 4)]
    assert bench.pass_order(cells) == [cells[0], cells[3], cells[4], cells[2], cells[1]]


def test_timeline_delta_is_the_calls_between_two_snapshots():
    before = {"decode.device_ms": {"count": 10, "mean_ms": 2.0}, "prefill.device_ms": {"count": 2, "mean_ms": 5.0}}
    after = {"decode.device_ms": {"count": 30, "mean_ms": 3.0}, "prefill.device_ms": {"count": 2, "mean_ms": 5.0},
             "decode->decode.device_idle_ms": {"count": 4, "mean_ms": 0.5}}
    got = bench.timeline_delta(before, after)
    assert got == {"decode.device_ms": {"count": 20, "mean_ms": 3.5},  # (90 - 20) / 20
                   "decode->decode.device_idle_ms": {"count": 4, "mean_ms": 0.5}}
    assert bench.timeline_delta({}, before) == before


def test_load_requests_keep_special_tokens_in_the_text(monkeypatch, tmp_path):
    """bench_serving times the first token at the first chunk with text: the bound_accept_all models emit a
    special token, so the requests keep special tokens (else TTFT reads 0 and TPOT holds the whole latency)."""
    import json
    import types

    seen = []

    def cli_main():
        seen.append(list(sys.argv))
        raise RuntimeError("stop here")

    monkeypatch.setitem(sys.modules, "sglang.benchmark.serving", types.SimpleNamespace(cli_main=cli_main))
    server = types.SimpleNamespace(name="s", url="http://127.0.0.1:1")
    bench.bench_serving(server, tmp_path, tmp_path / "d.jsonl", 4, 8, 512, 1.0, tmp_path)
    argv = seen[0]
    body = json.loads(argv[argv.index("--extra-request-body") + 1])
    assert body == {"sampling_params": {"temperature": 1.0, "max_new_tokens": 512, "ignore_eos": False,
                                        "skip_special_tokens": False}}
    assert argv[argv.index("--sharegpt-output-len") + 1] == "512" and "--disable-ignore-eos" in argv


def test_a_stopped_benchmark_is_not_recorded_as_a_failed_cell(monkeypatch, tmp_path):
    """bench_serving records a failing load run and goes on, but once SIGTERM arrived (``_stop``) the exit must
    reach main's cleanup (stop the servers, write what was measured) instead of being recorded as a cell error."""
    import types

    calls = []

    def cli_main():
        calls.append(1)
        raise SystemExit(143) if bench._STOPPING else RuntimeError("load generator failed")

    monkeypatch.setitem(sys.modules, "sglang.benchmark.serving", types.SimpleNamespace(cli_main=cli_main))
    server = types.SimpleNamespace(name="s", url="http://127.0.0.1:1")
    args = (server, tmp_path, tmp_path / "d.jsonl", 1, 8, 16, 0.0, tmp_path)
    assert bench.bench_serving(*args) == {"error": "RuntimeError: load generator failed"}
    monkeypatch.setattr(bench, "_STOPPING", True)
    with pytest.raises(SystemExit):
        bench.bench_serving(*args)
    assert len(calls) == 2


def test_server_flags_capture_the_prefill_graph_for_the_given_lengths_or_none():
    flags = bench.server_flags("--attention-backend flashinfer --sleep-on-idle", "256,32,64")
    assert flags == ["--attention-backend", "flashinfer", "--sleep-on-idle", "--cuda-graph-bs-prefill", "32", "64",
                     "256"]
    assert bench.server_flags("--sleep-on-idle", "none") == ["--sleep-on-idle", "--disable-prefill-cuda-graph"]
    assert "--disable-prefill-cuda-graph" not in bench.SERVER_FLAGS
    with pytest.raises(ValueError, match="positive token counts"):
        bench.server_flags("", "0,64")


def test_kernel_trace_summary_per_decode_step():
    def k(name, ts, dur, cat="kernel"):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}

    events = [k("_build_block_kernel", 0, 2), k("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 3, 10),
              k("BatchPrefillWithPagedKVCacheKernel", 14, 6), k("Memcpy DtoD (Device -> Device)", 21, 1, "gpu_memcpy"),
              k("_accept_kernel", 23, 1), k("my_mystery_kernel", 30, 10),
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": 0, "dur": 500},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 60, "dur": 40},
              {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 61, "dur": 7},
              k("_build_block_kernel", 100, 2), k("nvjet_tst_64x8_64x16_4x1_v_bz_TNT", 103, 10),
              k("BatchPrefillWithPagedKVCacheKernel", 114, 6), k("_accept_kernel", 121, 1),
              k("my_mystery_kernel", 130, 10)]
    s = bench.summarize_trace(events, steps=2)
    assert s["busy_us_per_step"] == 29.5  # (2+10+6+1+1+10 + 2+10+6+1+10) / 2; runtime calls are not GPU time
    assert s["span_us_per_step"] == 70.0  # 0 .. 140
    assert s["launches_per_step"] == 5.5
    assert s["categories_us_per_step"] == {"gemm": 10.0, "other": 10.0, "attention": 6.0,
                                           "sglang-dflash triton": 3.0, "memcpy / memset": 0.5}
    assert s["top_kernels"][0] == {"name": "nvjet_tst_64x8_64x16_4x1_v_bz_TNT", "per_step": 1.0, "us_per_step": 10.0}
    assert s["host_waits"] == {"cudaStreamSynchronize": {"per_step": 0.5, "us_per_step": 20.0}}  # not the Async copy
    assert [bench.kernel_category(n) for n in (
        "void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(__nv_bfloat16*, __nv_bfloa",
        "void flashinfer::PersistentVariableLengthMergeStatesKernel<8u, 8u, 16u, 4u, __nv_bfloat16,",
        "void flashinfer::BatchDecodeWithPagedKVCacheKernel<(flashinfer::PosEncodingMode)0, 2u, 1u,")] == [
        "norm", "attention", "attention"]
    assert bench.summarize_trace([], steps=2) == {"error": "no GPU events in the trace"}


def test_random_checkpoints_load_as_target_and_draft(tmp_path):
    """The realistic-size builder's output (here its tiny shape) loads: a Qwen3 target SGLang's class reads and a
    z-lab-format draft of 5 layers on 5 distinct target layers below the last."""
    from transformers import AutoConfig

    from sglang_dflash.model import load_draft

    rc = _bench_module("random_checkpoints")
    assert rc.spread_layers(36, 5) == [1, 9, 17, 25, 33]
    target_dir, draft_dir = rc.build("tiny", tmp_path, "cpu")
    cfg = AutoConfig.from_pretrained(target_dir)
    draft = load_draft(draft_dir)
    draft.cfg.validate_target(cfg)
    ids = list(draft.cfg.target_layer_ids)
    assert (cfg.architectures, cfg.num_hidden_layers, draft.cfg.num_hidden_layers) == (["Qwen3ForCausalLM"], 12, 5)
    assert len(set(ids)) == 5 and max(ids) < cfg.num_hidden_layers - 1
    assert (target_dir / "tokenizer.json").exists()


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4",
                                    "deepseek_v2"])
def test_family_checkpoints_are_read_by_sglang(family, tmp_path):
    """The architecture matrix's targets (`random_checkpoints.build_family`, shrunk here) are read by SGLang's
    ModelConfig as the family they stand for -- hybrid ones with a linear-attention state -- and the draft built
    for each validates against it."""
    from sglang.srt.configs.hybrid_arch import mambaish_config
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import AutoConfig

    from sglang_dflash.model import load_draft

    rc = _bench_module("random_checkpoints")
    assert sorted(rc.FAMILIES) == sorted(["llama", "qwen3", "qwen3_moe", "qwen3_5", "qwen3_next", "gpt_oss", "gemma4",
                                          "deepseek_v2"])
    target_dir, draft_dir = rc.build_family(family, tmp_path, "cpu", hidden_size=64, intermediate_size=128)
    model_config = ModelConfig(str(target_dir))
    assert model_config.hf_config.architectures == [rc.FAMILIES[family][2]]
    assert (mambaish_config(model_config) is not None) == (family in ("qwen3_5", "qwen3_next"))
    assert model_config.dtype == torch.bfloat16
    draft = load_draft(draft_dir)
    draft.cfg.validate_target(AutoConfig.from_pretrained(target_dir))
    assert (draft.cfg.num_hidden_layers, draft.cfg.head_dim, draft.cfg.block_size) == (2, 64, 16)


def test_gpt_oss_on_hopper_without_a_backend_is_served_on_triton(tmp_path):
    """The plain serving command on a gpt-oss target on Hopper: SGLang picks fa3 for the model (its gpt-oss override,
    not its generic default), which DFLASH is not served with, and FlashInfer has no attention sinks: the launcher
    resolves triton, logged, and reserves nothing for step graphs. SGLang's whole server-argument resolution of the
    family's checkpoint with an H100's platform answers (a subprocess: the hooks patch SGLang process-wide); the same
    without DFLASH keeps fa3."""
    import subprocess
    import textwrap

    rc = _bench_module("random_checkpoints")
    target_dir, draft_dir = rc.build_family("gpt_oss", tmp_path, "cpu", hidden_size=64, intermediate_size=128)
    code = textwrap.dedent(f"""
        import logging, sys
        logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
        from sglang_dflash.adapter import hooks
        hooks.install()
        from sglang.srt.plugins.hook_registry import HookRegistry
        HookRegistry.apply_hooks()
        import sglang.srt.arg_groups.overrides as ov
        import sglang.srt.server_args as sa
        import sglang.srt.utils
        from sglang.srt import runtime_context
        from sglang_dflash.adapter import compat
        # what an H100 with CUDA >= 12.3 and FlashInfer answers (platform facts from 0.5.20, helpers before)
        if hasattr(runtime_context, "override_platform"):
            runtime_context.override_platform(is_sm90=True, is_sm100=False, is_hopper_with_cuda_12_3=True,
                                              has_flashinfer=True).install()
        for module, name, value in ((ov, "is_sm90_supported", True), (ov, "is_sm100_supported", False),
                                    (sa, "is_hopper_with_cuda_12_3", True), (sa, "is_sm100_supported", False),
                                    (sa, "is_flashinfer_available", True), (sglang.srt.utils, "is_flashinfer_available", True)):
            setattr(module, name, lambda *a, value=value, **k: value)
        sa.get_device_memory_capacity = lambda *a, **k: 80 * 1024
        for spec in ({{"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "{draft_dir}"}}, {{}}):
            args = sa.ServerArgs(model_path="{target_dir}", device="cuda", **spec)
            if hasattr(args, "resolve_once"):  # 0.5.20+: construction leaves resolution to the launcher
                args.resolve_once()
            print("RESOLVED", spec.get("speculative_algorithm"), compat.published(args).attention_backend)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "RESOLVED DFLASH triton" in out.stdout, out.stdout[-3000:]
    assert "RESOLVED None fa3" in out.stdout, out.stdout[-3000:]
    assert "SGLang picks the fa3 attention backend for this model here" in out.stdout
    assert "kept outside --mem-fraction-static" not in out.stdout


def test_arch_matrix_chi_square_tells_one_distribution_from_another_and_prompts_share_a_prefix():
    import random
    from collections import Counter

    from transformers import AutoTokenizer

    from sglang_dflash.assets import smollm2_path

    matrix = _bench_module("arch_matrix")
    rng = random.Random(0)
    draw = lambda weights: Counter(rng.choices(range(20), weights=weights, k=1024))  # noqa: E731
    skewed = list(range(1, 21))
    assert matrix.chi2_p(draw(skewed), draw(skewed)) > 0.05
    assert matrix.chi2_p(draw(skewed), draw([1] * 20)) < 1e-6
    prompts, follow = matrix.prompts(AutoTokenizer.from_pretrained(smollm2_path()))
    shared = prompts[0][:150]
    assert len(prompts) == 32 and len({tuple(p) for p in prompts}) == 32 and follow
    assert all(p[:150] == shared for p in prompts) and min(map(len, prompts)) < 200 < max(map(len, prompts))


def test_batch_step_held_out_prompts_interleave_the_three_sets_with_the_chat_template(monkeypatch):
    """``bench_batch_steps --held-out``: request i gets the i-th of MT-Bench / HumanEval / GSM8K interleaved, as the
    target's chat-templated token ids."""
    from transformers import AutoTokenizer

    from sglang_dflash import data
    from sglang_dflash.assets import smollm2_path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    steps = _bench_module("bench_batch_steps")
    target = smollm2_path()
    tok = AutoTokenizer.from_pretrained(target)
    ids = steps.held_out_prompts(target, 7)
    assert len(ids) == 7
    expect = [data.mtbench_prompts(3, tok), data.humaneval_prompts(3, tok), data.gsm8k_prompts(3, tok)]
    for i, got in enumerate(ids):
        assert tok.decode(got) == expect[i % 3][i // 3]
    assert tok.decode(ids[0]).startswith("<|im_start|>") and tok.decode(ids[0]).endswith("<|im_start|>assistant\n")
    assert set(steps.WIDTHS) >= {"w1", "w2", "w4", "w8", "fixed", "adaptive"}
    # 3 passes of 256 tokens (255 decoded, the first from the prefill) in 691 batch steps (a real T=1 run)
    assert steps.tokens_per_step({"16": 691}, 256, 3) == pytest.approx(1.1071, abs=1e-4)
    assert steps.tokens_per_step({"2": 531, "8": 120, "1": 17}, 256, 3) == pytest.approx(765 / 668)
    assert steps.tokens_per_step({"1": 15}, 16, 1) == 1.0  # nothing accepted
    assert steps.tokens_per_step({}, 256, 3) == 1.0
    # per request: (completion tokens - the prefill's) / decode steps, pooled over the replies
    metas = [{"completion_tokens": 256, "spec_verify_ct": 170}, {"completion_tokens": 256, "spec_verify_ct": 85}]
    assert steps.accept_length(metas) == pytest.approx(510 / 255)
    assert steps.accept_length([{"completion_tokens": 256}]) is None  # no-spec: no step count


def test_batch_step_cells_run_every_temperature_at_each_concurrency_lowest_first(monkeypatch):
    """``bench_batch_steps --concurrency 64,16 --temperature 0,1``: four cells that every server runs in one
    start-up, the lowest concurrency first; a bad list is refused with the form to use."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    steps = _bench_module("bench_batch_steps")
    assert steps.cells_of("0,1", "64,16") == [(0.0, 16), (1.0, 16), (0.0, 64), (1.0, 64)]
    assert steps.cells_of("0.7", "4,4") == [(0.7, 4)]
    assert [steps.cell_name(t, c) for t, c in steps.cells_of("0,0.5", "1")] == ["t0_c1", "t0.5_c1"]
    with pytest.raises(SystemExit, match="--concurrency 16,64"):
        steps.cells_of("0", "0,16")
    with pytest.raises(SystemExit, match="temperatures >= 0"):
        steps.cells_of("zero", "16")
