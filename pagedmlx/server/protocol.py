"""OpenAI API request and response models (the subset pagedmlx serves), and their mapping to
SamplingParams. Field names and defaults follow OpenAI's API; vLLM's extensions (top_k, min_p,
repetition_penalty, stop_token_ids, ignore_eos, return_token_ids, ...) are accepted too."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import Field, WithJsonSchema

from pagedmlx.sampling_params import MAX_SEED, SamplingParams
from pagedmlx.server.protocol_base import (APIError, ErrorInfo, ErrorResponse, NonEmptyText, OpenAIModel,  # noqa: F401
                                           RequestModel, Text, _str_or_list, _tagged)
from pagedmlx.server.protocol_tools import (ChatCompletionToolsParam, MessageToolCall, ToolChoice)
from pagedmlx.structured_outputs.params import KINDS, StructuredOutputsParams

MAX_TOKEN_ID = 2**31 - 1  # the vocabulary's real bound is checked per model (Serving)
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]


def _prompt_kind(value: Any) -> Optional[str]:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        first = value[0] if value else None
        return "texts" if isinstance(first, str) else "token_lists" if isinstance(first, list) else "token_ids"
    return None


Prompt = _tagged(_prompt_kind, "prompt must be a string, a list of strings, a list of token ids or a list of "
                 "lists of token ids", text=NonEmptyText, texts=Annotated[list[NonEmptyText], Field(min_length=1)],
                 token_ids=Annotated[list[TokenId], Field(min_length=1)],
                 token_lists=Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)])
Stop = _tagged(_str_or_list, "stop must be a string or a list of strings", one=NonEmptyText,
               list=list[NonEmptyText])


# ---- requests --------------------------------------------------------------------------------

class StreamOptions(OpenAIModel):
    include_usage: bool = False


class JsonSchemaFormat(OpenAIModel):
    name: Text = "response"
    description: Optional[Text] = None
    schema_: Optional[dict[str, Any]] = Field(None, alias="schema")
    strict: Optional[bool] = None  # the schema is always enforced


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: Optional[JsonSchemaFormat] = None


class StructuredOutputsField(OpenAIModel):
    """vLLM's `structured_outputs` request field: one kind, and options."""

    json_: Optional[Union[dict[str, Any], Text]] = Field(None, alias="json")
    regex: Optional[Text] = None
    choice: Optional[list[Text]] = None
    grammar: Optional[Text] = None
    json_object: Optional[bool] = None
    structural_tag: Optional[Any] = None  # refused: not supported
    disable_any_whitespace: Optional[bool] = None  # None: compact JSON unless whitespace_pattern is given
    disable_additional_properties: bool = False
    whitespace_pattern: Optional[Text] = None


class SamplingRequest(RequestModel):
    """Parameters common to completions and chat completions. The ranges are SamplingParams' own
    (so the OpenAPI document states what the server enforces); n, max_tokens, the prompt count and
    token ids have per-server bounds, checked by Serving and added to the document (openapi.py)."""

    model: Optional[Text] = None
    max_tokens: Optional[int] = Field(None, ge=1)
    temperature: Optional[float] = Field(None, ge=0.0, le=100.0)
    top_p: Optional[float] = Field(None, gt=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=-1)
    min_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    n: int = Field(1, ge=1)
    best_of: Optional[int] = Field(None, ge=1)  # accepted only when equal to n (see Serving)
    stop: Optional[Stop] = None
    stop_token_ids: Optional[list[TokenId]] = None
    include_stop_str_in_output: bool = False
    seed: Optional[int] = Field(None, ge=0, le=MAX_SEED)
    presence_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: Optional[float] = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: Optional[float] = Field(None, ge=0.01, le=10.0)
    logit_bias: Optional[dict[Annotated[str, Field(pattern=r"^[0-9]{1,10}$")],
                              Annotated[float, Field(ge=-100.0, le=100.0)]]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    user: Optional[Text] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    return_token_ids: bool = False  # vLLM extension: token ids in every choice / chunk
    cache_salt: Optional[Text] = None  # vLLM extension: isolates this request's prefix-cache entries
    priority: int = 0  # vLLM extension: lower runs first under --scheduling-policy priority
    # Guided decoding: OpenAI's response_format, vLLM's structured_outputs and its older guided_* names
    response_format: Optional[ResponseFormat] = None
    structured_outputs: Optional[StructuredOutputsField] = None
    guided_json: Optional[Union[dict[str, Any], Text]] = None
    guided_regex: Optional[Text] = None
    guided_choice: Optional[list[Text]] = None
    guided_grammar: Optional[Text] = None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def requested_logprobs(self) -> Optional[int]:
        raise NotImplementedError

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_tokens

    def requested_prompt_logprobs(self) -> Optional[int]:
        return None

    def structured_outputs_params(self) -> Optional[StructuredOutputsParams]:
        """The request's guided decoding, from whichever field gave it (one kind at most; the options
        of `structured_outputs` apply to the others too, as vLLM). A 400 names the field."""
        kinds: list[tuple[str, str, Any]] = []  # (the request's field, its path in messages, kind -> value)
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.schema_ is None:
                raise APIError(400, "response_format.json_schema.schema is required with type json_schema",
                               param="response_format")
            kinds.append(("response_format", "response_format.json_schema.schema", ("json", fmt.json_schema.schema_)))
        elif fmt is not None and fmt.type == "json_object":
            kinds.append(("response_format", "response_format", ("json_object", True)))
        so = self.structured_outputs
        if so is not None:
            for kind in KINDS:
                value = getattr(so, "json_" if kind == "json" else kind)
                if value not in (None, False):
                    kinds.append(("structured_outputs", f"structured_outputs.{kind}", (kind, value)))
        for kind in ("json", "regex", "choice", "grammar"):
            value = getattr(self, f"guided_{kind}")
            if value is not None:
                kinds.append((f"guided_{kind}", f"guided_{kind}", (kind, value)))
        if not kinds:
            return None
        if len(kinds) > 1:
            raise APIError(400, f"give one kind of structured output, got {', '.join(k[1] for k in kinds)}",
                           param=kinds[1][0])
        field, path, (kind, value) = kinds[0]
        options = {} if so is None else dict(disable_any_whitespace=so.disable_any_whitespace,
                                             disable_additional_properties=so.disable_additional_properties,
                                             whitespace_pattern=so.whitespace_pattern)
        try:
            return StructuredOutputsParams(**{kind: value}, **options)
        except ValueError as exc:
            raise APIError(400, str(exc).replace(f"structured_outputs.{kind}", path), param=field)

    def to_sampling_params(self, max_tokens: int, defaults: Optional[dict] = None) -> SamplingParams:
        """SamplingParams for this request; what it leaves out comes from `defaults` (the model's
        recommended values), then vLLM's. A bad value raises APIError(400) naming the field."""
        bias = {}
        for key, value in (self.logit_bias or {}).items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        given = dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
                     seed=self.seed, presence_penalty=self.presence_penalty,
                     frequency_penalty=self.frequency_penalty, repetition_penalty=self.repetition_penalty)
        sampling = {k: v for k, v in (defaults or {}).items() if k in given}
        sampling.update({k: v for k, v in given.items() if v is not None})
        structured = self.structured_outputs_params()
        try:
            return SamplingParams(
                n=self.n, max_tokens=max_tokens, stop=self.stop or [], stop_token_ids=self.stop_token_ids or [],
                include_stop_str_in_output=self.include_stop_str_in_output, ignore_eos=self.ignore_eos,
                logit_bias=bias, logprobs=self.requested_logprobs(), prompt_logprobs=self.requested_prompt_logprobs(),
                skip_special_tokens=self.skip_special_tokens, structured_outputs=structured, **sampling)
        except ValueError as exc:
            message = str(exc)
            field = message.split(" ", 1)[0].split("[", 1)[0]
            raise APIError(400, message, param=field if field in type(self).model_fields else None)


class CompletionRequest(SamplingRequest):
    prompt: Prompt
    max_tokens: Optional[int] = Field(16, ge=1)
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = False
    suffix: Optional[Text] = None

    def requested_logprobs(self) -> Optional[int]:
        return self.logprobs

    def requested_prompt_logprobs(self) -> Optional[int]:
        return self.logprobs if self.echo else None  # OpenAI's echo: the prompt's logprobs too

    def prompts(self) -> list[Union[str, list[int]]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class TextPart(OpenAIModel):
    type: Literal["text"]
    text: Text


class ImageURL(OpenAIModel):
    url: NonEmptyText = Field(description="A data URL (data:image/png;base64,...), or a file:// URL under the "
                              "server's --allowed-local-media-path. http(s) URLs are refused (400).")
    detail: Optional[Literal["auto", "low", "high"]] = None  # accepted; the model's processor sizes the image


def _image_url_kind(value: Any) -> Optional[str]:
    return "one" if isinstance(value, str) else "object" if isinstance(value, (dict, ImageURL)) else None


class ImageURLPart(OpenAIModel):
    """OpenAI's image part; also with `image_url` a plain URL string (vLLM's form) and as the Responses
    API's `input_image`."""

    type: Literal["image_url", "input_image"]
    image_url: _tagged(_image_url_kind, "image_url must be an object with a url, or a URL string",
                       one=NonEmptyText, object=ImageURL)

    @property
    def url(self) -> str:
        return self.image_url if isinstance(self.image_url, str) else self.image_url.url


IMAGE_PART_TYPES = ("image_url", "input_image")


def _part_kind(value: Any) -> Optional[str]:
    if isinstance(value, (TextPart, ImageURLPart)):
        return "text" if isinstance(value, TextPart) else "image"
    if not isinstance(value, dict):
        return None
    kind = value.get("type")
    return "text" if kind == "text" else "image" if kind in IMAGE_PART_TYPES else "other"


def _component(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


# Other kinds of part (audio, video, files) parse, so that the refusal can name them; the document
# lists the kinds served (openapi.py adds their schemas).
ContentPart = Annotated[_tagged(_part_kind, "a content part must be an object", text=TextPart, image=ImageURLPart,
                                other=dict[str, Any]),
                        WithJsonSchema({"anyOf": [_component("TextPart"), _component("ImageURLPart")]})]
Content = _tagged(_str_or_list, "content must be a string or a list of content parts", one=Text,
                  list=list[ContentPart])
# A role is a name: a role string cannot smuggle template control tokens into the prompt.
Role = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$")]


class ChatMessage(OpenAIModel):
    role: Role
    content: Optional[Content] = None
    name: Optional[Text] = None
    tool_call_id: Optional[Text] = None  # role "tool": the call this message answers
    tool_calls: Optional[list[MessageToolCall]] = None  # role "assistant": the calls it made
    reasoning_content: Optional[Text] = None  # an assistant's reasoning, for templates that show it (vLLM)
    reasoning: Optional[Text] = None  # vLLM's newer name of reasoning_content

    def image_parts(self, index: int) -> list[tuple[str, ImageURLPart]]:
        """(its name, as `messages[0].content[1]`, the part) of each image part; `index`: this message's."""
        if not isinstance(self.content, list):
            return []
        return [(f"messages[{index}].content[{j}]", p) for j, p in enumerate(self.content)
                if isinstance(p, ImageURLPart)]

    def to_template_dict(self, index: int = 0, images: bool = False) -> dict:
        """The message for the chat template. With `images` (a vision model), a content that holds
        images stays a list of parts, each image as {"type": "image"} (the form the chat templates of
        vision models take); without, image parts are refused. `index`: this message's, for errors."""
        content = self.content
        if isinstance(content, list):
            parts: list[dict] = []
            for j, part in enumerate(content):
                param = f"messages[{index}].content[{j}]"
                if isinstance(part, TextPart):
                    parts.append({"type": "text", "text": part.text})
                elif isinstance(part, ImageURLPart) and images:
                    parts.append({"type": "image"})
                elif isinstance(part, ImageURLPart):
                    raise APIError(400, f"{param}: this model takes no images: send text content parts only",
                                   param=param)
                else:
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise APIError(400, f"{param}: content parts of type {str(kind)[:40]!r} are not supported "
                                   f"(text and image_url are)", param=param)
            has_images = any(p["type"] == "image" for p in parts)
            content = parts if has_images else "\n".join(p["text"] for p in parts)
        message = {"role": self.role, "content": content or ""}
        for key in ("name", "tool_call_id"):
            if getattr(self, key) is not None:
                message[key] = getattr(self, key)
        reasoning = self.reasoning if self.reasoning is not None else self.reasoning_content
        if reasoning is not None:
            message["reasoning_content"] = message["reasoning"] = reasoning
        if self.tool_calls:
            message["tool_calls"] = [template_tool_call(c) for c in self.tool_calls]
        return message


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    add_generation_prompt: bool = True
    # Tool calling (chat_tools.py) and reasoning (server/reasoning/)
    tools: Optional[list[ChatCompletionToolsParam]] = Field(None, description=(
        "Functions the model may call; they go to the chat template (not with tool_choice \"none\")."))
    tool_choice: Optional[ToolChoice] = Field(None, description=(
        "Default \"auto\" with tools (needs the server's --enable-auto-tool-choice), \"none\" without. "
        "\"required\" and a named function are enforced with guided decoding; a server without it answers 400."))
    parallel_tool_calls: bool = Field(True, description="false: only the first call is returned.")
    chat_template_kwargs: Optional[dict[str, Any]] = Field(None, description=(
        "Extra arguments of the chat template, e.g. {\"enable_thinking\": false}; the template's own "
        "(tokenize, tools, add_generation_prompt, ...) are refused."))
    include_reasoning: bool = Field(True, description="vLLM's: false leaves reasoning_content out.")
    functions: Optional[list[Any]] = Field(None, description="OpenAI's deprecated form of tools: refused (400).")
    function_call: Optional[Any] = Field(None, description="OpenAI's deprecated form of tool_choice: refused (400).")

    def requested_logprobs(self) -> Optional[int]:
        if self.top_logprobs is not None and not self.logprobs:
            raise APIError(400, "top_logprobs needs logprobs to be true", param="top_logprobs")
        return (self.top_logprobs or 0) if self.logprobs else None

    def requested_max_tokens(self) -> Optional[int]:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


def template_tool_call(call: MessageToolCall) -> dict:
    """A call for the chat template: arguments as an object where they parse as one (vLLM's
    conversion: the Qwen, Llama and Mistral templates render them with `tojson`)."""
    try:
        arguments = json.loads(call.function.arguments)
    except ValueError:
        arguments = call.function.arguments
    if not isinstance(arguments, dict):
        arguments = call.function.arguments
    out = {"type": "function", "function": {"name": call.function.name, "arguments": arguments}}
    if call.id is not None:
        out["id"] = call.id
    return out


def field_range(name: str) -> Optional[str]:
    """A request field's allowed range as the server states it ("[0.0, 100.0]", ">= 1"), or None."""
    for model in (CompletionRequest, ChatCompletionRequest):
        info = model.model_fields.get(name)
        if info is None:
            continue
        bounds = {type(m).__name__: getattr(m, type(m).__name__.lower()) for m in info.metadata
                  if type(m).__name__ in ("Ge", "Gt", "Le", "Lt")}
        lo, hi = bounds.get("Ge", bounds.get("Gt")), bounds.get("Le", bounds.get("Lt"))
        if lo is not None and hi is not None:
            return f"{'[' if 'Ge' in bounds else '('}{lo}, {hi}{']' if 'Le' in bounds else ')'}"
        if lo is not None:
            return f"{'>=' if 'Ge' in bounds else '>'} {lo}"
    return None


from pagedmlx.server.protocol_responses import (  # noqa: E402,F401 - the response models, from here too
    PromptTokensDetails, Usage, CompletionLogprobs, ChoiceBase, ResponseBase, CompletionChoice, CompletionResponse,
    TopLogprob, ChatTokenLogprob, ChatLogprobs, AssistantMessage, ChatChoice, ChatCompletionResponse, DeltaMessage,
    ChatChunkChoice, ChatCompletionChunk, ModelCard, ModelList)
