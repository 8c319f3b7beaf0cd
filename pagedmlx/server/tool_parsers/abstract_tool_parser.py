"""ToolParser (vLLM's name): the model's text in, content and tool calls out.

One code path serves whole responses and streams. A parser keeps the text so far and a cursor, and
`parse(final)` moves the cursor as far as the text decides: content up to a possible marker, a
call's name once complete, its arguments as they are written. Where the text so far cannot decide
(a marker may be starting), it waits for more. Decisions depend on the text alone, never on where a
delta ended, so a stream's deltas add up to exactly what the whole text gives (tests/test_tool_calls.py
checks every split of every fixture). A whole response is the stream of one delta.

Whitespace next to a tool call is dropped: the run before a call's marker, and a trailing run once
a call was made (Qwen writes "\\n\\n<tool_call>..."; OpenAI's content is then null). Text the format
cannot explain (a broken call) is content from there on, as vLLM returns unparsable output as content.

An output cut by max_tokens (`truncated`) keeps only what was parsed completely: a call left open is
dropped where it has not been streamed yet, and the unsettled end of the text (what might be a marker
or a call's beginning) is neither content nor a call.
"""

from __future__ import annotations

from typing import Any, Optional

from pagedmlx.server.protocol_tools import (DeltaFunctionCall, DeltaToolCall, ExtractedToolCallInformation,
                                            FunctionCall, ToolCall, make_tool_call_id)
from pagedmlx.server.tool_parsers.json_scan import WHITESPACE, ArgumentsReader, CallReader


def partial_marker(text: str, start: int, markers: tuple[str, ...]) -> int:
    """Length of the longest end of text[start:] that is a proper beginning of one of `markers`."""
    best = 0
    for marker in markers:
        for n in range(min(len(marker) - 1, len(text) - start), best, -1):
            if text.endswith(marker[:n]):
                best = n
                break
    return best


class ToolParser:
    """Subclasses implement parse(final) over self.text from self.pos, with content(), begin_call(),
    arguments() and end_call() (or read_call / read_arguments), fail() where the text breaks the format."""

    # False: the format's markers are special tokens, which the detokenizer must keep (chat_parser_factory)
    skip_special_tokens = True
    tool_call_id_factory = staticmethod(make_tool_call_id)

    def __init__(self, tokenizer: Any = None, request: Any = None):
        self.model_tokenizer = tokenizer
        self.request = request
        self.text = ""
        self.pos = 0
        self.mode = "text"
        self.raw = False  # after a broken call: everything left is content
        self.call_start = 0  # where the current call's text began (its marker)
        self.reader: Any = None  # the current call's CallReader or ArgumentsReader
        self._calls: list[list[str]] = []  # [id, name, arguments] of each call reported
        self.content_text = ""
        self.reasoning_text = ""  # formats that carry reasoning too (harmony)
        self.max_calls = None if request is None or getattr(request, "parallel_tool_calls", True) else 1
        self._open: Optional[list[str]] = None  # the call being streamed
        self._dropping = False  # a call past max_calls: read, not reported
        self._args_sent = 0
        self._pending_ws = ""
        self._delta_content: list[str] = []
        self._delta_reasoning: list[str] = []
        self._delta_calls: dict[int, list[Optional[str]]] = {}  # index -> [id, name, arguments] this delta

    # ---- vLLM's entry points ------------------------------------------------------------------

    def extract_tool_calls(self, model_output: str, request: Any = None) -> ExtractedToolCallInformation:
        self.extract_tool_calls_streaming(model_output, finished=True)
        return ExtractedToolCallInformation(tools_called=bool(self._calls), tool_calls=self.tool_calls,
                                            content=self.content_text or None)

    def extract_tool_calls_streaming(self, delta_text: str, finished: bool = False,
                                     truncated: bool = False) -> Optional[Any]:
        """The DeltaMessage this much more text gives (None: nothing yet). vLLM passes previous and
        current text and token ids too; a parser here keeps its own text. `truncated`: the output
        ended at max_tokens (with `finished`)."""
        from pagedmlx.server.protocol import DeltaMessage

        self.text += delta_text
        if not self.raw:
            self.parse(finished and not truncated)  # cut short: the text's end decides nothing
        if self.raw:
            self.content(self.text[self.pos:])
            self.pos = len(self.text)
        if finished:
            self._finish(truncated)
        content = "".join(self._delta_content) or None
        reasoning = "".join(self._delta_reasoning) or None
        calls = [DeltaToolCall(index=i, id=c[0], type="function" if c[0] else None,
                               function=DeltaFunctionCall(name=c[1], arguments=c[2]))
                 for i, c in self._delta_calls.items()] or None
        self._delta_content, self._delta_reasoning, self._delta_calls = [], [], {}
        if not (content or reasoning or calls):
            return None
        return DeltaMessage(content=content, reasoning_content=reasoning, tool_calls=calls)

    @property
    def tool_calls(self) -> list[ToolCall]:
        return [ToolCall(id=i, function=FunctionCall(name=n, arguments=a)) for i, n, a in self._calls]

    @property
    def finish_with_tool_calls(self) -> bool:
        """Whether the response's finish_reason becomes "tool_calls" (OpenAI's: a call was made)."""
        return bool(self._calls)

    def parse(self, final: bool) -> None:
        raise NotImplementedError

    # ---- what a parser reports ----------------------------------------------------------------

    def content(self, text: str) -> None:
        body = text.rstrip()
        if body:
            self._emit_content(self._pending_ws + body)
            self._pending_ws = text[len(body):]
        else:
            self._pending_ws += text

    def reasoning(self, text: str) -> None:
        if text:
            self._delta_reasoning.append(text)
            self.reasoning_text += text

    def begin_call(self, name: str) -> None:
        self._pending_ws = ""
        self._args_sent = 0
        if self.max_calls is not None and len(self._calls) >= self.max_calls:
            self._dropping = True
            return
        self._open = [self.tool_call_id_factory(), name, ""]
        self._calls.append(self._open)
        self._delta_calls[len(self._calls) - 1] = [self._open[0], name, ""]

    def arguments(self, text: str) -> None:
        if self._open is None or not text:
            return
        self._open[2] += text
        delta = self._delta_calls.setdefault(len(self._calls) - 1, [None, None, ""])
        delta[2] += text

    def end_call(self) -> None:
        self._open, self._dropping, self.reader = None, False, None

    @property
    def in_call(self) -> bool:
        return self._open is not None or self._dropping

    def fail(self) -> None:
        """The text breaks the format here: a call not yet reported becomes content from its marker,
        one already streamed ends as it is; everything after is content."""
        if self.in_call:
            self.end_call()
        else:
            self.pos = self.call_start
        self.reader = None
        self.raw = True

    def _drop_open_call(self) -> None:
        """Unreport the call being read: a whole response never shows it (a stream may have sent its start)."""
        index = len(self._calls) - 1
        self._calls.pop()
        self._delta_calls.pop(index, None)
        self._open = None

    def _emit_content(self, text: str) -> None:
        self._delta_content.append(text)
        self.content_text += text

    def _finish(self, truncated: bool = False) -> None:
        # cut in a call, or where one may begin: the whitespace before it is no content either
        cut = truncated and (self.mode != "text" or self.in_call or self.reader is not None
                             or self.pos < len(self.text))
        if truncated and self._open is not None:
            self._drop_open_call()
        if self.in_call:
            self.end_call()
        if self._pending_ws and not self._calls and not cut:
            self._emit_content(self._pending_ws)
        self._pending_ws = ""

    # ---- reading helpers ----------------------------------------------------------------------

    def find_marker(self, markers: tuple[str, ...], final: bool) -> tuple[Optional[str], int]:
        """The first of `markers` from the cursor and where it starts; with none found, (None, where the
        settled text ends: before what might be the start of one, unless final)."""
        found, at = None, len(self.text)
        for marker in markers:
            i = self.text.find(marker, self.pos)
            if i != -1 and i < at:
                found, at = marker, i
        if found is None and not final:
            at -= partial_marker(self.text, self.pos, markers)
        return found, at

    def text_until(self, markers: tuple[str, ...], final: bool) -> Optional[str]:
        """Content up to the first of `markers` (the cursor then stands on it; returned), or up to
        what might be the start of one (None: wait for more)."""
        found, at = self.find_marker(markers, final)
        self.content(self.text[self.pos:at])
        self.pos = at
        return found

    def skip_whitespace(self) -> bool:
        """Past whitespace; whether a character follows."""
        while self.pos < len(self.text) and self.text[self.pos] in WHITESPACE:
            self.pos += 1
        return self.pos < len(self.text)

    def at_object(self, final: bool) -> bool:
        """Past whitespace to a JSON object's "{" (True). False: more text is needed, or something
        else stands there (then fail() has run)."""
        if not self.skip_whitespace():
            if final:
                self.fail()
            return False
        if self.text[self.pos] != "{":
            self.fail()
            return False
        return True

    def at_marker(self, marker: str, final: bool) -> Optional[bool]:
        """Whether the text at the cursor is `marker` (then consumed); None: cannot tell yet."""
        rest = self.text[self.pos:self.pos + len(marker)]
        if rest == marker:
            self.pos += len(marker)
            return True
        if marker.startswith(rest) and not final:
            return None
        return False

    def read_call(self, final: bool, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> bool:
        """Feed the call object at the cursor to a CallReader; True once it is complete and reported.
        False: more text is needed, or the call broke (then fail() has run)."""
        if self.reader is None:
            self.reader = CallReader(args_keys)
        reader = self.reader
        try:
            while not reader.done:
                self.pos = reader.feed_run(self.text, self.pos)
                if self.pos >= len(self.text):
                    break
                reader.feed(self.text[self.pos])
                self.pos += 1
                if reader.name is not None and not self.in_call:
                    self.begin_call(reader.name)
            self._send_arguments(reader.arguments)
            if not reader.done:
                if final and self.in_call:
                    self.end_call()  # cut short: the call stays as streamed
                elif final:
                    self.fail()
                return False
            arguments = reader.finish()
        except ValueError:
            self._send_arguments(reader.arguments)
            self.fail()
            return False
        self._send_arguments(arguments)
        self.end_call()
        return True

    def _send_arguments(self, arguments: str) -> None:
        """The current call's arguments are `arguments` so far: report what is new."""
        if self.in_call and len(arguments) > self._args_sent:
            self.arguments(arguments[self._args_sent:])
            self._args_sent = len(arguments)

    def read_arguments(self, final: bool) -> bool:
        """Feed the arguments object at the cursor (its call already begun) to an ArgumentsReader,
        streaming it; True once complete."""
        if self.reader is None:
            self.reader = ArgumentsReader()
        reader = self.reader
        try:
            while not reader.done:
                self.pos = reader.feed_run(self.text, self.pos)
                if self.pos >= len(self.text):
                    break
                reader.feed(self.text[self.pos])
                self.pos += 1
        except ValueError:
            self._send_arguments(reader.text)
            self.fail()
            return False
        self._send_arguments(reader.text)
        if not reader.done:
            if final:
                self.end_call()
            return False
        self.end_call()
        return True
