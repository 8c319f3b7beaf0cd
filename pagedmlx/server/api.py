"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health,
/metrics and the admin snapshot /v1/engine/kv, over one AsyncEngine. Errors always come back in
OpenAI's shape (errors.py); bodies are read within limits (middleware.py); the OpenAPI document
lists every status (openapi.py)."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any, Awaitable, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import BaseModel
from sse_starlette import EventSourceResponse

from pagedmlx.engine.async_engine import AsyncEngine
from pagedmlx.blocks.snapshot import kv_snapshot
from pagedmlx.server import openapi
from pagedmlx.server.chat_media import MediaOptions
from pagedmlx.server.chat_tools import ChatParsing
from pagedmlx.server.errors import RETRY_AFTER_503, ASCIIJSONResponse, add_error_handlers, unavailable
from pagedmlx.server.metrics import EngineSnapshot, ServerMetrics
from pagedmlx.server.middleware import BodyLimits
from pagedmlx.server.protocol import (APIError, ChatCompletionChunk, ChatCompletionRequest, ChatCompletionResponse,
                                      CompletionRequest, CompletionResponse, ModelList)
from pagedmlx.server.protocol_responses import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from pagedmlx.server.serving import Serving, ServerLimits
from pagedmlx.server.serving_models import ServingModels

logger = logging.getLogger("pagedmlx.server")

# After the drain deadline the engine aborts what is left and each stream sends its last chunk and
# [DONE]; sse-starlette cancels a stream only this much later, if it is somehow still running.
SSE_GRACE_AFTER_DRAIN = 5.0


class Health(BaseModel):
    status: str
    error: Optional[str] = None


def build_app(async_engine: AsyncEngine, model_name: str, api_key: Optional[str] = None,
              max_waiting: Optional[int] = None, limits: Optional[ServerLimits] = None,
              drain_timeout: float = 30.0, shutdown_engine: bool = True, admin_key: Optional[str] = None,
              parsing: Optional[ChatParsing] = None, models: Optional[ServingModels] = None,
              media: Optional[MediaOptions] = None, mm_processor: Any = None) -> FastAPI:
    """The server's app. `max_waiting` caps requests waiting in the engine (429 beyond it);
    `limits` caps body size and time, n, prompts and max_tokens; on shutdown the app drains the engine for
    up to `drain_timeout` seconds (unless shutdown_engine is False). `api_key` guards /v1; `admin_key`
    (also good for /v1) alone unlocks the prompt text of KV blocks in /v1/engine/kv. `parsing`: the tool
    call and reasoning parsers of chat responses (chat_tools.py). `models`: the base model and the LoRA
    adapters requests may name (serving_models.py; its --lora-modules loaded by the caller); where the
    engine has LoRA enabled, /v1/load_lora_adapter and /v1/unload_lora_adapter take the admin key.
    `media`: where chat images may come from and how many a request may carry (chat_media.py);
    `mm_processor`: the model's MultiModalProcessor (pagedmlx/multimodal/; None: a text-only model)."""
    limits = limits or ServerLimits()
    if max_waiting is not None:
        async_engine.max_waiting = max_waiting
    models = models or ServingModels(async_engine, model_name, async_engine.max_model_len)
    serving = Serving(async_engine, model_name, limits, parsing, models, media, mm_processor)
    metrics = ServerMetrics(model_name)
    async_engine.add_listener(metrics.on_output)
    keys = [k.encode() for k in (api_key, admin_key) if k]

    def begin_drain() -> None:
        """Called as the server starts to shut down (a signal): the drain clock starts now."""
        if shutdown_engine:
            async_engine.begin_shutdown(drain_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            await async_engine.shutdown_async(drain_timeout)
        serving.prompts.close()
        if serving.num_cut:
            logger.warning("drain: %d responses were cut at the %g s deadline (finish_reason \"abort\")",
                           serving.num_cut, drain_timeout)

    app = FastAPI(title="pagedmlx", lifespan=lifespan)
    app.state.async_engine, app.state.serving, app.state.metrics = async_engine, serving, metrics
    app.state.limits, app.state.begin_drain, app.state.drain_timeout = limits, begin_drain, drain_timeout
    app.add_middleware(BodyLimits, max_bytes=limits.max_body_bytes, timeout=limits.body_timeout)
    add_error_handlers(app)

    def bearer(request: Request) -> bytes:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return token.encode() if scheme.lower() == "bearer" else b""

    def is_admin(request: Request) -> bool:
        return admin_key is not None and hmac.compare_digest(bearer(request), admin_key.encode())

    async def check_api_key(request: Request) -> None:
        token = bearer(request)
        if not any([hmac.compare_digest(token, key) for key in keys]):  # a list: compare with every key
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    auth = api_key is not None
    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)] if auth else [])
    auth_errors = openapi.error_responses(401) if auth else {}

    @v1.get("/models", responses={200: {"model": ModelList}, **auth_errors})
    async def list_models() -> Any:
        """The base model and the LoRA adapters (`parent`: their base model)."""
        return models.show_available_models().model_dump()

    if models.lora_enabled:
        add_lora_routes(v1, models, admin_key, is_admin, auth)

    async def respond(req, raw: Request, prepare, whole, chunks) -> Any:
        prep = await serving.prepare(prepare, req)
        stream = await serving.submit(prep, req)
        if req.stream:
            return _sse(chunks(req, prep, stream), drain_timeout + SSE_GRACE_AFTER_DRAIN)
        return await _until_disconnect(raw, whole(req, prep, stream), stream)

    completion_docs = openapi.generation_responses(CompletionResponse, CompletionResponse, auth)
    chat_docs = openapi.generation_responses(ChatCompletionResponse, ChatCompletionChunk, auth)

    @v1.post("/completions", responses=completion_docs)
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await respond(req, raw, serving.prepare_completion, serving.completion, serving.completion_stream)

    @v1.post("/chat/completions", responses=chat_docs)
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await respond(req, raw, serving.prepare_chat, serving.chat, serving.chat_stream)

    @v1.get("/engine/kv", responses={200: {"description": "A snapshot of the KV page pool (docs/kv-inspector.md)."},
                                     **auth_errors, **openapi.error_responses(503)})
    async def engine_kv(request: Request) -> Response:
        """The page pool and who holds what (pagedmlx blocks), built in the engine thread between steps.
        Block text only for the admin key (--admin-key)."""
        show_text = is_admin(request)
        try:
            snap = await asyncio.wait_for(async_engine.call(kv_snapshot, block_text=show_text), timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck engine
            raise unavailable(RuntimeError(f"no engine snapshot: {type(exc).__name__}: {exc}"))
        return ASCIIJSONResponse({"model": model_name, **snap})

    app.include_router(v1)

    async def health() -> Response:
        if async_engine.dead is not None:
            return _unhealthy({"status": "dead", "error": repr(async_engine.dead)})
        if not async_engine.is_running:
            return _unhealthy({"status": "shutting down"})
        return ASCIIJSONResponse({"status": "ok"})

    health_responses = {200: {"model": Health, "description": "Serving."},
                        503: {"model": Health, "description": "Shutting down, or the engine died.",
                              "headers": openapi.RETRY_AFTER}}
    for method in ("GET", "HEAD"):  # HEAD: some load balancers probe with it
        app.add_api_route("/health", health, methods=[method], responses=health_responses,
                          operation_id=f"health_{method.lower()}")

    @app.get("/metrics", responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                                          "description": "Prometheus metrics."}})
    async def metrics_endpoint() -> Response:
        try:
            metrics.update(await asyncio.wait_for(async_engine.call(EngineSnapshot.take), timeout=5.0))
        except Exception:  # noqa: BLE001 - a dead or stuck engine still gets its counters scraped
            logger.warning("/metrics: no engine snapshot", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def bounds() -> dict:
        cap = serving.max_model_len - 1
        return dict(max_n=limits.max_n, max_prompts=limits.max_prompts, vocab_size=serving.vocab_size,
                    max_tokens=min(cap, limits.max_tokens) if limits.max_tokens is not None else cap)

    openapi.install(app, bounds, auth)
    return app


def add_lora_routes(v1: APIRouter, models: ServingModels, admin_key: Optional[str], is_admin, auth: bool) -> None:
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, for the admin key only (without
    --admin-key, for nobody: 403)."""

    async def require_admin(request: Request) -> None:
        if admin_key is None:
            raise APIError(403, "loading and unloading LoRA adapters at run time needs the server's admin key "
                                "(--admin-key or PAGEDMLX_ADMIN_KEY)", code="forbidden")
        if not is_admin(request):
            raise APIError(401, "this route takes the admin key: send `Authorization: Bearer <admin key>`.",
                           code="invalid_api_key")

    docs = {200: {"content": {"text/plain": {"schema": {"type": "string"}}}, "description": "Done."},
            **openapi.error_responses(400, 401, 403, 404)}

    @v1.post("/load_lora_adapter", responses=docs, dependencies=[Depends(require_admin)])
    async def load_lora_adapter(req: LoadLoRAAdapterRequest) -> Response:
        """Read an mlx-lm adapter folder and serve it as `model: lora_name` (400 with the reason where the
        engine cannot serve it: rank above --max-lora-rank, another base model's shapes, ...)."""
        return PlainTextResponse(await models.load_lora_adapter(req.lora_name, req.lora_path))

    @v1.post("/unload_lora_adapter", responses=docs, dependencies=[Depends(require_admin)])
    async def unload_lora_adapter(req: UnloadLoRAAdapterRequest) -> Response:
        """Stop serving an adapter; requests already running with it finish."""
        return PlainTextResponse(await models.unload_lora_adapter(req.lora_name, req.lora_int_id))


def _unhealthy(body: dict) -> Response:
    return ASCIIJSONResponse(body, status_code=503, headers={"Retry-After": RETRY_AFTER_503})


def _sse(payloads, grace: float) -> EventSourceResponse:
    # On shutdown, sse-starlette lets streams run on for `grace` seconds before cancelling them.
    return EventSourceResponse(payloads, sep="\n", ping=15, shutdown_grace_period=grace)


async def _until_disconnect(request: Request, work: Awaitable, stream) -> Any:
    """Run a non-streaming handler's wait, but abort the request if the client goes away."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            stream.close()
    if task in done:
        return task.result()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return Response(status_code=499)  # "client closed request": nobody will read it


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
