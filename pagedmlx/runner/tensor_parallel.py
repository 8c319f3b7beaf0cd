"""Tensor parallelism at the runner level: rank 0 sends each step's batch to the other ranks, every
rank runs the same sharded forward pass, and a lost or hung rank fails the group loudly.

Rank 0 owns the scheduler; every step it sends the SchedulerOutput's integer arrays through two
`mx.distributed.all_sum` calls (a fixed-size header, then the flat payload; the other ranks add
zeros), then runs the forward pass, whose sharded layers all-reduce among all ranks. A rank's
page pool holds only its own KV heads, so one block id names the same page on every rank.

The collectives block, so rank 0 runs them in one device thread (MLX arrays belong to the thread
that builds them: the whole step is built and evaluated there) and a watchdog fails the step when
they take longer than `timeout`. When idle, rank 0 pings the others every `heartbeat` seconds, so
a rank that died is noticed even with no requests. Any failure of a step on any rank is fatal
to the group (the ranks could not stay in step after it): RankLostError.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from pagedmlx.scheduler_output import SchedulerOutput

logger = logging.getLogger("pagedmlx")

STEP, PING, STOP = 1, 2, 3
_MAGIC = 0x7061  # "pa": a header of zeros (a rank that sent nothing) is never taken for a message


class RankLostError(RuntimeError):
    """A rank died, hung or fell out of step: the tensor-parallel group cannot go on."""


# ---- the step's batch on the wire --------------------------------------------------------------

def _field_layout() -> list[tuple[str, str]]:
    """(name, kind) for every SchedulerOutput field, from its annotation, so that a field added
    later travels without changes here (or fails loudly at import if its type is new)."""
    kinds = {"np.ndarray": "array", "int": "scalar", "list[int]": "ints", "list[str]": "names",
             "set[str]": "nameset"}
    layout = []
    for f in dataclasses.fields(SchedulerOutput):
        t = str(f.type).replace(" ", "")
        if t not in kinds:
            raise TypeError(f"tensor parallelism cannot send SchedulerOutput.{f.name} of type {t}")
        layout.append((f.name, kinds[t]))
    return layout


_LAYOUT = _field_layout()
_SLOTS = {"array": 3, "scalar": 1, "ints": 1, "names": 1, "nameset": 1}  # header ints per field
HEADER_LEN = 4 + sum(_SLOTS[k] for _, k in _LAYOUT)  # magic, kind, seq, payload length, fields


def pack(kind: int, seq: int, so: Optional[SchedulerOutput] = None) -> tuple[np.ndarray, np.ndarray]:
    """(header, payload) int32 arrays for one message. Strings (request ids) stay on rank 0:
    only their count travels."""
    header = np.zeros(HEADER_LEN, np.int32)
    header[:3] = _MAGIC, kind, seq
    parts, i = [], 4
    for name, k in _LAYOUT if so is not None else ():
        v = getattr(so, name)
        if k == "array":
            a = np.asarray(v)
            if a.dtype.kind not in "iu" or a.ndim > 2:
                raise TypeError(f"SchedulerOutput.{name}: only integer arrays of rank <= 2 travel")
            header[i:i + 1 + a.ndim] = (a.ndim, *a.shape)
            parts.append(a.astype(np.int32, copy=False).reshape(-1))
        elif k == "ints":
            header[i] = len(v)
            parts.append(np.asarray(v, np.int32).reshape(-1))
        elif k == "scalar":
            header[i] = int(v)
        else:
            header[i] = len(v)
        i += _SLOTS[k]
    payload = np.concatenate(parts) if parts else np.zeros(0, np.int32)
    header[3] = payload.size
    return header, payload


def unpack(header: np.ndarray, payload: np.ndarray) -> SchedulerOutput:
    values, i, at = {}, 4, 0
    for name, k in _LAYOUT:
        if k == "array":
            shape = tuple(int(d) for d in header[i + 1:i + 1 + int(header[i])])
            n = int(np.prod(shape))
            values[name] = payload[at:at + n].reshape(shape)
            at += n
        elif k == "ints":
            n = int(header[i])
            values[name] = [int(x) for x in payload[at:at + n]]
            at += n
        elif k == "scalar":
            values[name] = int(header[i])
        elif k == "names":
            values[name] = [f"r{j}" for j in range(int(header[i]))]  # placeholders: ids stay on rank 0
        else:
            values[name] = set()
        i += _SLOTS[k]
    return SchedulerOutput(**values)


def _all_sum(x: np.ndarray, group: mx.distributed.Group) -> np.ndarray:
    return np.array(mx.distributed.all_sum(mx.array(x), group=group, stream=mx.cpu))


def send(group: mx.distributed.Group, kind: int, seq: int, so: Optional[SchedulerOutput] = None) -> None:
    """Rank 0: one message to every other rank (the others call recv)."""
    header, payload = pack(kind, seq, so)
    _all_sum(header, group)
    if payload.size:
        _all_sum(payload, group)


def recv(group: mx.distributed.Group, seq: int) -> tuple[int, Optional[SchedulerOutput]]:
    header = _all_sum(np.zeros(HEADER_LEN, np.int32), group)
    if header[0] != _MAGIC or header[2] != seq:
        raise RankLostError(f"rank {group.rank()}: message {seq} from rank 0 is garbled "
                            f"(magic {header[0]:#x}, seq {header[2]}): the ranks fell out of step")
    payload = _all_sum(np.zeros(int(header[3]), np.int32), group) if header[3] else np.zeros(0, np.int32)
    kind = int(header[1])
    return kind, unpack(header, payload) if kind == STEP else None


# ---- rank 0 ---------------------------------------------------------------------------------------

class TPDriver:
    """Rank 0's runner: the engine calls forward(so) as on ModelRunner (whose other attributes it
    passes through); the step is sent to the other ranks and run in the device thread, and its
    logits come back evaluated."""

    def __init__(self, runner, group: mx.distributed.Group, timeout: float = 60.0, heartbeat: float = 2.0,
                 describe_peers: Optional[Callable[[], str]] = None):
        self.runner = runner
        self.group = group
        self.timeout = timeout
        self.heartbeat = heartbeat
        self.describe_peers = describe_peers  # extra words for errors, e.g. the exit codes of local ranks
        self.lost: Optional[RankLostError] = None
        self._listeners: list[Callable[[RankLostError], None]] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._busy_since: Optional[float] = None
        self._current: Optional[Future] = None
        self._seq = 0
        self._stopped = False
        self._thread = threading.Thread(target=self._device_loop, name="pagedmlx-tp-device", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="pagedmlx-tp-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    def __getattr__(self, name):  # num_blocks, kv_pool, vocab_size, ...: the local runner's
        if name == "runner":
            raise AttributeError(name)
        return getattr(self.runner, name)

    def on_lost(self, listener: Callable[[RankLostError], None]) -> None:
        """Call listener(error) (from a driver thread) once the group is lost."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._listeners.append(listener)
        if lost is not None:
            listener(lost)

    def forward(self, so: SchedulerOutput) -> mx.array:
        return self._submit(STEP, so).result()

    def close(self, timeout: float = 5.0) -> None:
        """Tell the other ranks to exit (they return from serve_worker); idempotent."""
        with self._lock:
            if self._stopped or self.lost is not None:
                return
            self._stopped = True
        fut = Future()
        self._jobs.put((STOP, None, fut))
        try:
            fut.result(timeout)
        except Exception as exc:  # noqa: BLE001 - closing anyway
            logger.warning("tensor parallel: the other ranks did not take the stop message: %s", exc)

    def _submit(self, kind: int, so: Optional[SchedulerOutput]) -> Future:
        fut = Future()
        with self._lock:
            if self.lost is not None:
                fut.set_exception(self.lost)
                return fut
            if self._stopped:
                fut.set_exception(RankLostError("tensor parallel: the group was stopped"))
                return fut
            self._jobs.put((kind, so, fut))
        return fut

    def _device_loop(self) -> None:
        while True:
            try:
                kind, so, fut = self._jobs.get(timeout=self.heartbeat)
            except queue.Empty:
                kind, so, fut = PING, None, None
            with self._lock:
                if self.lost is not None:
                    if fut is not None and not fut.done():
                        fut.set_exception(self.lost)
                    continue
                self._busy_since, self._current = time.monotonic(), fut
            try:
                self._seq += 1
                send(self.group, kind, self._seq, so)
                result = None
                if kind == STEP:
                    result = self.runner.forward(so)
                    mx.eval(result)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the ranks out of step
                what = "a step failed on rank 0" if kind == STEP and not _is_comm_error(exc) else "lost a rank"
                self._lose(RankLostError(f"tensor parallel: {what}: {exc}{self._peers()}"))
                continue
            finally:
                with self._lock:
                    self._busy_since, self._current = None, None
            if fut is not None:
                _resolve(fut, result)
            if kind == STOP:
                return

    def _watch(self) -> None:
        tick = max(0.05, min(1.0, self.timeout / 20))
        while self.lost is None and not (self._stopped and not self._thread.is_alive()):
            time.sleep(tick)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout:
                self._lose(RankLostError(
                    f"tensor parallel: no answer from the other ranks within {self.timeout:g} s "
                    f"(a rank hung or died, or the link between ranks is down){self._peers()}"))

    def _peers(self) -> str:
        try:
            extra = self.describe_peers() if self.describe_peers else ""
        except Exception:  # noqa: BLE001
            extra = ""
        return f"; {extra}" if extra else ""

    def _lose(self, error: RankLostError) -> None:
        with self._lock:
            if self.lost is not None:
                return
            self.lost = error
            failed = [self._current] if self._current is not None else []
            while True:
                try:
                    failed.append(self._jobs.get_nowait()[2])
                except queue.Empty:
                    break
            listeners, self._listeners = self._listeners, []
        logger.error("%s", error)
        for fut in failed:
            if fut is not None:
                _resolve(fut, None, error)
        for listener in listeners:
            try:
                listener(error)
            except Exception:  # noqa: BLE001
                logger.exception("rank-loss listener failed")


def _resolve(fut: Future, result, error: Optional[BaseException] = None) -> None:
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:  # the watchdog failed it first
        pass


def _is_comm_error(exc: BaseException) -> bool:
    text = str(exc).lower()
    return any(w in text for w in ("[ring]", "[jaccl]", "[mpi]", "[nccl]", "peer", "socket", "connection"))


# ---- ranks 1..N-1 -------------------------------------------------------------------------------

def serve_worker(runner, group: mx.distributed.Group) -> None:
    """Run rank 0's steps on this rank's shard until rank 0 sends STOP. Raises RankLostError when
    rank 0 goes away (the collective fails as its sockets close) or a step fails here."""
    seq = 0
    while True:
        seq += 1
        try:
            kind, so = recv(group, seq)
        except RankLostError:
            raise
        except Exception as exc:  # noqa: BLE001
            raise RankLostError(f"rank {group.rank()}: lost rank 0 ({exc})") from exc
        if kind == STOP:
            return
        if kind == STEP:
            try:
                mx.eval(runner.forward(so))
            except Exception as exc:  # noqa: BLE001
                raise RankLostError(f"rank {group.rank()}: step {seq} failed ({type(exc).__name__}: {exc})") from exc
        elif kind != PING:
            raise RankLostError(f"rank {group.rank()}: unknown message kind {kind} from rank 0")
