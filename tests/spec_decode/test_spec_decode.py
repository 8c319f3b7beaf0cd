"""Speculative decoding through the engine: greedy output with drafts equals mlx-lm's solo generation
token for token (busy engines, staggered arrivals, chunked prefill, preemption, prefix hits; plain and
sliding-window models), stops never overshoot, seeded sampling keeps its distribution and its tokens,
the adaptive rules hold, and the engine-core process speculates too.

Random-weight models do not repeat themselves, so the n-gram proposer's drafts for them are almost
always rejected (tested below: proposed, rejected, paused). Where a test needs drafts that are partly
accepted it uses an oracle proposer: it knows mlx-lm's answer and spoils part of it (the engine treats
drafts alike whoever proposes them). SmolLM2 (slow) shows the n-gram proposer accepting on real text."""

from __future__ import annotations

import asyncio
import logging
import random

import mlx.core as mx
import numpy as np
import pytest
from utils import (ARCHS, CHI2_P1E4, assert_no_leaks, assert_solo_greedy, chi_square, make_model, run_staggered,
                   run_to_completion, shared_prefix_prompts, solo_greedy)

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.runner import attention, attention_metadata
from pagedmlx.runner.model import ModelRunner
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True)
VOCAB = {**{a: c["vocab_size"] for a, c in ARCHS.items()}, "gemma3-tiny": 512}


def spec(k: int = 4, **kw) -> dict:
    return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4, "prompt_lookup_min": 2, **kw}


class Oracle:
    """Drafts from mlx-lm's answer (`refs`, by prompt), 0..k tokens of them, each replaced by another
    token with probability `wrong`."""

    def __init__(self, refs: dict, vocab: int, k: int = 4, wrong: float = 0.25, seed: int = 0):
        self.refs, self.vocab, self.k, self.wrong, self.rng = refs, vocab, k, wrong, random.Random(seed)

    def __call__(self, req, room: int) -> list[int]:
        ref = self.refs[tuple(req.prompt_token_ids)]
        n = req.num_output_tokens
        draft = list(ref[n:n + min(self.rng.randint(0, self.k), room)])
        for j in range(len(draft)):
            if self.rng.random() < self.wrong:
                draft[j] = (draft[j] + 1 + self.rng.randrange(self.vocab - 1)) % self.vocab
        return draft


def engine_with(model, oracle=None, **config) -> LLMEngine:
    config.setdefault("speculative_config", spec(disable_by_batch_size=64, min_acceptance_rate=0.0))
    engine = LLMEngine(model, None, EngineConfig(block_size=4, **config))
    if oracle is not None:
        engine.drafter.proposer.propose = oracle
    return engine


def busy_prompts(model_name: str, seed: int) -> list[list[int]]:
    """Shared prefixes, and prompts that extend an earlier prompt by its answer: they arrive later and
    hit the blocks that the earlier request's speculative steps filled."""
    prompts = [[t % VOCAB[model_name] for t in p] for p in shared_prefix_prompts(24, seed)]
    model = make_model(model_name)
    rng = random.Random(seed)
    for p in rng.sample(prompts[2:], 6):
        prompts.append(p + solo_greedy(model, p, GREEDY.max_tokens)[:rng.randint(5, 12)])
    return prompts


def as_decode_rows(monkeypatch) -> list:
    """Steps built as where the decode kernel runs (short segments' tokens as decode rows), each row
    gathering its pages as a layer the kernel does not take would; returns decode_token_rows' answers."""
    monkeypatch.setattr(ModelRunner, "kernel_kv_heads", property(lambda runner: [1] * len(runner.windows)))
    monkeypatch.setattr(attention, "decode_kernel_takes", lambda *a: False)
    rows_steps, real = [], attention_metadata.decode_token_rows
    monkeypatch.setattr(attention_metadata, "decode_token_rows",
                        lambda so: rows_steps.append(real(so)) or rows_steps[-1])
    return rows_steps


@pytest.mark.parametrize("arch,decode_rows", [("llama", False), ("qwen3", False), ("gemma3-tiny", False),
                                               ("llama", True), ("gemma3-tiny", True)])
def test_busy_engine_with_drafts_equals_solo(arch, decode_rows, monkeypatch):
    """decode_rows: as where the decode kernel runs, verifying steps run each token as a decode row
    (attention_metadata.decode_token_rows); here the rows gather their pages, as a layer the kernel
    does not take would."""
    model = make_model(arch)
    prompts = busy_prompts(arch, seed=11)
    refs = {tuple(p): solo_greedy(model, p, GREEDY.max_tokens) for p in prompts}
    engine = engine_with(model, Oracle(refs, VOCAB[arch]), num_blocks=64, max_num_batched_tokens=48,
                         long_prefill_token_threshold=16, max_num_seqs=16)
    rows_steps = as_decode_rows(monkeypatch) if decode_rows else []
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    assert not decode_rows or any(r is not None for r in rows_steps)  # some steps ran their tokens as rows
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert all(n > 0 for n in stats.num_accepted_tokens_per_pos), stats
    assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.hits > 0
    assert engine.stats.num_steps < sum(map(len, refs.values()))  # drafts saved steps
    assert_no_leaks(engine)


def test_ngram_drafts_on_a_random_model_are_rejected_exactly_and_paused():
    """Prompts that repeat themselves: the n-gram proposer drafts, the random model disagrees; output
    stays exact, and requests whose drafts keep failing stop proposing (Drafter's pause)."""
    model = make_model("llama")
    rng = random.Random(3)
    prompts = [[rng.randrange(1, 500) for _ in range(rng.randint(3, 9))] * rng.randint(2, 4) for _ in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine = engine_with(model, num_blocks=128, speculative_config=spec(prompt_lookup_min=1))
    done = run_staggered(engine, prompts, params, seed=1)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, 40, i)
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert engine.drafter.num_paused > 0
    assert_no_leaks(engine)


def test_large_batches_do_not_speculate_and_overlap_again():
    """disable_by_batch_size 3: while more run, no step carries drafts and (async scheduling) steps
    overlap; as requests finish the rest speculate, in lockstep. Exact throughout."""
    model = make_model("qwen3")
    prompts = [[t % VOCAB["qwen3"] for t in p] for p in shared_prefix_prompts(10, seed=4)]
    lengths = [4 + 3 * i for i in range(len(prompts))]
    refs = {tuple(p): solo_greedy(model, p, n) for p, n in zip(prompts, lengths)}
    engine = engine_with(model, Oracle(refs, VOCAB["qwen3"], wrong=0.1), num_blocks=96, async_scheduling=True,
                         speculative_config=spec(disable_by_batch_size=3, min_acceptance_rate=0.0))
    seen = []
    forward = engine.runner.forward

    def watch(so, prev=None):
        seen.append((len(engine.scheduler.running), len(so.draft_token_ids)))
        return forward(so, prev)

    engine.runner.forward = watch
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
    done = run_to_completion(engine)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        assert_solo_greedy(done[str(i)].token_ids, model, p, n, i)
    assert all(drafts == 0 for running, drafts in seen if running > 3)
    assert any(drafts > 0 for running, drafts in seen if running <= 3)
    assert engine.stats.num_overlapped > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 7, 9])
def test_max_tokens_and_max_model_len_are_never_passed(max_tokens):
    """Drafts that are all right: each step would take 5 tokens, but output stops at max_tokens (and at
    max_model_len 40 for a 33-token prompt, at 7 tokens), exactly."""
    model = make_model("llama")
    prompts = [list(range(3, 13)), list(range(20, 53))]
    refs = {tuple(p): solo_greedy(model, p, 12) for p in prompts}
    engine = engine_with(model, Oracle(refs, VOCAB["llama"], wrong=0.0, k=4), num_blocks=64, max_model_len=40)
    engine.drafter.proposer.propose = lambda req, room: refs[tuple(req.prompt_token_ids)][
        req.num_output_tokens:req.num_output_tokens + min(4, room)]
    for i, p in enumerate(prompts):
        engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True))
    done = run_to_completion(engine)
    assert_solo_greedy(done["0"].token_ids, model, prompts[0], max_tokens)
    assert_solo_greedy(done["1"].token_ids, model, prompts[1], min(max_tokens, 7))
    assert done["0"].finish_reason == "length"
    if max_tokens >= 5:
        assert engine.scheduler.spec_decoding_stats.num_accepted_tokens >= 3
    assert_no_leaks(engine)


def test_eos_and_stop_token_ids_inside_accepted_drafts_end_the_output_there():
    model = make_model("qwen3")
    prompts = [[5, 9, 14, 3, 8, 21], [40, 41, 42, 43]]
    refs = {tuple(p): solo_greedy(model, p, 16) for p in prompts}
    a, b = (refs[tuple(p)] for p in prompts)
    eos, stop = a[5], b[3]
    assert eos not in a[:5] and stop not in b[:3]
    engine = engine_with(model, num_blocks=64)
    engine.drafter.proposer.propose = lambda req, room: refs[tuple(req.prompt_token_ids)][
        req.num_output_tokens:req.num_output_tokens + min(4, room)]
    engine.core.eos_token_ids = (eos,)
    engine.add_request("eos", prompts[0], SamplingParams(temperature=0.0, max_tokens=16))
    engine.core.eos_token_ids = ()
    engine.add_request("stop", prompts[1], SamplingParams(temperature=0.0, max_tokens=16, stop_token_ids=[stop]))
    done = run_to_completion(engine)
    assert done["eos"].token_ids == a[:6] and done["eos"].finish_reason == "stop"
    assert done["stop"].token_ids == b[:4] and done["stop"].stop_reason == stop
    assert engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    assert_no_leaks(engine)


def test_a_rejected_drafts_block_is_never_cached():
    """Drafts always wrong, four at a time across page boundaries: after every step each cached page of
    a running request lies within its computed (verified) tokens and is hashed from its own tokens; a
    later request that extends the first one's prompt by its answer hits those pages and still gets
    mlx-lm's tokens."""
    model = make_model("llama")
    prompt = [7, 3, 99, 4, 18, 250, 6]
    ref = solo_greedy(model, prompt, 30)
    engine = engine_with(model, num_blocks=64, speculative_config=spec(min_acceptance_rate=0.0))
    engine.drafter.proposer.propose = lambda req, room: [(t + 1) % 512
                                                         for t in ref[req.num_output_tokens:][:min(4, room)]]
    engine.add_request("a", prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    bs, pool = 4, engine.kv_cache_manager.block_pool
    while engine.has_unfinished_requests():
        engine.step()
        req = engine.scheduler.requests.get("a")
        if req is None:
            break
        for i, block in enumerate(engine.kv_cache_manager.req_to_blocks["a"]):
            if block.block_hash is not None:
                assert (i + 1) * bs <= req.num_computed_tokens
                assert block.block_hash.token_ids == tuple(req.all_token_ids[i * bs:(i + 1) * bs])
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 40 and stats.num_accepted_tokens == 0
    assert len(pool.cached_block_hash_to_block) == (len(prompt) + 30 - 1) // bs
    later = prompt + ref[:20]
    engine.add_request("b", later, SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True))
    assert_solo_greedy(run_to_completion(engine)["b"].token_ids, model, later, 10)
    assert engine.kv_cache_manager.stats.hits >= 24
    assert_no_leaks(engine)


def test_logprobs_of_accepted_drafts_equal_those_without_speculation():
    """Sampled tokens' logprobs, and a prompt's logprobs scored in a step where others verify drafts
    (its rows come after every sampled row, drafts' included)."""
    model = make_model("llama")
    prompts = [[11, 12, 13, 14, 15], [300, 2, 301, 2, 300]]
    late = list(range(40, 70))
    refs = {tuple(p): solo_greedy(model, p, 12) for p in prompts + [late]}
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    outs = []
    for speculate in (False, True):
        engine = engine_with(model, Oracle(refs, VOCAB["llama"], wrong=0.2) if speculate else None, num_blocks=64,
                             speculative_config=spec(min_acceptance_rate=0.0) if speculate else None)
        for i, p in enumerate(prompts):
            engine.add_request(str(i), p, params)
        engine.step()
        engine.step()
        engine.add_request("late", late, SamplingParams(temperature=0.0, max_tokens=4, prompt_logprobs=2))
        outs.append(run_to_completion(engine))
    assert engine.scheduler.spec_decoding_stats.num_accepted_tokens > 0
    a, b = outs[0]["late"].prompt_logprobs, outs[1]["late"].prompt_logprobs
    assert len(a) == len(b) == len(late) - 1
    assert all(x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4 for x, y in zip(a, b))
    for rid in ("0", "1"):
        plain, spec_lps = outs[0][rid].logprobs, outs[1][rid].logprobs
        assert outs[1][rid].token_ids == outs[0][rid].token_ids and len(spec_lps) == 12
        for x, y in zip(plain, spec_lps):
            assert x.token_id == y.token_id and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]


def test_seeded_sampling_with_drafts_keeps_its_tokens_and_distribution():
    """400 seeds of one prompt at temperature 0.8, top_k 3, drafts from the greedy answer (right about
    half the time): each seed's tokens equal its tokens without speculation (the sampler's noise
    depends only on seed and position), and the second token, the first one verified against a draft,
    follows mlx-lm's own distribution (chi-square over the categories expecting >= 5, the rest pooled,
    below its p = 1e-4 critical value: 27.86 at 6 degrees of freedom)."""
    model = make_model("llama")
    prompt = [17, 42, 99, 7, 250]
    greedy = solo_greedy(model, prompt, 3)
    N, T, K = 400, 0.8, 3
    results = []
    for speculate in (False, True):
        engine = engine_with(model, num_blocks=64, max_num_seqs=N, max_num_batched_tokens=4096,
                             speculative_config=spec(k=2, disable_by_batch_size=N, min_acceptance_rate=0.0)
                             if speculate else None)
        if speculate:
            engine.drafter.proposer.propose = lambda req, room: greedy[req.num_output_tokens:][:min(2, room)]
        for s in range(N):
            engine.add_request(str(s), prompt, SamplingParams(temperature=T, top_k=K, seed=s, max_tokens=3))
        done = run_to_completion(engine)
        results.append([done[str(s)].token_ids for s in range(N)])
    assert results[0] == results[1]
    stats = engine.scheduler.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    # the exact law of the second token: sum over seeds of p(. | prompt + that seed's first token)
    firsts = [r[0] for r in results[1]]
    expected = np.zeros(VOCAB["llama"])
    for t0, n in zip(*np.unique(firsts, return_counts=True)):
        logits = np.array(model(mx.array([prompt + [int(t0)]]))[0, -1].astype(mx.float32)) / T
        logits[np.argsort(-logits)[K:]] = -np.inf
        p = np.exp(logits - logits.max())
        expected += n * p / p.sum()
    observed = np.bincount([r[1] for r in results[1]], minlength=len(expected))
    big = expected >= 5
    cats_obs = np.append(observed[big], observed[~big].sum())
    cats_exp = np.append(expected[big], expected[~big].sum())
    keep = cats_exp > 0
    dof = int(keep.sum()) - 1
    assert dof >= 3, dof
    assert chi_square(cats_obs[keep], cats_exp[keep]) < CHI2_P1E4[dof], (cats_obs, cats_exp)


def test_guided_and_penalised_requests_do_not_speculate_and_state_models_do(caplog):
    from pagedmlx.request import Request

    engine = engine_with(make_model("llama"), num_blocks=32)
    with caplog.at_level(logging.INFO, logger="pagedmlx"):
        assert not engine.drafter.speculates(Request("p", [1], SamplingParams(presence_penalty=0.5)))
        guided = Request("g", [1], SamplingParams())
        guided.structured_output_request = object()
        assert not engine.drafter.speculates(guided)
        assert engine.drafter.speculates(Request("x", [1], SamplingParams()))
    assert "penalties" in caplog.text and "guided decoding" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="pagedmlx"):  # rollback of recurrent state: test_spec_decode_state.py
        state = LLMEngine(make_model("qwen3_5-tiny"), None,
                          EngineConfig(block_size=4, num_blocks=32, speculative_config=spec()))
    assert state.drafter is not None and "speculative decoding on recurrent-state layers" in caplog.text


def run_in_engine_process(config: EngineConfig, prompts: list, params: SamplingParams) -> tuple[list, object]:
    """Every prompt at once through an engine core in its own process: the final outputs, then its snapshot."""
    from pagedmlx.engine.async_engine import AsyncEngine
    from pagedmlx.engine.core_client import CoreProcess
    from pagedmlx.server.metrics import EngineSnapshot

    ae = AsyncEngine(CoreProcess(config))
    try:
        async def main():
            async def one(i, p):
                return [o async for o in ae.generate(p, params, str(i))][-1]
            outs = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            return outs, await ae.call(EngineSnapshot.take)

        return asyncio.run(main())
    finally:
        ae.shutdown(timeout=0)


def test_the_engine_process_speculates():
    config = EngineConfig(model="random:llama-tiny", block_size=8, num_blocks=64, max_model_len=256,
                          speculative_config='{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}')
    prompts = [[(5 * i + j) % 7 + 1 for j in range(12)] * 2 for i in range(4)]
    outs, snap = run_in_engine_process(config, prompts, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    model = make_model("llama")
    for p, out in zip(prompts, outs):
        assert_solo_greedy(out.outputs[0].token_ids, model, p, 12)
    assert snap.spec_decode_num_draft_tokens > 0 and len(snap.spec_decode_num_accepted_tokens_per_pos) == 3


def test_the_server_streams_several_tokens_a_step():
    """OpenAI completions through the server with drafts accepted: streamed chunks (several tokens in
    some) add up to the whole response, logprobs and usage count every token, a stop string cuts the
    text as without speculation, and /metrics shows vLLM's counters."""
    import httpx
    from server_utils import MODEL, Served, engine_config
    from utils import make_tokenizer

    model, tok = make_model("llama"), make_tokenizer(VOCAB["llama"])
    prompt = [5, 9, 11, 200, 3, 5, 9, 11]
    ref = solo_greedy(model, prompt, 24)
    engine = LLMEngine(model, tok, engine_config(speculative_config=spec(min_acceptance_rate=0.0)))
    engine.drafter.proposer.propose = lambda req, room: ref[req.num_output_tokens:][:min(3, room)]
    served = Served(engine)
    try:
        client = served.client()
        kw = dict(model=MODEL, prompt=prompt, max_tokens=24, temperature=0, logprobs=1, extra_body={"ignore_eos": True})
        whole = client.completions.create(**kw)
        chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
        assert whole.usage.completion_tokens == 24 and len(whole.choices[0].logprobs.tokens) == 24
        assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.choices[0].text == tok.decode(ref)
        assert sum(len(c.choices[0].logprobs.tokens) for c in chunks if c.choices and c.choices[0].logprobs) == 24
        assert chunks[-1].usage.completion_tokens == 24
        assert len([c for c in chunks if c.choices]) < 24  # some chunks carried several tokens
        text = tok.decode(ref)
        stop = text[len(text) // 2:len(text) // 2 + 3]
        cut = client.completions.create(**{**kw, "logprobs": None}, stop=[stop])
        assert cut.choices[0].text == text[:text.index(stop)] and cut.choices[0].finish_reason == "stop"
        assert cut.usage.completion_tokens == next(i + 1 for i in range(24) if stop in tok.decode(ref[:i + 1]))
        metrics = httpx.get(served.url + "/metrics").text
        assert 'vllm:spec_decode_num_accepted_tokens_total{model_name="tiny-llama"}' in metrics
        accepted = float(
            metrics.split('vllm:spec_decode_num_accepted_tokens_total{model_name="tiny-llama"} ')[1].split()[0])
        assert accepted > 0
    finally:
        served.stop()


def quoting_prompt(model, tok, max_tokens: int = 40) -> tuple[list[int], list[int]]:
    """A chat prompt asking to repeat a passage, and mlx-lm's greedy answer to it."""
    passage = ("The quick brown fox jumps over the lazy dog. It was a bright cold day in April, and the "
               "clocks were striking thirteen. Call me Ishmael.")
    prompt = tok.apply_chat_template([{"role": "user", "content": f"Repeat this text exactly:\n\n{passage}"}],
                                     add_generation_prompt=True)
    return prompt, solo_greedy(model, prompt, max_tokens, tuple(tok.eos_token_ids))


@pytest.mark.slow
def test_smollm_quoting_a_passage_accepts_ngram_drafts(smollm):
    """The real default model repeating a passage it was given: n-gram drafts are mostly accepted,
    the answer is mlx-lm's, token for token, in far fewer steps than tokens."""
    model, tok = smollm
    prompt, want = quoting_prompt(model, tok)
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=256, speculative_config=spec(k=4)))
    engine.add_request("q", prompt, SamplingParams(temperature=0.0, max_tokens=40))
    out = run_to_completion(engine)["q"]
    assert out.token_ids == want
    stats = engine.scheduler.spec_decoding_stats
    assert stats.acceptance_rate > 0.5 and engine.stats.num_steps < 0.6 * len(want), (stats, engine.stats.num_steps)


@pytest.mark.slow
def test_smollm_busy_quoting_engine_equals_mlx_lm(smollm):
    """Four rewrites of given passages (scripts/bench/bench_spec.py's workload) arriving staggered into a
    pool too small for all: n-gram drafts accepted, preemption, every answer mlx-lm's."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts" / "bench"))
    from bench_spec import prompts_for

    model, tok = smollm
    prompts = prompts_for(tok, 4)
    eos = tuple(tok.eos_token_ids)
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=20, max_num_batched_tokens=64,
                                                speculative_config=spec(k=4)))
    done = run_staggered(engine, prompts, SamplingParams(temperature=0.0, max_tokens=48), seed=0)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, 48, i, stop_ids=eos)
    stats = engine.scheduler.spec_decoding_stats
    assert stats.acceptance_rate > 0.5 and engine.scheduler.num_preemptions > 0, (
        stats, engine.scheduler.num_preemptions)
    assert_no_leaks(engine)
