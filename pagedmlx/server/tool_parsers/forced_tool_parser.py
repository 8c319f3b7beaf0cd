"""The output of a request whose tool_choice forces a call: vLLM enforces it with a JSON grammar
(chat_tools.tool_choice_structured_outputs) and reads the JSON itself, with no format's markers.

    tool_choice "required": [{"name": "get_weather", "parameters": {"city": "Paris"}}, ...]
    tool_choice {"type": "function", "function": {"name": "get_weather"}}: {"city": "Paris"}
"""

from __future__ import annotations

from typing import Any, Optional

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser
from pagedmlx.server.tool_parsers.array_calls import CallArray


class RequiredToolParser(ToolParser):
    """Each call is reported whole once its object closes, so that one identical to an earlier call of the
    response (a model that repeats its call until max_tokens) is dropped, and one cut short never shows."""

    def __init__(self, tokenizer: Any = None, request: Any = None):
        super().__init__(tokenizer, request)
        self.array = CallArray(("parameters",))
        self._reading: Optional[list[str]] = None  # [name, arguments] of the call being read
        self._seen: set[tuple[str, str]] = set()

    def begin_call(self, name: str) -> None:
        self._pending_ws = ""
        self._args_sent = 0
        self._reading = [name, ""]

    def arguments(self, text: str) -> None:
        if self._reading is not None:
            self._reading[1] += text

    @property
    def in_call(self) -> bool:
        return self._reading is not None or super().in_call

    def end_call(self) -> None:
        call, complete = self._reading, self.reader is not None and self.reader.done
        self._reading = None
        if call is not None and complete and tuple(call) not in self._seen:
            self._seen.add((call[0], call[1]))
            super().begin_call(call[0])
            super().arguments(call[1])
        super().end_call()

    def parse(self, final: bool) -> None:
        if self.mode == "text":
            if not self.skip_whitespace():
                return
            if self.text[self.pos] != "[":
                self.pos, self.raw = 0, True
                return
            self.mode = "array"
        if self.mode == "array" and self.array.parse(self, final):
            self.mode = "rest"
        if self.mode == "rest":  # nothing, the grammar permitting
            self.content(self.text[self.pos:])
            self.pos = len(self.text)


class NamedToolParser(ToolParser):
    def __init__(self, tokenizer: Any = None, request: Any = None):
        super().__init__(tokenizer, request)
        self.name = request.tool_choice.function.name

    def parse(self, final: bool) -> None:
        if self.mode == "text":
            if not self.skip_whitespace():
                return
            if self.text[self.pos] != "{":
                self.pos, self.raw = 0, True
                return
            self.begin_call(self.name)
            self.mode = "arguments"
        if self.mode == "arguments" and self.read_arguments(final):
            self.mode = "rest"
        if self.mode == "rest":
            self.content(self.text[self.pos:])
            self.pos = len(self.text)

    @property
    def finish_with_tool_calls(self) -> bool:
        return False  # OpenAI's finish_reason for a named function is "stop"
