"""The engine core's busy loop (vLLM's EngineCoreProc.run_busy_loop): apply what came in (adds,
aborts, calls, a drain), run a step, hand its outputs out; sleep only when there is nothing to do.

It runs in a thread of the server's process (engine/core_client.py's CoreThread) or as the engine-core
process's main loop (engine/core_proc.py); the messages (engine/messages.py) are the same either way. It never
waits on the front end: outputs go out with `send`, which must not block.
"""

from __future__ import annotations

import logging
import queue
import time
from typing import Callable, Optional

from pagedmlx.engine.core import EngineCore
from pagedmlx.engine.messages import AddRequest
from pagedmlx.outputs import EngineCoreOutput

logger = logging.getLogger("pagedmlx")

IDLE_WAIT_S = 0.005  # nothing could be scheduled (no pages free): look again this much later


class CoreLoop:
    def __init__(self, core: EngineCore, inbox: queue.Queue, send: Callable[[tuple], None]):
        self.core, self.inbox, self.send = core, inbox, send
        self.stopping = False
        self.deadline = 0.0
        self._num_waiting = 0  # as last reported

    def run(self) -> None:
        """Step until a drain ends (then send "stopped"); what kills the loop propagates."""
        core = self.core
        core.warm_up()  # in this thread, which steps: before the first request
        while True:
            self._apply_inbox(block=not self.stopping and not core.has_unfinished_requests())
            if self.stopping and (not core.has_unfinished_requests() or time.monotonic() >= self.deadline):
                ids = list(core.scheduler.requests)
                if ids:
                    logger.warning("shutdown: the drain deadline passed; aborting %d unfinished requests "
                                   "(they end with finish_reason \"abort\")", len(ids))
                self._send_outputs(core.abort_request(ids), always=True)
                self.send(("stopped",))
                return
            if not core.has_unfinished_requests():
                continue
            num_steps = core.stats.num_steps
            outputs = core.step()
            self._send_outputs(outputs)
            if not outputs and core.stats.num_steps == num_steps and not core.has_step_in_flight:
                self._apply_inbox(block=True, timeout=IDLE_WAIT_S)  # nothing scheduled: wait for a change

    def _apply_inbox(self, block: bool, timeout: Optional[float] = None) -> None:
        items = []
        if block:
            try:
                items.append(self.inbox.get(timeout=timeout))
            except queue.Empty:
                return
        while True:
            try:
                items.append(self.inbox.get_nowait())
            except queue.Empty:
                break
        for item in items:
            self._apply(item)

    def _apply(self, item: tuple) -> None:
        kind = item[0]
        if kind == "add":
            self._add(item[1])
        elif kind == "abort":
            self._send_outputs(self.core.abort_request(item[1]))
        elif kind == "call":
            _, call_id, fn, args, kwargs = item
            try:
                self.send(("result", call_id, fn(self.core, *args, **kwargs), None))
            except Exception as exc:  # noqa: BLE001 - handed back to the caller
                self.send(("result", call_id, None, exc))
        elif kind == "drain":
            if not self.stopping:
                self.stopping, self.deadline = True, time.monotonic() + item[1]
        else:
            logger.error("engine core: unknown message %r", kind)

    def _add(self, add: AddRequest) -> None:
        added: list[str] = []
        error = None
        try:
            for i, (rid, prompt, params) in enumerate(add.children):
                self.core.add_request(rid, prompt, params, priority=add.priority, arrival_time=add.arrival_time,
                                      cache_salt=add.cache_salt, lora_request=add.lora_request,
                                      mm_features=add.mm_features[i] if add.mm_features else None)
                added.append(rid)
        except Exception as exc:  # noqa: BLE001 - a bad request: its caller hears why
            self.core.abort_request(added)
            error = exc
        self._num_waiting = len(self.core.scheduler.waiting)
        self.send(("added", add.request_id, error, self._num_waiting))

    def _send_outputs(self, outputs: list[EngineCoreOutput], always: bool = False) -> None:
        waiting = len(self.core.scheduler.waiting)
        if outputs or always or waiting != self._num_waiting:
            self._num_waiting = waiting
            self.send(("outputs", outputs, waiting))
