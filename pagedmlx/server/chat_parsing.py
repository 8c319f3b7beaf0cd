"""One chat choice's output, parsed: the reasoning parser first (reasoning_content), then its content
through the tool parser (tool_calls), whole or delta by delta. Plain chats (neither) never come here:
they keep the streaming fast path of sse.py."""

from __future__ import annotations

from typing import Any, Callable, Optional

from pagedmlx.server.chat_tools import ChatParsing, tool_choice_of
from pagedmlx.server.protocol import AssistantMessage, DeltaMessage
from pagedmlx.server.protocol_tools import ChatCompletionNamedToolChoiceParam
from pagedmlx.server.reasoning import REASONING_PARSERS, ReasoningParser
from pagedmlx.server.tool_parsers import TOOL_PARSERS, ToolParser
from pagedmlx.server.tool_parsers.forced_tool_parser import NamedToolParser, RequiredToolParser


PROMPT_TAIL_TOKENS = 16  # enough for "</think>" and the whitespace after it, in any tokenizer


class ChatOutputParser:
    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolParser],
                 include_reasoning: bool = True):
        self.reasoning_parser = reasoning
        self.tool_parser = tools
        self.include_reasoning = include_reasoning

    def feed(self, delta_text: str, finished: bool = False, truncated: bool = False) -> Optional[DeltaMessage]:
        """The delta this much more text gives (None: nothing to send yet). `truncated`: the output ended
        at max_tokens, so a tool call it leaves open is not one (ToolParser)."""
        reasoning, content = None, delta_text
        if self.reasoning_parser is not None:
            delta = self.reasoning_parser.extract_reasoning_streaming(delta_text, finished)
            reasoning, content = (delta.reasoning_content, delta.content) if delta is not None else (None, None)
        calls = None
        if self.tool_parser is not None:
            delta = self.tool_parser.extract_tool_calls_streaming(content or "", finished, truncated)
            content, calls = (delta.content, delta.tool_calls) if delta is not None else (None, None)
            reasoning = _join(reasoning, delta.reasoning_content if delta is not None else None)
        if not self.include_reasoning:
            reasoning = None
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(content=content, reasoning_content=reasoning, reasoning=reasoning, tool_calls=calls)

    def whole(self, text: str, truncated: bool = False) -> AssistantMessage:
        """The message of a whole response: the stream of one delta."""
        delta = self.feed(text, finished=True, truncated=truncated) or DeltaMessage()
        calls = [_call(c) for c in delta.tool_calls or []] or None
        content = delta.content if delta.content or calls or delta.reasoning else ""  # plain: "" as without parsers
        return AssistantMessage(content=content, reasoning_content=delta.reasoning_content, reasoning=delta.reasoning,
                                tool_calls=calls)

    def finish_reason(self, reason: Optional[str]) -> Optional[str]:
        """OpenAI's "tool_calls" where the model stopped after making calls."""
        if reason == "stop" and self.tool_parser is not None and self.tool_parser.finish_with_tool_calls:
            return "tool_calls"
        return reason


def _join(a: Optional[str], b: Optional[str]) -> Optional[str]:
    return (a or "") + (b or "") or None


def _call(delta: Any) -> Any:
    from pagedmlx.server.protocol_tools import FunctionCall, ToolCall

    return ToolCall(id=delta.id, function=FunctionCall(name=delta.function.name, arguments=delta.function.arguments))


def chat_parser_factory(req: Any, parsing: ChatParsing, tokenizer: Any, params: Any, forced: bool,
                        prompt: Optional[list[int]] = None) -> Optional[Callable[[], ChatOutputParser]]:
    """A maker of one ChatOutputParser per choice, or None for a plain chat. `forced`: tool_choice
    "required" / named is enforced by a grammar (its output is JSON, read without the tool parser).
    `prompt`: its token ids (their end tells a reasoning parser whether the template closed the
    reasoning). Adjusts `params` (special tokens kept where a parser's markers are special tokens)."""
    choice = tool_choice_of(req)
    if forced:
        tool_class: Optional[type[ToolParser]] = (NamedToolParser
                                                  if isinstance(choice, ChatCompletionNamedToolChoiceParam)
                                                  else RequiredToolParser)
    elif choice == "auto" and req.tools and parsing.auto_tools:
        tool_class = TOOL_PARSERS[parsing.tool_call_parser]
    else:
        tool_class = None
    reasoning_class = REASONING_PARSERS[parsing.reasoning_parser] if parsing.reasoning_parser else None
    if reasoning_class is not None and getattr(reasoning_class, "harmony", False) and tool_class is not None \
            and tool_class is TOOL_PARSERS["openai"]:
        reasoning_class = None  # the harmony tool parser reads the analysis channel too
    if tool_class is None and reasoning_class is None:
        return None
    for cls in (tool_class, reasoning_class):
        if cls is not None and not cls.skip_special_tokens:
            params.skip_special_tokens = False

    tail = tokenizer.decode(prompt[-PROMPT_TAIL_TOKENS:]) if reasoning_class and prompt and tokenizer else ""

    def make() -> ChatOutputParser:
        return ChatOutputParser(reasoning_class(tokenizer, req, tail) if reasoning_class else None,
                                tool_class(tokenizer, req) if tool_class else None, req.include_reasoning)

    return make
