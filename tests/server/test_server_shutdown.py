"""Shutdown: SIGTERM, what systemd, launchd and Docker send, must drain and exit 0 as
Ctrl-C does; a stream still running at the drain deadline must end with a final chunk
(finish_reason "abort") and [DONE], not a cut connection."""

from __future__ import annotations

import json
import logging
import signal
import threading
import time

import httpx
from server_utils import MODEL, Served, ServeProcess, make_engine, sse_payloads


def _stream(url: str, body: dict, out: dict, key: int) -> None:
    try:
        with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
            out[key] = sse_payloads(r)
    except httpx.HTTPError as exc:
        out[key] = exc


def _ends_properly(payloads) -> str:
    """The finish_reason of a stream that ended with a final chunk and [DONE] (else an AssertionError)."""
    assert isinstance(payloads, list) and len(payloads) >= 2 and payloads[-1] == "[DONE]", payloads
    last = json.loads(payloads[-2])
    assert last["choices"] and last["choices"][0]["finish_reason"] is not None, last
    return last["choices"][0]["finish_reason"]


def _start_streams(url: str, short: int, long: int) -> tuple[list[threading.Thread], dict]:
    out: dict = {}
    bodies = [{"model": MODEL, "prompt": "Tell me a story", "max_tokens": 20, "ignore_eos": True}] * short + \
             [{"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True}] * long
    threads = [threading.Thread(target=_stream, args=(url, body, out, i)) for i, body in enumerate(bodies)]
    for t in threads:
        t.start()
    return threads, out


def test_sigterm_under_load_drains_and_exits_0():
    """SIGTERM used to end the process with status 143 (-15) and no cleanup; the streams still
    running at the drain deadline were cut with no final chunk and no [DONE]."""
    server = ServeProcess("--drain-timeout", "1", "--max-num-seqs", "16", step_sleep=0.01)
    try:
        threads, out = _start_streams(server.url, short=4, long=4)
        deadline = time.monotonic() + 30
        while not server.running(8):
            assert time.monotonic() < deadline
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(30)
        code, err = server.finish()
        took = time.monotonic() - t0
    finally:
        server.kill()
    assert code == 0, err
    assert [_ends_properly(out[i]) for i in range(8)] == ["length"] * 4 + ["abort"] * 4
    assert 0.9 < took < 10, took
    assert "drain: 4 responses were cut at the 1 s deadline" in err and "pagedmlx: stopped" in err


def test_drain_deadline_cut_ends_every_stream(caplog):
    """The same cut, in process: shutdown begins (as on a signal), the engine drains for 0.5 s,
    then every stream left gets its last chunk (finish_reason "abort"), usage if asked, and [DONE]."""
    engine = make_engine()
    step = engine.core.step
    engine.core.step = lambda: (time.sleep(0.01), step())[1]  # 240 tokens take > 2.4 s
    s = Served(engine, drain_timeout=0.5)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 240, "ignore_eos": True, "n": 2,
            "stream_options": {"include_usage": True}}
    threads, out = _start_streams(s.url, short=0, long=0)
    for i in range(4):
        threads.append(threading.Thread(target=_stream, args=(s.url, body, out, i)))
        threads[-1].start()
    deadline = time.monotonic() + 10
    while engine.get_num_unfinished_requests() < 8:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with caplog.at_level(logging.WARNING):
        t0 = time.monotonic()
        s.stop()  # uvicorn's shutdown, as a signal starts it
        for t in threads:
            t.join(10)
    assert time.monotonic() - t0 < 5
    for i in range(4):
        payloads = out[i]
        assert payloads[-1] == "[DONE]", payloads[-3:]
        chunks = [json.loads(p) for p in payloads[:-1]]
        reasons = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert sorted(r for r in reasons if r) == ["abort", "abort"]  # one per choice
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] < 2 * 240
    assert "drain: 4 responses were cut at the 0.5 s deadline" in caplog.text
