"""Error responses in OpenAI's shape, for every way a request can fail."""

from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedmlx.server.protocol import APIError, field_range

logger = logging.getLogger("pagedmlx.server")
RETRY_AFTER_503 = "5"  # seconds: a stopping server's supervisor restarts it in about that


class ASCIIJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: an error may quote what the client sent, and a
    lone surrogate in it must not turn the error into a 500 (UTF-8 cannot encode one)."""

    def render(self, content: Any) -> bytes:
        return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode("ascii")


def unavailable(exc: Exception) -> APIError:
    return APIError(503, str(exc), type="server_error", code=503, headers={"Retry-After": RETRY_AFTER_503})


def error_json(message: str, status: int) -> str:
    """An error event of a stream: OpenAI's error body as JSON."""
    return json.dumps(APIError(status, message, type="server_error").response_body())


def error_response(err: APIError) -> JSONResponse:
    return ASCIIJSONResponse(err.response_body(), status_code=err.status, headers=err.headers)


def _is_label(part: Any) -> bool:
    """A location part that names no field: pydantic's labels for union members and dict keys."""
    return isinstance(part, str) and ("[" in part or part in _UNION_TAGS)


_UNION_TAGS = {"text", "texts", "token_ids", "token_lists", "one", "list", "other", "named", "image", "object"}
_RANGE_ERRORS = {"greater_than", "greater_than_equal", "less_than", "less_than_equal"}


def _quote(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "..."


def _path(loc: list) -> str:
    """A location as a client writes it: messages[0].content[1].image_url."""
    return "".join(f"[{x}]" if isinstance(x, int) else f".{x}" if i else str(x) for i, x in enumerate(loc))


def _message(loc: list, error: dict) -> str:
    """'temperature must be in [0.0, 100.0], got 150'; else pydantic's words, with the value sent."""
    value = error.get("input")
    where = _path(loc) or "body"
    allowed = field_range(str(loc[0])) if len(loc) == 1 and error.get("type") in _RANGE_ERRORS else None
    if allowed is not None:
        return f"{where} must be {'in ' if allowed[0] in '[(' else ''}{allowed}, got {_quote(value)}"
    message = f"{where}: {error.get('msg', 'invalid value').removeprefix('Value error, ')}"
    if isinstance(value, (int, float, str)) and error.get("type") != "missing":
        message += f", got {_quote(value)}"
    return message


def validation_error(request: Request, exc: RequestValidationError) -> APIError:
    errors = exc.errors()
    first = errors[0] if errors else {}
    loc = [x for x in first.get("loc", ()) if x != "body" and not _is_label(x)]
    if first.get("type") == "json_invalid":
        return APIError(400, f"Invalid JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    content_type = request.headers.get("content-type", "")
    if not loc and first.get("type") == "model_attributes_type" and "json" not in content_type:
        return APIError(400, f"the body must be a JSON object sent as `Content-Type: application/json`, "
                        f"got {content_type[:100]!r}")
    message = _message(loc, first)
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more errors)"
    return APIError(400, message, param=str(loc[0]) if loc else None)


def add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(validation_error(request, exc))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(APIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error"))
