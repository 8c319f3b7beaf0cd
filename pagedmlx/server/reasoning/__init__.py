"""Reasoning parsers (vLLM's vllm/reasoning), by the names `--reasoning-parser` takes."""

from __future__ import annotations

from pagedmlx.server.reasoning.abs_reasoning_parsers import ReasoningParser
from pagedmlx.server.reasoning.basic_parsers import DeepSeekR1ReasoningParser, Qwen3ReasoningParser
from pagedmlx.server.reasoning.gptoss_reasoning_parser import GptOssReasoningParser

REASONING_PARSERS: dict[str, type[ReasoningParser]] = {
    "qwen3": Qwen3ReasoningParser,
    "deepseek_r1": DeepSeekR1ReasoningParser,
    "openai_gptoss": GptOssReasoningParser,
}


def get_reasoning_parser(name: str) -> type[ReasoningParser]:
    try:
        return REASONING_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}") from None
