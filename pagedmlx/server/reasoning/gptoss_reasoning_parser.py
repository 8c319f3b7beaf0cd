"""openai_gptoss: gpt-oss's analysis channel as reasoning, its final channel as content (the harmony
reader of tool_parsers/openai_tool_parser.py, without tool calls: a call's body is content)."""

from __future__ import annotations

from typing import Any, Optional

from pagedmlx.server.reasoning.abs_reasoning_parsers import ReasoningParser
from pagedmlx.server.tool_parsers.openai_tool_parser import OpenAIToolParser


class GptOssReasoningParser(ReasoningParser):
    skip_special_tokens = False
    harmony = True  # with the `openai` tool parser, that one reads everything (chat_parsing.py)

    def __init__(self, tokenizer: Any = None, request: Any = None, prompt_tail: str = ""):
        super().__init__(tokenizer, request, prompt_tail)
        self.reader = OpenAIToolParser(tokenizer, request, tools=False)

    def extract_reasoning_streaming(self, delta_text: str, finished: bool = False) -> Optional[Any]:
        delta = self.reader.extract_tool_calls_streaming(delta_text, finished)
        if delta is not None:
            self.reasoning_text += delta.reasoning_content or ""
            self.content_text += delta.content or ""
        return delta
