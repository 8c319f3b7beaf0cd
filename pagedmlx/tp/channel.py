"""The control channel of a tensor-parallel group: rank 0 sends each step's batch (the
SchedulerOutput's integer arrays) to the other ranks over TCP, and each rank acknowledges the step
once its forward pass has finished. The model's own collectives (mx.distributed, inside the
sharded layers) carry the activations.

Why not mx.distributed for the batch too: a rank waiting in an MLX ring collective busy-polls
(measured here: 2.5 CPU-seconds per 5 s of waiting), so an idle server's other ranks would each
burn a core; a blocking socket costs nothing while idle, and a peer that dies closes it, which
both sides see at once. The channel's address and a random token go out through one all_sum
at startup, so only members of the MLX group can join it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import json
import secrets
import select
import socket
import struct
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from pagedmlx import envs
from pagedmlx.core.sched.output import SchedulerOutput

STEP, STOP = 1, 2
_MAGIC = 0x70616765  # "page"


class RankLostError(RuntimeError):
    """A rank died, hung or fell out of step: the tensor-parallel group cannot go on."""


# ---- the step's batch as integers ------------------------------------------------------------------

def _field_layout() -> list[tuple[str, str]]:
    """(name, kind) for every SchedulerOutput field, from its annotation, so that a field added
    later travels without changes here (or fails loudly at import if its type is new)."""
    kinds = {"np.ndarray": "array", "int": "scalar", "list[int]": "ints", "list[str]": "names",
             "set[str]": "nameset"}
    layout = []
    for f in dataclasses.fields(SchedulerOutput):
        if f.name in ("device_drafts", "mm_features"):  # rank 0's device array: TPDriver.forward inlines the drafts
            continue  # first; images are not served with tensor parallelism (multimodal/engine.py refuses them)
        t = str(f.type).replace(" ", "")
        if t not in kinds:
            raise TypeError(f"tensor parallelism cannot send SchedulerOutput.{f.name} of type {t}")
        layout.append((f.name, kinds[t]))
    return layout


_LAYOUT = _field_layout()
_SLOTS = {"array": 4, "scalar": 1, "ints": 1, "names": 1, "nameset": 1}  # header ints per field
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
            if a.dtype.kind not in "iu" or a.ndim > 3:
                raise TypeError(f"SchedulerOutput.{name}: only integer arrays of rank <= 3 travel")
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


# ---- the sockets ---------------------------------------------------------------------------------

def rank0_host() -> str:
    """Rank 0's address as the launcher gave it (ring hostfile, JACCL coordinator, NCCL host);
    else this machine's name's address (rank 0 only reads it)."""
    candidates = []
    path = envs.MLX_HOSTFILE
    if path:
        try:
            with open(path) as f:
                candidates.append(json.load(f)[0][0].rsplit(":", 1)[0])
        except (OSError, ValueError, IndexError, KeyError, TypeError):
            pass
    coordinator = envs.MLX_JACCL_COORDINATOR
    if coordinator:
        candidates.append(coordinator.rsplit(":", 1)[0])
    candidates.append((envs.NCCL_HOST_IP or ""))
    for c in candidates:
        try:
            return str(ipaddress.IPv4Address(c))
        except ValueError:
            continue
    try:
        return socket.gethostbyname(socket.gethostname())
    except OSError:
        return "127.0.0.1"


def _broadcast_ints(values: list[int], n: int, group: mx.distributed.Group) -> list[int]:
    """Rank 0's n int32 values to every rank (one all_sum; the others add zeros)."""
    x = np.zeros(n, np.int32)
    if group.rank() == 0:
        x[:] = values
    return np.array(mx.distributed.all_sum(mx.array(x), group=group, stream=mx.cpu)).tolist()


def _keepalive(sock: socket.socket) -> None:
    """Notice a peer whose machine vanished (no FIN) within about half a minute."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for opt, value in (("TCP_KEEPIDLE", 10), ("TCP_KEEPALIVE", 10), ("TCP_KEEPINTVL", 5), ("TCP_KEEPCNT", 3)):
        if hasattr(socket, opt):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise ConnectionError("connection closed")
        buf += chunk
    return bytes(buf)


class ControlServer:
    """Rank 0's end: one connection per other rank."""

    def __init__(self, group: mx.distributed.Group, connect_timeout: float = 60.0,
                 dead_ranks: Optional[Callable[[], str]] = None):
        """dead_ranks(): words on ranks known to have died (local ranks), to stop waiting early."""
        self.group = group
        host = rank0_host()
        listener = socket.create_server((host, 0))
        token = secrets.token_bytes(16)
        ip = list(ipaddress.IPv4Address(host).packed)
        _broadcast_ints([_MAGIC, listener.getsockname()[1], *ip, *struct.unpack("4i", token)], 10, group)
        self.conns: dict[int, socket.socket] = {}
        deadline = time.monotonic() + connect_timeout
        try:
            while len(self.conns) < group.size() - 1:
                listener.settimeout(min(0.5, max(0.01, deadline - time.monotonic())))
                try:
                    conn, _ = listener.accept()
                except socket.timeout:
                    dead = dead_ranks() if dead_ranks else ""
                    if dead or time.monotonic() > deadline:
                        missing = sorted(set(range(1, group.size())) - set(self.conns))
                        raise RankLostError(f"ranks {missing} did not join the control channel"
                                            + (f": {dead}" if dead else f" within {connect_timeout:g} s")) from None
                    continue
                conn.settimeout(5.0)
                try:
                    hello = _recv_exact(conn, 20)
                except (OSError, ConnectionError):
                    conn.close()
                    continue
                rank = struct.unpack("i", hello[16:])[0]
                if not secrets.compare_digest(hello[:16], token) or not 0 < rank < group.size() or rank in self.conns:
                    conn.close()  # not one of ours
                    continue
                conn.settimeout(None)
                _keepalive(conn)
                self.conns[rank] = conn
        finally:
            listener.close()

    def send(self, kind: int, seq: int, so: Optional[SchedulerOutput] = None) -> None:
        header, payload = pack(kind, seq, so)
        data = header.tobytes() + payload.tobytes()
        for rank, conn in self.conns.items():
            try:
                conn.sendall(data)
            except OSError as exc:
                raise RankLostError(f"rank {rank} is gone (sending step {seq}: {exc})") from exc

    def wait_acks(self, seq: int) -> None:
        """Every rank has finished step `seq` (or raise, naming the rank that has not)."""
        for rank, conn in self.conns.items():
            try:
                got = struct.unpack("ii", _recv_exact(conn, 8))
            except (OSError, ConnectionError) as exc:
                raise RankLostError(f"rank {rank} is gone (waiting for step {seq}: {exc})") from exc
            if got != (seq, 0):
                raise RankLostError(f"rank {rank} failed step {seq}" if got[0] == seq else
                                    f"rank {rank} answered step {got[0]} to step {seq}: out of step")

    def closed_ranks(self) -> list[int]:
        """Ranks whose connection has closed (checked without blocking or taking data)."""
        socks = list(self.conns.values())
        readable, _, broken = select.select(socks, [], socks, 0)
        gone = []
        for rank, conn in self.conns.items():
            if conn in broken:
                gone.append(rank)
            elif conn in readable:
                try:
                    if conn.recv(1, socket.MSG_PEEK) == b"":
                        gone.append(rank)
                except OSError:
                    gone.append(rank)
        return gone

    def close(self) -> None:
        for conn in self.conns.values():
            conn.close()


class ControlClient:
    """A worker rank's end."""

    def __init__(self, group: mx.distributed.Group, connect_timeout: float = 60.0):
        values = _broadcast_ints([], 10, group)
        if values[0] != _MAGIC:
            raise RankLostError("rank 0 did not open the control channel")
        port, host = values[1], str(ipaddress.IPv4Address(bytes(values[2:6])))
        token = struct.pack("4i", *values[6:10])
        deadline = time.monotonic() + connect_timeout
        while True:
            try:
                self.sock = socket.create_connection((host, port), timeout=5.0)
                break
            except OSError as exc:
                if time.monotonic() > deadline:
                    raise RankLostError(f"could not reach rank 0 at {host}:{port}: {exc}") from exc
                time.sleep(0.05)
        self.sock.settimeout(None)
        _keepalive(self.sock)
        self.sock.sendall(token + struct.pack("i", group.rank()))

    def recv(self) -> tuple[int, int, Optional[SchedulerOutput]]:
        """(kind, seq, batch): blocks, costing nothing, until rank 0 sends; ConnectionError when
        rank 0 is gone."""
        header = np.frombuffer(_recv_exact(self.sock, HEADER_LEN * 4), np.int32)
        if header[0] != _MAGIC:
            raise RankLostError(f"garbled message from rank 0 (magic {header[0]:#x})")
        payload = np.frombuffer(_recv_exact(self.sock, int(header[3]) * 4), np.int32) if header[3] else \
            np.zeros(0, np.int32)
        kind, seq = int(header[1]), int(header[2])
        return kind, seq, unpack(header, payload) if kind == STEP else None

    def ack(self, seq: int, ok: bool = True) -> None:
        self.sock.sendall(struct.pack("ii", seq, 0 if ok else 1))

    def close(self) -> None:
        self.sock.close()
