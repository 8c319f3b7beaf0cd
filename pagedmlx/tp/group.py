"""Joining (or starting) the group of tensor-parallel ranks: under a launcher every process joins
the group its environment describes; `--tp N` alone makes this process rank 0 and starts ranks
1..N-1 as copies of its own command line, joined by the ring backend on loopback."""

from __future__ import annotations

import atexit
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Optional

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.platform import hard_exit, on_hard_exit
from pagedmlx.tp.channel import RankLostError
from pagedmlx.tp.launcher import launched_backend

logger = logging.getLogger("pagedmlx")

CONNECT_TIMEOUT = 120.0  # seconds for all ranks to start and connect

# ---- the group -----------------------------------------------------------------------------------

class LocalRanks:
    """Ranks 1..N-1 that this process started (`--tp N`): copies of its command line."""

    def __init__(self, n: int, argv: Optional[list[str]] = None):
        ports = _free_ports(n)
        fd, self.hostfile = tempfile.mkstemp(prefix="pagedmlx-tp-", suffix=".json")
        with os.fdopen(fd, "w") as f:
            json.dump([[f"127.0.0.1:{p}"] for p in ports], f)
        argv = [sys.executable, *(argv or getattr(sys, "orig_argv", [sys.executable, *sys.argv]))[1:]]
        self.procs = []
        for rank in range(1, n):
            env = dict(os.environ, MLX_RANK=str(rank), MLX_HOSTFILE=self.hostfile, PAGEDMLX_TP_PARENT=str(os.getpid()))
            self.procs.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
        os.environ.update(MLX_RANK="0", MLX_HOSTFILE=self.hostfile)
        atexit.register(self.stop)
        on_hard_exit(self.kill)
        self.starting = True  # until rank 0's engine exists, a rank's death ends everything from here
        threading.Thread(target=self._watch_startup, name="pagedmlx-tp-startup", daemon=True).start()

    def _watch_startup(self) -> None:
        """A rank that dies while the ranks load and check the model leaves rank 0 waiting in a
        collective that may never return: end rank 0 too, saying why."""
        while self.starting:
            dead = self.status()
            if dead:
                hard_exit(1, f"tensor parallel: {dead} while starting")
            time.sleep(0.2)

    def status(self, wait: float = 0.0) -> str:
        """Which ranks have exited, and how; waits up to `wait` s for one to (a rank's sockets
        close a moment before its exit status is ready)."""
        deadline = time.monotonic() + wait
        while not any(p.poll() is not None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.02)
        dead = [f"rank {i + 1} (pid {p.pid}) exited with {_exit_words(p.returncode)}"
                for i, p in enumerate(self.procs) if p.poll() is not None]
        return "; ".join(dead)

    def kill(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()

    def stop(self, grace: float = 3.0) -> None:
        """Wait for the ranks (they exit on the stop message or rank 0's end), then end the rest."""
        deadline = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        try:
            os.unlink(self.hostfile)
        except OSError:
            pass


def _exit_words(code: Optional[int]) -> str:
    if code is not None and code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _die_with_parent() -> None:
    """A rank started by --tp ends when rank 0 does, even when rank 0 was killed mid-step (Linux;
    elsewhere the collective that loses its peer ends it)."""
    parent = envs.PAGEDMLX_TP_PARENT
    if not parent:
        return
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != int(parent):  # rank 0 was gone before the line above took effect
        os._exit(1)


def _free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


_local_ranks: Optional[LocalRanks] = None


def local_ranks() -> Optional[LocalRanks]:
    """The ranks this process started with --tp N, if it did."""
    return _local_ranks


def join_group(tp: Optional[int] = None, connect_timeout: float = CONNECT_TIMEOUT,
               argv: Optional[list[str]] = None) -> Optional[mx.distributed.Group]:
    """The tensor-parallel group of this process, or None for a single process.

    Under a launcher, join the group its environment describes (tp, if given, must match its
    size). Otherwise tp > 1 starts ranks 1..tp-1 here (ring backend on loopback), each running
    `argv` (default: this process's own command line)."""
    global _local_ranks
    backend = launched_backend()
    if backend is None and (tp or 1) > 1:
        _local_ranks = LocalRanks(tp, argv)
        backend = "ring"
    if backend is None:
        return None
    _die_with_parent()
    group = _init(backend, connect_timeout)
    if tp is not None and group.size() != tp:
        raise RuntimeError(f"--tp {tp} asked for {tp} ranks, but the launcher started {group.size()}")
    return group if group.size() > 1 else None


def _init(backend: str, timeout: float) -> mx.distributed.Group:
    """mx.distributed.init, which waits for every rank to connect: give up after `timeout`, or as
    soon as a rank this process started has died."""
    box: dict[str, Any] = {}

    def init():
        try:
            box["group"] = mx.distributed.init(strict=True, backend=backend)
        except Exception as exc:  # noqa: BLE001
            box["error"] = exc

    t = threading.Thread(target=init, name="pagedmlx-tp-init", daemon=True)
    t.start()
    deadline = time.monotonic() + timeout
    while t.is_alive():
        t.join(0.1)
        dead = _local_ranks.status() if _local_ranks else ""
        if dead or time.monotonic() > deadline:
            raise RankLostError(f"tensor parallel: the ranks did not connect ({backend} backend) within "
                                f"{timeout:g} s" if not dead else f"tensor parallel: {dead} before connecting")
    if "error" in box:
        raise RuntimeError(f"tensor parallel: could not start the {backend} backend: {box['error']}")
    return box["group"]
