"""Adapter pieces that need no server: SGLang compatibility check, request refusal, server-arg resolution,
and the carried draft state (filter/merge). The served behaviour is in test_server_dflash.py."""

from __future__ import annotations

import collections
import functools
import importlib.util
import itertools
import os
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sglang_dflash.adapter import hooks
from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.model import DFlashDraftModel, save_draft


def test_installed_sglang_matches_every_hooked_signature():
    assert hooks.check_sglang_compat() == []


def test_version_gate_is_the_supported_range():
    from sglang_dflash.adapter import compat

    lo, hi = compat.SUPPORTED_RANGE
    assert compat.version_problem(lo) is None and compat.version_problem(hi) is None
    for outside in ("0.5.16", "0.5.24", "0.6.0", "unknown"):
        problem = compat.version_problem(outside)
        assert problem is not None and f"sglang=={outside}" in problem and f"{lo} to {hi}" in problem


def test_flashinfer_plan_only_on_checked_versions(monkeypatch):
    import importlib.metadata

    from sglang_dflash.adapter import compat

    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.15.post1")
    assert compat.unchecked_flashinfer() is None
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.7.2")
    assert "0.7.2" in compat.unchecked_flashinfer() and "0.6.15.post1" in compat.unchecked_flashinfer()


def test_signature_mismatch_is_reported(monkeypatch):
    monkeypatch.setitem(hooks.EXPECTED_SIGNATURES,
                        "sglang.srt.managers.tp_worker.TpModelWorker.forward_batch_generation", ["self", "no_such"])
    problems = hooks.check_sglang_compat()
    assert len(problems) == 1 and "forward_batch_generation" in problems[0] and "no_such" in problems[0]


def test_impl_switch(monkeypatch):
    """The switch is read once per process: later changes of the variable do not move it (each case below clears
    that memory first, as a fresh process starts without it)."""
    monkeypatch.delenv(hooks.IMPL_ENV, raising=False)
    hooks.selected_impl.cache_clear()
    assert hooks.selected_impl() == "sglang_dflash"
    monkeypatch.setenv(hooks.IMPL_ENV, "builtin")
    assert hooks.selected_impl() == "sglang_dflash"
    hooks.selected_impl.cache_clear()
    assert hooks.selected_impl() == "builtin"
    monkeypatch.setenv(hooks.IMPL_ENV, "other")
    hooks.selected_impl.cache_clear()
    with pytest.raises(ValueError, match="not one of"):
        hooks.selected_impl()
    hooks.selected_impl.cache_clear()


def _req(**sampling):
    params = dict(frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0, min_new_tokens=0,
                  logit_bias=None, regex=None, json_schema=None, ebnf=None, structural_tag=None, max_new_tokens=16)
    params.update(sampling)
    return SimpleNamespace(sampling_params=SimpleNamespace(**params), custom_logit_processor=None,
                           return_logprob=False, return_hidden_states=False)


def test_the_step_accepts_only_what_its_own_rule_covers():
    """The step's own accept (greedy argmax, or speculative sampling under temperature / top-k / top-p / min-p)
    stands only where `BlockSampler.accept` would apply nothing else: a batch with a grammar, custom processors,
    logit_bias, min_new_tokens not yet reached, any penalty or a sampling seed accepts on the logits (BLOCK); the
    filters choose the kind with the sort."""
    from sglang_dflash.adapter.sampling import BLOCK, FILTERED, GREEDY, SAMPLED, step_accept_kind

    def batch(*reqs, greedy=True, grammar=False, processors=False, bias=None, seed=None, top_k=False, top_p=False,
              min_p=False):
        info = SimpleNamespace(is_all_greedy=greedy, has_custom_logit_processor=processors, logit_bias=bias,
                               sampling_seed=seed, need_top_k_sampling=top_k, need_top_p_sampling=top_p,
                               need_min_p_sampling=min_p)
        for r in reqs:
            r.output_ids = [5, 6]
        return SimpleNamespace(sampling_info=info, has_grammar=grammar, reqs=list(reqs))

    assert step_accept_kind(batch(_req(), _req(min_new_tokens=2))) == GREEDY  # min_new_tokens already reached
    assert step_accept_kind(batch(_req(), greedy=False)) == SAMPLED
    for flag in ("top_k", "top_p", "min_p"):
        assert step_accept_kind(batch(_req(), greedy=False, **{flag: True})) == FILTERED, flag
    assert step_accept_kind(batch(_req(), greedy=False, seed=torch.zeros(1))) == BLOCK
    for greedy in (True, False):
        assert step_accept_kind(batch(_req(), grammar=True, greedy=greedy)) == BLOCK
        assert step_accept_kind(batch(_req(), processors=True, greedy=greedy)) == BLOCK
        assert step_accept_kind(batch(_req(), bias=torch.zeros(1, 8), greedy=greedy)) == BLOCK
        assert step_accept_kind(batch(_req(), _req(min_new_tokens=3), greedy=greedy)) == BLOCK
        for penalty in (dict(frequency_penalty=0.1), dict(presence_penalty=-0.5), dict(repetition_penalty=1.2)):
            assert step_accept_kind(batch(_req(), _req(**penalty), greedy=greedy)) == BLOCK, penalty


def test_step_sampling_reads_sglang_sampling_info_and_fills_graph_inputs():
    """`StepSampling.of` reads SGLang's per-request values (temperatures ``[bs, 1]``, int32 top-k) as the step's
    ``[bs]`` parameters, its probabilities are `verify.target_probs` of them, and `copy_` writes a batch of n into the
    first n rows of a graph's static inputs, leaving the padded rows."""
    from sglang_dflash.adapter.sampling import StepSampling
    from sglang_dflash.verify import target_probs

    info = SimpleNamespace(temperatures=torch.tensor([[0.7], [1.3]]),
                           top_ks=torch.tensor([3, 1 << 30], dtype=torch.int32),
                           top_ps=torch.tensor([1.0, 0.5]), min_ps=torch.tensor([0.0, 0.1]))
    s = StepSampling.of(info, filtered=True)
    assert s.temperature.shape == (2,) and s.top_k.dtype == torch.int32
    logits = torch.randn(2, 3, 11, generator=torch.Generator().manual_seed(0))
    want = target_probs(logits, torch.tensor([0.7, 1.3]), torch.tensor([3, 1 << 30]), torch.tensor([1.0, 0.5]),
                        torch.tensor([0.0, 0.1]))
    torch.testing.assert_close(s.probs(logits), want)
    assert (s.probs(logits)[0] > 0).sum(-1).tolist() == [3, 3, 3]  # top-k 3 applied

    static = StepSampling(torch.full((4,), 9.0), torch.full((4,), 9, dtype=torch.int64), torch.full((4,), 9.0),
                          torch.full((4,), 9.0), filtered=False)
    static.copy_(info)
    assert static.temperature.tolist() == pytest.approx([0.7, 1.3, 9.0, 9.0])
    assert static.top_k.tolist() == [3, 1 << 30, 9, 9]
    assert static.top_p.tolist() == [1.0, 0.5, 9.0, 9.0]
    assert static.min_p.tolist() == pytest.approx([0.0, 0.1, 9.0, 9.0])


def test_unsupported_request_is_refused_with_its_name():
    req = _req()
    req.return_hidden_states = True
    msg = hooks.request_error(req)
    assert msg.startswith("sglang-dflash:") and "return_hidden_states" in msg
    assert "without --speculative-algorithm DFLASH" in msg


def test_plain_and_prompt_scoring_requests_are_served():
    assert hooks.request_error(_req()) is None
    with_processor = _req()
    with_processor.custom_logit_processor = "<serialized processor>"
    assert hooks.request_error(with_processor) is None  # applied per block position
    assert hooks.request_error(_req(logit_bias={"3": 1.0}, min_new_tokens=4)) is None  # applied per block position
    assert hooks.request_error(_req(frequency_penalty=0.5, presence_penalty=-0.2, repetition_penalty=1.1)) is None
    for field, value in (("regex", "a+"), ("json_schema", "{}"), ("ebnf", 'root ::= "a"'), ("structural_tag", "{}")):
        assert hooks.request_error(_req(**{field: value})) is None  # grammar masks per block position
    scoring = _req(max_new_tokens=0)
    scoring.return_logprob = True
    assert hooks.request_error(scoring) is None
    decode_logprobs = _req()
    decode_logprobs.return_logprob = True
    assert hooks.request_error(decode_logprobs) is None


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    cfg = DFlashDraftConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=1, num_attention_heads=4,
                            num_key_value_heads=2, vocab_size=100, num_target_layers=8, mask_token_id=5,
                            head_dim=16, block_size=8)
    path = tmp_path_factory.mktemp("draft")
    save_draft(DFlashDraftModel(cfg), path)
    return path


def _args(draft, **overrides):
    args = dict(speculative_draft_model_path=str(draft), speculative_draft_model_revision=None, tp_size=1, pp_size=1,
                dp_size=1, enable_dp_attention=False, disaggregation_mode="null", page_size=1,
                speculative_draft_window_size=None, attention_backend=None, speculative_eagle_topk=None,
                speculative_num_steps=None, speculative_dflash_block_size=None, speculative_num_draft_tokens=None,
                disable_overlap_schedule=False, enable_lora=None, lora_paths=None, device="cpu",
                speculative_adaptive=False, speculative_adaptive_config=None)
    args.update(overrides)
    return SimpleNamespace(**args)


def _resolved(args):
    """What resolution decided for ``args`` (`compat.resolving`: declared fields on SGLang 0.5.20+)."""
    from sglang_dflash.adapter import compat

    return compat.resolving(args)


@pytest.mark.parametrize("config, match", [
    ('{"widths": [0, 4]}', r"^sglang-dflash: --speculative-adaptive-config: widths must be a non-empty list of "
                           r"integers in \[1, 8\] \(the block size\)"),
    ('{"candidate_steps": [1]}', r"unknown keys \['candidate_steps'\] for DFLASH"),
])
def test_bad_adaptive_config_is_refused_at_startup(draft_dir, config, match):
    """A --speculative-adaptive-config DFLASH cannot use stops the launcher with a one-line message."""
    from sglang_dflash.adapter.server_args import resolve_server_args

    with pytest.raises(ValueError, match=match):
        resolve_server_args(_args(draft_dir, speculative_adaptive_config=config))


def test_speculative_adaptive_flag_is_taken_off(draft_dir):
    """SGLang's --speculative-adaptive (EAGLE's switch) is cleared: DFLASH adapts through its own policy."""
    from sglang_dflash.adapter.server_args import resolve_server_args

    args = _args(draft_dir, speculative_adaptive=True)
    resolve_server_args(args)
    assert _resolved(args).speculative_adaptive is False


def test_server_args_resolved_from_the_draft(draft_dir):
    from sglang_dflash.adapter.server_args import resolve_server_args

    args = _args(draft_dir, device="cuda")
    resolve_server_args(args)
    args = _resolved(args)
    assert (args.speculative_num_draft_tokens, args.speculative_dflash_block_size) == (8, 8)
    assert (args.speculative_num_steps, args.speculative_eagle_topk) == (1, 1)
    assert args.disable_overlap_schedule is False  # SGLang's overlap schedule serves DFLASH on CUDA


@pytest.mark.parametrize("device", ["cuda", None])
@pytest.mark.parametrize("backend", ["flashinfer", "triton", None])
def test_gpu_paged_backends_are_served_on_every_supported_sglang(draft_dir, device, backend):
    """DFLASH on a GPU with FlashInfer or Triton (or SGLang's default) resolves on every supported SGLang, 0.5.23's
    KV-location plan included (`compat.VERIFY_ARGS_KEYWORD_PLAN`; served by `spec_inputs.DFlashBlockInput`)."""
    from sglang_dflash.adapter.server_args import resolve_server_args

    args = _args(draft_dir, device=device, attention_backend=backend)
    resolve_server_args(args)
    resolved = _resolved(args)
    assert (resolved.speculative_num_draft_tokens, resolved.speculative_dflash_block_size) == (8, 8)
    assert resolved.attention_backend == backend and resolved.disable_overlap_schedule is False


@pytest.mark.parametrize("device, overlap", [("cuda", True), (None, True), ("cpu", False)])
def test_overlap_schedule_where_streams_exist(draft_dir, device, overlap):
    """Overlap stays on where SGLang runs it (CUDA; SGLang's default device) and is switched off on CPU;
    --disable-overlap-schedule is always honoured."""
    from sglang_dflash.adapter.server_args import resolve_server_args

    args = _args(draft_dir, device=device)
    resolve_server_args(args)
    assert _resolved(args).disable_overlap_schedule is (not overlap)
    args = _args(draft_dir, device=device, disable_overlap_schedule=True)
    resolve_server_args(args)
    assert _resolved(args).disable_overlap_schedule is True


@pytest.mark.parametrize("env, overlap", [(None, False), ("0", False), ("1", True)])
def test_cpu_overlap_is_a_test_harness_switch(env, overlap):
    """The CPU test servers' ``sitecustomize`` turns the overlap schedule on for CPU only when
    SGLANG_DFLASH_TEST_CPU_OVERLAP=1 (the product has no such switch)."""
    import subprocess
    import sys
    from pathlib import Path

    code = ("from types import SimpleNamespace as S; from sglang_dflash.adapter.server_args import overlap_supported; "
            "print(overlap_supported(S(device='cpu')))")
    env_vars = {k: v for k, v in os.environ.items() if k != "SGLANG_DFLASH_TEST_CPU_OVERLAP"}
    env_vars["PYTHONPATH"] = str(Path(__file__).parent / "harness" / "sitecustomize")
    if env is not None:
        env_vars["SGLANG_DFLASH_TEST_CPU_OVERLAP"] = env
    out = subprocess.run([sys.executable, "-c", code], env=env_vars, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(overlap)
    assert ("TEST: overlap schedule on CPU" in out.stderr) is overlap


def test_data_parallel_replicas_are_accepted(draft_dir):
    """--dp-size N (without DP attention) runs N independent schedulers, each with its own DFLASH worker."""
    from sglang_dflash.adapter.server_args import resolve_server_args

    args = _args(draft_dir, dp_size=2)
    resolve_server_args(args)
    assert (args.dp_size, _resolved(args).speculative_num_draft_tokens) == (2, 8)


@pytest.mark.parametrize("tp, dp", [(2, 1), (2, 2), (4, 1)])
def test_tensor_parallel_sizes_that_divide_the_draft_are_accepted(draft_dir, tp, dp):
    """--tp-size N (with --dp-size M replicas): the draft (4 query heads, 2 KV heads, 96 intermediate) is sharded
    with the target's TP group; at N=4 its 2 KV heads are each replicated on two ranks."""
    from sglang_dflash.adapter.server_args import resolve_server_args

    args = _args(draft_dir, tp_size=tp, dp_size=dp)
    resolve_server_args(args)
    assert (args.tp_size, args.dp_size, _resolved(args).speculative_num_draft_tokens) == (tp, dp, 8)


@pytest.mark.parametrize("overrides,message", [
    ({"pp_size": 2}, r"pipeline parallelism \(--pp-size 2\) is not supported .* Use --pp-size 1 with tensor "
                     r"parallelism \(--tp-size N\)"),
    ({"tp_size": 3}, r"the draft's num_attention_heads=4, num_key_value_heads=2 cannot be split over --tp-size 3 "),
    ({"tp_size": 8}, r"the draft's num_attention_heads=4 cannot be split over --tp-size 8 .*Use a --tp-size that "
                     r"divides them"),
    ({"dp_size": 2, "enable_dp_attention": True}, "--enable-dp-attention"),
    ({"tp_size": 2, "attn_dp_size": 2}, r"data-parallel attention .*--attn-dp-size"),
    ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
    ({"page_size": 16}, "--page-size 16"),
    ({"attention_backend": "fa3"}, "--attention-backend fa3"),
    ({"speculative_dflash_block_size": 65}, r"block size 65 is out of range \[2, 64\]"),
    ({"speculative_dflash_block_size": 8, "speculative_num_draft_tokens": 4}, "differ"),
    ({"speculative_eagle_topk": 4}, "must be 1"),
    ({"speculative_draft_window_size": 128}, "draft-window-size"),
    ({"enable_lora": True}, "LoRA adapters"),
    ({"lora_paths": ["a=/adapters/a"]}, "LoRA adapters"),
    ({"speculative_draft_model_path": None}, "needs a draft model"),
])
def test_unsupported_flags_fail_with_the_fix(draft_dir, overrides, message):
    from sglang_dflash.adapter.server_args import resolve_server_args

    with pytest.raises(ValueError, match=message) as err:
        resolve_server_args(_args(draft_dir, **overrides))
    assert str(err.value).startswith("sglang-dflash:")


def test_default_attention_backend_is_one_dflash_serves(monkeypatch):
    import sglang.srt.utils

    from sglang_dflash.adapter.server_args import _SUPPORTED_BACKENDS, default_attention_backend

    cuda, cpu = SimpleNamespace(device="cuda"), SimpleNamespace(device="cpu")
    for backend in _SUPPORTED_BACKENDS:
        assert default_attention_backend(cuda, backend) == backend  # SGLang's choice kept where we serve it
        assert default_attention_backend(cuda, backend, attention_sinks=True) == backend
    for installed, fallback in ((True, "flashinfer"), (False, "triton")):
        monkeypatch.setattr(sglang.srt.utils, "is_flashinfer_available", lambda: installed)
        assert [default_attention_backend(cuda, b) for b in ("fa3", "trtllm_mha", "fa4", None)] == [fallback] * 4
        # attention sinks (gpt-oss): FlashInfer has none
        assert default_attention_backend(cuda, "fa3", attention_sinks=True) == "triton"
    assert default_attention_backend(cpu, "intel_amx") == "torch_native"


def _sglang_decides(args, **fields):
    """SGLang's own start-up decision for the model (a model override; not typed by the user, whose values the raw
    fields keep until resolution ends)."""
    from sglang_dflash.adapter import compat

    if compat.SERVER_ARGS_DECLARED:
        compat._overrides.declare_resolution(args, "_model_overrides", **fields)
    else:
        args._resolved_overrides = [*getattr(args, "_resolved_overrides", []), ("_model_overrides", dict(fields))]


@pytest.mark.parametrize("sinks, served", [(False, "flashinfer"), (True, "triton")])
def test_a_backend_sglang_picks_for_the_model_is_replaced_by_one_dflash_serves(draft_dir, monkeypatch, caplog,
                                                                                sinks, served):
    """gpt-oss on Hopper: SGLang picks fa3 for the model (not the user: no --attention-backend typed), which DFLASH is
    not served with; the launcher uses triton for a target with attention sinks (else flashinfer), logged, and a page
    size SGLang picks is set back to 1 -- where a backend or page size the user typed is refused."""
    import logging

    import sglang.srt.utils

    from sglang_dflash.adapter import server_args as sa

    monkeypatch.setattr(sglang.srt.utils, "is_flashinfer_available", lambda: True)
    monkeypatch.setattr(sa, "attention_sinks", lambda server_args: sinks)
    args = _args(draft_dir, device="cuda", page_size=None)
    _sglang_decides(args, attention_backend="fa3", page_size=64)
    with caplog.at_level(logging.INFO, logger=sa.logger.name):
        sa.resolve_server_args(args)
    assert (_resolved(args).attention_backend, _resolved(args).page_size) == (served, 1)
    assert "SGLang picks the fa3 attention backend for this model here" in caplog.text
    assert f"using {served}" in caplog.text and "page size 1 instead of the 64 SGLang picks" in caplog.text


def test_launch_without_attention_backend_gets_a_served_default_on_hopper():
    """`launch_server --speculative-algorithm DFLASH` with no --attention-backend on an H100/H200: SGLang's default
    there is fa3, which the worker does not serve; the plugin's hook picks a supported backend for DFLASH only.
    Runs in a subprocess: installing hooks patches SGLang process-wide."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import os, pkgutil
        from types import SimpleNamespace
        from sglang_dflash.adapter import compat, hooks
        hooks.install()
        from sglang.srt.plugins.hook_registry import HookRegistry
        HookRegistry.apply_hooks()
        from sglang.srt import runtime_context
        # what an H100/H200 with CUDA >= 12.3 reports (a platform fact from 0.5.20, a server_args helper before)
        if hasattr(runtime_context, "override_platform"):
            runtime_context.override_platform(is_hopper_with_cuda_12_3=True).install()
        else:
            import sglang.srt.server_args as sa
            sa.is_hopper_with_cuda_12_3 = lambda: True
        get_default = pkgutil.resolve_name(compat.DEFAULT_ATTN_BACKEND[0])  # the hooked SGLang function
        cfg = SimpleNamespace(hf_config=SimpleNamespace(architectures=["LlamaForCausalLM"]), has_attention_sinks=False)
        def default(algo):
            args = SimpleNamespace(speculative_algorithm=algo, speculative_eagle_topk=None, page_size=None, device="cuda")
            return get_default(args, False, cfg)
        print("DEFAULTS", default("DFLASH"), default(None), default("EAGLE"))
        os.environ[hooks.IMPL_ENV] = "builtin"
        hooks.selected_impl.cache_clear()  # as a process started with the variable set
        print("BUILTIN", default("DFLASH"))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    from sglang.srt.utils import is_flashinfer_available

    served = "flashinfer" if is_flashinfer_available() else "triton"
    assert f"DEFAULTS {served} fa3 fa3" in out.stdout, out.stdout
    assert "BUILTIN fa3" in out.stdout, out.stdout


@pytest.fixture(scope="module")
def smollm2_and_drafter(tmp_path_factory) -> tuple[str, str]:
    """(SmolLM2 target directory, the drafter the server tests serve with it)."""
    from server_fixtures import drafter_for_tests

    from sglang_dflash.assets import smollm2_path

    target = smollm2_path()
    return str(target), str(drafter_for_tests(tmp_path_factory.mktemp("drafter"), target)[0])


LAUNCHER_ARGS = """
import json, sys
from sglang_dflash.adapter import hooks
hooks.install()
from sglang.srt.plugins.hook_registry import HookRegistry
HookRegistry.apply_hooks()
from sglang.srt.server_args import prepare_server_args
from sglang_dflash.adapter import compat
results = {}
for name, argv in json.loads(sys.argv[1]).items():
    try:
        args = prepare_server_args(argv)
        if compat.SERVER_ARGS_DECLARED:  # resolution runs at launch, not in the constructor
            args.resolve_once()
        args = compat.published(args)
        results[name] = ["ok", args.speculative_dflash_block_size, args.speculative_num_draft_tokens]
    except ValueError as e:
        results[name] = ["error", str(e)]
print("RESULTS " + json.dumps(results))
"""


def test_launcher_refuses_broken_drafts_and_resolves_hub_ids(smollm2_and_drafter, tmp_path):
    """`launch_server --speculative-algorithm DFLASH` arguments through SGLang's own server-args processing with the
    plugin's hooks, as the launcher runs it before starting anything: a draft without config.json (refused by the
    plugin before SGLang reads the draft), a mask id outside the draft's vocabulary and an out-of-range block size
    are refused with sglang-dflash's message; a draft named by a Hugging Face Hub repo id resolves offline from the
    HF cache (block size from its config), a missing one is refused naming both readings of the path. In a
    subprocess: hooks patch SGLang process-wide, and huggingface_hub reads its cache settings at import. The
    worker's own checks: the next test; a refused start whose message reaches the server log: test_server_dflash.py."""
    import json
    import os
    import subprocess
    import sys

    from server_fixtures import HUB_REPO_ID, broken_drafts, hub_cache

    target, draft = smollm2_and_drafter
    broken = broken_drafts(draft, target, tmp_path / "broken")
    env = {**os.environ, **hub_cache(draft, tmp_path / "hub")}

    def argv(path, *extra):
        return ["--model-path", target, "--device", "cpu", "--attention-backend", "torch_native",
                "--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", path, *extra]

    refused = ("no-config", "mask-own", "block-65")
    cases = {name: argv(broken[name][0], *broken[name][1]) for name in refused}
    cases.update(hub=argv(HUB_REPO_ID), missing=argv("someone/missing-draft"))
    out = subprocess.run([sys.executable, "-c", LAUNCHER_ARGS, json.dumps(cases)], capture_output=True, text=True,
                         env=env, timeout=300)
    lines = [line for line in out.stdout.splitlines() if line.startswith("RESULTS ")]
    assert out.returncode == 0 and lines, out.stderr[-3000:]
    results = json.loads(lines[0].removeprefix("RESULTS "))
    for name in refused:
        assert results[name][0] == "error" and broken[name][2] in results[name][1], (name, results[name])
    block = json.loads((Path(draft) / "config.json").read_text())["block_size"]
    assert results["hub"] == ["ok", block, block], results["hub"]
    kind, message = results["missing"]
    assert kind == "error" and "not a local directory" in message and "Hub repo" in message, results["missing"]


def test_worker_refuses_drafts_that_do_not_fit_the_target(smollm2_and_drafter, tmp_path):
    """The DFLASH worker's check when it loads in the scheduler process (the draft's config against the target's
    config): a hidden size other than the target's and a mask id outside the target's vocabulary (which the draft's
    own, larger vocabulary allows) are refused with sglang-dflash's message; the served drafter fits."""
    from server_fixtures import broken_drafts
    from transformers import AutoConfig

    from sglang_dflash.config import DFlashConfigError

    target, draft = smollm2_and_drafter
    broken = broken_drafts(draft, target, tmp_path)
    target_config = AutoConfig.from_pretrained(target)
    DFlashDraftConfig.from_pretrained(draft).validate_target(target_config)
    for name in ("hidden", "mask-target"):
        path, _, message = broken[name]
        with pytest.raises(DFlashConfigError) as err:
            DFlashDraftConfig.from_pretrained(path).validate_target(target_config)
        assert message in str(err.value), name


def test_draft_state_filter_and_merge():
    from sglang_dflash.adapter.spec_inputs import DFlashDraftState

    a = DFlashDraftState(bonus_tokens=torch.tensor([10, 11, 12]), block_size=4)
    a.filter_batch(torch.tensor([0, 2]))
    assert a.bonus_tokens.tolist() == [10, 12]
    a.merge_batch(DFlashDraftState(bonus_tokens=torch.tensor([13]), block_size=4))
    assert a.bonus_tokens.tolist() == [10, 12, 13]


def test_draft_state_relayed_through_the_future_map_filters_and_merges_its_rows():
    """Under the overlap schedule the bonus tokens are resolved from FutureMap rows: filter/merge act on those rows,
    and a relayed batch cannot be merged with one that is not."""
    from sglang_dflash.adapter.spec_inputs import DFlashDraftState

    def relayed(rows):
        return DFlashDraftState(bonus_tokens=torch.full((len(rows),), -1), block_size=4,
                                future_indices=torch.tensor(rows))

    a = relayed([7, 3, 9])
    a.filter_batch(torch.tensor([2, 0]), [2, 0])
    assert a.future_indices.tolist() == [9, 7]
    a.merge_batch(relayed([5]))
    assert a.future_indices.tolist() == [9, 7, 5]
    with pytest.raises(RuntimeError, match="FutureMap"):
        a.merge_batch(DFlashDraftState(bonus_tokens=torch.tensor([1]), block_size=4))
    # the FutureMap's relay payload reads these fields of every algorithm's draft state
    assert (a.topk_p, a.topk_index, a.hidden_states, a.dsa_topk_indices) == (None, None, None, None)


def test_overlap_is_kept_only_for_batches_that_do_not_read_the_output_so_far(monkeypatch):
    """The scheduler applies the previous step's result before a batch runs when `is_disable_overlap_for_batch`
    says so: SGLang's own reasons, and for DFLASH decode batches with penalties, min_new_tokens not yet reached,
    custom processors or grammars."""
    monkeypatch.setattr(hooks, "_serving_dflash", lambda: True)

    def batch(*reqs, decode=True, grammar=False, processors=False, bias=None):
        info = SimpleNamespace(is_all_greedy=True, has_custom_logit_processor=processors, logit_bias=bias)
        for r in reqs:
            r.output_ids = [5, 6]
        return SimpleNamespace(sampling_info=info, has_grammar=grammar, reqs=list(reqs),
                               forward_mode=SimpleNamespace(is_decode=lambda: decode))

    def sync(b, sglang_says=False):
        return hooks._sync_for_history(lambda *a: sglang_says, None, b, None)

    assert not sync(batch(_req(), _req(min_new_tokens=2)))  # plain greedy, min_new_tokens reached
    assert not sync(batch(_req(), bias=torch.zeros(1, 8)))  # logit_bias does not depend on the output
    assert sync(batch(_req(), _req(min_new_tokens=3)))
    assert sync(batch(_req(), grammar=True))
    assert sync(batch(_req(), processors=True))
    assert sync(batch(_req(repetition_penalty=1.2)))
    assert not sync(batch(_req(repetition_penalty=1.2), decode=False))  # a prefill reads no draft history
    assert sync(batch(_req()), sglang_says=True) and not sync(None)
    monkeypatch.setattr(hooks, "_serving_dflash", lambda: False)
    assert not sync(batch(_req(), grammar=True))  # another algorithm: SGLang's rule only


def test_sglangs_decode_graphs_are_warmed_up_not_captured_when_our_step_serves(monkeypatch):
    """The DFLASH decode step calls both models itself (eager, or its own graphs), so SGLang's decode-mode graph
    runners of a DFLASH-ours server run only their one-time kernel warm-up; any other server captures as SGLang does."""
    calls = []
    runner = SimpleNamespace(warmup=lambda: calls.append("warmup"),
                             model_runner=SimpleNamespace(is_draft_worker=True))

    def capture(r):
        calls.append("capture")

    monkeypatch.setattr(hooks, "_serving_dflash", lambda: True)
    assert hooks._warm_up_without_decode_graphs(capture, runner) is None
    assert calls == ["warmup"]
    monkeypatch.setattr(hooks, "_serving_dflash", lambda: False)
    hooks._warm_up_without_decode_graphs(capture, runner)
    assert calls == ["warmup", "capture"]


def test_every_forward_publishes_its_committed_lengths():
    """Under the overlap schedule the scheduler plans the next step from the lengths published by this one: the
    worker hands `on_publish` the result's new_seq_lens on every path (prefill, idle, decode), and nothing when
    the scheduler is synchronous (no callback)."""
    from sglang_dflash.adapter.worker import DFlashWorker

    def batch(mode, bs=2):
        forward_mode = SimpleNamespace(is_extend=lambda: mode == "extend", is_idle=lambda: mode == "idle")
        return SimpleNamespace(forward_mode=forward_mode, is_extend_in_batch=False, batch_size=lambda: bs)

    published, kinds = [], []
    for b, lens in ((batch("decode"), torch.tensor([5, 9])), (batch("extend"), torch.tensor([3, 4])),
                    (batch("idle", 0), torch.empty(0, dtype=torch.int64))):
        result = SimpleNamespace(new_seq_lens=lens)
        worker = SimpleNamespace(decode=lambda batch, r=result: kinds.append("decode") or r,
                                 prefill=lambda batch, r=result: kinds.append("prefill") or r,
                                 idle=lambda r=result: kinds.append("idle") or r)
        got = DFlashWorker.forward_batch_generation(worker, b, on_publish=published.append)
        assert published[-1] is got.new_seq_lens is lens
        DFlashWorker.forward_batch_generation(worker, b)
    assert len(published) == 3 and kinds == ["decode", "decode", "prefill", "prefill", "idle", "idle"]


def test_mismatched_sglang_refuses_dflash_only():
    """On an SGLang whose hooked symbols differ, DFLASH is refused with the supported version; others still work.
    Runs in a subprocess: installing hooks patches SGLang process-wide."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        from sglang_dflash.adapter import hooks
        hooks.check_sglang_compat = lambda: ["sglang==9.9 installed"]
        hooks.install()
        from sglang.srt.plugins.hook_registry import HookRegistry
        HookRegistry.apply_hooks()
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        assert SpeculativeAlgorithm.from_string("EAGLE") is SpeculativeAlgorithm.EAGLE
        try:
            SpeculativeAlgorithm.from_string("DFLASH")
        except RuntimeError as e:
            print("REFUSED:", e)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "REFUSED: sglang-dflash supports SGLang 0.5.17 to 0.5.23" in out.stdout
    assert "sglang==9.9 installed" in out.stdout and "SGLANG_DFLASH_IMPL=builtin" in out.stdout


def test_block_kv_layout_gathers_prefix_and_block_per_request():
    """write_block_kv_layout (the step graphs' device-side layout, and the verify attention's on SGLang without the
    KV-location plan) on odd sizes, run by SGLang's Triton kernel under TRITON_INTERPRET=1 (a subprocess: the
    variable is read at import) into poisoned buffers: request i reads req_to_token[row_i, s_i : s_i + prefix_i +
    block] (s_i = kv_start_idx[i], 0 without), packed in batch order. The verify layout against SGLang's own:
    test_verify_args.py."""
    import os
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch
        from sglang_dflash.adapter.spec_inputs import write_block_kv_layout
        g = torch.Generator().manual_seed(5)
        for bs, block, windowed in ((1, 3, False), (3, 16, False), (5, 7, False), (3, 4, True), (5, 16, True)):
            pool, ctx = bs + 2, 61
            req_to_token = torch.randperm(pool * ctx, generator=g).to(torch.int32).view(pool, ctx)
            rows = torch.randperm(pool, generator=g)[:bs]
            prefix = torch.randint(0, ctx - block + 1, (bs,), generator=g)
            start = torch.randint(0, 3, (bs,), generator=g) * (ctx - block - prefix) // 2 if windowed else None
            first = start.tolist() if windowed else [0] * bs
            indptr = torch.full((bs + 1,), -7, dtype=torch.int32)
            indices = torch.full((int(prefix.sum()) + bs * block + 4,), -7, dtype=torch.int32)
            write_block_kv_layout(req_to_token, rows, prefix, block, indptr, indices, start)
            want = torch.cat([req_to_token[r, s : s + p + block]
                              for r, s, p in zip(rows.tolist(), first, prefix.tolist())])
            assert indptr.tolist() == [0] + torch.cumsum(prefix + block, 0).tolist(), indptr
            assert torch.equal(indices[: len(want)], want) and (indices[len(want):] == -7).all()
        print("LAYOUT OK")
    """)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "LAYOUT OK" in out.stdout


def _workspace_int32(ws: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """The test's own reading of ``n`` int32 entries at byte ``offset`` of a uint8 FlashInfer workspace."""
    return ws[offset : offset + 4 * n].view(torch.int32)


def test_step_graph_device_plan_writes_flashinfer_workspace_at_the_plan_offsets(monkeypatch):
    """DevicePlan reads the capture-time plan's offsets (FlashInfer's PrefillPlanInfo order) and writes the split-kv
    plan of the committed lengths and the row count there, as int32 (uint8 block_valid_mask), leaving the rest of
    the workspace: every array a replay's kernels read from it, so graphs can share one workspace."""
    from sglang_dflash.adapter import step_graphs
    from sglang_dflash.kernels.attention_plan import split_kv_plan_ref

    monkeypatch.setattr(step_graphs.torch.cuda, "get_device_properties",
                        lambda device: SimpleNamespace(multi_processor_count=5))
    bs, B, padded = 3, 4, 8
    offsets = dict(rows=0, req=16, qtile=48, kvtile=80, merge=112, o=176, chunk=192, valid=208)
    info = [padded, bs * B, offsets["rows"], 64, offsets["req"], offsets["qtile"], offsets["kvtile"],
            offsets["merge"], offsets["o"], offsets["chunk"], 0, 0, offsets["valid"], 1, 1]
    ws = torch.full((256,), 0xAB, dtype=torch.uint8)
    wrapper = SimpleNamespace(_plan_info=info, _int_workspace_buffer=ws)
    plan = step_graphs.DevicePlan(wrapper, bs, B, num_qo_heads=6, num_kv_heads=2,
                                  scratch=torch.zeros(12, dtype=torch.int32))
    assert plan.tiles_q == 1 and plan.max_batch_size_if_split == 5  # ceil(4 * 3 / 64); 2 * 5 SMs // 2 kv heads
    seq_lens = torch.tensor([300, 1, 129])
    plan.write(seq_lens)
    want = split_kv_plan_ref(seq_lens, B, 1, 5, padded, 128)
    # kv 304, 5, 133: chunks of 128 make 3 + 1 + 2 > 5 items; 133 is the smallest size with 3 + 1 + 1
    assert want["kv_chunk_size"].item() == 133 and want["block_valid_mask"].sum() == 5

    i32 = functools.partial(_workspace_int32, ws)
    assert torch.equal(i32(offsets["req"], padded), want["request_indices"])
    assert torch.equal(i32(offsets["qtile"], padded), want["qo_tile_indices"])
    assert torch.equal(i32(offsets["kvtile"], padded), want["kv_tile_indices"])
    assert torch.equal(i32(offsets["merge"], bs * B + 1), want["merge_indptr"])
    assert torch.equal(i32(offsets["o"], bs + 1), want["o_indptr"])
    assert torch.equal(i32(offsets["chunk"], 1), want["kv_chunk_size"])
    assert torch.equal(ws[offsets["valid"] : offsets["valid"] + padded], want["block_valid_mask"])
    assert i32(offsets["rows"], 1).item() == bs * B  # the plan's row count (the workspace is shared by graphs)
    written = torch.zeros(256, dtype=torch.bool)
    for key, n in (("rows", 1), ("req", padded), ("qtile", padded), ("kvtile", padded), ("merge", bs * B + 1), ("o", bs + 1),
                   ("chunk", 1)):
        written[offsets[key] : offsets[key] + 4 * n] = True
    written[offsets["valid"] : offsets["valid"] + padded] = True
    assert (ws[~written] == 0xAB).all()
    with pytest.raises(RuntimeError, match="15 fields with enable_cuda_graph, split_kv set"):
        step_graphs.DevicePlan(SimpleNamespace(_plan_info=info[:14] + [0], _int_workspace_buffer=ws), bs, B, 6, 2,
                               torch.zeros(12, dtype=torch.int32))


@pytest.mark.parametrize("split", [True, False])
def test_step_graph_decode_plan_writes_flashinfer_workspace_at_the_plan_offsets(split):
    """DecodeDevicePlan reads the capture-time decode plan's offsets (FlashInfer's DecodePlanInfo order) and writes
    the plan of the committed lengths there (int32; uint8 block_valid_mask only when the capture split kv: without a
    split FlashInfer allocates no mask), leaving the rest of the workspace."""
    from sglang_dflash.adapter import step_graphs
    from sglang_dflash.kernels.attention_plan import decode_plan_ref

    bs, kv_heads = 3, 2
    padded = 8 if split else bs
    offsets = dict(req=16, kvtile=48, o=80, valid=96, chunk=112)
    info = [padded, 0, 0, offsets["req"], offsets["kvtile"], offsets["o"], offsets["valid"] if split else 0,
            offsets["chunk"], 1, int(split)]
    ws = torch.full((160,), 0xAB, dtype=torch.uint8)
    plan = step_graphs.DecodeDevicePlan(SimpleNamespace(_plan_info=info, _int_workspace_buffer=ws), bs,
                                        scratch=torch.zeros(12, dtype=torch.int32))
    seq_lens = torch.tensor([300, 1, 129])
    plan.write(seq_lens)
    want = decode_plan_ref(seq_lens, padded * kv_heads, kv_heads, split, 128)
    if split:  # kv 301, 2, 130 in chunks of 128: 3 + 1 + 2 items of the grid's 8
        assert want["kv_chunk_size"].item() == 128 and want["block_valid_mask"].sum() == 6

    i32 = functools.partial(_workspace_int32, ws)
    assert torch.equal(i32(offsets["req"], padded), want["request_indices"])
    assert torch.equal(i32(offsets["kvtile"], padded), want["kv_tile_indices"])
    assert torch.equal(i32(offsets["o"], bs + 1), want["o_indptr"])
    written = torch.zeros(160, dtype=torch.bool)
    for key, n in (("req", padded), ("kvtile", padded), ("o", bs + 1), ("chunk", 1)):
        written[offsets[key] : offsets[key] + 4 * n] = True
    if split:
        assert torch.equal(i32(offsets["chunk"], 1), want["kv_chunk_size"])
        assert torch.equal(ws[offsets["valid"] : offsets["valid"] + padded], want["block_valid_mask"])
        written[offsets["valid"] : offsets["valid"] + padded] = True
    assert (ws[~written] == 0xAB).all()
    with pytest.raises(RuntimeError, match="10 fields with enable_cuda_graph set"):
        step_graphs.DecodeDevicePlan(SimpleNamespace(_plan_info=info[:8] + [0, int(split)], _int_workspace_buffer=ws),
                                     bs, torch.zeros(12, dtype=torch.int32))


@pytest.mark.parametrize("struct, fields", [("PrefillPlanInfo", "PREFILL_PLAN_INFO"),
                                            ("DecodePlanInfo", "DECODE_PLAN_INFO")])
def test_step_graph_plan_layout_is_the_installed_flashinfers(struct, fields):
    """The step graph reads a wrapper's ``_plan_info`` by the field order of the FlashInfer this SGLang brings
    (0.6.15 with 0.5.17, 0.7.2 with 0.5.23): ``ToVector`` of that struct in its installed scheduler header. A
    FlashInfer that reorders the fields fails here, on a CPU, instead of planning at the wrong offsets on a GPU."""
    from sglang_dflash.adapter import step_graphs

    root = Path(importlib.util.find_spec("flashinfer").submodule_search_locations[0])
    header = (root / "data" / "include" / "flashinfer" / "attention" / "scheduler.cuh").read_text()
    body = header[header.index(f"struct {struct} {{"):]
    listed = re.search(r"ToVector\(\) const \{\s*return \{([^}]*)\};", body)[1]
    assert tuple(name.strip() for name in listed.split(",")) == getattr(step_graphs, fields)


def test_step_graph_accept_writes_one_packed_buffer():
    """The step graph's greedy accept writes accept_tokens' four outputs into views of one int64 buffer
    (`step_graphs.unpack`), equal to the unpacked accept."""
    from sglang_dflash.adapter.sampling import greedy_accept
    from sglang_dflash.adapter.step_graphs import unpack

    g = torch.Generator().manual_seed(3)
    bs, B, V = 3, 5, 11
    draft = torch.randint(0, V, (bs, B), generator=g)
    logits = torch.randn(bs * B, V, generator=g)
    logits.view(bs, B, V)[0, :3].scatter_(-1, draft[0, 1:4, None], 50.0)  # row 0 accepts 3 drafts
    seq_lens = torch.tensor([7, 1, 30])
    packed = torch.full((bs * (B + 3),), -9, dtype=torch.int64)
    got = greedy_accept(draft, logits, seq_lens, out=unpack(packed, bs, B))
    want = greedy_accept(draft, logits, seq_lens)
    assert int(want[0][0]) == 3
    for a, b, v in zip(got, want, unpack(packed, bs, B)):
        assert torch.equal(a, b) and torch.equal(v, b)
    assert (packed != -9).all()


def test_padded_rows_picks_the_smallest_captured_size():
    from sglang_dflash.adapter.step import padded_rows

    rows = [16, 32, 64]
    assert [padded_rows(n, rows) for n in (1, 16, 17, 33, 64, 65)] == [16, 16, 32, 64, 64, None]


def test_custom_params_after_drafts_show_them_as_output_without_touching_the_request():
    from sglang_dflash.adapter.sampling import params_after as _params_after

    req = SimpleNamespace(origin_input_ids=[1, 2], output_ids=[7, 8], rid="r")
    params = {"ngram_size": 2, "__req__": req}
    assert _params_after(params, []) is params and _params_after(None, [3]) is None
    assert _params_after({"token_ids": [5]}, [3]) == {"token_ids": [5]}  # no request to show
    after = _params_after(params, [3, 4])
    assert after["ngram_size"] == 2 and after["__req__"] is not req
    assert after["__req__"].output_ids == [7, 8, 3, 4] and after["__req__"].origin_input_ids == [1, 2]
    assert after["__req__"].rid == "r"
    assert req.output_ids == [7, 8] and params["__req__"] is req
    from array import array

    packed = SimpleNamespace(origin_input_ids=array("q", [1]), output_ids=array("q", [7]))
    after = _params_after({"__req__": packed}, [3])["__req__"]
    assert after.origin_input_ids + after.output_ids == array("q", [1, 7, 3]) and packed.output_ids == array("q", [7])


def test_phase_timer_counts_only_gaps_between_back_to_back_decode_steps(tmp_path):
    import json

    from sglang_dflash.adapter.profiling import PhaseTimer

    timer = PhaseTimer("cpu", str(tmp_path / "phases.json"))
    for i in range(20):
        phase = timer.start_step(batch_size=3)
        with phase("draft"):
            pass
        timer.end_step()
        if i in (4, 11):
            timer.break_chain()  # a prefill ran before the next decode step
    summary = json.loads((tmp_path / "phases.json").read_text())
    assert summary["steps"] == 20 and summary["requests_stepped"] == 60
    assert set(summary["ms_per_step"]) == {"draft", "scheduler"}
    assert timer.totals["scheduler_steps"] == 17  # 19 gaps, two of them after a prefill
    off = PhaseTimer("cpu", None)
    with off.start_step(batch_size=1)("draft"):
        pass
    off.end_step()
    assert off.steps == 0


def test_step_timeline_adds_up_device_and_host_time_once_events_complete(tmp_path, monkeypatch):
    import json

    from sglang_dflash.adapter import profiling

    clock = {"host": 0.0, "device_ms": 0.0, "drained": False}  # drained: the device has run everything
    made = []

    class FakeEvent:  # a timing event stamped with the fake device clock when recorded
        def __init__(self):
            self.t, self.done = None, False
            made.append(self)

        def record(self):
            self.t = clock["device_ms"]

        def query(self):
            return self.done or clock["drained"]

        def elapsed_time(self, other):
            return other.t - self.t

    monkeypatch.setattr(profiling.time, "perf_counter", lambda: clock["host"])
    tl = profiling.StepTimeline(str(tmp_path / "timeline.json"), FakeEvent)

    def call(kind, host_start, host_end, dev_start, dev_end):
        clock["host"], clock["device_ms"] = host_start, dev_start
        mark = tl.begin(kind)
        clock["host"], clock["device_ms"] = host_end, dev_end
        tl.end(mark)

    call("decode", 0.000, 0.001, 0.0, 2.0)
    assert tl.resolved == 0 and len(tl.pending) == 1  # its events have not completed: nothing is waited for
    made[0].done = made[1].done = True
    call("decode", 0.0015, 0.0025, 2.5, 4.5)  # resolves the first call only
    assert tl.resolved == 1 and len(tl.pending) == 1
    clock["drained"] = True
    call("prefill", 0.5, 0.503, 10.0, 13.0)  # 0.5 s after: the server was idle, no pair is recorded
    got = tl.summary()
    assert got["decode.device_ms"] == {"count": 2, "mean_ms": 2.0}
    assert got["decode.host_ms"]["count"] == 2 and abs(got["decode.host_ms"]["mean_ms"] - 1.0) < 1e-9
    assert got["decode->decode.device_idle_ms"] == {"count": 1, "mean_ms": 0.5}
    assert abs(got["decode->decode.host_between_ms"]["mean_ms"] - 0.5) < 1e-9
    assert got["prefill.device_ms"] == {"count": 1, "mean_ms": 3.0}
    assert not any(k.startswith("decode->prefill") for k in got)
    tl.write()
    assert json.loads((tmp_path / "timeline.json").read_text()) == {"calls": 3, "timeline": got}

    monkeypatch.setenv("SGLANG_DFLASH_TIMELINE", str(tmp_path / "t.json"))
    with pytest.raises(ValueError, match="needs a CUDA device"):
        profiling.StepTimeline.from_env("cpu")
    monkeypatch.delenv("SGLANG_DFLASH_TIMELINE")
    off = profiling.StepTimeline.from_env("cpu")
    off.end(off.begin("decode"))
    assert off.resolved == 0 and not off.pending


@pytest.mark.parametrize("free", [1000, 10])
def test_prepare_for_decode_reserves_blocks_past_the_committed_length(monkeypatch, free):
    """A request below two blocks of headroom triggers a reservation; with the slots free every request below three
    blocks is topped up to three (so the next reservations are steps away), with too few free only the two blocks
    SGLang's memory check counted on; nobody below two blocks: no allocation at all."""
    from sglang_dflash.adapter import compat, spec_inputs

    handed = []

    def alloc(tree_cache, n):
        start = 100 + sum(handed)
        handed.append(n)
        return torch.arange(start, start + n, dtype=torch.int64)

    monkeypatch.setattr(spec_inputs, "alloc_token_slots", alloc)
    B = 4

    def req(i, c, a):  # a request's KV fields where this SGLang keeps them (`compat.KV_FIELDS_ON_REQ_KV`)
        if compat.KV_FIELDS_ON_REQ_KV:
            return SimpleNamespace(kv=SimpleNamespace(req_pool_idx=i, kv_committed_len=c, kv_allocated_len=a))
        return SimpleNamespace(req_pool_idx=i, kv_committed_len=c, kv=SimpleNamespace(kv_allocated_len=a))

    def batch_of(specs):
        reqs = [req(i, c, a) for i, c, a in specs]
        return SimpleNamespace(reqs=reqs, batch_size=lambda: len(reqs), tree_cache=None,
                               req_to_token_pool=SimpleNamespace(req_to_token=torch.full((3, 32), -1, dtype=torch.int32)),
                               token_to_kv_pool_allocator=SimpleNamespace(available_size=lambda: free))

    state = spec_inputs.DFlashDraftState(bonus_tokens=torch.zeros(3, dtype=torch.int64), block_size=B)
    # (req_pool_idx, committed, allocated): two blocks ahead = 13 / 11 / 17; three = 17 / 15 / 21
    batch = batch_of([(2, 5, 6), (0, 3, 20), (1, 9, 14)])
    state.prepare_for_decode(batch)
    r2t = batch.req_to_token_pool.req_to_token
    new_len = [17, 20, 21] if free == 1000 else [13, 20, 17]
    assert handed == [new_len[0] - 6 + new_len[2] - 14]
    assert [r.kv.kv_allocated_len for r in batch.reqs] == new_len
    assert r2t[2, 6 : new_len[0]].tolist() == list(range(100, 100 + new_len[0] - 6)) and r2t[2, new_len[0]] == -1
    first = 100 + new_len[0] - 6
    assert r2t[1, 14 : new_len[2]].tolist() == list(range(first, first + new_len[2] - 14))
    assert r2t[1, new_len[2]] == -1
    assert (r2t[0] == -1).all() and (r2t[2, :6] == -1).all()
    assert batch.seq_lens_cpu.tolist() == [5, 3, 9] and batch.seq_lens_sum == 17

    # every request at least two blocks ahead (one below three): nothing allocated, nothing written
    handed.clear()
    batch = batch_of([(2, 5, 13), (0, 3, 20)])
    state.prepare_for_decode(batch)
    assert handed == [] and [r.kv.kv_allocated_len for r in batch.reqs] == [13, 20]
    assert (batch.req_to_token_pool.req_to_token == -1).all()


def test_instrument_wraps_the_worker_from_outside(tmp_path, monkeypatch):
    """SGLANG_DFLASH_PROFILE wraps decode / prefill / the sampler's accept at start-up (the step takes no timing
    argument); unset, the worker's methods are left as they are."""
    import json

    from sglang_dflash.adapter import profiling

    def worker():
        w = SimpleNamespace(device="cpu", calls=[])
        w.sampler = SimpleNamespace(accept=lambda *a: w.calls.append("accept") or "accepted")
        w.decode = lambda batch: w.calls.append("decode") or w.sampler.accept(batch)
        w.prefill = lambda batch: w.calls.append("prefill") or "prefilled"
        w.idle = lambda: "idle"
        w.forward_batch_generation = lambda batch: w.decode(batch)
        return w

    monkeypatch.delenv("SGLANG_DFLASH_PROFILE", raising=False)
    monkeypatch.delenv("SGLANG_DFLASH_TIMELINE", raising=False)
    plain = worker()
    methods = (plain.decode, plain.prefill, plain.sampler.accept, plain.forward_batch_generation)
    profiling.instrument(plain)
    assert (plain.decode, plain.prefill, plain.sampler.accept, plain.forward_batch_generation) == methods

    monkeypatch.setenv("SGLANG_DFLASH_PROFILE", str(tmp_path / "phases.json"))
    w = worker()
    profiling.instrument(w)
    batch = SimpleNamespace(batch_size=lambda: 2)
    for _ in range(20):
        assert w.decode(batch) == "accepted"
    assert w.prefill(batch) == "prefilled" and w.calls.count("accept") == 20
    summary = json.loads((tmp_path / "phases.json").read_text())
    assert summary["steps"] == 20 and summary["requests_stepped"] == 40
    assert {"decode", "accept"} <= set(summary["ms_per_step"])


def test_captured_step_keeps_its_attention_plan_alive():
    """A captured step graph reads buffers its FlashInfer wrappers own; the wrappers are referenced only by the
    size's `GraphPlan`, so `_Captured` must hold it (a replay after they were collected read freed memory)."""
    import gc
    import weakref

    from sglang_dflash.adapter.step_graphs import GraphPlan, _Captured

    class Wrapper:  # stands for a capture-mode FlashInfer wrapper
        pass

    wrappers = [Wrapper(), Wrapper()]
    alive = [weakref.ref(w) for w in wrappers]
    captured = _Captured(graphs=(), batch=None, plan=GraphPlan([(wr, 16, None) for wr in wrappers], []),
                         outputs=None, packed=None)
    del wrappers
    gc.collect()
    assert all(ref() is not None for ref in alive)
    del captured
    gc.collect()
    assert all(ref() is None for ref in alive)


def test_step_widths_cost_a_step_by_its_device_time_or_the_host_interval_to_the_next_choice(monkeypatch):
    """A step's cost is max(its own time, host time from its choice to the next choice); a prefill in between
    voids the host part; figures reach the policy only once both are known."""
    import sglang_dflash.adapter.widths as widths_mod
    from sglang_dflash.policy import AdaptiveConfig

    clock = [0.0]
    monkeypatch.setattr(widths_mod.time, "perf_counter", lambda: clock[0])
    sw = widths_mod.StepWidths(AdaptiveConfig.parse('{"widths": [1, 4]}', 4), 4, "cpu")
    seen = []
    monkeypatch.setattr(sw.policy, "observe", lambda bs, w, lens, s: seen.append((bs, w, lens, round(s, 6))))
    assert sw.possible_widths() == [1, 4]

    w1 = sw.choose(2)  # step 1: 1 ms in the step, then 4 ms of scheduler before the next choice
    clock[0] = 0.001
    sw.finish(torch.tensor([3, 1]))
    assert seen == []  # its host interval is not known yet
    clock[0] = 0.005
    w2 = sw.choose(2)
    assert seen == [(2, w1, [3, 1], 0.005)]
    clock[0] = 0.012  # step 2: 7 ms in the step itself, then a prefill, then the next choice
    sw.finish(torch.tensor([0, 0]))
    sw.interrupt()
    clock[0] = 0.100
    w3 = sw.choose(3)
    assert seen[1] == (2, w2, [0, 0], 0.007)  # the prefill's time is not the step's

    # overlap schedule: the host launches step N, then waits for step N-1: the interval from choice N to N+1 is N-1's
    ov = widths_mod.StepWidths(AdaptiveConfig.parse('{"widths": [1, 4]}', 4), 4, "cpu", overlap=True)
    seen.clear()
    monkeypatch.setattr(ov.policy, "observe", lambda bs, w, lens, s: seen.append((bs, w, lens, round(s, 6))))
    for i, (t_choose, t_done) in enumerate([(1.000, 1.001), (1.010, 1.011), (1.030, 1.031)]):
        clock[0] = t_choose
        ov.choose(1)
        clock[0] = t_done
        ov.finish(torch.tensor([i]))
    assert [x[2:] for x in seen] == [([0], 0.02)]  # step 1: choice 2 -> choice 3 (20 ms), not its own 1 ms
    clock[0] = 1.040
    ov.choose(1)
    assert [x[2:] for x in seen] == [([0], 0.02), ([1], 0.01)]  # step 2: choice 3 -> choice 4

    pinned = widths_mod.StepWidths(AdaptiveConfig.parse('{"widths": [8]}', 16), 16, "cpu")
    assert pinned.fixed and pinned.choose(5) == 8 and pinned.possible_widths() == [8]
    capped = widths_mod.StepWidths(AdaptiveConfig.parse('{"widths": [16], "max_batch_size": 8}', 16), 16, "cpu")
    assert not capped.fixed and capped.possible_widths() == [1, 16] and capped.choose(9) == 1

    # what /get_server_info reports: candidates and decode steps per width since start-up (not reset by the log)
    assert sw.report() == {"widths": [1, 4], "adaptive": True, "max_batch_size": None,
                           "steps_per_width": {str(w): n for w, n in sorted(collections.Counter([w1, w2, w3]).items())}}
    assert pinned.report() == {"widths": [8], "adaptive": False, "max_batch_size": None, "steps_per_width": {"8": 1}}
    assert capped.report()["steps_per_width"] == {"1": 1} and capped.report()["max_batch_size"] == 8
    sw._log()
    assert sum(sw.report()["steps_per_width"].values()) == 3 and not sw.counts


def _hybrid_args(strategy: str, sglang_choice: str, **overrides):
    """Raw server args of a hybrid target in start-up resolution: the user's ``--mamba-radix-cache-strategy`` and
    the strategy SGLang's own resolution already decided (its stash of decisions)."""
    args = SimpleNamespace(**{"mamba_radix_cache_strategy": strategy, "disable_radix_cache": False,
                              "max_running_requests": None, "disable_overlap_schedule": False, **overrides})
    args._resolved_overrides = [("_mamba_radix_cache_resolution",
                                 {"uses_mamba_radix_cache": True, "mamba_radix_cache_strategy": sglang_choice})]
    return args


@pytest.fixture
def qwen3_next_target(monkeypatch):
    """`hybrid.resolve_server_args` sees a Qwen3-Next target (no checkpoint read)."""
    from sglang_dflash.adapter import compat, hybrid

    monkeypatch.setattr(hybrid, "target_state_config", lambda model_config: object())
    monkeypatch.setattr(compat, "model_config", lambda server_args: SimpleNamespace(
        hf_config=SimpleNamespace(architectures=["Qwen3NextForCausalLM"])))


def test_hybrid_extra_buffer_left_to_sglang_becomes_no_buffer_with_the_synchronous_scheduler(qwen3_next_target):
    from sglang.srt.arg_groups.overrides import resolved_view

    from sglang_dflash.adapter import hybrid

    args = _hybrid_args("auto", "extra_buffer")  # SGLang's automatic choice for Qwen3-Next under the overlap schedule
    hybrid.resolve_server_args(args)
    final = resolved_view(args)  # SGLang applies its stash last writer wins
    assert (final.mamba_radix_cache_strategy, final.disable_overlap_schedule, final.max_running_requests) == (
        "no_buffer", True, hybrid.DEFAULT_MAX_RUNNING_REQUESTS)

    kept = _hybrid_args("auto", "no_buffer", max_running_requests=8)  # SGLang's choice for other architectures
    hybrid.resolve_server_args(kept)
    final = resolved_view(kept)
    assert (final.mamba_radix_cache_strategy, final.disable_overlap_schedule, final.max_running_requests) == (
        "no_buffer", False, 8)


def test_hybrid_extra_buffer_asked_for_is_refused_with_the_fix(qwen3_next_target):
    from sglang_dflash.adapter import hybrid

    with pytest.raises(ValueError, match=r"--mamba-radix-cache-strategy extra_buffer is not supported with DFLASH on "
                                         r"Qwen3NextForCausalLM.*--disable-radix-cache"):
        hybrid.resolve_server_args(_hybrid_args("extra_buffer", "extra_buffer"))


def test_dflash_on_cpu_settles_the_synchronous_scheduler_before_sglangs_model_settings():
    """`cpu_platform.dflash_synchronous_scheduler` runs in SGLang's CPU-backend pass, before its model-specific
    settings (where SGLang 0.5.23 picks a hybrid target's radix-cache strategy from the overlap schedule): DFLASH
    served by sglang-dflash on CPU gets the synchronous scheduler there; a server without speculative decoding keeps
    SGLang's choice."""
    from sglang.srt.arg_groups.overrides import resolved_view

    from sglang_dflash.adapter import cpu_platform

    for algorithm, synchronous in (("DFLASH", True), (None, False)):
        args = SimpleNamespace(device="cpu", speculative_algorithm=algorithm, disable_overlap_schedule=False,
                               _resolved_overrides=[])
        cpu_platform.dflash_synchronous_scheduler(args)
        assert resolved_view(args).disable_overlap_schedule is synchronous


def test_hybrid_target_on_cpu_only_where_the_ops_call_form_is_known(qwen3_next_target, monkeypatch):
    """The launcher's CPU set-up (`cpu_platform.check_hybrid_target`) lets a hybrid target start where the form of
    the installed SGLang's CPU op calls is known (`compat.CPU_SIGMOID_MUL_CALL`: found for every supported release),
    and refuses it elsewhere in one line naming the fix; a pure-attention target is not asked."""
    import sglang

    from sglang_dflash.adapter import compat, cpu_platform, hybrid

    args = SimpleNamespace()
    assert compat.CPU_SIGMOID_MUL_CALL is not None
    cpu_platform.check_hybrid_target(args)
    monkeypatch.setattr(compat, "CPU_SIGMOID_MUL_CALL", None)
    with pytest.raises(ValueError, match=rf"^sglang-dflash: Qwen3NextForCausalLM \(a hybrid linear-attention target\) "
                                         rf"on CPU: sglang=={re.escape(sglang.__version__)}'s CPU Qwen3.5 calls "
                                         rf"sgl-kernel's fused_sigmoid_mul_cpu in a form .*Install an SGLang from "
                                         rf"0.5.17 to 0.5.23 to serve it on CPU"):
        cpu_platform.check_hybrid_target(args)
    monkeypatch.setattr(hybrid, "target_state_config", lambda model_config: None)
    cpu_platform.check_hybrid_target(args)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("copy", ["host_to_device", "blocking"])
def test_slot_index_copy_does_not_wait_for_the_running_step(copy):
    """`prepare_for_decode`'s host->device copy (`spec_inputs.host_to_device`) returns while the stream is still
    busy with earlier work (~1 s of spinning, standing in for the running step the scheduler's stream waits for),
    and the values arrive; the blocking ``.to(device)`` it replaced returns only after that work (the same check
    tells them apart)."""
    from sglang_dflash.adapter.spec_inputs import host_to_device

    t = torch.arange(7, dtype=torch.int64)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)
    earlier = torch.cuda.Event()
    earlier.record()
    out = host_to_device(t, "cuda") if copy == "host_to_device" else t.to("cuda")
    returned_while_busy = not earlier.query()
    torch.cuda.synchronize()
    assert out.cpu().tolist() == list(range(7))
    assert returned_while_busy == (copy == "host_to_device")


def test_step_widths_keep_the_whole_block_when_every_draft_is_accepted(monkeypatch):
    """Overlap schedule, 1 request at a time, eight 512-token replies (a prefill between them), host-bound steps
    of ~2.2 ms at every width, every draft accepted: the policy's trials and re-measurements cost at most 4% of the
    steps the whole block needs (32 per reply)."""
    import collections
    import random

    import sglang_dflash.adapter.widths as widths_mod
    from sglang_dflash.policy import AdaptiveConfig

    clock, rng = [0.0], random.Random(0)
    monkeypatch.setattr(widths_mod.time, "perf_counter", lambda: clock[0])
    sw = widths_mod.StepWidths(AdaptiveConfig.parse(None, 16), 16, "cpu", overlap=True)
    used = collections.Counter()
    for _ in range(8):
        sw.interrupt()
        clock[0] += 0.04  # the next request's prefill
        left = 511  # the prefill gave the first token
        while left > 0:
            w = sw.choose(1)
            used[w] += 1
            clock[0] += 0.0003
            sw.finish(torch.tensor([w - 1]))
            left -= w
            clock[0] += 0.0022 * (1 + 0.03 * rng.uniform(-1, 1)) * (1 + 0.002 * w)
    assert sum(used.values()) <= 1.04 * 8 * 32, dict(used)
    assert all(n <= 3 for w, n in used.items() if w < 16), dict(used)  # one trial, then re-measurements


# ---- sampled accept: the verify rows drawn by SGLang's own sampler ----------------------------------------------

def _cpu_sampler(monkeypatch):
    """SGLang's own `Sampler` on CPU with its "pytorch" backend, built outside a server: the process-wide settings it
    reads (one rank, no deterministic mode, the sampling backend) are stubbed where this SGLang looks them up."""
    import sglang.srt.layers.sampler as sm

    group = SimpleNamespace(device_group=None)
    cfg = SimpleNamespace(deterministic=SimpleNamespace(rl_on_policy_target=None, enable_deterministic_inference=False),
                          kernel=SimpleNamespace(sampling_backend="pytorch"),
                          features=SimpleNamespace(sampling_mask_max_tokens=0))
    monkeypatch.setattr(sm, "get_exec", lambda: cfg)
    monkeypatch.setattr(sm, "is_dp_attention_enabled", lambda: False)
    monkeypatch.setattr(sm, "get_tp_group", lambda: group, raising=False)  # SGLang 0.5.17
    monkeypatch.setattr(sm, "get_parallel", lambda: SimpleNamespace(tp_group=group), raising=False)  # 0.5.23
    return sm.Sampler()


def _sampling_info(n: int, vocab: int, temperature: float, top_k: int, top_p: float, seed=None):
    from sglang.srt.sampling.sampling_batch_info import SamplingBatchInfo

    return SamplingBatchInfo(
        temperatures=torch.full((n, 1), temperature), top_ps=torch.full((n,), top_p),
        top_ks=torch.full((n,), top_k, dtype=torch.int32), min_ps=torch.zeros(n), is_all_greedy=False,
        is_any_greedy=False, need_top_p_sampling=top_p < 1, need_top_k_sampling=top_k < vocab,
        need_min_p_sampling=False, vocab_size=vocab, device="cpu", sampling_seed=seed)


def test_sample_rows_gives_each_row_its_requests_parameters_and_position(monkeypatch):
    """Row (i, k) of the verify block is sampled with request i's parameters at position seq_len_i + k; the ids come
    back int64 and the seed stays absent when the batch has none."""
    from sglang_dflash.adapter.sampling import sample_rows

    seen = {}

    def sampler(out, info, return_logprob, top_nums, token_ids, positions):
        seen.update(info=info, positions=positions, return_logprob=return_logprob, n=out.next_token_logits.shape[0])
        return torch.arange(out.next_token_logits.shape[0], dtype=torch.int32)

    info = _sampling_info(2, 9, 0.5, 3, 0.8)
    info.temperatures = torch.tensor([[0.5], [2.0]])
    info.top_ks = torch.tensor([3, 9], dtype=torch.int32)
    ids = sample_rows(sampler, info, torch.zeros(2 * 4, 9), torch.tensor([7, 20]), 4)
    assert ids.dtype == torch.int64 and ids.tolist() == list(range(8))
    rows = seen["info"]
    assert seen["n"] == 8 and seen["return_logprob"] is False
    assert rows.temperatures.view(-1).tolist() == [0.5] * 4 + [2.0] * 4
    assert rows.top_ks.tolist() == [3] * 4 + [9] * 4 and rows.top_ps.shape == (8,) and rows.min_ps.shape == (8,)
    assert seen["positions"].tolist() == [7, 8, 9, 10, 20, 21, 22, 23]
    assert rows.sampling_seed is None and not rows.is_all_greedy and rows.need_top_k_sampling

    info.sampling_seed = torch.tensor([11, 12])
    sample_rows(sampler, info, torch.zeros(8, 9), torch.tensor([7, 20]), 4)
    assert seen["info"].sampling_seed.tolist() == [11] * 4 + [12] * 4


def test_sampled_accept_commits_the_targets_law(monkeypatch):
    """`BlockSampler.accept` with SGLang's own sampler, half the requests at temperature 0.8 with top-k 2, half at
    1.3 with top-p 0.7 (each filter binding where it is set): the first committed token follows the request's
    filtered law at block row 0 (`verify.target_probs`, the rule's own copy), and the second, after an accepted first
    draft, the law at row 1 -- although the drafts are each row's most likely token, which a sampler ignoring them
    would over-commit. Control: the same test rejects a verify step that, after rejecting a draft, draws the bonus
    token afresh from the whole law instead of taking the rejected row's draw."""
    from scipy.stats import chisquare

    from sglang_dflash.adapter.sampling import BlockSampler, sample_rows
    from sglang_dflash.verify import target_probs

    torch.manual_seed(0)
    n, B, V = 4000, 3, 7
    half = n // 2
    base = torch.tensor([[2.0, 1.6, 1.0, 0.5, 0.0, -1.0, -3.0],
                         [0.3, 1.2, 1.1, -0.4, 0.8, -2.0, 0.1],
                         [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = {"temperature": [0.8, 1.3], "top_k": [2, V], "top_p": [1.0, 0.7]}
    laws = [target_probs(base[None], torch.tensor([t]), torch.tensor([k]), torch.tensor([p]), torch.zeros(1),
                         any_greedy=False)[0] for t, k, p in zip(*params.values())]  # per group [B, V]
    assert [int((law > 0).sum()) for law in laws[0][:2]] == [2, 2]  # top-k binds
    assert [int((law > 0).sum()) for law in laws[1][:2]] == [3, 4]  # top-p binds
    group = torch.arange(n) >= half
    drafts = torch.stack([torch.full((n,), 5), base[0].argmax().repeat(n), base[1].argmax().repeat(n)], dim=1)

    def info_for(m: int):
        info = _sampling_info(m, V, 1.0, V, 1.0)
        g = torch.arange(m) >= m // 2
        info.temperatures = torch.where(g, 1.3, 0.8)[:, None]
        info.top_ks = torch.where(g, V, 2).to(torch.int32)
        info.top_ps = torch.where(g, 0.7, 1.0)
        info.need_top_k_sampling = info.need_top_p_sampling = True
        return info

    sampler = _cpu_sampler(monkeypatch)
    reqs = [SimpleNamespace(sampling_params=SimpleNamespace(min_new_tokens=0, frequency_penalty=0.0,
                                                            presence_penalty=0.0, repetition_penalty=1.0),
                            output_ids=[1]) for _ in range(n)]
    info = info_for(n)
    info.logit_bias = None
    batch = SimpleNamespace(has_grammar=False, reqs=reqs, sampling_info=info, return_logprob=False,
                            seq_lens=torch.full((n,), 10))
    accept_lens, bonus, committed, _ = BlockSampler("cpu", sampler).accept(batch, drafts, base.repeat(n, 1))

    def fits(tokens: torch.Tensor, probs: torch.Tensor) -> float:
        keep = probs > 0
        assert (torch.bincount(tokens, minlength=V)[~keep] == 0).all()  # nothing outside the filtered support
        counts = torch.bincount(tokens, minlength=V)[keep].double()
        expected = probs[keep].double()
        return float(chisquare(counts, expected / expected.sum() * counts.sum()).pvalue)

    assert torch.equal(committed[torch.arange(n), accept_lens], bonus)
    for g, law in enumerate(laws):
        mine = group == bool(g)
        assert fits(committed[mine, 0], law[0]) >= 1e-4
        after = mine & (accept_lens >= 1)
        assert 0.2 * half < int(after.sum()) < 0.8 * half
        assert fits(committed[after, 1], law[1]) >= 1e-4

    # control: the bonus drawn afresh after a rejection over-commits d_1
    rows = sample_rows(sampler, info_for(n), base.repeat(n, 1), torch.zeros(n), B).view(n, B)
    fresh = sample_rows(sampler, info_for(n), base.repeat(n, 1), torch.zeros(n), B).view(n, B)
    broken_first = torch.where(rows[:, 0] == drafts[:, 1], drafts[:, 1], fresh[:, 0])
    assert fits(broken_first[~group], laws[0][0]) < 1e-4


def test_step_graphs_planned_cover_every_width_the_policy_can_choose_and_no_more():
    """Every width the policy can choose for n requests has a graph at the size n pads to (a missing one would run
    that step eagerly, with a host sync); above the batch-size ceiling only width 1 is captured (plain decode)."""
    from sglang_dflash.adapter.sampling import FILTERED, GREEDY, SAMPLED
    from sglang_dflash.adapter.step import padded_rows
    from sglang_dflash.adapter.step_graphs import graph_count, planned_graphs
    from sglang_dflash.policy import WidthPolicy

    sizes = [*range(1, 9), *range(10, 33, 2), *range(40, 65, 4)]  # SGLang's speculative ladder up to 64: 27 sizes
    widths = [1, 2, 4, 8, 16]
    plan = planned_graphs(sizes, widths, 49152)
    assert len(plan) == len(set(plan)) == 27 * 5 * 3
    assert plan[:3] == [(64, 16, FILTERED), (64, 16, SAMPLED), (64, 16, GREEDY)]  # largest first, kinds together
    assert plan[-1] == (1, 1, GREEDY)
    pairs = [(bs, w) for bs, w, _ in plan]  # a (size, width)'s kinds are adjacent: they share one verify graph
    assert len([p for p, _ in itertools.groupby(pairs)]) == len(set(pairs))
    assert graph_count(plan) == 27 * 5 * (2 * 3 + 1)
    for ceiling, top in ((21, 22), (20, 20), (64, 64), (100, 64), (0, 0)):
        plan = planned_graphs(sizes, widths, 49152, ceiling)
        policy = WidthPolicy(16, tuple(widths), ceiling)
        for n in range(1, 65):
            m = padded_rows(n, sizes)
            choosable = widths if n <= ceiling else [policy.choose(n)]
            assert choosable == widths or choosable == [1]
            assert all((m, w, GREEDY) in plan for w in choosable)
        assert {(bs, w) for bs, w, _ in plan} == {(bs, w) for bs in sizes for w in (widths if bs <= top else [1])}
    assert len(planned_graphs(sizes, widths, 49152, 21)) == (15 * 5 + 12) * 3  # 15 sizes up to 22, 12 above


def test_step_graph_memory_estimate_counts_each_graph_and_the_shared_buffers():
    """`capture_bytes`, hand-counted: each graph's own memory (per target layer), the shared float32 logits of the
    largest size x block, the drafts' law (the most bs * (w - 1) rows), and three 8 MiB int workspaces (one per
    forward: draft, target verify, target decode; whatever the number of wrappers)."""
    from sglang_dflash.adapter.step_graphs import GRAPH_BYTES_PER_TARGET_LAYER as per_layer, capture_bytes

    ws = 8 << 20
    # sizes 1, 2 x widths 1, 4 x three accept kinds (vocabulary 8: every kind fits): 12 steps, a draft and an accept
    # graph each, and 4 verify graphs; logits 2 x 4 rows, law 2 x 3 rows
    assert capture_bytes([1, 2], [1, 4], 4, 8, 30) == 28 * 30 * per_layer + (8 + 6) * 8 * 4 + 3 * ws
    # a ceiling of 1 request: size 2 at width 1 only (3 steps, 1 verify graph) -> 21 graphs, law 1 x 3 rows
    assert capture_bytes([1, 2], [1, 4], 4, 8, 30, max_batch_size=1) == 21 * 30 * per_layer + (8 + 3) * 8 * 4 + 3 * ws
    # a vocabulary too large for the sampled kinds: greedy only (12 graphs), no law
    big = (256 << 20) // 4 + 1
    assert capture_bytes([1, 2], [1, 4], 4, big, 30) == 12 * 30 * per_layer + 8 * big * 4 + 3 * ws


def _graph_args(draft, **overrides):
    from sglang.srt.model_executor.cuda_graph_config import Backend

    decode = SimpleNamespace(bs=[1, 2, 4, 8], backend=overrides.pop("decode_backend", Backend.FULL))
    return _args(draft, **{"device": "cuda", "speculative_algorithm": "DFLASH",
                           "cuda_graph_config": SimpleNamespace(decode=decode), **overrides})


def test_step_graph_memory_is_added_to_sglangs_reserve_where_the_step_is_captured(draft_dir, monkeypatch):
    """When SGLang sizes --mem-fraction-static itself, the reserve it leaves outside the static fraction (its own
    graphs') grows by the step graphs' estimate for the batch sizes SGLang's decode graphs capture and every width
    the policy can choose; nothing where the step is not captured (CPU, decode graphs off, Triton)."""
    import sglang.srt.utils
    from sglang.srt.model_executor.cuda_graph_config import Backend

    from sglang_dflash.adapter import hooks, server_args as sa
    from sglang_dflash.adapter.step_graphs import capture_bytes

    monkeypatch.setattr(sglang.srt.utils, "is_flashinfer_available", lambda: True)
    monkeypatch.setattr(sa, "attention_sinks", lambda server_args: False)
    sglangs = lambda server_args: 100.0  # noqa: E731  SGLang's own reserve (MB)
    mb = lambda nbytes: nbytes / (1 << 20)  # noqa: E731
    # the test draft: block 8, vocabulary 100, 8 target layers; default widths 1, 2, 4, 8
    assert hooks._reserve_step_graphs(sglangs, _graph_args(draft_dir)) == 100.0 + mb(
        capture_bytes([1, 2, 4, 8], [1, 2, 4, 8], 8, 100, 8))
    config = '{"widths": [4, 8], "max_batch_size": 2}'  # width 1 above the ceiling
    assert hooks._reserve_step_graphs(sglangs, _graph_args(draft_dir, speculative_adaptive_config=config)) == (
        100.0 + mb(capture_bytes([1, 2, 4, 8], [1, 4, 8], 8, 100, 8, max_batch_size=2)))
    for args in (_graph_args(draft_dir, device="cpu"), _graph_args(draft_dir, decode_backend=Backend.DISABLED),
                 _graph_args(draft_dir, attention_backend="triton"),
                 _graph_args(draft_dir, speculative_algorithm="EAGLE")):
        assert hooks._reserve_step_graphs(sglangs, args) == 100.0
    # a target with attention sinks runs on triton (`default_attention_backend`): no step graphs to reserve for,
    # unless the user typed flashinfer
    monkeypatch.setattr(sa, "attention_sinks", lambda server_args: True)
    assert hooks._reserve_step_graphs(sglangs, _graph_args(draft_dir)) == 100.0
    assert hooks._reserve_step_graphs(sglangs, _graph_args(draft_dir, attention_backend="flashinfer")) > 100.0


def test_a_capture_out_of_gpu_memory_names_the_flags_that_fix_it(monkeypatch):
    """Start-up: a decode-step capture that runs out of GPU memory stops the server with what it was capturing and
    the flags that capture less (or leave it more memory), not with the allocator's traceback."""
    from sglang_dflash.adapter import compat, step_graphs

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(compat, "VERIFY_ARGS_KEYWORD_PLAN", False)
    monkeypatch.setattr(compat, "unchecked_flashinfer", lambda: None)
    monkeypatch.setattr(step_graphs.torch.cuda, "mem_get_info", lambda device: (6.4e9, 80e9))
    monkeypatch.setattr(step_graphs, "StepGraphs", out_of_memory)
    runner = SimpleNamespace(decode_cuda_graph_runner=SimpleNamespace(capture_bs=[1, 2, 4, 8, 16, 24, 32]),
                             attn_backend=SimpleNamespace(num_wrappers=1, prefill_backend="fa2"),
                             model_config=SimpleNamespace(vocab_size=151936))
    with pytest.raises(MemoryError) as e:
        step_graphs.capture(None, (runner, runner), "flashinfer", False, (1, 2, 4, 8, 16), "cuda:0")
    message = str(e.value)
    assert message.startswith("sglang-dflash: capturing the decode step (")
    planned = step_graphs.planned_graphs([1, 2, 4, 8, 16, 24, 32], (1, 2, 4, 8, 16), 151936)
    assert f"({step_graphs.graph_count(planned)} CUDA graphs" in message
    assert "batch sizes up to 32 x verify widths [1, 2, 4, 8, 16]" in message and "6.4 GB were free" in message
    for fix in ("--cuda-graph-max-bs 8", """'{"widths": [1, 4, 16]}'""", '"max_batch_size": 32', "--mem-fraction-static"):
        assert fix in message, fix


def test_sampled_step_graphs_only_where_a_vocabulary_row_block_fits():
    """Each (batch size, width) is captured greedy, and sampled / filtered where a [bs x width, V] float32 tensor fits
    `SAMPLED_ROWS_BYTES` (256 MiB): SmolLM2's 49,152 ids up to 1,365 rows, Qwen3's 151,936 up to 441."""
    from sglang_dflash.adapter.sampling import FILTERED, GREEDY, SAMPLED
    from sglang_dflash.adapter.step_graphs import accept_kinds

    assert set(accept_kinds(64, 16, 49152)) == {GREEDY, SAMPLED, FILTERED}  # 1,024 rows
    assert len(accept_kinds(91, 15, 49152)) == 3 and accept_kinds(683, 2, 49152) == (GREEDY,)  # 1,365 / 1,366 rows
    assert len(accept_kinds(441, 1, 151936)) == 3 and accept_kinds(442, 1, 151936) == (GREEDY,)
