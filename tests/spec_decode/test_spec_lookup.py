"""A draft model that looks the context up too (speculative_config prompt_lookup with draft_model): where
the context repeats, the n-gram's draft (no draft forward) is taken when it promises more tokens a round
than the model's; greedy output stays mlx-lm's, token for token, with steps that verify both kinds of
drafts at once (host drafts beside device drafts); seeded sampling keeps its tokens.

Random-weight models do not repeat themselves: where a busy test needs lookups that are partly
accepted, the lookup is an oracle (test_spec_decode.Oracle) that knows mlx-lm's answer, spoils part of
it, and proposes nothing at times (the model drafts then)."""

from __future__ import annotations

import dataclasses
import pickle

import mlx.core as mx
import numpy as np
import pytest
from sched_utils import make_request
from test_spec_decode import GREEDY, Oracle, busy_prompts
from test_spec_draft_model import draft_model, draft_spec
from utils import (assert_no_leaks, assert_solo_greedy, make_model, run_staggered, run_to_completion,
                   shared_prefix_prompts, solo_greedy)

from pagedmlx.config import EngineConfig, SpeculativeConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.loaders.random_model import random_model
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.core.sched.output import SchedulerOutput
from pagedmlx.server.metrics import EngineSnapshot
from pagedmlx.spec_decode.drafter import PAUSE_TOKENS, Drafter

REPEATING = [1, 2, 3, 4, 5, 6, 1, 2, 3]  # its last 3 tokens occurred earlier: the n-gram drafts 4, 5, 6, 1


def test_prompt_lookup_is_on_for_a_draft_model_only_where_asked():
    def config(**kw):
        return SpeculativeConfig(**{"method": "draft_model", "model": "m", "num_speculative_tokens": 4, **kw})

    assert not config().prompt_lookup
    assert config(prompt_lookup_max=3).prompt_lookup and config(prompt_lookup_min=2).prompt_lookup
    assert (config(prompt_lookup=True).prompt_lookup
            and not config(prompt_lookup_max=3, prompt_lookup=False).prompt_lookup)
    assert SpeculativeConfig(method="ngram", num_speculative_tokens=2).prompt_lookup
    assert SpeculativeConfig.from_any(
        '{"model": "m", "num_speculative_tokens": 2, "prompt_lookup": true}').prompt_lookup
    kept = EngineConfig(speculative_config=config(prompt_lookup_max=3))
    assert pickle.loads(pickle.dumps(kept)).speculative_config.prompt_lookup  # to the engine process
    assert not dataclasses.replace(config(), num_speculative_tokens=2).prompt_lookup
    with pytest.raises(ValueError, match="prompt_lookup must be true or false, got 'yes'"):
        config(prompt_lookup="yes")
    with pytest.raises(ValueError, match="cannot be false with method 'ngram'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup=False)


class Recorder:
    """A costed proposer that records which requests it was asked for and drafts nothing."""

    def __init__(self):
        self.asked = 0

    def propose_batch(self, items):
        self.asked += len(items)
        return {}


def drafter_for(min_rate: float = 0.0, lookup: bool = True, cost: float = 0.25) -> tuple[Drafter, Recorder]:
    spec = SpeculativeConfig(method="draft_model", model="m", num_speculative_tokens=4, prompt_lookup_max=3,
                             prompt_lookup_min=2, min_acceptance_rate=min_rate, prompt_lookup=lookup)
    proposer = Recorder()
    return Drafter(spec, 1000, proposer, cost_ratio=cost), proposer


def caught_up(prompt=REPEATING):
    req = make_request("r", prompt, max_tokens=100)
    req.num_computed_tokens = req.num_tokens - 1
    return req


def extend(req, tokens) -> None:
    """The step kept these tokens (the request caught up again)."""
    for t in tokens:
        req.append_output_token(t)
    req.num_computed_tokens = req.num_tokens - 1


def test_the_lookup_is_taken_where_it_promises_more_than_the_model():
    """No history: a 4-token lookup (5 tokens a step expected) beats 4 drafts of a model at a quarter of a
    step each (5 / 2). Once the lookup's draft is rejected, the model drafts; the lookup's drafts it
    beat are scored against the tokens kept, so when the text follows them the lookup is taken again."""
    drafter, model = drafter_for()
    req = caught_up()
    assert drafter.propose_draft_token_ids([req]) == {"r": [4, 5, 6, 1]} and model.asked == 0
    extend(req, [9])  # the engine observes a draft after the step's tokens are appended
    drafter.observe(req, 4, 0)  # the lookup's draft: rejected at once
    assert drafter.propose_draft_token_ids([req]) == {} and model.asked == 1  # ... 3, 9: no match
    extend(req, [1, 2, 3, 4, 5])  # ... 9, 1, 2, 3, 4, 5: the lookup would draft 6, 1, 2, 3
    drafter.observe(req, 4, 4)
    assert drafter.propose_draft_token_ids([req]) == {} and model.asked == 2  # its estimate is still 0
    extend(req, [6, 1, 2, 3, 4])  # what the lookup proposed: counted for it, though the model drafted
    drafter.observe(req, 4, 4)
    assert drafter.propose_draft_token_ids([req]) == {"r": [5, 6, 1, 2]} and model.asked == 2
    assert drafter.num_lookup_drafts == 2
    no_lookup, model = drafter_for(lookup=False)
    assert no_lookup.lookup is None and no_lookup.propose_draft_token_ids([caught_up()]) == {} and model.asked == 1


def test_each_source_pauses_apart():
    """A paused model leaves the lookup drafting whatever its estimate; lookups rejected below
    min_acceptance_rate then pause the lookup too, and after its pause it is tried afresh."""
    drafter, model = drafter_for(min_rate=0.5)
    req = caught_up([1, 2, 3, 7, 8, 9, 10, 11, 12])  # no repeat: the model drafts
    for _ in range(4):
        drafter.propose_draft_token_ids([req])
        drafter.observe(req, 4, 0)
    assert drafter.paused(req) and model.asked >= 2
    asked = model.asked
    extend(req, [1, 2, 3])  # the context now repeats: the lookup drafts 7, 8, 9, 10 while the model is paused
    for _ in range(4):
        if drafter.paused(req, drafter._lookup_acceptance):
            break
        assert drafter.propose_draft_token_ids([req]) == {"r": [7, 8, 9, 10]}
        drafter.observe(req, 4, 0)
    assert drafter.paused(req, drafter._lookup_acceptance) and model.asked == asked
    assert drafter.propose_draft_token_ids([req]) == {}
    extend(req, [5] * (4 * PAUSE_TOKENS) + [1, 2, 3])  # both pauses over; the lookup tried afresh
    assert not drafter.paused(req, drafter._lookup_acceptance) and not drafter.paused(req)
    assert drafter.propose_draft_token_ids([req]) == {"r": [5, 5, 5, 5]}  # after the latest 1, 2, 3


def test_a_step_verifies_host_and_device_drafts_together():
    """resolve_drafts fills only the device drafts' places; the lookup's stay as the host gave them."""
    so = SchedulerOutput.empty(set(), [])
    so.draft_token_ids = np.asarray([4, 5, 0, 0, 0, 9], np.int32)
    so.device_drafts = mx.array([70, 71, 72, 73], mx.int32)
    so.draft_src, so.draft_pos = np.asarray([1, 3, 2], np.int32), np.asarray([2, 3, 4], np.int32)
    so.resolve_drafts()
    assert so.draft_token_ids.tolist() == [4, 5, 71, 73, 72, 9] and so.device_drafts is None
    # inline_drafts (tensor parallelism: every input token on the host) fills the device drafts' rows only
    so = SchedulerOutput.empty(set(), [])
    so.input_ids = np.asarray([1, 4, 5, 2, 0, 0, 0, 9], np.int32)
    so.draft_token_ids = np.asarray([4, 5, 0, 0, 0, 9], np.int32)
    so.device_drafts = mx.array([70, 71, 72, 73], mx.int32)
    so.placeholder_rows, so.placeholder_src = np.asarray([4, 5, 6], np.int32), np.asarray([1, 3, 2], np.int32)
    so.draft_src, so.draft_pos = np.asarray([1, 3, 2], np.int32), np.asarray([2, 3, 4], np.int32)
    so.inline_drafts()
    assert so.input_ids.tolist() == [1, 4, 5, 2, 71, 73, 72, 9] and not len(so.placeholder_rows)
    assert so.draft_token_ids.tolist() == [4, 5, 71, 73, 72, 9]


@pytest.mark.parametrize("arch,kind", [("llama", "first"), ("gemma3-tiny", "llama")])
def test_busy_engine_with_a_draft_model_and_lookups_equals_solo(arch, kind, monkeypatch):
    """Staggered arrivals, shared prefixes, prompts extending an earlier one by its answer (prefix hits),
    preemption, chunked prefill; the lookup an oracle that is sometimes wrong and sometimes silent. Steps
    verify the lookup's drafts and the model's together, and both are accepted at times."""
    target = make_model(arch)
    draft = random_model("llama-tiny", 0) if kind == "llama" else draft_model(arch, kind)
    prompts = busy_prompts(arch, seed=5)
    refs = {tuple(p): solo_greedy(target, p, GREEDY.max_tokens) for p in prompts}
    engine = LLMEngine(target, None, EngineConfig(
        block_size=4, num_blocks=64, max_num_batched_tokens=48, long_prefill_token_threshold=16, max_num_seqs=16,
        speculative_config=draft_spec(draft, 3, prompt_lookup_max=3)))
    engine.drafter.lookup.propose = Oracle(refs, engine.runner.vocab_size, k=3, wrong=0.3, seed=1)
    mixed, resolve = [], SchedulerOutput.resolve_drafts

    def recording(so):
        if so.device_drafts is not None and 0 < len(so.draft_pos) < len(so.draft_token_ids):
            mixed.append(so)
        resolve(so)

    monkeypatch.setattr(SchedulerOutput, "resolve_drafts", recording)
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], target, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < engine.drafter.num_lookup_drafts < stats.num_drafts, (engine.drafter.num_lookup_drafts, stats)
    assert EngineSnapshot.take(engine.core).spec_decode_num_lookup_drafts == engine.drafter.num_lookup_drafts
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens and mixed
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert_no_leaks(engine)


def test_seeded_sampling_with_lookups_keeps_its_tokens():
    """Temperature 0.8: each seed's tokens equal its tokens without speculation, with a draft model and a
    lookup (an oracle of those tokens, a third of them spoiled, silent at times) drafting in turn."""
    target = make_model("llama")
    prompts = [[17, 42, 99, 7, 250], [3, 1, 4, 1, 5, 9, 2, 6]]
    params = [SamplingParams(temperature=0.8, seed=s, max_tokens=12, ignore_eos=True) for s in range(8)]
    results = []
    for spec in (None, draft_spec(draft_model("llama", "first"), prompt_lookup_max=2)):
        engine = LLMEngine(target, None, EngineConfig(block_size=4, num_blocks=128, speculative_config=spec))
        if spec is not None:
            refs = {tuple(prompts[s % 2]) + (s,): results[0][s] for s in range(8)}
            oracle = Oracle(refs, engine.runner.vocab_size, k=3, wrong=0.3, seed=3)
            engine.drafter.lookup.propose = lambda req, room: oracle(_Keyed(req), room)
        for s in range(8):
            engine.add_request(str(s), prompts[s % 2], params[s])
        done = run_to_completion(engine)
        results.append([done[str(s)].token_ids for s in range(8)])
        assert_no_leaks(engine)
    assert results[0] == results[1]
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < engine.drafter.num_lookup_drafts < stats.num_drafts and stats.num_accepted_tokens > 0


class _Keyed:
    """A request as Oracle looks it up: its prompt with its seed (one answer per seed)."""

    def __init__(self, req):
        self.prompt_token_ids = list(req.prompt_token_ids) + [req.sampling_params.seed]
        self.num_output_tokens = req.num_output_tokens


def test_mtp_with_lookups_on_a_recurrent_target_equals_solo():
    """Qwen3.5 (recurrent state rolled back where drafts are rejected) with its MTP module and an oracle
    lookup, chunked prefill, preemption, prefix hits: every answer is mlx-lm's."""
    from test_spec_mtp import VOCAB, mtp_spec, random_mtp_weights
    from test_state_layers import state_engine

    target = make_model("qwen3_5-tiny")
    prompts = [[t % VOCAB for t in p] for p in shared_prefix_prompts(12, seed=6)]
    prompts += [[(5 * i + j) % VOCAB for j in range(90)] for i in range(2)]
    refs = {tuple(p): solo_greedy(target, p, GREEDY.max_tokens) for p in prompts}
    engine = state_engine(target, speculative_config={**mtp_spec(3, random_mtp_weights(target)), "prompt_lookup": True})
    engine.drafter.lookup.propose = Oracle(refs, VOCAB, k=3, wrong=0.3, seed=2)
    done = run_staggered(engine, prompts, GREEDY, seed=4)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], target, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < engine.drafter.num_lookup_drafts < stats.num_drafts and stats.num_accepted_tokens > 0
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert_no_leaks(engine)


@pytest.mark.slow
def test_smollm_quoting_with_a_draft_model_takes_the_lookup(smollm):
    """The real default model rewriting a passage, its first 10 layers as the draft (a poor draft): most
    drafts come from the lookup, are mostly accepted, and the answer is mlx-lm's, token for token."""
    from test_spec_decode import quoting_prompt

    model, tok = smollm
    prompt, want = quoting_prompt(model, tok)
    draft = type(model)(type(model.args).from_dict({**vars(model.args), "num_hidden_layers": 10}))
    params = model.parameters()
    params["model"]["layers"] = params["model"]["layers"][:10]
    draft.update(params)  # the target's arrays
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=256, speculative_config=spec))
    engine.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=40))
    assert run_to_completion(engine)["q"].token_ids == want
    stats = engine.scheduler.spec_decoding_stats
    assert engine.drafter.num_lookup_drafts > stats.num_drafts / 2 and stats.acceptance_rate > 0.5, stats


def test_the_engine_process_looks_up_beside_a_draft_model():
    """Through the engine core's own process (the config pickled, the draft loaded there): prompts that
    repeat themselves take lookups, the answers are mlx-lm's, and the snapshot /metrics reads counts them."""
    from test_spec_decode import run_in_engine_process

    config = EngineConfig(model="random:llama-tiny", block_size=8, num_blocks=64, max_model_len=256,
                          speculative_config='{"method": "draft_model", "model": "random:llama-tiny", '
                                             '"num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    prompts = [[(5 * i + j) % 7 + 1 for j in range(12)] * 2 for i in range(3)]
    outs, snap = run_in_engine_process(config, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    model = make_model("llama")
    for p, out in zip(prompts, outs):
        assert_solo_greedy(out.outputs[0].token_ids, model, p, 12)
    assert 0 < snap.spec_decode_num_lookup_drafts <= snap.spec_decode_num_drafts
