"""Expert routing made the same on both sides of the load-time check (selfcheck.py).

Every mlx-lm MoE block picks its experts with mx.argpartition over router values. Random routers are full of near
ties (bf16 router probabilities over hundreds of experts tie exactly), and the paged forward's products run other
kernels than mlx-lm's (another row count, another reduction order), so a last-bit difference may pick the other
expert of a tie: that token's output then moves by a whole expert's contribution, and every later layer follows.
Both choices are right; comparing logits across them is not.

So the check records the experts the paged forward picks, and the router values it picked them by, and has mlx-lm's
reference pick the same ones. Both sides then compute one function, and any difference left is a fault or rounding:
the check compares the logits and the router values themselves (a router that computes wrong values on pages is
refused whatever it picks), each within the dtype's tolerance or, past it, within what mlx-lm's own values move
with rounding (selfcheck.py measures that with a second reference pass, `follow(..., noise=True)`). A choice is as
good as the reference's own where the reference's values of the two experts are no further apart than both sides'
values may each stray. In bf16 over many layers that can be more than a fixed near-tie bound: on the CPU, a
quantized product that rounds otherwise for one row than for several moves a 16-layer, 256-expert model's router
values by 2e-1 of their scale (tests/runner/test_moe_check.py emulates such a backend).

mx.argpartition is swapped for the check's duration only, and acts only in the thread and the `with` blocks that
ask for it; everywhere else it is MLX's own."""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass, field
from typing import Iterator, Optional

import mlx.core as mx
import numpy as np

RowKey = tuple[str, int]  # (request, position)


@dataclass
class _Call:
    """One argpartition call of a paged forward: its rows' tokens, and the partition it returned."""

    rows: list[RowKey]
    kth: int
    axis: int
    out: mx.array
    values: mx.array
    host: Optional[np.ndarray] = None
    host_values: Optional[np.ndarray] = None

    def partition(self) -> np.ndarray:
        """(tokens, rows per token, n): the partition with its axis last."""
        if self.host is None:
            moved = np.moveaxis(np.array(self.out), self.axis, -1)
            self.host = moved.reshape(len(self.rows), -1, moved.shape[-1])
        return self.host

    def router_values(self) -> np.ndarray:
        """(tokens, rows per token, n): the values it partitioned, in float32, their axis last."""
        if self.host_values is None:
            self.host_values = _rows_last(self.values, self.axis, len(self.rows))
        return self.host_values


def _rows_last(a: mx.array, axis: int, tokens: int) -> np.ndarray:
    moved = np.moveaxis(np.array(a.astype(mx.float32)), axis, -1)
    return moved.reshape(tokens, -1, moved.shape[-1])


@dataclass
class Divergence:
    """The reference row furthest from something (its forced choice from its own router values, its router values
    from the paged ones or from its own under other rounding), and how far."""

    ratio: float = 0.0  # how far, relative to the row's largest |router value|
    where: Optional[RowKey] = None
    call: int = -1


@dataclass
class RoutingMatch:
    """Records the paged forward's argpartitions (`record`) and replays them into mlx-lm's (`follow`).
    `forced` counts reference rows that took another choice than their own; `worst` is the furthest of them.
    `drift` is the reference row whose router values are furthest from the paged ones (the same experts taken
    before, so the same function: a router that computes wrong values on pages shows here, whatever it picks);
    `noise` the furthest of a second reference pass (`follow(rows, noise=True)`, e.g. with other rounding) from the
    first one's router values: how far this model's router values move with rounding alone."""

    calls: list[_Call] = field(default_factory=list)
    index: dict[tuple[str, int, int], tuple[int, int]] = field(default_factory=dict)  # (req, pos, nth) -> call, row
    forced: int = 0
    worst: Divergence = field(default_factory=Divergence)
    drift: Divergence = field(default_factory=Divergence)
    noise: Divergence = field(default_factory=Divergence)
    reference: dict[tuple[str, int, int], np.ndarray] = field(default_factory=dict)  # (req, pos, nth) -> values
    _mode: Optional[str] = None
    _rows: list[RowKey] = field(default_factory=list)
    _nth: int = 0

    @contextlib.contextmanager
    def record(self, rows: list[RowKey]) -> Iterator[None]:
        """A paged forward whose input rows are `rows`: its routing decisions are kept."""
        with self._scope("record", rows):
            yield

    @contextlib.contextmanager
    def follow(self, rows: list[RowKey], noise: bool = False) -> Iterator[None]:
        """A reference forward whose input rows are `rows` (in order): each routing decision is the recorded
        paged one for the same token and call where there is one of the same shape, else its own. Its router
        values are measured against the paged ones (`drift`), or with `noise` against the first reference's."""
        with self._scope("noise" if noise else "follow", rows):
            yield

    def reset(self) -> None:
        """The measures zeroed (for the next prompt); the recorded routing kept."""
        self.forced, self.worst, self.drift, self.noise = 0, Divergence(), Divergence(), Divergence()

    @contextlib.contextmanager
    def _scope(self, mode: str, rows: list[RowKey]) -> Iterator[None]:
        self._mode, self._rows, self._nth = mode, rows, 0
        try:
            yield
        finally:
            self._mode = None

    def argpartition(self, original, a: mx.array, kth: int, axis: Optional[int] = -1, **kwargs) -> mx.array:
        """mx.argpartition in the active scope (see record and follow); MLX's own elsewhere."""
        out = original(a, kth, axis=axis, **kwargs)
        if self._mode is None or axis is None or not self._rows:
            return out
        nth, self._nth = self._nth, self._nth + 1
        axis = axis % a.ndim
        if a.size % (len(self._rows) * a.shape[axis]):
            return out
        if self._mode == "record":
            for row, (rid, pos) in enumerate(self._rows):
                self.index[(rid, pos, nth)] = (len(self.calls), row)
            self.calls.append(_Call(list(self._rows), kth, axis, out, a))
            return out
        return self._follow(a, kth, axis, nth, out)

    def _follow(self, a: mx.array, kth: int, axis: int, nth: int, own: mx.array) -> mx.array:
        spots = [self.index.get((rid, pos, nth)) for rid, pos in self._rows]
        if any(s is None for s in spots):
            return own
        values = _rows_last(a, axis, len(self._rows))
        taken, paged = [], []
        for c, r in spots:
            call = self.calls[c]
            if call.kth != kth or call.partition().shape[1:] != values.shape[1:]:
                return own
            taken.append(call.partition()[r])
            paged.append(call.router_values()[r])
        forced = np.stack(taken)
        keys = [(rid, pos, nth) for rid, pos in self._rows]
        if self._mode == "noise":
            if all(k in self.reference for k in keys):
                self.noise = self._furthest(values, np.stack([self.reference[k] for k in keys]), nth, self.noise)
        else:
            self.reference.update(zip(keys, values))
            self.drift = self._furthest(values, np.stack(paged), nth, self.drift)
            mine = np.moveaxis(np.array(own), axis, -1).reshape(forced.shape)
            self._judge(values, forced, mine, kth % values.shape[-1], nth)
        shape = (*a.shape[:axis], *a.shape[axis + 1:], a.shape[axis])
        return mx.array(np.moveaxis(forced.reshape(shape), -1, axis)).astype(own.dtype)

    def _furthest(self, values: np.ndarray, other: np.ndarray, nth: int, worst: Divergence) -> Divergence:
        """`worst`, or the row of `values` further from `other` than it: max |difference| over the row's scale."""
        ratio = np.abs(values - other).max(-1) / np.maximum(np.abs(values).max(-1), 1e-30)
        t, r = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        if ratio[t, r] > worst.ratio or not np.isfinite(ratio[t, r]):
            return Divergence(float(ratio[t, r]), self._rows[t], nth)
        return worst

    def _judge(self, values: np.ndarray, forced: np.ndarray, mine: np.ndarray, kth: int, nth: int) -> None:
        """Counts the rows whose forced partition is not their own, and keeps the one furthest from a valid
        partition of its own values: the largest value it puts before position kth (kth+1) over the smallest it
        puts from there on. Zero or less: valid (an exact tie included)."""
        def split(p: np.ndarray) -> np.ndarray:
            head = np.sort(p[..., :kth], axis=-1)
            return np.concatenate([head, p[..., kth:kth + 1]], axis=-1)

        self.forced += int((split(forced) != split(mine)).any(-1).sum())
        v = np.take_along_axis(values, forced.astype(np.int64), axis=-1)
        gaps = [v[..., :cut].max(-1) - v[..., cut:].min(-1) for cut in (kth, kth + 1) if 0 < cut < v.shape[-1]]
        if not gaps:
            return
        ratio = np.maximum.reduce(gaps) / np.maximum(np.abs(values).max(-1), 1e-30)
        t, r = np.unravel_index(int(np.argmax(ratio)), ratio.shape)
        if ratio[t, r] > self.worst.ratio or not np.isfinite(ratio[t, r]):
            self.worst = Divergence(float(ratio[t, r]), self._rows[t], nth)


_active = threading.local()  # this thread's RoutingMatch, if any
_lock = threading.Lock()
_swap = {"original": mx.argpartition, "users": 0}  # MLX's own argpartition, and how many threads use the swap


def _argpartition(a: mx.array, kth: int, axis: Optional[int] = -1, **kwargs) -> mx.array:
    original = _swap["original"]
    match = getattr(_active, "match", None)
    return original(a, kth, axis=axis, **kwargs) if match is None else match.argpartition(original, a, kth, axis,
                                                                                           **kwargs)


@contextlib.contextmanager
def routing_match() -> Iterator[RoutingMatch]:
    """A RoutingMatch for this thread, with mx.argpartition routed through it while inside; MLX's own restored
    once no thread uses one."""
    match, before = RoutingMatch(), getattr(_active, "match", None)
    with _lock:
        if not _swap["users"]:
            _swap["original"], mx.argpartition = mx.argpartition, _argpartition
        _swap["users"] += 1
    _active.match = match
    try:
        yield match
    finally:
        _active.match = before
        with _lock:
            _swap["users"] -= 1
            if not _swap["users"]:
                mx.argpartition = _swap["original"]
