"""One CUDA graph per batch size for the whole decode step on FlashInfer.

Replayed through SGLang's runners, a step is three graph replays (draft, verify, commit_kv) plus
~20 eager launches, and each replay first rebuilds a ForwardBatch, copies it into the runner's static
buffers and plans attention: the host, not the GPU, sets the step time on small targets. Here the
phases

    build_block -> draft (+ lm_head, argmax) -> verify -> commit_kv -> greedy accept

are captured together, per batch size, into one graph on static buffers; the graph also writes both
forwards' FlashInfer paged layout (qo/kv indptr, kv indices) and their split-kv plans
(`kernels.attention_plan`: FlashInfer's host planning rule, run on the device) from the committed
lengths on the device. A replay copies three per-request inputs (bonus tokens, committed lengths,
request-pool rows) and launches the graph: no host plan and no host copy of the lengths, so under
SGLang's overlap schedule step N+1 is enqueued while step N still runs (the scheduler's host mirror
of the committed lengths is switched off, `DFlashWorker.spec_v2_attn_backends`). Needs FlashInfer's
fa2 prefill backend.

The greedy accept result is used when the batch needs nothing else; otherwise the worker accepts
eagerly on the verify logits (sampling, penalties, grammars, custom processors, logprobs).

Padding: a batch of n requests replays the graph of the next captured size m >= n; rows n.. get
committed length 1 and request-pool row 0, and every KV write of those rows (draft block, target
block, draft context) goes to SGLang's padding slot 0.

Each captured size owns its own attention wrappers (created through the backends' capture path and then
taken out of ``prefill_cuda_graph_metadata``, which belongs to SGLang's per-runner graphs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
from triton import next_power_of_2 as triton_next_power_of_2

from sglang.srt.layers.dp_attention import set_dp_buffer_len, set_is_extend_in_batch
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.model_executor.forward_context import ForwardContext, forward_context
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

from sglang_dflash.adapter.commit_graphs import PADDING_SLOT, padded_rows
from sglang_dflash.adapter.spec_inputs import DFlashBlockInput, write_block_kv_layout
from sglang_dflash.kernels.attention_plan import split_kv_plan
from sglang_dflash.kernels.block_builder import build_block

SEQ_LEN_FILL = 1  # committed length of padded rows (FlashInfer needs kv_len >= 1 per row)


@dataclass
class StepOutputs:
    """Views of one replay's static outputs, ``bs`` real rows (n = bs * block_size)."""

    draft_tokens: torch.Tensor  # [bs, B]
    logits: torch.Tensor  # [n, V]
    accept_lens: torch.Tensor  # [bs]  greedy
    bonus_tokens: torch.Tensor  # [bs]
    committed: torch.Tensor  # [bs, B]
    new_seq_lens: torch.Tensor  # [bs]


class _Captured:
    """One batch size: its graph, its wrappers (planned inside it, `DevicePlan`), its outputs, the two ForwardBatches of
    the capture, which hold the static block tensors the graph reads and writes, and ``packed``, the one int64
    buffer the greedy accept writes (`unpack`; a replay copies it out in one launch)."""

    def __init__(self, bs, graph, draft_fb, target_fb, draft_wrappers, target_wrappers, outputs, packed=None):
        self.bs, self.graph = bs, graph
        self.draft_fb, self.target_fb = draft_fb, target_fb
        self.draft_wrappers, self.target_wrappers = draft_wrappers, target_wrappers
        self.outputs, self.packed = outputs, packed


class DevicePlan:
    """Where the split-kv plan of one capture-mode FlashInfer prefill wrapper lives in its int workspace, and the
    fixed quantities of its captured grid (from the capture-time plan); `write` runs `split_kv_plan` into it."""

    MIN_KV_CHUNK = 128  # FlashInfer's min_kv_chunk_size for page size 1

    def __init__(self, wrapper, bs: int, block_size: int, num_qo_heads: int, num_kv_heads: int, scratch: torch.Tensor):
        info = list(wrapper._plan_info)
        if len(info) != 15 or not info[13] or not info[14]:
            raise RuntimeError(f"sglang-dflash: unexpected FlashInfer prefill plan {info} (expected a CUDA-graph plan "
                               "with split kv, FlashInfer 0.6.15's layout); the step graph cannot plan on the device")
        padded, _, _, cta_tile_q, req_off, qtile_off, kvtile_off, merge_off, o_off, chunk_off = info[:10]
        valid_off = info[12]
        ws = wrapper._int_workspace_buffer

        def i32(offset: int, n: int) -> torch.Tensor:
            return ws[offset : offset + 4 * n].view(torch.int32)

        self.bs, self.block_size, self.padded, self.scratch = bs, block_size, int(padded), scratch
        self.tiles_q = -(-block_size * (num_qo_heads // num_kv_heads) // int(cta_tile_q))
        sms = torch.cuda.get_device_properties(ws.device).multi_processor_count
        self.max_batch_size_if_split = 2 * sms // num_kv_heads  # FlashInfer's PrefillPlan budget
        self.out = dict(request_indices=i32(req_off, self.padded), qo_tile_indices=i32(qtile_off, self.padded),
                        kv_tile_indices=i32(kvtile_off, self.padded), o_indptr=i32(o_off, bs + 1),
                        merge_indptr=i32(merge_off, bs * block_size + 1), kv_chunk_size=i32(chunk_off, 1),
                        block_valid_mask=ws[valid_off : valid_off + self.padded])

    def write(self, seq_lens: torch.Tensor) -> None:
        """seq_lens ``[bs]`` int64 committed lengths (kv length = seq_lens + block_size) on the device."""
        split_kv_plan(seq_lens, self.block_size, self.tiles_q, self.max_batch_size_if_split, self.padded,
                      self.MIN_KV_CHUNK, self.out, self.scratch)


class StepGraphs:
    """Whole-step CUDA graphs for ``batch_sizes``; ``worker`` is the DFlashWorker (FlashInfer, CUDA)."""

    def __init__(self, worker, batch_sizes: Sequence[int]):
        self.w = worker
        self.B = worker.block_size
        self.sizes = sorted({int(b) for b in batch_sizes})
        max_bs, dev = self.sizes[-1], worker.device
        self.bonus = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.valid = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        # one float logits buffer for every size (SGLang's logits processor copies into it): per-size logits
        # outputs would each stay alive with their graph
        self.logits = torch.zeros((max_bs * self.B, worker.target_runner.model_config.vocab_size),
                                  dtype=torch.float, device=dev)
        self.qo_indptr = torch.arange(0, (max_bs + 1) * self.B, self.B, dtype=torch.int32, device=dev)
        self.plan_scratch = torch.zeros(3 * triton_next_power_of_2(max_bs), dtype=torch.int32, device=dev)
        self.draft_backend = worker.draft_runner.attn_backend
        self.target_backend = worker.target_runner.attn_backend
        self.captured: dict[int, _Captured] = {}
        stream = torch.cuda.Stream(dev)
        pool = None
        for bs in reversed(self.sizes):  # largest first: the smaller graphs reuse its memory pool
            self.captured[bs] = self._capture(bs, stream, pool)
            pool = self.captured[bs].graph.pool()

    # ---- capture -------------------------------------------------------------------------
    def _forward_batch(self, bs: int, input_ids: torch.Tensor, positions: torch.Tensor, loc: torch.Tensor,
                       capture: CaptureHiddenMode) -> ForwardBatch:
        spec_info = DFlashBlockInput(draft_token=input_ids, positions=positions, draft_token_num=self.B,
                                     capture_hidden_mode=capture)
        kv_lens_cpu = torch.full((bs,), SEQ_LEN_FILL + self.B, dtype=torch.int64)  # the capture's: prefix + block
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs], out_cache_loc=loc,
            seq_lens_sum=int(kv_lens_cpu.sum()), seq_lens_cpu=kv_lens_cpu,
            positions=positions, spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=spec_info,
            capture_hidden_mode=capture,
        )

    def _capture(self, bs: int, stream: torch.cuda.Stream, pool) -> _Captured:
        w, B, n = self.w, self.B, bs * self.B
        dev = w.device
        # static block tensors the two ForwardBatches point at (filled inside the graph)
        input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        positions = torch.zeros(n, dtype=torch.int64, device=dev)
        loc = torch.zeros(n, dtype=torch.int64, device=dev)
        verify_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        draft_fb = self._forward_batch(bs, input_ids, positions, loc, CaptureHiddenMode.NULL)
        target_fb = self._forward_batch(bs, verify_ids, positions, loc, CaptureHiddenMode.FULL)
        target_fb.next_token_logits_buffer = self.logits[:n]
        self.valid[:bs].fill_(False)  # capture and warm-up write only to the padding slot

        draft_wrappers = self._prepare_wrappers(self.draft_backend, draft_fb, bs)
        target_wrappers = self._prepare_wrappers(self.target_backend, target_fb, bs)
        plans = [DevicePlan(wr, bs, B, b.indices_updater_prefill.num_qo_heads, b.indices_updater_prefill.num_kv_heads,
                            self.plan_scratch)
                 for b, wrappers in ((self.draft_backend, draft_wrappers), (self.target_backend, target_wrappers))
                 for wr in wrappers]

        req_to_token = w.target_runner.req_to_token_pool.req_to_token
        packed = torch.zeros(bs * (B + 3), dtype=torch.int64, device=dev)

        def body():
            ids, pos, slots = build_block(self.bonus[:bs], self.seq_lens[:bs], B, w.mask_token_id, req_to_token,
                                          self.req_pool_indices[:bs], out=(input_ids, positions, loc),
                                          check_values=False)
            slots.view(bs, B).masked_fill_(~self.valid[:bs, None], PADDING_SLOT)
            for wrapper in (*draft_wrappers, *target_wrappers):  # the attention layout
                wrapper._qo_indptr_buf.copy_(self.qo_indptr[: bs + 1])
                write_block_kv_layout(req_to_token, self.req_pool_indices[:bs], self.seq_lens[:bs], B,
                                      wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf)
            for plan in plans:  # and its split-kv plan
                plan.write(self.seq_lens[:bs])
            set_dp_buffer_len(None, n, False, None)
            set_is_extend_in_batch(False)
            with forward_context(ForwardContext(attn_backend=self.draft_backend)):
                self.draft_backend.init_forward_metadata_in_graph(draft_fb)
                hidden = w.draft_model(ids, pos, draft_fb, input_embeds=w.embed(ids)).hidden_states
            draft_tokens = w.propose(hidden, ids, bs)
            verify_ids.copy_(draft_tokens.view(-1))
            with forward_context(ForwardContext(attn_backend=self.target_backend)):
                self.target_backend.init_forward_metadata_in_graph(target_fb)
                out = w.target_runner.model(verify_ids, pos, target_fb)
            w.commit_kv(out.hidden_states, pos, slots)
            logits = out.next_token_logits
            accept = w.greedy_accept(draft_tokens, logits, self.seq_lens[:bs], out=unpack(packed, bs, B))
            return StepOutputs(draft_tokens, logits, *accept)

        torch.cuda.synchronize(dev)
        graph = torch.cuda.CUDAGraph()
        with torch.no_grad():
            with torch.cuda.stream(stream):
                for _ in range(2):  # warm-up outside capture (JIT, autotuning, workspaces)
                    body()
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()  # the warm-up's blocks, which the capture's private pool cannot use
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = body()
        torch.cuda.synchronize(dev)
        return _Captured(bs, graph, draft_fb, target_fb, draft_wrappers, target_wrappers, outputs, packed)

    def _prepare_wrappers(self, backend, fb: ForwardBatch, bs: int) -> list:
        """Create and plan this size's own capture-mode wrappers (they also become ``backend.forward_metadata``,
        which the capture reads) and put SGLang's wrappers for ``bs`` back."""
        saved = backend.prefill_cuda_graph_metadata.get(bs)
        backend.init_forward_metadata_out_graph(fb, in_capture=True)
        wrappers = backend.prefill_cuda_graph_metadata[bs]
        if saved is None:
            backend.prefill_cuda_graph_metadata.pop(bs)
        else:
            backend.prefill_cuda_graph_metadata[bs] = saved
        return wrappers

    # ---- replay --------------------------------------------------------------------------
    def padded_size(self, n: int) -> int | None:
        """The captured batch size a batch of n requests replays (None: larger than every capture)."""
        return padded_rows(n, self.sizes)

    def replay(self, batch, bonus_tokens: torch.Tensor) -> StepOutputs:
        """One decode step for ``batch`` (n requests, at most the largest captured size); returns the real rows'
        outputs."""
        n = batch.batch_size()
        m = self.padded_size(n)
        c = self.captured[m]
        self.bonus[:n].copy_(bonus_tokens)
        self.seq_lens[:n].copy_(batch.seq_lens)
        self.req_pool_indices[:n].copy_(batch.req_pool_indices)
        self.valid[:n].fill_(True)
        if m > n:
            self.seq_lens[n:m].fill_(SEQ_LEN_FILL)
            self.req_pool_indices[n:m].zero_()
            self.valid[n:m].fill_(False)
        c.graph.replay()
        o = c.outputs
        accept_lens, bonus_tokens, committed, new_seq_lens = unpack(c.packed.clone(), m, self.B)  # one copy
        return StepOutputs(o.draft_tokens[:n], o.logits[: n * self.B], accept_lens[:n], bonus_tokens[:n],
                           committed[:n], new_seq_lens[:n])


def unpack(packed: torch.Tensor, bs: int, block_size: int):
    """Views of a packed accept buffer ``[bs * (block_size + 3)]`` int64 in `accept_tokens`' output order:
    accept_lens, bonus_tokens ``[bs]``, committed ``[bs, block_size]``, new_seq_lens ``[bs]`` (each contiguous)."""
    n = bs * block_size
    return (packed[:bs], packed[bs : 2 * bs], packed[2 * bs : 2 * bs + n].view(bs, block_size),
            packed[2 * bs + n : 3 * bs + n])
