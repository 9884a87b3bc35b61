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

from harness import budget
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


# Seconds each module's tests take on a 2-core CPU machine: the fast tier's (one core each) and the server
# tier's (`-m server`, the module alone). Only `--shard` reads them, to balance its shares (a module missing: 2 s).
FAST_TIER_SECONDS = {"test_hf.py": 120, "test_adapter.py": 95, "test_train_ddp.py": 28, "test_assets.py": 23,
                     "test_tp.py": 19, "test_verify.py": 17, "test_train.py": 9, "test_cpu_serving.py": 9,
                     "test_draft_kernels.py": 9, "test_model.py": 8, "test_zlab_semantics.py": 8, "test_bootstrap.py": 7,
                     "test_bench.py": 7, "test_cpu_attention.py": 6, "test_harness_cleanup.py": 5,
                     "test_attention_plan.py": 4, "test_kernels.py": 4}
SERVER_TIER_SECONDS = {"test_server_dflash.py": 583, "test_server_tp.py": 153, "test_server_arch.py": 78,
                       "test_harness.py": 52, "test_server_sliding_draft.py": 39, "test_cpu_serving.py": 32}


def pytest_addoption(parser):
    parser.addoption("--shard", metavar="K/N", default=None,
                     help="run the K-th of N shares of the selected test modules (whole modules, balanced by "
                          "FAST_TIER_SECONDS / SERVER_TIER_SECONDS); tests/run.py runs each tier as shares side by "
                          "side")


def shares(modules: dict[str, tuple[float, float]], n: int) -> list[list[str]]:
    """``n`` shares of ``modules`` (name -> (seconds, PEAK_GB), in collection order), each in the order it runs.
    Longest first, each module goes to the least loaded share. A share keeps the collection order, except that the odd
    shares run the modules of the server budget heaviest (PEAK_GB) first, the even ones lightest first, so that two
    heavy modules do not wait for the budget together at the start."""
    load, out = [0.0] * n, [[] for _ in range(n)]
    for m in sorted(modules, key=lambda m: (-modules[m][0], m)):
        k = load.index(min(load))
        out[k].append(m)
        load[k] += modules[m][0]
    rank = {m: i for i, m in enumerate(modules)}
    for k, share in enumerate(out):
        share.sort(key=rank.get)
        share.sort(key=lambda m: modules[m][1], reverse=k % 2 == 0)  # stable: equal PEAK_GB keep their order
    return out


@pytest.hookimpl(trylast=True)  # after -m / -k deselected theirs
def pytest_collection_modifyitems(config, items):
    spec = config.getoption("--shard")
    if not spec:
        return
    k, n = (int(x) for x in spec.split("/"))
    if not 1 <= k <= n:
        raise pytest.UsageError(f"--shard {spec}: K must lie in 1..N")
    modules = {}  # name -> (seconds, PEAK_GB, tiers): the seconds of the tiers its selected tests belong to
    for item in items:
        name = item.path.name
        seconds, gb, tiers = modules.get(name, (0.0, 0, set()))
        tier = "server" if item.get_closest_marker("server") else "fast"
        if tier not in tiers:
            tiers.add(tier)
            seconds += (SERVER_TIER_SECONDS if tier == "server" else FAST_TIER_SECONDS).get(name, 2.0)
        if tier == "server":
            gb = getattr(item.module, "PEAK_GB", 0)
        modules[name] = (seconds, gb, tiers)
    order = {m: i for i, m in enumerate(shares({m: v[:2] for m, v in modules.items()}, n)[k - 1])}
    config.hook.pytest_deselected(items=[item for item in items if item.path.name not in order])
    items[:] = sorted((item for item in items if item.path.name in order), key=lambda item: order[item.path.name])


@pytest.fixture(scope="module", autouse=True)
def _environment_restored():
    """Each module leaves ``os.environ`` as it found it: the plugin's CPU set-up exports variables for its own
    children (e.g. ``SGLANG_USE_CPU_ENGINE``) that would otherwise reach the subprocesses of later modules."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="module", autouse=True)
def _server_budget(request):
    """Holds the module's ``PEAK_GB`` (the most memory its tests hold at once, its SGLang servers and the test
    process, in GB) of the server budget that ``tests/run.py`` shares between its server-tier processes
    (``harness/budget.py``) while the module runs; without that budget (a plain ``pytest``), nothing."""
    with budget.held(getattr(request.module, "PEAK_GB", 0)):
        yield


_being_set_up = {}  # "item": the test whose setup (fixtures included) or call is running


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    _being_set_up["item"] = item


@pytest.fixture(scope="session", autouse=True)
def _sglang_servers_only_in_the_server_tier():
    """A test that starts ``sglang.launch_server`` must carry the ``server`` marker: ``tests/run.py`` runs those tests
    in the server tier, after the rest, and leaves them out with ``--fast``; its module must declare ``PEAK_GB``
    (:func:`_server_budget`). Starting one from an unmarked test (or from a fixture that an unmarked test is the first
    to use) or from a module without ``PEAK_GB`` raises, naming the test."""
    popen_init = subprocess.Popen.__init__

    def guarded(self, args, *rest, **kwargs):
        item = _being_set_up.get("item")
        text = " ".join(map(str, args)) if isinstance(args, (list, tuple)) else str(args)
        if item is not None and "sglang.launch_server" in text:
            if item.get_closest_marker("server") is None:
                raise RuntimeError(f"{item.nodeid} starts an SGLang server: mark it @pytest.mark.server")
            if not getattr(item.module, "PEAK_GB", 0):
                raise RuntimeError(f"{item.nodeid} starts an SGLang server: give its module PEAK_GB (conftest's "
                                   "_server_budget)")
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
