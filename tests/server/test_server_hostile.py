"""Hostile requests: huge prompts must not stall the event loop, text that no encoder
takes must be a 400 naming its field, the KV inspector must not show one tenant's prompt to
another, and the small contract fixes (HEAD /health, Retry-After on 503, best_of, param)."""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest
from server_utils import MODEL, Served, error_of, make_engine, wait_idle

from pagedmlx.server.serving import ServerLimits

MIB = 1 << 20


@pytest.fixture(scope="module")
def served():
    s = Served(make_engine(), limits=ServerLimits(max_body_bytes=2 * MIB, max_n=4), admin_key="root-key")
    yield s
    s.stop()


async def _health_while(url: str, requests: list) -> tuple[list[int], float]:
    """Send `requests` (path, body) at once while polling /health; (their statuses, slowest /health)."""
    slowest, stop = 0.0, asyncio.Event()

    async with httpx.AsyncClient(timeout=60) as client:
        async def poll():
            nonlocal slowest
            while not stop.is_set():
                t = time.monotonic()
                assert (await client.get(url + "/health")).status_code == 200
                slowest = max(slowest, time.monotonic() - t)
                await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.1)
        responses = await asyncio.gather(*(client.post(url + path, json=body) for path, body in requests))
        await asyncio.sleep(0.1)
        stop.set()
        await poller
    return [r.status_code for r in responses], slowest


def _big_text(size: int) -> str:
    return ("lorem ipsum dolor sit amet " * (size // 27 + 1))[:size]


class CountingTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer, self.encoded = tokenizer, 0

    def encode(self, *args, **kw):
        self.encoded += 1
        return self.tokenizer.encode(*args, **kw)

    def __getattr__(self, name):
        return getattr(self.tokenizer, name)


def test_1mib_prompts_leave_health_answering(served, monkeypatch):
    """8 x 1 MiB prompts used to block every request, /health too, for 6.5-11 s while they were
    tokenized on the event loop. Now a text that cannot fit the context is refused before it is
    tokenized, and what must be tokenized is, in a thread pool."""
    prompts = served.app.state.serving.prompts
    tokenizer = CountingTokenizer(prompts.tokenizer)
    monkeypatch.setattr(prompts, "tokenizer", tokenizer)
    text = _big_text(MIB - 1000)
    completions = [("/v1/completions", {"model": MODEL, "prompt": text, "max_tokens": 2})] * 8
    statuses, slowest = asyncio.run(_health_while(served.url, completions))
    assert statuses == [400] * 8 and tokenizer.encoded == 0, "refused without tokenizing"
    assert slowest < 0.5, slowest

    # Without the cheap refusal (as for a tokenizer with no vocabulary to bound it), the text is
    # templated and tokenized (1.6 s for 1 MiB here, all that time a stall on the event loop): in
    # the pool, while /health goes on answering.
    monkeypatch.setattr(prompts, "max_text_chars", None)
    chats = [("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": text}]})] * 2
    statuses, slowest = asyncio.run(_health_while(served.url, chats))
    assert statuses == [400] * 2
    # On the event loop /health waited for a whole templating and tokenizing (>= 1.6 s); in the pool it
    # waits at most for one call that holds the GIL (0.62 s seen on this 2-core machine in a full run).
    assert slowest < 1.0, slowest
    r = httpx.post(served.url + "/v1/completions", json={"model": MODEL, "prompt": text[:20_000]})
    assert r.status_code == 400 and error_of(r)["code"] == "context_length_exceeded" and tokenizer.encoded == 1


SURROGATE = "Hel\\ud800lo"  # as JSON sends it: a lone UTF-16 surrogate escape
COMPLETION_FIELDS = {
    "prompt": '"prompt": "%s"',
    "prompt list": '"prompt": ["fine", "%s"]',
    "model": '"model": "%s", "prompt": "hi"',
    "stop": '"prompt": "hi", "stop": "%s"',
    "stop list": '"prompt": "hi", "stop": ["ok", "%s"]',
    "suffix": '"prompt": "hi", "suffix": "%s"',
    "user": '"prompt": "hi", "user": "%s"',
    "cache_salt": '"prompt": "hi", "cache_salt": "%s"',
    "logit_bias": '"prompt": "hi", "logit_bias": {"%s": 1}',
}
CHAT_FIELDS = {
    "messages": '"messages": [{"role": "user", "content": "%s"}]',
    "messages part": '"messages": [{"role": "user", "content": [{"type": "text", "text": "%s"}]}]',
    "messages image": '"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "%s"}}]}]',
    "messages image string": '"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "%s"}]}]',
    "messages role": '"messages": [{"role": "%s", "content": "hi"}]',
    "messages name": '"messages": [{"role": "user", "content": "hi", "name": "%s"}]',
    "model": '"model": "%s", "messages": [{"role": "user", "content": "hi"}]',
    "stop": '"messages": [{"role": "user", "content": "hi"}], "stop": "%s"',
}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("path, case, fields", [("/v1/completions", k, COMPLETION_FIELDS) for k in COMPLETION_FIELDS]
                         + [("/v1/chat/completions", k, CHAT_FIELDS) for k in CHAT_FIELDS])
def test_lone_surrogates_are_400_naming_the_field(served, path, case, fields, stream):
    """'\\ud800' in a prompt, a prompt list, the model name or a stream's prompt used to be a 500
    (the tokenizer's TypeError; a 404 body that UTF-8 could not encode); in stop strings, salts,
    user and names it was taken silently."""
    body = "{" + fields[case] % SURROGATE + ', "max_tokens": 2, "stream": %s}' % json.dumps(stream)
    r = httpx.post(served.url + path, content=body, headers={"content-type": "application/json"}, timeout=30)
    err = error_of(r)
    assert r.status_code == 400, err
    assert err["param"] == case.split()[0], err
    assert any(w in err["message"] for w in ("surrogate", "unicode", "pattern")), err


def test_inspector_shows_block_text_only_to_the_admin_key():
    """A salted tenant's prompt text used to be listed in /v1/engine/kv (most shared blocks) for
    any holder of the client key."""
    engine = make_engine()
    step = engine.core.step
    engine.core.step = lambda: (time.sleep(0.01), step())[1]  # keep the requests in flight a while
    s = Served(engine, api_key="client-key", admin_key="root-key")
    try:
        secret = "SECRET-SYSTEM-PROMPT of tenant A: the launch code is 0000. " * 3
        body = {"model": MODEL, "prompt": secret, "max_tokens": 60, "ignore_eos": True, "cache_salt": "tenant-A"}
        headers = {"Authorization": "Bearer client-key"}
        threads = [threading.Thread(target=httpx.post, args=(s.url + "/v1/completions",),
                                    kwargs={"json": body, "headers": headers, "timeout": 60}) for _ in range(3)]
        threads[0].start()
        time.sleep(0.3)  # the first computes the prompt; the next two share its blocks
        for t in threads[1:]:
            t.start()

        def snapshot(key: str) -> dict:
            r = httpx.get(s.url + "/v1/engine/kv", headers={"Authorization": f"Bearer {key}"})
            assert r.status_code == 200
            return r.json()

        deadline = time.monotonic() + 10
        while not (client_view := snapshot("client-key"))["most_shared"]:
            assert time.monotonic() < deadline, "no shared block seen"
            time.sleep(0.02)
        admin_view = snapshot("root-key")
        for t in threads:
            t.join(30)
    finally:
        s.stop()
    assert "SECRET" not in json.dumps(client_view) and "launch" not in json.dumps(client_view)
    assert all(row["text"] is None for row in client_view["most_shared"])
    assert any("SECRET" in (row["text"] or "") for row in admin_view["most_shared"]), admin_view["most_shared"]


def test_contract_fixes(served):
    url = served.url
    r = httpx.head(url + "/health")
    assert r.status_code == 200 and r.content == b""

    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2, "best_of": 3})
    assert r.status_code == 400 and error_of(r)["param"] == "best_of" and "best_of=3" in error_of(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "n": 2, "best_of": 2,
                                                  "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 2

    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi", "logit_bias": {"100000": 1}})
    assert r.status_code == 400 and error_of(r)["param"] == "logit_bias" and "100000" in error_of(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": [[1, 2], [3, 10 ** 400]]})
    assert r.status_code == 400 and error_of(r)["param"] == "prompt" and len(r.text) < 400  # not 401 digits back
    r = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                                                       "logprobs": True, "top_logprobs": 10 ** 6})
    assert r.status_code == 400 and error_of(r)["param"] == "top_logprobs"
    assert error_of(r)["message"] == "top_logprobs must be in [0, 20], got 1000000"
    # Found by the schema fuzzer: a tiny repetition penalty made float32 logits inf, and logprobs null.
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi hi", "repetition_penalty": 1e-300})
    assert r.status_code == 400 and error_of(r)["param"] == "repetition_penalty"
    r = httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": "hi hi", "repetition_penalty": 0.01,
                                                  "logprobs": 1, "max_tokens": 4})
    assert r.status_code == 200 and None not in r.json()["choices"][0]["logprobs"]["token_logprobs"]
    r = httpx.post(url + "/v1/completions", content=b"prompt=hi", headers={"content-type": "text/plain"})
    assert r.status_code == 400 and "application/json" in error_of(r)["message"]
    r = httpx.post(url + "/v1/completions", json={"model": "m" * 100_000, "prompt": "hi"})
    assert r.status_code == 404 and len(r.content) < 1000
    wait_idle(served.engine)


def test_503_carries_retry_after():
    s = Served(make_engine())
    try:
        s.async_engine.begin_shutdown(0.0)
        r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == "5", r.text
        r = httpx.get(s.url + "/health")
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.json()["status"] == "shutting down"
    finally:
        s.stop()
