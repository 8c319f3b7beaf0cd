"""BaseThinkingReasoningParser (vLLM's): reasoning between a start and an end token, <think> and
</think>. The start token is optional (templates that open the block in the prompt: DeepSeek-R1-0528,
Qwen3.5), so everything up to the end token is reasoning; with no end token, all of it is (the
model was cut short while thinking). After the end token, content, as the model wrote it."""

from __future__ import annotations

from typing import Optional

from pagedmlx.server.reasoning.abs_reasoning_parsers import ReasoningParser
from pagedmlx.server.tool_parsers.json_scan import WHITESPACE


class BaseThinkingReasoningParser(ReasoningParser):
    start_token = "<think>"
    end_token = "</think>"

    def thinking(self) -> bool:
        """Whether the output starts in reasoning: not when the prompt ends by closing the block (a
        template told the model not to think; vLLM's prompt_is_reasoning_end)."""
        return not self.prompt_tail.rstrip().endswith(self.end_token)

    def parse(self, final: bool) -> None:
        if self.mode == "start" and not self._start(final):
            return
        if self.mode == "reasoning":
            end = self.reasoning_end(final)
            if end is None:
                self.emit_held_back(self.held_markers(), final, "reasoning")
                return
            at, skip = end
            self.emit_until(at, "reasoning")
            if skip is None:  # undecided from `at` on: wait
                return
            self.pos += skip
            self.mode = "content"
        if self.mode == "content":
            self.emit_until(len(self.text), "content")

    def _start(self, final: bool) -> bool:
        """Past an opening start token (leading whitespace and all); False: wait for more text."""
        if not self.thinking():
            self.mode = "content"
            return True
        rest = self.text[self.pos:].lstrip(WHITESPACE)
        if rest.startswith(self.start_token):
            self.pos = len(self.text) - len(rest) + len(self.start_token)
        elif self.start_token.startswith(rest) and not final:
            return False
        self.mode = "reasoning"
        return True

    def held_markers(self) -> tuple[str, ...]:
        return (self.end_token,)

    def reasoning_end(self, final: bool) -> Optional[tuple[int, Optional[int]]]:
        """Where reasoning ends: (index, length of the marker to drop there); (index, None): it may end
        there, the text so far cannot tell; None: not in the text so far."""
        at = self.text.find(self.end_token, self.pos)
        return None if at == -1 else (at, len(self.end_token))


class DeepSeekR1ReasoningParser(BaseThinkingReasoningParser):
    """deepseek_r1: DeepSeek-R1 and its distills, QwQ."""


class Qwen3ReasoningParser(BaseThinkingReasoningParser):
    """qwen3: Qwen3, 3.5, 3.6. `chat_template_kwargs: {"enable_thinking": false}` makes the template close
    the block in the prompt: all output is content. Qwen3.5 may start a call (<tool_call> then
    <function=) without closing </think>: that ends the reasoning too, the call going to the content."""

    tool_call_start = "<tool_call>"
    function_start = "<function"

    def thinking(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False and super().thinking()

    def held_markers(self) -> tuple[str, ...]:
        return (self.end_token, self.tool_call_start)

    def reasoning_end(self, final: bool) -> Optional[tuple[int, Optional[int]]]:
        end = self.text.find(self.end_token, self.pos)
        search = self.pos
        while True:
            at = self.text.find(self.tool_call_start, search, end if end != -1 else len(self.text))
            if at == -1:
                return None if end == -1 else (end, len(self.end_token))
            after = self.text[at + len(self.tool_call_start):].lstrip(WHITESPACE)
            if after.startswith(self.function_start):
                return at, 0
            if self.function_start.startswith(after) and not final:
                return at, None
            search = at + 1
