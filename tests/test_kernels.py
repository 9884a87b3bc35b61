"""Triton kernels vs their torch refs (exact integers), dispatch, and input validation.

The Triton runs happen in ONE subprocess started with ``TRITON_INTERPRET=1`` (the variable is read
when ``@triton.jit`` decorates a kernel, so it must be set before ``sglang_dflash.kernels`` is
imported, which this pytest process may already have done). That subprocess replaces the refs with
functions that raise and counts kernel launches, so its outputs can only come from the kernels.
Output buffers are poisoned before each run; ``req_to_token`` is read only and checked unchanged.
"""

import os
import sys

import pytest
import torch

from conftest import interpreted_results
from sglang_dflash.kernels import accept as accept_mod
from sglang_dflash.kernels import accept_ref, accept_tokens, build_block, build_block_ref, use_triton
from sglang_dflash.kernels import block_builder as block_mod

BATCHES = [1, 3, 7, 33]
BLOCKS = [2, 7, 16, 64]
POISON = -777
MASK_ID = 151_669
MAX_CTX = 200


def _block_inputs(b, block_size, seed):
    """Distinct random slot ids everywhere in ``req_to_token`` (a wrong row/column gathers a wrong
    value). It is a strided view: transposed storage for odd block sizes, a column slice of a wider
    table otherwise."""
    g = torch.Generator().manual_seed(seed)
    pool_size = b + 5
    n = pool_size * MAX_CTX
    slots = (torch.randperm(n, generator=g) * ((2**31 - 2) // n)).to(torch.int32)
    if block_size % 2:
        req_to_token = slots.view(MAX_CTX, pool_size).t()
    else:
        req_to_token = torch.cat([slots.view(pool_size, MAX_CTX), torch.zeros(pool_size, 3, dtype=torch.int32)], 1)
        req_to_token = req_to_token[:, :MAX_CTX]
    seq_lens = torch.randint(0, MAX_CTX - block_size + 1, (b,), generator=g)
    seq_lens[0] = MAX_CTX - block_size  # the block ends on the table's last column
    req_pool_indices = torch.randperm(pool_size, generator=g)[:b]  # distinct rows
    # the largest slot id an int32 table holds, in the last gathered entry
    req_to_token[req_pool_indices[-1], seq_lens[-1] + block_size - 1] = 2**31 - 1
    return dict(
        last_tokens=torch.randint(0, 152_000, (b,), generator=g),
        seq_lens=seq_lens,
        req_to_token=req_to_token,
        req_pool_indices=req_pool_indices,
    )


def _accept_inputs(b, block_size, seed):
    """Rows with accept lengths spread over 0..B-1; a tiny vocabulary makes later positions match
    by chance after the first mismatch (the rule must still stop there)."""
    g = torch.Generator().manual_seed(seed)
    draft = torch.randint(0, 3, (b, block_size), generator=g)
    target = torch.randint(0, 3, (b, block_size), generator=g)
    lens = torch.randint(0, block_size, (b,), generator=g)
    for r in range(b):
        a = int(lens[r])
        target[r, :a] = draft[r, 1 : a + 1]
        if a < block_size - 1:
            target[r, a] = (draft[r, a + 1] + 1) % 3
    return draft, target, torch.randint(0, 10_000, (b,), generator=g)


def _cases():
    for b in BATCHES:
        for block_size in BLOCKS:
            yield b, block_size, 1000 * b + block_size


# ---------------------------------------------------------------------------------------------
# Subprocess worker (TRITON_INTERPRET=1)
# ---------------------------------------------------------------------------------------------

def _worker(out_path):
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert use_triton(torch.device("cpu"))
    assert isinstance(block_mod._build_block_kernel, InterpretedFunction)
    assert isinstance(accept_mod._accept_kernel, InterpretedFunction)

    def _ref_called(*args, **kwargs):
        raise AssertionError("launcher fell back to the torch ref")

    block_mod.build_block_ref = _ref_called
    accept_mod.accept_ref = _ref_called
    launches = {"build_block": 0, "accept": 0}

    class _Counting:
        def __init__(self, kernel, key):
            self.kernel, self.key = kernel, key

        def __getitem__(self, grid):
            launches[self.key] += 1
            return self.kernel[grid]

    block_mod._build_block_kernel = _Counting(block_mod._build_block_kernel, "build_block")
    accept_mod._accept_kernel = _Counting(accept_mod._accept_kernel, "accept")

    results = {}
    calls = 0
    for b, block_size, seed in _cases():
        x = _block_inputs(b, block_size, seed)
        out = tuple(torch.full((b * block_size,), POISON) for _ in range(3))
        got = build_block(x["last_tokens"], x["seq_lens"], block_size, MASK_ID, x["req_to_token"],
                          x["req_pool_indices"], out=out)
        assert all(g is o for g, o in zip(got, out))
        results[f"block-{b}-{block_size}-slots"] = got + (x["req_to_token"].clone(),)
        results[f"block-{b}-{block_size}-alloc"] = build_block(
            x["last_tokens"], x["seq_lens"], block_size, MASK_ID, x["req_to_token"], x["req_pool_indices"])
        draft, target, seq_lens = _accept_inputs(b, block_size, seed)
        out = (torch.full((b,), POISON), torch.full((b,), POISON), torch.full((b, block_size), POISON),
               torch.full((b,), POISON))
        results[f"accept-{b}-{block_size}"] = accept_tokens(draft, target, seq_lens, out=out)
        results[f"accept-{b}-{block_size}-alloc"] = accept_tokens(draft, target, seq_lens)
        calls += 1
    results["launches"] = launches
    results["calls"] = calls
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory.mktemp("triton") / "results.pt")


def test_triton_path_was_taken(triton_results):
    """Every launcher call in the worker launched its kernel exactly once (refs raised if called)."""
    n = triton_results["calls"]
    assert n == len(BATCHES) * len(BLOCKS)
    assert triton_results["launches"] == {"build_block": 2 * n, "accept": 2 * n}


@pytest.mark.parametrize("b, block_size, seed", list(_cases()))
def test_build_block_triton_matches_ref(triton_results, b, block_size, seed):
    x = _block_inputs(b, block_size, seed)
    r2t_before = x["req_to_token"].clone()
    ids_ref, pos_ref, loc_ref = build_block_ref(x["last_tokens"], x["seq_lens"], block_size, MASK_ID,
                                                x["req_to_token"], x["req_pool_indices"])
    assert torch.equal(x["req_to_token"], r2t_before)
    ids, pos, loc, req_to_token = triton_results[f"block-{b}-{block_size}-slots"]
    assert ids.dtype == pos.dtype == loc.dtype == torch.int64
    assert torch.equal(ids, ids_ref)
    assert torch.equal(pos, pos_ref)
    assert torch.equal(loc, loc_ref)
    assert loc[-1].item() == 2**31 - 1
    assert torch.equal(req_to_token, r2t_before)  # read only
    ids, pos, loc = triton_results[f"block-{b}-{block_size}-alloc"]
    assert torch.equal(ids, ids_ref) and torch.equal(pos, pos_ref) and torch.equal(loc, loc_ref)


@pytest.mark.parametrize("b, block_size, seed", list(_cases()))
def test_accept_tokens_triton_matches_ref(triton_results, b, block_size, seed):
    expected = accept_ref(*_accept_inputs(b, block_size, seed))
    for key in (f"accept-{b}-{block_size}", f"accept-{b}-{block_size}-alloc"):
        got = triton_results[key]
        assert len(got) == 4
        for name, g, e in zip(("accept_lens", "bonus_tokens", "committed", "new_seq_lens"), got, expected):
            assert g.dtype == torch.int64, name
            assert torch.equal(g, e), f"{key} {name}: {g} != {e}"


# ---------------------------------------------------------------------------------------------
# Refs (the spec) on hand-built cases, and the CPU dispatch
# ---------------------------------------------------------------------------------------------

def test_build_block_ref_hand_built():
    req_to_token = (torch.arange(30, dtype=torch.int32) + 100).view(3, 10)
    ids, pos, loc = build_block_ref(torch.tensor([7, 8]), torch.tensor([0, 5]), 3, 99, req_to_token,
                                    torch.tensor([2, 0]))
    assert ids.tolist() == [7, 99, 99, 8, 99, 99]
    assert pos.tolist() == [0, 1, 2, 5, 6, 7]
    assert loc.dtype == torch.int64
    assert loc.tolist() == [120, 121, 122, 105, 106, 107]
    assert torch.equal(req_to_token, (torch.arange(30, dtype=torch.int32) + 100).view(3, 10))


def test_accept_ref_hand_built():
    draft = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3], [5, 1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [9, 2, 3, 4], [1, 2, 8, 4]])
    accept_lens, bonus, committed, new_seq_lens = accept_ref(draft, target, torch.tensor([10, 20, 30]))
    assert accept_lens.tolist() == [3, 0, 2]
    assert bonus.tolist() == [4, 9, 8]
    assert committed.tolist() == [[1, 2, 3, 4], [9, -1, -1, -1], [1, 2, 8, -1]]
    assert new_seq_lens.tolist() == [14, 21, 33]


def test_cpu_without_interpreter_uses_ref(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert not use_triton(torch.device("cpu"))

    def _kernel_called(*args, **kwargs):
        raise AssertionError("kernel launched on CPU without TRITON_INTERPRET=1")

    monkeypatch.setattr(block_mod, "_build_block_kernel", _kernel_called)
    monkeypatch.setattr(accept_mod, "_accept_kernel", _kernel_called)
    b, block_size = 7, 16
    x = _block_inputs(b, block_size, 5)
    expected_r2t = x["req_to_token"].clone()
    expected = build_block_ref(x["last_tokens"], x["seq_lens"], block_size, MASK_ID, x["req_to_token"],
                               x["req_pool_indices"])
    out = tuple(torch.full((b * block_size,), POISON) for _ in range(3))
    got = build_block(x["last_tokens"], x["seq_lens"], block_size, MASK_ID, x["req_to_token"],
                      x["req_pool_indices"], out=out)
    assert all(g is o for g, o in zip(got, out))
    assert all(torch.equal(g, e) for g, e in zip(got, expected))
    assert torch.equal(x["req_to_token"], expected_r2t)
    inputs = _accept_inputs(b, block_size, 5)
    out = (torch.full((b,), POISON), torch.full((b,), POISON), torch.full((b, block_size), POISON),
           torch.full((b,), POISON))
    for g, e in zip(accept_tokens(*inputs, out=out), accept_ref(*inputs)):
        assert torch.equal(g, e)


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------

def _bb_args(**over):
    args = dict(last_tokens=torch.tensor([1, 2, 3]), seq_lens=torch.tensor([0, 4, 8]), block_size=4, mask_token_id=9,
                req_to_token=torch.zeros(5, 16, dtype=torch.int32), req_pool_indices=torch.tensor([0, 1, 2]))
    args.update(over)
    return args


@pytest.mark.parametrize("over, match", [
    ({"last_tokens": torch.tensor([1, 2, 3], dtype=torch.int32)}, "last_tokens must be torch.int64"),
    ({"last_tokens": torch.zeros(3, 1, dtype=torch.int64)}, "last_tokens must be a 1-D int64 tensor"),
    ({"seq_lens": torch.tensor([0, 4])}, r"seq_lens must have shape \(3,\)"),
    ({"req_pool_indices": None}, "req_pool_indices must be a torch.Tensor"),
    ({"req_pool_indices": torch.tensor([0, 1])}, r"req_pool_indices must have shape \(3,\)"),
    ({"req_pool_indices": torch.tensor([0, 1, 2], dtype=torch.int32)}, "req_pool_indices must be torch.int64"),
    ({"req_to_token": torch.zeros(5, 16, dtype=torch.int64)}, "req_to_token must be a 2-D int32 tensor"),
    ({"req_to_token": torch.zeros(80, dtype=torch.int32)}, "req_to_token must be a 2-D int32 tensor"),
    ({"req_to_token": None}, "req_to_token must be a 2-D int32 tensor"),
])
def test_build_block_validation(over, match):
    with pytest.raises((TypeError, ValueError), match=match):
        build_block(**_bb_args(**over))


def test_build_block_reads_the_last_column():
    """seq_lens + B == max_ctx reads the table's last column."""
    r2t = torch.arange(80, dtype=torch.int32).view(5, 16)
    _, _, loc = build_block(**_bb_args(seq_lens=torch.tensor([0, 4, 12]), req_to_token=r2t))
    assert loc.tolist() == [0, 1, 2, 3, 20, 21, 22, 23, 44, 45, 46, 47]


def test_build_block_validation_out_buffers():
    i64 = lambda n=12: torch.zeros(n, dtype=torch.int64)  # noqa: E731
    with pytest.raises(ValueError, match=r"out must be a tuple \(input_ids, positions, out_cache_loc\)"):
        build_block(**_bb_args(), out=(i64(), i64()))
    with pytest.raises(ValueError, match="out positions must be torch.int64"):
        build_block(**_bb_args(), out=(i64(), torch.zeros(12, dtype=torch.int32), i64()))
    with pytest.raises(ValueError, match=r"out input_ids must have shape \(12,\)"):
        build_block(**_bb_args(), out=(i64(13), i64(), i64()))
    with pytest.raises(ValueError, match=r"out out_cache_loc must have shape \(12,\)"):
        build_block(**_bb_args(), out=(i64(), i64(), i64(11)))


@pytest.mark.parametrize("args, match", [
    ((torch.zeros(3, 4, dtype=torch.int32), torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
     "draft_tokens must be int64"),
    ((torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 5, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
     r"target_tokens must have shape \(3, 4\)"),
    ((torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64), torch.zeros(2, dtype=torch.int64)),
     r"seq_lens must have shape \(3,\)"),
    ((torch.zeros(12, dtype=torch.int64), torch.zeros(12, dtype=torch.int64), torch.zeros(3, dtype=torch.int64)),
     r"draft_tokens must be a 2-D int64 tensor \[batch, block_size\]"),
])
def test_accept_tokens_validation(args, match):
    with pytest.raises(ValueError, match=match):
        accept_tokens(*args)


def test_accept_tokens_validation_out_buffers():
    inputs = (torch.zeros(3, 4, dtype=torch.int64), torch.zeros(3, 4, dtype=torch.int64),
              torch.zeros(3, dtype=torch.int64))
    bad = (torch.zeros(3, dtype=torch.int64), torch.zeros(3, dtype=torch.int64), torch.zeros(3, 3, dtype=torch.int64),
           torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match=r"out committed must have shape \(3, 4\)"):
        accept_tokens(*inputs, out=bad)


if __name__ == "__main__":
    _worker(sys.argv[1])
