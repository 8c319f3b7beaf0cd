"""The OpenAI surface where clients compare it with OpenAI and vLLM: completions logprobs carry the
sampled token, and streamed events stay one line for line readers. Random-weight tiny model."""

from __future__ import annotations

import json

import httpx
import pytest
from server_utils import MODEL, Served, make_engine, sse_payloads

from pagedmlx.server.sse import event

LINE_BREAKS = "a\u2028b\u2029c\x85d"


@pytest.fixture(scope="module")
def served():
    s = Served(make_engine())
    yield s
    s.stop()


def test_completion_top_logprobs_include_the_sampled_token(served):
    """OpenAI and vLLM: top_logprobs holds the k best and the sampled token, so up to k + 1 entries. At
    temperature 1 a random model's samples are seldom its best token."""
    c = served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=24, logprobs=1, temperature=1.0,
                                           seed=7, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.top_logprobs) == 24
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == logprob and 1 <= len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)  # some sampled token was not the best
    zero = served.client().completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=0,
                                              extra_body={"ignore_eos": True}).choices[0].logprobs
    assert [list(t) for t in zero.top_logprobs] == [[t] for t in zero.tokens]


def test_chat_top_logprobs_are_the_k_best_as_openai(served):
    """Chat has the sampled token's logprob in the entry itself; top_logprobs is exactly the k best."""
    r = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=8, logprobs=True, top_logprobs=2, temperature=1.0,
                                                extra_body={"ignore_eos": True})
    for t in r.choices[0].logprobs.content:
        best, second = t.top_logprobs
        assert best.logprob >= second.logprob and t.logprob <= best.logprob + 1e-6


def test_an_event_with_unicode_line_breaks_is_one_line():
    payload = json.dumps({"text": LINE_BREAKS}, ensure_ascii=False)
    lines = event(payload).decode().splitlines()
    assert lines == ["data: " + payload.replace("\u2028", "\\u2028").replace("\u2029", "\\u2029")
                     .replace("\x85", "\\u0085"), ""]
    assert json.loads(lines[0][len("data: "):]) == {"text": LINE_BREAKS}


def test_streamed_events_survive_a_line_reader(served):
    """The echoed prompt carries U+2028, U+2029 and U+0085 into the first completions chunk; httpx's
    iter_lines (str.splitlines) still reads every event whole."""
    with httpx.stream("POST", served.url + "/v1/completions", timeout=30,
                      json={"model": MODEL, "prompt": LINE_BREAKS, "echo": True, "max_tokens": 2, "stream": True}) as r:
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[0]["choices"][0]["text"].startswith(LINE_BREAKS)
    with httpx.stream("POST", served.url + "/v1/chat/completions", timeout=30,
                      json={"model": MODEL, "messages": [{"role": "user", "content": LINE_BREAKS}], "max_tokens": 2,
                            "stream": True, "logprobs": True}) as r:
        payloads = sse_payloads(r)
    assert payloads[-1] == "[DONE]" and all(json.loads(p)["object"] for p in payloads[:-1])


NUMBERS = {"type": "object", "properties": {"n": {"type": "integer", "minimum": -50, "maximum": 50},
                                            "b": {"type": "boolean"}, "z": {"type": "null"}, "e": {"enum": [1, 2]}},
           "required": ["n", "b", "z", "e"], "additionalProperties": False}


def test_guided_json_is_compact_by_default(served):
    """JSON on one line as json.dumps writes it unless whitespace is asked for: at temperature 1 a random
    model takes any whitespace it is allowed."""
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": NUMBERS, "strict": True}}
    for seed in range(3):
        r = served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=200, temperature=1.0, seed=seed, response_format=fmt)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and text == json.dumps(json.loads(text))  # ", " and ": " only


def _first_token_texts(**options) -> list[str]:
    """The texts of the tokens a JSON grammar allows right after `{`."""
    import numpy as np
    from utils import ARCHS, make_tokenizer

    from pagedmlx.structured_outputs.backend import GuidanceBackend, GuidanceGrammar
    from pagedmlx.structured_outputs.params import StructuredOutputsParams

    tok = make_tokenizer(ARCHS["llama"]["vocab_size"])
    backend = GuidanceBackend(tok, tok.eos_token_ids)
    grammar = GuidanceGrammar(backend.compile(StructuredOutputsParams(json=NUMBERS, **options)))
    assert all(grammar.accept_token(t) for t in tok.encode("{", add_special_tokens=False))
    row = np.zeros((backend.vocab_size + 31) // 32, np.int32)
    grammar.fill_bitmask(row)
    return [tok.decode([i]) for i in range(backend.vocab_size) if (int(row[i // 32]) >> (i % 32)) & 1]


def test_guided_json_whitespace_options():
    compact = _first_token_texts()
    assert compact and not any(t[:1].isspace() for t in compact)
    assert _first_token_texts(disable_any_whitespace=True) == compact
    for options in ({"disable_any_whitespace": False}, {"whitespace_pattern": r"[\n ]{0,4}"}):
        assert {"\n", " "} <= set(_first_token_texts(**options))
