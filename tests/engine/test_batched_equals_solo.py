"""A busy engine gives each request exactly what mlx-lm gives that prompt alone (greedy, float32)."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from utils import (ARCHS, Greedy, assert_no_leaks, assert_solo_greedy, greedy_mismatch, make_model, make_prompts,
                   run_staggered)

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.request import RequestStatus
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.mark.parametrize("arch_name,overlap", [(a, True) for a in ARCHS] + [("llama", False), ("llama", "early")])
def test_64_busy_requests_equal_solo(arch_name, overlap, monkeypatch):
    """overlap: async scheduling (step N+1 built while step N runs, decodes fed from the device).
    "early": also dispatched before step N is read back, as where CUDA kernels write the pages in
    place (here the pages are still scattered, so only the engine's ordering is under test)."""
    if overlap == "early":
        from pagedmlx.runner.model import ModelRunner

        monkeypatch.setattr(ModelRunner, "pages_in_place", property(lambda self: True))
    model = make_model(arch_name)
    vocab = ARCHS[arch_name]["vocab_size"]
    prompts = make_prompts(64, vocab, seed=7)
    # MLX's CUDA RoPE with per-row offsets fails to launch from rows x heads x head_dim / 2 >= 2,048 at
    # head_dim 8 (docs/benchmarks.md): the tied llama's steps stay under 64 rows
    budget = 48 if arch_name == "llama_tied" else 96
    config = EngineConfig(block_size=4, num_blocks=160, max_num_batched_tokens=budget,
                          long_prefill_token_threshold=48, max_num_seqs=32, async_scheduling=bool(overlap))
    engine = LLMEngine(model, None, config)
    done = run_staggered(engine, prompts, GREEDY, seed=3)

    # The run must really have exercised what it claims to.
    assert (engine.stats.num_overlapped > 0) == bool(overlap)
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.stats.hits > 0
    assert engine.kv_cache_manager.stats.preempted_hits > 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch_name", ["llama", "qwen3"])
def test_attention_shapes_padded_as_on_cuda_equal_solo(arch_name, monkeypatch):
    """CUDA's setting on the CPU: every prefill attention call padded to multiples of a quantum
    (query rows before and after a segment, keys after it; short segments' count, length and keys
    too; long segments of one padded shape in one call). Quantum 12, not a multiple of the 4-token
    pages, with prefix hits and chunks that start anywhere: the padding must keep each query at its
    own position."""
    from pagedmlx.runner import attention

    seen, shapes, padded, batched = [], set(), set(), []
    real = attention._prefill_attention

    def spy(q, k_pages, v_pages, md, *args):
        for g in md.prefill_groups:
            if isinstance(g.mask, str):  # long segments grouped by padded shape
                seen.extend(g.pads)
                shapes.add((g.num_queries, g.num_keys))
                batched.append(len(g.pads))
            else:
                padded.add(g.mask.shape)
        return real(q, k_pages, v_pages, md, *args)

    monkeypatch.setattr(attention, "_prefill_attention", spy)
    model = make_model(arch_name)
    prompts = make_prompts(48, ARCHS[arch_name]["vocab_size"], seed=5)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=160, max_num_batched_tokens=96,
                                                 long_prefill_token_threshold=40, max_num_seqs=16,
                                                 sdpa_quantum=12))
    assert engine.runner.sdpa_quantum == 12
    done = run_staggered(engine, prompts, GREEDY, seed=4)
    assert any(f > 0 for f, _ in seen) and any(b > 0 for _, b in seen)
    assert max(batched) > 1  # segments of one shape in one call
    assert all(q % 12 == 0 and k % 12 == 0 for q, k in shapes), shapes
    pow2 = lambda n: n & (n - 1) == 0  # noqa: E731
    assert padded and all(pow2(p) and pow2(L) and k % 12 == 0 for p, _, L, k in padded), padded
    assert engine.kv_cache_manager.stats.hits > 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    assert_no_leaks(engine)


def test_warm_up_runs_the_shapes_a_long_prompt_meets_beside_decodes(monkeypatch):
    """CUDA builds a cuDNN graph per attention shape; start-up runs the shapes of a long prompt
    prefilled in capped chunks beside running decodes (forced on the CPU, quantum 12): every
    causal call such a prompt then makes must be one of them, and the tokens stay mlx-lm's."""
    calls, real = [], mx.fast.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        if isinstance(kwargs.get("mask"), str):
            calls.append((q.shape, k.shape))
        return real(q, k, v, **kwargs)

    monkeypatch.setattr(mx.fast, "scaled_dot_product_attention", spy)
    model = make_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=64,
                                                 long_prefill_token_threshold=40, max_model_len=240,
                                                 sdpa_quantum=12, warm_up_attention=True,
                                                 enable_prefix_caching=False))
    rng = random.Random(8)
    short = [[rng.randrange(500) for _ in range(6)] for _ in range(3)]
    long = [rng.randrange(500) for _ in range(190)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    for i, p in enumerate(short):
        engine.add_request(f"s{i}", p, params)
    engine.step()  # warms up first, then prefills the short prompts
    warmed = set(calls)
    assert len(warmed) >= 8
    calls.clear()
    engine.add_request("long", long, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert len(calls) >= 4 * model.args.num_hidden_layers and set(calls) <= warmed, set(calls) - warmed
    for rid, p in [("long", long)] + [(f"s{i}", p) for i, p in enumerate(short)]:
        assert_solo_greedy(done[rid], model, p, 16, rid)
    assert_no_leaks(engine)


def test_a_failed_warm_up_is_logged_and_serving_goes_on(monkeypatch, caplog):
    model = make_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, sdpa_quantum=12,
                                                 warm_up_attention=True, long_prefill_token_threshold=40))
    calls = []

    def fail(chunk, max_keys):
        calls.append((chunk, max_keys))
        raise RuntimeError("out of memory")

    monkeypatch.setattr(engine.runner, "warm_up_attention", fail)
    prompt = list(range(1, 30))
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert calls == [(40, 64 * 4)]  # once for this thread, however many steps
    assert "building the prefill attention shapes failed" in caplog.text
    assert_solo_greedy(done["a"], model, prompt, 5)


def test_cached_blocks_hold_their_owners_kv():
    """mlx-lm issue 965: a stored prefix must hold the KV of the prompt that owns it, never another's."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedmlx.core.kv.block_hash import hash_request_blocks

    model = make_model("llama")
    rng = random.Random(5)
    uniques = [[rng.randrange(500) for _ in range(rng.randint(20, 40))] for _ in range(6)]
    # Later prompts share part of an earlier one, cut mid-block, then diverge.
    sharers = [u[: len(u) // 2 + 1] + [rng.randrange(500) for _ in range(10)] for u in uniques]
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=64))
    done = run_staggered(engine, uniques + sharers, SamplingParams(temperature=0, max_tokens=6, ignore_eos=True), 1)
    assert_no_leaks(engine)

    owners = {}
    for i, prompt in enumerate(uniques + sharers):
        tokens = prompt + done[str(i)]
        hashes = []
        hash_request_blocks(tokens, 4, hashes)
        for j, h in enumerate(hashes):
            owners[h] = tokens[: (j + 1) * 4]
    pool = engine.kv_cache_manager.block_pool
    cached = [b for b in pool.blocks if b.block_hash is not None]
    assert len(cached) > 20
    for block in cached:
        tokens = owners[block.block_hash]
        caches = make_prompt_cache(model)
        mx.eval(model(mx.array([tokens]), cache=caches))
        for layer, c in enumerate(caches):
            end = c.offset  # mlx-lm's buffer is longer than what it holds
            want_k = c.keys[0, :, end - 4:end, :].transpose(1, 0, 2)  # (4, n_kv, D)
            want_v = c.values[0, :, end - 4:end, :].transpose(1, 0, 2)
            got_k = engine.runner.kv_pool.keys[layer][block.block_id].transpose(1, 0, 2)
            got_v = engine.runner.kv_pool.values[layer][block.block_id].transpose(1, 0, 2)
            # rounding only: another prompt's KV is off by O(1)
            np.testing.assert_allclose(np.array(got_k), np.array(want_k), rtol=1e-4, atol=1e-4)
            np.testing.assert_allclose(np.array(got_v), np.array(want_v), rtol=1e-4, atol=1e-4)


def test_mixed_step_fresh_hit_partial_resumed_and_decodes():
    """mlx-lm issue 754: one step holding a fresh request, a full prefix hit, a partial-block hit,
    a resumed preempted request and plain decodes."""
    model = make_model("qwen3")
    rng = random.Random(11)
    base = [rng.randrange(448) for _ in range(24)]  # 6 full blocks of 4
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, max_num_batched_tokens=256))
    engine.add_request("warm", base, params)
    while engine.has_unfinished_requests():
        engine.step()

    prompts = {
        "dec1": [rng.randrange(448) for _ in range(9)],
        "dec2": [rng.randrange(448) for _ in range(5)],
        "victim": [rng.randrange(448) for _ in range(13)],
    }
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    engine.step()
    engine.step()  # all three decoding now
    victim = engine.scheduler.requests["victim"]
    engine.scheduler._preempt(victim)  # as if pages had run out
    prompts.update({
        "fresh": [rng.randrange(448) for _ in range(7)],
        "full_hit": list(base),
        "partial_hit": base[:10] + [rng.randrange(448) for _ in range(5)],
    })
    for rid in ("fresh", "full_hit", "partial_hit"):
        engine.add_request(rid, prompts[rid], params)

    so = engine.scheduler.schedule()
    assert set(so.req_ids) == {"dec1", "dec2", "victim", "fresh", "full_hit", "partial_hit"}
    reqs = engine.scheduler.requests
    assert reqs["full_hit"].num_cached_tokens == 20  # never the whole prompt: the last block is recomputed
    assert reqs["partial_hit"].num_cached_tokens == 8
    assert victim.num_preemptions == 1 and engine.kv_cache_manager.stats.preempted_hits > 0
    # Put the step back and let the engine run it for real.
    for i, rid in enumerate(so.req_ids):
        reqs[rid].num_computed_tokens -= so.num_scheduled_tokens[i]
    engine.kv_cache_manager.stats.preempted_hits = 0
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    for rid, p in prompts.items():
        assert_solo_greedy(done[rid], model, p, 8, rid)
    assert_no_leaks(engine)


def test_abort_mid_run_frees_everything():
    model = make_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=32))
    rng = random.Random(2)
    for i in range(12):
        engine.add_request(str(i), [rng.randrange(500) for _ in range(rng.randint(5, 50))],
                           SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        engine.step()
    outs = engine.abort_request([str(i) for i in range(0, 12, 2)])
    assert {o.request_id for o in outs} == {str(i) for i in range(0, 12, 2)}
    assert all(o.finished and o.finish_reason == "abort" for o in outs)
    finished = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert set(finished) == {str(i) for i in range(1, 12, 2)}
    assert all(len(o.token_ids) == 30 and o.finish_reason == "length" for o in finished.values())
    assert_no_leaks(engine)


def test_failed_step_fails_only_its_requests_and_uncaches(monkeypatch):
    model = make_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64))
    prompt = list(range(1, 30))
    engine.add_request("a", prompt, GREEDY)
    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")]
    assert "boom" in outs[0].error
    assert_no_leaks(engine)
    assert not engine.kv_cache_manager.block_pool.cached_block_hash_to_block  # garbage never shared
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    engine.add_request("b", prompt, GREEDY)
    out = []
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    assert_solo_greedy(out[0].token_ids, model, prompt, GREEDY.max_tokens)
    assert engine.kv_cache_manager.stats.hits == 0


def test_a_failed_step_that_leaves_the_pages_unreadable_does_not_stop_the_engine(caplog):
    """Where MLX scatters the pages, a step whose graph fails can leave an array in the pools' lists that
    fails whenever it is read (here a tracer that a broken trace leaked). The step's requests fail; the runner
    then zeroes the pages (ModelRunner.repair_pages), so later requests get mlx-lm's tokens, not the error."""
    model = make_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64, compile_decode=False))
    prompt = list(range(1, 30))
    engine.add_request("a", prompt, GREEDY)
    engine.step()
    keys, leaked = engine.runner.kv_pool.keys, []
    mx.compile(lambda x: leaked.append(x * 1) or x)(mx.zeros(keys[0].shape, keys[0].dtype))
    keys[0] = leaked[0]
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [(o.request_id, o.finish_reason) for o in done] == [("a", "error")] and "KV pages were lost" in caplog.text
    assert_no_leaks(engine)
    engine.add_request("b", prompt, GREEDY)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert_solo_greedy(done[0].token_ids, model, prompt, GREEDY.max_tokens)


def test_a_step_that_fails_to_dispatch_fails_only_its_requests(monkeypatch):
    """mx.async_eval itself can raise (MLX encodes the graph there): an error output, no crash."""
    import pagedmlx.engine.core as engine_module

    engine = LLMEngine(make_model("llama"), None, EngineConfig(block_size=4, num_blocks=64))
    real = engine_module.mx.async_eval
    calls = []

    def failing_once(*arrays):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("encode failed")
        return real(*arrays)

    monkeypatch.setattr(engine_module.mx, "async_eval", failing_once)
    engine.add_request("a", [1, 2, 3], GREEDY)
    outs = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", "error")] and "encode failed" in outs[0].error
    assert_no_leaks(engine)
    engine.add_request("b", [1, 2, 3], GREEDY)
    done = []
    while engine.has_unfinished_requests():
        done += [o for o in engine.step() if o.finished]
    assert [o.finish_reason for o in done] == ["length"] and len(done[0].token_ids) == GREEDY.max_tokens


def test_request_status_finish_reasons():
    assert RequestStatus.FINISHED_LENGTH.finish_reason == "length"
    assert not RequestStatus.PREEMPTED.finished


def test_reused_request_id_never_gets_the_old_requests_token():
    """An id aborted while its step is still on the device, then reused at once: the new request
    must not receive the old one's in-flight token."""
    model = make_model("llama")
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=128, async_scheduling=True))
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    for i in range(5):
        engine.add_request(f"o{i}", [3 + i, 9, 4, 7], params)
    engine.add_request("x", [11, 12, 13, 14, 15], params)
    for _ in range(3):
        engine.step()
    assert engine._inflight is not None and "x" in engine._inflight.so.req_ids
    engine.abort_request(["x"])
    prompt = [21, 22, 23, 24, 25, 26]
    engine.add_request("x", prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    assert_solo_greedy(done["x"], model, prompt, 8)
    assert_no_leaks(engine)


def test_nan_sampling_values_are_refused():
    for field in ("temperature", "top_p", "min_p", "presence_penalty"):
        with pytest.raises(ValueError, match=field):
            SamplingParams(**{field: float("nan")})


def test_greedy_comparison_forgives_only_a_near_tie_and_goes_on_after_it():
    """utils.greedy_mismatch: a token may differ from the reference's only where it is the runner-up within the
    gap; the reference then goes on from it. Here the reference continues a prompt by its last token + 1, the
    runner-up + 2, led by 1e-4 after token 5 and by 1.0 elsewhere."""
    def reference(prompt: list[int], max_tokens: int) -> Greedy:
        out, last = Greedy(), prompt[-1]
        for _ in range(max_tokens):
            out.tokens.append(last + 1)
            out.runner_up.append(last + 2)
            out.lead.append(1e-4 if last == 5 else 1.0)
            last += 1
        return out

    def why(got, prompt=(4,)):
        return greedy_mismatch(got, list(prompt), 4, reference)

    assert why([5, 6, 7, 8]) is None
    assert why([5, 7, 8, 9]) is None  # the runner-up at the near tie, then the reference from there
    assert "token 3 is 10" in why([5, 7, 8, 10])  # a fault after the near tie still fails
    assert "token 1 is 8" in why([5, 8, 9, 10])  # not the runner-up
    assert "token 0 is 2" in why([2, 3, 4, 5], prompt=[0])  # the runner-up, but 1.0 behind
    assert why([5, 6]) and why([5, 6, 7, 8, 9])  # too few tokens, too many
