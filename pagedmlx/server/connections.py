"""Connection hygiene under uvicorn.

uvicorn arms its keep-alive timeout only after a response, so a connection that never sends a
byte (or sends its headers one byte at a time) is held forever; 2,100 of them once took every file
descriptor and locked every client out. Here:
- a connection gets `header_timeout` seconds to send each request's line and headers (counted from
  the connection, or from the end of the previous response), then it is closed;
- at most `max_connections` are open: a new one closes the longest-idle connection that has no
  request in flight, and with none idle it is refused at once with a 503 (Retry-After);
- asyncio's "socket.accept() out of system resource" (EMFILE) is logged at most once per interval
  with a count, instead of once per accept attempt (62 MB of log in 12 s).
Bodies have their own deadline, in the app (middleware.BodyLimits).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Any, Optional

from uvicorn.protocols.http.auto import AutoHTTPProtocol

logger = logging.getLogger("pagedmlx.server")

LOG_INTERVAL = 10.0  # seconds between two log lines about the same kind of trouble
LINGER = 1.0  # seconds a refused connection is read (and dropped) before it is closed


class RateLimitedLog:
    """Log a recurring event at most once per interval, saying how often it happened meanwhile."""

    def __init__(self, message: str, interval: float = LOG_INTERVAL):
        self.message, self.interval = message, interval
        self.count, self.last = 0, float("-inf")

    def hit(self, detail: str = "") -> None:
        self.count += 1
        now = time.monotonic()
        if now - self.last >= self.interval:
            suffix = f" ({self.count} times in the last {self.interval:g} s)" if self.count > 1 else ""
            logger.warning("%s%s%s", self.message, f": {detail}" if detail else "", suffix)
            self.count, self.last = 0, now


def _refusal(max_connections: int) -> bytes:
    body = json.dumps({"error": {
        "message": f"too many open connections (the limit is {max_connections}, --max-connections); retry later",
        "type": "server_error", "param": None, "code": "too_many_connections"}}).encode()
    head = (f"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
            f"connection: close\r\ncontent-length: {len(body)}\r\n\r\n").encode()
    return head + body


def guarded_protocol(header_timeout: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (httptools or h11, as uvicorn picks) with the deadline and cap."""
    refusal = _refusal(max_connections)
    refused = RateLimitedLog(f"connections: at the limit of {max_connections} with none idle; refusing new ones")
    evicted = RateLimitedLog(f"connections: at the limit of {max_connections}; closing the longest-idle ones")
    timed_out = RateLimitedLog(f"connections: closed for sending no complete request headers within "
                               f"{header_timeout:g} s")

    class GuardedHTTPProtocol(AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _idle_since = 0.0
        _idle_cycle: Any = None
        _header_timer: Optional[asyncio.TimerHandle] = None
        _refused = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections and not self._make_room():
                self._refuse()
            else:
                self._await_request()

        def data_received(self, data: bytes) -> None:
            if not self._refused:
                super().data_received(data)

        def _refuse(self) -> None:
            """Answer 503 and close, after reading (and dropping) what the client sends for a moment:
            closing with its request unread would reset the connection, and the 503 with it."""
            refused.hit()
            self._refused = True
            self.transport.write(refusal)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self._header_timer = self.loop.call_later(LINGER, self.transport.close)

        def on_response_complete(self) -> None:
            self._await_request()  # before super(): it may start a pipelined request at once
            super().on_response_complete()

        def connection_lost(self, exc: Optional[Exception]) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            super().connection_lost(exc)

        @property
        def waiting_for_request(self) -> bool:
            """No request in flight: nothing but a new request's headers can come next."""
            return self.cycle is self._idle_cycle and not self._refused and not self.transport.is_closing()

        def _await_request(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._idle_since, self._idle_cycle = time.monotonic(), self.cycle
            self._header_timer = self.loop.call_later(header_timeout, self._header_deadline)

        def _header_deadline(self) -> None:
            if self.waiting_for_request:
                timed_out.hit()
                self.close_idle()

        def close_idle(self) -> None:
            try:
                self.timeout_keep_alive_handler()  # uvicorn's own way to close an idle connection
            except Exception:  # noqa: BLE001 - h11 refused the state change: close all the same
                self.transport.close()

        def _make_room(self) -> bool:
            """Close the longest-idle other connection, if any; say whether one was closed."""
            idle = [c for c in self.connections if c is not self and getattr(c, "waiting_for_request", False)]
            if not idle:
                return False
            evicted.hit()
            min(idle, key=lambda c: c._idle_since).close_idle()
            return True

    return GuardedHTTPProtocol


def install_accept_error_filter(loop: asyncio.AbstractEventLoop) -> None:
    """Route asyncio's accept errors (out of file descriptors, ...) through a RateLimitedLog."""
    accept_errors = RateLimitedLog("socket.accept() failed: out of file descriptors or memory")
    previous = loop.get_exception_handler()

    def handler(loop: asyncio.AbstractEventLoop, context: dict) -> None:
        if str(context.get("message", "")).startswith("socket.accept() out of system resource"):
            accept_errors.hit(repr(context.get("exception")))
        elif previous is not None:
            previous(loop, context)
        else:
            loop.default_exception_handler(context)

    loop.set_exception_handler(handler)
