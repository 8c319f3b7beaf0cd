"""The OpenAI-compatible server, end to end: a real uvicorn on a loopback port, driven by the
official openai client, by httpx (raw SSE) and by bad requests. Random-weight tiny model."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import threading
import time

import httpx
import openai
import pytest
from server_utils import (MAX_MODEL_LEN, MODEL, Served, ServeProcess, engine_config, error_of, make_engine,
                          sse_payloads, wait_idle)
from utils import run_to_completion

from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def served():
    s = Served(make_engine())
    yield s
    s.stop()
    assert not s.async_engine.client.is_alive()


def offline(engine_kw: dict, prompt, max_tokens: int, **params) -> tuple[list[int], str]:
    """What the offline engine gives this prompt alone."""
    engine = make_engine(**engine_kw)
    engine.add_request("solo", prompt, SamplingParams(temperature=0.0, max_tokens=max_tokens, **params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out.token_ids, out.text
    raise AssertionError("no output")


# ---- behaviour ---------------------------------------------------------------------------------

def test_32_concurrent_streaming_chats_equal_offline(served):
    tok = served.engine.tokenizer
    chats = [[{"role": "system", "content": "Be brief."} if i % 3 == 0 else {"role": "user", "content": "Hi"},
              {"role": "user", "content": f"Question {i}: " + "what is the capital of France? " * (i % 5)}]
             for i in range(32)]
    want = [offline({}, tok.apply_chat_template(c, add_generation_prompt=True), 12, ignore_eos=True)
            for c in chats]

    async def one(client, messages):
        stream = await client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_tokens=12, stream=True,
            extra_body={"ignore_eos": True, "return_token_ids": True})
        ids, text, roles, reasons = [], "", [], []
        async for chunk in stream:
            for choice in chunk.choices:
                roles.append(choice.delta.role)
                text += choice.delta.content or ""
                ids += choice.model_extra.get("token_ids") or []
                reasons.append(choice.finish_reason)
        assert roles[0] == "assistant" and reasons[-1] == "length" and not any(reasons[:-1])
        return ids, text

    async def main():
        async with served.aclient() as client:
            return await asyncio.gather(*(one(client, c) for c in chats))

    steps = served.engine.stats.num_steps
    got = asyncio.run(main())
    assert served.engine.stats.num_steps - steps < 32 * 12 / 4  # they really ran batched
    for i, (g, w) in enumerate(zip(got, want)):
        assert g == w, f"chat {i}"
    wait_idle(served.engine)


def test_completion_prompt_forms(served):
    client = served.client()
    tok = served.engine.tokenizer
    text_prompt = "The quick brown fox"
    ids = tok.encode(text_prompt)
    r = client.completions.create(model=MODEL, prompt=text_prompt, max_tokens=6, temperature=0)
    want_ids, want_text = offline({}, ids, 6)
    assert r.choices[0].text == want_text and r.object == "text_completion"
    assert r.usage.prompt_tokens == len(ids) and r.usage.completion_tokens == len(want_ids)
    r2 = client.completions.create(model=MODEL, prompt=ids, max_tokens=6, temperature=0)
    assert r2.choices[0].text == want_text
    r3 = client.completions.create(model=MODEL, prompt=[text_prompt, "Hello, world"], max_tokens=6, temperature=0)
    assert [c.index for c in r3.choices] == [0, 1] and r3.choices[0].text == want_text
    r4 = client.completions.create(model=MODEL, prompt=[ids, [5, 6, 7]], max_tokens=6, temperature=0,
                                   extra_body={"return_token_ids": True})
    assert r4.choices[0].text == want_text
    assert r4.choices[1].model_extra["token_ids"] == offline({}, [5, 6, 7], 6)[0]
    assert r4.usage.prompt_tokens == len(ids) + 3


def test_n2_echo_and_cached_tokens(served):
    client = served.client()
    prompt = "Paged attention keeps the KV cache in fixed-size blocks. " * 3
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0, n=2, echo=True,
                                  extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.text.startswith(prompt) for c in r.choices)
    assert r.choices[0].text == r.choices[1].text  # greedy
    assert r.usage.completion_tokens == 10 and r.usage.prompt_tokens == len(served.engine.tokenizer.encode(prompt))
    again = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens > 0
    chat = [{"role": "user", "content": prompt}]
    c1 = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3, n=2)
    assert len(c1.choices) == 2 and c1.choices[0].message.role == "assistant"
    c2 = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=3)
    assert c2.usage.prompt_tokens_details.cached_tokens >= 8
    wait_idle(served.engine)


def test_stream_usage_chunk_and_raw_sse(served):
    body = {"model": MODEL, "prompt": "Hello, world! How are", "max_tokens": 7, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        payloads = sse_payloads(resp)
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    usage = chunks[-1]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 7
    assert usage["usage"]["total_tokens"] == usage["usage"]["prompt_tokens"] + 7
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"
    text = "".join(c["choices"][0]["text"] for c in chunks[:-1])
    assert text == offline({}, "Hello, world! How are", 7, ignore_eos=True)[1]

    stream = served.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": [{"type": "text", "text": "Hi"}]}], max_tokens=4,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-1].choices == []


def test_stop_strings(served):
    client = served.client()
    prompt = "What is the capital of France?"
    full = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0,
                                     extra_body={"ignore_eos": True}).choices[0].text
    assert len(full) >= 6
    stop = full[3:6]
    cut = full[:full.find(stop)]
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=[stop, "\x00zz"],
                                  extra_body={"ignore_eos": True})
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop"
    assert r.choices[0].model_extra["stop_reason"] == stop
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=20, temperature=0, stop=stop,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == cut
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_disconnect_frees_pages(served, monkeypatch):
    real_step = served.engine.core.step  # slowed down: 200 tokens take > 4 s, unless aborted
    monkeypatch.setattr(served.engine.core, "step", lambda: (time.sleep(0.02), real_step())[1])
    reasons = []
    served.async_engine.add_listener(lambda out, timing, now: out.finished and reasons.append(out.finish_reason))
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Tell me a story"}], "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    with httpx.stream("POST", served.url + "/v1/chat/completions", json=body, timeout=30) as resp:
        lines = resp.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        assert served.engine.has_unfinished_requests()
    wait_idle(served.engine)
    assert reasons == ["abort"]

    body["stream"] = False  # non-streaming: the client gives up waiting
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.url + "/v1/chat/completions", json=body, timeout=0.3)
    deadline = time.monotonic() + 10  # a busy machine may still be tokenizing it when the client gives up
    while len(reasons) < 2 and time.monotonic() < deadline:
        time.sleep(0.02)
    wait_idle(served.engine)
    assert reasons == ["abort", "abort"]
    served.async_engine._listeners.pop()


def test_step_failure_is_one_requests_error(served, monkeypatch):
    runner = served.engine.runner
    real_forward = runner.forward
    failures = []

    def forward_failing_once(so, *args):
        if not failures:
            failures.append(so)
            raise RuntimeError("injected step failure")
        return real_forward(so, *args)

    monkeypatch.setattr(runner, "forward", forward_failing_once)
    body = {"model": MODEL, "prompt": "Hello", "max_tokens": 4}
    r = httpx.post(served.url + "/v1/completions", json=body, timeout=30)
    assert r.status_code == 500 and "injected step failure" in error_of(r)["message"]
    assert httpx.post(served.url + "/v1/completions", json=body, timeout=30).status_code == 200

    failures.clear()
    with httpx.stream("POST", served.url + "/v1/completions", json={**body, "stream": True}, timeout=30) as resp:
        payloads = sse_payloads(resp)
    assert payloads[-1] == "[DONE]" and "injected step failure" in json.loads(payloads[-2])["error"]["message"]
    ok = served.client().completions.create(model=MODEL, prompt="Hello", max_tokens=4)
    assert ok.choices[0].finish_reason in ("length", "stop")
    assert served.async_engine.dead is None
    wait_idle(served.engine)


def test_health_models_metrics(served):
    assert httpx.get(served.url + "/health").json() == {"status": "ok"}
    models = served.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    served.client().completions.create(model=MODEL, prompt="Hello there", max_tokens=3)
    text = httpx.get(served.url + "/metrics").text
    for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                 "vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                 "vllm:prompt_tokens_total", "vllm:generation_tokens_total",
                 "vllm:time_to_first_token_seconds_bucket", "vllm:inter_token_latency_seconds_bucket",
                 "vllm:e2e_request_latency_seconds_count", "pagedmlx:kv_blocks_total", "pagedmlx:kv_blocks_free",
                 "pagedmlx:kv_blocks_cached_free", "pagedmlx:step_forward_seconds_total"):
        assert f"\n{name}" in text, name
    assert f'pagedmlx:kv_blocks_total{{kv_cache_group="full",model_name="{MODEL}"}} 256.0' in text
    gen = [line for line in text.splitlines() if line.startswith("vllm:generation_tokens_total")]
    assert float(gen[0].split()[-1]) > 0


# ---- bad requests ----------------------------------------------------------------------------

@pytest.mark.parametrize("body, status, param, words", [
    ('{"model": "tiny-llama", "prompt": ', 400, None, ["JSON"]),
    ({"model": MODEL, "prompt": "hi", "temperature": "hot"}, 400, "temperature", ["temperature"]),
    ({"model": MODEL, "prompt": "hi", "temperature": 150}, 400, "temperature", ["temperature", "150"]),
    ({"model": MODEL, "prompt": "hi", "max_tokens": 1000}, 400, "max_tokens", [str(MAX_MODEL_LEN), "1000"]),
    ({"model": MODEL, "prompt": list(range(300)), "max_tokens": 5}, 400, "prompt", [str(MAX_MODEL_LEN), "300"]),
    ({"model": MODEL, "prompt": [1, 2, 100000]}, 400, "prompt", ["100000", "[0, 512)"]),
    ({"model": MODEL, "prompt": "hi", "n": 100}, 400, "n", ["100"]),
    ({"model": MODEL, "prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias", ["logit_bias"]),
    ({"model": MODEL}, 400, "prompt", ["prompt"]),
    ({"model": "gpt-5", "prompt": "hi"}, 404, "model", ["gpt-5"]),
])
def test_bad_completion_requests(served, body, status, param, words):
    kw = {"content": body, "headers": {"content-type": "application/json"}} if isinstance(body, str) else {"json": body}
    r = httpx.post(served.url + "/v1/completions", timeout=30, **kw)
    err = error_of(r)
    assert r.status_code == status, err
    assert err["param"] == param and all(w in err["message"] for w in words), err


def test_bad_chat_requests_and_body_limit(served):
    url = served.url + "/v1/chat/completions"
    r = httpx.post(url, json={"model": MODEL, "messages": []})
    assert r.status_code == 400 and error_of(r)["param"] == "messages"
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                              "top_logprobs": 3})
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"
    r = httpx.post(url, json={"model": MODEL, "messages": [{"role": "user", "content": "x" * 100_000}]})
    assert r.status_code == 413 and "65536" in error_of(r)["message"]
    with pytest.raises(openai.BadRequestError, match="context length is 256 .* 5000 in the completion"):
        served.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=5000)
    assert httpx.get(served.url + "/v1/nothing").status_code == 404


def test_api_key():
    s = Served(make_engine(), api_key="sekrit")
    try:
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 401 and error_of(r)["code"] == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            s.client(api_key="wrong").models.list()
        assert s.client(api_key="sekrit").completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
        assert httpx.get(s.url + "/health").status_code == 200
    finally:
        s.stop()


def test_429_when_waiting_queue_is_full():
    engine = make_engine()
    gate = threading.Event()
    real_step = engine.core.step
    engine.core.step = lambda: (gate.wait(10), real_step())[1]
    s = Served(engine, max_waiting=1)
    try:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
        first = threading.Thread(target=httpx.post, args=(s.url + "/v1/completions",), kwargs={"json": body})
        first.start()
        deadline = time.monotonic() + 5
        while s.async_engine.num_waiting() < 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        r = httpx.post(s.url + "/v1/completions", json=body)
        assert r.status_code == 429 and r.headers["retry-after"] == "1" and "max_waiting" in error_of(r)["message"]
        with pytest.raises(openai.RateLimitError):
            s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2)
        gate.set()
        first.join(10)
        assert s.client().completions.create(model=MODEL, prompt="hi", max_tokens=2).choices
    finally:
        gate.set()
        s.stop()


def test_logprobs_shapes(served):
    client = served.client()
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 4 and all(isinstance(t.token, str) and t.logprob <= 0 for t in content)
    c = client.completions.create(model=MODEL, prompt="Hi", max_tokens=4, logprobs=2, extra_body={"ignore_eos": True})
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4 and lp.text_offset[0] == 0
    # echo with logprobs: the prompt's tokens first (the first without a logprob), as vLLM returns them,
    # equal to what the offline engine computes for that prompt; streamed in the first chunk.
    prompt = [5, 9, 11, 200, 3]
    e = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True, temperature=0,
                                  extra_body={"ignore_eos": True}).choices[0].logprobs
    offline = LLMEngine(served.engine.model, served.engine.tokenizer, engine_config())
    offline.add_request("x", prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2, ignore_eos=True))
    want = run_to_completion(offline)["x"].prompt_logprobs
    assert len(e.tokens) == len(e.token_logprobs) == len(e.top_logprobs) == len(prompt) + 3
    assert e.token_logprobs[0] is None and e.top_logprobs[0] is None
    assert e.token_logprobs[1:len(prompt)] == pytest.approx([lp.logprob for lp in want], abs=1e-4)
    # keyed by text (two ids may decode alike): the top 2 and the prompt's own token
    assert all(1 <= len(t) <= 3 and tok in t for tok, t in zip(e.tokens[1:], e.top_logprobs[1:]))
    chunks = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, logprobs=2, echo=True,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True}))
    streamed = [t for ch in chunks if ch.choices and ch.choices[0].logprobs
                for t in ch.choices[0].logprobs.token_logprobs]
    assert streamed == pytest.approx(e.token_logprobs, abs=1e-4)
    chunks = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                 max_tokens=4, logprobs=True, stream=True,
                                                 extra_body={"ignore_eos": True}))
    assert sum(len(ch.choices[0].logprobs.content) for ch in chunks if ch.choices[0].logprobs) == 4


def test_cli_serve_drains_on_ctrl_c():
    """`pagedmlx serve`, then Ctrl-C with two requests in flight: both finish, the process exits 0."""
    server = ServeProcess("--drain-timeout", "20")
    url = server.url
    try:
        body = {"model": MODEL, "prompt": "Tell me a story", "max_tokens": 240, "ignore_eos": True}
        results = {}

        def plain():
            results["plain"] = httpx.post(url + "/v1/completions", json=body, timeout=60).json()

        def streamed():
            with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
                results["stream"] = sse_payloads(r)

        threads = [threading.Thread(target=plain), threading.Thread(target=streamed)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while not server.running(2):
            assert time.monotonic() < deadline
        server.proc.send_signal(signal.SIGINT)
        t0 = time.monotonic()
        for t in threads:
            t.join(30)
        assert time.monotonic() - t0 > 0.5  # they really were in flight, and drained
        code, err = server.finish()
    finally:
        server.kill()
    assert code == 0, err
    assert "CPU" in err and "256 blocks" in err and f"127.0.0.1:{server.port}/v1" in err
    assert ("kernels per KV cache group:\n    full (layers 0-1): decode gather + SDPA; prefill gather + SDPA; "
            "page write MLX scatter (no GPU backend)\n") in err  # runner/kernel_paths.py
    assert re.search(r"\n  start-up: \d+\.\d s", err)  # runner/start_times.py (a check kept on disk: no phases)
    assert results["plain"]["choices"][0]["finish_reason"] == "length"
    assert results["plain"]["usage"]["completion_tokens"] == 240
    assert results["stream"][-1] == "[DONE]" and json.loads(results["stream"][-2])["choices"][0]["finish_reason"] \
        == "length"


def test_requests_take_the_models_sampling_defaults_and_their_own_values_win():
    """A request without temperature samples with the model's default (here greedy); its own wins."""
    engine = make_engine()
    engine.generation_defaults = {"temperature": 0.0}
    served = Served(engine)
    try:
        client = served.client()
        prompt = [7, 3, 99, 12]
        plain = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, extra_body={"ignore_eos": True})
        hot = client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=1.5, seed=3,
                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    finally:
        served.stop()
        served.async_engine.shutdown(timeout=5)
    offline = make_engine()
    offline.add_request("g", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    offline.add_request("h", prompt, SamplingParams(temperature=1.5, seed=3, max_tokens=6, ignore_eos=True))
    done = run_to_completion(offline)
    assert plain.choices[0].text == done["g"].text
    assert hot.choices[0].token_ids == done["h"].token_ids != done["g"].token_ids
