"""Shared fixtures: tiny random HF targets and matching DFlash draft configs (float32, CPU)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

# Tiny models: intra-op threads only add synchronisation cost (and stall badly on a busy 2-core host).
if "OMP_NUM_THREADS" not in os.environ:
    torch.set_num_threads(1)

from sglang_dflash.config import DFlashDraftConfig

TINY_VOCAB = 128
TINY_MASK_ID = TINY_VOCAB - 1

# The bundled drafter's accept length is tested on the reference engine with the protocol of
# benchmarks/RESULTS.md's tau table -- greedy, block 16, 128 new tokens, held-out MT-Bench / HumanEval / GSM8K --
# on the first TAU_PROMPTS_PER_SET prompts of each set.
TAU_PROMPTS_PER_SET = 3
TAU_NEW_TOKENS = 128


def interpreted_results(test_file: str, out_path) -> dict:
    """Run ``python test_file out_path`` with ``TRITON_INTERPRET=1`` (the variable is read when ``@triton.jit``
    decorates a kernel, so the kernel tests launch their Triton runs in one fresh process) and load what it saved."""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, test_file, str(out_path)], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, f"TRITON_INTERPRET=1 worker failed:\n{proc.stdout}\n{proc.stderr}"
    return torch.load(out_path)


def make_tiny_target(family: str = "qwen3", seed: int = 0, **overrides):
    """A random HF causal LM (``"qwen3"`` or ``"llama"``): 6 layers, hidden 32, GQA 4/2 heads, vocab 128."""
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    cls_cfg, cls_model = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "llama": (LlamaConfig, LlamaForCausalLM)}[family]
    kwargs = dict(
        vocab_size=TINY_VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rope_theta=10000.0,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
    )
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = cls_model(cls_cfg(**kwargs)).to(torch.float32).eval()
    model.generation_config.pad_token_id = 0
    return model


def make_draft_config(target_config, num_hidden_layers: int = 2, block_size: int = 8, **overrides) -> DFlashDraftConfig:
    """A draft config shaped like ``target_config`` (mask id defaults to the last tiny-vocab id)."""
    overrides.setdefault("torch_dtype", "float32")
    overrides.setdefault("mask_token_id", TINY_MASK_ID)
    return DFlashDraftConfig.from_target(
        target_config, num_hidden_layers=num_hidden_layers, block_size=block_size, **overrides
    )


# Seconds each module's fast-tier tests take on a 2-core CPU machine (one core each); only `--shard` reads them, to
# balance its shares (a module missing here counts as 2 s).
FAST_TIER_SECONDS = {"test_hf.py": 120, "test_adapter.py": 95, "test_train_ddp.py": 28, "test_assets.py": 23,
                     "test_tp.py": 19, "test_verify.py": 17, "test_train.py": 9, "test_cpu_serving.py": 9,
                     "test_draft_kernels.py": 9, "test_model.py": 8, "test_zlab_semantics.py": 8, "test_bootstrap.py": 7,
                     "test_bench.py": 7, "test_harness_cleanup.py": 5, "test_attention_plan.py": 4, "test_kernels.py": 4}


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run the K-th of N shares of the selected test modules (whole modules, balanced by "
                          "FAST_TIER_SECONDS); tests/run.py runs the fast tier as shares side by side")


@pytest.hookimpl(trylast=True)  # after -m / -k deselected theirs
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    k, n = (int(x) for x in spec.split("/"))
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec}: K must lie in 1..N")
    modules = sorted({item.path.name for item in items}, key=lambda m: (-FAST_TIER_SECONDS.get(m, 2.0), m))
    load, owner = [0.0] * n, {}
    for m in modules:  # longest first, each to the least loaded share
        owner[m] = load.index(min(load))
        load[owner[m]] += FAST_TIER_SECONDS.get(m, 2.0)
    keep = [item for item in items if owner[item.path.name] == k - 1]
    config.hook.pytest_deselected(items=[item for item in items if owner[item.path.name] != k - 1])
    items[:] = keep


_being_set_up = {}  # "item": the test whose setup (fixtures included) or call is running


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _being_set_up["item"] = item


@pytest.fixture(scope="session", autouse=True)
def _sglang_servers_only_in_the_server_tier():
    """A test that starts ``sglang.launch_server`` must carry the ``server`` marker: ``tests/run.py`` runs those tests
    in the server tier, after the rest, and leaves them out with ``--fast``. Starting one from an unmarked test (or
    from a fixture that an unmarked test is the first to use) raises, naming the test."""
    popen_init = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        item = _being_set_up.get("item")
        text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if item is not None and "sglang.launch_server" in text and item.get_closest_marker("server") is None:
            raise RuntimeError(f"{item.nodeid} starts an SGLang server: mark it @pytest.mark.server")
        popen_init(self, args, *rest, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(subprocess.Popen, "__init__", guarded)
        yield


@pytest.fixture(scope="session")
def tiny_qwen3():
    return make_tiny_target("qwen3")


@pytest.fixture(scope="session")
def tiny_llama():
    return make_tiny_target("llama")


@pytest.fixture
def tiny_draft_config(tiny_qwen3) -> DFlashDraftConfig:
    return make_draft_config(tiny_qwen3.config)
