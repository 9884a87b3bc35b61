"""Test-only start-up hook of the CPU test servers: switches for testing paths a CPU server does not take by itself.

Put this directory first on PYTHONPATH of an ``sglang.launch_server`` subprocess; Python imports ``sitecustomize``
automatically at start-up, in the server and in every process it spawns. Nothing in the package imports it. What a
CPU server needs to run at all (SGLang's CPU engine, sgl_kernel without a GPU driver, its CPU ops, xgrammar on CPU)
is the plugin's own set-up (``sglang_dflash.adapter.cpu_platform``), not this file's.

1. SGLang's overlap scheduler (FutureMap, the scheduler's batch pinning) calls ``Tensor.record_stream`` with the
   device's current stream, which torch accepts only for CUDA streams ("unknown parameter type"). On CPU there is
   one stream and nothing to record, so a CPU tensor's ``record_stream`` is a no-op here. With
   ``SGLANG_DFLASH_TEST_CPU_OVERLAP=1`` sglang-dflash's ``overlap_supported`` then answers True on CPU, so DFLASH
   runs SGLang's overlap schedule there (the plugin itself turns it off on CPU); the launcher logs
   ``TEST: overlap schedule on CPU`` once.

2. ``SGLANG_DFLASH_TEST_NO_HOST_LENGTHS=1``: SGLang's overlap scheduler does not mirror the committed lengths to the
   host (``decide_needs_cpu_seq_lens`` returns False), as for a GPU server whose decode step is one CUDA graph
   planned on the device (`DFlashWorker.spec_v2_attn_backends`); the CPU step then reads them itself, as a GPU batch
   larger than every capture does. The scheduler logs ``TEST: no host mirror of committed lengths`` once.

3. ``SGLANG_DFLASH_TEST_ORACLE_DRAFT=<file>``: a draft that knows the target's greedy continuations, to force every
   accept length. The file holds token sequences (prompt + the target's greedy output, e.g. from a no-spec server).
   Each DFLASH step, every request's drafts are replaced: a request whose bonus token sits at a position where the
   sequences continue (alike) gets ``n`` correct drafts followed by a wrong one, ``n`` cycling 0, 1, .., B-1 over
   the requests of successive steps (B: the verify width; SGLang's ``spec_correct_drafts_histogram`` shows the accept lengths); other
   requests keep the real draft's proposal. Logged once as ``TEST: oracle draft``.

4. ``SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT=1``: the control of a hybrid target's state commit: every request's
   linear-attention state is committed after the whole verify block instead of after its accepted tokens
   (``sglang_dflash.adapter.hybrid.commit_verified_states``). Logged once as ``TEST: broken state commit``.

5. ``SGLANG_DFLASH_TEST_WIDTHS=16,1,3``: sglang-dflash's verify width cycles through these widths, one per decode
   step, whatever the policy would choose (the server must run adaptive, i.e. more than one candidate width); the
   scheduler logs ``TEST: verify widths cycle [...]`` once.
6. SGLang starts its scheduler and detokenizer with the ``spawn`` start method, so each re-imports SGLang (~10-14 s
   of CPU each, the bulk of a CPU server's start-up). A test server forks them from the launcher instead, which has
   imported it already (a SmolLM2 server ready in ~16 s instead of ~25 s on 2 cores). The spawn path the product
   takes is what ``tests/test_cpu_serving.py`` starts (the README's command, without this file);
   ``SGLANG_DFLASH_TEST_SPAWN=1`` keeps it here too. Only a server launched with ``--device cpu``: a CUDA process
   cannot be forked once CUDA is initialised ("Cannot re-initialize CUDA in forked subprocess").
"""

import itertools
import json
import os
import sys

import torch


# 1. record_stream: a no-op for CPU tensors (see the module docstring)
_record_stream = torch.Tensor.record_stream


def _record_stream_cpu_noop(self, stream):
    if self.device.type == "cpu":
        return None
    return _record_stream(self, stream)


torch.Tensor.record_stream = _record_stream_cpu_noop


class _PatchAfterImport:
    """Meta-path finder that runs a patch right after one module executes."""

    def __init__(self, name, patch):
        self.name, self.patch = name, patch

    def find_spec(self, name, path=None, target=None):
        if name != self.name:
            return None
        import importlib.util

        sys.meta_path.remove(self)  # find the real spec, then stay out of the way
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            self.patch(module)

        spec.loader.exec_module = exec_module
        return spec


# 2. the scheduler's host mirror of the committed lengths off (see the module docstring)
def _patch_overlap_utils(module) -> None:
    def decide_needs_cpu_seq_lens(*_args) -> bool:  # (server_args, attn_backends); 0.5.23: (attn_backends)
        print("TEST: no host mirror of committed lengths", file=sys.stderr, flush=True)
        return False

    module.decide_needs_cpu_seq_lens = decide_needs_cpu_seq_lens


def _patch_server_args(module) -> None:
    def overlap_supported(server_args) -> bool:
        print("TEST: overlap schedule on CPU", file=sys.stderr, flush=True)
        return True

    module.overlap_supported = overlap_supported


if os.environ.get("SGLANG_DFLASH_TEST_CPU_OVERLAP") == "1":
    sys.meta_path.insert(0, _PatchAfterImport("sglang_dflash.adapter.server_args", _patch_server_args))


# 5. verify widths forced to cycle (see the module docstring)
def _patch_policy(module) -> None:
    cycle = [int(w) for w in os.environ["SGLANG_DFLASH_TEST_WIDTHS"].split(",")]
    widths = itertools.cycle(cycle)
    print(f"TEST: verify widths cycle {cycle}", file=sys.stderr, flush=True)
    module.WidthPolicy.choose = lambda self, bs: next(widths)


if os.environ.get("SGLANG_DFLASH_TEST_WIDTHS"):
    sys.meta_path.insert(0, _PatchAfterImport("sglang_dflash.policy", _patch_policy))
if os.environ.get("SGLANG_DFLASH_TEST_NO_HOST_LENGTHS") == "1":
    sys.meta_path.insert(0, _PatchAfterImport("sglang.srt.managers.overlap_utils", _patch_overlap_utils))


# 3. the oracle draft (see the module docstring)
def _patch_step_oracle(module) -> None:
    index: dict[tuple[int, int], list[list[int]]] = {}
    for seq in json.loads(open(os.environ["SGLANG_DFLASH_TEST_ORACLE_DRAFT"]).read()):
        for pos, tok in enumerate(seq):
            index.setdefault((pos, tok), []).append(seq[pos + 1:])
    wanted = itertools.count()
    seen = {}
    build_block, propose = module.build_block, module.propose

    def recording_build_block(bonus, seq_lens, *args, **kwargs):
        seen["seq_lens"] = seq_lens
        return build_block(bonus, seq_lens, *args, **kwargs)

    def oracle_propose(m, hidden, input_ids, bs, *args, **kwargs):
        drafts, law = propose(m, hidden, input_ids, bs, *args, **kwargs)  # [bs, w]: the bonus, w - 1 drafts
        assert law is None, "the oracle draft replaces argmax drafts: greedy requests only"
        B, vocab = drafts.shape[1], m.lm_head_weight.shape[0]
        for i, (pos, bonus) in enumerate(zip(seen["seq_lens"].tolist(), drafts[:, 0].tolist())):
            conts = index.get((pos, bonus))
            if not conts:
                continue
            agreed = []  # the continuation all sequences through (pos, bonus) share
            for toks in zip(*conts):
                if len(set(toks)) > 1:
                    break
                agreed.append(toks[0])
            n = next(wanted) % B
            for j in range(min(n, len(agreed), B - 1)):
                drafts[i, 1 + j] = agreed[j]
            if n < min(len(agreed), B - 1):
                drafts[i, 1 + n] = (agreed[n] + 1) % vocab
        return drafts, law

    module.build_block, module.propose = recording_build_block, oracle_propose
    print("TEST: oracle draft", file=sys.stderr, flush=True)


# 4. the broken state commit (see the module docstring)
def _patch_hybrid(module) -> None:
    commit = module.commit_verified_states

    def commit_whole_block(caches, state_indices, steps):
        return commit(caches, state_indices, torch.full_like(steps, caches.intermediate_ssm.shape[2] - 1))

    module.commit_verified_states = commit_whole_block
    print("TEST: broken state commit", file=sys.stderr, flush=True)


if os.environ.get("SGLANG_DFLASH_TEST_ORACLE_DRAFT"):
    sys.meta_path.insert(0, _PatchAfterImport("sglang_dflash.adapter.step", _patch_step_oracle))
if os.environ.get("SGLANG_DFLASH_TEST_BROKEN_STATE_COMMIT") == "1":
    sys.meta_path.insert(0, _PatchAfterImport("sglang_dflash.adapter.hybrid", _patch_hybrid))


# 6. SGLang's processes forked from the launcher (see the module docstring); CPU servers only
def _cpu_server(argv) -> bool:
    return any(a == "--device" and v == "cpu" for a, v in zip(argv, argv[1:])) or "--device=cpu" in argv


if os.environ.get("SGLANG_DFLASH_TEST_SPAWN") != "1" and _cpu_server(sys.argv):
    import multiprocessing

    _set_start_method = multiprocessing.set_start_method

    def _fork_start_method(method, force=False):
        return _set_start_method("fork" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = _fork_start_method
