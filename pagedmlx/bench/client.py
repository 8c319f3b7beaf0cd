"""One benchmark request: the request body for /v1/completions or /v1/chat/completions, and
`send_request`, which streams it over httpx, reads the events itself (sse.py) and times them.

The timing, as vLLM's request functions measure it, from just before the request is sent:
TTFT to the first chunk with output text, ITL the gaps between consecutive chunks with output text,
E2EL (`latency`) to the end of the stream. Output tokens are the usage chunk's `completion_tokens`
(requests ask for it with stream_options.include_usage), or else the number of chunks with text."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Optional

import httpx

from pagedmlx.bench.datasets import SampleRequest
from pagedmlx.bench.sse import SSEParser, read_payload

CHAT_ENDPOINT = "/v1/chat/completions"
COMPLETIONS_ENDPOINT = "/v1/completions"


@dataclass
class RequestRecord:
    """One request's outcome; times in seconds, `start_time` on time.perf_counter's clock."""

    prompt_len: int = 0
    expected_output_len: int = 0
    success: bool = False
    start_time: float = 0.0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    output_tokens: int = 0
    generated_text: str = ""
    error: str = ""


def request_body(endpoint: str, model: str, sample: SampleRequest, ignore_eos: bool = False,
                 temperature: float = 0.0, extra_body: Optional[dict] = None) -> dict:
    body: dict[str, Any] = {"model": model, "temperature": temperature, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint.endswith("chat/completions"):
        if not isinstance(sample.prompt, str):
            raise ValueError("the chat endpoint takes text prompts")
        body.update(messages=[{"role": "user", "content": sample.prompt}],
                    max_completion_tokens=sample.expected_output_len)
    else:
        body.update(prompt=sample.prompt, max_tokens=sample.expected_output_len)
    if ignore_eos:
        body["ignore_eos"] = True
    body.update(extra_body or {})
    return body


async def send_request(client: httpx.AsyncClient, url: str, body: dict, headers: Optional[dict] = None,
                       prompt_len: Optional[int] = None) -> RequestRecord:
    """Stream one request; never raises: a failure is a record with success False and `error`."""
    rec = RequestRecord(prompt_len=prompt_len or 0,
                        expected_output_len=body.get("max_tokens") or body.get("max_completion_tokens") or 0)
    stream = _Stream(rec)
    rec.start_time = stream.last = time.perf_counter()
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", errors="replace")
                rec.error = f"HTTP {resp.status_code}: {text[:300]}"
                return rec
            parser = SSEParser()
            async for raw in resp.aiter_bytes():
                now = time.perf_counter()  # the events of one read arrived together
                for data in parser.feed(raw):
                    stream.event(data, now)
            for data in parser.close():
                stream.event(data, time.perf_counter())
        rec.latency = (stream.done_at or time.perf_counter()) - rec.start_time
        if not rec.error and stream.done_at is None:
            rec.error = "the stream ended before data: [DONE]"
        if not rec.error and stream.chunks == 0:
            rec.error = "no chunk with output text (nothing to time the first token by)"
    except Exception as exc:  # noqa: BLE001 - a transport error or a bad stream is this request's failure
        rec.error = f"{type(exc).__name__}: {exc}"
    rec.generated_text = "".join(stream.texts)
    rec.output_tokens = rec.output_tokens or stream.chunks
    rec.success = not rec.error
    return rec


class _Stream:
    """The timing state of one stream, event by event."""

    def __init__(self, rec: RequestRecord):
        self.rec, self.texts, self.chunks = rec, [], 0
        self.last = 0.0
        self.done_at: Optional[float] = None

    def event(self, data: str, now: float) -> None:
        rec = self.rec
        if self.done_at is not None or rec.error:
            return  # nothing after [DONE] or an error counts; the body is still read to its end
        p = read_payload(data)
        if p.error is not None:
            rec.error = f"error event: {p.error}"
        elif p.done:
            self.done_at = now
        if p.completion_tokens is not None:
            rec.output_tokens = p.completion_tokens
        if p.prompt_tokens:  # the server's count wins: it includes a chat template, a bos
            rec.prompt_len = p.prompt_tokens
        if p.text:
            if self.chunks == 0:
                rec.ttft = now - rec.start_time
            else:
                rec.itl.append(now - self.last)
            self.last, self.chunks = now, self.chunks + 1
            self.texts.append(p.text)
