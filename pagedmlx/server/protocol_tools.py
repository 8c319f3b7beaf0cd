"""Tool calling in OpenAI's chat API, vLLM's model names: the functions a request offers (`tools`),
which it wants called (`tool_choice`), the calls an assistant made (in a response, in a stream's
deltas, and in the messages a client sends back)."""

from __future__ import annotations

import uuid
from typing import Any, Literal, Optional

from pydantic import BaseModel, Field

from pagedmlx.server.protocol_base import OpenAIModel, Text, _tagged

# OpenAI's rule for a function's name, dots allowed (namespaced tools): it goes into prompts verbatim.
FunctionName = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")


def _none(value: Any) -> bool:
    return value is None


def Omitted(**kw: Any) -> Any:
    """A field left out of the JSON while None (plain chat chunks keep their bytes)."""
    return Field(None, exclude_if=_none, **kw)


# ---- requests --------------------------------------------------------------------------------

class FunctionDefinition(OpenAIModel):
    name: str = FunctionName
    description: Optional[Text] = None
    parameters: Optional[dict[str, Any]] = None  # a JSON Schema
    strict: Optional[bool] = None  # enforced only where a grammar applies (tool_choice required / named)


class ChatCompletionToolsParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class ChatCompletionNamedFunction(OpenAIModel):
    name: Text


class ChatCompletionNamedToolChoiceParam(OpenAIModel):
    type: Literal["function"] = "function"
    function: ChatCompletionNamedFunction


def _choice_kind(value: Any) -> Optional[str]:
    return "one" if isinstance(value, str) else "named" if isinstance(value, (dict, BaseModel)) else None


ToolChoice = _tagged(_choice_kind, 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                     '"function": {"name": ...}}', one=Literal["none", "auto", "required"],
                     named=ChatCompletionNamedToolChoiceParam)


class MessageFunctionCall(OpenAIModel):
    name: Text
    arguments: Text = "{}"


class MessageToolCall(OpenAIModel):
    """A call an earlier assistant message made, as the client sends it back."""

    id: Optional[Text] = None
    type: Literal["function"] = "function"
    function: MessageFunctionCall


# ---- responses -------------------------------------------------------------------------------

def make_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as the model wrote it


class ToolCall(BaseModel):
    id: str = Field(default_factory=make_tool_call_id)
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaFunctionCall(BaseModel):
    name: Optional[str] = Omitted()
    arguments: Optional[str] = Omitted()


class DeltaToolCall(BaseModel):
    """A stream's piece of one call: `index`, then (first piece only) id, type and the name, then
    fragments of the arguments; a client concatenates the fragments per index."""

    index: int
    id: Optional[str] = Omitted()
    type: Optional[Literal["function"]] = Omitted()
    function: Optional[DeltaFunctionCall] = Omitted()


class ExtractedToolCallInformation(BaseModel):
    """vLLM's: what a tool parser found in a whole response."""

    tools_called: bool
    tool_calls: list[ToolCall] = Field(default_factory=list)
    content: Optional[str] = None
