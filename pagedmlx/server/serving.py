"""From an OpenAI request to engine requests, and from engine outputs to OpenAI responses: whole (non-streaming)
or as server-sent-event chunks."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable, Optional

from pagedmlx.engine.async_engine import (AsyncEngine, EngineDeadError, EngineShutdownError, RequestStream,
                                          TooManyRequestsError)
from pagedmlx.lora.request import LoRARequest
from pagedmlx.outputs import EngineOutput, TokenLogprob
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.server.chat_media import ChatPrompts, MediaOptions
from pagedmlx.server.chat_parsing import ChatOutputParser, chat_parser_factory
from pagedmlx.server.chat_tools import ChatParsing, attach_tool_constraint, check_tool_request
from pagedmlx.server.errors import error_json, unavailable
from pagedmlx.server.prompts import PromptEncoder
from pagedmlx.server.serving_models import ServingModels
from pagedmlx.server.sse import ChunkTemplate, coalesce, event
from pagedmlx.server.protocol import (APIError, AssistantMessage, ChatChoice, ChatChunkChoice,
                                      ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      ChatLogprobs, ChatTokenLogprob, CompletionChoice, CompletionLogprobs,
                                      CompletionRequest, CompletionResponse, DeltaMessage,
                                      PromptTokensDetails, SamplingRequest, TopLogprob, Usage)

MIN_LOGPROB = -9999.0  # JSON has no -inf
_ENGINE_ERROR_FIELDS = {"logit_bias": "logit_bias", "stop": "stop", "structured_outputs": "structured_outputs",
                        "adapter": "model"}  # an engine ValueError's first word


@dataclass
class ServerLimits:
    max_body_bytes: int = 1 << 20
    max_n: int = 16
    max_prompts: int = 64  # prompts in one completions request
    max_tokens: Optional[int] = None  # None: up to the context
    header_timeout: float = 10.0  # seconds for a connection to send a request line and headers
    body_timeout: float = 30.0  # seconds for a request's body, once its headers are in
    max_connections: Optional[int] = None  # open connections (None: from the open-file limit)


@dataclass
class Prepared:
    """One API request turned into engine input."""

    request_id: str
    prompts: list[list[int]]
    params: SamplingParams
    texts: Optional[list[Optional[str]]] = None  # the prompts as sent, where they were text (for echo)
    prompt_field: str = "prompt"
    chat_parser: Optional[Callable[[], ChatOutputParser]] = None  # tools / reasoning: one parser per choice
    lora_request: Optional[LoRARequest] = None  # the adapter `model` names
    model_name: str = ""  # what responses say in `model`: the base model's name or the adapter's
    mm_features: Optional[list] = None  # a chat's images, processed (multimodal/inputs.py)

    @property
    def n(self) -> int:
        return self.params.n


def _lp(x: float) -> float:
    return max(float(x), MIN_LOGPROB)


class Serving:
    def __init__(self, engine: AsyncEngine, model_name: str, limits: ServerLimits,
                 parsing: Optional[ChatParsing] = None, models: Optional[ServingModels] = None,
                 media: Optional[MediaOptions] = None, mm_processor: Any = None):
        self.engine = engine
        self.model_name = model_name
        self.models = models or ServingModels(engine, model_name, engine.max_model_len)
        self.limits = limits
        self.parsing = parsing or ChatParsing()
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.prompts = PromptEncoder(self.tokenizer, self.max_model_len)
        self.chat_prompts = ChatPrompts(self.prompts, mm_processor, media or MediaOptions(), engine.info)
        self.num_cut = 0  # responses ended by the drain deadline (finish_reason "abort")
        self._token_text: dict[int, str] = {}

    # ---- requests in --------------------------------------------------------------------------

    async def prepare(self, prepare: Callable[[Any], Prepared], req: SamplingRequest) -> Prepared:
        """prepare_completion / prepare_chat, off the event loop (they tokenize)."""
        return await self.prompts.run(prepare, req)

    def check_model(self, req: SamplingRequest) -> Optional[LoRARequest]:
        """The LoRA adapter `model` names (None: the base model); 404 model_not_found for other names."""
        return self.models.resolve(req.model)

    def _need_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise APIError(400, f"this server has no tokenizer: {what} is not available (send token ids)")
        return self.tokenizer

    def prepare_completion(self, req: CompletionRequest) -> Prepared:
        lora = self.check_model(req)
        if req.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        prompts = req.prompts()
        if not prompts:
            raise APIError(400, "prompt must not be empty", param="prompt")
        if len(prompts) > self.limits.max_prompts:
            raise APIError(400, f"at most {self.limits.max_prompts} prompts per request, got {len(prompts)}",
                           param="prompt")
        if any(isinstance(p, str) for p in prompts):
            self._need_tokenizer("a text prompt")
        ids = [self.prompts.encode(p, "prompt") if isinstance(p, str) else list(p) for p in prompts]
        prep = self._prepare(req, ids, "prompt", lora)
        prep.texts = [p if isinstance(p, str) else None for p in prompts]
        return prep

    def prepare_chat(self, req: ChatCompletionRequest) -> Prepared:
        lora = self.check_model(req)
        self._need_tokenizer("chat")
        check_tool_request(req, self.parsing)
        ids, features = self.chat_prompts.prompt(req)
        prep = self._prepare(req, [ids], "messages", lora, features)
        forced = attach_tool_constraint(req, prep.params)
        prep.chat_parser = chat_parser_factory(req, self.parsing, self.tokenizer, prep.params, forced, ids)
        return prep

    def _prepare(self, req: SamplingRequest, prompts: list[list[int]], prompt_field: str,
                 lora: Optional[LoRARequest] = None, mm_features: Optional[list] = None) -> Prepared:
        limits = self.limits
        if req.n > limits.max_n:
            raise APIError(400, f"n must be <= {limits.max_n}, got {req.n}", param="n")
        if req.best_of is not None and req.best_of != req.n:
            raise APIError(400, f"best_of must equal n (got best_of={req.best_of}, n={req.n}): pagedmlx returns "
                           f"every sample it generates, so ask for them with n", param="best_of")
        if any(not p for p in prompts):
            raise APIError(400, f"{prompt_field} must hold at least one token", param=prompt_field)
        longest = max(len(p) for p in prompts)
        requested = req.requested_max_tokens()
        if requested is not None and limits.max_tokens is not None and requested > limits.max_tokens:
            raise APIError(400, f"max_tokens must be <= {limits.max_tokens}, got {requested}", param="max_tokens")
        max_tokens = requested if requested is not None else max(self.max_model_len - longest, 1)
        if requested is None and limits.max_tokens is not None:
            max_tokens = min(max_tokens, limits.max_tokens)
        if max_tokens >= 1 and longest + max_tokens > self.max_model_len:
            where = "messages" if prompt_field == "messages" else "prompt"
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {longest + max_tokens} tokens ({longest} in the {where}, {max_tokens} in the "
                f"completion). Please reduce the length of the {where} or completion.",
                param="max_tokens" if requested is not None and longest < self.max_model_len else prompt_field,
                code="context_length_exceeded")
        params = req.to_sampling_params(max_tokens, self.engine.generation_defaults)
        return Prepared(uuid.uuid4().hex, prompts, params, prompt_field=prompt_field, lora_request=lora,
                        model_name=lora.lora_name if lora is not None else self.model_name, mm_features=mm_features)

    async def submit(self, prep: Prepared, req: SamplingRequest) -> RequestStream:
        try:
            prompts = [{"prompt_token_ids": p, "mm_features": prep.mm_features} for p in prep.prompts] \
                if prep.mm_features else prep.prompts  # a chat's images (one prompt)
            return await self.engine.add_requests(prep.request_id, prompts, prep.params,
                                                  priority=req.priority, cache_salt=req.cache_salt,
                                                  lora_request=prep.lora_request)
        except TooManyRequestsError as exc:
            raise APIError(429, f"{exc}; retry later", type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"})
        except (EngineDeadError, EngineShutdownError) as exc:
            raise unavailable(exc)
        except ValueError as exc:  # the engine's own checks, worded "<field> ..."
            first = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), param=prep.prompt_field if first == "prompt" else
                           _ENGINE_ERROR_FIELDS.get(first))

    def note_cut(self, out: EngineOutput) -> bool:  # a request aborted by the drain deadline
        return out.finish_reason == "abort" and self.engine.stopping

    # ---- responses out -----------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    def chat_logprobs(self, lps: Optional[list[TokenLogprob]]) -> Optional[ChatLogprobs]:
        if lps is None:
            return None

        def top(tid: int, lp: float) -> TopLogprob:
            s = self.token_text(tid)
            return TopLogprob(token=s, logprob=_lp(lp), bytes=list(s.encode("utf-8")))

        return ChatLogprobs(content=[
            ChatTokenLogprob(**top(t.token_id, t.logprob).model_dump(), top_logprobs=[top(i, v) for i, v in t.top])
            for t in lps])

    def completion_logprobs(self, lps: Optional[list[TokenLogprob]], offset: int) -> Optional[CompletionLogprobs]:
        if lps is None:
            return None
        out = CompletionLogprobs()
        for t in lps:
            s = self.token_text(t.token_id)
            out.tokens.append(s)
            out.token_logprobs.append(_lp(t.logprob))
            top = {self.token_text(i): _lp(v) for i, v in t.top}
            top[s] = _lp(t.logprob)  # OpenAI's and vLLM's k + 1: the chosen token too, with its own logprob
            out.top_logprobs.append(top)
            out.text_offset.append(offset)
            offset += len(s)
        return out

    @staticmethod
    def usage(prep: Prepared, finals: dict[int, EngineOutput]) -> Usage:
        prompt = sum(len(p) for p in prep.prompts)
        completion = sum(len(o.token_ids) for o in finals.values())
        cached = sum(finals[k * prep.n].num_cached_tokens for k in range(len(prep.prompts)) if k * prep.n in finals)
        return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def collect(self, stream: RequestStream) -> dict[int, EngineOutput]:
        """Wait for every child's final output; an engine error becomes a 500."""
        finals: dict[int, EngineOutput] = {}
        try:
            async for out in stream:
                if out.finish_reason == "error":
                    raise APIError(500, f"the engine failed on this request: {out.error}", type="server_error")
                if out.finished:
                    finals[stream.index(out.request_id)] = out
        except (EngineDeadError, EngineShutdownError) as exc:
            raise unavailable(exc)
        finally:
            stream.close()
        self.num_cut += any(self.note_cut(o) for o in finals.values())
        return finals

    async def echo_logprobs(self, prep: Prepared, index: int, out: EngineOutput, echo: str,
                            lps: Optional[list[TokenLogprob]]) -> Optional[CompletionLogprobs]:
        """OpenAI's echo with logprobs: the prompt's tokens (the first without a logprob, as vLLM), then the
        completion's `lps`, offsets counted over the echoed text and the completion. The prompt's (a token and its
        top k each) are decoded in the tokenizing pool, off the event loop."""
        if out.prompt_logprobs is None:
            return self.completion_logprobs(lps, len(echo))
        return await self.prompts.run(self._merge_prompt_logprobs, prep, index, out, lps)

    def _merge_prompt_logprobs(self, prep: Prepared, index: int, out: EngineOutput,
                               lps: Optional[list[TokenLogprob]]) -> CompletionLogprobs:
        prompt = prep.prompts[index // prep.n]
        first = TokenLogprob(prompt[0], 0.0, [])
        merged = self.completion_logprobs([first, *out.prompt_logprobs, *(lps or [])], 0)
        merged.token_logprobs[0] = None
        merged.top_logprobs[0] = None
        return merged

    def _prompt_text(self, prep: Prepared, index: int) -> str:
        k = index // prep.n
        if prep.texts and prep.texts[k] is not None:
            return prep.texts[k]
        return self.tokenizer.decode(prep.prompts[k]) if self.tokenizer is not None else ""

    async def completion(self, req: CompletionRequest, prep: Prepared, stream: RequestStream) -> CompletionResponse:
        finals = await self.collect(stream)
        choices = []
        for i in sorted(finals):
            out = finals[i]
            echo = self._prompt_text(prep, i) if req.echo else ""
            choices.append(CompletionChoice(
                index=i, text=echo + out.text, logprobs=await self.echo_logprobs(prep, i, out, echo, out.logprobs),
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                token_ids=out.token_ids if req.return_token_ids else None,
                prompt_token_ids=out.prompt_token_ids if req.return_token_ids else None))
        return CompletionResponse(id=f"cmpl-{prep.request_id}", model=prep.model_name, choices=choices,
                                  usage=self.usage(prep, finals))

    async def chat(self, req: ChatCompletionRequest, prep: Prepared, stream: RequestStream) -> ChatCompletionResponse:
        finals = await self.collect(stream)
        choices = []
        for i in sorted(finals):
            out = finals[i]
            parser = prep.chat_parser() if prep.chat_parser is not None else None
            choices.append(ChatChoice(
                index=i, message=parser.whole(out.text, out.finish_reason == "length") if parser
                else AssistantMessage(content=out.text),
                logprobs=self.chat_logprobs(out.logprobs), stop_reason=out.stop_reason,
                finish_reason=parser.finish_reason(out.finish_reason) if parser else out.finish_reason,
                token_ids=out.token_ids if req.return_token_ids else None))
        return ChatCompletionResponse(id=f"chatcmpl-{prep.request_id}", model=prep.model_name, choices=choices,
                                      usage=self.usage(prep, finals),
                                      prompt_token_ids=prep.prompts[0] if req.return_token_ids else None)

    # ---- streaming ---------------------------------------------------------------------------

    def completion_stream(self, req: CompletionRequest, prep: Prepared, stream: RequestStream) -> AsyncIterator[bytes]:
        rid, created = f"cmpl-{prep.request_id}", int(time.time())
        offsets: dict[int, int] = {}
        plain = None
        if not (req.echo or prep.params.logprobs is not None or req.return_token_ids):
            plain = ChunkTemplate.of(CompletionResponse(id=rid, model=prep.model_name, created=created,
                                                     choices=[CompletionChoice(index=0, text="")]))

        async def chunk(i: int, out: EngineOutput) -> Optional[bytes]:
            if plain is not None:
                return plain.render(i, out.new_text, out.finish_reason, out.stop_reason) \
                    if out.new_text or out.finished else None
            first = i not in offsets
            text = (self._prompt_text(prep, i) if req.echo and first else "") + out.new_text
            offset = offsets.get(i, len(text) - len(out.new_text))
            offsets[i] = offset + len(out.new_text)
            if not (text or out.finished or out.new_logprobs or req.return_token_ids):
                return None
            logprobs = (await self.echo_logprobs(prep, i, out, text, out.new_logprobs) if first and req.echo
                        else self.completion_logprobs(out.new_logprobs, offset))
            return event(CompletionResponse(id=rid, model=prep.model_name, created=created, choices=[CompletionChoice(
                index=i, text=text, logprobs=logprobs,
                finish_reason=out.finish_reason, stop_reason=out.stop_reason,
                token_ids=out.new_token_ids if req.return_token_ids else None)]).model_dump_json())

        def usage_chunk(usage: Usage) -> CompletionResponse:
            return CompletionResponse(id=rid, model=prep.model_name, created=created, choices=[], usage=usage)

        return self._sse(req, prep, stream, [], chunk, usage_chunk)

    def chat_stream(self, req: ChatCompletionRequest, prep: Prepared, stream: RequestStream) -> AsyncIterator[bytes]:
        rid, created = f"chatcmpl-{prep.request_id}", int(time.time())

        def model(**choice: Any) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, model=prep.model_name, created=created,
                                       choices=[ChatChunkChoice(**choice)])

        firsts = [model(index=i, delta=DeltaMessage(role="assistant", content="")) for i in range(prep.n)]
        plain = None
        if not (prep.params.logprobs is not None or req.return_token_ids or prep.chat_parser is not None):
            plain = ChunkTemplate.of(model(index=0, delta=DeltaMessage()))
        parsers: dict[int, ChatOutputParser] = {}  # tools / reasoning: their own path, through the models

        async def chunk(i: int, out: EngineOutput) -> Optional[bytes]:
            if not (out.new_text or out.finished or out.new_logprobs or req.return_token_ids):
                return None
            if plain is not None:
                return plain.render(i, out.new_text, out.finish_reason, out.stop_reason)
            delta, finish = DeltaMessage(content=out.new_text), out.finish_reason
            if prep.chat_parser is not None:
                parser = parsers.get(i) or parsers.setdefault(i, prep.chat_parser())
                delta = parser.feed(out.new_text, out.finished, out.finish_reason == "length")
                finish = parser.finish_reason(out.finish_reason)
                if delta is None and not (out.finished or out.new_logprobs or req.return_token_ids):
                    return None
            return event(model(index=i, delta=delta or DeltaMessage(),
                               logprobs=self.chat_logprobs(out.new_logprobs), finish_reason=finish,
                               stop_reason=out.stop_reason,
                               token_ids=out.new_token_ids if req.return_token_ids else None).model_dump_json())

        def usage_chunk(usage: Usage) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=rid, model=prep.model_name, created=created, choices=[], usage=usage)

        return self._sse(req, prep, stream, firsts, chunk, usage_chunk)

    async def _sse(self, req: SamplingRequest, prep: Prepared, stream: RequestStream, firsts: list,
                   chunk: Callable[[int, EngineOutput], Awaitable[Optional[bytes]]],
                   usage_chunk: Callable[[Usage], Any]) -> AsyncIterator[bytes]:
        """The events: the chunks, an optional usage chunk, then [DONE]. The outputs a stream holds when its turn
        comes go out as one chunk per sample (sse.coalesce). An engine error ends the stream with an error event
        (then [DONE]); a dropped connection aborts the request."""
        finals: dict[int, EngineOutput] = {}
        cut = failed = False
        try:
            for c in firsts:
                yield event(c.model_dump_json())
            async for out in stream:
                batch = [(stream.index(o.request_id), o) for o in (out, *stream.ready())]
                for i, o in (batch if any(o.finish_reason == "error" for _, o in batch) else coalesce(batch)):
                    if o.finish_reason == "error":
                        yield event(error_json(f"the engine failed on this request: {o.error}", 500))
                        failed = True
                        break
                    if o.finished:
                        finals[i] = o
                        cut = cut or self.note_cut(o)
                    c = await chunk(i, o)
                    if c is not None:
                        yield c
                if failed:
                    break
            else:
                if req.include_usage:
                    yield event(usage_chunk(self.usage(prep, finals)).model_dump_json())
        except (EngineDeadError, EngineShutdownError) as exc:
            yield event(error_json(str(exc), 503))
        finally:
            stream.close()
            self.num_cut += cut
        yield DONE


DONE = event("[DONE]")

