"""The decode step (`step.decode_step`) captured as CUDA graphs per (batch size, verify width), on FlashInfer.

Replayed through SGLang's runners, a step is three graph replays (draft, verify, commit_kv) plus
~20 eager launches, and each replay first rebuilds a ForwardBatch, copies it into the runner's static
buffers and plans attention: the host, not the GPU, sets the step time on small targets. Here the
whole `decode_step` is captured, per batch size and verify width, over a static `step.StepBatch`, as three graphs
replayed back to back (`step.draft_phase`, `step.verify_phase`, `step.accept_phase`), with `GraphPlan` as its
attention planner: inside the first it writes both forwards' FlashInfer paged layout (qo/kv indptr, kv
indices) and their split-kv plans (`DevicePlan`: FlashInfer's host planning rule, run on the device by
`kernels.attention_plan`) from the committed lengths on the device. A replay copies three per-request
inputs (bonus tokens, committed lengths, request-pool rows) and launches the graphs: no host plan and no
host copy of the lengths, so under SGLang's overlap schedule step N+1 is enqueued while step N still runs
(the scheduler's host mirror of the committed lengths is switched off, `DFlashWorker.spec_v2_attn_backends`).
Needs FlashInfer's fa2 prefill backend with one wrapper per model.

Padding: a batch of n requests replays the graph of the next captured size m >= n; rows n.. get
committed length 1 and request-pool row 0, and every KV write of those rows (draft block, target
block, draft context) goes to SGLang's padding slot 0.

Widths: every candidate verify width of the policy (`sglang_dflash.policy`) is captured for every batch size up to
the one a batch at the policy's batch-size ceiling replays, width 1 alone above it (`planned_graphs`), so
a narrower step replays a graph as well (an eager step would read the committed lengths on the host: a sync that
stops the overlap schedule). The draft forward always runs the whole block, so a batch size's draft wrappers serve
all its widths; the target's wrappers are per (size, width), at width 1 FlashInfer's decode wrapper where its
CUDA-core kernel serves the target (`decode_kernel`; its plan written on the device by `DecodeDevicePlan`). The
wrappers of one forward share one 8 MiB FlashInfer int workspace (each replay writes its whole plan there first).

Accept kinds (`sampling.step_accept_kind`): each (size, width) is captured greedy and, where the sampled step's
vocabulary-sized float32 temporaries fit `SAMPLED_ROWS_BYTES` per tensor, also
sampled without and with the top-k / top-p / min-p sort: the drafts are drawn and accepted inside the graph, with
the requests' parameters as four more static inputs and CUDA's graph-safe random numbers. The kinds of one
(size, width) share its wrappers and its verify graph (the target's forward: the bulk of a capture's time), each with
its own draft and accept graphs; the drafts' law passes between them in one buffer (`StepGraphs.law`).

Each captured graph's wrappers are its own (created through the backends' capture path and then taken out of
``prefill_cuda_graph_metadata``, which belongs to SGLang's per-runner graphs). This module sees the step's
`StepModels`, never the worker.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
import time
from typing import NamedTuple, Sequence

import torch
from triton import next_power_of_2 as triton_next_power_of_2

from sglang.srt.distributed.parallel_state import graph_capture

from sglang_dflash.adapter import compat
from sglang_dflash.adapter.hybrid import GraphStates, full_attention_backend
from sglang_dflash.adapter.sampling import FILTERED, GREEDY, SAMPLED, StepSampling
from sglang_dflash.adapter.spec_inputs import write_block_kv_layout
from sglang_dflash.adapter.step import (StepBatch, StepModels, StepResult, accept_phase, draft_phase, padded_rows,
                                        verify_phase)
from sglang_dflash.kernels.attention_plan import decode_plan, split_kv_plan

logger = logging.getLogger(__name__)

SEQ_LEN_FILL = 1  # committed length of padded rows (FlashInfer needs kv_len >= 1 per row)
# A sampled step holds a few [bs * width, V] float32 tensors (probabilities of the draft and the target, the
# residual, the race); its graph is captured where one of them fits this (the graphs share one memory pool).
SAMPLED_ROWS_BYTES = 256 << 20


def accept_kinds(bs: int, width: int, vocab_size: int) -> tuple[str, ...]:
    """The accept kinds captured for ``bs`` requests at ``width``: greedy, and the sampled ones where a
    ``[bs * width, vocab_size]`` float32 tensor fits `SAMPLED_ROWS_BYTES`."""
    return (FILTERED, SAMPLED, GREEDY) if bs * width * vocab_size * 4 <= SAMPLED_ROWS_BYTES else (GREEDY,)


def planned_graphs(sizes: Sequence[int], widths: Sequence[int], vocab_size: int,
                   max_batch_size: int | None = None) -> list[tuple[int, int, str]]:
    """(batch size, width, accept kind) of each graph to capture, in capture order (largest first: the smaller
    graphs reuse its memory pool): every width at the sizes a batch of at most ``max_batch_size`` requests (the
    policy's ceiling; None: none) replays, width 1 only above them (the policy runs plain decode steps there)."""
    sizes, widths = sorted({int(b) for b in sizes}), sorted({int(w) for w in widths})
    if max_batch_size is None:
        top = sizes[-1]
    else:  # the size a batch of max_batch_size requests replays (0: none speculates)
        top = (padded_rows(max_batch_size, sizes) or sizes[-1]) if max_batch_size > 0 else 0
    return [(bs, w, kind) for bs in reversed(sizes) for w in reversed(widths if bs <= top else [1])
            for kind in accept_kinds(bs, w, vocab_size)]


def graph_count(planned) -> int:
    """CUDA graphs of the (batch size, width, accept kind) steps ``planned``: a draft and an accept graph per step, a
    verify graph per (batch size, width)."""
    planned = list(planned)
    return 2 * len(planned) + len({(bs, w) for bs, w, _ in planned})


# GPU memory of one captured graph besides the buffers counted apart, per layer of the target: CUDA's memory for the
# graph's nodes and its share of the graphs' pool. From captures on an H100 (RESULTS, "Step capture at start-up"):
# 0.12 MB per layer (SmolLM2, 30 layers, 1,653 graphs), 0.13 MB (the Qwen3-8B shape, 36 layers, 945); with a margin.
GRAPH_BYTES_PER_TARGET_LAYER = 160 << 10
# FlashInfer's int workspace of a wrapper; one per forward (`StepGraphs`): the draft's, the target's verify and, on the
# decode kernel (`decode_kernel`), the target's width-1 decode
INT_WORKSPACE_BYTES = 8 << 20
INT_WORKSPACES = 3


def law_rows(planned) -> int:
    """Rows of the drafts' law buffer the sampled kinds of ``planned`` share: the most ``bs * (width - 1)``."""
    return max((bs * (w - 1) for bs, w, kind in planned if kind != GREEDY), default=0)


def capture_bytes(sizes: Sequence[int], widths: Sequence[int], block_size: int, vocab_size: int,
                  num_target_layers: int, max_batch_size: int | None = None) -> int:
    """Estimated GPU memory (bytes) `StepGraphs` takes for these captures: each graph's own
    (`GRAPH_BYTES_PER_TARGET_LAYER`), the shared float32 logits ``[max(sizes) * block_size, V]`` and drafts' law,
    and the int workspaces."""
    planned = planned_graphs(sizes, widths, vocab_size, max_batch_size)
    shared = (max(sizes) * block_size + law_rows(planned)) * vocab_size * 4 + INT_WORKSPACES * INT_WORKSPACE_BYTES
    return graph_count(planned) * num_target_layers * GRAPH_BYTES_PER_TARGET_LAYER + shared


def out_of_memory_message(sizes: Sequence[int], widths: Sequence[int], graphs: int, free_gb: float) -> str:
    """What a decode-step capture that ran out of GPU memory tells the user: what it was capturing and the flags
    that capture fewer or smaller graphs, or leave it more memory."""
    narrower = [w for w in widths if w in (1, 4, max(widths))]
    fewer = (f"fewer widths (--speculative-adaptive-config '{{\"widths\": {narrower}}}'), "
             if len(narrower) < len(widths) else "")
    return (f"sglang-dflash: capturing the decode step ({graphs} CUDA graphs: batch sizes up to {max(sizes)} x verify "
            f"widths {list(widths)}) ran out of GPU memory ({free_gb:.1f} GB were free when it began). Capture fewer or "
            f"smaller graphs: --cuda-graph-max-bs {max(1, max(sizes) // 4)}, {fewer}or speculate only up to a batch "
            "size ('{\"max_batch_size\": 32}': width 1 alone above it); or leave the capture more memory with a lower "
            "--mem-fraction-static.")


def capture(m: StepModels, runners: Sequence, backend: str, hybrid: bool, widths: Sequence[int],
            device, max_batch_size: int | None = None) -> StepGraphs | None:
    """`decode_step` captured for the batch sizes both ``runners`` (target, draft) captured x ``widths`` (x the sampled
    accept kinds where they fit), where it can be: CUDA graphs on, FlashInfer's fa2 prefill with one
    wrapper per model (a ``hybrid`` target's full-attention layers included; its linear-attention layers as
    `hybrid.GraphStates`), an SGLang without the KV-location plan (`compat.VERIFY_ARGS_KEYWORD_PLAN`; 0.5.23 pins a
    FlashInfer the device plan was not checked against anyway), a FlashInfer its device plan was checked against. None
    (the step runs eagerly, logged) otherwise."""
    if not str(device).startswith("cuda") or any(r.decode_cuda_graph_runner is None for r in runners):
        return None
    paged = [full_attention_backend(r.attn_backend) for r in runners]
    if backend != "flashinfer" or not all(b.num_wrappers == 1 and b.prefill_backend == "fa2" for b in paged):
        reason = "its CUDA graph needs FlashInfer's fa2 prefill with one wrapper per model"
    elif compat.VERIFY_ARGS_KEYWORD_PLAN:
        reason = "host attention plan: the graph's device-side layout reads req_to_token, not SGLang's KV-location plan"
    else:
        unchecked = compat.unchecked_flashinfer()
        reason = unchecked and f"host attention plan: {unchecked}"
    if reason:
        logger.info("sglang-dflash: the decode step runs eagerly (%s)", reason)
        return None
    sizes = sorted(set.intersection(*(set(r.decode_cuda_graph_runner.capture_bs) for r in runners)))
    vocab_size = runners[0].model_config.vocab_size
    planned = planned_graphs(sizes, widths, vocab_size, max_batch_size)
    logger.info("sglang-dflash: capturing the decode step: batch sizes %s x verify widths %s%s, %d graphs",
                sizes, widths, "" if max_batch_size is None else f" (width 1 above {max_batch_size} requests)",
                graph_count(planned))
    t0, free0 = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
    try:
        graphs = StepGraphs(m, sizes, widths, vocab_size, device, hybrid, max_batch_size)
    except torch.cuda.OutOfMemoryError:  # start-up, not the step: name the fixes instead of a traceback
        raise MemoryError(out_of_memory_message(sizes, widths, graph_count(planned), free0 / 1e9)) from None
    pairs = sorted({(bs, w) for bs, w, kind in graphs.captured if kind == SAMPLED})
    logger.info("sglang-dflash: decode step captured as CUDA graphs for batch sizes %s x verify widths %s (width 1 on "
                "FlashInfer's %s kernel); sampled steps for %d (batch size, width) pairs up to %d rows; %d graphs in "
                "%.1f s (the first, with its kernels' first compilation: %.1f s; eager warm-ups %.1f s, recording "
                "%.1f s), %.2f GB", sizes, widths, "decode" if graphs.decode_kernel else "prefill", len(pairs),
                max((bs * w for bs, w in pairs), default=0), graph_count(graphs.captured),
                time.perf_counter() - t0, graphs.first_s, graphs.warmup_s, graphs.record_s,
                (free0 - torch.cuda.mem_get_info(device)[0]) / 1e9)
    return graphs


def _int32_at(workspace: torch.Tensor, offset: int, n: int) -> torch.Tensor:
    """``n`` int32 entries at byte ``offset`` of a FlashInfer int workspace (uint8), as a view."""
    return workspace[offset : offset + 4 * n].view(torch.int32)


# The order of a wrapper's ``_plan_info``: FlashInfer's PrefillPlanInfo / DecodePlanInfo ``ToVector``
# (include/flashinfer/attention/scheduler.cuh; the same in FlashInfer 0.6.15 and 0.7.2).
PREFILL_PLAN_INFO = ("padded_batch_size", "total_num_rows", "total_num_rows_offset", "cta_tile_q",
                     "request_indices_offset", "qo_tile_indices_offset", "kv_tile_indices_offset",
                     "merge_indptr_offset", "o_indptr_offset", "kv_chunk_size_ptr_offset", "v_offset", "s_offset",
                     "block_valid_mask_offset", "enable_cuda_graph", "split_kv")
DECODE_PLAN_INFO = ("padded_batch_size", "v_offset", "s_offset", "request_indices_offset", "kv_tile_indices_offset",
                    "o_indptr_offset", "block_valid_mask_offset", "kv_chunk_size_ptr_offset", "enable_cuda_graph",
                    "split_kv")


def plan_info(wrapper, fields: tuple[str, ...], needs: tuple[str, ...]) -> dict[str, int]:
    """A capture-mode FlashInfer wrapper's ``_plan_info`` by field name (``fields``: `PREFILL_PLAN_INFO` or
    `DECODE_PLAN_INFO`); every field in ``needs`` must be set (the plan the step graph can rewrite on the device)."""
    values = [int(x) for x in wrapper._plan_info]
    info = dict(zip(fields, values))
    if len(values) != len(fields) or not all(info[f] for f in needs):
        raise RuntimeError(f"sglang-dflash: unexpected FlashInfer plan {values} (expected {len(fields)} fields with "
                           f"{', '.join(needs)} set, FlashInfer 0.6.15-0.7.2's layout); the step graph cannot plan "
                           "on the device")
    return info


class DevicePlan:
    """Where the split-kv plan of one capture-mode FlashInfer prefill wrapper lives in its int workspace, and the
    fixed quantities of its captured grid (from the capture-time plan); `write` runs `split_kv_plan` into it and
    sets the plan's row count, so the workspace holds nothing from the capture-time plan that a replay reads (the
    graphs of one forward share one workspace: `StepGraphs.int_workspaces`)."""

    MIN_KV_CHUNK = 128  # FlashInfer's min_kv_chunk_size for page size 1

    def __init__(self, wrapper, bs: int, block_size: int, num_qo_heads: int, num_kv_heads: int, scratch: torch.Tensor):
        """``block_size``: query rows per request of this wrapper's forward (the draft's block, or the verify
        width)."""
        info = plan_info(wrapper, PREFILL_PLAN_INFO, needs=("enable_cuda_graph", "split_kv"))
        ws = wrapper._int_workspace_buffer
        i32 = functools.partial(_int32_at, ws)

        self.bs, self.block_size, self.padded, self.scratch = bs, block_size, info["padded_batch_size"], scratch
        self.tiles_q = -(-block_size * (num_qo_heads // num_kv_heads) // info["cta_tile_q"])
        sms = torch.cuda.get_device_properties(ws.device).multi_processor_count
        self.max_batch_size_if_split = 2 * sms // num_kv_heads  # FlashInfer's PrefillPlan budget
        valid_off = info["block_valid_mask_offset"]
        self.out = dict(request_indices=i32(info["request_indices_offset"], self.padded),
                        qo_tile_indices=i32(info["qo_tile_indices_offset"], self.padded),
                        kv_tile_indices=i32(info["kv_tile_indices_offset"], self.padded),
                        o_indptr=i32(info["o_indptr_offset"], bs + 1),
                        merge_indptr=i32(info["merge_indptr_offset"], bs * block_size + 1),
                        kv_chunk_size=i32(info["kv_chunk_size_ptr_offset"], 1),
                        block_valid_mask=ws[valid_off : valid_off + self.padded])
        self.total_rows, self.total_rows_at = info["total_num_rows"], i32(info["total_num_rows_offset"], 1)

    def write(self, seq_lens: torch.Tensor) -> None:
        """seq_lens ``[bs]`` int64 committed lengths (kv length = seq_lens + block_size) on the device."""
        split_kv_plan(seq_lens, self.block_size, self.tiles_q, self.max_batch_size_if_split, self.padded,
                      self.MIN_KV_CHUNK, self.out, self.scratch)
        self.total_rows_at.fill_(self.total_rows)


def decode_kernel(target_backend, hybrid: bool) -> bool:
    """Whether a captured width-1 step's target forward (FlashInfer, one wrapper: `capture`) runs FlashInfer's
    CUDA-core decode kernel, as a DECODE batch like SGLang's own decode step, instead of its prefill kernel with one
    query row (twice the attention time on SmolLM2 at 64 requests): where SGLang's decode does not run on tensor cores
    (it picks them for GQA groups of 4 and more, and that wrapper runs the prefill kernel anyway), for a target without
    linear-attention layers."""
    return not hybrid and not target_backend.decode_use_tensor_cores


class DecodeDevicePlan:
    """Where the plan of one capture-mode FlashInfer decode wrapper (CUDA-core kernel, page size 1) lives in its int
    workspace, and its captured grid; `write` runs `decode_plan` there (the graphs of the target's width-1 forward
    share one workspace, as `DevicePlan`'s)."""

    def __init__(self, wrapper, bs: int, scratch: torch.Tensor):
        info = plan_info(wrapper, DECODE_PLAN_INFO, needs=("enable_cuda_graph",))
        ws, dev = wrapper._int_workspace_buffer, wrapper._int_workspace_buffer.device
        i32 = functools.partial(_int32_at, ws)

        padded, valid_off = info["padded_batch_size"], info["block_valid_mask_offset"]
        self.padded, self.split, self.scratch = padded, bool(info["split_kv"]), scratch
        spare = torch.zeros(padded + bs + 1, dtype=torch.int32, device=dev)  # written by the shared kernel, not read
        self.out = dict(request_indices=i32(info["request_indices_offset"], padded), qo_tile_indices=spare[:padded],
                        kv_tile_indices=i32(info["kv_tile_indices_offset"], padded),
                        o_indptr=i32(info["o_indptr_offset"], bs + 1), merge_indptr=spare[padded:],
                        kv_chunk_size=i32(info["kv_chunk_size_ptr_offset"], 1),
                        block_valid_mask=(ws[valid_off : valid_off + padded] if self.split
                                          else torch.zeros(padded, dtype=torch.uint8, device=dev)))

    def write(self, seq_lens: torch.Tensor) -> None:
        """seq_lens ``[bs]`` int64 committed lengths (kv length = seq_lens + 1) on the device."""
        decode_plan(seq_lens, self.padded, self.split, DevicePlan.MIN_KV_CHUNK, self.out, self.scratch)


class GraphPlan:
    """`decode_step`'s attention planner inside a captured graph: the paged layout and split-kv plan of this graph's
    own wrappers, written on the device, a hybrid target's state slots (``states``), then each backend's in-graph
    metadata. ``layouts``: (wrapper, query rows per request, qo_indptr ``arange(0, (bs + 1) * rows, rows)``; None for a
    decode wrapper) per wrapper."""

    def __init__(self, layouts: list, plans: list[DevicePlan], states: GraphStates | None = None):
        self.layouts, self.plans, self.states = layouts, plans, states

    def __call__(self, m: StepModels, b: StepBatch) -> None:
        for wrapper, rows, qo_indptr in self.layouts:  # the attention layout
            if qo_indptr is not None:
                wrapper._qo_indptr_buf.copy_(qo_indptr[: b.bs + 1])
            write_block_kv_layout(m.req_to_token, b.req_pool_indices, b.seq_lens, rows,
                                  wrapper._paged_kv_indptr_buf, wrapper._paged_kv_indices_buf)
        for plan in self.plans:  # and its split-kv plan
            plan.write(b.seq_lens)
        if self.states is not None:
            self.states.write(b.req_pool_indices, b.valid)
        if b.draft_fb is not None:
            m.draft_backend.init_forward_metadata_in_graph(b.draft_fb)
        m.target_backend.init_forward_metadata_in_graph(b.target_fb)


class _Wrappers(NamedTuple):
    """One forward's own wrappers in a graph: `GraphPlan` layouts, their `DevicePlan`s, and the backend's
    ``forward_metadata`` over them (shared by the graphs that run the same forward: a size's widths for the draft, a
    (size, width)'s accept kinds for the target)."""

    layouts: list
    plans: list
    forward_metadata: object


class _Captured:
    """One (batch size, width, accept kind): its three graphs, replayed in order -- the draft phase (block, attention
    plan, draft forward and proposal; the kind's own), the verify phase (the target's forward and the draft's context
    K/V; one graph shared by the kinds of the size and width), the accept (the kind's own) --, the static `StepBatch`
    they read and write, its `GraphPlan` (whose wrappers own buffers the graphs read: kept alive with them), the
    outputs, and ``packed``, the one int64 buffer the accept writes (`unpack`; a replay copies it out in one
    launch)."""

    def __init__(self, graphs: tuple, batch: StepBatch, plan: GraphPlan, outputs: StepResult, packed: torch.Tensor):
        self.graphs, self.batch, self.plan, self.outputs, self.packed = graphs, batch, plan, outputs, packed


class StepGraphs:
    """`decode_step` captured for ``batch_sizes`` x ``widths`` x accept kinds (FlashInfer, CUDA); ``vocab_size``: the
    target's logits width; ``hybrid``: the target has linear-attention layers. The sampled kinds are
    captured where they fit (`SAMPLED_ROWS_BYTES`)."""

    def __init__(self, m: StepModels, batch_sizes: Sequence[int], widths: Sequence[int], vocab_size: int, device,
                 hybrid: bool = False, max_batch_size: int | None = None):
        self.m, self.B, self.hybrid = m, m.block_size, hybrid
        self.decode_kernel = decode_kernel(full_attention_backend(m.target_backend), hybrid)
        self.sizes = sorted({int(b) for b in batch_sizes})
        self.widths = sorted({int(w) for w in widths})
        max_bs, dev = self.sizes[-1], device
        self.bonus = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.seq_lens = torch.full((max_bs,), SEQ_LEN_FILL, dtype=torch.int64, device=dev)
        self.req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.valid = torch.zeros(max_bs, dtype=torch.bool, device=dev)
        ones = lambda dtype: torch.ones(max_bs, dtype=dtype, device=dev)  # noqa: E731
        self.sampling = StepSampling(ones(torch.float32), ones(torch.int64), ones(torch.float32),
                                     torch.zeros(max_bs, dtype=torch.float32, device=dev), filtered=False)
        # one float logits buffer for every graph (SGLang's logits processor copies into it): per-graph logits
        # outputs would each stay alive with their graph
        self.logits = torch.zeros((max_bs * self.B, vocab_size), dtype=torch.float, device=dev)
        planned = planned_graphs(self.sizes, self.widths, vocab_size, max_batch_size)
        # and one buffer for the drafts' law [bs, w-1, V] of the sampled kinds (the draft phase's output, which the
        # accept reads): held per graph, each would keep a vocabulary-sized tensor alive
        self.law = torch.zeros(law_rows(planned) * vocab_size, dtype=torch.float, device=dev)
        self.qo_indptr = {rows: torch.arange(0, (max_bs + 1) * rows, rows, dtype=torch.int32, device=dev)
                          for rows in {*self.widths, self.B}}
        self.plan_scratch = torch.zeros(3 * triton_next_power_of_2(max_bs), dtype=torch.int32, device=dev)
        # one FlashInfer int workspace (8 MiB) per forward (draft, target verify, target decode) for all its graphs
        # instead of one per (size, width): each replay writes its whole plan there first (`DevicePlan`,
        # `DecodeDevicePlan`), and the graphs run one at a time
        self.int_workspaces: dict = {}  # (backend, decode) -> (device workspace, pinned host workspace)
        self.captured: dict[tuple[int, int, str], _Captured] = {}
        self.first_s = 0.0  # seconds of the first capture (warm-ups that compile kernels included)
        self.warmup_s = self.record_s = 0.0  # seconds of all captures' eager warm-ups, and of their recording
        pool, t0 = None, time.perf_counter()
        # SGLang's capture context: under tensor parallelism the draft's and the target's all-reduces / gathers
        # go to the communicators that can be captured (PyNccl, custom all-reduce), as in SGLang's own graphs
        with graph_capture() as context:
            draft = draft_bs = None  # this size's draft wrappers (shared by its widths)
            for (bs, w), group in itertools.groupby(planned, key=lambda g: g[:2]):
                if bs != draft_bs:
                    draft, draft_bs = None, bs
                kinds = [kind for _, _, kind in group]
                captured, draft, pool = self._capture(bs, w, kinds, draft, context.stream, pool, dev)
                self.captured.update({(bs, w, kind): c for kind, c in captured.items()})
                self.first_s = self.first_s or time.perf_counter() - t0

    # ---- capture -------------------------------------------------------------------------
    def _capture(self, bs: int, w: int, kinds: Sequence[str], draft, stream: torch.cuda.Stream, pool, dev):
        """-> ({kind: its `_Captured`} of ``bs`` requests at width ``w``, this size's draft wrappers for its next
        widths, the memory pool). The target's forward is captured once for all ``kinds``, each kind's draft and
        accept phases around it."""
        m, B = self.m, self.B
        base = StepBatch(m, self.bonus[:bs], self.seq_lens[:bs], self.req_pool_indices[:bs], valid=self.valid[:bs],
                         logits_buffer=self.logits[: bs * w], width=w, decode_kernel=self.decode_kernel and w == 1)
        self.valid[:bs].fill_(False)  # capture and warm-up write only to the padding slot
        forwards = []  # (backend, its own wrappers) of each forward in the step
        if base.draft_fb is not None:
            if draft is None:
                draft = self._own_wrappers(m.draft_backend, base.draft_fb, bs, B)
            forwards.append((m.draft_backend, draft))
        backend = full_attention_backend(m.target_backend)
        forwards.append((backend, self._own_wrappers(backend, base.target_fb, bs, w)))
        layouts, plans = [], []
        for be, own in forwards:
            be.forward_metadata = own.forward_metadata  # what the forward reads while being captured
            layouts += own.layouts
            plans += own.plans
        states = GraphStates(m.target_backend, self.qo_indptr[w], bs, w) if self.hybrid else None
        if states is not None:
            states.install()  # what the target's linear-attention layers read while being captured
        plan = GraphPlan(layouts, plans, states)
        batches = {}  # kind -> (the kind's view of the static batch: its sampling and accept buffer, its packed)
        for kind in kinds:
            b = copy.copy(base)
            packed = torch.zeros(bs * (w + 3), dtype=torch.int64, device=dev)
            b.sampling = None if kind == GREEDY else self.sampling.head(bs, kind == FILTERED)
            b.accept_out = unpack(packed, bs, w)
            batches[kind] = b, packed

        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        with torch.no_grad():
            with torch.cuda.stream(stream):
                logits = None
                for _ in range(2):  # warm-up outside capture (JIT, autotuning, workspaces): the first kind's whole
                    for kind in kinds:  # step, the other kinds' own phases
                        b = batches[kind][0]
                        drafts, law = draft_phase(m, b, plan)
                        logits = verify_phase(m, b) if kind == kinds[0] else logits
                        accept_phase(m, b, drafts, logits, law)
            torch.cuda.synchronize(dev)
            torch.cuda.empty_cache()  # the warm-up's blocks, which the capture's private pool cannot use
            t1 = time.perf_counter()
            proposals = {}
            for kind in kinds:
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    drafts, law = draft_phase(m, batches[kind][0], plan)
                    if law is not None:
                        law = self.law[: law.numel()].view(law.shape).copy_(law)
                proposals[kind], pool = (graph, drafts, law), graph.pool()
            verify = torch.cuda.CUDAGraph()
            with torch.cuda.graph(verify, pool=pool, stream=stream):
                logits = verify_phase(m, base)
            captured = {}
            for kind in kinds:
                (b, packed), (graph, drafts, law) = batches[kind], proposals[kind]
                accept = torch.cuda.CUDAGraph()
                with torch.cuda.graph(accept, pool=pool, stream=stream):
                    outputs = StepResult(drafts, logits, *accept_phase(m, b, drafts, logits, law))
                captured[kind] = _Captured((graph, verify, accept), b, plan, outputs, packed)
        torch.cuda.synchronize(dev)
        self.warmup_s, self.record_s = self.warmup_s + t1 - t0, self.record_s + time.perf_counter() - t1
        return captured, draft, pool

    def _own_wrappers(self, backend, fb, bs: int, rows: int) -> _Wrappers:
        """This size's own capture-mode wrappers of one forward (``rows`` query rows per request; a DECODE batch:
        decode wrappers) and their device-side layouts and plans."""
        decode = fb.forward_mode.is_decode()
        wrappers = _prepare_wrappers(backend, fb, bs)
        for wr in wrappers:  # the forward's shared workspaces; the wrapper's own ones are freed
            shared = self.int_workspaces.setdefault(
                (backend, decode), (wr._int_workspace_buffer, wr._pin_memory_int_workspace_buffer))
            wr._int_workspace_buffer, wr._pin_memory_int_workspace_buffer = shared
        if decode:
            return _Wrappers([(wr, 1, None) for wr in wrappers],
                             [DecodeDevicePlan(wr, bs, self.plan_scratch) for wr in wrappers], backend.forward_metadata)
        be = backend.indices_updater_prefill
        return _Wrappers([(wr, rows, self.qo_indptr[rows]) for wr in wrappers],
                         [DevicePlan(wr, bs, rows, be.num_qo_heads, be.num_kv_heads, self.plan_scratch)
                          for wr in wrappers],
                         backend.forward_metadata)

    # ---- replay --------------------------------------------------------------------------
    def padded_size(self, n: int) -> int | None:
        """The captured batch size a batch of n requests replays (None: larger than every capture)."""
        return padded_rows(n, self.sizes)

    def serves(self, n: int, width: int, kind: str = GREEDY) -> bool:
        """Whether a step of n requests at ``width`` accepting by ``kind`` replays a graph (else it runs eagerly)."""
        m = self.padded_size(n)
        return m is not None and (m, width, kind) in self.captured

    def replay(self, bonus_tokens: torch.Tensor, seq_lens: torch.Tensor, req_pool_indices: torch.Tensor,
               width: int, kind: str = GREEDY, info=None) -> StepResult:
        """One decode step of n requests (at most the largest captured size) at a captured ``width``, accepting by
        ``kind`` (sampled kinds: with the parameters of SGLang's SamplingBatchInfo ``info``); returns the real rows'
        results."""
        n = seq_lens.shape[0]
        m = self.padded_size(n)
        c = self.captured[(m, width, kind)]
        if kind != GREEDY:
            self.sampling.copy_(info)
        self.bonus[:n].copy_(bonus_tokens)
        self.seq_lens[:n].copy_(seq_lens)
        self.req_pool_indices[:n].copy_(req_pool_indices)
        self.valid[:n].fill_(True)
        if m > n:
            self.seq_lens[n:m].fill_(SEQ_LEN_FILL)
            self.req_pool_indices[n:m].zero_()
            self.valid[n:m].fill_(False)
        for graph in c.graphs:
            graph.replay()
        o = c.outputs
        accept_lens, bonus, committed, new_seq_lens = unpack(c.packed.clone(), m, width)  # one copy
        return StepResult(o.draft_tokens[:n], o.logits[: n * width], accept_lens[:n], bonus[:n], committed[:n],
                          new_seq_lens[:n])


def _prepare_wrappers(backend, fb, bs: int) -> list:
    """Create and plan this size's own capture-mode wrappers of ``fb``'s mode (they also become
    ``backend.forward_metadata``, which the capture reads) and put SGLang's wrappers for ``bs`` back."""
    graphs = backend.decode_cuda_graph_metadata if fb.forward_mode.is_decode() else backend.prefill_cuda_graph_metadata
    saved = graphs.get(bs)
    backend.init_forward_metadata_out_graph(fb, in_capture=True)
    wrappers = graphs[bs]
    if saved is None:
        graphs.pop(bs)
    else:
        graphs[bs] = saved
    return wrappers


def unpack(packed: torch.Tensor, bs: int, block_size: int):
    """Views of a packed accept buffer ``[bs * (block_size + 3)]`` int64 in `accept_tokens`' output order:
    accept_lens, bonus_tokens ``[bs]``, committed ``[bs, block_size]``, new_seq_lens ``[bs]`` (each contiguous)."""
    n = bs * block_size
    return (packed[:bs], packed[bs : 2 * bs], packed[2 * bs : 2 * bs + n].view(bs, block_size),
            packed[2 * bs + n : 3 * bs + n])
