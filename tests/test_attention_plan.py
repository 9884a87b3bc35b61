"""The device-side split-kv plans (`kernels.attention_plan`), of FlashInfer's prefill wrapper and of its decode
wrapper: the Triton kernel vs the refs on CPU (``TRITON_INTERPRET=1``, one subprocess), the refs on hand-built cases
and, on a GPU, against FlashInfer's own host plan (the int workspace it writes) and as the plan of a captured attention
graph replayed at new kv lengths.
"""

import os
import random
import sys

import pytest
import torch

from conftest import interpreted_results
from sglang_dflash.kernels.attention_plan import decode_plan, decode_plan_ref, split_kv_plan, split_kv_plan_ref

KEYS = ("request_indices", "qo_tile_indices", "kv_tile_indices", "o_indptr", "merge_indptr", "kv_chunk_size",
        "block_valid_mask")


def _cases():
    rng = random.Random(0)
    for case in range(48):
        bs = rng.choice([1, 2, 3, 5, 7, 16, 33, 64, 100])
        block = rng.choice([1, 2, 7, 16])
        tiles_q = rng.choice([1, 1, 2])
        budget = rng.choice([88, 264, 44, 5])
        padded = max(budget, tiles_q * bs) + rng.choice([0, 3])
        lens = [rng.choice([0, 1, 5, 100, 112, 113, 127, 128, 1000, 5000, rng.randint(0, 40_000)]) for _ in range(bs)]
        yield case, bs, block, tiles_q, budget, padded, lens


def _decode_cases():
    rng = random.Random(1)
    for case in range(40):
        bs = rng.choice([1, 2, 3, 5, 7, 16, 33, 64, 100])
        kv_heads = rng.choice([1, 3, 8])
        max_grid = rng.choice([1056, 264, 50, 7, 3 * bs])
        lens = [rng.choice([0, 1, 5, 126, 127, 128, 1000, 5000, rng.randint(0, 40_000)]) for _ in range(bs)]
        yield case, bs, kv_heads, max_grid, bs * kv_heads < max_grid, lens


def _decode_padded(bs, kv_heads, max_grid, split):
    return max_grid // kv_heads if split else bs


def _out(bs, block, padded):
    """Poisoned output buffers (a value the kernel forgets to write shows)."""
    n = dict(request_indices=padded, qo_tile_indices=padded, kv_tile_indices=padded, o_indptr=bs + 1,
             merge_indptr=bs * block + 1, kv_chunk_size=1)
    out = {k: torch.full((v,), -7, dtype=torch.int32) for k, v in n.items()}
    out["block_valid_mask"] = torch.full((padded,), 9, dtype=torch.uint8)
    return out


def _worker(out_path):
    from triton.runtime.interpreter import InterpretedFunction

    from sglang_dflash.kernels import attention_plan as ap

    assert os.environ.get("TRITON_INTERPRET") == "1" and isinstance(ap._split_kv_plan_kernel, InterpretedFunction)
    ap.split_kv_plan_ref = None  # the launcher must not fall back to it
    results = {}
    for case, bs, block, tiles_q, budget, padded, lens in _cases():
        out = _out(bs, block, padded)
        scratch = torch.full((3 * 128,), -5, dtype=torch.int32)
        ap.split_kv_plan(torch.tensor(lens), block, tiles_q, budget, padded, 128, out, scratch)
        results[case] = out
    for case, bs, kv_heads, max_grid, split, lens in _decode_cases():
        out = _out(bs, 1, _decode_padded(bs, kv_heads, max_grid, split))
        scratch = torch.full((3 * 128,), -5, dtype=torch.int32)
        ap.decode_plan(torch.tensor(lens), _decode_padded(bs, kv_heads, max_grid, split), split, 128, out, scratch)
        results["decode", case] = out
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def triton_results(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory.mktemp("triton") / "plan.pt")


@pytest.mark.parametrize("case, bs, block, tiles_q, budget, padded, lens", list(_cases()))
def test_kernel_matches_ref(triton_results, case, bs, block, tiles_q, budget, padded, lens):
    want = split_kv_plan_ref(torch.tensor(lens), block, tiles_q, budget, padded, 128)
    got = triton_results[case]
    for key in KEYS:
        assert torch.equal(got[key], want[key]), f"{key}: {got[key].tolist()} != {want[key].tolist()}"


DECODE_KEYS = ("request_indices", "kv_tile_indices", "o_indptr", "kv_chunk_size", "block_valid_mask")


@pytest.mark.parametrize("case, bs, kv_heads, max_grid, split, lens", list(_decode_cases()))
def test_decode_kernel_matches_ref(triton_results, case, bs, kv_heads, max_grid, split, lens):
    want = decode_plan_ref(torch.tensor(lens), max_grid, kv_heads, split, 128)
    got = triton_results["decode", case]
    for key in DECODE_KEYS if split else DECODE_KEYS[:3]:  # without split the chunk and the mask are not read
        assert torch.equal(got[key], want[key]), f"{key}: {got[key].tolist()} != {want[key].tolist()}"


def test_decode_ref_hand_built():
    """kv lengths 301, 2, 130; 12 CTAs over 3 kv heads (a grid of 4 items): chunks of 128 would make 3 + 1 + 2 items,
    150 still 3 + 1 + 1, 151 is the smallest with 2 + 1 + 1. Without split (2 requests x 8 heads fill a grid of 16):
    one item per request."""
    got = decode_plan_ref(torch.tensor([300, 1, 129]), 12, 3, True, 128)
    assert got["kv_chunk_size"].tolist() == [151]
    assert got["request_indices"].tolist() == [0, 0, 1, 2]
    assert got["kv_tile_indices"].tolist() == [0, 1, 0, 0]
    assert got["o_indptr"].tolist() == [0, 2, 3, 4]
    assert got["block_valid_mask"].tolist() == [1, 1, 1, 1]
    got = decode_plan_ref(torch.tensor([300, 1]), 16, 8, False, 128)
    assert got["request_indices"].tolist() == [0, 1] and got["kv_tile_indices"].tolist() == [0, 0]
    assert got["o_indptr"].tolist() == [0, 1, 2]


def test_ref_hand_built():
    """kv lengths 304, 5, 133 (block 4); budget 5 items: chunks of 128 would make 3 + 1 + 2 items, 133 is the
    smallest chunk with 3 + 1 + 1."""
    got = split_kv_plan_ref(torch.tensor([300, 1, 129]), 4, 1, 5, 7, 128)
    assert got["kv_chunk_size"].tolist() == [133]
    assert got["request_indices"].tolist() == [0, 0, 0, 1, 2, 0, 0]
    assert got["kv_tile_indices"].tolist() == [0, 1, 2, 0, 0, 0, 0]
    assert got["qo_tile_indices"].tolist() == [0] * 7
    assert got["block_valid_mask"].tolist() == [1, 1, 1, 1, 1, 0, 0]
    assert got["o_indptr"].tolist() == [0, 12, 16, 20]
    assert got["merge_indptr"].tolist() == [0, 3, 6, 9, 12, 13, 14, 15, 16, 17, 18, 19, 20]
    # two q tiles per request: items (request, q tile, kv tile) request-major, q tile before kv tile
    got = split_kv_plan_ref(torch.tensor([200]), 4, 2, 88, 88, 128)
    assert got["kv_chunk_size"].tolist() == [128]
    assert got["request_indices"][:4].tolist() == [0, 0, 0, 0]
    assert got["qo_tile_indices"][:4].tolist() == [0, 0, 1, 1]
    assert got["kv_tile_indices"][:4].tolist() == [0, 1, 0, 1]


def test_launcher_validation():
    out, scratch = _out(2, 4, 8), torch.zeros(6, dtype=torch.int32)
    with pytest.raises(ValueError, match="seq_lens must be a 1-D int64"):
        split_kv_plan(torch.tensor([1, 2], dtype=torch.int32), 4, 1, 8, 8, 128, out, scratch)
    with pytest.raises(ValueError, match="exceed the captured grid of 3"):
        split_kv_plan(torch.tensor([1, 2]), 4, 2, 8, 3, 128, out, scratch)
    with pytest.raises(ValueError, match=r"out\['merge_indptr'\] must be a torch.int32 tensor of shape \(9,\)"):
        split_kv_plan(torch.tensor([1, 2]), 4, 1, 8, 8, 128, {**out, "merge_indptr": torch.zeros(8, dtype=torch.int32)},
                      scratch)
    with pytest.raises(ValueError, match="scratch must be int32 with at least 6 entries"):
        split_kv_plan(torch.tensor([1, 2]), 4, 1, 8, 8, 128, out, torch.zeros(5, dtype=torch.int32))


# ---------------------------------------------------------------- on a GPU, against FlashInfer itself

def _flashinfer_wrapper(bs, block, max_tokens):
    import flashinfer

    dev = torch.device("cuda")
    return flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True,
        qo_indptr_buf=torch.arange(0, (bs + 1) * block, block, dtype=torch.int32, device=dev),
        paged_kv_indptr_buf=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buf=torch.zeros(max_tokens, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buf=torch.ones(bs, dtype=torch.int32, device=dev), backend="fa2")


def _host_plan(wrapper, lens, block, heads, kv_heads, head_dim, slots):
    """FlashInfer's own plan (host) of the verify layout for committed lengths ``lens``; returns kv_indptr."""
    dev = torch.device("cuda")
    bs = len(lens)
    kv = torch.tensor(lens, dtype=torch.int32) + block
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    kv_indptr[1:] = kv.cumsum(0)
    wrapper.plan(torch.arange(0, (bs + 1) * block, block, dtype=torch.int32, device=dev), kv_indptr.to(dev),
                 slots[: int(kv_indptr[-1])], torch.ones(bs, dtype=torch.int32, device=dev), heads, kv_heads,
                 head_dim, 1, causal=True, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return kv_indptr


def _workspace_views(wrapper, bs, block):
    info = wrapper._plan_info
    ws = wrapper._int_workspace_buffer

    def i32(off, n):
        return ws[off : off + 4 * n].view(torch.int32)

    padded = info[0]
    return dict(request_indices=i32(info[4], padded), qo_tile_indices=i32(info[5], padded),
                kv_tile_indices=i32(info[6], padded), merge_indptr=i32(info[7], bs * block + 1),
                o_indptr=i32(info[8], bs + 1), kv_chunk_size=i32(info[9], 1),
                block_valid_mask=ws[info[12] : info[12] + padded])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's plan needs a GPU")
@pytest.mark.parametrize("block", [1, 4, 16])  # query rows per request: a verify width, or the draft's block
@pytest.mark.parametrize("bs", [1, 3, 16, 64])
def test_device_plan_equals_flashinfer_host_plan_and_serves_a_captured_graph(bs, block):
    heads, kv_heads, head_dim = 9, 3, 64
    dev = torch.device("cuda")
    max_tokens = bs * (6000 + block)
    slots = torch.randperm(max_tokens + 1000, device=dev)[:max_tokens].to(torch.int32)
    k_cache = torch.randn(max_tokens + 1000, 1, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(bs * block, heads, head_dim, dtype=torch.bfloat16, device=dev)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    budget = 2 * sms // kv_heads

    graph_wrapper = _flashinfer_wrapper(bs, block, max_tokens)
    _host_plan(graph_wrapper, [1] * bs, block, heads, kv_heads, head_dim, slots)  # the capture-time plan
    info = list(graph_wrapper._plan_info)
    assert info[13] == 1 and info[14] == 1  # CUDA-graph mode, split kv
    tiles_q = -(-block * (heads // kv_heads) // info[3])
    views = _workspace_views(graph_wrapper, bs, block)
    seq_lens = torch.ones(bs, dtype=torch.int64, device=dev)
    scratch = torch.zeros(3 * 128, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    def body():
        split_kv_plan(seq_lens, block, tiles_q, budget, info[0], 128, views, scratch)
        graph_wrapper.run(q, (k_cache, v_cache), out=out)

    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()

    host_wrapper = _flashinfer_wrapper(bs, block, max_tokens)
    rng = random.Random(bs)
    for trial in range(6):
        lens = [rng.choice([0, 3, 127, 300, 1000, 5999, rng.randint(0, 5999)]) for _ in range(bs)]
        kv_indptr = _host_plan(host_wrapper, lens, block, heads, kv_heads, head_dim, slots)
        torch.cuda.synchronize()
        want = _workspace_views(host_wrapper, bs, block)
        assert list(host_wrapper._plan_info)[:4] == info[:4]  # same grid, rows and q tile as the capture
        new_items = int(want["block_valid_mask"].sum())
        ref = split_kv_plan_ref(torch.tensor(lens), block, tiles_q, budget, info[0], 128)
        _assert_plan(want, ref, KEYS, new_items, f"host plan bs={bs} lens={lens}")  # the ref is FlashInfer's rule
        _replay_at(graph, graph_wrapper, seq_lens, lens, kv_indptr, slots)
        _assert_plan(views, ref, KEYS, new_items, f"device plan bs={bs} lens={lens}")
        expected = host_wrapper.run(q, (k_cache, v_cache))
        assert torch.equal(out, expected), f"bs={bs} lens={lens}: max diff {(out - expected).abs().max()}"


ITEM_KEYS = ("request_indices", "qo_tile_indices", "kv_tile_indices")  # per work item: stale past the last one


def _assert_plan(got, ref, keys, items, what):
    for key in keys:
        n = items if key in ITEM_KEYS else None
        assert torch.equal(got[key].cpu()[:n], ref[key][:n]), f"{what}: {key}"


def _replay_at(graph, wrapper, seq_lens, lens, kv_indptr, slots):
    """Replay a captured plan + attention graph at committed lengths ``lens``, their kv layout written first."""
    seq_lens.copy_(torch.tensor(lens))
    wrapper._paged_kv_indptr_buf.copy_(kv_indptr)
    wrapper._paged_kv_indices_buf[: int(kv_indptr[-1])].copy_(slots[: int(kv_indptr[-1])])
    graph.replay()
    torch.cuda.synchronize()


def _decode_wrapper(bs, max_tokens):
    import flashinfer

    dev = torch.device("cuda")
    return flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(256 << 20, dtype=torch.uint8, device=dev), "NHD", use_cuda_graph=True, use_tensor_cores=False,
        paged_kv_indptr_buffer=torch.zeros(bs + 1, dtype=torch.int32, device=dev),
        paged_kv_indices_buffer=torch.zeros(max_tokens, dtype=torch.int32, device=dev),
        paged_kv_last_page_len_buffer=torch.ones(bs, dtype=torch.int32, device=dev))


def _decode_host_plan(wrapper, lens, heads, kv_heads, head_dim, slots):
    """FlashInfer's own decode plan (host) for committed lengths ``lens`` (kv length + 1); returns kv_indptr."""
    dev = torch.device("cuda")
    kv_indptr = torch.zeros(len(lens) + 1, dtype=torch.int32)
    kv_indptr[1:] = (torch.tensor(lens, dtype=torch.int32) + 1).cumsum(0)
    wrapper.plan(kv_indptr.to(dev), slots[: int(kv_indptr[-1])], torch.ones(len(lens), dtype=torch.int32, device=dev),
                 heads, kv_heads, head_dim, 1, q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    return kv_indptr


def _decode_workspace_views(wrapper, bs):
    info = [int(x) for x in wrapper._plan_info]
    ws = wrapper._int_workspace_buffer

    def i32(off, n):
        return ws[off : off + 4 * n].view(torch.int32)

    padded = info[0]
    views = dict(request_indices=i32(info[3], padded), kv_tile_indices=i32(info[4], padded),
                 o_indptr=i32(info[5], bs + 1), kv_chunk_size=i32(info[7], 1))
    if info[9]:
        views["block_valid_mask"] = ws[info[6] : info[6] + padded]
    return views


@pytest.mark.skipif(not torch.cuda.is_available(), reason="FlashInfer's plan needs a GPU")
@pytest.mark.parametrize("bs", [1, 3, 16, 64, 256])
def test_device_decode_plan_equals_flashinfer_host_plan_and_serves_a_captured_graph(bs):
    heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2's heads: a GQA group of 3, SGLang's CUDA-core decode
    dev = torch.device("cuda")
    max_tokens = bs * 6001
    slots = torch.randperm(max_tokens + 1000, device=dev)[:max_tokens].to(torch.int32)
    k_cache = torch.randn(max_tokens + 1000, 1, kv_heads, head_dim, dtype=torch.bfloat16, device=dev)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(bs, heads, head_dim, dtype=torch.bfloat16, device=dev)

    graph_wrapper = _decode_wrapper(bs, max_tokens)
    _decode_host_plan(graph_wrapper, [1] * bs, heads, kv_heads, head_dim, slots)  # the capture-time plan
    info = [int(x) for x in graph_wrapper._plan_info]
    assert info[8] == 1  # CUDA-graph mode
    padded, split = info[0], bool(info[9])
    views = _decode_workspace_views(graph_wrapper, bs)
    out_views = dict(views, qo_tile_indices=torch.zeros(padded, dtype=torch.int32, device=dev),
                     merge_indptr=torch.zeros(bs + 1, dtype=torch.int32, device=dev))
    if not split:
        out_views["block_valid_mask"] = torch.zeros(padded, dtype=torch.uint8, device=dev)
    seq_lens = torch.ones(bs, dtype=torch.int64, device=dev)
    scratch = torch.zeros(3 * 256, dtype=torch.int32, device=dev)
    out = torch.empty_like(q)

    def body():
        decode_plan(seq_lens, padded, split, 128, out_views, scratch)
        graph_wrapper.run(q, (k_cache, v_cache), out=out)

    body()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()

    host_wrapper = _decode_wrapper(bs, max_tokens)
    keys = DECODE_KEYS if split else DECODE_KEYS[:3]
    rng = random.Random(bs)
    for trial in range(6):
        lens = [rng.choice([0, 3, 127, 300, 1000, 5999, rng.randint(0, 5999)]) for _ in range(bs)]
        kv_indptr = _decode_host_plan(host_wrapper, lens, heads, kv_heads, head_dim, slots)
        torch.cuda.synchronize()
        want = _decode_workspace_views(host_wrapper, bs)
        assert [int(x) for x in host_wrapper._plan_info][0] == padded  # same grid as the capture
        ref = decode_plan_ref(torch.tensor(lens), padded * kv_heads, kv_heads, split, 128)
        items = int(ref["o_indptr"][-1])
        _assert_plan(want, ref, keys, items, f"host plan bs={bs} lens={lens}")  # the ref is FlashInfer's rule
        _replay_at(graph, graph_wrapper, seq_lens, lens, kv_indptr, slots)
        _assert_plan(views, ref, keys, items, f"device plan bs={bs} lens={lens}")
        expected = host_wrapper.run(q, (k_cache, v_cache))
        assert torch.equal(out, expected), f"bs={bs} lens={lens}: max diff {(out - expected).abs().max()}"


if __name__ == "__main__":
    _worker(sys.argv[1])
