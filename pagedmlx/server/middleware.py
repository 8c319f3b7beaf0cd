"""BodyLimits: every request body is read here, before the app, within a size and a time limit."""

from __future__ import annotations

import asyncio
import time

from starlette.types import ASGIApp, Receive, Scope, Send

from pagedmlx.server.errors import error_response
from pagedmlx.server.protocol import APIError


class BodyLimits:
    """Refuse a body over max_bytes with 413 (from its Content-Length when it declares one), and one
    not complete within `timeout` seconds of the headers with 408, closing the connection: a client
    that sends a few bytes of its body and then stalls would otherwise hold its connection forever."""

    def __init__(self, app: ASGIApp, max_bytes: int, timeout: float = 30.0):
        self.app, self.max_bytes, self.timeout = app, max_bytes, timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            return await self._refuse(413, f"request body too large: the limit is {self.max_bytes} bytes",
                                      "request_too_large", scope, receive, send)
        chunks, size = [], 0
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
            except asyncio.TimeoutError:
                return await self._refuse(408, f"request body not received within {self.timeout:g} s",
                                          "request_timeout", scope, receive, send)
            if message["type"] != "http.request":
                return  # the client left before sending its body
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                return await self._refuse(413, f"request body too large: the limit is {self.max_bytes} bytes",
                                          "request_too_large", scope, receive, send)
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

    @staticmethod
    async def _refuse(status: int, message: str, code: str, scope: Scope, receive: Receive, send: Send) -> None:
        # The unread rest of the body would be taken for the next request: close the connection.
        err = APIError(status, message, code=code, headers={"Connection": "close"})
        await error_response(err)(scope, receive, send)
