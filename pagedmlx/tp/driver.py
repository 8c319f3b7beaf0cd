"""Tensor parallelism at the runner level: rank 0 sends each step's batch to the other ranks, every
rank runs the same sharded forward pass, and a lost or hung rank fails the group loudly.

Every step, rank 0 sends the SchedulerOutput's integer arrays to the other ranks over the control
channel (tp/channel.py), runs the forward pass, whose sharded layers all-reduce among all
ranks through mx.distributed, then waits for every rank's acknowledgement before it hands the
logits to the sampler. A rank's page pool holds only its own KV heads, so one block id names the
same page on every rank.

A lost rank does not always make a collective fail: the ring backend was seen to hand back the
survivors' partial sum once after a peer died, then to block. The acknowledgements make such a
step fail instead of being sampled. The collectives block, so rank 0 runs the step in one device
thread (MLX arrays belong to the thread that builds them: the whole step is built and evaluated
there) and a watchdog fails it when it takes longer than `timeout`; the watchdog also notices a
rank whose connection closes while idle. Any failure of a step on any rank is fatal to the
group (the ranks could not stay in step after it): RankLostError.
"""

from __future__ import annotations

import logging
import os
import queue
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from typing import Callable, Optional

import mlx.core as mx

from pagedmlx.core.sched.output import SchedulerOutput
from pagedmlx.tp.channel import STEP, STOP, ControlClient, ControlServer, RankLostError

logger = logging.getLogger("pagedmlx")

__all__ = ["RankLostError", "TPDriver", "serve_worker"]


# ---- rank 0 ---------------------------------------------------------------------------------------

class TPDriver:
    """Rank 0's runner: the engine calls forward(so) as on ModelRunner; the step is sent to the
    other ranks and run in the device thread, and its logits come back evaluated."""

    def __init__(self, runner, group: mx.distributed.Group, timeout: float = 60.0,
                 peers_status: Optional[Callable[[float], str]] = None):
        self.runner = runner
        self.group = group
        self.timeout = timeout
        # peers_status(wait): words on ranks known to have exited (local ranks), waiting up to `wait` s
        self.peers_status = peers_status
        self.lost: Optional[RankLostError] = None
        self._listeners: list[Callable[[RankLostError], None]] = []
        self._lock = threading.Lock()
        self._jobs: queue.Queue = queue.Queue()
        self._busy_since: Optional[float] = None
        self._current: Optional[Future] = None
        self._seq = 0
        self._stopped = False
        self.control = ControlServer(group, dead_ranks=peers_status and (lambda: peers_status(0.0)))
        self._thread = threading.Thread(target=self._device_loop, name="pagedmlx-tp-device", daemon=True)
        self._watchdog = threading.Thread(target=self._watch, name="pagedmlx-tp-watchdog", daemon=True)
        self._thread.start()
        self._watchdog.start()

    # The runner interface the engine uses (runner/model.py's Runner), answered by the local shard.
    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def kv_pool(self):
        return self.runner.kv_pool

    @property
    def kv_cache_config(self):
        return self.runner.kv_cache_config

    @property
    def bytes_per_block(self) -> int:
        return self.runner.bytes_per_block

    pages_in_place = False  # lockstep: each step is evaluated in the device thread before it returns

    def repair_pages(self) -> bool:
        """Not repaired: the ranks would have to zero their pools together (a failed step fails its requests)."""
        return False

    def on_lost(self, listener: Callable[[RankLostError], None]) -> None:
        """Call listener(error) (from a driver thread) once the group is lost."""
        with self._lock:
            lost = self.lost
            if lost is None:
                self._listeners.append(listener)
        if lost is not None:
            listener(lost)

    def forward(self, so: SchedulerOutput, prev_sampled: Optional[mx.array] = None) -> mx.array:
        so.inline_drafts()  # a draft model's drafts, on rank 0's device: the other ranks get them as tokens
        if len(so.placeholder_rows):  # TPEngine steps in lockstep: every input token is on the host
            raise RuntimeError("tensor parallel steps need every input token on the host")
        return self._submit(STEP, so).result()

    def close(self, timeout: float = 5.0) -> None:
        """Tell the other ranks to exit (they return from serve_worker); idempotent."""
        fut = Future()
        with self._lock:
            if self._stopped or self.lost is not None:
                return
            self._jobs.put((STOP, None, fut))
            self._stopped = True
        try:
            fut.result(timeout)
        except Exception as exc:  # noqa: BLE001 - closing anyway
            if self.lost is None:
                logger.warning("tensor parallel: the other ranks did not take the stop message: %s", exc)

    def _submit(self, kind: int, so: Optional[SchedulerOutput]) -> Future:
        fut = Future()
        with self._lock:
            if self.lost is not None or self._stopped:
                fut.set_exception(self.lost or RankLostError("tensor parallel: the group was stopped"))
                return fut
            self._jobs.put((kind, so, fut))
        return fut

    def _device_loop(self) -> None:
        while True:
            kind, so, fut = self._jobs.get()
            with self._lock:
                if self.lost is not None:
                    _resolve(fut, None, self.lost)
                    continue
                self._busy_since, self._current = time.monotonic(), fut
            result = None
            try:
                self._seq += 1
                self.control.send(kind, self._seq, so)
                if kind == STEP:
                    result = self.runner.forward(so)
                    mx.eval(result)
                    self.control.wait_acks(self._seq)
            except Exception as exc:  # noqa: BLE001 - any failure leaves the ranks out of step
                what = "lost a rank" if isinstance(exc, RankLostError) or _is_comm_error(exc) else \
                    "a step failed on rank 0"
                self._lose(RankLostError(f"tensor parallel: {what}: {exc}{self._peers()}"))
                continue
            finally:
                with self._lock:
                    self._busy_since, self._current = None, None
            _resolve(fut, result)
            if kind == STOP:
                self.control.close()
                return

    def _watch(self) -> None:
        tick = max(0.05, min(0.5, self.timeout / 20))
        while self.lost is None and self._thread.is_alive():
            time.sleep(tick)
            since = self._busy_since
            if since is not None and time.monotonic() - since > self.timeout:
                self._lose(RankLostError(
                    f"tensor parallel: no answer from the other ranks within {self.timeout:g} s "
                    f"(a rank hung or died, or the link between ranks is down){self._peers()}"))
            elif self._thread.is_alive() and not self._stopped:
                try:
                    gone = self.control.closed_ranks()
                except (OSError, ValueError):  # closed under us: the device thread is ending
                    gone = []
                if gone:
                    self._lose(RankLostError(
                        f"tensor parallel: lost a rank: rank {gone[0]} closed its connection (it exited, or "
                        f"its machine went away){self._peers()}"))

    def _peers(self) -> str:
        try:
            extra = self.peers_status(1.0) if self.peers_status else ""
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
        logger.debug("%s", error)  # the step that raises it, or the on_lost listeners, report it
        for fut in failed:
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

def serve_worker(runner, group: mx.distributed.Group, timeout: float = 60.0) -> None:
    """Run rank 0's steps on this rank's shard until rank 0 sends STOP. Raises RankLostError when
    rank 0 goes away (its connection closes) or a step fails here; a step stuck for longer than
    twice `timeout` (a collective that lost its peer) ends the process from a watchdog thread.
    Twice: rank 0 gives up after `timeout`, and it is rank 0 that should say why."""
    rank = group.rank()
    control = ControlClient(group)  # in step with rank 0's ControlServer
    state = {"since": None, "done": False}

    def watch() -> None:
        limit = 2 * timeout
        while not state["done"]:
            time.sleep(min(1.0, limit / 10))
            since = state["since"]
            if since is not None and time.monotonic() - since > limit:
                print(f"pagedmlx rank {rank}: a step has waited on the other ranks for {limit:g} s; exiting",
                      file=sys.stderr, flush=True)
                os._exit(1)

    threading.Thread(target=watch, name="pagedmlx-tp-worker-watchdog", daemon=True).start()
    try:
        while True:
            try:
                kind, seq, so = control.recv()
            except (OSError, ConnectionError) as exc:
                raise RankLostError(f"lost rank 0 ({exc})") from exc
            if kind == STOP:
                return
            if kind != STEP:
                raise RankLostError(f"unknown message kind {kind} from rank 0")
            state["since"] = time.monotonic()
            try:
                mx.eval(runner.forward(so))
            except Exception as exc:  # noqa: BLE001
                try:
                    control.ack(seq, ok=False)  # rank 0 hears which rank failed
                except OSError:
                    pass
                raise RankLostError(f"step {seq} failed ({type(exc).__name__}: {exc})") from exc
            state["since"] = None
            try:
                control.ack(seq)
            except OSError as exc:
                raise RankLostError(f"lost rank 0 ({exc})") from exc
    finally:
        state["done"] = True
        control.close()
