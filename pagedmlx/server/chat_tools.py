"""Tool calling and reasoning, the request's side: the server's settings (ChatParsing), a chat request's
checks (a 400 naming the field for what the server knows but cannot honour), what the chat template
gets, and the structured-output constraint that enforces tool_choice "required" or a named function.

tool_choice, as vLLM serves it:
- "none" (the default without tools): no calls; the tools are left out of the prompt, so that the
  model does not write one (vLLM's --exclude-tools-when-tool-choice-none).
- "auto" (the default with tools): the model decides; its text goes through the --tool-call-parser.
- "required", or {"type": "function", "function": {"name": ...}}: a call is enforced by a JSON grammar
  over the output (vLLM's _get_json_schema_from_tool), read without a parser (forced_tool_parser.py).
  That needs guided decoding (SamplingParams.structured_outputs); until the engine has it, refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Optional

from pagedmlx.server.protocol_base import IGNORED_FIELDS, APIError
from pagedmlx.server.protocol_tools import ChatCompletionNamedToolChoiceParam
from pagedmlx.server.reasoning import REASONING_PARSERS
from pagedmlx.server.tool_parsers import TOOL_PARSERS, detect_tool_parser

# chat_template_kwargs a client may not set: the server's own arguments of apply_chat_template
RESERVED_TEMPLATE_KWARGS = frozenset({
    "messages", "conversation", "tools", "documents", "add_generation_prompt", "continue_final_message",
    "tokenize", "return_dict", "return_tensors", "chat_template", "padding", "truncation", "max_length",
    "return_assistant_tokens_mask", "tokenizer_kwargs"})


@dataclass
class ChatParsing:
    """What `pagedmlx serve` was told: --enable-auto-tool-choice, --tool-call-parser, --reasoning-parser."""

    tool_call_parser: Optional[str] = None
    enable_auto_tool_choice: bool = False
    reasoning_parser: Optional[str] = None

    def __post_init__(self) -> None:
        for name, known, flag in ((self.tool_call_parser, TOOL_PARSERS, "--tool-call-parser"),
                                  (self.reasoning_parser, REASONING_PARSERS, "--reasoning-parser")):
            if name is not None and name not in known:
                raise ValueError(f"{flag}: unknown parser {name!r}; choose one of {', '.join(known)}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (or a model whose chat template "
                             f"names one); choose one of {', '.join(TOOL_PARSERS)}")

    @property
    def auto_tools(self) -> bool:
        return self.enable_auto_tool_choice and self.tool_call_parser is not None

    def describe(self) -> str:
        auto = f"tool_choice auto with the {self.tool_call_parser} parser" if self.auto_tools else \
            "tool_choice auto off (--enable-auto-tool-choice)"
        forced = "required / named on" if structured_outputs_class() is not None else \
            "required / named refused (no guided decoding yet)"
        return f"{auto}; {forced}"


def resolve_tool_call_parser(name: Optional[str], enable: bool, tokenizer: Any) -> Optional[str]:
    """serve's parser: the one named, else (with --enable-auto-tool-choice) the one the model's chat
    template points to; None when tool choice "auto" stays off."""
    if name is not None or not enable:
        return name
    return detect_tool_parser(tokenizer)


def tool_choice_of(req: Any) -> Any:
    """The request's tool_choice, OpenAI's default filled in."""
    if req.tool_choice is not None:
        return req.tool_choice
    return "auto" if req.tools else "none"


def check_tool_request(req: Any, parsing: ChatParsing) -> None:
    """Refuse (400, naming the field) what this server cannot honour."""
    for field, instead in (("functions", "tools"), ("function_call", "tool_choice")):
        if getattr(req, field) is not None:
            raise APIError(400, f"{field} is deprecated and not supported: send {instead}", param=field)
    names = [t.function.name for t in req.tools or []]
    if len(set(names)) != len(names):
        dup = next(n for n in names if names.count(n) > 1)
        raise APIError(400, f"tools: the function name {dup!r} is given twice", param="tools")
    choice = tool_choice_of(req)
    if choice != "none" and not req.tools:
        raise APIError(400, f"tool_choice {_show(choice)} needs tools", param="tool_choice")
    if isinstance(choice, ChatCompletionNamedToolChoiceParam) and choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                       f"({', '.join(names)})", param="tool_choice")
    if choice == "auto" and not parsing.auto_tools:
        raise APIError(400, '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set '
                       'on the server', param="tool_choice" if req.tool_choice is not None else "tools")
    if choice == "auto" and any(t.function.strict for t in req.tools):
        # The openai SDK's pydantic_function_tool sets it on every tool: refusing would break its helpers.
        IGNORED_FIELDS.note("ChatCompletionRequest", {"tools[].function.strict (enforced only with tool_choice "
                                                      "required / named)"})


def _show(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def template_kwargs(req: Any) -> dict[str, Any]:
    """apply_chat_template's arguments beyond the messages: the tools (not with tool_choice "none")
    and the request's chat_template_kwargs."""
    kwargs = dict(req.chat_template_kwargs or {})
    reserved = sorted(RESERVED_TEMPLATE_KWARGS & kwargs.keys())
    if reserved:
        raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
    if req.tools and tool_choice_of(req) != "none":
        kwargs["tools"] = [t.model_dump(exclude_none=True) for t in req.tools]
    return kwargs


# ---- tool_choice "required" / named: the grammar ---------------------------------------------------

def get_json_schema_from_tools(tool_choice: Any, tools: Optional[list], parallel: bool = True) -> Optional[dict]:
    """vLLM's: the JSON Schema the output must match when tool_choice forces a call, else None.
    Named: that function's parameters. "required": an array of one or more {"name", "parameters"}; of
    exactly one without `parallel` (parallel_tool_calls false: the grammar ends after the call)."""
    if not tools or tool_choice in (None, "none", "auto"):
        return None
    if isinstance(tool_choice, ChatCompletionNamedToolChoiceParam):
        tool = next(t for t in tools if t.function.name == tool_choice.function.name)
        return tool.function.parameters or {"type": "object", "properties": {}}
    defs: dict[str, Any] = {}
    items = []
    for tool in tools:
        params = dict(tool.function.parameters or {"type": "object", "properties": {}})
        for name, schema in params.pop("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise APIError(400, f"tools: the $defs entry {name!r} differs between tools", param="tools")
            defs[name] = schema
        items.append({"properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "parameters": params}, "required": ["name", "parameters"]})
    schema = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": items}}
    if not parallel:
        schema["maxItems"] = 1
    if defs:
        schema["$defs"] = defs
    return schema


def structured_outputs_class() -> Any:
    """The guided-decoding branch's StructuredOutputsParams (vLLM's SamplingParams.structured_outputs),
    or None while this build has no guided decoding."""
    try:
        from pagedmlx.structured_outputs import StructuredOutputsParams
    except ImportError:
        return None
    return StructuredOutputsParams


def tool_choice_structured_outputs(req: Any) -> Optional[Any]:
    """THE hook: the constraint that enforces tool_choice "required" or a named function, as vLLM's
    StructuredOutputsParams(json=schema); None for "none" and "auto". A 400 while this build has no
    guided decoding (structured_outputs_class() is None)."""
    schema = get_json_schema_from_tools(tool_choice_of(req), req.tools, getattr(req, "parallel_tool_calls", True))
    if schema is None:
        return None
    params_class = structured_outputs_class()
    if params_class is None:
        raise APIError(400, f"tool_choice {_show(tool_choice_of(req))} is enforced with guided decoding, which this "
                       f"server does not have yet: send tool_choice \"auto\"", param="tool_choice")
    try:
        return params_class(json=schema)
    except ValueError as exc:
        raise APIError(400, f"tools: the tool call schema does not compile: {exc}", param="tools")


def attach_tool_constraint(req: Any, params: Any) -> bool:
    """Put the constraint of a forced tool_choice on the request's SamplingParams; whether there was one."""
    constraint = tool_choice_structured_outputs(req)
    if constraint is None:
        return False
    if getattr(params, "structured_outputs", None) is not None:
        raise APIError(400, f"tool_choice {_show(tool_choice_of(req))} cannot be combined with another structured "
                       f"output (response_format, structured_outputs, guided_*)", param="tool_choice")
    params.structured_outputs = constraint
    return True


def tool_text_length(req: Any) -> int:
    """Characters the tools and earlier calls add to the prompt (the context-length pre-check)."""
    tools = sum(len(json.dumps(t.model_dump(exclude_none=True))) for t in req.tools or [])
    calls = sum(len(c.function.arguments) + len(c.function.name) for m in req.messages for c in m.tool_calls or [])
    return tools + calls
