"""Reference engine: greedy DFlashLM == target greedy generate; exact accept lengths with "right" drafts;
sampled output has the target's distribution."""

from __future__ import annotations


import pytest
import torch

from conftest import (TAU_NEW_TOKENS, TAU_PROMPTS_PER_SET, TINY_MASK_ID, TINY_VOCAB, make_draft_config,
                      make_tiny_target)
from sglang_dflash import hf
from sglang_dflash.hf import DFlashLM, target_generate_baseline
from sglang_dflash.model import DFlashDraftModel, DraftKVCache, save_draft
from sglang_dflash.verify import target_probs


def _prompts(n: int = 9, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = [3, 7, 1, 12, 5, 9, 4, 15, 2][:n]
    return [torch.randint(3, TINY_MASK_ID, (n_,), generator=g).tolist() for n_ in lens]


def _hf_greedy(target, prompt: list[int], max_new_tokens: int, stops: list[int]) -> list[int]:
    """The target's own greedy decoding of one unpadded prompt, stopping at ``stops``."""
    ids = torch.tensor([prompt])
    out = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                          do_sample=False, eos_token_id=stops or None, pad_token_id=0)
    new = out[0, len(prompt):].tolist()
    for j, tok in enumerate(new):  # HF pads finished rows; keep up to (and incl.) the first stop
        if tok in stops:
            return new[: j + 1]
    return new


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def target(request):
    return make_tiny_target(request.param, seed=1)


@pytest.fixture(scope="module")
def references(target):
    """Unstopped greedy continuations (40 tokens) of every prompt."""
    return [_hf_greedy(target, p, 40, []) for p in _prompts()]


def _stops_inside(references) -> list[int]:
    """Two stop tokens that first occur at positions >= 3 of some continuation (i.e. inside a later block)."""
    stops = []
    for ref in references:
        for j in range(3, 20):
            if ref[j] not in ref[:j] and ref[j] not in stops:
                stops.append(ref[j])
                break
        if len(stops) == 2:
            break
    return stops


@pytest.fixture(scope="module")
def stopped(target, references):
    """(stops, HF greedy continuations of 24 tokens that stop at them)."""
    stops = _stops_inside(references)
    assert len(stops) == 2
    return stops, [_hf_greedy(target, p, 24, stops) for p in _prompts()]


@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_greedy_equals_target_generate(target, stopped, block_size):
    prompts = _prompts()
    draft = DFlashDraftModel(make_draft_config(target.config, block_size=block_size)).eval()
    lm = DFlashLM(target, draft)
    stops, expected = stopped
    out = lm.generate(prompts, max_new_tokens=24, stop_token_ids=stops)
    assert out.sequences == expected
    assert any(len(s) < 24 and s[-1] in stops for s in expected)  # some rows stop early ...
    assert any(len(s) == 24 for s in expected)  # ... others run to max_new_tokens
    assert out.num_verify_steps >= max(len(s) for s in expected) // block_size
    for log, seq in zip(out.accept_lens, out.sequences):
        assert all(0 <= a <= block_size - 1 for a in log)
        assert len(seq) <= 1 + sum(a + 1 for a in log)
    base = target_generate_baseline(target, prompts, max_new_tokens=24, stop_token_ids=stops)
    assert base.sequences == expected


class CyclingWidths:
    """A verify-width policy that cycles through ``widths`` (one per step) and records what it observed."""

    def __init__(self, widths):
        self.widths, self.i, self.observed = list(widths), 0, []

    def choose(self, bs):
        w = self.widths[self.i % len(self.widths)]
        self.i += 1
        return w

    def observe(self, bs, width, accept_lens, seconds):
        assert seconds > 0
        self.observed.append((bs, width, list(accept_lens)))


def test_greedy_equals_target_generate_at_changing_widths(target, stopped):
    """Widths 1 (plain decode steps), odd and full widths, changing every step: the greedy output is still the
    target's, and every step's accept lengths fit its width."""
    draft = DFlashDraftModel(make_draft_config(target.config, block_size=8)).eval()
    stops, expected = stopped
    widths = CyclingWidths([1, 8, 3, 1, 2, 5])
    out = DFlashLM(target, draft).generate(_prompts(), max_new_tokens=24, stop_token_ids=stops, widths=widths)
    assert out.sequences == expected
    assert {w for _, w, _ in widths.observed} == {1, 2, 3, 5, 8}
    assert all(0 <= a <= w - 1 for _, w, lens in widths.observed for a in lens)
    assert [bs for bs, _, _ in widths.observed] == [len(lens) for _, _, lens in widths.observed]


@pytest.mark.parametrize("max_new_tokens", [1, 2])
def test_tiny_max_new_tokens(target, references, max_new_tokens):
    draft = DFlashDraftModel(make_draft_config(target.config, block_size=8)).eval()
    out = DFlashLM(target, draft).generate(torch.tensor([p[:1] for p in _prompts()]), max_new_tokens, stop_token_ids=[])
    expected = [_hf_greedy(target, p[:1], max_new_tokens, []) for p in _prompts()]
    assert out.sequences == expected
    assert out.num_verify_steps == max_new_tokens - 1
    assert all(len(log) == max_new_tokens - 1 for log in out.accept_lens)


def test_default_stop_is_target_eos(target, references, monkeypatch):
    """stop_token_ids=None stops at generation_config.eos_token_id: the unstopped references cut after it."""
    eos = _stops_inside(references)[0]
    monkeypatch.setattr(target.generation_config, "eos_token_id", eos)
    draft = DFlashDraftModel(make_draft_config(target.config, block_size=4)).eval()
    out = DFlashLM(target, draft).generate(_prompts(), max_new_tokens=40)
    expected = [ref[: ref.index(eos) + 1] if eos in ref else ref for ref in references]
    assert any(len(e) < 40 for e in expected)
    assert out.sequences == expected


class RecordingDraft(DFlashDraftModel):
    """Records what the engine feeds the draft at every step."""

    def __init__(self, cfg):
        super().__init__(cfg)
        self.calls = []

    def forward(self, block_embeds, block_positions, ctx_kv, attn_mask=None, ctx_positions=None):
        self.calls.append((block_embeds.clone(), block_positions.clone(),
                           [(k.clone(), v.clone()) for k, v in ctx_kv], attn_mask.clone()))
        return super().forward(block_embeds, block_positions, ctx_kv, attn_mask, ctx_positions)


@pytest.mark.parametrize("cycle, flush_at, stop", [(None, 64, False), ([1, 1, 4, 1, 3, 1, 1, 1, 2], 64, False),
                                                   ([1] * 7 + [4], 3, False), ([1, 1, 4, 1, 3, 2], 64, True)])
def test_draft_sees_context_of_exactly_the_committed_tokens(target, stopped, cycle, flush_at, stop, monkeypatch):
    """Every draft step: the cached context K/V of each row == recomputed from scratch over its committed tokens
    (target hidden states after target_layer_ids, positions 0..n-1); block = [last token, MASK...] at n.. -- also
    when plain decode steps (width 1) left their tokens pending, when the pending tokens were written early
    (``CONTEXT_FLUSH_TOKENS`` lowered below a run of plain steps), and when rows stopped and left the batch with
    tokens pending."""
    monkeypatch.setattr(hf, "CONTEXT_FLUSH_TOKENS", flush_at)
    torch.manual_seed(0)
    draft = RecordingDraft(make_draft_config(target.config, block_size=4)).eval()
    prompts = _prompts()
    widths = cycle and CyclingWidths(cycle)
    appends = []
    append = DraftKVCache.append
    monkeypatch.setattr(DraftKVCache, "append", lambda self, kvs, keep: appends.append(1) or append(self, kvs, keep))
    stops, expected = stopped if stop else ([], None)
    out = DFlashLM(target, draft).generate(prompts, max_new_tokens=24 if stop else 12, stop_token_ids=stops,
                                           widths=widths)
    if stop:
        assert out.sequences == expected and len({len(s) for s in expected}) > 1
    drafted = [s for s, (_, w, _) in enumerate(widths.observed) if w > 1] if widths else range(out.num_verify_steps)
    assert len(draft.calls) == len(drafted) and (widths is None or len(drafted) < out.num_verify_steps)
    # one context write per draft step; with flush_at 3, also at plain steps 0 (the prompt), 3, 6 and 10
    assert len(appends) == len(drafted) + (4 if flush_at == 3 else 0)
    embed = target.get_input_embeddings()
    with torch.no_grad():
        for step, (embeds, positions, kvs, mask) in zip(drafted, draft.calls):
            active = [i for i in range(len(prompts)) if len(out.accept_lens[i]) > step]
            assert embeds.shape[0] == len(active)
            for r, i in enumerate(active):
                committed = 1 + sum(a + 1 for a in out.accept_lens[i][:step])
                full = prompts[i] + out.sequences[i]
                n = len(prompts[i]) + committed - 1
                assert positions[r].tolist() == list(range(n, n + 4))
                assert torch.equal(embeds[r], embed(torch.tensor([full[n]] + [TINY_MASK_ID] * 3)))
                ctx_len = kvs[0][0].shape[1]
                assert mask[r].tolist() == [[True] * n + [False] * (ctx_len - n) + [True] * 4] * 4
                hs = target(torch.tensor([full[:n]]), output_hidden_states=True).hidden_states
                feats = torch.cat([hs[j + 1] for j in draft.cfg.target_layer_ids], dim=-1)
                ref = draft.context_kv(draft.project_context(feats), torch.arange(n)[None])
                for (k, v), (rk, rv) in zip(kvs, ref):
                    torch.testing.assert_close(k[r, :n], rk[0], rtol=1e-4, atol=1e-5)
                    torch.testing.assert_close(v[r, :n], rv[0], rtol=1e-4, atol=1e-5)


# ------------------------------------------------------------------ "right" drafts: exact accept lengths

def test_constant_target_and_matching_draft_accept_everything():
    """Target with a zeroed final norm emits token 0 forever; a draft with a zeroed norm proposes 0 everywhere."""
    target = make_tiny_target("qwen3", seed=2)
    with torch.no_grad():
        target.model.norm.weight.zero_()
    draft = DFlashDraftModel(make_draft_config(target.config, block_size=8)).eval()
    with torch.no_grad():
        draft.norm.weight.zero_()
    prompts = _prompts(4)
    out = DFlashLM(target, draft).generate(prompts, max_new_tokens=13, stop_token_ids=[])
    assert out.sequences == [[0] * 13] * 4 == [_hf_greedy(target, p, 13, []) for p in prompts]
    # 1 (prefill) + 8 (all 7 drafts accepted + bonus) + 4 of the next 8 (truncated inside the block)
    assert out.accept_lens == [[7, 7]] * 4
    assert out.num_verify_steps == 2 and out.mean_accept_length == 8.0


PERM_A, PERM_B = 5, 3  # the permutation target maps token x -> (5x + 3) mod V


def _perm_next(x: int) -> int:
    return (PERM_A * x + PERM_B) % TINY_VOCAB


def _perm_prev(y: int) -> int:
    return ((y - PERM_B) * pow(PERM_A, -1, TINY_VOCAB)) % TINY_VOCAB


def make_permutation_target(family: str):
    """All attention/MLP outputs zeroed, so the hidden state is the current token's embedding; lm_head row
    ``next(x)`` is the normed embedding of x, so greedy decoding follows x -> (5x + 3) mod V."""
    target = make_tiny_target(family, seed=3)
    with torch.no_grad():
        target.model.embed_tokens.weight[0].normal_()  # the pad row starts at zero
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        normed = target.model.norm(target.model.embed_tokens.weight)
        target.lm_head.weight.copy_(normed[[_perm_prev(y) for y in range(TINY_VOCAB)]])
        logits = target.lm_head(normed)
    assert logits.argmax(-1).tolist() == [_perm_next(x) for x in range(TINY_VOCAB)]
    return target


def _is_bad(tok: int) -> bool:
    return tok % 7 == 0


class ChainDraft(DFlashDraftModel):
    """A draft that knows the permutation: at block index j it proposes next^j(last), except that a correct
    token t with t % 7 == 0 is replaced by t + 1 (a deliberate miss). Context handling is the real one."""

    def __init__(self, cfg, target):
        super().__init__(cfg)
        self.target_ref = (target,)  # a tuple: not registered as a submodule

    def forward(self, block_embeds, block_positions, ctx_kv, attn_mask=None, ctx_positions=None):
        target = self.target_ref[0]
        table = target.model.embed_tokens.weight
        b, q_len, _ = block_embeds.shape
        last = (block_embeds[:, 0, None, :] == table[None]).all(-1).float().argmax(-1).tolist()
        want = torch.zeros(b, q_len, dtype=torch.long)
        for i, tok in enumerate(last):
            for j in range(1, q_len):
                tok = _perm_next(tok)
                want[i, j] = (tok + 1) % TINY_VOCAB if _is_bad(tok) else tok
        # hidden whose lm_head argmax is `want`: the normed embedding of its predecessor
        prev = torch.tensor([[_perm_prev(int(t)) for t in row] for row in want])
        return target.model.norm(table[prev])


def _expected_run(ref: list[int], block_size: int, max_new_tokens: int, stops: list[int], widths=None):
    """Simulate the accept rule on a reference continuation (step k verifies ``widths[k % len]`` positions; default
    the whole block).

    Returns (tokens, accept_lens, accepted) where accepted[k] says token k was an accepted draft token
    followed by more committed tokens of the same step (so a stop there truncates inside the block).
    """
    out, accepts, accepted, last = ref[:1], [], [False], 0
    if out[-1] in stops or max_new_tokens == 1:
        return out, accepts, accepted
    while True:
        width = widths[len(accepts) % len(widths)] if widths else block_size
        acc = 0
        while acc < width - 1 and not _is_bad(ref[last + acc + 1]):
            acc += 1
        accepts.append(acc)
        new = ref[last + 1 : last + acc + 2][: max_new_tokens - len(out)]
        for j, tok in enumerate(new):
            out.append(tok)
            accepted.append(j < acc and j + 1 < len(new))
            if tok in stops:
                return out, accepts, accepted
        if len(out) == max_new_tokens:
            return out, accepts, accepted
        last += acc + 1


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_right_draft_exact_accept_lens(family, block_size):
    target = make_permutation_target(family)
    draft = ChainDraft(make_draft_config(target.config, block_size=block_size), target).eval()
    prompts = _prompts()
    refs = [[_perm_next(p[-1])] for p in prompts]
    for r in refs:
        while len(r) < 80:
            r.append(_perm_next(r[-1]))
    assert refs[0] == _hf_greedy(target, prompts[0], 80, [])
    # stop token: the first-occurring token of row 0 that is an accepted draft with more tokens after it in
    # its block (so generation must truncate inside an accepted span); plus 42 (0 mod 7: always a miss)
    row0, _, accepted0 = _expected_run(refs[0], block_size, 40, [])
    inside = [k for k in range(5, 40) if accepted0[k] and row0[k] not in row0[:k]]
    assert inside
    stops = [row0[inside[0]], 42]
    lm = DFlashLM(target, draft)
    out = lm.generate(prompts, max_new_tokens=40, stop_token_ids=stops)
    assert out.sequences[0][-1] == stops[0] and len(out.sequences[0]) == inside[0] + 1
    for i, p in enumerate(prompts):
        tokens, accepts, _ = _expected_run(refs[i], block_size, 40, stops)
        assert out.sequences[i] == tokens == _hf_greedy(target, p, 40, stops)
        assert out.accept_lens[i] == accepts
    assert any(len(s) == 40 for s in out.sequences)
    if block_size == 16:
        assert max(max(a) for a in out.accept_lens) == 15
    all_acc = [a for log in out.accept_lens for a in log]
    assert out.mean_accept_length == pytest.approx(sum(a + 1 for a in all_acc) / len(all_acc))
    assert out.mean_accept_length > 2.0 if block_size > 2 else out.mean_accept_length > 1.5


def test_right_draft_exact_accept_lens_at_changing_widths():
    """The known-permutation draft at widths cycling 16, 1, 5, 2: each step accepts exactly what its width lets
    through (the simulation), and the outputs are the target's."""
    target = make_permutation_target("qwen3")
    draft = ChainDraft(make_draft_config(target.config, block_size=16), target).eval()
    cycle = [16, 1, 5, 2]
    prompts = _prompts()
    out = DFlashLM(target, draft).generate(prompts, max_new_tokens=40, stop_token_ids=[42],
                                           widths=CyclingWidths(cycle))
    for i, p in enumerate(prompts):
        ref = [_perm_next(p[-1])]
        while len(ref) < 80:
            ref.append(_perm_next(ref[-1]))
        tokens, accepts, _ = _expected_run(ref, 16, 40, [42], widths=cycle)  # every row starts at step 0
        assert out.accept_lens[i] == accepts
        assert out.sequences[i] == tokens == _hf_greedy(target, p, 40, [42])
    lens = [a for log in out.accept_lens for a in log]
    assert 0 in lens and max(lens) > 4  # plain decode steps, and a whole-block step past width 5's cap


# ------------------------------------------------------------------ sampling

@pytest.mark.parametrize("widths", [None, [1, 3], [2, 1]])
def test_sampling_matches_target_distribution(widths):
    """Joint law of the first three sampled tokens (top_k=3 keeps it to 27 cells) == the target's, at the block
    size and with verify widths changing between steps (a plain decode step, then a verify, and the reverse)."""
    target = make_permutation_target("qwen3")
    draft = ChainDraft(make_draft_config(target.config, block_size=4), target).eval()
    prompt, n, temp = [11, 22, 33], 6000, 12.0
    params = dict(temperature=temp, top_k=3, top_p=1.0, min_p=0.0)
    out = DFlashLM(target, draft).generate([prompt] * n, max_new_tokens=3, stop_token_ids=[], seed=0, **params,
                                           widths=widths and CyclingWidths(widths))
    assert all(len(s) == 3 for s in out.sequences)
    assert sum(a > 0 for log in out.accept_lens for a in log) > n // 10  # drafts really get accepted

    def probs(prefix):
        logits = target(torch.tensor([prefix])).logits[:, -1]
        one = torch.ones(1)
        return target_probs(logits, one * temp, torch.tensor([3]), one, one * 0)[0]

    counts = {}
    for s in out.sequences:
        counts[tuple(s)] = counts.get(tuple(s), 0) + 1
    p0 = probs(prompt)
    total_p = 0.0
    with torch.no_grad():
        for t0 in p0.nonzero().flatten().tolist():
            p1 = probs(prompt + [t0])
            for t1 in p1.nonzero().flatten().tolist():
                p2 = probs(prompt + [t0, t1])
                for t2 in p2.nonzero().flatten().tolist():
                    p = float(p0[t0] * p1[t1] * p2[t2])
                    total_p += p
                    emp = counts.pop((t0, t1, t2), 0) / n
                    assert abs(emp - p) <= 5 * (p * (1 - p) / n) ** 0.5 + 1e-3, (t0, t1, t2, emp, p)
    assert counts == {} and total_p == pytest.approx(1.0, abs=1e-5)


def test_sampling_is_reproducible_with_seed(tiny_qwen3):
    draft = DFlashDraftModel(make_draft_config(tiny_qwen3.config, block_size=4)).eval()
    lm = DFlashLM(tiny_qwen3, draft)
    kw = dict(max_new_tokens=10, temperature=0.8, top_p=0.9, stop_token_ids=[], seed=7)
    a, b = lm.generate(_prompts(4), **kw), lm.generate(_prompts(4), **kw)
    assert a.sequences == b.sequences
    assert lm.generate(_prompts(4), **{**kw, "seed": 8}).sequences != a.sequences


# ------------------------------------------------------------------ API

def test_from_pretrained_and_stats(tmp_path, tiny_qwen3):
    tiny_qwen3.save_pretrained(tmp_path / "target")
    save_draft(DFlashDraftModel(make_draft_config(tiny_qwen3.config, block_size=4)), tmp_path / "draft")
    lm = DFlashLM.from_pretrained(str(tmp_path / "target"), str(tmp_path / "draft"), device="cpu",
                                  dtype=torch.float32)
    out = lm.generate([[5, 6, 7]], max_new_tokens=6, stop_token_ids=[])
    assert out.sequences == [_hf_greedy(tiny_qwen3, [5, 6, 7], 6, [])]
    assert out.num_new_tokens == 6 and out.tokens_per_s > 0 and 0 < out.ttft_s <= out.total_time_s
    assert out.num_verify_steps == len(out.accept_lens[0]) >= 2
    base = lm.target_generate_baseline([[5, 6, 7]], max_new_tokens=6, stop_token_ids=[])
    assert base.sequences == out.sequences and base.accept_lens == [] and base.num_verify_steps == 0


def test_bad_inputs(tiny_qwen3):
    draft = DFlashDraftModel(make_draft_config(tiny_qwen3.config, block_size=4))
    lm = DFlashLM(tiny_qwen3, draft)
    with pytest.raises(ValueError, match="every prompt needs >= 1 token"):
        lm.generate([[1, 2], []], 4)
    with pytest.raises(ValueError, match="max_new_tokens=0 must be >= 1"):
        lm.generate([[1, 2]], 0)
    with pytest.raises(ValueError, match=r"input_ids tensor must be \[batch, T\]"):
        lm.generate(torch.tensor([1, 2]), 4)
    with pytest.raises(ValueError, match="must be a list of token-id lists"):
        lm.generate([1, 2], 4)
    other = make_tiny_target("qwen3", hidden_size=64, head_dim=16)
    from sglang_dflash.config import DFlashConfigError

    with pytest.raises(DFlashConfigError, match="hidden size mismatch"):
        DFlashLM(other, draft)


# ------------------------------------------------------------------ real model

@pytest.fixture(scope="module")
def smollm2():
    """(target, prompts, stops, HF greedy references of 16 tokens) for SmolLM2-135M-Instruct in float32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sglang_dflash.assets import smollm2_path

    path = smollm2_path()
    target = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    questions = ["What is 2+2?", "Name a color.", "Write a haiku about rain.", "Who wrote Hamlet?",
                 "List three fruits.", "What is the capital of France?", "Explain gravity briefly.", "Say hi."]
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for q in questions]
    stops = [tok.eos_token_id]
    return target, prompts, stops, [_hf_greedy(target, p, 16, stops) for p in prompts]


@pytest.mark.real_model
@pytest.mark.parametrize("block_size", [2, 8, 16])
def test_smollm2_greedy_equals_target(smollm2, block_size):
    target, prompts, stops, expected = smollm2
    torch.manual_seed(0)
    draft = DFlashDraftModel(make_draft_config(target.config, num_hidden_layers=1, block_size=block_size,
                                               mask_token_id=16)).eval()
    out = DFlashLM(target, draft).generate(prompts, max_new_tokens=16, stop_token_ids=stops)
    assert out.sequences == expected


@pytest.fixture(scope="module")
def bundled_run(smollm2):
    """The committed drafter on held-out prompts: (DFlashOutput, target greedy sequences)."""
    from transformers import AutoTokenizer

    from sglang_dflash import data
    from sglang_dflash.assets import bundled_drafter_path, smollm2_path
    from sglang_dflash.model import load_draft

    target, _, stops, _ = smollm2
    tok = AutoTokenizer.from_pretrained(smollm2_path())
    texts = [t for name in data.EVAL_DATASETS for t in data.eval_prompts(name, TAU_PROMPTS_PER_SET)]
    prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"] for t in texts]
    lm = DFlashLM(target, load_draft(bundled_drafter_path(), dtype=torch.float32).eval())
    out = lm.generate(prompts, max_new_tokens=TAU_NEW_TOKENS, stop_token_ids=stops)
    base = lm.target_generate_baseline(prompts, max_new_tokens=TAU_NEW_TOKENS, stop_token_ids=stops)
    return out, base.sequences


@pytest.mark.real_model
def test_bundled_drafter_greedy_equals_target(bundled_run):
    out, expected = bundled_run
    assert out.sequences == expected
    assert sum(a > 0 for log in out.accept_lens for a in log) > 0  # the trained drafter does get tokens accepted


@pytest.mark.real_model
def test_bundled_drafter_accept_length(bundled_run):
    out, _ = bundled_run
    print(f"mean accept length {out.mean_accept_length:.3f} over {len(out.sequences)} prompts")
    assert out.mean_accept_length > 2.0, f"mean accept length {out.mean_accept_length:.2f}"
