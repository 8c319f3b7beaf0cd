"""AsyncEngine: an LLMEngine stepping in one dedicated thread, with one asyncio stream per request.

Callers (the server's handlers) live on an event loop; the engine lives in its own thread and
is the only code that touches the LLMEngine. They meet in two places:

- the inbox, a list under a condition variable: adds, aborts and calls go in from any thread
  and are applied between steps; the engine thread sleeps on the condition when idle;
- each request's asyncio.Queue, fed once per step per event loop with `call_soon_threadsafe`,
  so the step loop never waits on a slow client.

A request whose consumer goes away (disconnect, cancellation, garbage collection) is aborted,
and its pages are freed before the next step. Every accepted request ends with a finish_reason,
or with an exception when the engine thread itself dies or shuts down.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable, Optional, Sequence

from pagedmlx.async_stream import (EngineDeadError, EngineShutdownError, RequestStream, TooManyRequestsError,
                                   deliver, resolve)
from pagedmlx.engine import LLMEngine, PromptType
from pagedmlx.outputs import EngineOutput, RequestOutput, RequestOutputBuilder
from pagedmlx.request import fan_out
from pagedmlx.sampling_params import SamplingParams

logger = logging.getLogger("pagedmlx")


@dataclass
class RequestTiming:
    """Engine-thread timestamps of one request (time.monotonic), for latency metrics."""

    arrival: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None


# A listener sees every output in the engine thread: (output, its request's timing before this
# output, now). It must be quick and thread-safe (prometheus_client's metrics are).
OutputListener = Callable[[EngineOutput, RequestTiming, float], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine, max_waiting: Optional[int] = None, start: bool = True):
        self.engine = engine
        self.max_waiting = max_waiting
        self._cond = threading.Condition()
        self._inbox: list[tuple] = []
        self._num_pending_adds = 0  # child requests in the inbox, not yet in the scheduler
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._timings: dict[str, RequestTiming] = {}
        self._listeners: list[OutputListener] = []
        self._stop_requested = False
        self._deadline = 0.0
        self._closed = False  # the engine thread has exited (normally or not)
        self.dead: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, name="pagedmlx-engine", daemon=True)
        if start:
            self._thread.start()

    # ---- caller side (any event loop) ---------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self.dead is None and not self._stop_requested

    @property
    def stopping(self) -> bool:
        """A shutdown has begun: no new requests; the running ones drain until the deadline."""
        return self._stop_requested

    def add_listener(self, listener: OutputListener) -> None:
        self._listeners.append(listener)

    def num_waiting(self) -> int:
        """Requests accepted but not yet running: in the inbox or the scheduler's waiting queue."""
        return self._num_pending_adds + len(self.engine.scheduler.waiting)

    async def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                          priority: int = 0, cache_salt: Optional[str] = None) -> RequestStream:
        """Add one prompt (n > 1 fans out into children `{id}-{i}`). Returns once the engine has
        accepted it; a bad request raises here (ValueError), as does a full queue
        (TooManyRequestsError) or a dead / stopping engine."""
        return await self.add_requests(request_id, [prompt], params, priority, cache_salt)

    async def add_requests(self, request_id: str, prompts: Sequence[PromptType],
                           params: Optional[SamplingParams] = None, priority: int = 0,
                           cache_salt: Optional[str] = None) -> RequestStream:
        """Several prompts as one request: child k = prompt k // n, sample k % n, id `{id}-{k}`
        (just `{id}` for a single prompt with n == 1). All are accepted or none."""
        params = params or self.engine.get_default_sampling_params()
        if not prompts:
            raise ValueError("prompt must not be empty")
        children = fan_out(request_id, prompts, params)
        ids = [c[0] for c in children]
        loop = asyncio.get_running_loop()
        accepted = loop.create_future()
        arrival = time.monotonic()
        with self._cond:
            self._check_accepting()
            if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
                raise TooManyRequestsError(
                    f"too many requests waiting ({self.num_waiting()} >= max_waiting {self.max_waiting})")
            taken = [rid for rid in ids if rid in self._streams]
            if taken:
                raise ValueError(f"request id {taken[0]!r} is already in use")
            stream = RequestStream(ids, self._abort_nowait)
            for rid in ids:
                self._streams[rid] = (loop, stream._queue)
            self._inbox.append(("add", children, priority, cache_salt, arrival, loop, accepted))
            self._num_pending_adds += len(children)
            self._cond.notify()
        try:
            await accepted
        except asyncio.CancelledError:
            stream.close()  # queued after the add: the engine applies both in order
            raise
        except BaseException:
            stream._finalizer.detach()
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, priority: int = 0,
                       cache_salt: Optional[str] = None) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLM.generate: the request's RequestOutput after every step that changed it
        (cumulative: `outputs[i]` is sample i so far), the last one with finished=True. Stopping
        the iteration (break, cancellation, a closed generator) aborts the request."""
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or self.engine.get_default_sampling_params()
        stream = await self.add_request(request_id, prompt, params, priority, cache_salt)
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        builder = RequestOutputBuilder(request_id, prompt if isinstance(prompt, str) else None, len(index),
                                       self.engine.tokenizer)
        try:
            async for out in stream:
                yield builder.add(index[out.request_id], out)
        finally:
            stream.close()

    def abort(self, request_ids: str | Sequence[str]) -> None:
        """Abort requests by engine id (a fanned-out request's are its stream's request_ids); thread-safe."""
        self._abort_nowait((request_ids,) if isinstance(request_ids, str) else tuple(request_ids))

    def _abort_nowait(self, request_ids: tuple[str, ...]) -> None:
        with self._cond:
            if not self._closed:
                self._inbox.append(("abort", request_ids))
                self._cond.notify()

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Run fn(engine) in the engine thread between steps (state snapshots, metrics)."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        with self._cond:
            if self.dead is not None:
                raise EngineDeadError(f"the engine died: {self.dead!r}")
            direct = self._closed
            if not direct:
                self._inbox.append(("call", fn, loop, done))
                self._cond.notify()
        if direct:  # no engine thread left: nothing else touches the engine
            return fn(self.engine)
        return await done

    def _check_accepting(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine died: {self.dead!r}")
        if self._stop_requested or self._closed:
            raise EngineShutdownError("the engine is shutting down")

    def begin_shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let the in-flight ones finish for up to `timeout` seconds, then abort
        the rest (their streams end with finish_reason "abort") and stop the engine thread. Returns
        at once; the first call sets the deadline."""
        with self._cond:
            if not self._stop_requested:
                self._stop_requested = True
                self._deadline = time.monotonic() + timeout
            self._cond.notify()

    def shutdown(self, timeout: float = 30.0) -> None:
        """begin_shutdown, then wait for the engine thread to stop. Blocking; see shutdown_async."""
        self.begin_shutdown(timeout)
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    async def shutdown_async(self, timeout: float = 30.0) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self.engine.warm_up()  # in this thread, which steps: before the first request
            self._loop()
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop, consumers must hear of it
            logger.exception("the engine thread died")
            self.dead = exc
        finally:
            self._close()

    def _loop(self) -> None:
        engine = self.engine
        while True:
            with self._cond:
                while not (self._inbox or self._stop_requested or engine.has_unfinished_requests()):
                    self._cond.wait()
                inbox, self._inbox = self._inbox, []
                stopping, deadline = self._stop_requested, self._deadline
            self._apply(inbox)
            if stopping and (not engine.has_unfinished_requests() or time.monotonic() >= deadline):
                ids = list(engine.scheduler.requests)
                if ids:
                    logger.warning("shutdown: the drain deadline passed; aborting %d unfinished requests "
                                   "(they end with finish_reason \"abort\")", len(ids))
                self._publish(engine.abort_request(ids))
                return
            if not engine.has_unfinished_requests():
                continue
            num_steps = engine.stats.num_steps
            outputs = engine.step()
            self._publish(outputs)
            if not outputs and engine.stats.num_steps == num_steps and not engine.has_step_in_flight:
                with self._cond:  # nothing could be scheduled: wait for a change instead of spinning
                    if not self._inbox:
                        self._cond.wait(0.005)

    def _apply(self, inbox: list[tuple]) -> None:
        for item in inbox:
            kind = item[0]
            if kind == "add":
                self._apply_add(*item[1:])
            elif kind == "abort":
                self._publish(self.engine.abort_request(item[1]))
            elif kind == "call":
                _, fn, loop, done = item
                try:
                    resolve(loop, done, fn(self.engine), None)
                except Exception as exc:  # noqa: BLE001 - handed back to the caller
                    resolve(loop, done, None, exc)

    def _apply_add(self, children, priority, cache_salt, arrival, loop, accepted) -> None:
        added: list[str] = []
        try:
            for rid, prompt, params in children:
                self.engine.add_request(rid, prompt, params, priority=priority, cache_salt=cache_salt)
                added.append(rid)
                self._timings[rid] = RequestTiming(arrival)
        except Exception as exc:  # noqa: BLE001 - a bad request: hand the error to its caller
            self.engine.abort_request(added)
            with self._cond:
                for rid, _, _ in children:
                    self._streams.pop(rid, None)
                    self._timings.pop(rid, None)
            resolve(loop, accepted, None, exc)
        else:
            resolve(loop, accepted, None, None)
        finally:
            with self._cond:
                self._num_pending_adds -= len(children)

    def _publish(self, outputs: list[EngineOutput]) -> None:
        """Hand a step's outputs to their streams: one wake-up per event loop per step."""
        if not outputs:
            return
        now = time.monotonic()
        for out in outputs:  # timings are the engine thread's own: no lock
            timing = self._timings.pop(out.request_id, None) if out.finished else self._timings.get(out.request_id)
            if timing is None:
                continue
            for listener in self._listeners:
                try:
                    listener(out, timing, now)
                except Exception:  # noqa: BLE001 - metrics never break serving
                    logger.exception("output listener failed")
            if out.new_token_ids:
                timing.first_token = timing.first_token or now
                timing.last_token = now
        batches: dict[asyncio.AbstractEventLoop, list] = {}
        with self._cond:
            for out in outputs:
                rid = out.request_id
                entry = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
                if entry is not None:
                    batches.setdefault(entry[0], []).append((entry[1], out))
        for loop, items in batches.items():
            deliver(loop, items)

    def _close(self) -> None:
        """The thread is ending: fail everything still waiting on it."""
        error = (EngineDeadError(f"the engine died: {self.dead!r}") if self.dead is not None
                 else EngineShutdownError("the engine was shut down"))
        with self._cond:
            self._closed = True
            inbox, self._inbox = self._inbox, []
            streams, self._streams = self._streams, {}
        batches: dict[asyncio.AbstractEventLoop, dict[int, tuple]] = {}
        for loop, queue in streams.values():
            batches.setdefault(loop, {})[id(queue)] = (queue, error)
        for loop, items in batches.items():
            deliver(loop, list(items.values()))
        for item in inbox:
            if item[0] == "add":
                resolve(item[5], item[6], None, error)
            elif item[0] == "call" and self.dead is not None:
                resolve(item[2], item[3], None, error)
            elif item[0] == "call":  # the engine is idle for good: run it here
                try:
                    resolve(item[2], item[3], item[1](self.engine), None)
                except Exception as exc:  # noqa: BLE001
                    resolve(item[2], item[3], None, exc)
