"""The OpenAPI document, made to say what the server does: every status a route answers, with
OpenAI's error body, the event-stream response, and this server's own bounds (n, prompts per
request, max_tokens, token ids). FastAPI's default 422 is dropped: validation errors are 400s."""

from __future__ import annotations

from typing import Any, Callable, Optional

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from pydantic import BaseModel

from pagedmlx.server.protocol import MAX_TOKEN_ID, ChatCompletionChunk, ErrorResponse, ImageURLPart, TextPart

ERRORS = {
    400: "Invalid request: a field's type or range, an unknown token id, a prompt or chat that does not fit the "
         "context, text the tokenizer cannot take, a tool_choice this server cannot honour (an unknown function, "
         "\"auto\" without --enable-auto-tool-choice), an image part the server cannot use (not an image, truncated, "
         "too large, too many, a remote URL, a model without images). `error.param` names the field or part.",
    401: "Missing or wrong API key (`Authorization: Bearer <key>`); on the LoRA admin routes, not the admin key.",
    403: "Loading LoRA adapters at run time is off: the server has no admin key (--admin-key).",
    404: "Unknown model (or LoRA adapter).",
    408: "The request body did not arrive in time (--body-timeout); the connection is closed.",
    413: "Request body too large (--max-body-bytes).",
    429: "Too many requests waiting (--max-waiting); retry after `Retry-After` seconds.",
    500: "The engine failed on this request.",
    503: "The engine is shutting down or has died; retry after `Retry-After` seconds (elsewhere, or once restarted).",
}
RETRY_AFTER = {"Retry-After": {"description": "Seconds to wait before retrying.", "required": True,
                               "schema": {"type": "integer"}}}
SSE_DOC = ("With `stream: true`: server-sent events, one `data: <chunk JSON>` line each, then `data: [DONE]`. "
           "An engine failure, or a server going away, ends the stream with `data: <error JSON>` (OpenAI's error "
           "body) before `data: [DONE]`; a request cut by the drain deadline ends with finish_reason `abort`. "
           "The schema describes one event.")
# Referenced from event streams and content parts only: FastAPI would leave them out
EXTRA_MODELS = (ChatCompletionChunk, TextPart, ImageURLPart)


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def sse_event(chunk: type[BaseModel]) -> dict:
    """One server-sent event of a stream of `chunk`s (OpenAPI 3.1: a media type's schema is per event)."""
    payload = {"type": "string", "contentMediaType": "application/json",
               "contentSchema": {"anyOf": [_ref(chunk), _ref(ErrorResponse)]}}
    return {"type": "object", "required": ["data"], "description": SSE_DOC,
            "properties": {"data": {"anyOf": [{"const": "[DONE]"}, payload]}}}


def error_responses(*statuses: int) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for status in statuses:
        out[status] = {"model": ErrorResponse, "description": ERRORS[status]}
        if status in (429, 503):
            out[status]["headers"] = RETRY_AFTER
    return out


def generation_responses(model: type[BaseModel], chunk: type[BaseModel], auth: bool) -> dict[int, dict]:
    ok = {"model": model, "description": "The whole response, or (`stream: true`) an event stream.",
          "content": {"text/event-stream": {"schema": sse_event(chunk)}}}
    return {200: ok, **error_responses(400, *((401,) if auth else ()), 404, 408, 413, 429, 500, 503)}


def install(app: FastAPI, bounds: Callable[[], dict[str, Optional[int]]], auth: bool) -> None:
    """Replace app.openapi: FastAPI's document, patched. `bounds()`: max_n, max_prompts,
    max_tokens, vocab_size of this server."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                              description=app.description)
            _drop_422(doc)
            _add_models(doc, EXTRA_MODELS)
            _add_bounds(doc.get("components", {}).get("schemas", {}), **bounds())
            if auth:
                _add_bearer(doc)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi


def _drop_422(doc: dict) -> None:
    for ops in doc.get("paths", {}).values():
        for op in ops.values():
            op.get("responses", {}).pop("422", None)
    schemas = doc.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        schemas.pop(name, None)


def _add_models(doc: dict, models: tuple[type[BaseModel], ...]) -> None:
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for name, sub in schema.pop("$defs", {}).items():
            schemas.setdefault(name, sub)
        schemas.setdefault(model.__name__, schema)


def _integer_branch(prop: dict) -> dict:
    """The integer schema of an optional integer property ({anyOf: [integer, null]}) or the property itself."""
    for branch in prop.get("anyOf", []):
        if branch.get("type") == "integer":
            return branch
    return prop


def _add_bounds(schemas: dict, max_n: int, max_prompts: int, max_tokens: Optional[int], vocab_size: int) -> None:
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = schemas.get(name, {}).get("properties", {})
        if "n" in props:
            props["n"]["maximum"] = max_n
        if "best_of" in props:
            _integer_branch(props["best_of"])["maximum"] = max_n
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props and max_tokens is not None:
                _integer_branch(props[field])["maximum"] = max_tokens
    prompt = schemas.get("CompletionRequest", {}).get("properties", {}).get("prompt", {})
    for member in prompt.get("oneOf", []):
        if member.get("type") == "array" and member.get("items", {}).get("type") != "integer":
            member["maxItems"] = max_prompts
    _cap_token_ids(prompt, vocab_size - 1)


def _cap_token_ids(schema: Any, top: int) -> None:
    if isinstance(schema, dict):
        if schema.get("type") == "integer" and schema.get("maximum") == MAX_TOKEN_ID:
            schema["maximum"] = top
        for value in schema.values():
            _cap_token_ids(value, top)
    elif isinstance(schema, list):
        for value in schema:
            _cap_token_ids(value, top)


def _add_bearer(doc: dict) -> None:
    doc.setdefault("components", {}).setdefault("securitySchemes", {})["bearer"] = {"type": "http", "scheme": "bearer"}
    for path, ops in doc.get("paths", {}).items():
        if path.startswith("/v1/"):
            for op in ops.values():
                op["security"] = [{"bearer": []}]
