"""OpenAI API request and response models (the subset pagedmlx serves), and their mapping to
SamplingParams. Field names and defaults follow OpenAI's API; vLLM's extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, return_token_ids, ...) are accepted too."""

from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedmlx.sampling_params import SamplingParams


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")  # unknown fields are ignored, as vLLM does


# ---- errors ----------------------------------------------------------------------------------

class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[Union[str, int]] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class APIError(Exception):
    """An error the API answers with its status and OpenAI's error shape."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                 headers: Optional[dict[str, str]] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers
        self.code = code if code is not None else status

    def response_body(self) -> dict:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=self.type, param=self.param,
                                             code=self.code)).model_dump()


# ---- requests --------------------------------------------------------------------------------

class StreamOptions(OpenAIModel):
    include_usage: bool = False


class SamplingRequest(OpenAIModel):
    """Parameters common to completions and chat completions."""

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    n: int = 1
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    repetition_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: Optional[str] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False  # vLLM extension: token ids in every choice / chunk
    cache_salt: Optional[str] = None  # vLLM extension: isolates this request's prefix-cache entries
    priority: int = 0  # vLLM extension: lower runs first under --scheduling-policy priority

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_logprobs(self) -> Optional[int]:
        raise NotImplementedError

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def to_sampling_params(self, max_tokens: int) -> SamplingParams:
        """SamplingParams for this request; a bad value raises APIError(400) naming the field."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     seed=self.seed, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty)
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                logit_bias=bias, logprobs=self.requested_logprobs(), skip_special_tokens=self.skip_special_tokens,
                **{k: v for k, v in given.items() if v is not None})
        except ValueError as exc:
            message = str(exc)
            field = message.split(" ", 1)[0].split("[", 1)[0]
            raise APIError(400, message, param=field if field in type(self).model_fields else None)


class CompletionRequest(SamplingRequest):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    suffix: Optional[str] = None

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIModel):
    role: str
    content: Optional[Union[str, list[Union[TextPart, dict[str, Any]]]]] = None
    name: Optional[str] = None

    def to_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if not isinstance(part, TextPart):
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(400, f"only text content parts are supported, got {kind!r}", param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        message = {"role": self.role, "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True

    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses -------------------------------------------------------------------------------

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


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
