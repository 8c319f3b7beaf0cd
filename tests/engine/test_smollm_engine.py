"""The real default model through the engine: the same tokens as mlx-lm, real text, stop strings."""

from __future__ import annotations

import pytest

from utils import assert_no_leaks, solo_greedy

from pagedmlx import LLM
from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.sampling_params import SamplingParams

pytestmark = pytest.mark.slow  # deselect with -m "not slow"

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def mlx_lm_greedy(model, tok, prompt, max_tokens):
    """mlx-lm's tokens up to (not including) EOS."""
    out = solo_greedy(model, prompt, max_tokens, tuple(tok.eos_token_ids))
    return out[:-1] if out and out[-1] in tok.eos_token_ids else out


def test_engine_answers_paris_with_mlx_lm_tokens(smollm):
    model, tok = smollm
    llm = LLM(model, tok, num_blocks=256)
    prompt = tok.apply_chat_template(QUESTION, add_generation_prompt=True)
    other = tok.apply_chat_template([{"role": "user", "content": "Name three colours."}], add_generation_prompt=True)
    outs = [o.outputs[0] for o in llm.generate([prompt, other, prompt], SamplingParams(temperature=0, max_tokens=24))]
    want = mlx_lm_greedy(model, tok, prompt, 24)
    assert outs[0].token_ids == outs[2].token_ids
    assert outs[0].token_ids[:-1] == want and outs[0].token_ids[-1] in tok.eos_token_ids  # EOS kept, as vLLM
    assert "Paris" in outs[0].text and outs[0].finish_reason == "stop"
    assert outs[0].text == tok.decode(want)
    assert llm.engine.kv_cache_manager.stats.hits > 0  # the repeated prompt came from the prefix cache
    assert_no_leaks(llm.engine)


def test_stop_string_on_real_text(smollm):
    model, tok = smollm
    llm = LLM(model, tok, num_blocks=128)
    out = llm.chat(QUESTION, SamplingParams(temperature=0, max_tokens=24, stop=["Paris"]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == "Paris"
    assert out.text.startswith("The capital of France is") and "Paris" not in out.text


def test_server_chat_answers_paris_streaming_and_not(smollm):
    """The real model end to end through the OpenAI server, with the official client."""
    from server_utils import Served

    model, tok = smollm
    served = Served(LLMEngine(model, tok, EngineConfig(num_blocks=128)))
    try:
        client = served.client()
        whole = client.chat.completions.create(model="tiny-llama", messages=QUESTION, temperature=0, max_tokens=24)
        assert "Paris" in whole.choices[0].message.content and whole.choices[0].finish_reason == "stop"
        chunks = client.chat.completions.create(model="tiny-llama", messages=QUESTION, temperature=0,
                                                max_tokens=24, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content
        want = tok.decode(mlx_lm_greedy(model, tok, tok.apply_chat_template(QUESTION, add_generation_prompt=True), 24))
        assert streamed == want
    finally:
        served.stop()
        served.async_engine.shutdown(timeout=5)
