"""Recurrent-state layers in a token-major step: the state pool and the regrouped owner modules.

A step's T rows run as independent length-1 sequences everywhere but in a state layer, whose
recurrence runs along the sequence. There the module that owns the state (the plan's `owner`: a
Gated DeltaNet, a Mamba2 mixer, a short convolution) is class-swapped (its parameter tree unchanged)
to run its stock code per group of rows:
- the decode rows of all requests together, as one (nd, 1) batch, their states gathered by slot;
- each prefill segment alone, as (1, L), from its request's state (None at position 0, exactly as
  mlx-lm's generate_step starts a prompt); segments of one length that continue a state (steps that
  verify drafts, and their recomputation) together, as one (n, L) batch.
The outputs go back in row order and the new states to their slots (and to a checkpoint slot where
the step saves one).

The pool keeps each layer's arrays [num_slots, *shape] in one list only (as KVPool does for pages).
Where the runner's state kernels run (CUDA: KernelPlan.state), a kernel writes the new states in
place. Elsewhere MLX writes by scatter, which is in place only when nothing else references the
array, and a gather of this step's states still references it: so the writes wait, and land at the
start of the layer's next call, before its reads. The scheduler never lets one step read a slot
that another request of the step writes, so the two orders give the same states.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.cache import ArraysCache

from pagedmlx.config import EngineConfig
from pagedmlx.core.kv.spec import KVCacheGroupSpec, MambaSpec, cdiv
from pagedmlx.kernels import recurrent_state
from pagedmlx.runner.attention import as_dtype, zero_in_place
from pagedmlx.runner.attention_metadata import upload_indices
from pagedmlx.runner.plan import LayerPlan, StatePlan
from pagedmlx.core.sched.output import SchedulerOutput


def state_group(plan: list[LayerPlan], config: EngineConfig) -> Optional[KVCacheGroupSpec]:
    """The recurrent-state KV cache group: a slot per running request (max_num_seqs), with speculative
    decoding a spare for each request that may speculate at once (a verifying step's state, see
    MambaSpec), and the checkpoints (none without prefix caching); page_size_bytes: one slot of every
    state layer."""
    layers = tuple(i for i, p in enumerate(plan) if p.state is not None)
    if not layers:
        return None
    interval = cdiv(config.state_checkpoint_interval, config.block_size) * config.block_size
    interval = interval if config.enable_prefix_caching else 0
    checkpoints = 0 if not interval else (config.max_num_seqs if config.max_state_checkpoints is None
                                          else config.max_state_checkpoints)
    spec = config.speculative_config
    speculating = 0 if spec is None else min(config.max_num_seqs, spec.disable_by_batch_size)
    return KVCacheGroupSpec(MambaSpec(interval, checkpoints, int(spec is not None), speculating),
                            config.max_num_seqs + speculating + checkpoints, layers,
                            sum(plan[i].state.nbytes for i in layers))


def pages_budget(budget: Any, state: Optional[KVCacheGroupSpec], config: EngineConfig) -> int:
    """Bytes of the KV budget (runner/kv_budget.py's KVBudget) left for pages once the state slots are counted."""
    how, budget = budget.how, budget.nbytes
    if state is None:
        return budget
    state_bytes = state.num_blocks * state.page_size_bytes
    if state_bytes >= budget:
        spec = state.kv_cache_spec
        spare = f"{spec.max_speculating * spec.num_speculative_blocks} spare + " if spec.num_speculative_blocks else ""
        raise ValueError(
            f"{state.num_blocks} recurrent-state slots ({config.max_num_seqs} running + {spare}"
            f"{spec.max_checkpoints} checkpoints) of {state.page_size_bytes / 2**20:.1f} MiB take "
            f"{state_bytes / 1e9:.2f} GB, more than the KV budget of {budget / 1e9:.2f} GB ({how}): raise it "
            f"(kv_cache_memory_gb, gpu_memory_utilization), or lower max_num_seqs or max_state_checkpoints")
    return budget - state_bytes


class StatePool:
    """Every state layer's arrays by layer index, [num_slots, *shape] each (None: no state)."""

    def __init__(self, num_slots: int, layers: list[tuple[int, StatePlan]], num_layers: int, in_place: bool):
        """in_place: the runner's state kernels run (KernelPlan.state), and write_rows writes the states."""
        self.in_place = in_place
        self.arrays: list[Optional[list[mx.array]]] = [None] * num_layers
        self.pending: list[list[tuple[Any, list[mx.array]]]] = [[] for _ in range(num_layers)]
        for i, state in layers:
            self.arrays[i] = [mx.zeros((num_slots, *shape), dtype) for shape, dtype in state.arrays]
        mx.eval([a for arrays in self.arrays if arrays for a in arrays])

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.flat)

    @property
    def flat(self) -> list[mx.array]:
        return [a for arrays in self.arrays if arrays for a in arrays]

    def reset(self) -> None:
        """Every state zeroed, in the same lists (see ModelRunner.repair_pages)."""
        zero_in_place([arrays for arrays in self.arrays if arrays])
        self.pending = [[] for _ in self.pending]

    def read(self, layer: int, slots) -> list[mx.array]:
        """The states at `slots` (a (n,) array, or one slot as an int), after the writes still pending."""
        arrays = self.arrays[layer]
        for where, values in self.pending[layer]:
            for j, v in enumerate(values):
                arrays[j][where] = v
        self.pending[layer] = []
        return [a[slots:slots + 1] if isinstance(slots, int) else a[slots] for a in arrays]

    def write(self, layer: int, slots: mx.array, values: list[mx.array]) -> list[mx.array]:
        """Store states at `slots` ((n,) int32, uploaded with the step's metadata). Returns what the
        step's output must depend on."""
        arrays = self.arrays[layer]
        values = [as_dtype(v, a.dtype) for v, a in zip(values, arrays)]
        if not self.in_place:
            self.pending[layer].append((slots, values))
            return values
        return [recurrent_state.write_rows(v, slots, a) for v, a in zip(values, arrays)]


@dataclass
class StateSegment:
    """One prefill chunk: its rows, and the slots its state is read from (-1: none), written to and
    saved to (-1: no checkpoint) after its first save_len rows."""

    row_start: int
    num_rows: int
    read: int
    write: int
    save: int
    save_len: int
    write_slots: Optional[mx.array] = None  # (1,) `write` and `save` on the device, for StatePool.write
    save_slots: Optional[mx.array] = None


@dataclass
class StateBatch:
    """Chunks of one length L > 1 of n requests that continue a state and save no checkpoint inside
    (steps that verify drafts, and their recomputation after a rejection): one (n, L) call."""

    size: int  # n
    num_rows: int  # L
    rows: Optional[mx.array] = None  # (n * L,) their rows, request by request
    read: Optional[mx.array] = None  # (n,)
    write: Optional[mx.array] = None  # (n,)
    save_rows: Optional[mx.array] = None  # requests (in the batch of n) that also save a checkpoint at the end
    save_slots: Optional[mx.array] = None


@dataclass
class StateMetadata:
    """A step's grouping of rows for the state layers, built once on the host and shared by them."""

    num_decodes: int  # rows of requests that continue a state by one token: one (nd, 1) batch
    decode_rows: Optional[mx.array] = None  # (nd,) where those rows are, if not rows [0, nd)
    decode_read: Optional[mx.array] = None  # (nd,)
    decode_write: Optional[mx.array] = None  # (nd,)
    save_rows: Optional[mx.array] = None  # decode rows (in the batch of nd) that also save a checkpoint
    save_slots: Optional[mx.array] = None
    segments: list[StateSegment] = field(default_factory=list)
    batches: list[StateBatch] = field(default_factory=list)
    order: Optional[mx.array] = None  # (T,) each row's place among the outputs [decodes..., batches..., segments...]

    @classmethod
    def build(cls, so: SchedulerOutput) -> "StateMetadata":
        qsl, slots, nd = so.query_start_loc, so.state_slots, so.num_decodes
        continues = slots[:nd, 0] >= 0  # a 1-token chunk at position 0 (a 1-token prompt) is a segment
        decode = np.flatnonzero(continues)  # decode requests' rows are their indices
        rest = np.concatenate([np.flatnonzero(~continues), np.arange(nd, so.num_reqs)])
        segments = [StateSegment(int(qsl[i]), int(qsl[i + 1] - qsl[i]), *slots[i].tolist()) for i in rest]
        batched, segments = _batch_segments(segments)
        batch_rows = [np.concatenate([np.arange(s.row_start, s.row_start + s.num_rows) for s in b]) for b in batched]
        rows = np.concatenate([decode, *batch_rows,
                               *(np.arange(s.row_start, s.row_start + s.num_rows) for s in segments)])
        host = {}
        if len(decode):
            host.update(decode_read=slots[decode, 0], decode_write=slots[decode, 1])
            saving = np.flatnonzero(slots[decode, 2] >= 0)
            if len(saving):
                host.update(save_rows=saving, save_slots=slots[decode[saving], 2])
            if decode[-1] != len(decode) - 1:
                host["decode_rows"] = decode
        if (rows != np.arange(len(rows))).any():
            host["order"] = np.argsort(rows)
        for i, (group, group_rows) in enumerate(zip(batched, batch_rows)):
            host.update({f"batch{i}.rows": group_rows, f"batch{i}.read": np.array([s.read for s in group]),
                         f"batch{i}.write": np.array([s.write for s in group])})
            saving = [j for j, s in enumerate(group) if s.save >= 0]
            if saving:
                host.update({f"batch{i}.save_rows": np.array(saving),
                             f"batch{i}.save_slots": np.array([group[j].save for j in saving])})
        for i, seg in enumerate(segments):  # uploaded with the rest: an array made per write is an upload each
            host[f"write{i}"] = np.array([seg.write])
            if seg.save >= 0:
                host[f"save{i}"] = np.array([seg.save])
        batches = [StateBatch(len(group), group[0].num_rows) for group in batched]
        md = cls(len(decode), segments=segments, batches=batches)
        dev = upload_indices(host)  # every request is a decode, in a batch or a segment: never empty
        for i, seg in enumerate(segments):
            seg.write_slots, seg.save_slots = dev.pop(f"write{i}"), dev.pop(f"save{i}", None)
        for i, batch in enumerate(batches):
            for name in ("rows", "read", "write", "save_rows", "save_slots"):
                setattr(batch, name, dev.pop(f"batch{i}.{name}", None))
        for name, value in dev.items():
            setattr(md, name, value)
        return md


def _batch_segments(segments: list[StateSegment]) -> tuple[list[list[StateSegment]], list[StateSegment]]:
    """(groups of two or more chunks of one length that can run as one batch, the other segments):
    chunks that continue a state (not from position 0) and save no checkpoint before their end."""
    by_len: dict[int, list[StateSegment]] = {}
    for seg in segments:
        if seg.read >= 0 and (seg.save < 0 or seg.save_len == seg.num_rows):
            by_len.setdefault(seg.num_rows, []).append(seg)
    groups = [group for group in by_len.values() if len(group) > 1]
    grouped = {id(seg) for group in groups for seg in group}
    return groups, [seg for seg in segments if id(seg) not in grouped]


class StateLayerCache:
    """Stands in for mlx-lm's ArraysCache in one state layer for one step; only the regrouped owner
    module looks inside (the model itself may ask it for a mask: None)."""

    lengths = None
    left_padding = None

    def __init__(self, layer: int, num_arrays: int, pool: StatePool, md: StateMetadata):
        self.layer, self.num_arrays, self.pool, self.md = layer, num_arrays, pool, md

    def make_mask(self, *args, **kwargs) -> None:
        return None

    def regroup(self, call: Callable, x: mx.array, rebuild: Callable) -> mx.array:
        """x (T, 1, D) -> (T, 1, D'): call(*rebuild(rows, cache)) for each group of rows."""
        with recurrent_state.active(self.pool.in_place):
            return self._regroup(call, x, rebuild)

    def _regroup(self, call: Callable, x: mx.array, rebuild: Callable) -> mx.array:
        md, outs, deps = self.md, [], []
        if md.num_decodes:
            rows = (x if md.num_decodes == x.shape[0] else x[:md.num_decodes]) if md.decode_rows is None \
                else x[md.decode_rows]
            out, states = self._call(call, rebuild, rows, self.pool.read(self.layer, md.decode_read))
            deps += self.pool.write(self.layer, md.decode_write, states)
            if md.save_rows is not None:
                deps += self.pool.write(self.layer, md.save_slots, [s[md.save_rows] for s in states])
            outs.append(out)
        for b in md.batches:
            rows = x[b.rows].reshape(b.size, b.num_rows, -1)
            out, states = self._call(call, rebuild, rows, self.pool.read(self.layer, b.read))
            deps += self.pool.write(self.layer, b.write, states)
            if b.save_rows is not None:
                deps += self.pool.write(self.layer, b.save_slots, [s[b.save_rows] for s in states])
            outs.append(out.reshape(b.size * b.num_rows, 1, -1))
        for seg in md.segments:
            rows = x[seg.row_start:seg.row_start + seg.num_rows].reshape(1, seg.num_rows, -1)
            states = self.pool.read(self.layer, seg.read) if seg.read >= 0 else [None] * self.num_arrays
            parts = []
            if seg.save >= 0 and seg.save_len < seg.num_rows:  # a checkpoint inside the chunk: split the call there
                out, states = self._call(call, rebuild, rows[:, :seg.save_len], states)
                deps += self.pool.write(self.layer, seg.save_slots, states)
                parts.append(out)
                rows = rows[:, seg.save_len:]
            out, states = self._call(call, rebuild, rows, states)
            parts.append(out)
            deps += self.pool.write(self.layer, seg.write_slots, states)
            if seg.save >= 0 and seg.save_len == seg.num_rows:
                deps += self.pool.write(self.layer, seg.save_slots, states)
            out = parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=1)
            outs.append(out.reshape(seg.num_rows, 1, -1))
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=0)
        if md.order is not None:
            out = out[md.order]
        return mx.depends(out, deps)  # the writes are part of the step however the output is used

    def _call(self, call: Callable, rebuild: Callable, rows: mx.array, states: list) -> tuple[mx.array, list[mx.array]]:
        cache = ArraysCache(self.num_arrays)
        cache.cache = list(states)
        out = call(*rebuild(rows, cache))
        if any(s is None or s.shape[0] != rows.shape[0] for s in cache.cache):
            raise RuntimeError(f"state layer {self.layer}: the module left its state unwritten or of another "
                               "batch size")
        return out, cache.cache


def _find_cache(args: tuple, kwargs: dict) -> Optional[StateLayerCache]:
    return next((a for a in (*args, *kwargs.values()) if isinstance(a, StateLayerCache)), None)


def _rebuilder(args: tuple, kwargs: dict) -> tuple[mx.array, Callable]:
    """The call's input rows x (the first argument, or the keyword argument that is a 3-D array,
    e.g. Falcon-H1's input_states) and a function that makes the call's arguments for other rows
    and another cache."""
    key = None if args else next(k for k, v in kwargs.items() if isinstance(v, mx.array) and v.ndim == 3)
    x = args[0] if key is None else kwargs[key]

    def rebuild(rows: mx.array, cache: ArraysCache) -> tuple[tuple, dict]:
        a = tuple(cache if isinstance(v, StateLayerCache) else v for v in args)
        kw = {k: cache if isinstance(v, StateLayerCache) else v for k, v in kwargs.items()}
        if key is None:
            return (rows, *a[1:]), kw
        return a, {**kw, key: rows}

    return x, rebuild


class Regrouped:
    """Mixed into a state owner's class: in a paged step the module runs per group of rows (see the
    module docstring); with any other cache (mlx-lm's own, in the same process) it runs as written."""

    def __call__(self, *args, **kwargs):
        cache = _find_cache(args, kwargs)
        if cache is None:
            return super().__call__(*args, **kwargs)
        x, rebuild = _rebuilder(args, kwargs)
        inner = super().__call__
        return cache.regroup(lambda a, kw: inner(*a, **kw), x, rebuild)


def module_at(model: nn.Module, path: str) -> nn.Module:
    obj = model
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


def install_regrouping(model: nn.Module, plan: list[LayerPlan]) -> None:
    """Class-swap every state owner to its Regrouped subclass (idempotent)."""
    for layer in plan:
        if layer.state is not None:
            owner = module_at(model, layer.state.owner)
            if not isinstance(owner, Regrouped):
                owner.__class__ = _regrouped_class(type(owner))


_CLASSES: dict[type, type] = {}


def _regrouped_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Regrouped{cls.__name__}", (Regrouped, cls), {"__module__": cls.__module__})
    return _CLASSES[cls]
