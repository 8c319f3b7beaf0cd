"""openai: gpt-oss's harmony format, read from text (the detokenizer keeps the special tokens):

  <|channel|>analysis<|message|>The user wants the weather.<|end|>
  <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>
  ... or, answering: <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

The analysis channel is reasoning, the final channel content, a commentary message to functions.NAME a
call whose arguments are its body as written; other commentary (a preamble) is content. The recipient
may also stand before the channel (`<|start|>assistant to=functions.f<|channel|>commentary json`).
<|call|> and <|return|> end generation (stop tokens): the text may end without them.
With `tools=False` (the reasoning parser alone) a call's body is content."""

from __future__ import annotations

import re
from typing import Any

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser

_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_HEADER_STARTS = ("<|start|>", "<|channel|>")
_BODY_ENDS = ("<|end|>", "<|call|>", "<|return|>")
_MAX_HEADER = 512


class OpenAIToolParser(ToolParser):
    skip_special_tokens = False
    message_token = "<|message|>"

    def __init__(self, tokenizer: Any = None, request: Any = None, tools: bool = True):
        super().__init__(tokenizer, request)
        self.tools = tools
        self.channel = ""
        self.kind = "content"  # where the current body goes: "reasoning", "content" or "call"

    def parse(self, final: bool) -> None:
        while not self.raw:
            if self.mode == "text":  # a header, up to <|message|>
                if not self._header(final):
                    return
            elif not self._body(final):
                return

    def _header(self, final: bool) -> bool:
        self.skip_whitespace()
        rest = self.text[self.pos:]
        if not rest:
            return False
        if not rest.startswith(_HEADER_STARTS):
            if final or not any(m.startswith(rest) for m in _HEADER_STARTS):
                self.call_start = self.pos
                self.fail()  # not harmony: content from here
            return False
        end = self.text.find(self.message_token, self.pos)
        if end == -1:
            if final or len(rest) > _MAX_HEADER:
                self.call_start = self.pos
                self.fail()
            return False
        header = self.text[self.pos:end]
        self.pos = end + len(self.message_token)
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        self.channel = channel.group(1) if channel else ""
        name = recipient.group(1) if recipient else ""
        if self.tools and name.startswith("functions.") and len(name) > len("functions."):
            self.kind = "call"
            self.begin_call(name[len("functions."):])
        else:
            self.kind = "reasoning" if self.channel == "analysis" else "content"
        self.mode = "body"
        return True

    def _body(self, final: bool) -> bool:
        found, at = self.find_marker(_BODY_ENDS + _HEADER_STARTS, final)
        body = self.text[self.pos:at]
        if self.kind == "call":
            self.arguments(body)
        elif self.kind == "reasoning":
            self.reasoning(body)
        else:
            self.content(body)
        self.pos = at
        if found is None:
            return False
        if found in _BODY_ENDS:
            self.pos += len(found)
        if self.kind == "call":
            self.end_call()
        self.mode = "text"
        return True
