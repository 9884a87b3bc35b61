"""Reference DFlash engine for Hugging Face targets (Qwen3 / Llama families), torch + transformers only.

Per request row, with ``B = block_size``:

1. target prefill (``output_hidden_states``) -> first token + context features of the prompt;
2. each step: block ``[last token, MASK x (B-1)]`` at positions ``seq_lens .. seq_lens+B-1`` -> one draft
   forward over the context KV cache -> draft tokens ``d_1..d_{B-1}`` = argmax of the target lm_head on
   block positions 1..B-1 -> the target verifies ``[last, d_1..d_{B-1}]`` in one forward over its KV cache ->
   ``accept`` (sglang_dflash.verify) -> committed tokens ``d_1..d_{accept_len}, bonus`` -> the target cache
   keeps ``accept_len + 1`` of the block's slots; the target features of those tokens wait in `_PendingContext`
   until the draft next runs (or ``CONTEXT_FLUSH_TOKENS`` of them are pending), when their context K/V is
   appended to the draft cache in one projection -- so a width-1 step (plain decode) costs the target's forward.

Ragged batches: prompts are left padded; the target's 2D attention mask marks valid cache slots (rejected
block slots of a row become masked holes, the cache is cropped to the longest row), position ids are per row.
Finished rows (stop token / max_new_tokens) are dropped from the batch.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

import torch
import torch.nn.functional as F
from transformers import DynamicCache

from .config import MAX_BLOCK_SIZE, MIN_BLOCK_SIZE
from .model import DFlashDraftModel, DraftKVCache, draft_logits, load_draft
from .policy import WidthPolicy
from .verify import accept, draw, greedy_predictions, sample_predictions, target_probs

Prompts = Union[Sequence[Sequence[int]], torch.Tensor]

# pending committed tokens (per row, rejected slots included) at which their draft context K/V is written anyway
CONTEXT_FLUSH_TOKENS = 64


@dataclass
class DFlashOutput:
    """Generated tokens and statistics.

    ``sequences[i]``: new tokens of row i (stop token included, like HF ``generate``).
    ``accept_lens[i]``: accepted draft tokens per verify step of row i (0..B-1; empty for the baseline).
    ``committed[i]``: tokens row i's output gained per verify step (``accept_len + 1`` cut at max_new_tokens / the
    first stop: z-lab's per-step acceptance length).
    ``mean_accept_length``: tau = mean over (row, step) of ``accept_len + 1`` (tokens committed per verify step
    incl. the bonus, before max_new_tokens/stop truncation); 0.0 when no verify step ran. z-lab's per-request
    figure: ``sglang_dflash.eval.tau_per_request(committed)``.
    """

    sequences: list[list[int]]
    accept_lens: list[list[int]] = field(default_factory=list)
    committed: list[list[int]] = field(default_factory=list)
    num_verify_steps: int = 0
    mean_accept_length: float = 0.0
    ttft_s: float = 0.0
    total_time_s: float = 0.0

    @property
    def num_new_tokens(self) -> int:
        return sum(len(s) for s in self.sequences)

    @property
    def tokens_per_s(self) -> float:
        return self.num_new_tokens / self.total_time_s if self.total_time_s > 0 else 0.0


# ---------------------------------------------------------------- shared helpers

def _as_prompts(input_ids: Prompts) -> list[list[int]]:
    if isinstance(input_ids, torch.Tensor):
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids tensor must be [batch, T], got shape {tuple(input_ids.shape)}; "
                             "use input_ids[None] for a single prompt.")
        prompts = input_ids.tolist()
    else:
        if not isinstance(input_ids, (list, tuple)) or not all(
            isinstance(p, (list, tuple, torch.Tensor)) for p in input_ids
        ):
            raise ValueError("input_ids must be a list of token-id lists (one per prompt) or a [batch, T] tensor.")
        prompts = [[int(t) for t in p] for p in input_ids]
    if not prompts or any(len(p) == 0 for p in prompts):
        raise ValueError("input_ids must hold at least one prompt and every prompt needs >= 1 token.")
    return prompts


def _stop_set(target, stop_token_ids: Optional[Sequence[int]]) -> set[int]:
    """``stop_token_ids`` if given (``[]`` disables stopping), else the target's eos_token_id(s)."""
    if stop_token_ids is not None:
        return {int(t) for t in stop_token_ids}
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(target.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(eos)} if isinstance(eos, int) else {int(t) for t in eos}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _Sampler:
    """Per-row sampling parameters of the active rows; greedy when temperature == 0."""

    def __init__(self, b: int, device, temperature: float, top_p: float, top_k: int, min_p: float,
                 seed: Optional[int]):
        if temperature < 0 or not 0 < top_p <= 1 or not 0 <= min_p <= 1:
            raise ValueError(f"bad sampling parameters temperature={temperature}, top_p={top_p}, min_p={min_p}; "
                             "need temperature >= 0, 0 < top_p <= 1, 0 <= min_p <= 1.")
        self.greedy = temperature == 0
        self.temperature = torch.full((b,), float(temperature), device=device)
        self.top_p = torch.full((b,), float(top_p), device=device)
        self.top_k = torch.full((b,), int(top_k), device=device, dtype=torch.long)
        self.min_p = torch.full((b,), float(min_p), device=device)
        self.generator = None if seed is None else torch.Generator(device=device).manual_seed(int(seed))

    def select(self, rows: torch.Tensor) -> None:
        self.temperature, self.top_p = self.temperature[rows], self.top_p[rows]
        self.top_k, self.min_p = self.top_k[rows], self.min_p[rows]

    def next_tokens(self, logits: torch.Tensor) -> torch.Tensor:
        """Last-position logits ``[b, V]`` -> next tokens ``[b]`` (argmax, or sampled from target_probs)."""
        if self.greedy:
            return logits.argmax(-1)
        probs = target_probs(logits[:, None], self.temperature, self.top_k, self.top_p, self.min_p)
        placeholder = torch.zeros(probs.shape[:2], dtype=torch.long, device=probs.device)  # B=1: nothing to verify
        return sample_predictions(placeholder, probs, generator=self.generator)[:, 0]

    def drafts(self, logits: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """Draft logits ``[b, n, V]`` -> draft tokens ``[b, n]`` and the law they were drawn from: greedy, the
        argmax (None); sampling, a draw from the draft's law under the request's own parameters (``[b, n, V]``),
        which the verify accepts with ``min(1, p / q)`` -- more often than the argmax's ``p(argmax q)``."""
        if self.greedy:
            return logits.argmax(-1), None
        q = target_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)
        return draw(q, self.generator), q

    def target_tokens(self, block: torch.Tensor, logits: torch.Tensor,
                      draft_probs: Optional[torch.Tensor] = None) -> torch.Tensor:
        """block ``[b, B]`` (verify rows), logits ``[b, B, V]``, the drafts' law ``[b, B-1, V]`` from `drafts`
        -> target_tokens ``[b, B]``."""
        if self.greedy:
            return greedy_predictions(logits)
        probs = target_probs(logits, self.temperature, self.top_k, self.top_p, self.min_p)
        return sample_predictions(block, probs, generator=self.generator, draft_probs=draft_probs)


class _Batch:
    """Left-padded target state shared by the DFlash engine and the baseline.

    ``valid [b, S]`` bool marks real target-cache slots; ``seq_lens [b]`` = tokens in the target cache per row
    (= position of the next token); ``rows`` maps batch rows to request indices.
    """

    def __init__(self, target, prompts: list[list[int]], max_new_tokens: int, stops: set[int]):
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 1.")
        layer_types = getattr(target.config, "layer_types", None) or []
        if "sliding_attention" in layer_types:
            raise ValueError("the HF reference engine crops a DynamicCache and supports full-attention targets "
                             "only; disable sliding-window attention in the target config.")
        self.target = target
        self.device = target.device
        self.max_new_tokens = max_new_tokens
        self.stops = stops
        b, t = len(prompts), max(len(p) for p in prompts)
        self.prompt_lens = torch.tensor([len(p) for p in prompts], device=self.device)
        pad = getattr(target.config, "pad_token_id", None) or 0
        ids = torch.full((b, t), pad, dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, t - len(p):] = torch.tensor(p)
        self.prompt_ids = ids.to(self.device)
        self.valid = torch.zeros((b, 0), dtype=torch.bool, device=self.device)
        self.seq_lens = self.prompt_lens.clone()
        self.rows = torch.arange(b, device=self.device)
        self.outputs: list[list[int]] = [[] for _ in range(b)]
        self.cache = DynamicCache(config=target.config)

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, hidden: bool, logits_to_keep: int = 0,
                new_valid: Optional[torch.Tensor] = None):
        """Run the target on ``ids [b, n]`` at ``positions [b, n]``, appending n cache slots (``new_valid [b, n]``,
        default all valid)."""
        if new_valid is None:
            new_valid = self.valid.new_ones(ids.shape)
        self.valid = torch.cat((self.valid, new_valid), dim=1)
        return self.target(
            input_ids=ids, position_ids=positions, attention_mask=self.valid.long(), past_key_values=self.cache,
            use_cache=True, output_hidden_states=hidden, logits_to_keep=logits_to_keep,
        )

    def prefill(self, hidden: bool):
        t = self.prompt_ids.shape[1]
        positions = torch.arange(t, device=self.device)[None, :] - (t - self.prompt_lens)[:, None]
        return self.forward(self.prompt_ids, positions.clamp(min=0), hidden, logits_to_keep=1,
                            new_valid=positions >= 0)

    def keep_slots(self, n_keep: torch.Tensor, n_block: int) -> None:
        """After appending n_block slots, keep the first ``n_keep[i]`` of them for row i (crop to the longest)."""
        s = self.valid.shape[1] - n_block
        m = int(n_keep.max())
        self.cache.crop(s + m)
        self.valid = self.valid[:, : s + m].clone()
        self.valid[:, s:] = torch.arange(m, device=self.device)[None, :] < n_keep[:, None]
        self.seq_lens = self.seq_lens + n_keep

    def commit(self, tokens: list[list[int]]) -> torch.Tensor:
        """Append each active row's new tokens, truncated at max_new_tokens / first stop token.

        Returns the bool ``[b]`` mask of rows still running. Only the new tokens are scanned.
        """
        running = []
        for row, new in zip(self.rows.tolist(), tokens):
            out = self.outputs[row]
            new = new[: self.max_new_tokens - len(out)]
            stop_at = next((j for j, tok in enumerate(new) if tok in self.stops), None)
            if stop_at is not None:
                new = new[: stop_at + 1]
            out.extend(new)
            running.append(stop_at is None and len(out) < self.max_new_tokens)
        return torch.tensor(running, device=self.device, dtype=torch.bool)

    def select(self, keep: torch.Tensor) -> torch.Tensor:
        """Drop finished rows; returns the kept batch indices."""
        idx = keep.nonzero().squeeze(1)
        self.cache.batch_select_indices(idx)
        self.valid, self.seq_lens, self.rows = self.valid[idx], self.seq_lens[idx], self.rows[idx]
        return idx


class _PendingContext:
    """Target features of committed tokens whose draft context K/V is not in the draft cache yet, as chunks
    ``(feats [b, n, n_ids*H], positions [b, n], keep [b, n] bool)`` in commit order."""

    def __init__(self):
        self.chunks: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []

    @property
    def tokens(self) -> int:
        """Chunk columns held (per row, rejected slots included)."""
        return sum(keep.shape[1] for _, _, keep in self.chunks)

    def add(self, feats: torch.Tensor, positions: torch.Tensor, n_keep: torch.Tensor) -> None:
        """The first ``n_keep[i]`` of row i's n tokens are committed."""
        keep = torch.arange(feats.shape[1], device=feats.device)[None, :] < n_keep[:, None]
        self.chunks.append((feats, positions, keep))

    def select(self, rows: torch.Tensor) -> None:
        self.chunks = [(f[rows], p[rows], k[rows]) for f, p, k in self.chunks]

    def flush(self, draft: DFlashDraftModel, cache: DraftKVCache) -> None:
        """Project every pending token at once and append its context K/V to ``cache``."""
        if not self.chunks:
            return
        feats, positions, keep = (torch.cat(x, dim=1) for x in zip(*self.chunks))
        cache.append(draft.context_kv(draft.project_context(feats), positions), keep)
        self.chunks = []


# ---------------------------------------------------------------- engine

class DFlashLM:
    """DFlash speculative decoding of an HF causal LM with a DFlash draft (reference, batch of ragged prompts)."""

    def __init__(self, target_model, draft_model: DFlashDraftModel, block_size: Optional[int] = None):
        draft_model.cfg.validate_target(target_model.config)
        self.target = target_model.eval()
        self.draft = draft_model.eval()
        self.block_size = int(block_size if block_size is not None else draft_model.cfg.block_size)
        if not MIN_BLOCK_SIZE <= self.block_size <= MAX_BLOCK_SIZE:
            raise ValueError(f"block_size={self.block_size} must be in [{MIN_BLOCK_SIZE}, {MAX_BLOCK_SIZE}].")
        self.mask_token_id = draft_model.cfg.mask_token_id
        self.layer_ids = list(draft_model.cfg.target_layer_ids)
        self.embed = target_model.get_input_embeddings()
        self.lm_head = target_model.get_output_embeddings()

    @classmethod
    def from_pretrained(cls, target_path: str, draft_path: str, device="cpu", dtype: Optional[torch.dtype] = None,
                        block_size: Optional[int] = None) -> "DFlashLM":
        """Load an HF target (AutoModelForCausalLM) and a z-lab format draft; dtype None -> the target's dtype."""
        from transformers import AutoModelForCausalLM

        target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype or "auto").to(device).eval()
        draft = load_draft(draft_path, device=device, dtype=dtype or target.dtype)
        return cls(target, draft, block_size=block_size)

    def _context_features(self, hidden_states: Sequence[torch.Tensor]) -> torch.Tensor:
        """HF hidden states tuple -> concat of outputs of ``target_layer_ids`` ``[b, n, len(ids)*H]``."""
        return torch.cat([hidden_states[i + 1] for i in self.layer_ids], dim=-1)

    @torch.no_grad()
    def generate(
        self,
        input_ids: Prompts,
        max_new_tokens: int,
        temperature: float = 0.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        stop_token_ids: Optional[Sequence[int]] = None,
        seed: Optional[int] = None,
        widths: Optional[WidthPolicy] = None,
    ) -> DFlashOutput:
        """Generate up to ``max_new_tokens`` per prompt; greedy output equals the target's own greedy decoding.

        input_ids: list of token-id lists (ragged) or a ``[b, T]`` tensor. stop_token_ids None -> target eos.
        widths: the verify width per step (`sglang_dflash.policy`, fed with each step's wall time); None: every
        step verifies the whole block. A width-1 step is a plain decode step (no draft forward).
        """
        prompts = _as_prompts(input_ids)
        batch = _Batch(self.target, prompts, max_new_tokens, _stop_set(self.target, stop_token_ids))
        device, bsz, B = batch.device, len(prompts), self.block_size
        sampler = _Sampler(bsz, device, temperature, top_p, top_k, min_p, seed)
        accept_log: list[list[int]] = [[] for _ in prompts]
        committed_log: list[list[int]] = [[] for _ in prompts]
        steps = 0
        _sync(device)
        start = time.perf_counter()

        # prefill: first token + prompt context features (right-aligned into the draft cache, slot j = position j)
        out = batch.prefill(hidden=True)
        first = sampler.next_tokens(out.logits[:, -1])
        t = batch.prompt_ids.shape[1]
        dcache = DraftKVCache.for_model(self.draft, bsz, max_len=t + max_new_tokens + B)
        idx = (torch.arange(t, device=device)[None, :] + (t - batch.prompt_lens)[:, None]).clamp(max=t - 1)
        feats = self._context_features(out.hidden_states)
        feats = torch.gather(feats, 1, idx[..., None].expand(-1, -1, feats.shape[-1]))
        pending = _PendingContext()
        pending.add(feats, torch.arange(t, device=device)[None, :].expand(bsz, t), batch.prompt_lens)
        running = batch.commit([[tok] for tok in first.tolist()])
        _sync(device)
        ttft = time.perf_counter() - start
        last = first

        offsets = torch.arange(B, device=device)
        while bool(running.any()):
            if not bool(running.all()):
                idx = batch.select(running)
                dcache.select(idx)
                pending.select(idx)
                sampler.select(idx)
                last = last[idx]
            w = B if widths is None else widths.choose(last.shape[0])
            step_start = time.perf_counter()  # a draft step pays for the context it writes
            if w > 1 or pending.tokens >= CONTEXT_FLUSH_TOKENS:
                pending.flush(self.draft, dcache)
            # draft: one forward over the block, its proposals for the w - 1 verified positions
            block = torch.full((last.shape[0], B), self.mask_token_id, dtype=torch.long, device=device)
            block[:, 0] = last
            positions = batch.seq_lens[:, None] + offsets
            q = None
            if w > 1:
                kvs, mask = dcache.views(B)
                hidden = self.draft(F.embedding(block, self.embed.weight), positions, kvs, mask)
                logits = self.lm_head(hidden[:, 1:w].to(self.lm_head.weight.dtype))
                block[:, 1:w], q = sampler.drafts(draft_logits(self.draft.cfg, logits))
            block, positions = block[:, :w], positions[:, :w]
            # verify: one target forward over the first w block positions
            out = batch.forward(block, positions, hidden=True)
            target_tokens = sampler.target_tokens(block, out.logits, q)
            accept_lens, bonus = accept(block, target_tokens)
            n_keep = accept_lens + 1
            batch.keep_slots(n_keep, w)
            pending.add(self._context_features(out.hidden_states), positions, n_keep)
            steps += 1
            if widths is not None:
                widths.observe(last.shape[0], w, accept_lens.tolist(), time.perf_counter() - step_start)
            committed = target_tokens.tolist()  # d_1..d_acc == target_tokens[:acc]; bonus = target_tokens[acc]
            keep_list = n_keep.tolist()
            rows = batch.rows.tolist()
            before = [len(batch.outputs[row]) for row in rows]
            running = batch.commit([c[:n] for c, n in zip(committed, keep_list)])
            for row, n, had in zip(rows, keep_list, before):
                accept_log[row].append(n - 1)
                committed_log[row].append(len(batch.outputs[row]) - had)
            last = bonus

        _sync(device)
        total = time.perf_counter() - start
        n_steps = sum(len(a) for a in accept_log)
        tau = sum(a + 1 for log in accept_log for a in log) / n_steps if n_steps else 0.0
        return DFlashOutput(sequences=batch.outputs, accept_lens=accept_log, committed=committed_log,
                            num_verify_steps=steps,
                            mean_accept_length=tau, ttft_s=ttft, total_time_s=total)

    def target_generate_baseline(self, input_ids: Prompts, max_new_tokens: int, **kwargs) -> DFlashOutput:
        """Plain target decoding with the same batching/timing (see :func:`target_generate_baseline`)."""
        return target_generate_baseline(self.target, input_ids, max_new_tokens, **kwargs)


@torch.no_grad()
def target_generate_baseline(
    target_model,
    input_ids: Prompts,
    max_new_tokens: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    top_k: int = 0,
    min_p: float = 0.0,
    stop_token_ids: Optional[Sequence[int]] = None,
    seed: Optional[int] = None,
) -> DFlashOutput:
    """One token per target forward (no speculation), same padding, stop rule, sampling rule and timing."""
    prompts = _as_prompts(input_ids)
    batch = _Batch(target_model, prompts, max_new_tokens, _stop_set(target_model, stop_token_ids))
    device = batch.device
    sampler = _Sampler(len(prompts), device, temperature, top_p, top_k, min_p, seed)
    _sync(device)
    start = time.perf_counter()
    out = batch.prefill(hidden=False)
    last = sampler.next_tokens(out.logits[:, -1])
    running = batch.commit([[tok] for tok in last.tolist()])
    _sync(device)
    ttft = time.perf_counter() - start
    while bool(running.any()):
        if not bool(running.all()):
            idx = batch.select(running)
            sampler.select(idx)
            last = last[idx]
        ids = last[:, None]
        out = batch.forward(ids, batch.seq_lens[:, None], hidden=False)
        batch.seq_lens = batch.seq_lens + 1
        last = sampler.next_tokens(out.logits[:, -1])
        running = batch.commit([[tok] for tok in last.tolist()])
    _sync(device)
    return DFlashOutput(sequences=batch.outputs, ttft_s=ttft, total_time_s=time.perf_counter() - start)
