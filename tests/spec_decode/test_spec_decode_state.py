"""Speculative decoding on targets with recurrent-state layers: a step that verifies drafts
writes each state to the request's spare slot; all accepted, the slots swap; a rejection keeps the
state from before the step and the next step computes the accepted tokens again (core/kv/state_manager.py).
Greedy output equals mlx-lm's solo generation, and the engine's without speculation, token for token:
busy engines of every recurrent arch, drafts always wrong, always right and partly right, the n-gram
proposer, a draft model, preemption, checkpoint hits over several turns, steps that overlap (async
scheduling) between speculating ones, seeded sampling. Tiny random float32 models, pages of 4 tokens.

Random-weight models seldom repeat themselves, so drafts that are partly accepted come from an oracle
(mlx-lm's answer, partly spoiled: test_spec_decode.Oracle), from the n-gram proposer on a model whose
output head favours 8 tokens (its output repeats), or from a draft made of the target's own attention
layers on a target whose recurrent layers are quiet (their output scaled down; they still decide
tokens: without rollback that test fails)."""

from __future__ import annotations

import functools
import random

import mlx.core as mx
import pytest
from sched_utils import FakeModel, check_invariants, make_request, make_scheduler
from test_spec_decode import Oracle, as_decode_rows, spec
from test_state_layers import BS, INTERVAL, STATE_ARCHS, expected_hit, has_pages, state_engine
from utils import (assert_no_leaks, assert_solo_greedy, make_model, run_staggered, run_to_completion,
                   shared_prefix_prompts, solo_greedy)

from pagedmlx.engine.core_info import kv_pool_line
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.core.kv.state_manager import StateManager
from pagedmlx.loaders.random_model import random_model
from pagedmlx.runner.model import UnsupportedModelError
from pagedmlx.runner.state import StateMetadata
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.spec_decode.drafter import Drafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
VOCAB = 512  # every recurrent tiny arch's


def spec_engine(model, propose=None, k: int = 4, **config) -> LLMEngine:
    """test_state_layers' engine (chunked prefill with decodes, a pool small enough to preempt, a
    checkpoint every 8 tokens) with speculation at any batch size; propose: the n-gram proposer's stand-in."""
    config.setdefault("speculative_config", spec(k, disable_by_batch_size=64, min_acceptance_rate=0.0))
    engine = state_engine(model, **config)
    if propose is not None:
        engine.drafter.proposer.propose = propose
    return engine


def plain_engine_tokens(model, prompts, params, **config) -> dict[str, list[int]]:
    """The same staggered run without speculation."""
    return run_staggered(state_engine(model, **config), prompts, params, seed=2)


def rolled_back(engine) -> int:
    return engine.kv_cache_manager.state_manager.num_rollbacks


@functools.lru_cache(maxsize=None)
def few_token_model(n: int = 8):
    """qwen3_5-tiny whose output head favours tokens 0..n-1 (their rows scaled up, the rest down): its
    greedy output repeats itself, so the n-gram proposer's drafts are sometimes right."""
    model = random_model("qwen3_5-tiny", 0)
    head = model.language_model.lm_head
    head.weight = head.weight * mx.where(mx.arange(head.weight.shape[0])[:, None] < n, 3.0, 0.01)
    mx.eval(model.parameters())
    return model


@functools.lru_cache(maxsize=None)
def quiet_target(scale: float = 0.003):
    """qwen3_5-tiny whose Gated DeltaNet layers (their attention output and MLP) are scaled down: close
    enough to its attention layers alone for a draft of those to be right at times."""
    model = random_model("qwen3_5-tiny", 0)
    for layer in model.language_model.model.layers:
        if layer.is_linear:
            layer.linear_attn.out_proj.weight = layer.linear_attn.out_proj.weight * scale
            layer.mlp.down_proj.weight = layer.mlp.down_proj.weight * scale
    mx.eval(model.parameters())
    return model


def attention_only_draft():
    """qwen3_5-tiny's full-attention layers only (the same weights): a plain-attention model."""
    model = random_model("qwen3_5-tiny", 0)
    text = model.language_model.model
    text.layers = [layer for layer in text.layers if not layer.is_linear]
    text.ssm_idx, text.fa_idx = None, 0
    return model


def draft_spec(draft, k: int = 3) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "disable_by_batch_size": 64,
            "min_acceptance_rate": 0.0}


@pytest.mark.parametrize("arch,decode_rows", [(a, False) for a in STATE_ARCHS] + [("qwen3_5-tiny", True)])
def test_busy_engine_with_drafts_equals_solo(arch, decode_rows, monkeypatch):
    """Staggered arrivals, shared prefixes (checkpoint hits), chunked prefill beside verifying steps,
    preemption; drafts partly right: every verifying step either swaps slots or rolls back. Chunks of
    one length (verifying steps) run in the state layers as one batch (runner/state.py's StateBatch).
    decode_rows: the attention layers take short segments' tokens as decode rows (test_spec_decode's
    as_decode_rows) while the state layers take them as segments."""
    model = make_model(arch)
    prompts = shared_prefix_prompts(16, seed=5)
    refs = {tuple(p): solo_greedy(model, p, GREEDY.max_tokens) for p in prompts}
    engine = spec_engine(model, Oracle(refs, VOCAB))
    rows_steps = as_decode_rows(monkeypatch) if decode_rows else []
    batched = []
    build = StateMetadata.build.__func__

    def count(cls, so):
        md = build(cls, so)
        batched.append(len(md.batches))
        return md

    monkeypatch.setattr(StateMetadata, "build", classmethod(count))
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    assert not decode_rows or any(r is not None for r in rows_steps)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} ({len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert 0 < rolled_back(engine) < stats.num_drafts and any(batched)
    if has_pages(engine):  # mamba2 holds slots only: nothing to preempt, no pages to hit
        assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("right", [False, True])
def test_drafts_always_wrong_or_always_right_equal_no_speculation(right):
    """Four drafts a step, all wrong (every step rolls back) or all right (none does; slots swap), for
    several requests at once: each one's tokens equal mlx-lm's and the engine's without speculation."""
    model = make_model("qwen3_5-tiny")
    prompts = shared_prefix_prompts(6, seed=7)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    refs = {tuple(p): solo_greedy(model, p, 20) for p in prompts}

    def propose(req, room):
        draft = refs[tuple(req.prompt_token_ids)][req.num_output_tokens:][:min(4, room)]
        return draft if right else [(t + 1) % VOCAB for t in draft]

    engine = spec_engine(model, propose, num_blocks=200)
    done = run_staggered(engine, prompts, params, seed=2)
    plain = plain_engine_tokens(model, prompts, params, num_blocks=200)
    for i, p in enumerate(prompts):
        for got in (done[str(i)], plain[str(i)]):
            assert_solo_greedy(got, model, p, 20, i)
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_drafts > len(prompts)
    if right:
        assert stats.num_accepted_tokens == stats.num_draft_tokens and rolled_back(engine) == 0
        assert engine.stats.num_steps < sum(map(len, refs.values())) / 2
    else:
        assert stats.num_accepted_tokens == 0 and rolled_back(engine) == stats.num_drafts
    assert_no_leaks(engine)


def test_ngram_drafts_are_partly_accepted_and_exact():
    """Prompts that repeat themselves and a model whose output repeats: the n-gram proposer's drafts are
    accepted at some positions and rejected at others; output equals mlx-lm's and no speculation's."""
    model = few_token_model()
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 9))] * rng.randint(2, 4) for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = spec_engine(model, num_blocks=200, speculative_config=spec(prompt_lookup_min=1, disable_by_batch_size=64,
                                                                        min_acceptance_rate=0.0))
    done = run_staggered(engine, prompts, params, seed=1)
    plain = plain_engine_tokens(model, prompts, params, num_blocks=200)
    for i, p in enumerate(prompts):
        for got in (done[str(i)], plain[str(i)]):
            assert_solo_greedy(got, model, p, 40, i)
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert stats.num_accepted_tokens_per_pos[1] > 0  # some steps accepted two drafts and rolled back the third
    assert rolled_back(engine) > 0
    assert_no_leaks(engine)


def test_a_draft_model_on_a_hybrid_target_equals_solo():
    """A plain-attention draft (its pages in the target's full-attention group) on a Gated DeltaNet
    target: some drafts accepted, some rejected; preemption and checkpoint hits; exact."""
    target = quiet_target()
    prompts = shared_prefix_prompts(12, seed=5)
    engine = spec_engine(target, speculative_config=draft_spec(attention_only_draft()))
    assert engine.draft_proposer.manager is engine.kv_cache_manager.managers[0]
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], target, p, GREEDY.max_tokens, f"request {i} ({len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert rolled_back(engine) > 0
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert_no_leaks(engine)


def test_drafts_that_need_state_of_their_own_are_refused():
    """A draft with recurrent layers, or a draft model on a target without full-attention layers (a
    state-only model: no pages for the draft's), is refused naming the reason."""
    with pytest.raises(UnsupportedModelError, match="full-attention layers only"):
        spec_engine(make_model("llama"), speculative_config=draft_spec(random_model("qwen3_5-tiny", 1)))
    with pytest.raises(UnsupportedModelError, match="needs a target with full-attention layers"):
        spec_engine(make_model("mamba2-tiny"), speculative_config=draft_spec(random_model("llama-tiny", 0)))


@pytest.mark.parametrize("overlap", [None, True])
def test_multi_turn_with_drafts_resumes_from_checkpoints(overlap):
    """Three conversations, three turns: each turn resumes from the checkpoint the previous turns left,
    and equals mlx-lm, while drafts are partly rejected (a checkpoint of a draft's state would give the
    next turn other tokens). overlap: async scheduling, whose steps do not overlap while requests speculate."""
    model = make_model("qwen3_5-tiny")
    rng = random.Random(4)
    history = {c: [rng.randrange(1, 500) for _ in range(rng.randint(5, 30))] for c in range(3)}
    refs: dict = {}
    oracle = Oracle(refs, VOCAB, wrong=0.4)
    engine = spec_engine(model, oracle, num_blocks=400, async_scheduling=overlap)
    saved = {c: set() for c in history}
    for turn in range(3):
        refs.update({tuple(p): solo_greedy(model, p, GREEDY.max_tokens) for p in history.values()})
        for c, prompt in history.items():
            engine.add_request(f"{c}.{turn}", prompt, GREEDY)
        done = run_to_completion(engine)
        for c, prompt in history.items():
            out = done[f"{c}.{turn}"]
            assert_solo_greedy(out.token_ids, model, prompt, GREEDY.max_tokens, f"conversation {c}, turn {turn}")
            if turn:
                assert out.num_cached_tokens == expected_hit(saved[c], len(prompt) - 1) > 0
            computed = len(prompt) + len(out.token_ids) - 1
            last_full = (len(prompt) - 1) // BS * BS
            saved[c] |= set(range(INTERVAL, computed + 1, INTERVAL)) | ({last_full} - {0})
            history[c] = prompt + out.token_ids + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]
    assert rolled_back(engine) > 0 and engine.kv_cache_manager.state_manager.num_checkpoint_hits > 0
    assert_no_leaks(engine)


def test_preempted_speculating_request_resumes_from_its_checkpoint():
    """test_state_layers' preemption case with drafts: the newest request is preempted (its spare slot
    freed with its slot) and resumes from the last checkpoint its cached pages cover."""
    model = make_model("qwen3_5-tiny")
    rng = random.Random(8)
    prompts = {"old": [rng.randrange(1, 500) for _ in range(30)], "new": [rng.randrange(1, 500) for _ in range(40)]}
    lengths = {"old": 40, "new": 16}
    refs = {tuple(p): solo_greedy(model, p, lengths[rid]) for rid, p in prompts.items()}
    engine = spec_engine(model, Oracle(refs, VOCAB), num_blocks=24, long_prefill_token_threshold=INTERVAL)
    engine.add_request("old", prompts["old"], SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    engine.step()
    engine.add_request("new", prompts["new"], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    done = run_to_completion(engine)
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.preempted_hits > 0
    for rid, p in prompts.items():
        assert_solo_greedy(done[rid].token_ids, model, p, lengths[rid], rid)
    assert engine.scheduler.spec_decoding_stats.num_drafts > 0 and rolled_back(engine) > 0
    assert_no_leaks(engine)


def test_overlapped_and_speculating_steps_alternate_exactly():
    """disable_by_batch_size 3, async scheduling: while more run, steps overlap (a state written by
    step N is read by step N+1 before N is read back); as requests finish the rest speculate."""
    model = make_model("qwen3_5-tiny")
    prompts = shared_prefix_prompts(8, seed=4)
    lengths = [4 + 3 * i for i in range(len(prompts))]
    refs = {tuple(p): solo_greedy(model, p, n) for p, n in zip(prompts, lengths)}
    engine = spec_engine(model, Oracle(refs, VOCAB, wrong=0.3), num_blocks=200, async_scheduling=True,
                         speculative_config=spec(4, disable_by_batch_size=3, min_acceptance_rate=0.0))
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    done = run_to_completion(engine)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert_solo_greedy(done[str(i)].token_ids, model, p, n, i)
    assert engine.stats.num_overlapped > 0 and rolled_back(engine) > 0
    assert_no_leaks(engine)


def test_seeded_samples_with_drafts_equal_those_without():
    """Temperature 0.8, top_k 2, seeded: drafts from the greedy answers, partly accepted; each seed's
    tokens equal its tokens without speculation."""
    model = make_model("qwen3_5-tiny")
    prompts = shared_prefix_prompts(6, seed=9)
    refs = {tuple(p): solo_greedy(model, p, 12) for p in prompts}
    outs = []
    for speculate in (False, True):
        engine = (spec_engine(model, Oracle(refs, VOCAB, wrong=0.0), num_blocks=200) if speculate
                  else state_engine(model, num_blocks=200))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, SamplingParams(temperature=0.8, top_k=2, seed=i, max_tokens=12,
                                                                   ignore_eos=True))
        outs.append({rid: o.token_ids for rid, o in run_to_completion(engine).items()})
    assert outs[0] == outs[1]
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and rolled_back(engine) > 0


def test_a_verifying_step_writes_a_spare_slot_that_replaces_the_slot_if_all_drafts_are_accepted():
    """The pool keeps a spare for each request that may speculate at once; a verifying step takes one
    and writes its request's state there; all drafts accepted, the spare becomes the slot, else the
    slot stays (the step rolls back to its start); either way the other block goes back."""
    model = make_model("qwen3_5-tiny")
    engine = spec_engine(model, num_blocks=60, speculative_config=spec(disable_by_batch_size=5))
    state: StateManager = engine.kv_cache_manager.state_manager
    assert state.block_pool.num_blocks == 12 + 5 + 12 and state.max_spares == 5
    assert "(12 running + 5 spare + 12 checkpoints)" in kv_pool_line(engine.core)
    prompt = list(range(10, 20))
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    engine.step()  # the prompt
    req, ref = engine.scheduler.requests["a"], solo_greedy(model, prompt, 8)
    for right in (True, False):
        n, (slot,) = req.num_output_tokens, state.req_to_block_ids["a"]
        engine.scheduler.update_draft_token_ids({"a": ref[n:n + 2] if right else [(ref[n] + 1) % VOCAB, ref[n + 1]]})
        so = engine.scheduler.schedule()
        spare = state.spares["a"].block_id
        assert so.state_slots[0, :2].tolist() == [slot, spare]
        start = req.num_computed_tokens - 3
        engine.scheduler.update_from_output(so, [ref[n:n + 3] if right else [ref[n]]])
        assert state.req_to_block_ids["a"] == [spare if right else slot] and not state.spares
        assert req.num_computed_tokens == (start + 3 if right else start)
        assert state.block_pool.blocks[slot if right else spare].ref_cnt == 0


def test_drafts_wait_for_a_spare_slot():
    """Spares for one request only (fewer than speculate here): the others' drafts are dropped in a step
    whose spare is taken; output stays exact."""
    model = make_model("qwen3_5-tiny")
    prompts = shared_prefix_prompts(4, seed=6)
    refs = {tuple(p): solo_greedy(model, p, GREEDY.max_tokens) for p in prompts}
    engine = spec_engine(model, Oracle(refs, VOCAB, wrong=0.2), num_blocks=200)
    state = engine.kv_cache_manager.state_manager
    state.max_spares = 1
    verifying = []
    forward = engine.runner.forward

    def watch(so, prev=None):
        verifying.append(sum(1 for k in so.num_draft_tokens if k))
        return forward(so, prev)

    engine.runner.forward = watch
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, GREEDY)
    done = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)].token_ids, model, p, GREEDY.max_tokens, i)
    assert max(verifying) == 1 and engine.scheduler.spec_decoding_stats.num_drafts > len(prompts)
    assert_no_leaks(engine)


class VerifyingFakeModel(FakeModel):
    """sched_utils' fake model (each state slot holds the tokens it consumed, drafts included), which
    accepts a random number of each request's drafts; random drafts are proposed after each step."""

    def __init__(self, sched, seed: int):
        super().__init__(sched, seed=seed)
        self.drafter = Drafter(sched.config.speculative_config, sched.max_model_len, proposer=self)
        self.finished: list[list[int]] = []  # each finished request's tokens

    def propose(self, req, room: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(min(self.rng.randint(0, 3), room))]

    def sample(self, out):
        drafts = out.scheduled_spec_decode_tokens
        return [drafts[rid][:self.rng.randint(0, len(drafts[rid]))] + [self.rng.randrange(1, self.vocab)]
                if rid in drafts else self.rng.randrange(1, self.vocab) for rid in out.sampled_req_ids]

    def step(self, tokens=None):
        out, updates = super().step(tokens)
        self.finished += [list(u.request.all_token_ids) for u in updates if u.finished]
        self.sched.update_draft_token_ids(self.drafter.propose_draft_token_ids(self.sched.running))
        return out, updates


@pytest.mark.parametrize("seed", range(10))
def test_every_state_read_is_the_requests_own_prefix_with_random_drafts(seed):
    """Scheduler and managers alone (sched_utils.FakeModel): shared prefixes, chunked prefill, small
    pools (preemption), a checkpoint every block; drafts of 0-3 random tokens, a random number of them
    accepted; later turns extend a finished request by more tokens (they resume from checkpoints its
    verifying steps saved). Every state a step reads (slot or checkpoint) holds exactly the request's
    tokens before it, no slot is written by two requests, and the page accounting holds after every step."""
    rng = random.Random(seed)
    sched = make_scheduler(num_blocks=rng.choice([14, 20, 64]), max_num_seqs=4, max_num_batched_tokens=16,
                           long_prefill_token_threshold=8, max_model_len=80, state_interval=4,
                           speculative_config=spec(3, disable_by_batch_size=4, min_acceptance_rate=0.0))
    model = VerifyingFakeModel(sched, seed)
    shared = [rng.randrange(1, 50) for _ in range(20)]
    pending = [shared[:rng.randint(0, 20)] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 12))]
               for _ in range(10)]
    turns = 10
    for n in range(2000):
        if model.finished and turns and rng.random() < 0.3:
            turns -= 1
            history = model.finished.pop(rng.randrange(len(model.finished)))
            pending.append(history[:36] + [rng.randrange(1, 50) for _ in range(rng.randint(1, 4))])
        if pending and rng.random() < 0.3:
            sched.add_request(make_request(f"{n}", pending.pop(), max_tokens=rng.randint(1, 15)))
        if not pending and not sched.has_unfinished_requests() and not (model.finished and turns):
            break
        model.step()
        check_invariants(sched)
    assert not pending and not sched.has_unfinished_requests()
    state, stats = sched.kv_cache_manager.state_manager, sched.spec_decoding_stats
    assert 0 < state.num_rollbacks < stats.num_drafts and stats.num_accepted_tokens > 0
    assert state.num_checkpoint_hits > 0
