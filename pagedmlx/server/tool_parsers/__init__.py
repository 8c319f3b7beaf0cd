"""Tool call parsers (vLLM's vllm/entrypoints/openai/tool_parsers), by the names `--tool-call-parser`
takes; and the one a model's chat template points to, where that is unambiguous."""

from __future__ import annotations

from typing import Any, Optional

from pagedmlx.server.tool_parsers.abstract_tool_parser import ToolParser
from pagedmlx.server.tool_parsers.hermes_tool_parser import Hermes2ProToolParser
from pagedmlx.server.tool_parsers.llama_tool_parser import Llama3JsonToolParser
from pagedmlx.server.tool_parsers.mistral_tool_parser import MistralToolParser
from pagedmlx.server.tool_parsers.openai_tool_parser import OpenAIToolParser
from pagedmlx.server.tool_parsers.qwen3coder_tool_parser import Qwen3CoderToolParser

TOOL_PARSERS: dict[str, type[ToolParser]] = {
    "hermes": Hermes2ProToolParser,
    "qwen3_coder": Qwen3CoderToolParser,
    "llama3_json": Llama3JsonToolParser,
    "mistral": MistralToolParser,
    "openai": OpenAIToolParser,
}

# What a chat template writes for tool calls -> the parser; the first that matches wins (qwen3_coder's
# templates also write <tool_call>).
_TEMPLATE_MARKERS = (
    (("<|channel|>", "<|call|>"), "openai"),
    (("<function=", "<parameter="), "qwen3_coder"),
    (("<tool_call>",), "hermes"),
    (("[TOOL_CALLS]",), "mistral"),
    (("<|python_tag|>",), "llama3_json"),
    (("Environment: ipython",), "llama3_json"),
)


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}") from None


def chat_template_text(tokenizer: Any) -> str:
    """The tokenizer's chat template(s) as one text ("" without one)."""
    for obj in (tokenizer, getattr(tokenizer, "_tokenizer", None)):
        template = getattr(obj, "chat_template", None)
        if isinstance(template, dict):
            return "\n".join(str(t) for t in template.values())
        if isinstance(template, str):
            return template
    return ""


def detect_tool_parser(tokenizer: Any) -> Optional[str]:
    """The parser the model's chat template calls for, or None when it names none."""
    template = chat_template_text(tokenizer)
    for markers, name in _TEMPLATE_MARKERS:
        if all(m in template for m in markers):
            return name
    return None
