"""The paged verify attention's layout (`DFlashBlockInput.generate_attn_arg_prefill`) against SGLang's own DFLASH
verify input on the installed SGLang, and the KV-location plan of the step's hand-built batches.

The layouts are compared as the installed FlashInfer backend asks for them: on SGLang 0.5.23 (keyword-only, with
the runner's ``KVIndexTranslator`` and the batch's ``kv_loc_plan``, bound as `step.HostPlan` binds it) and on 0.5.17
(positional, with ``req_to_token``). Cases: batch sizes 1, 3, 5; blocks 4 and 16; committed lengths including 0;
the full-attention wrapper's whole prefix, and the sliding-window wrapper's last ``WINDOW`` tokens (``kv_start_idx``).
The gathers are SGLang's Triton kernels, run in ONE subprocess under ``TRITON_INTERPRET=1`` (read when a kernel is
decorated, so before SGLang is imported).
"""

import inspect
import sys
from types import SimpleNamespace

import pytest
import torch

from conftest import interpreted_results
from sglang_dflash.adapter import compat

CTX = 61  # req_to_token row width
WINDOW = 6  # the sliding-window wrapper's window in the "window" layout
POISON = -7
CASES = [(bs, block, layout) for bs in (1, 3, 5) for block in (4, 16) for layout in ("prefix", "window")]
TRANSLATED = [(1, 16, "prefix"), (5, 4, "window"), (5, 16, "prefix")]
keyword_plan_only = pytest.mark.skipif(not compat.VERIFY_ARGS_KEYWORD_PLAN,
                                       reason="SGLang without the KV-location plan (before 0.5.23)")


def _inputs(bs: int, block: int, layout: str, seed: int) -> dict:
    """Distinct random slot ids in ``req_to_token`` ``[bs + 3, CTX]``, ``bs`` random rows, committed lengths with a 0
    (request 0), and what the backend asks for: the whole prefix ("prefix") or its last WINDOW tokens ("window":
    ``kv_start_idx`` = committed - those)."""
    g = torch.Generator().manual_seed(seed)
    pool = bs + 3
    req_to_token = torch.randperm(pool * CTX, generator=g).to(torch.int32).view(pool, CTX)
    rows = torch.randperm(pool, generator=g)[:bs]
    seq_lens = torch.randint(0, CTX - block + 1, (bs,), generator=g)
    seq_lens[0] = 0
    if layout == "prefix":
        paged, start = seq_lens, None
    else:
        paged = torch.clamp(seq_lens, max=WINDOW)
        start = seq_lens - paged
    first = torch.zeros(bs, dtype=torch.int64) if start is None else start
    want = torch.cat([req_to_token[r, s : s + p + block] for r, s, p in zip(rows.tolist(), first.tolist(),
                                                                            paged.tolist())])
    return dict(req_to_token=req_to_token, rows=rows, seq_lens=seq_lens, paged=paged, start=start, want=want,
                want_indptr=torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(paged + block, 0)]))


def _translator(req_to_token: torch.Tensor):
    """The runner's KVIndexTranslator over the pools a pure-attention target gets (`ModelRunner`'s
    ``init_kv_index_translator``): an MHA pool and its token allocator."""
    from sglang.srt.mem_cache.allocator.token import TokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    size = req_to_token.numel()
    pool = MHATokenToKVPool(size, page_size=1, dtype=torch.float32, head_num=1, head_dim=4, layer_num=1,
                            device="cpu", enable_memory_saver=False)
    allocator = TokenToKVPoolAllocator(size, torch.float32, "cpu", pool, need_sort=False)
    return KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=allocator, token_to_kv_pool=pool,
                             page_size=1, device="cpu")


def _block_batch(x: dict, block: int):
    """The target's verify ForwardBatch of the step (`step.block_forward_batch`, FlashInfer/Triton lengths) over the
    block's slots ``req_to_token[row, seq_len : seq_len + block]``."""
    from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode

    from sglang_dflash.adapter.step import block_forward_batch

    bs = x["rows"].shape[0]
    cols = x["seq_lens"][:, None] + torch.arange(block)
    loc = x["req_to_token"][x["rows"][:, None], cols].reshape(-1).to(torch.int64)
    b = SimpleNamespace(bs=bs, req_pool_indices=x["rows"], seq_lens=x["seq_lens"])
    ids = torch.zeros(bs * block, dtype=torch.int64)
    return block_forward_batch(SimpleNamespace(paged_verify=True), b, ids, cols.reshape(-1), loc, block,
                               x["seq_lens"].clone(), CaptureHiddenMode.FULL)


def _backend_call(spec, x: dict, translator=None, plan=None, **extra):
    """``spec.generate_attn_arg_prefill`` called as the installed FlashInfer backend calls a DFLASH verify input."""
    lens_sum = int(x["paged"].sum())
    if compat.VERIFY_ARGS_KEYWORD_PLAN:
        return spec.generate_attn_arg_prefill(req_pool_indices=x["rows"], paged_kernel_lens=x["paged"],
                                              paged_kernel_lens_sum=lens_sum, translator=translator, plan=plan,
                                              kind=compat.IdSpaceKind.FULL, kv_start_idx=x["start"], **extra)
    return spec.generate_attn_arg_prefill(x["rows"], x["paged"], lens_sum, x["req_to_token"],
                                          kv_start_idx=x["start"])


def _both(bs: int, block: int, x: dict, translator=None, plan=None, **extra) -> dict:
    """Ours and SGLang's built-in layout of ``x``."""
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from sglang_dflash.adapter.spec_inputs import DFlashBlockInput

    out = {}
    for name, cls in (("ours", DFlashBlockInput), ("sglang", DFlashVerifyInput)):
        spec = cls(draft_token=torch.zeros(bs * block, dtype=torch.int64), positions=None, draft_token_num=block)
        buf = {k: v.clone() for k, v in extra.items()}
        out[name] = _backend_call(spec, x, translator, plan, **buf)
        out[name + "_buf"] = buf
    return out


def _worker(out_path: str) -> None:
    """Under TRITON_INTERPRET=1: both layouts of every case (and, with a KV-location plan, into a given buffer and
    through a translating id space), saved for the tests."""
    results = {}
    for i, (bs, block, layout) in enumerate(CASES):
        x = _inputs(bs, block, layout, seed=i)
        translator = plan = None
        if compat.VERIFY_ARGS_KEYWORD_PLAN:
            translator = _translator(x["req_to_token"])
            fb = _block_batch(x, block)
            compat.bind_kv_plan(translator, fb)
            plan = fb.kv_loc_plan
            buf = torch.full((int(x["paged"].sum()) + bs * block + 5,), POISON, dtype=torch.int32)
            results[("buf", bs, block, layout)] = _both(bs, block, x, translator, plan, kv_indices_buf=buf)
        results[(bs, block, layout)] = _both(bs, block, x, translator, plan)
        if compat.VERIFY_ARGS_KEYWORD_PLAN and (bs, block, layout) in TRANSLATED:
            # a pool whose reads go through a page table (SGLang's unified pool; ours refuses that flag, the
            # translator reads through it all the same): install a virtual->physical table on the FULL space
            from sglang.srt.mem_cache.kv_loc_plan import IdSpace

            v2p = torch.randperm(x["req_to_token"].numel(), generator=torch.Generator().manual_seed(99 + i))
            v2p = v2p.to(torch.int32)
            translator._spaces[compat.IdSpaceKind.FULL] = IdSpace(
                key=(compat.IdSpaceKind.FULL, "test"), write=lambda ids: v2p[ids].to(ids.dtype), read_v2p=v2p)
            translator._rows = torch.arange(x["req_to_token"].shape[0])
            fb = _block_batch(x, block)
            compat.bind_kv_plan(translator, fb)
            results[("translated", bs, block, layout)] = dict(_both(bs, block, x, translator, fb.kv_loc_plan),
                                                              v2p=v2p)
    torch.save(results, out_path)


@pytest.fixture(scope="module")
def layouts(tmp_path_factory):
    return interpreted_results(__file__, tmp_path_factory.mktemp("verify_args") / "results.pt")


def _check(got, x: dict, bs: int, block: int, want_indices: torch.Tensor) -> None:
    kv_indices, kv_indptr, qo_indptr, mask = got
    assert kv_indices.dtype == kv_indptr.dtype == qo_indptr.dtype == torch.int32 and mask is None
    assert kv_indptr.tolist() == x["want_indptr"].tolist()
    assert qo_indptr.tolist() == list(range(0, (bs + 1) * block, block))
    assert torch.equal(kv_indices[: want_indices.numel()], want_indices.to(torch.int32))


@pytest.mark.parametrize("bs, block, layout", CASES)
def test_verify_layout_matches_sglang_builtin(layouts, bs, block, layout):
    """Ours equals SGLang's own DFLASH verify layout, and both are the expected gather: request i reads its
    committed prefix (or the window's part of it) then the block, packed in batch order."""
    x = _inputs(bs, block, layout, seed=CASES.index((bs, block, layout)))
    r = layouts[(bs, block, layout)]
    for got, ref in zip(r["ours"], r["sglang"]):
        assert (got is None and ref is None) or torch.equal(got, ref)
    _check(r["ours"], x, bs, block, x["want"])
    _check(r["sglang"], x, bs, block, x["want"])


@keyword_plan_only
@pytest.mark.parametrize("bs, block, layout", CASES)
def test_verify_layout_into_the_given_buffer(layouts, bs, block, layout):
    """With ``kv_indices_buf`` (SGLang's sync-free plan path) the layout is written there, as SGLang's own does,
    the rest of the buffer left alone."""
    x = _inputs(bs, block, layout, seed=CASES.index((bs, block, layout)))
    r = layouts[("buf", bs, block, layout)]
    n = x["want"].numel()
    for name in ("ours", "sglang"):
        buf = r[name + "_buf"]["kv_indices_buf"]
        assert r[name][0].data_ptr() == buf.data_ptr() and (buf[n:] == POISON).all()
        _check(r[name], x, bs, block, x["want"])


@keyword_plan_only
@pytest.mark.parametrize("bs, block, layout", TRANSLATED)
def test_verify_layout_reads_through_the_translator(layouts, bs, block, layout):
    """Where the pool's read ids differ from ``req_to_token``'s (a virtual->physical page table on the full id
    space), the layout holds the translated ids, as SGLang's own: it is read through the translator and plan."""
    x = _inputs(bs, block, layout, seed=CASES.index((bs, block, layout)))
    r = layouts[("translated", bs, block, layout)]
    translated = r["v2p"][x["want"].long()]
    assert not torch.equal(translated, x["want"])
    _check(r["ours"], x, bs, block, translated)
    _check(r["sglang"], x, bs, block, translated)


def test_verify_layout_takes_the_installed_sglang_arguments():
    """Our layout method takes the parameters (names, order, kinds) of SGLang's own on the installed release."""
    from sglang.srt.speculative.dflash_info import DFlashVerifyInput

    from sglang_dflash.adapter.spec_inputs import DFlashBlockInput

    def params(fn):
        return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]

    assert params(DFlashBlockInput.generate_attn_arg_prefill) == params(DFlashVerifyInput.generate_attn_arg_prefill)


def test_step_batches_get_their_kv_plan_before_attention_is_planned():
    """`step.HostPlan` binds each hand-built batch to a KV-location plan of its own (0.5.23: SGLang's backends read
    their reads and writes from it) before the backend plans it; the write window stays the step's own slot
    buffer. Before 0.5.23 nothing is bound."""
    from sglang_dflash.adapter.step import HostPlan

    x = _inputs(3, 4, "prefix", seed=0)
    draft_fb, target_fb = _block_batch(x, 4), _block_batch(x, 4)
    slots = target_fb.out_cache_loc
    seen = []

    class Backend:
        def init_forward_metadata(self, fb):
            seen.append(getattr(fb, "kv_loc_plan", None))

    translator = _translator(x["req_to_token"]) if compat.VERIFY_ARGS_KEYWORD_PLAN else None
    m = SimpleNamespace(draft_backend=Backend(), target_backend=Backend(), draft_kv_translator=translator,
                        target_kv_translator=translator)
    HostPlan()(m, SimpleNamespace(draft_fb=draft_fb, target_fb=target_fb))
    assert len(seen) == 2 and target_fb.out_cache_loc is slots
    if not compat.VERIFY_ARGS_KEYWORD_PLAN:
        assert seen == [None, None]
        return
    assert seen == [draft_fb.kv_loc_plan, target_fb.kv_loc_plan] and seen[0] is not seen[1]
    plan = target_fb.kv_loc_plan
    assert plan.req_pool_indices is x["rows"] and plan.seq_lens is x["seq_lens"] and plan.read_extent == 4
    assert target_fb.out_cache_loc_is_physical


@keyword_plan_only
def test_bound_step_batch_writes_the_sliding_window_slots():
    """A sliding-window target's pool (Gemma 4: `SWAKVPool`) writes its sliding layers at slots of its own, which
    SGLang 0.5.23's FlashInfer/Triton backends take from the batch's plan (``swa_out_cache_loc``; none without a
    plan, and the pool then refuses the write): the bound step batch has them."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.kv_index_translator import KVIndexTranslator
    from sglang.srt.mem_cache.swa_memory_pool import SWAKVPool

    pool = SWAKVPool(size=64, size_swa=32, page_size=1, dtype=torch.float32, head_num=1, head_dim=4,
                     swa_attention_layer_ids=[0], full_attention_layer_ids=[1], device="cpu")
    allocator = SWATokenToKVPoolAllocator(64, 32, 1, torch.float32, "cpu", pool, need_sort=False)
    slots = allocator.alloc(12)
    req_to_token = torch.zeros(4, 20, dtype=torch.int32)
    req_to_token[[1, 3], 5:11] = slots.view(2, 6).to(torch.int32)
    translator = KVIndexTranslator(req_to_token=req_to_token, token_to_kv_pool_allocator=allocator,
                                   token_to_kv_pool=pool, page_size=1, device="cpu")
    x = dict(req_to_token=req_to_token, rows=torch.tensor([3, 1]), seq_lens=torch.tensor([5, 7]))
    fb = _block_batch(x, 4)
    assert translator.write_ids(fb, compat.IdSpaceKind.SLIDING_WINDOW) is None  # unbound: no sliding-window slots
    compat.bind_kv_plan(translator, fb)
    want = pool.translate_loc_from_full_to_swa(fb.out_cache_loc)
    assert torch.equal(translator.write_ids(fb, compat.IdSpaceKind.SLIDING_WINDOW), want)
    assert torch.equal(fb.out_cache_loc, req_to_token[[[3], [1]], [[5, 6, 7, 8], [7, 8, 9, 10]]].reshape(-1).long())


@keyword_plan_only
def test_step_graphs_leave_sglang_with_a_kv_plan_to_the_host_plan(caplog):
    """The step graphs write FlashInfer's layout on the device from ``req_to_token``; on an SGLang with the
    KV-location plan the decode step runs eagerly with the host plan (`step.HostPlan`) instead, logged."""
    from sglang_dflash.adapter import step_graphs

    runner = SimpleNamespace(decode_cuda_graph_runner=object(),
                             attn_backend=SimpleNamespace(num_wrappers=1, prefill_backend="fa2"))
    with caplog.at_level("INFO", logger=step_graphs.logger.name):
        assert step_graphs.capture(None, (runner, runner), "flashinfer", False, [4], "cuda:0") is None
    assert "KV-location plan" in caplog.text


if __name__ == "__main__":
    _worker(sys.argv[1])
