"""Sampling through the engine: seeds reproducible inside busy batches, logprobs, stop strings."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from utils import assert_no_leaks, make_model, run_to_completion

from pagedmlx.config import EngineConfig
from pagedmlx.engine.detokenizer import IncrementalDetokenizer
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.llm import LLM
from pagedmlx.sampling_params import SamplingParams

run_all = run_to_completion


def test_seed_gives_same_tokens_alone_and_in_a_busy_batch():
    model = make_model("qwen3")
    rng = random.Random(4)
    prompt = [rng.randrange(448) for _ in range(37)]
    seeded = SamplingParams(temperature=0.9, top_p=0.95, top_k=50, seed=1234, max_tokens=24, ignore_eos=True)

    alone = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=64))
    alone.add_request("s", prompt, seeded)
    want = run_all(alone)["s"].token_ids

    busy = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=72, max_num_batched_tokens=40,
                                               long_prefill_token_threshold=16, async_scheduling=True))
    for i in range(20):
        p = [rng.randrange(448) for _ in range(rng.randint(1, 80))]
        params = SamplingParams(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]),
                                presence_penalty=rng.choice([0.0, 0.5]), max_tokens=rng.randint(5, 30),
                                ignore_eos=True)
        busy.add_request(f"o{i}", p, params)
        if i == 7:
            busy.add_request("s", prompt, seeded)
        busy.step()
    got = run_all(busy)
    assert busy.scheduler.num_preemptions > 0
    assert got["s"].token_ids == want
    assert_no_leaks(busy)


def test_different_seeds_differ_and_n_samples_differ():
    model = make_model("llama")
    llm = LLM(model, None, block_size=4, num_blocks=128)
    prompt = list(range(3, 20))
    a = llm.generate([prompt], SamplingParams(temperature=1.0, seed=1, max_tokens=16, ignore_eos=True))[0]
    b = llm.generate([prompt], SamplingParams(temperature=1.0, seed=2, max_tokens=16, ignore_eos=True))[0]
    assert a.outputs[0].token_ids != b.outputs[0].token_ids
    outs = llm.generate([prompt], SamplingParams(n=3, temperature=1.0, max_tokens=16, ignore_eos=True))
    assert len(outs) == 1 and [o.index for o in outs[0].outputs] == [0, 1, 2]
    assert len({tuple(o.token_ids) for o in outs[0].outputs}) == 3
    # n > 1 shares the prompt's pages: the later samples hit the first one's blocks.
    assert llm.engine.kv_cache_manager.stats.hits >= 2 * 16


def test_logprobs_match_mlx_lm_log_softmax():
    from mlx_lm.models.cache import make_prompt_cache

    model = make_model("llama_tied")
    prompt = [5, 9, 11, 200, 3, 7]
    llm = LLM(model, None, block_size=4, num_blocks=32)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    tokens = prompt + out.token_ids
    logits = model(mx.array([tokens]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for i, lps in enumerate(out.logprobs):  # vLLM's shape: {token id: Logprob}, the sampled token first
        row = ref[len(prompt) - 1 + i]
        sampled = next(iter(lps))
        assert sampled == out.token_ids[i] == int(row.argmax())
        np.testing.assert_allclose(lps[sampled].logprob, row[sampled], atol=1e-4)
        top = sorted(lps.items(), key=lambda kv: kv[1].rank)
        assert [t for t, _ in top] == list(np.argsort(-row)[:3]) and [lp.rank for _, lp in top] == [1, 2, 3]
        np.testing.assert_allclose([lp.logprob for _, lp in top], np.sort(row)[::-1][:3], atol=1e-4)
    np.testing.assert_allclose(out.cumulative_logprob, sum(ref[len(prompt) - 1 + i][t] for i, t in
                                                           enumerate(out.token_ids)), atol=1e-3)


class CharTokenizer:
    """One token per character: enough to test the detokenizer's stop-string logic exactly."""

    all_special_ids = [0]
    eos_token_ids = {0}

    class _Stream:
        def __init__(self):
            self.text = ""

        def add_token(self, t):
            self.text += chr(t)

        def finalize(self):
            pass

    @property
    def detokenizer(self):
        return self._Stream()


def feed(params: SamplingParams, text: str, chunk: int = 1):
    detok = IncrementalDetokenizer(CharTokenizer(), params)
    pieces, stop = [], None
    ids = [ord(c) for c in text]
    for i in range(0, len(ids), chunk):
        last = i + chunk >= len(ids)
        delta, stop = detok.update(ids[i:i + chunk], last)
        pieces.append(delta)
        if stop:
            break
    return "".join(pieces), detok.text, stop


def test_stop_string_split_across_tokens_is_found_and_cut():
    streamed, text, stop = feed(SamplingParams(stop=["xyz"]), "hello world")
    assert stop is None and text == streamed == "hello world"
    streamed, text, stop = feed(SamplingParams(stop=["END"]), "hello wENDorld")
    assert (streamed, text, stop) == ("hello w", "hello w", "END")


def test_stop_string_included_when_asked_and_earliest_wins():
    streamed, text, stop = feed(SamplingParams(stop=["lo w", "o"], include_stop_str_in_output=True), "hello world", 3)
    assert (text, stop) == ("hello", "o") and streamed == text


def test_streamed_text_never_shows_a_partial_stop_string():
    detok = IncrementalDetokenizer(CharTokenizer(), SamplingParams(stop=["STOP"]))
    shown = ""
    for c in "abc STO":
        shown += detok.update([ord(c)], False)[0]
    assert shown == "abc "  # "STO" could still become "STOP": held back
    delta, stop = detok.update([ord("X")], False)
    assert stop is None and shown + delta == "abc S"


def test_ids_must_decode_with_the_tokenizer_and_output_errors_stay_per_request(monkeypatch):
    from utils import make_tokenizer

    engine = LLMEngine(make_model("llama"), make_tokenizer(384), EngineConfig(block_size=4, num_blocks=64))
    assert engine.vocab_size == 384  # the model has 512 rows, the tokenizer 384 tokens
    for bad in (dict(prompt=[1, 2, 450]), dict(prompt=[1, 2], params=SamplingParams(logit_bias={450: 5.0}))):
        with pytest.raises(ValueError, match="384"):
            engine.add_request("bad", bad["prompt"], bad.get("params"))
    from pagedmlx.engine.output_processor import RequestState

    real = RequestState.update

    def update(state, out):
        if state.request_id == "boom":
            raise IndexError("token id out of the detokenizer's range")
        return real(state, out)

    monkeypatch.setattr(RequestState, "update", update)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("boom", [5, 6, 7], params)
    engine.add_request("fine", [8, 9, 10], params)
    done = run_all(engine)
    assert done["boom"].finish_reason == "error" and "IndexError" in done["boom"].error
    assert done["fine"].finish_reason == "length" and len(done["fine"].token_ids) == 4
    assert_no_leaks(engine)


def test_prompt_logprobs_match_mlx_lm_log_softmax_across_chunks():
    """vLLM's prompt_logprobs: None for the first prompt token, then each token's logprob under the
    model given the tokens before it, and the top k; computed in chunks (a budget of 4 tokens) and
    never from the prefix cache (a repeated prompt computes its prompt again)."""
    from mlx_lm.models.cache import make_prompt_cache

    model = make_model("llama_tied")
    prompt = [5, 9, 11, 200, 3, 7, 42, 8, 1, 77]
    llm = LLM(model, None, block_size=4, num_blocks=32, max_num_batched_tokens=4)
    params = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=2, ignore_eos=True)
    first, again = llm.generate([prompt, prompt], params)
    logits = model(mx.array([prompt]), cache=make_prompt_cache(model))[0].astype(mx.float32)
    ref = np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))
    for out in (first, again):
        lps = out.prompt_logprobs
        assert len(lps) == len(prompt) and lps[0] is None
        for i in range(1, len(prompt)):
            row, entry = ref[i - 1], lps[i]
            assert next(iter(entry)) == prompt[i]  # the prompt's own token first
            np.testing.assert_allclose(entry[prompt[i]].logprob, row[prompt[i]], atol=1e-4)
            top = sorted((lp.rank, t) for t, lp in entry.items() if lp.rank is not None)
            assert [t for _, t in top] == list(np.argsort(-row)[:2])
    assert first.outputs[0].token_ids == again.outputs[0].token_ids
    assert llm.engine.kv_cache_manager.stats.hits == 0  # prompt logprobs take no prefix hit
    assert llm.generate([prompt], SamplingParams(max_tokens=1))[0].prompt_logprobs is None
