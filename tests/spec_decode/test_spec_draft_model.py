"""Speculative decoding with a draft model (spec_decode/draft_model.py): greedy output with a draft equals
mlx-lm's solo generation token for token (busy engines, staggered arrivals, chunked prefill, preemption,
prefix hits; plain and sliding-window targets), seeded sampling gives the tokens it gives without
speculation, and the pair is checked at load.

Drafts: the target's own weights (random_model with the same seed: every draft accepted), its first
layer only (some accepted), or an unrelated random model (almost all rejected)."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest
from test_spec_decode import GREEDY, busy_prompts
from utils import assert_no_leaks, assert_solo_greedy, make_model, run_staggered, run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.loaders.random_model import random_model
from pagedmlx.runner.model import UnsupportedModelError
from pagedmlx.sampling_params import SamplingParams

ARCH = {"llama": "llama-tiny", "qwen3": "qwen3-tiny", "gemma3-tiny": "gemma3-tiny"}


def draft_model(arch: str, kind: str):
    """"same": the target's weights; "first": its first layer; "other": unrelated weights."""
    model = random_model(ARCH.get(arch, arch), 7 if kind == "other" else 0)
    if kind == "first":
        model.model.layers = model.model.layers[:1]
    return model


def draft_spec(draft, k: int = 3, **kw) -> dict:
    return {"method": "draft_model", "model": draft, "num_speculative_tokens": k, "disable_by_batch_size": 64,
            "min_acceptance_rate": 0.0, **kw}


def engine_with(target, draft, k: int = 3, **config) -> LLMEngine:
    return LLMEngine(target, None, EngineConfig(block_size=4, speculative_config=draft_spec(draft, k), **config))


@pytest.mark.parametrize("arch,kind,merged", [("llama", "first", False), ("llama", "same", False),
                                              ("qwen3", "first", False), ("qwen3", "other", False),
                                              ("gemma3-tiny", "llama", False), ("llama", "same", True),
                                              ("qwen3", "first", True)])
def test_busy_engine_with_a_draft_model_equals_solo(arch, kind, merged):
    """Shared prefixes, prompts extending an earlier prompt by its answer (prefix hits on pages that
    speculative steps filled), a pool small enough to preempt, chunked prefill. merged: target and draft
    with their projections merged (layers/merged_linear.py, a GPU's default)."""
    target = random_model(ARCH[arch], 0) if merged else make_model(arch)  # merging changes the model object
    draft = random_model("llama-tiny", 0) if kind == "llama" else draft_model(arch, kind)
    prompts = busy_prompts(arch, seed=11)
    engine = engine_with(target, draft, num_blocks=64, max_num_batched_tokens=48, long_prefill_token_threshold=16,
                         max_num_seqs=16, merge_projections=merged)
    assert (engine.runner.merged_groups > 0) == merged and engine.draft_proposer.runner.merges == merged
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], target, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0
    if kind == "same":
        assert stats.num_accepted_tokens == stats.num_draft_tokens, stats
    if kind == "first":
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert_no_leaks(engine)


def test_the_target_draft_pair_shares_one_block_budget():
    """Sized from kv_cache_memory_gb, the pool holds fewer blocks with a draft (both models' bytes per
    block count), and the draft has a page per block of the target's."""
    target = make_model("llama")
    plain = LLMEngine(target, None, EngineConfig(block_size=4, kv_cache_memory_gb=0.01))
    paired = engine_with(target, draft_model("llama", "same"), kv_cache_memory_gb=0.01)
    n_plain, n_paired = plain.runner.num_blocks, paired.runner.num_blocks
    assert n_paired < n_plain and abs(n_paired * 2 - n_plain) <= 2  # the draft is as large as the target here
    assert paired.draft_proposer.runner.kv_pool.keys[0].shape[0] == n_paired


def test_seeded_sampling_with_a_draft_model_keeps_its_tokens():
    """Temperature 0.8, top_p 0.9: each seed's tokens equal its tokens without speculation; with the
    target's own weights as the draft, the draft samples with the target row's noise and so every
    draft is accepted."""
    target = make_model("llama")
    prompts = [[17, 42, 99, 7, 250], [3, 1, 4, 1, 5, 9, 2, 6]]
    results, stats = [], {}
    for kind in (None, "same", "first"):
        spec = draft_spec(draft_model("llama", kind)) if kind else None
        engine = LLMEngine(target, None, EngineConfig(block_size=4, num_blocks=128, speculative_config=spec))
        for s in range(12):
            engine.add_request(str(s), prompts[s % 2], SamplingParams(temperature=0.8, top_p=0.9, seed=s,
                                                                      max_tokens=10, ignore_eos=True))
        done = run_to_completion(engine)
        results.append([done[str(s)].token_ids for s in range(12)])
        stats[kind] = engine.scheduler.spec_decoding_stats
        assert_no_leaks(engine)
    assert results[0] == results[1] == results[2]
    assert stats["same"].num_accepted_tokens == stats["same"].num_draft_tokens > 0
    assert stats["first"].num_accepted_tokens < stats["first"].num_draft_tokens


def test_a_draft_model_with_a_window_or_another_vocabulary_is_refused():
    target = make_model("llama")
    with pytest.raises(UnsupportedModelError, match="full-attention layers only"):
        engine_with(target, random_model("gemma3-tiny", 0), num_blocks=32)
    with pytest.raises(ValueError, match=r"vocabulary \(384 tokens\) is smaller"):
        engine_with(target, random_model("llama-tiny-tied", 0), num_blocks=32)


def test_a_recurrent_target_speculates_with_a_draft_and_stays_exact(caplog):
    """A plain-attention draft on a hybrid target (more in test_spec_decode_state.py): its pages take a
    share of the target's KV budget, and the output stays mlx-lm's."""
    target = make_model("qwen3_5-tiny")
    prompt = [5, 6, 7, 8, 9, 10]
    with caplog.at_level(logging.INFO, logger="pagedmlx"):
        engine = engine_with(target, draft_model("llama", "same"), kv_cache_memory_gb=0.05)
    assert engine.drafter is not None and "recurrent-state layers" in caplog.text
    plain = LLMEngine(target, None, EngineConfig(block_size=4, kv_cache_memory_gb=0.05))
    assert engine.runner.num_blocks < plain.runner.num_blocks
    engine.add_request("0", prompt, GREEDY)
    assert_solo_greedy(run_to_completion(engine)["0"].token_ids, target, prompt, GREEDY.max_tokens)
    assert engine.scheduler.spec_decoding_stats.num_draft_tokens > 0


def test_the_draft_model_loads_from_a_name_and_through_llm():
    from pagedmlx.llm import LLM

    llm = LLM("random:llama-tiny", block_size=4, num_blocks=64,
              speculative_config={"model": "random:llama-tiny", "num_speculative_tokens": 2})
    out = llm.generate([{"prompt_token_ids": [1, 2, 3]}],
                       SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    assert_solo_greedy(out[0].outputs[0].token_ids, make_model("llama"), [1, 2, 3], 8)
    stats = llm.engine.core.scheduler.spec_decoding_stats
    assert stats.num_accepted_tokens == stats.num_draft_tokens > 0  # the same random weights


def test_the_draft_catches_up_by_count_not_from_the_start():
    """Each step the draft computes only what it has not: its catch-up after an accepted or rejected draft
    is a token or two, so over a request it computes about its tokens plus k - 1 drafts a step."""
    target = make_model("llama")
    engine = engine_with(target, draft_model("llama", "first"), k=3, num_blocks=64)
    runner = engine.draft_proposer.runner
    forward, computed = runner.forward, []

    def count(so, prev=None):
        computed.append(so.total_num_scheduled_tokens)
        return forward(so, prev)

    runner.forward = count
    prompt = list(range(3, 23))
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True))
    assert_solo_greedy(run_to_completion(engine)["0"].token_ids, target, prompt, 40)
    drafts = engine.scheduler.spec_decoding_stats.num_drafts
    assert sum(computed) <= len(prompt) + 40 + 2 * drafts, (sum(computed), drafts)


def test_a_long_catch_up_is_cut_to_the_step_budget():
    """Long prompts (a request that arrives or resumes after preemption) catch the draft up in pieces of at
    most max_num_batched_tokens a step, drafting nothing until the last; the tokens stay mlx-lm's."""
    target = make_model("llama")
    engine = engine_with(target, draft_model("llama", "same"), k=3, num_blocks=128, max_num_batched_tokens=24,
                         long_prefill_token_threshold=12)
    runner = engine.draft_proposer.runner
    forward, firsts = runner.forward, []

    def record(so, prev=None):
        if prev is None:  # a step's first draft forward: the catch-ups
            firsts.append(so.total_num_scheduled_tokens)
        return forward(so, prev)

    runner.forward = record
    prompts = [list(range(3, 3 + n)) for n in (70, 5, 41)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    done = run_to_completion(engine)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)].token_ids, target, p, 12, i)
    assert max(firsts) <= 24 and len(firsts) > len(prompts), firsts
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens == stats.num_draft_tokens
    assert_no_leaks(engine)


def test_drafts_stay_on_the_device_until_the_verifying_step_is_read_back():
    """The target's verifying step takes a draft model's drafts as placeholder rows from the proposer's
    array (no host sync between the draft forwards and the step); the engine reads them back with the
    step's tokens, and they are what the draft proposed. inline_drafts (tensor parallelism: every input
    on the host) puts the same values into input_ids. The tokens stay mlx-lm's."""
    target = make_model("llama")
    engine = engine_with(target, draft_model("llama", "first"), k=3, num_blocks=64)
    forward, seen = engine.runner.forward, []

    def record(so, prev=None):
        if so.num_draft_tokens:
            assert so.device_drafts is not None and prev is so.device_drafts
            rows = so.placeholder_rows.tolist()
            first = [r for r in range(so.total_num_scheduled_tokens) if r not in rows]
            assert len(rows) == sum(so.num_draft_tokens) and (so.input_ids[rows] == 0).all(), rows
            inlined = _with_own_input_ids(so)
            inlined.inline_drafts()
            drafts = np.asarray(prev)[so.placeholder_src]
            assert (inlined.input_ids[rows] == drafts).all() and not len(inlined.placeholder_rows)
            assert (inlined.input_ids[first] == so.input_ids[first]).all()
            seen.append(drafts.tolist())
        return forward(so, prev)

    engine.runner.forward = record
    prompt = list(range(3, 23))
    engine.add_request("0", prompt, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
    assert_solo_greedy(run_to_completion(engine)["0"].token_ids, target, prompt, 24)
    assert len(seen) == engine.scheduler.spec_decoding_stats.num_drafts > 2


def _with_own_input_ids(so):
    """A copy whose arrays can be changed without touching the step's."""
    return dataclasses.replace(so, input_ids=so.input_ids.copy())


def test_a_request_aborted_while_its_drafts_wait_on_the_device_leaves_nothing_behind():
    """Abort a speculating request between the step that proposed its drafts (still on the device) and the
    step that would verify them: its pages are freed, the others' tokens stay mlx-lm's, nothing leaks."""
    target = make_model("llama")
    engine = engine_with(target, draft_model("llama", "first"), k=3, num_blocks=64)
    prompts = {str(i): list(range(3 + i, 23 + i)) for i in range(3)}
    for rid, p in prompts.items():
        engine.add_request(rid, p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
    done, aborted = {}, False
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        pending = engine.scheduler.requests.get("1")
        if not aborted and pending is not None and pending.spec_token_ids:
            assert hasattr(pending.spec_token_ids, "src")  # drafts not read back yet
            engine.abort_request(["1"])
            aborted = True
    assert aborted
    assert "1" not in done or done["1"].finish_reason == "abort"
    for rid in ("0", "2"):
        assert_solo_greedy(done[rid].token_ids, target, prompts[rid], 20, rid)
    assert_no_leaks(engine)
