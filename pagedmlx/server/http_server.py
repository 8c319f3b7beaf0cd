"""The uvicorn server for an app from build_app: connection hygiene (connections.py), and a drain
that starts when the shutdown does (a signal), so that streams still running at the deadline end
with finish_reason "abort" and [DONE] instead of a cut connection."""

from __future__ import annotations

import asyncio
import math
import resource
import socket
import threading
import time
from typing import Callable, Optional

import uvicorn
from fastapi import FastAPI

from pagedmlx.platform import hard_exit
from pagedmlx.server.api import SSE_GRACE_AFTER_DRAIN
from pagedmlx.server.connections import guarded_protocol, install_accept_error_filter
from pagedmlx.server.file_limit import default_max_connections


class PagedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, on_shutdown: Optional[Callable[[], None]] = None):
        super().__init__(config)
        self.on_shutdown = on_shutdown

    async def startup(self, sockets: Optional[list[socket.socket]] = None) -> None:
        install_accept_error_filter(asyncio.get_running_loop())
        await super().startup(sockets)
        if sockets and self.started:  # uvicorn says where it listens only on sockets it bound itself
            self._log_started_message(sockets)

    async def shutdown(self, sockets: Optional[list[socket.socket]] = None) -> None:
        if self.on_shutdown is not None:
            self.on_shutdown()
        await super().shutdown(sockets)


def max_connections(app: FastAPI) -> int:
    """The app's connection cap: --max-connections, or what the open-file limit leaves room for."""
    return app.state.limits.max_connections or default_max_connections(
        resource.getrlimit(resource.RLIMIT_NOFILE)[0])


def make_server(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> PagedServer:
    limits = app.state.limits
    # uvicorn's own limit comes last: after the drain, the abort chunks and sse-starlette's grace.
    graceful = math.ceil(app.state.drain_timeout + SSE_GRACE_AFTER_DRAIN) + 5
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=graceful,
                            http=guarded_protocol(limits.header_timeout, max_connections(app)))
    return PagedServer(config, on_shutdown=app.state.begin_drain)


class EngineWatch:
    """When the engine core dies (or a tensor-parallel rank is lost: `fail`), say so and stop the
    HTTP server: requests in flight end with a 503 error, and the process ends within `grace`
    seconds. `error` is set once that happened: the server then exits with a non-zero status."""

    def __init__(self, async_engine, server: uvicorn.Server, console, grace: float = 5.0):
        self.async_engine, self.server, self.console, self.grace = async_engine, server, console, grace
        self.error: Optional[BaseException] = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="pagedmlx-engine-watch", daemon=True).start()

    def fail(self, error: BaseException) -> None:
        with self._lock:
            if self.error is not None:
                return
            self.error = error
        self.console.print(f"[bold red]pagedmlx: {error}[/]\npagedmlx: stopping the server")
        self.server.should_exit = True
        timer = threading.Timer(self.grace, lambda: hard_exit(1, "the server did not stop in time"))
        timer.daemon = True
        timer.start()

    def _watch(self) -> None:
        while self.error is None:
            if self.async_engine.dead is not None:
                self.fail(self.async_engine.dead)
            time.sleep(0.2)
