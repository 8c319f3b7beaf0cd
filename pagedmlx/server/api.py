"""The FastAPI app: OpenAI's /v1/completions, /v1/chat/completions and /v1/models, plus /health,
/metrics and the admin snapshot /v1/engine/kv, over one AsyncEngine. Errors always come back in
OpenAI's shape."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from typing import Any, Awaitable, Optional

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from sse_starlette import EventSourceResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from pagedmlx.async_engine import AsyncEngine
from pagedmlx.blocks.snapshot import kv_snapshot
from pagedmlx.server.metrics import EngineSnapshot, ServerMetrics
from pagedmlx.server.protocol import APIError, ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from pagedmlx.server.serving import ServerLimits, Serving

logger = logging.getLogger("pagedmlx.server")


def build_app(async_engine: AsyncEngine, model_name: str, api_key: Optional[str] = None,
              max_waiting: Optional[int] = None, limits: Optional[ServerLimits] = None,
              drain_timeout: float = 30.0, shutdown_engine: bool = True) -> FastAPI:
    """The server's app. `max_waiting` caps requests waiting in the engine (429 beyond it);
    `limits` caps body size, n, prompts and max_tokens; on shutdown the app drains the engine for
    up to `drain_timeout` seconds (unless shutdown_engine is False)."""
    limits = limits or ServerLimits()
    if max_waiting is not None:
        async_engine.max_waiting = max_waiting
    serving = Serving(async_engine, model_name, limits)
    metrics = ServerMetrics(model_name)
    async_engine.add_listener(metrics.on_output)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        if shutdown_engine:
            await async_engine.shutdown_async(drain_timeout)

    app = FastAPI(title="pagedmlx", lifespan=lifespan)
    app.state.async_engine, app.state.serving, app.state.metrics = async_engine, serving, metrics
    app.add_middleware(BodySizeLimit, max_bytes=limits.max_body_bytes)
    _add_error_handlers(app)

    async def check_api_key(request: Request) -> None:
        given = request.headers.get("authorization", "")
        scheme, _, token = given.partition(" ")
        if not (scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), api_key.encode())):
            raise APIError(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`.",
                           code="invalid_api_key")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(check_api_key)] if api_key else [])

    @v1.get("/models")
    async def models() -> dict:
        card = ModelCard(id=model_name, max_model_len=serving.max_model_len)
        return ModelList(data=[card]).model_dump()

    async def respond(req, raw: Request, prepare, whole, chunks) -> Any:
        prep = prepare(req)
        stream = await serving.submit(prep, req)
        if req.stream:
            return _sse(chunks(req, prep, stream), drain_timeout)
        return await _until_disconnect(raw, whole(req, prep, stream), stream)

    @v1.post("/completions")
    async def completions(req: CompletionRequest, raw: Request) -> Any:
        return await respond(req, raw, serving.prepare_completion, serving.completion, serving.completion_stream)

    @v1.post("/chat/completions")
    async def chat_completions(req: ChatCompletionRequest, raw: Request) -> Any:
        return await respond(req, raw, serving.prepare_chat, serving.chat, serving.chat_stream)

    @v1.get("/engine/kv")
    async def engine_kv() -> Response:
        """The page pool and who holds what (pagedmlx blocks), built in the engine thread between steps."""
        try:
            snap = await asyncio.wait_for(async_engine.call(kv_snapshot), timeout=10.0)
        except Exception as exc:  # noqa: BLE001 - a dead or stuck engine
            raise APIError(503, f"no engine snapshot: {type(exc).__name__}: {exc}", type="server_error")
        return JSONResponse({"model": model_name, **snap})

    app.include_router(v1)

    @app.get("/health")
    async def health() -> Response:
        if async_engine.dead is not None:
            return JSONResponse({"status": "dead", "error": repr(async_engine.dead)}, status_code=503)
        if not async_engine.is_running:
            return JSONResponse({"status": "shutting down"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        try:
            metrics.update(await asyncio.wait_for(async_engine.call(EngineSnapshot.take), timeout=5.0))
        except Exception:  # noqa: BLE001 - a dead or stuck engine still gets its counters scraped
            logger.warning("/metrics: no engine snapshot", exc_info=True)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app


def _sse(payloads, drain_timeout: float) -> EventSourceResponse:
    # On shutdown, sse-starlette lets streams run on for the grace period (our drain) before cancelling.
    return EventSourceResponse(payloads, sep="\n", ping=15, shutdown_grace_period=drain_timeout)


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


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.response_body(), status_code=err.status, headers=err.headers)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            message = f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return _error_response(APIError(400, message))
        param = loc[0] if loc else None
        message = f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}"
        if len(errors) > 1:
            message += f" (and {len(errors) - 1} more errors)"
        return _error_response(APIError(400, message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))


class BodySizeLimit:
    """Refuse request bodies over max_bytes with 413, before the app reads them."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)
            if not message.get("more_body", False):
                break
        body = b"".join(chunks)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = APIError(413, f"request body too large: the limit is {self.max_bytes} bytes",
                       code="request_too_large")
        await _error_response(err)(scope, receive, send)
