"""Server-sent events of the streaming responses, without a pydantic model per token.

A stream's plain chunks (text, a finish reason, no logprobs, no token ids) differ only in the
choice's index, text and finish fields, so each stream serializes its chunk once through the
pydantic model, with markers in those places, and fills in the markers for every chunk after. The
result is the model's own JSON byte for byte (tests/test_sse.py). Chunks with logprobs or token ids
go through the models as before.

Outputs that reached a stream while its consumer was busy are merged into one chunk (`coalesce`):
the client gets the same text in fewer events, and a slow consumer never falls further behind.
"""

from __future__ import annotations

import json
from typing import Any, Optional

import msgspec

from pagedmlx.outputs import EngineOutput

_INDEX, _TEXT, _FINISH, _STOP = "\x01index\x01", "\x01text\x01", "\x01finish\x01", "\x01stop\x01"
_json = msgspec.json.Encoder()


# Line breaks to str.splitlines (httpx's iter_lines, many SSE readers) that JSON writes raw: as escapes,
# the JSON value is the same and the event stays one line. In UTF-8 these byte runs are only these characters.
_LINE_BREAKS = tuple((ch.encode(), f"\\u{ord(ch):04x}".encode()) for ch in ("\u2028", "\u2029", "\x85"))


def event(payload: str) -> bytes:
    """One `data:` event (sse-starlette passes bytes through as they are); `payload` is JSON or [DONE]."""
    data = payload.encode()
    for raw, escaped in _LINE_BREAKS:
        if raw in data:
            data = data.replace(raw, escaped)
    return b"data: " + data + b"\n\n"


class ChunkTemplate:
    """The JSON of a chunk model whose one choice has index, text, finish_reason and stop_reason."""

    def __init__(self, chunk: Any):
        """chunk: the stream's chunk model with one choice (index 0, no text, not finished). Raises
        ValueError where a marker cannot be placed (an id or model name that holds one)."""
        choice = chunk.choices[0]
        choice.index, choice.finish_reason, choice.stop_reason = _INDEX, _FINISH, _STOP  # type: ignore[assignment]
        if hasattr(choice, "delta"):
            choice.delta.content = _TEXT
        else:
            choice.text = _TEXT
        text = chunk.model_dump_json(warnings=False).replace("{", "{{").replace("}", "}}")  # index: a str here
        for marker, field in ((_INDEX, "{0}"), (_FINISH, "{1}"), (_STOP, "{2}"), (_TEXT, "{3}")):
            marker = json.dumps(marker)
            if text.count(marker) != 1:
                raise ValueError(f"no template for this chunk: {marker} appears {text.count(marker)} times")
            text = text.replace(marker, field)
        self._format = text.format

    @classmethod
    def of(cls, chunk: Any) -> Optional["ChunkTemplate"]:
        """The template, or None where it cannot be made (the chunks then go through the model)."""
        try:
            return cls(chunk)
        except ValueError:
            return None

    def render(self, index: int, text: str, finish_reason: Optional[str], stop_reason: Any) -> bytes:
        return event(self._format(index, _value(finish_reason), _value(stop_reason), _value(text)))


def _value(value: Any) -> str:
    return "null" if value is None else _json.encode(value).decode()


def coalesce(outputs: list[tuple[int, EngineOutput]]) -> list[tuple[int, EngineOutput]]:
    """Merge each sample's consecutive outputs (pairs of (choice index, output), in order) into one."""
    merged: dict[int, EngineOutput] = {}
    for index, out in outputs:
        prev = merged.get(index)
        merged[index] = out if prev is None else _merge(prev, out)
    return list(merged.items())


def _merge(a: EngineOutput, b: EngineOutput) -> EngineOutput:
    lps = (a.new_logprobs or []) + (b.new_logprobs or []) if a.new_logprobs is not None or b.new_logprobs is not None \
        else None
    return EngineOutput(b.request_id, b.prompt_token_ids, b.token_ids, b.text, a.new_token_ids + b.new_token_ids,
                        a.new_text + b.new_text, b.finished, b.finish_reason, b.stop_reason, b.logprobs, lps,
                        b.num_cached_tokens, b.error, b.prompt_logprobs)
