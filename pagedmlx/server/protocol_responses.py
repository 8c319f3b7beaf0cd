"""The OpenAI API's response bodies (protocol.py has the requests and re-exports these), and the
bodies of vLLM's LoRA admin routes."""

from __future__ import annotations

import time
from typing import Optional, Union

from pydantic import BaseModel, Field

from pagedmlx.server.protocol_tools import DeltaToolCall, Omitted, ToolCall


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class ChoiceBase(BaseModel):
    index: int
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None  # vLLM extension: the stop string or token id that matched
    token_ids: Optional[list[int]] = None  # with return_token_ids


class ResponseBase(BaseModel):
    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    usage: Optional[Usage] = None


class CompletionChoice(ChoiceBase):
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    prompt_token_ids: Optional[list[int]] = None


class CompletionResponse(ResponseBase):
    object: str = "text_completion"
    choices: list[CompletionChoice]


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None


class AssistantMessage(BaseModel):
    role: str = "assistant"
    content: Optional[str] = None
    reasoning_content: Optional[str] = Omitted(description="With --reasoning-parser: the model's reasoning (vLLM).")
    reasoning: Optional[str] = Omitted(description="The same text under vLLM's newer name.")
    tool_calls: Optional[list[ToolCall]] = Omitted(description="The calls the model made (finish_reason tool_calls).")


class ChatChoice(ChoiceBase):
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionResponse(ResponseBase):
    object: str = "chat.completion"
    choices: list[ChatChoice]
    prompt_token_ids: Optional[list[int]] = None


class DeltaMessage(BaseModel):
    role: Optional[str] = None
    content: Optional[str] = None
    reasoning_content: Optional[str] = Omitted()
    reasoning: Optional[str] = Omitted()
    tool_calls: Optional[list[DeltaToolCall]] = Omitted()


class ChatChunkChoice(ChoiceBase):
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None


class ChatCompletionChunk(ResponseBase):
    object: str = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "pagedmlx"
    max_model_len: Optional[int] = None
    root: Optional[str] = None  # the base model's name, or a LoRA adapter's folder
    parent: Optional[str] = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's): an mlx-lm adapter folder, served as `model: lora_name`."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: Optional[str] = Field(default=None, max_length=256)
    lora_int_id: Optional[int] = None
