"""AsyncEngine: the front end of an engine core (vLLM's AsyncLLM), with one asyncio stream per request.

The core steps elsewhere: in a thread of this process (an LLMEngine or EngineCore given here) or in
a process of its own (a engine/core_client.py CoreProcess, what `pagedmlx serve` runs). Either way it only
sees token ids; this side tokenizes, turns token ids into text (the OutputProcessor), keeps request
metrics, and feeds each request's asyncio.Queue. The core's messages arrive on a thread of the
client's and are handed to the event loop once a step, so the step loop never waits on a client.

A request whose consumer goes away (disconnect, cancellation, garbage collection) is aborted, and
its pages are freed before the next step. Every accepted request ends with a finish_reason, or with
an exception when the core itself dies or shuts down.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Optional, Sequence, Union

from pagedmlx.engine.async_stream import (EngineDeadError, EngineShutdownError, RequestStream, TooManyRequestsError,
                                   resolve)
from pagedmlx.engine.core_client import CoreProcess, CoreThread
from pagedmlx.engine.core_info import CoreInfo
from pagedmlx.engine.messages import AddRequest
from pagedmlx.engine.llm_engine import LLMEngine, PromptType, encode_prompt, prompt_mm_features
from pagedmlx.lora.request import LoRARequest
from pagedmlx.engine.output_processor import OutputProcessor
from pagedmlx.outputs import EngineCoreOutput, EngineOutput, RequestOutput, RequestOutputBuilder
from pagedmlx.request import fan_out
from pagedmlx.sampling_params import SamplingParams

if TYPE_CHECKING:  # a core of this process (not the server's: its core has a process of its own)
    from pagedmlx.engine.core import EngineCore

logger = logging.getLogger("pagedmlx")


@dataclass
class RequestTiming:
    """Front-end timestamps of one request (time.monotonic), for latency metrics."""

    arrival: float
    first_token: Optional[float] = None
    last_token: Optional[float] = None


# A listener sees every output on the event loop: (output, its request's timing before this output, now).
OutputListener = Callable[[EngineOutput, RequestTiming, float], None]


class AsyncEngine:
    def __init__(self, engine: Union[LLMEngine, EngineCore, CoreProcess], max_waiting: Optional[int] = None,
                 start: bool = True):
        """engine: an LLMEngine or EngineCore, stepped by a thread of this process, or a CoreProcess.
        `start=False` leaves the core idle until start()."""
        core = engine.core if isinstance(engine, LLMEngine) else engine
        self.client = core if isinstance(core, CoreProcess) else CoreThread(core)
        self.engine: Optional[EngineCore] = None if isinstance(core, CoreProcess) else core  # in this process only
        self.max_waiting = max_waiting
        self.processor = OutputProcessor(self.tokenizer)
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # where streams live and outputs are processed
        self._lock = threading.Lock()  # the flags below, the pending calls
        self._streams: dict[str, asyncio.Queue] = {}
        self._adds: dict[str, tuple[asyncio.Future, list[str]]] = {}  # request id -> (accepted, child ids)
        self._calls: dict[int, tuple] = {}  # call id -> (loop, future, fn, args, kwargs)
        self._call_ids = itertools.count()
        self._timings: dict[str, RequestTiming] = {}
        self._listeners: list[OutputListener] = []
        self._num_pending_adds = 0  # child requests sent, not yet accepted
        self._core_waiting = 0  # requests waiting in the core, as it last said
        self._stop_requested = False
        self._closed = False  # the core said its last word (stopped or dead)
        self.dead: Optional[BaseException] = None
        if start:
            self.start()

    def start(self) -> None:
        self.client.start(self._receive)

    # ---- what the core is --------------------------------------------------------------------------

    @property
    def info(self) -> CoreInfo:
        return self.client.info

    @property
    def tokenizer(self) -> Any:
        return self.info.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def generation_defaults(self) -> dict[str, Any]:
        return self.info.generation_defaults

    def get_default_sampling_params(self, **overrides: Any) -> SamplingParams:
        """SamplingParams from the model's defaults; `overrides` (a request's own values) win."""
        return SamplingParams(**{**self.generation_defaults, **overrides})

    @property
    def is_running(self) -> bool:
        return self.client.is_alive() and self.dead is None and not self._stop_requested

    @property
    def stopping(self) -> bool:
        """A shutdown has begun: no new requests; the running ones drain until the deadline."""
        return self._stop_requested

    def add_listener(self, listener: OutputListener) -> None:
        self._listeners.append(listener)

    def num_waiting(self) -> int:
        """Requests accepted but not yet running: on their way to the core or in its waiting queue."""
        return self._num_pending_adds + self._core_waiting

    # ---- requests ----------------------------------------------------------------------------------

    async def add_request(self, request_id: str, prompt: PromptType, params: Optional[SamplingParams] = None,
                          priority: int = 0, cache_salt: Optional[str] = None,
                          lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Add one prompt (n > 1 fans out into children `{id}-{i}`). Returns once the core has
        accepted it; a bad request raises here (ValueError, also for an adapter that cannot be
        served), as does a full queue (TooManyRequestsError) or a dead / stopping engine."""
        return await self.add_requests(request_id, [prompt], params, priority, cache_salt, lora_request)

    async def add_requests(self, request_id: str, prompts: Sequence[PromptType],
                           params: Optional[SamplingParams] = None, priority: int = 0,
                           cache_salt: Optional[str] = None,
                           lora_request: Optional[LoRARequest] = None) -> RequestStream:
        """Several prompts as one request: child k = prompt k // n, sample k % n, id `{id}-{k}`
        (just `{id}` for a single prompt with n == 1). All are accepted or none. lora_request: the
        adapter they all run with (the engine needs enable_lora)."""
        params = params or self.get_default_sampling_params()
        if not prompts:
            raise ValueError("prompt must not be empty")
        loop = self._bind_loop()
        self._check_accepting()
        if self.max_waiting is not None and self.num_waiting() >= self.max_waiting:
            raise TooManyRequestsError(
                f"too many requests waiting ({self.num_waiting()} >= max_waiting {self.max_waiting})")
        if request_id in self._adds:
            raise ValueError(f"request id {request_id!r} is already in use")
        fanned = fan_out(request_id, prompts, params)
        children = [(rid, encode_prompt(self.tokenizer, p), cp) for rid, p, cp in fanned]
        mm_features = [prompt_mm_features(p) or [] for _, p, _ in fanned]  # a prompt's images (processed dicts)
        ids = [c[0] for c in children]
        try:
            for rid, prompt, child_params in children:
                self.processor.add_request(rid, prompt, child_params)
        except BaseException:
            self.processor.forget(ids[:-1] if ids[-1] not in self.processor.requests else ids)
            raise
        stream = RequestStream(ids, self._abort_nowait)
        arrival = time.monotonic()
        for rid in ids:
            self._streams[rid] = stream._queue
            self._timings[rid] = RequestTiming(arrival)
        accepted = loop.create_future()
        self._adds[request_id] = (accepted, ids)
        self._num_pending_adds += len(ids)
        self.client.send(("add", AddRequest(request_id, children, priority, cache_salt, arrival, lora_request,
                                            mm_features if any(mm_features) else None)))
        try:
            await accepted
        except asyncio.CancelledError:
            stream.close()  # sent after the add: the core applies both in order
            raise
        except BaseException:
            stream._finalizer.detach()
            raise
        return stream

    async def generate(self, prompt: PromptType, sampling_params: Optional[SamplingParams] = None,
                       request_id: Optional[str] = None, *, priority: int = 0, cache_salt: Optional[str] = None,
                       lora_request: Optional[LoRARequest] = None) -> AsyncIterator[RequestOutput]:
        """vLLM's AsyncLLM.generate: the request's RequestOutput after every step that changed it
        (cumulative: `outputs[i]` is sample i so far), the last one with finished=True. Stopping
        the iteration (break, cancellation, a closed generator) aborts the request."""
        request_id = request_id or uuid.uuid4().hex
        params = sampling_params or self.get_default_sampling_params()
        stream = await self.add_request(request_id, prompt, params, priority, cache_salt, lora_request)
        index = {rid: i for i, rid in enumerate(stream.request_ids)}
        builder = RequestOutputBuilder(request_id, prompt if isinstance(prompt, str) else None, len(index),
                                       self.tokenizer if params.detokenize else None, lora_request)
        try:
            async for out in stream:
                yield builder.add(index[out.request_id], out)
        finally:
            stream.close()

    def abort(self, request_ids: Union[str, Sequence[str]]) -> None:
        """Abort requests by engine id (a fanned-out request's are its stream's request_ids); thread-safe."""
        self._abort_nowait((request_ids,) if isinstance(request_ids, str) else tuple(request_ids))

    def _abort_nowait(self, request_ids: tuple[str, ...]) -> None:
        if not self._closed:
            self.client.send(("abort", list(request_ids)))

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read and check an adapter in the core (ValueError saying why it cannot be served)."""
        return await self.call(_add_lora, lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        return await self.call(_remove_lora, lora_id)

    async def list_loras(self) -> set[int]:
        return await self.call(_list_loras)

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """fn(core, *args, **kwargs) run by the core between steps (state snapshots, metrics). For a
        core in its own process, fn and its arguments must pickle (a module-level function does)."""
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        with self._lock:
            if self.dead is not None:
                raise EngineDeadError(f"the engine died: {self.dead!r}")
            direct = self._closed
            if not direct:
                call_id = next(self._call_ids)
                self._calls[call_id] = (loop, future, fn, args, kwargs)
                self.client.send(("call", call_id, fn, args, kwargs))
        if direct:
            if self.engine is None:
                raise EngineShutdownError("the engine was shut down")
            return fn(self.engine, *args, **kwargs)  # no core thread left: nothing else touches the core
        return await future

    def _bind_loop(self) -> asyncio.AbstractEventLoop:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            if self._loop is not None and not self._loop.is_closed() and self._streams:
                raise RuntimeError("an AsyncEngine serves one event loop at a time")
            self._loop = loop
        return loop

    def _check_accepting(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine died: {self.dead!r}")
        if self._stop_requested or self._closed:
            raise EngineShutdownError("the engine is shutting down")

    # ---- shutdown ----------------------------------------------------------------------------------

    def begin_shutdown(self, timeout: float = 30.0) -> None:
        """Stop taking requests, let the in-flight ones finish for up to `timeout` seconds, then abort
        the rest (their streams end with finish_reason "abort") and stop the core. Returns at once;
        the first call sets the deadline."""
        with self._lock:
            first = not self._stop_requested
            self._stop_requested = True
            if first and not self._closed:
                self.client.send(("drain", float(timeout)))

    def shutdown(self, timeout: float = 30.0) -> None:
        """begin_shutdown, then wait for the core to stop. Blocking; see shutdown_async."""
        self.begin_shutdown(timeout)
        self.client.join(timeout + 30.0)

    async def shutdown_async(self, timeout: float = 30.0) -> None:
        await asyncio.to_thread(self.shutdown, timeout)

    # ---- the core's messages (on the client's thread, then on the event loop) ------------------------

    def _receive(self, message: tuple) -> None:
        kind = message[0]
        if kind == "result":
            with self._lock:
                entry = self._calls.pop(message[1], None)
            if entry is not None:
                resolve(entry[0], entry[1], message[2], message[3])
            return
        if kind in ("stopped", "dead"):
            self._close(message[1] if kind == "dead" else None)
        loop = self._loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._on_message, message)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass

    def _on_message(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            self._core_waiting = message[2]
            self._on_outputs(message[1])
        elif kind == "added":
            self._on_added(*message[1:])
        elif kind in ("stopped", "dead"):
            self._fail_all()

    def _on_added(self, request_id: str, error: Optional[BaseException], num_waiting: int) -> None:
        entry = self._adds.pop(request_id, None)
        if entry is None:  # failed meanwhile (the core's last word)
            return
        future, ids = entry
        self._num_pending_adds -= len(ids)
        self._core_waiting = num_waiting
        if error is not None:
            self._forget(ids)
            if not future.done():
                future.set_exception(error)
        elif not future.done():
            future.set_result(None)

    def _on_outputs(self, core_outputs: list[EngineCoreOutput]) -> None:
        outputs, to_abort = self.processor.process(core_outputs)
        if to_abort:
            self._abort_nowait(tuple(to_abort))  # ended here (a stop string): the core still runs them
        now = time.monotonic()
        for out in outputs:
            rid = out.request_id
            timing = self._timings.pop(rid, None) if out.finished else self._timings.get(rid)
            if timing is not None:
                for listener in self._listeners:
                    try:
                        listener(out, timing, now)
                    except Exception:  # noqa: BLE001 - metrics never break serving
                        logger.exception("output listener failed")
                if out.new_token_ids:
                    timing.first_token = timing.first_token or now
                    timing.last_token = now
            queue = self._streams.pop(rid, None) if out.finished else self._streams.get(rid)
            if queue is not None:
                queue.put_nowait(out)

    def _forget(self, ids: list[str]) -> None:
        self.processor.forget(ids)
        for rid in ids:
            self._streams.pop(rid, None)
            self._timings.pop(rid, None)

    def _close(self, dead: Optional[BaseException]) -> None:
        """The core's last word (on the client's thread): settle the calls still waiting on it."""
        with self._lock:
            self._closed = True
            if dead is not None:
                self.dead = dead
            calls, self._calls = self._calls, {}
        for loop, future, fn, args, kwargs in calls.values():
            if self.engine is None or self.dead is not None:
                resolve(loop, future, None, self._error())
                continue
            try:  # a core thread that stopped: nothing else touches the core now
                resolve(loop, future, fn(self.engine, *args, **kwargs), None)
            except Exception as exc:  # noqa: BLE001
                resolve(loop, future, None, exc)

    def _error(self) -> BaseException:
        return (EngineDeadError(f"the engine died: {self.dead!r}") if self.dead is not None
                else EngineShutdownError("the engine was shut down"))

    def _fail_all(self) -> None:
        """On the loop, after the core's last word: every stream and add still open gets the error."""
        error = self._error()
        for future, _ in self._adds.values():
            if not future.done():
                future.set_exception(error)
        self._adds.clear()
        self._num_pending_adds = 0
        seen = set()
        for queue in self._streams.values():
            if id(queue) not in seen:
                seen.add(id(queue))
                queue.put_nowait(error)
        self._streams.clear()
        self.processor.forget(list(self.processor.requests))


# Run by the core between steps (module-level: they pickle to a core in its own process).
def _add_lora(core: EngineCore, lora_request: LoRARequest) -> bool:
    return core.add_lora(lora_request)


def _remove_lora(core: EngineCore, lora_id: int) -> bool:
    return core.remove_lora(lora_id)


def _list_loras(core: EngineCore) -> set[int]:
    return core.list_loras()
