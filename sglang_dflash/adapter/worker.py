"""`DFlashWorker`: the speculative worker SGLang's scheduler drives for DFLASH (SGLang's worker protocol only).

A decode call runs `step.decode_step` (build block -> draft -> verify -> commit draft KV -> accept) -- replayed
from `step_graphs.StepGraphs` on FlashInfer for the captured batch sizes, eagerly with a host attention plan
otherwise. The step's own accept is greedy, or sampled with the requests' temperature and filters (drafts drawn
from the draft's law, speculative sampling); batches that need more (grammars, penalties, min_new_tokens, logit
bias, custom logit processors, seeded sampling) take `sampling.BlockSampler.accept` on the greedy step's logits
(`sampling.step_accept_kind`). A prefill call is the target's own
extend with hidden-state capture followed by the draft's context K/V for the prompt tokens
(`StepModels.commit_kv`); the scheduler gets `spec_inputs`' results.

Under SGLang's overlap schedule the step is the same; its committed lengths are published to the scheduler's
FutureMap when it ends (`forward_batch_generation`), and batches whose logits read the output so far run after
the previous step's result is applied (`sampling.reads_output_history`, `hooks`).
"""

from __future__ import annotations

import functools
import logging

import torch

from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import build_draft_tp_worker

from sglang_dflash.adapter import compat, cpu_attention, hybrid, profiling, step_graphs
from sglang_dflash.adapter.draft_model import SGLangDFlashDraft, capture_target_layers
from sglang_dflash.adapter.sampling import BLOCK, FILTERED, GREEDY, BlockSampler, StepSampling, step_accept_kind
from sglang_dflash.adapter.spec_inputs import (decode_result, extend_positions, host_to_device, idle_result,
                                                prefill_result)
from sglang_dflash.adapter.step import HostPlan, StepBatch, StepModels, decode_step
from sglang_dflash.adapter.widths import StepWidths
from sglang_dflash.adapter.tp import agree_on_accept, lm_head_shard, tp_group
from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.model import draft_logits
from sglang_dflash.policy import AdaptiveConfig
from sglang_dflash.verify import VocabSplit

logger = logging.getLogger(__name__)


class DFlashWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id, nccl_port, target_worker: TpModelWorker, ps=None):
        args = compat.published(server_args)  # resolved values (`compat.published`)
        super().__init__()
        self._target_worker = target_worker
        self.target_runner = target_worker.model_runner
        self.device = target_worker.device
        self.block_size = int(args.speculative_num_draft_tokens)

        self.dcfg = DFlashDraftConfig.from_pretrained(args.speculative_draft_model_path,
                                                      args.speculative_draft_model_revision)
        self.dcfg.validate_target(self.target_runner.model_config.hf_config)
        target = self.target_runner.model
        self._capture_target_layers()  # its checks here, at start-up; set again in `init_attention_backends`
        self.embed = target.get_input_embeddings()
        # under tensor parallelism: this rank's vocabulary shard (`tp`)
        self.lm_head_weight, vocab_start, vocab_split = lm_head_shard(target.lm_head)
        self.tp_group = tp_group()
        self.vocab = VocabSplit(vocab_start, self.lm_head_weight.shape[0], self.target_runner.model_config.vocab_size,
                                self.tp_group if vocab_split else None)
        self.mask_token_id = int(self.dcfg.mask_token_id)

        self.backend = args.attention_backend or "flashinfer"
        self._draft_worker = self._build_draft_worker(server_args, gpu_id, ps, nccl_port)
        self.draft_runner = self._draft_worker.model_runner
        self.draft_model: SGLangDFlashDraft = self.draft_runner.model
        if self.draft_model.get_attention_sliding_window_size() is not None and self.backend != "torch_native":
            logger.info("sglang-dflash: sliding-window draft layers run on SGLang's sliding-window attention, which "
                        "trims each request's keys to its window plus the block: at contexts longer than the window "
                        "a block query may see up to block_size keys past z-lab's window (torch_native: exact)")
        self.sampler = BlockSampler(self.device, self.target_runner.sampler)
        adaptive = AdaptiveConfig.parse(args.speculative_adaptive_config, self.block_size)
        self.widths = StepWidths(adaptive, self.block_size, self.device, self.tp_group,
                                 overlap=not args.disable_overlap_schedule)
        self.step_graphs: step_graphs.StepGraphs | None = None  # the whole step as CUDA graphs (init_cuda_graphs)
        self._models: StepModels | None = None
        self.state_commit: hybrid.StateCommit | None = None  # hybrid targets (init_attention_backends)
        logger.info(
            "DFLASH served by sglang-dflash (block_size=%d, target_layer_ids=%s, mask_token_id=%d, "
            "attention_backend=%s, verify widths=%s%s)",
            self.block_size, list(self.dcfg.target_layer_ids), self.mask_token_id, self.backend,
            list(self.widths.policy.widths), " adaptive" if adaptive.adaptive and len(adaptive.widths) > 1 else "",
        )
        profiling.instrument(self)

    @property
    def models(self) -> StepModels:
        """What `decode_step` runs (made at first use: the KV pools exist by then)."""
        if self._models is None:
            self._models = StepModels(
                draft_model=self.draft_model, target_model=self.target_runner.model,
                draft_backend=self.draft_runner.attn_backend, target_backend=self.target_runner.attn_backend,
                embed=self.embed, lm_head_weight=self.lm_head_weight,
                draft_logits=functools.partial(draft_logits, self.dcfg),
                commit_kv=functools.partial(self.draft_model.write_context_kv, kv_pool=self.draft_runner.token_to_kv_pool),
                req_to_token=self.target_runner.req_to_token_pool.req_to_token, mask_token_id=self.mask_token_id,
                block_size=self.block_size, paged_verify=self.backend != "torch_native", vocab=self.vocab,
                draft_kv_translator=compat.kv_translator(self.draft_runner),
                target_kv_translator=compat.kv_translator(self.target_runner))
        return self._models

    def _capture_target_layers(self) -> list[int]:
        """Set the target's hidden-state capture to the draft's target layers (`capture_target_layers`: its checks,
        and the layers captured, each once in layer order)."""
        return capture_target_layers(self.target_runner.model, list(self.dcfg.target_layer_ids),
                                     self.target_runner.model_config.hf_text_config.num_hidden_layers)

    def _build_draft_worker(self, server_args, gpu_id, ps, nccl_port) -> TpModelWorker:
        """A draft TpModelWorker (SGLang's draft-worker builder) whose model class is ours and whose KV pool shares
        slots."""
        ModelRegistry.models["DFlashDraftModel"] = SGLangDFlashDraft
        return build_draft_tp_worker(
            server_args=server_args, gpu_id=gpu_id, nccl_port=nccl_port, **compat.worker_ps(ps),
            target_model_config=self.target_runner.model_config, algo_label="DFLASH",
            attention_backend_override=self.backend).draft_worker

    # ---- SGLang worker plumbing -------------------------------------------------------
    def init_attention_backends(self):
        """The draft runner's attention backends (the target's are made by its own worker first); on torch_native
        both runners' extends then go to `cpu_attention.DFlashCPUAttnBackend` (new tokens only, the draft's layers
        as z-lab defines them). The target's layer capture is set here, after the target runner set SGLang's (the
        draft's target_layer_ids as given, which repeated ids break) and before any graph is captured."""
        self.draft_model.read_captured_layers(self._capture_target_layers())
        super().init_attention_backends()
        if self.backend == "torch_native":
            for runner in (self.target_runner, self.draft_runner):
                cpu_attention.install(runner)
        self.state_commit = hybrid.state_commit(self.target_runner)

    def init_cuda_graphs(self):
        """Capture the draft runner's graphs (the target's are captured by its own worker first), then the decode
        step for the same batch sizes where it can be (`step_graphs.capture`)."""
        super().init_cuda_graphs()
        self.step_graphs = step_graphs.capture(self.models, (self.target_runner, self.draft_runner), self.backend,
                                               self.state_commit is not None, self.widths.possible_widths(),
                                               self.device, self.widths.policy.max_batch_size)

    @property
    def spec_v2_attn_backends(self) -> tuple:
        """The backends whose ``needs_cpu_seq_lens`` decides whether SGLang's FutureMap mirrors the committed lengths
        to the host each step (read once, after `init_cuda_graphs`). The step graphs plan attention on the device,
        so with them there is none: no mirror, and the host enqueues the next step without waiting for this one
        (a batch larger than every capture reads its lengths itself, `decode`)."""
        return () if self.step_graphs is not None else (self.target_runner.attn_backend, self.draft_runner.attn_backend)

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        """The draft's KV pool, on the target's request rows and token slots."""
        self._draft_worker.alloc_memory_pool(memory_pool_config=memory_pool_config, req_to_token_pool=req_to_token_pool,
                                             token_to_kv_pool_allocator=token_to_kv_pool_allocator)
        self.req_to_token_pool, self.token_to_kv_pool_allocator = req_to_token_pool, token_to_kv_pool_allocator

    # ---- online weight updates (RL weight sync) ----------------------------------------
    # SGLang loads new target weights in place (so the borrowed embeddings / lm_head and the step graphs' pointers
    # follow) and flushes the KV cache, the draft's included, unless asked not to. The draft keeps its weights:
    # outputs stay exactly the updated target's; only the acceptance may drop until the drafter is retrained.
    def update_weights_from_disk(self, recv_req):
        """Called after the target worker loaded new weights (a target checkpoint, or weights sent by IPC)."""
        return True, "Succeeded to update model weights (target; the DFlash draft keeps its own)."

    update_weights_from_ipc = update_weights_from_disk

    def weight_update_runners(self) -> list:
        """The runners SGLang's weight updates load into besides the target's (SGLang 0.5.23+): none."""
        return []

    def update_weights_from_tensor(self, recv_req):
        """SGLang routes tensor updates to the speculative worker: named tensors are the target's parameters."""
        return self._target_worker.update_weights_from_tensor(recv_req)

    # ---- the step ---------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None,
                                 pp_proxy_tensors=None) -> GenerationBatchResult:
        """One forward of ``batch``. Under SGLang's overlap schedule ``on_publish(new_seq_lens)`` hands the
        committed lengths to the scheduler's FutureMap once the step is enqueued (the next step reads them on the
        device; the host copies them only without step graphs, `spec_v2_attn_backends`); ``grammar_barrier`` is
        unused: batches with a grammar, or whose logits depend on the output so far, run with the previous step's
        result applied (`hooks._sync_for_history`); ``pp_proxy_tensors`` is None (no pipeline parallelism)."""
        kind = call_kind(batch)
        result = self.decode(batch) if kind == "decode" else self.prefill(batch) if kind == "prefill" else self.idle()
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        return result

    def decode(self, batch) -> GenerationBatchResult:
        """One DFLASH decode step of ``batch`` (`step.decode_step`: graph replay or eager) and its accept."""
        bonus = batch.spec_info.bonus_tokens
        seq_lens, rows = batch.seq_lens.to(torch.int64), batch.req_pool_indices.to(torch.int64)
        bs = batch.batch_size()
        width = self.widths.choose(bs)
        kind = step_accept_kind(batch)
        step_kind = GREEDY if kind == BLOCK else kind
        graphed = self.step_graphs is not None and self.step_graphs.serves(bs, width, step_kind)
        if graphed:
            res = self.step_graphs.replay(bonus, seq_lens, rows, width, step_kind, batch.sampling_info)
        else:  # host plan: the lengths on the host (copied here when SGLang did not mirror them)
            if batch.seq_lens_cpu is None:
                batch.seq_lens_cpu = batch.seq_lens.cpu()
            sampling = None if step_kind == GREEDY else StepSampling.of(batch.sampling_info, kind == FILTERED)
            b = StepBatch(self.models, bonus, seq_lens, rows, seq_lens_cpu=batch.seq_lens_cpu, width=width,
                          sampling=sampling)
            res = decode_step(self.models, b, HostPlan())
        if kind != BLOCK:
            accepted = res.accept_lens, res.bonus_tokens, res.committed, res.new_seq_lens
        else:
            accepted = self.sampler.accept(batch, res.draft_tokens, res.logits)
            if self.tp_group is not None:  # SGLang's sampler drew on every rank: rank 0's draw decides
                accepted = agree_on_accept(accepted, self.tp_group)
        accept_lens, _, committed, _ = accepted
        if self.state_commit is not None:  # hybrid target: linear-attention states after the committed tokens
            self.state_commit(accept_lens, rows)
        result = decode_result(res.logits, accepted, width, self.block_size, graphed)
        if batch.return_logprob:
            self.sampler.attach_logprobs(batch, result.logits_output, committed)
        self.widths.finish(accept_lens)
        return result

    def prefill(self, batch) -> GenerationBatchResult:
        """The target's extend with hidden-state capture, then the draft's context K/V of the extended tokens."""
        self.widths.interrupt()
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        self.models.commit_kv(out.logits_output.hidden_states, host_to_device(extend_positions(batch), self.device),
                              batch.out_cache_loc)
        return prefill_result(out, batch, self.block_size)

    def idle(self) -> GenerationBatchResult:
        return idle_result(self.device, self.block_size)


def call_kind(batch) -> str:
    """prefill / idle / decode: which path `DFlashWorker.forward_batch_generation` takes for ``batch``."""
    if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
        return "prefill"
    if batch.forward_mode.is_idle() or batch.batch_size() == 0:
        return "idle"
    return "decode"
