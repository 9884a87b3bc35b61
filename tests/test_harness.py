"""The server harness: a real ``sglang.launch_server`` (no speculation) on a tiny random Llama must
reproduce transformers' greedy tokens exactly, alone and under concurrent load.

Runs in the harness's device mode (``SGLANG_DFLASH_TEST_DEVICE``, see ``harness/server.py``). In GPU mode the
server serves bfloat16 (flashinfer, or triton with ``SGLANG_DFLASH_TEST_GPU_BACKEND=triton``) and the
transformers reference runs in bfloat16 on the GPU too; the tiny model's head_dim is 64 there (flashinfer's
attention kernels are built for head_dim 64/128/256, not 16).
In bfloat16 (GPU mode, or ``SGLANG_DFLASH_TEST_BF16=1``) SGLang's kernels and transformers' eager code round
differently, so the replies are compared with ``sglang_dflash.compare``'s near-tie rule (transformers' top choices as the
reference) and the logprobs of the shared part within a bf16 tolerance; in float32 they must be identical.
The argv/env tests at the end build both modes' server commands without starting anything.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from sglang_dflash import compare
from harness.models import make_tiny_llama
from harness.server import (
    CPU_BF16,
    CPU_SERVER_ENV,
    DEVICE,
    GPU_BACKEND,
    SITECUSTOMIZE_DIR,
    ServerStartupError,
    device_from_env,
    gpu_backend_from_env,
    expect_startup_failure,
    launch_server,
    server_command,
    server_dtype,
    server_env,
)

pytestmark = pytest.mark.server
PEAK_GB = 4  # one server, a failing one beside it (conftest's _server_budget)

PROMPTS = [
    "Hello, my name is",
    "The capital of France is",
    "def fibonacci(n):\n    if n < 2:\n        return n\n",
    "1, 2, 3, 4, 5,",
]
MAX_NEW_TOKENS = 12
# Tiny-Llama shape per device mode (make_tiny_llama keyword overrides).
TINY_SHAPE = {"cpu": {}, "cuda": {"hidden_size": 256, "head_dim": 64, "intermediate_size": 512}}
BF16 = server_dtype("float32") == "bfloat16"
LOGPROB_ABS = compare.BF16_LOGPROB_ABS if BF16 else 1e-3


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    from sglang_dflash.assets import smollm2_path

    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_path(), seed=0, **TINY_SHAPE[DEVICE])


@pytest.fixture(scope="module")
def hf_model(tiny_dir):
    from transformers import AutoModelForCausalLM

    # The server's dtype and device (float32 on CPU; bfloat16 on the GPU in GPU mode).
    dtype = getattr(torch, server_dtype("float32"))
    return AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=dtype).to(DEVICE).eval()


@pytest.fixture(scope="module")
def prompt_ids(tiny_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_dir)
    ids = [tok(p).input_ids for p in PROMPTS]
    assert len({len(i) for i in ids}) > 1, "prompts should have different lengths"
    return ids


@pytest.fixture(scope="module")
def server(tiny_dir):
    # Log every decode step so the concurrency test can see batch sizes.
    with launch_server(tiny_dir, ["--dtype", "float32", "--decode-log-interval", "1"]) as s:
        yield s


@torch.no_grad()
def hf_greedy(model, ids: list[int], n: int) -> tuple[list[int], list[float], list[list[tuple[float, int]]]]:
    """n greedy tokens of ``model`` after ``ids`` (no EOS stop), their log-probs, and the top choices
    ``[(logprob, token), ...]`` at each position (sglang_dflash.compare's reference)."""
    seq = torch.tensor([ids], device=model.device)
    out, logprobs, tops = [], [], []
    for _ in range(n):
        lp = torch.log_softmax(model(seq).logits[0, -1].float(), -1)
        tok = int(lp.argmax())
        top = lp.topk(compare.TOPK)
        out.append(tok)
        logprobs.append(float(lp[tok]))
        tops.append(list(zip(top.values.tolist(), top.indices.tolist())))
        seq = torch.cat([seq, torch.tensor([[tok]], device=model.device)], dim=1)
    return out, logprobs, tops


def assert_matches_transformers(reference, got_ids: list[int], context, got_logprobs: list[float] | None = None):
    """The server's greedy reply equals transformers' (in bf16: up to a near-tie parting) and its logprobs agree
    within LOGPROB_ABS over the shared part."""
    want, want_lp, tops = reference
    n = compare.agreeing_length(want, got_ids, tops, BF16)
    assert n is not None, (context, want, got_ids)
    if got_logprobs is not None:
        torch.testing.assert_close(torch.tensor(got_logprobs[:n]), torch.tensor(want_lp[:n]), atol=LOGPROB_ABS,
                                   rtol=0)


GREEDY = {"temperature": 0.0, "max_new_tokens": MAX_NEW_TOKENS, "ignore_eos": True}


def test_server_runs_harness_device_and_backend(server):
    info = server.get_server_info()
    assert info["device"] == DEVICE
    assert info["attention_backend"] == {"cpu": "torch_native", "cuda": GPU_BACKEND}[DEVICE]
    assert info["dtype"] == server_dtype("float32")
    assert info["speculative_algorithm"] is None
    if DEVICE == "cuda":  # decode runs as CUDA graphs (SGLang 0.5.17 logs each capture)
        assert re.search(r"Capture target decode CUDA graph end\.", server.log_text()), "no decode CUDA graph captured"


def test_greedy_matches_transformers(server, hf_model, prompt_ids):
    for ids in prompt_ids:
        reference = hf_greedy(hf_model, ids, MAX_NEW_TOKENS)
        out = server.generate(ids, GREEDY, return_logprob=True)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids)
        assert meta["completion_tokens"] == MAX_NEW_TOKENS
        assert meta["finish_reason"]["type"] == "length"
        assert [tok for _lp, tok, _text in meta["output_token_logprobs"]] == out["output_ids"]
        assert_matches_transformers(reference, out["output_ids"], f"prompt {ids}",
                                    [lp for lp, _tok, _text in meta["output_token_logprobs"]])


def test_concurrent_requests_match_transformers(server, hf_model, prompt_ids):
    # 3 copies of each prompt in flight at once: decode batches mix requests of different lengths.
    reference = {tuple(ids): hf_greedy(hf_model, ids, MAX_NEW_TOKENS) for ids in prompt_ids}
    requests = [ids for ids in prompt_ids for _ in range(3)]
    with ThreadPoolExecutor(max_workers=len(requests)) as pool:
        outs = list(pool.map(lambda ids: server.generate(ids, GREEDY), requests))
    for ids, out in zip(requests, outs):
        assert_matches_transformers(reference[tuple(ids)], out["output_ids"], f"prompt {ids}")
    # The server must have batched them: some decode step ran more than one request.
    running = [int(line.split("#running-req: ")[1].split(",")[0])
               for line in server.log_text().splitlines() if "Decode batch" in line and "#running-req: " in line]
    assert max(running) > 1, "no decode batch held more than one request"


def test_batched_input_ids(server, hf_model, prompt_ids):
    # One POST carrying a list of prompts.
    outs = server.post("/generate", {"input_ids": prompt_ids, "sampling_params": GREEDY})
    assert len(outs) == len(prompt_ids)
    for ids, out in zip(prompt_ids, outs):
        assert_matches_transformers(hf_greedy(hf_model, ids, MAX_NEW_TOKENS), out["output_ids"], f"prompt {ids}")


def test_max_new_tokens_1(server, hf_model, prompt_ids):
    for ids in prompt_ids:
        out = server.generate(ids, {"temperature": 0.0, "max_new_tokens": 1, "ignore_eos": True})
        assert_matches_transformers(hf_greedy(hf_model, ids, 1), out["output_ids"], f"prompt {ids}")
        assert out["meta_info"]["completion_tokens"] == 1
        assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1}


def test_broken_model_fails_fast(tiny_dir, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_dir, broken)
    cfg = json.loads((broken / "config.json").read_text())
    hidden = cfg["hidden_size"]  # weights are [.., hidden] (64 on CPU, 256 in GPU mode)
    cfg["hidden_size"] = hidden + 32
    (broken / "config.json").write_text(json.dumps(cfg))
    log = expect_startup_failure(broken, ["--dtype", "float32"])
    assert f"The size of tensor a ({hidden + 32}) must match the size of tensor b ({hidden})" in log


def test_launch_server_raises_with_log_tail(tmp_path):
    with pytest.raises(ServerStartupError, match="exited with code") as err:
        with launch_server(tmp_path / "no-such-model"):
            pass
    assert "no-such-model" in str(err.value)


# ----------------------------------------------------------------------------------------------- argv / env (no server)

PY = sys.executable
PREFIX = [PY, "-m", "sglang.launch_server", "--model-path", "/m", "--host", "127.0.0.1", "--port", "1234"]


def test_device_switch_values():
    assert device_from_env({}) == "cpu"
    assert device_from_env({"SGLANG_DFLASH_TEST_DEVICE": ""}) == "cpu"
    assert device_from_env({"SGLANG_DFLASH_TEST_DEVICE": "cpu"}) == "cpu"
    assert device_from_env({"SGLANG_DFLASH_TEST_DEVICE": "cuda"}) == "cuda"
    for bad in ("gpu", "CUDA", "cuda:0"):
        with pytest.raises(ValueError, match="SGLANG_DFLASH_TEST_DEVICE=.* is not a test device"):
            device_from_env({"SGLANG_DFLASH_TEST_DEVICE": bad})
    with pytest.raises(ValueError, match="test device 'gpu' is not one of"):
        server_command("/m", 1234, device="gpu")


def test_cpu_server_command_and_env():
    served = "bfloat16" if CPU_BF16 else "float32"  # SGLANG_DFLASH_TEST_BF16=1 serves float32 as bfloat16
    assert server_command("/m", 1234, ["--dtype", "float32", "--decode-log-interval", "1"], device="cpu") == [
        *PREFIX, "--device", "cpu", "--attention-backend", "torch_native", "--max-total-tokens", "8192",
        "--sleep-on-idle", "--dtype", served, "--decode-log-interval", "1"]
    # extra args override a default (dropped from the defaults, kept where the test put them)
    assert server_command("/m", 1234, ["--max-total-tokens=4096", "--dtype=float32"], device="cpu") == [
        *PREFIX, "--device", "cpu", "--attention-backend", "torch_native", "--sleep-on-idle",
        "--max-total-tokens=4096", f"--dtype={served}"]
    env = server_env({"OMP_NUM_THREADS": "1"}, device="cpu")
    assert env["PYTHONPATH"].split(os.pathsep) == [
        str(SITECUSTOMIZE_DIR), *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]]
    assert {k: env[k] for k in CPU_SERVER_ENV} == CPU_SERVER_ENV == {
        "SGLANG_USE_CPU_ENGINE": "1", "SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0",
        "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    assert env["OMP_NUM_THREADS"] == "1"
    assert server_dtype("float32", device="cpu") == served


def test_gpu_backend_switch_values():
    assert gpu_backend_from_env({}) == "flashinfer"
    assert gpu_backend_from_env({"SGLANG_DFLASH_TEST_GPU_BACKEND": "triton"}) == "triton"
    with pytest.raises(ValueError, match="SGLANG_DFLASH_TEST_GPU_BACKEND='fa3' is not a test GPU backend"):
        gpu_backend_from_env({"SGLANG_DFLASH_TEST_GPU_BACKEND": "fa3"})
    with pytest.raises(ValueError, match="not one of"):
        server_command("/m", 1234, device="cuda", gpu_backend="fa3")


@pytest.mark.parametrize("backend", ["flashinfer", "triton"])
def test_cuda_server_command_and_env(monkeypatch, backend):
    dtype = "bfloat16"
    cmd = server_command("/m", 1234, ["--dtype", "float32", "--decode-log-interval", "1"], device="cuda",
                         gpu_backend=backend, deterministic=False)
    assert cmd == [
        *PREFIX, "--device", "cuda", "--attention-backend", backend, "--mem-fraction-static", "0.3",
        "--max-total-tokens", "16384", "--cuda-graph-max-bs", "32", "--disable-prefill-cuda-graph",
        "--sleep-on-idle", "--dtype", dtype, "--decode-log-interval", "1"]
    # CUDA graphs for decode / verify stay on: nothing disables them
    assert not {"--disable-cuda-graph", "--disable-decode-cuda-graph", "--cuda-graph-backend-decode"} & set(cmd)
    det = server_command("/m", 1234, [], device="cuda", gpu_backend=backend, deterministic=True)
    assert det == cmd[:-4] + ["--enable-deterministic-inference"]
    assert server_command("/m", 1234, ["--dtype=float32"], device="cuda", gpu_backend=backend)[-1] == f"--dtype={dtype}"
    assert server_command("/m", 1234, ["--dtype", "float16"], device="cuda",
                          gpu_backend=backend)[-2:] == ["--dtype", "float16"]
    assert server_dtype("float32", device="cuda", gpu_backend=backend) == dtype
    assert server_dtype("bfloat16", device="cuda", gpu_backend=backend) == "bfloat16"
    # a test's own value still wins over a GPU default
    over = server_command("/m", 1234, ["--mem-fraction-static", "0.3"], device="cuda")
    assert over.count("--mem-fraction-static") == 1 and over[-2:] == ["--mem-fraction-static", "0.3"]

    # no sitecustomize (not even an inherited one) and no CPU engine switch (not even an inherited one)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITECUSTOMIZE_DIR), "/opt/sglang", "/opt/site"]))
    monkeypatch.setenv("SGLANG_USE_CPU_ENGINE", "1")
    env = server_env({"OMP_NUM_THREADS": "1"}, device="cuda")
    assert env["PYTHONPATH"].split(os.pathsep) == ["/opt/sglang", "/opt/site"]
    assert "SGLANG_USE_CPU_ENGINE" not in env
    assert env["SGLANG_CUDA_COREDUMP_BEFORE_CRASH"] == "0" and env["HF_HUB_OFFLINE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    monkeypatch.delenv("PYTHONPATH")
    assert "PYTHONPATH" not in server_env(device="cuda")


@pytest.mark.parametrize("device, method", [("cpu", "fork"), ("cuda", "spawn")])
def test_sitecustomize_forks_only_cpu_servers(device, method):
    """The harness hook forks SGLang's scheduler / detokenizer from the launcher of a ``--device cpu`` server only:
    a CUDA process cannot be forked once CUDA is initialised, so a GPU server keeps SGLang's spawn."""
    import subprocess

    code = "import multiprocessing as mp; mp.set_start_method('spawn'); print(mp.get_start_method())"
    out = subprocess.run([sys.executable, "-c", code, "--device", device], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(SITECUSTOMIZE_DIR)})
    assert out.stdout.split()[-1] == method
