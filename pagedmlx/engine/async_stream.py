"""The asyncio side of the engine core: per-request output streams, the errors a caller may get,
and the thread-safe way to settle a future of an event loop."""

from __future__ import annotations

import asyncio
import weakref
from typing import Any, Callable, Optional

from pagedmlx.outputs import EngineOutput


class TooManyRequestsError(RuntimeError):
    """The waiting queue is full: try again later (HTTP 429)."""


class EngineDeadError(RuntimeError):
    """The engine thread died; no request can make progress (HTTP 503)."""


class EngineShutdownError(RuntimeError):
    """The engine is shutting down and takes no new requests (HTTP 503)."""


class RequestStream:
    """The outputs of one request (all its n samples / prompts), as an async iterator.

    Ends when every child request has finished. `close()` aborts what is unfinished; so does
    garbage collection of a stream that was dropped without being closed.
    """

    def __init__(self, request_ids: list[str], abort: Callable[[tuple[str, ...]], None]):
        self.request_ids = request_ids
        self._index = {rid: i for i, rid in enumerate(request_ids)}
        self._queue: asyncio.Queue = asyncio.Queue()
        self._unfinished = set(request_ids)
        self._error: Optional[BaseException] = None  # met by ready(), raised next
        self._finalizer = weakref.finalize(self, abort, tuple(request_ids))

    def index(self, request_id: str) -> int:
        """Which child (choice index) an output belongs to."""
        return self._index[request_id]

    @property
    def finished(self) -> bool:
        return not self._unfinished

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> EngineOutput:
        if not self._unfinished:
            raise StopAsyncIteration
        return self._take(self._error or await self._queue.get())

    def ready(self) -> list[EngineOutput]:
        """The outputs already queued behind the one just read, without waiting (an error queued
        among them is raised by the next __anext__)."""
        items = []
        while self._unfinished and self._error is None and not self._queue.empty():
            item = self._queue.get_nowait()
            if isinstance(item, BaseException):
                self._error = item
            else:
                items.append(self._take(item))
        return items

    def _take(self, item):
        if isinstance(item, BaseException):
            self._unfinished.clear()
            self._finalizer.detach()
            raise item
        if item.finished:
            self._unfinished.discard(item.request_id)
            if not self._unfinished:
                self._finalizer.detach()
        return item

    def close(self) -> None:
        """Abort the children that have not finished (idempotent)."""
        if self._unfinished:
            self._unfinished.clear()
            self._finalizer()


def resolve(loop: asyncio.AbstractEventLoop, future: asyncio.Future, result: Any,
             exc: Optional[BaseException]) -> None:
    """From any thread: settle a future of `loop` (unless its awaiter was cancelled meanwhile)."""
    def set_it() -> None:
        if future.done():  # the caller was cancelled meanwhile
            return
        if exc is not None:
            future.set_exception(exc)
        else:
            future.set_result(result)

    try:
        loop.call_soon_threadsafe(set_it)
    except RuntimeError:
        pass
