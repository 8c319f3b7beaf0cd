"""The layer plan: what each layer of a stock mlx-lm model keeps, derived at load from the model's own
caches (`make_prompt_cache`) and one probe forward pass.

- full attention (KVCache): pages for every token;
- a sliding window of W tokens (RotatingKVCache(W), keep 0): pages for the last W tokens;
- shared KV (Gemma 3n / Gemma 4 "E" models): a layer that attends over another layer's keys and
  values; it owns no pages. Gemma 4 hands such a layer its source's (keys, values) and no cache, so
  the runner gives it an alias cache; the probe finds its source by identity (the keys it is handed
  are the very arrays its source's cache returned). Gemma 3n hands it the source's cache itself.
- recurrent state (ArraysCache: Gated DeltaNet, Mamba2, short convolutions): one state per request,
  read and written by one module (its owner), which the probe finds by the frame that indexes the
  cache; the runner calls that module per group of rows (runner/state.py).
- a CacheList of one state and one attention cache (Falcon-H1): both, in one layer.
Attention sinks (gpt-oss) need nothing here: they reach the attention call as an argument.

Everything else is refused with an error naming the layer and the reason, never served approximately:
chunked attention (llama4), other cache lists, a window the cache does not keep (a window asked for
only through the attention mask, which the paged step cannot see), a state whose owner also attends.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from mlx_lm.models.cache import ArraysCache


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class StatePlan:
    """A layer's recurrent state: the module that owns it and each array's shape (without the batch
    axis) and dtype, as the model writes them."""

    owner: str  # path of the module in model.named_modules()
    arrays: tuple[tuple[tuple[int, ...], mx.Dtype], ...]

    @property
    def nbytes(self) -> int:
        """Bytes of one request's state in this layer."""
        total = 0
        for shape, dtype in self.arrays:
            n = dtype.size
            for d in shape:
                n *= d
            total += n
        return total


@dataclass(frozen=True)
class LayerPlan:
    kind: str  # "full", "sliding", "shared" or "state"
    window: Optional[int] = None  # sliding: W (a query at p attends keys in (p - W, p])
    source: Optional[int] = None  # shared: the layer whose pages it reads
    spec: Optional[tuple[int, int, int, mx.Dtype]] = None  # owners: (n_kv_heads, k_dim, v_dim, dtype)
    n_heads: Optional[int] = None  # query heads
    sinks: bool = False  # learned attention sinks
    state: Optional[StatePlan] = None  # "state" layers, and the state part of a CacheList layer
    cache_list: tuple[str, ...] = ()  # a CacheList layer: its parts in order ("state", "attention")

    @property
    def has_pages(self) -> bool:
        return self.kind in ("full", "sliding")


def model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None) or type(model).__module__


_REFUSED = {
    "ChunkedKVCache": "chunked local attention (llama4), whose model code needs integer offsets",
    "CacheList": "several caches in one layer (other than one state and one attention cache)",
    "QuantizedKVCache": "a quantized KV cache",
}
_STATE_CACHES = ("ArraysCache", "MambaCache")


def _refuse(model: nn.Module, i: int, what: str) -> UnsupportedModelError:
    return UnsupportedModelError(f"model type {model_type(model)!r}: layer {i} {what}")


def _cache_kind(model: nn.Module, i: int, cache) -> tuple[str, Optional[int]]:
    """("full", None), ("sliding", W) or ("state", number of arrays)."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if type(cache) is KVCache:
        return "full", None
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise _refuse(model, i, f"keeps its first {cache.keep} tokens forever (RotatingKVCache keep={cache.keep}, "
                                    f"StreamingLLM-style sinks), which pagedmlx does not page")
        return "sliding", cache.max_size
    name = type(cache).__name__
    if name in _STATE_CACHES:
        return "state", len(cache.cache)
    raise UnsupportedModelError(
        f"model type {model_type(model)!r} is not supported yet: layer {i} needs "
        f"{_REFUSED.get(name, name)} ({name}), which pagedmlx does not keep in pages")


def _layer_parts(model: nn.Module, i: int, cache) -> list[tuple[str, Optional[int]]]:
    """A layer's cache kinds: one, or a CacheList's parts (one state and one attention cache)."""
    if type(cache).__name__ != "CacheList":
        return [_cache_kind(model, i, cache)]
    parts = [_cache_kind(model, i, c) for c in cache.caches]
    if sorted(k == "state" for k, _ in parts) != [False, True]:
        raise UnsupportedModelError(f"model type {model_type(model)!r} is not supported yet: layer {i} needs "
                                    f"{_REFUSED['CacheList']} ({', '.join(type(c).__name__ for c in cache.caches)})")
    return parts


def _caller(modules: dict[int, str]) -> Optional[str]:
    """The path of the innermost model module on the stack (the `self` of a calling frame)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = modules.get(id(frame.f_locals.get("self")))
        if name is not None:
            return name
        frame = frame.f_back
    return None


class _Probe:
    """A cache for one probe pass: records K/V shapes, the window a mask asks for, the module that
    writes through it and the identity of the K/V it is handed and returns; attends over the new
    tokens only."""

    def __init__(self, returned: dict[int, "_Probe"], modules: dict[int, str]):
        self.offset = 0
        self.spec = None
        self.received: Optional[int] = None
        self.asked_window: Optional[int] = None
        self.caller: Optional[str] = None
        self.kv: tuple = (None, None)
        self.n_heads: Optional[int] = None
        self.sinks = False
        self._returned = returned  # id(keys returned) -> the probe that returned them
        self._modules = modules

    def make_mask(self, *args, window_size: Optional[int] = None, **kwargs) -> None:
        self.asked_window = window_size or self.asked_window
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.caller = _caller(self._modules)
        self.received = id(keys)
        self.spec = (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        self._returned.setdefault(id(keys), self)
        self.kv = (keys, values)  # also keeps the arrays alive, so that no other array reuses their id
        return keys, values

    def record_queries(self, queries: mx.array, sinks: Optional[mx.array]) -> None:  # from the SDPA dispatcher
        self.n_heads, self.sinks = queries.shape[1], sinks is not None

    def keys_and_values(self) -> tuple[mx.array, mx.array]:  # gemma3n's shared layers read their source so
        return self.kv


class _StateProbe(ArraysCache):
    """mlx-lm's own ArraysCache, recording which modules index it."""

    def __init__(self, size: int, modules: dict[int, str]):
        super().__init__(size)
        self.owners: set[Optional[str]] = set()
        self._modules = modules

    def __getitem__(self, idx):
        self.owners.add(_caller(self._modules))
        return super().__getitem__(idx)

    def __setitem__(self, idx, value):
        self.owners.add(_caller(self._modules))
        super().__setitem__(idx, value)

    def arrays(self) -> list[Optional[tuple[tuple[int, ...], mx.Dtype]]]:
        return [None if a is None else (tuple(a.shape), a.dtype) for a in self.cache]


def plan_layers(model: nn.Module) -> tuple[list[LayerPlan], int]:
    """(the plan of every layer the runner passes a cache to, the model's vocabulary size)."""
    from mlx_lm.models.cache import CacheList, make_prompt_cache

    layer_parts = [_layer_parts(model, i, c) for i, c in enumerate(make_prompt_cache(model))]
    num_layers = len(getattr(model, "layers", None) or layer_parts)
    modules = {id(m): name for name, m in model.named_modules()}
    returned: dict[int, _Probe] = {}
    states = [next((_StateProbe(n, modules) for k, n in parts if k == "state"), None) for parts in layer_parts]

    def probe_caches(attn: list[_Probe]) -> list:
        caches = []
        for i, probe in enumerate(attn):
            parts = layer_parts[i] if i < len(layer_parts) else [("full", None)]
            own = [states[i] if kind == "state" else probe for kind, _ in parts]
            caches.append(own[0] if len(own) == 1 else CacheList(*own))
        return caches

    probes = [_Probe(returned, modules) for _ in range(max(num_layers, len(layer_parts)))]
    logits = model(mx.array([[1, 2, 3]]), cache=probe_caches(probes))
    if any(s is not None for s in states):  # again from the states just written: their dtypes from then on
        mx.eval(logits)
        first = [s.arrays() if s is not None else None for s in states]
        mx.eval(model(mx.array([[4, 5]]), cache=probe_caches([_Probe({}, modules) for _ in probes])))
    else:  # what the layers asked of their caches is known once the graph is built: not run (a read of every weight)
        first = [None] * len(states)
    plan = []
    for i, parts in enumerate(layer_parts):
        attention = [(k, w) for k, w in parts if k != "state"]
        kind, window = attention[0] if attention else ("state", None)
        state = _state_plan(model, i, states[i], first[i]) if states[i] is not None else None
        plan.append(LayerPlan(kind, window, spec=probes[i].spec if attention else None, state=state,
                              n_heads=probes[i].n_heads, sinks=probes[i].sinks,
                              cache_list=tuple("state" if k == "state" else "attention" for k, _ in parts)
                              if len(parts) > 1 else ()))
    for i, p in enumerate(probes[len(layer_parts):], len(layer_parts)):
        if p.received is None:
            break  # slots past the model's own list that no layer uses
        source = returned.get(p.received)
        if source is None or source is p or source.spec is None:
            raise _refuse(model, i, "computes its own keys and values but the model keeps no cache for it")
        plan.append(LayerPlan("shared", source=probes.index(source), n_heads=p.n_heads, sinks=p.sinks))
    _check(model, plan, probes)
    return plan, logits.shape[-1]


def _state_plan(model: nn.Module, i: int, probe: _StateProbe, first: list) -> StatePlan:
    owners = probe.owners - {None}
    if len(owners) != 1 or None in probe.owners:
        found = ", ".join(sorted(owners)) or "no module of the model"
        raise _refuse(model, i, f"has a recurrent state read by {found}: pagedmlx needs exactly one module that "
                                f"owns it, to run that module per group of requests")
    arrays = probe.arrays()
    for j, (a, b) in enumerate(zip(first, arrays)):
        if a is None or b is None or a[0] != b[0] or b[0][0] != 1:
            raise _refuse(model, i, f"state array {j} is "
                                    f"{'never written' if a is None or b is None else 'of changing shape'}"
                                    f" ({a and a[0]}, then {b and b[0]}): pagedmlx keeps a fixed-size state per "
                                    "request")
    return StatePlan(owners.pop(), tuple((shape[1:], dtype) for shape, dtype in arrays))


def _check(model: nn.Module, plan: list[LayerPlan], probes: list[_Probe]) -> None:
    kind = model_type(model)
    for i, layer in enumerate(plan):
        if layer.kind not in ("shared", "state") and layer.spec is None:
            raise UnsupportedModelError(f"model type {kind!r}: layer {i} never wrote keys and values through "
                                        f"its cache")
        if layer.state is not None:
            inside = sorted({p.caller for p in probes if p.caller is not None and
                             (p.caller == layer.state.owner or p.caller.startswith(layer.state.owner + "."))})
            if inside:
                raise UnsupportedModelError(
                    f"model type {kind!r}: layer {i}'s recurrent state belongs to {layer.state.owner!r}, which also "
                    f"attends ({', '.join(inside)}): its rows cannot run per request while attention runs on pages")
    planned = {layer.window for layer in plan if layer.kind == "sliding"}
    for i, p in enumerate(probes):
        if p.asked_window is not None and p.asked_window not in planned:
            raise UnsupportedModelError(
                f"model type {kind!r}: layer {i} asks for a sliding window of {p.asked_window} tokens through its "
                f"attention mask, but its cache "
                f"({'keeps ' + str(plan[i].window) + ' tokens' if i < len(plan) and plan[i].window else 'a KVCache'}) "
                f"does not: mlx-lm applies that window in the mask, which the paged step cannot see; refusing "
                f"rather than attending past the window")
