"""Server-sent events as OpenAI-compatible servers stream them: `SSEParser` turns the byte stream,
cut anywhere by the network, into the `data:` payload of each event; `read_payload` says what one
payload of a completions or chat completions stream carries."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Optional


class SSEParser:
    """Incremental: `feed` the bytes as they arrive, get the complete events' data so far.

    An event ends at a blank line; its `data:` lines are joined with newlines (the SSE spec); comment
    lines (`:` first, the keep-alive pings) and other fields (`event:`, `id:`, `retry:`) are dropped.
    Lines end in \\n, \\r\\n or \\r, and a read may stop inside a line or inside a UTF-8 character."""

    def __init__(self) -> None:
        self._buffer = b""
        self._data: list[str] = []

    def feed(self, chunk: bytes) -> list[str]:
        self._buffer += chunk
        events: list[str] = []
        while True:
            cut = _line_end(self._buffer)
            if cut is None:
                return events
            end, after = cut
            line, self._buffer = self._buffer[:end], self._buffer[after:]
            self._line(line.decode("utf-8", errors="replace"), events)

    def close(self) -> list[str]:
        """The last event, when the stream ended without its blank line."""
        events: list[str] = []
        if self._buffer:
            self._line(self._buffer.decode("utf-8", errors="replace"), events)
            self._buffer = b""
        self._line("", events)
        return events

    def _line(self, line: str, events: list[str]) -> None:
        if not line:
            if self._data:
                events.append("\n".join(self._data))
                self._data = []
        elif line.startswith("data:"):
            value = line[5:]
            self._data.append(value[1:] if value.startswith(" ") else value)


def _line_end(buffer: bytes) -> Optional[tuple[int, int]]:
    """(end of the first line, start of the next) in `buffer`, or None when no line is complete yet.
    A final \\r may be the first half of \\r\\n: it waits for the next byte."""
    n, r = buffer.find(b"\n"), buffer.find(b"\r")
    if r == -1 or (n != -1 and n < r):
        return None if n == -1 else (n, n + 1)
    if r + 1 == len(buffer):
        return None
    return (r, r + 2) if buffer[r + 1:r + 2] == b"\n" else (r, r + 1)


@dataclass
class Payload:
    """What one `data:` payload carries. `text` is the new output (completions' `text`, chat's
    `delta.content`, or a reasoning model's `delta.reasoning_content` / `delta.reasoning`);
    `has_choice` whether it had a choice at all (chat's first chunk carries only the role)."""

    done: bool = False
    error: Optional[str] = None
    has_choice: bool = False
    text: str = ""
    completion_tokens: Optional[int] = None
    prompt_tokens: Optional[int] = None


def read_payload(data: str) -> Payload:
    if data.strip() == "[DONE]":
        return Payload(done=True)
    try:
        chunk = json.loads(data)
    except json.JSONDecodeError:
        return Payload(error=f"not JSON: {data[:200]!r}")
    if not isinstance(chunk, dict):
        return Payload(error=f"not a JSON object: {data[:200]!r}")
    if chunk.get("error"):
        error = chunk["error"]
        return Payload(error=str(error.get("message", error)) if isinstance(error, dict) else str(error))
    out = Payload()
    usage = chunk.get("usage")
    if isinstance(usage, dict):
        out.completion_tokens, out.prompt_tokens = usage.get("completion_tokens"), usage.get("prompt_tokens")
    choices = chunk.get("choices")
    if choices:
        choice = choices[0]
        out.has_choice = True
        delta = choice.get("delta")
        if isinstance(delta, dict):
            out.text = delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""
        else:
            out.text = choice.get("text") or ""
    return out
