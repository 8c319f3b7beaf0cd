"""The front end's handle on an engine core (vLLM's core_client.py), in one of two places:

- CoreThread: a thread of this process steps the core (offline async use, tests, tensor parallelism
  under MPI);
- CoreProcess: the core lives in a process of its own (spawned, so MLX and the model exist only
  there) and talks over ZeroMQ: the server's default, so that the step loop never shares an
  interpreter lock with the HTTP side.

Both take messages with `send` (thread-safe, never blocks) and hand the core's messages, from a
thread of their own, to the `receive` given to `start` (engine/messages.py lists both directions).
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import shutil
import tempfile
import threading
from typing import Any, Callable, Optional

from pagedmlx.engine.core_info import CoreInfo

logger = logging.getLogger("pagedmlx")

Receive = Callable[[tuple], None]


class CoreThread:
    """The core stepped by a thread of this process."""

    def __init__(self, core: Any):
        self.core = core
        self.inbox: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, name="pagedmlx-engine", daemon=True)
        self._receive: Optional[Receive] = None
        self.info = CoreInfo.of(core)

    def start(self, receive: Receive) -> None:
        self._receive = receive
        self.thread.start()

    def send(self, message: tuple) -> None:
        self.inbox.put(message)

    def is_alive(self) -> bool:
        return self.thread.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        if self.thread.is_alive() and self.thread is not threading.current_thread():
            self.thread.join(timeout)

    def _run(self) -> None:
        from pagedmlx.engine.core_loop import CoreLoop  # the model's side: not imported by a front end of a process

        try:
            CoreLoop(self.core, self.inbox, self._receive).run()
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop, the front end must hear of it
            logger.exception("the engine thread died")
            self._receive(("dead", exc))


class CoreStartupError(RuntimeError):
    """The engine-core process could not build its engine (the message says why)."""


class CoreProcess:
    """The core in a spawned process of its own; requests and outputs over ZeroMQ (ipc sockets in a
    private temporary folder). The process exits when this one does (it watches its parent)."""

    def __init__(self, config: Any, *, distributed: bool = False, tp: Optional[int] = None, tp_timeout: float = 60.0,
                 argv: Optional[list[str]] = None, log_level: str = "info", wait: bool = True):
        """config: the EngineConfig to build. distributed: tensor parallelism (`tp` ranks, or a
        launcher's); the process becomes rank 0 and `argv` starts the others (`--tp N`). wait=False:
        return once the process is started; wait_ready() before use."""
        import zmq

        from pagedmlx.engine.core_proc import CoreArgs, run_engine_core

        self._zmq = zmq
        self._dir = tempfile.mkdtemp(prefix="pagedmlx-")
        paths = [f"ipc://{os.path.join(self._dir, name)}" for name in ("in", "out")]
        self._ctx = zmq.Context()
        self._input = self._ctx.socket(zmq.PUSH)
        self._input.setsockopt(zmq.SNDHWM, 0)  # never block the event loop: the core reads all it gets
        self._input.bind(paths[0])
        self._output = self._ctx.socket(zmq.PULL)
        self._output.setsockopt(zmq.RCVHWM, 0)
        self._output.bind(paths[1])
        self._lock = threading.Lock()
        args = CoreArgs(config, paths[0], paths[1], distributed, tp, tp_timeout, argv, log_level)
        self.proc = multiprocessing.get_context("spawn").Process(
            target=run_engine_core, args=(args,), name="pagedmlx-engine-core", daemon=True)
        self.proc.start()
        self.thread: Optional[threading.Thread] = None
        self.info: Optional[CoreInfo] = None
        if wait:
            self.wait_ready()

    def wait_ready(self, while_starting: Optional[Callable[[], None]] = None,
                   on_tokenizer: Optional[Callable[[Any], None]] = None) -> CoreInfo:
        """Wait for the core's "ready" (CoreStartupError: it could not start), running `while_starting` (the
        front end's own start-up) first, beside the core's, and on_tokenizer(tokenizer) once the core has
        read its model (the front end's work on the tokenizer, beside the rest of the core's)."""
        try:
            if while_starting is not None:
                while_starting()
            self.info = self._wait_ready(on_tokenizer)
        except BaseException:
            self.join(timeout=5)
            raise
        return self.info

    def _wait_ready(self, on_tokenizer: Optional[Callable[[Any], None]] = None) -> CoreInfo:
        from pagedmlx.engine.messages import decode

        poller = self._zmq.Poller()
        poller.register(self._output, self._zmq.POLLIN)
        poller.register(self.proc.sentinel, self._zmq.POLLIN)
        tokenizer = None
        while True:
            events = dict(poller.poll())
            if self._output in events:
                message = decode(self._output.recv_multipart())
                if message[0] == "tokenizer":  # before "ready", which then leaves it out
                    tokenizer = message[1]
                    if on_tokenizer is not None and tokenizer is not None:
                        on_tokenizer(tokenizer)
                elif message[0] == "ready":
                    info = message[1]
                    if info.tokenizer is None:
                        info.tokenizer = tokenizer
                    return info
                if message[0] == "failed":
                    raise CoreStartupError(message[1])
            elif not self.proc.is_alive():
                raise CoreStartupError(f"the engine core process exited with code {self.proc.exitcode} while "
                                       f"starting (its error is above)")

    def start(self, receive: Receive) -> None:
        """Hand the core's messages to `receive` from now on (one front end per core)."""
        if self.thread is not None:
            raise RuntimeError("this engine core already has a front end")
        self.thread = threading.Thread(target=self._read, args=(receive,), name="pagedmlx-core-output", daemon=True)
        self.thread.start()

    def send(self, message: tuple) -> None:
        from pagedmlx.engine.messages import encode

        frames = encode(message)
        with self._lock:
            if not self._input.closed:
                self._input.send_multipart(frames, copy=False)

    def is_alive(self) -> bool:
        return self.proc.is_alive()

    def join(self, timeout: Optional[float] = None) -> None:
        """Wait for the process to end (after a drain), killing it past `timeout`; then clean up."""
        self.proc.join(timeout)
        if self.proc.is_alive():
            logger.warning("the engine core process did not stop in time; killing it")
            self.proc.kill()
            self.proc.join(5)
        with self._lock:
            if self._ctx.closed:  # joined before
                return
            self._input.close(linger=0)
        if self.thread is None:
            self._output.close(linger=0)
        self._ctx.term()  # wakes the reader thread, which closes its own socket (zmq sockets stay in their thread)
        shutil.rmtree(self._dir, ignore_errors=True)

    def _read(self, receive: Receive) -> None:
        """Hand every message of the core to `receive`; end with its last ("stopped" / "dead"), or a
        "dead" of our own when the process exits without one."""
        from pagedmlx.engine.async_stream import EngineDeadError
        from pagedmlx.engine.messages import decode

        zmq = self._zmq
        poller = zmq.Poller()
        poller.register(self._output, zmq.POLLIN)
        poller.register(self.proc.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                exited = self.proc.sentinel in events
                # Read what is queued first: a process that exits right after its last message.
                while self._output.poll(100 if exited else 0):
                    message = decode(self._output.recv_multipart())
                    receive(message)
                    if message[0] in ("stopped", "dead"):
                        return
                if exited:
                    self.proc.join(1)  # reap it: its exit code is known only then
                    receive(("dead", EngineDeadError(
                        f"the engine core process (pid {self.proc.pid}) exited with code {self.proc.exitcode}")))
                    return
        except zmq.ZMQError:  # the context is ending: join()
            return
        finally:
            self._output.close(linger=0)
