"""`DFlashWorker`: the speculative worker SGLang's scheduler drives for DFLASH.

One decode step, one method per phase:

    build_block -> draft -> verify -> accept -> commit_kv

* build_block: `[bonus, MASK x (B-1)]` per request at positions `seq_len + arange(B)`,
  slots gathered from the reservation in `req_to_token` (one Triton launch).
* draft: one forward of the draft model over the block (bidirectional inside the
  block, attending to the draft KV of the context); draft tokens = argmax of the
  target's lm_head on block positions 1..B-1.
* verify: one TARGET_VERIFY forward of the target over the B tokens (causal, no tree).
* accept: greedy or exact rejection sampling (`sglang_dflash.verify`), then the
  accept kernel packs `accept_lens`, `bonus_tokens`, committed tokens, new `seq_lens`.
* commit_kv: the draft's context K/V for the block tokens, from the target hidden
  states captured during verify, written at the verify slots (rows past the commit
  point are overwritten by the next block before anything reads them).

On FlashInfer (CUDA) the five phases are captured together as one CUDA graph per batch size
(`step_graphs`); other GPU backends run them one by one with commit_kv from CUDA graphs
(`commit_graphs`); CPU runs them eagerly.

Prefill is the target's own extend with hidden-state capture, followed by
`commit_kv` for the prompt tokens.

Under SGLang's overlap schedule the step is the same; its committed lengths are published to the
scheduler's FutureMap when it ends (`forward_batch_generation`), and batches whose logits read the
output so far run after the previous step's result is applied (`reads_output_history`).
"""

from __future__ import annotations

import copy
import logging

import torch

from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.managers.tp_worker import TpModelWorker
from sglang.srt.managers.utils import GenerationBatchResult
from sglang.srt.model_executor.forward_batch_info import CaptureHiddenMode, ForwardBatch, ForwardMode
from sglang.srt.models.registry import ModelRegistry
from sglang.srt.runtime_context import get_context
from sglang.srt.speculative.base_spec_worker import BaseSpecWorker
from sglang.srt.speculative.draft_worker_common import draft_server_args_overrides
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
from sglang.srt.speculative.spec_utils import GrammarTree, build_grammar_vocab_mask

from sglang_dflash.adapter.commit_graphs import CommitGraphs
from sglang_dflash.adapter.draft_model import SGLangDFlashDraft
from sglang_dflash.adapter.profiling import PhaseTimer, StepTimeline
from sglang_dflash.adapter.spec_inputs import DFlashBlockInput, DFlashDraftState
from sglang_dflash.adapter.step_graphs import StepGraphs
from sglang_dflash.config import DFlashDraftConfig
from sglang_dflash.kernels.accept import accept_tokens
from sglang_dflash.kernels.block_builder import build_block
from sglang_dflash.verify import BlockPenalties, OutputCounts, adjust_block_logits, sample_predictions, target_probs

logger = logging.getLogger(__name__)



class DFlashWorker(BaseSpecWorker):
    def __init__(self, server_args, gpu_id, ps, nccl_port, target_worker: TpModelWorker):
        super().__init__()
        self._target_worker = target_worker
        self.target_runner = target_worker.model_runner
        self.device = target_worker.device
        self.block_size = int(server_args.speculative_num_draft_tokens)

        self.dcfg = DFlashDraftConfig.from_pretrained(server_args.speculative_draft_model_path,
                                                      server_args.speculative_draft_model_revision)
        self.dcfg.validate_target(self.target_runner.model_config.hf_config)
        target = self.target_runner.model
        if not hasattr(target, "set_dflash_layers_to_capture"):
            raise ValueError(
                f"sglang-dflash: target architecture {type(target).__name__} cannot expose the hidden "
                "states of intermediate layers (no set_dflash_layers_to_capture). Use a Llama/Qwen-family target."
            )
        num_layers = self.target_runner.model_config.hf_text_config.num_hidden_layers
        if max(self.dcfg.target_layer_ids) >= num_layers - 1:
            raise ValueError(
                f"sglang-dflash: draft target_layer_ids {self.dcfg.target_layer_ids} include the target's last layer "
                f"({num_layers - 1}); SGLang captures hidden states before a layer runs, so the last layer's output "
                "cannot be captured. Use a draft trained on earlier layers."
            )
        target.set_dflash_layers_to_capture(list(self.dcfg.target_layer_ids))
        self.embed = target.get_input_embeddings()
        self.lm_head_weight = target.lm_head.weight
        self.mask_token_id = int(self.dcfg.mask_token_id)

        self.backend = server_args.attention_backend or "flashinfer"
        # FlashInfer's TARGET_VERIFY reads `seq_lens` as the committed prefix (the block is added by
        # `generate_attn_arg_prefill`); torch_native reads it as the full KV length and needs extend lens.
        self.paged_verify = self.backend != "torch_native"
        self._draft_worker = self._build_draft_worker(server_args, gpu_id, ps, nccl_port)
        self.draft_runner = self._draft_worker.model_runner
        self.draft_model: SGLangDFlashDraft = self.draft_runner.model
        self.timer = PhaseTimer.from_env(self.device)
        self.timeline = StepTimeline.from_env(self.device)
        self.output_counts = None  # OutputCounts for the penalties, made at the first penalized step (logits width)
        self.commit_block_kv = self.commit_kv  # CommitGraphs once the CUDA graphs are captured (init_cuda_graphs)
        self.step_graphs: StepGraphs | None = None  # the whole step as CUDA graphs (init_cuda_graphs, FlashInfer)
        logger.info(
            "DFLASH served by sglang-dflash (block_size=%d, target_layer_ids=%s, mask_token_id=%d, "
            "attention_backend=%s)",
            self.block_size, list(self.dcfg.target_layer_ids), self.mask_token_id, self.backend,
        )

    def _build_draft_worker(self, server_args, gpu_id, ps, nccl_port) -> TpModelWorker:
        """A draft TpModelWorker whose model class is ours and whose KV pool shares slots."""
        ModelRegistry.models["DFlashDraftModel"] = SGLangDFlashDraft
        draft_args = copy.deepcopy(server_args)
        draft_args.override(
            "sglang_dflash.draft_worker",
            **draft_server_args_overrides(self.target_runner.model_config, self.backend),
        )
        with get_context().preserve_config():
            get_context().set_server_args(draft_args)
            worker = TpModelWorker(server_args=draft_args, gpu_id=gpu_id, ps=ps, nccl_port=nccl_port,
                                   is_draft_worker=True)
        worker.draft_runner = worker.model_runner  # read by SGLang's KV-pool builders
        return worker

    # ---- SGLang worker plumbing -------------------------------------------------------
    def init_cuda_graphs(self):
        """Capture the draft runner's graphs (the target's are captured by its own worker first), then, for the
        same batch sizes, the decode step: whole on FlashInfer (`StepGraphs`), else its commit_kv (`CommitGraphs`)."""
        super().init_cuda_graphs()
        runners = (self.target_runner, self.draft_runner)
        if not str(self.device).startswith("cuda") or any(r.decode_cuda_graph_runner is None for r in runners):
            return
        sizes = sorted(set.intersection(*(set(r.decode_cuda_graph_runner.capture_bs) for r in runners)))
        if self.backend == "flashinfer" and all(r.attn_backend.num_wrappers == 1
                                                and r.attn_backend.prefill_backend == "fa2" for r in runners):
            self.step_graphs = StepGraphs(self, sizes)
            logger.info("sglang-dflash: decode step captured as one CUDA graph for batch sizes %s", sizes)
            return
        hidden = self.target_runner.model_config.hf_text_config.hidden_size
        self.commit_block_kv = CommitGraphs(
            self.commit_kv, sizes, self.block_size, len(self.dcfg.target_layer_ids) * hidden,
            self.embed.weight.dtype, torch.int64, self.device)  # out_cache_loc from build_block is int64
        logger.info("sglang-dflash: commit_kv captured for batch sizes %s", sizes)

    @property
    def spec_v2_attn_backends(self) -> tuple:
        """The backends whose ``needs_cpu_seq_lens`` decides whether SGLang's FutureMap mirrors the committed lengths
        to the host each step (read once, after `init_cuda_graphs`). The step graphs plan attention on the device,
        so with them there is none: no mirror, and the host enqueues the next step without waiting for this one
        (a batch larger than every capture reads its lengths itself, `phase_step`)."""
        if self.step_graphs is not None:
            return ()
        return (self.target_runner.attn_backend, self.draft_runner.attn_backend)

    def alloc_memory_pool(self, memory_pool_config=None, req_to_token_pool=None, token_to_kv_pool_allocator=None):
        self._draft_worker.alloc_memory_pool(
            memory_pool_config=memory_pool_config,
            req_to_token_pool=req_to_token_pool,
            token_to_kv_pool_allocator=token_to_kv_pool_allocator,
        )
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator

    # ---- online weight updates (RL weight sync) ----------------------------------------
    # SGLang loads new target weights in place (so the borrowed embeddings / lm_head and the step graphs' pointers
    # follow) and flushes the KV cache, the draft's included, unless asked not to. The draft keeps its weights:
    # outputs stay exactly the updated target's; only the acceptance may drop until the drafter is retrained.
    def update_weights_from_disk(self, recv_req):
        """Called after the target worker loaded ``recv_req.model_path`` (a target checkpoint)."""
        return True, "Succeeded to update model weights (target; the DFlash draft keeps its own)."

    def update_weights_from_ipc(self, recv_req):
        """Called after the target worker took the new weights."""
        return True, "Succeeded to update model weights (target; the DFlash draft keeps its own)."

    def update_weights_from_tensor(self, recv_req):
        """SGLang routes tensor updates to the speculative worker: named tensors are the target's parameters."""
        return self._target_worker.update_weights_from_tensor(recv_req)

    # ---- the step ---------------------------------------------------------------------
    def forward_batch_generation(self, batch, on_publish=None, grammar_barrier=None) -> GenerationBatchResult:
        """One forward of ``batch``. Under SGLang's overlap schedule ``on_publish(new_seq_lens)`` hands the
        committed lengths to the scheduler's FutureMap once the step is enqueued (the next step reads them on the
        device; the host copies them only without step graphs, `spec_v2_attn_backends`); ``grammar_barrier`` is
        unused: batches with a grammar, or whose logits depend on the output so far, run with the previous step's
        result applied (`hooks._sync_for_history`)."""
        kind = _call_kind(batch)
        mark = self.timeline.begin(kind)
        result = self.step(batch, kind)
        if on_publish is not None:
            on_publish(result.new_seq_lens)
        self.timeline.end(mark)
        return result

    def step(self, batch, kind: str) -> GenerationBatchResult:
        """``kind``: `_call_kind(batch)`."""
        if kind != "decode":
            self.timer.break_chain()
            return self.prefill(batch) if kind == "prefill" else self.idle()
        state: DFlashDraftState = batch.spec_info
        t = self.timer.start_step(batch.batch_size())
        if self.step_graphs is not None and self.step_graphs.padded_size(batch.batch_size()) is not None:
            draft_tokens, logits_output, accepted = self.graph_step(batch, state, t)
            can_run_graph = True
        else:
            draft_tokens, logits_output, accepted, can_run_graph = self.phase_step(batch, state, t)
        accept_lens, bonus, committed, new_seq_lens = accepted
        if batch.return_logprob:
            self.attach_logprobs(batch, logits_output, committed)
        self.timer.end_step()
        logits_output.hidden_states = None
        return GenerationBatchResult(
            logits_output=logits_output,
            next_token_ids=committed.reshape(-1),
            accept_lens=(accept_lens + 1).to(torch.int32),
            can_run_cuda_graph=can_run_graph,
            next_draft_input=DFlashDraftState(bonus_tokens=bonus, block_size=self.block_size),
            speculative_num_draft_tokens=self.block_size,
            new_seq_lens=new_seq_lens,
        )

    def phase_step(self, batch, state: DFlashDraftState, t):
        """build_block -> draft -> verify -> accept -> commit_kv, each phase its own launches (the forwards
        replay SGLang's per-runner graphs where they can; both plan attention on the host from the committed
        lengths, copied here when SGLang did not mirror them)."""
        if batch.seq_lens_cpu is None:
            batch.seq_lens_cpu = batch.seq_lens.cpu()
        with t("build_block"):
            block = self.build_block(batch, state)
        with t("draft"):
            draft_tokens = self.draft(batch, block)
        with t("verify"):
            logits_output, can_run_graph = self.verify(batch, block, draft_tokens)
        with t("accept"):
            accepted = self.accept(batch, draft_tokens, logits_output)
        with t("commit_kv"):
            self.commit_block_kv(logits_output.hidden_states, block.positions, block.out_cache_loc)
        return draft_tokens, logits_output, accepted, can_run_graph

    def graph_step(self, batch, state: DFlashDraftState, t):
        """The same phases replayed as one CUDA graph (`StepGraphs`); its greedy accept is used unless the
        batch needs more (sampling, grammars, penalties, logit processors), which accept on its logits."""
        with t("step_graph"):
            out = self.step_graphs.replay(batch, state.bonus_tokens)
        logits_output = LogitsProcessorOutput(next_token_logits=out.logits)
        with t("accept"):
            if self.plain_greedy(batch):  # the replay's own copies of the graph's accept outputs
                accepted = (out.accept_lens, out.bonus_tokens, out.committed, out.new_seq_lens)
            else:
                accepted = self.accept(batch, out.draft_tokens, logits_output)
        return out.draft_tokens, logits_output, accepted

    def prefill(self, batch) -> GenerationBatchResult:
        out = self.target_worker.forward_batch_generation(batch, capture_hidden_mode=CaptureHiddenMode.FULL)
        prefix = torch.tensor(batch.prefix_lens, dtype=torch.int64)
        lens = torch.tensor(batch.extend_lens, dtype=torch.int64)
        positions = torch.repeat_interleave(prefix, lens) + (
            torch.arange(int(lens.sum())) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
        )
        self.commit_kv(out.logits_output.hidden_states, positions.to(self.device), batch.out_cache_loc)
        out.logits_output.hidden_states = None
        out.new_seq_lens = batch.seq_lens
        out.next_draft_input = DFlashDraftState(bonus_tokens=out.next_token_ids.to(torch.int64),
                                                block_size=self.block_size)
        return out

    def idle(self) -> GenerationBatchResult:
        empty = torch.empty((0,), dtype=torch.int64, device=self.device)
        return GenerationBatchResult(
            next_token_ids=empty, accept_lens=empty.to(torch.int32), new_seq_lens=empty,
            next_draft_input=DFlashDraftState(bonus_tokens=empty, block_size=self.block_size),
            speculative_num_draft_tokens=self.block_size,
        )

    def build_block(self, batch, state: DFlashDraftState) -> "_Block":
        input_ids, positions, out_cache_loc = build_block(
            state.bonus_tokens, batch.seq_lens.to(torch.int64), self.block_size, self.mask_token_id,
            self.target_runner.req_to_token_pool.req_to_token, batch.req_pool_indices.to(torch.int64),
            check_values=False,
        )
        return _Block(input_ids, positions, out_cache_loc)

    def _forward_batch(self, batch, block: "_Block", input_ids, capture) -> ForwardBatch:
        """TARGET_VERIFY-mode ForwardBatch over one block per request."""
        bs, B = batch.batch_size(), self.block_size
        prefix_cpu = batch.seq_lens_cpu.to(torch.int64)
        seq_lens_cpu = prefix_cpu + B  # host bound: committed prefix + the block
        seq_lens = batch.seq_lens if self.paged_verify else batch.seq_lens + B
        spec_info = DFlashBlockInput(draft_token=input_ids, positions=block.positions, draft_token_num=B,
                                     capture_hidden_mode=capture)
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=input_ids,
            req_pool_indices=batch.req_pool_indices, seq_lens=seq_lens, out_cache_loc=block.out_cache_loc,
            seq_lens_sum=int(seq_lens_cpu.sum()), seq_lens_cpu=seq_lens_cpu, positions=block.positions,
            spec_algorithm=SpeculativeAlgorithm.DFLASH, spec_info=spec_info, capture_hidden_mode=capture,
            sampling_info=batch.sampling_info,
        )
        if not self.paged_verify:
            fb.extend_prefix_lens = batch.seq_lens.to(torch.int32)
            fb.extend_seq_lens = torch.full((bs,), B, dtype=torch.int32, device=self.device)
            fb.extend_prefix_lens_cpu = prefix_cpu.tolist()
            fb.extend_seq_lens_cpu = [B] * bs
            fb.extend_num_tokens = bs * B
        return fb

    def draft(self, batch, block: "_Block") -> torch.Tensor:
        """-> draft_tokens [bs, B]: column 0 = bonus token, 1.. = draft proposals."""
        fb = self._forward_batch(batch, block, block.input_ids, CaptureHiddenMode.NULL)
        fb.input_embeds = self.embed(block.input_ids)
        hidden = self.draft_runner.forward(fb).logits_output.hidden_states
        return self.propose(hidden, block.input_ids, batch.batch_size())

    def propose(self, hidden: torch.Tensor, input_ids: torch.Tensor, bs: int) -> torch.Tensor:
        """Draft hidden states [bs * B, H] and block input_ids [bs * B] -> draft_tokens [bs, B]: column 0 = the
        bonus token, 1.. = argmax of the target's lm_head."""
        B = self.block_size
        proposals = torch.matmul(hidden.view(bs, B, -1)[:, 1:], self.lm_head_weight.t()).argmax(dim=-1)
        return torch.cat([input_ids.view(bs, B)[:, :1], proposals], dim=1)

    def verify(self, batch, block: "_Block", draft_tokens: torch.Tensor):
        fb = self._forward_batch(batch, block, draft_tokens.reshape(-1), CaptureHiddenMode.FULL)
        out = self.target_runner.forward(fb)
        return out.logits_output, out.can_run_graph

    def accept(self, batch, draft_tokens: torch.Tensor, logits_output):
        bs, B = draft_tokens.shape
        logits = logits_output.next_token_logits.view(bs, B, -1)
        if batch.has_grammar:
            self.apply_grammar(batch, draft_tokens, logits_output.next_token_logits)
        self.adjust_logits(batch, logits, draft_tokens)
        info = batch.sampling_info
        if info.has_custom_logit_processor:
            self.apply_custom_processors(info, draft_tokens, logits_output.next_token_logits)
        seq_lens = batch.seq_lens.to(torch.int64)
        if info.is_all_greedy:
            return self.greedy_accept(draft_tokens, logits, seq_lens)
        probs = target_probs(logits, info.temperatures.view(-1), info.top_ks.view(-1),
                             info.top_ps.view(-1), info.min_ps.view(-1),
                             needs_filter=info.need_top_p_sampling or info.need_top_k_sampling
                             or info.need_min_p_sampling,
                             any_greedy=False)  # SGLang encodes greedy rows as top_k=1, temperature 1
        return accept_tokens(draft_tokens, sample_predictions(draft_tokens, probs), seq_lens)

    def greedy_accept(self, draft_tokens: torch.Tensor, logits: torch.Tensor, seq_lens: torch.Tensor, out=None):
        """draft_tokens [bs, B], verify logits [bs * B, V] (or [bs, B, V]), seq_lens [bs] int64 -> accept_tokens'
        (accept_lens, bonus_tokens, committed, new_seq_lens) with the target's argmax as its choice (written into
        ``out``, four buffers in that order, when given)."""
        bs, B = draft_tokens.shape
        return accept_tokens(draft_tokens, logits.view(bs, B, -1).argmax(dim=-1), seq_lens, out=out)

    def plain_greedy(self, batch) -> bool:
        """True when accept is the target's argmax alone: all greedy, no grammar, logit bias, min_new_tokens,
        penalties or custom logit processors (what `accept` would otherwise apply)."""
        info = batch.sampling_info
        return info.is_all_greedy and info.logit_bias is None and not reads_output_history(batch)

    def apply_grammar(self, batch, draft_tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """Constrained decoding (regex / JSON schema / EBNF / structural tags): block position k of a request with a
        grammar gets the vocab mask of its grammar after ``d_1..d_k``, built by SGLang's chain traversal (the FSM
        accepts the drafts one by one and rolls back). Positions after a draft the grammar forbids keep every
        token allowed; their verdict is never used, because the masked target cannot pick that draft.
        draft_tokens ``[bs, B]``; logits ``[bs * B, V]`` in place. The scheduler advances each FSM over the
        committed tokens afterwards and cuts a run at the token that completes the grammar."""
        mask = build_grammar_vocab_mask(reqs=batch.reqs, tree=GrammarTree.from_linear_chain(draft_tokens),
                                        sampling_info=batch.sampling_info, device=self.device, barrier=None)
        if mask is not None:
            mask.apply(logits)

    def adjust_logits(self, batch, logits: torch.Tensor, draft_tokens: torch.Tensor) -> None:
        """Penalties, min_new_tokens and logit_bias on the verify logits ``[bs, B, V]``, in place, per block
        position as plain decoding applies them (accept and attach_logprobs both see them); draft_tokens
        ``[bs, B]`` are the verify rows. The forward's sampling_info carries no penalizer state (SGLang strips
        it for the forward), so the penalties count each request's output ids (kept between steps by
        OutputCounts, updated with the tokens committed since) and min_new_tokens
        from SGLang's definition of a request's stop ids (sampling stop_token_ids, the tokenizer's additional
        stop ids and its EOS)."""
        bias = batch.sampling_info.logit_bias
        reqs = batch.reqs
        short, penalized = _short_and_penalized(reqs)
        if bias is None and not short and not penalized:
            return
        bs, _, vocab = logits.shape
        stop_penalties = num_output = min_new = penalties = None
        if short:
            stop_penalties = torch.zeros((bs, vocab), dtype=torch.float32)
            for i in short:
                tok = reqs[i].tokenizer
                ids = set(reqs[i].sampling_params.stop_token_ids or ()) | set(getattr(tok, "additional_stop_token_ids", None) or ())
                if getattr(tok, "eos_token_id", None) is not None:
                    ids.add(tok.eos_token_id)
                stop_penalties[i, [t for t in ids if 0 <= t < vocab]] = float("-inf")
            stop_penalties = stop_penalties.to(self.device)
            num_output, min_new = torch.tensor([[len(r.output_ids), r.sampling_params.min_new_tokens] for r in reqs],
                                               dtype=torch.int64).to(self.device).unbind(1)  # one copy
        if penalized:
            if self.output_counts is None or self.output_counts.vocab_size != vocab:
                self.output_counts = OutputCounts(vocab, self.device)
            counts = self.output_counts.gather([reqs[i].rid for i in penalized], [reqs[i].output_ids for i in penalized],
                                               penalized, bs)
            params = torch.tensor([[r.sampling_params.frequency_penalty, r.sampling_params.presence_penalty,
                                    r.sampling_params.repetition_penalty] for r in reqs], dtype=torch.float32)
            penalties = BlockPenalties(counts, draft_tokens, *params.to(self.device).unbind(1))  # one copy
        adjust_block_logits(logits, bias, stop_penalties, num_output, min_new, penalties)

    def apply_custom_processors(self, info, draft_tokens: torch.Tensor, logits: torch.Tensor) -> None:
        """SGLang's custom logit processors (``--enable-custom-logit-processor``) on every block position, last, as
        SGLang's sampler applies them. Row (i, k) gets request i's custom params; a processor that reads the request
        (``__req__``) sees a shallow copy whose ``output_ids`` end with the drafts d_1..d_k, the history plain
        decoding shows it at that position. draft_tokens ``[bs, B]``; logits ``[bs * B, V]`` in place."""
        B = draft_tokens.shape[1]
        drafts = draft_tokens[:, 1:].tolist()
        for processor, mask in info.custom_logit_processor.values():
            reqs = mask.nonzero(as_tuple=True)[0].tolist()
            rows = torch.tensor([i * B + k for i in reqs for k in range(B)], device=logits.device)
            params = [_params_after(info.custom_params[i], drafts[i][:k]) for i in reqs for k in range(B)]
            logits[rows] = processor(logits[rows], params)

    def attach_logprobs(self, batch, logits_output, committed: torch.Tensor) -> None:
        """Decode logprobs of the committed tokens, as SGLang's sampler defines them: log_softmax of the
        temperature-scaled logits at each token's verify position. committed [bs, B] (-1 padded); the
        scheduler reads the first accept_len+1 entries of each row (and of each top-k / token-ids list)."""
        bs, B = committed.shape
        temps = batch.sampling_info.temperatures.view(bs, 1, 1).float()
        logp = torch.log_softmax(logits_output.next_token_logits.view(bs, B, -1).float() / temps, dim=-1)
        logits_output.next_token_logprobs = logp.gather(-1, committed.clamp(min=0)[..., None]).squeeze(-1)
        flat = logp.view(bs * B, -1)
        top_nums = [n for n in batch.top_logprobs_nums for _ in range(B)]
        if any(top_nums):
            vals, idx = flat.topk(max(top_nums), dim=-1)
            logits_output.next_token_top_logprobs_val = [vals[r, :k] for r, k in enumerate(top_nums)]
            logits_output.next_token_top_logprobs_idx = [idx[r, :k] for r, k in enumerate(top_nums)]
        token_ids = [ids for ids in batch.token_ids_logprobs for _ in range(B)]
        if any(ids is not None for ids in token_ids):
            logits_output.next_token_token_ids_logprobs_val = [
                flat[r, ids] if ids is not None else flat.new_empty(0) for r, ids in enumerate(token_ids)]
            logits_output.next_token_token_ids_logprobs_idx = [ids or [] for ids in token_ids]

    def commit_kv(self, aux_hidden: torch.Tensor, positions: torch.Tensor, cache_loc: torch.Tensor) -> None:
        self.draft_model.write_context_kv(aux_hidden, positions, cache_loc, self.draft_runner.token_to_kv_pool)


def _call_kind(batch) -> str:
    """prefill / idle / decode: which path `DFlashWorker.step` takes for ``batch``."""
    if batch.forward_mode.is_extend() or batch.is_extend_in_batch:
        return "prefill"
    if batch.forward_mode.is_idle() or batch.batch_size() == 0:
        return "idle"
    return "decode"


class _Block:
    """input_ids / positions / out_cache_loc, each [bs * block_size]."""

    __slots__ = ("input_ids", "positions", "out_cache_loc")

    def __init__(self, input_ids, positions, out_cache_loc):
        self.input_ids, self.positions, self.out_cache_loc = input_ids, positions, out_cache_loc


def _params_after(params: dict | None, drafts: list[int]) -> dict | None:
    """A request's custom params at the block position after ``drafts``: ``__req__`` (SGLang's Req, which history-
    dependent processors read) replaced by a shallow copy with the drafts appended to its output_ids."""
    if not drafts or not params or params.get("__req__") is None:
        return params
    req = copy.copy(params["__req__"])
    req.output_ids = copy.copy(req.output_ids)  # a list or an array('q'), as SGLang keeps it
    req.output_ids.extend(drafts)
    return {**params, "__req__": req}


def reads_output_history(batch) -> bool:
    """True when the verify logits of ``batch`` depend on its requests' output so far or their grammar states
    (what `DFlashWorker.accept` applies beyond the plain target logits, logit_bias aside)."""
    if batch.has_grammar or batch.sampling_info.has_custom_logit_processor:
        return True
    short, penalized = _short_and_penalized(batch.reqs)
    return bool(short or penalized)


def _short_and_penalized(reqs) -> tuple[list[int], list[int]]:
    """Indices of the requests still under their min_new_tokens, and of those with a penalty."""
    short = [i for i, r in enumerate(reqs) if r.sampling_params.min_new_tokens > len(r.output_ids)]
    penalized = [i for i, r in enumerate(reqs) if _has_penalty(r.sampling_params)]
    return short, penalized


def _has_penalty(sp) -> bool:
    """A request with a frequency, presence or repetition penalty (SGLang's neutral values: 0, 0, 1)."""
    return bool(sp.frequency_penalty) or bool(sp.presence_penalty) or sp.repetition_penalty != 1.0
