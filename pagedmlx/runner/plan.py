"""The layer plan: what each layer of a stock mlx-lm model keeps, derived at load from the model's own
caches (`make_prompt_cache`) and one probe forward pass.

- full attention (KVCache): pages for every token;
- a sliding window of W tokens (RotatingKVCache(W), keep 0): pages for the last W tokens;
- shared KV (Gemma 3n / Gemma 4 "E" models): a layer that attends over another layer's keys and
  values; it owns no pages. Gemma 4 hands such a layer its source's (keys, values) and no cache, so
  the runner gives it an alias cache; the probe finds its source by identity (the keys it is handed
  are the very arrays its source's cache returned). Gemma 3n hands it the source's cache itself.
Attention sinks (gpt-oss) need nothing here: they reach the attention call as an argument.

Everything else is refused with an error naming the layer and the reason, never served approximately:
recurrent state, chunked attention (llama4), several caches per layer, a window the cache does not
keep (a window asked for only through the attention mask, which the paged step cannot see).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx
import mlx.nn as nn


class UnsupportedModelError(ValueError):
    pass


@dataclass(frozen=True)
class LayerPlan:
    kind: str  # "full", "sliding" or "shared"
    window: Optional[int] = None  # sliding: W (a query at p attends keys in (p - W, p])
    source: Optional[int] = None  # shared: the layer whose pages it reads
    spec: Optional[tuple[int, int, int, mx.Dtype]] = None  # owners: (n_kv_heads, k_dim, v_dim, dtype)
    n_heads: Optional[int] = None  # query heads
    sinks: bool = False  # learned attention sinks


def model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None) or type(model).__module__


_REFUSED = {
    "ArraysCache": "recurrent (SSM / linear attention) state",
    "MambaCache": "recurrent (SSM) state",
    "ChunkedKVCache": "chunked local attention (llama4), whose model code needs integer offsets",
    "CacheList": "several caches in one layer",
    "QuantizedKVCache": "a quantized KV cache",
}


def _cache_kind(model: nn.Module, i: int, cache) -> tuple[str, Optional[int]]:
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    if type(cache) is KVCache:
        return "full", None
    if type(cache) is RotatingKVCache:
        if cache.keep:
            raise UnsupportedModelError(
                f"model type {model_type(model)!r}: layer {i} keeps its first {cache.keep} tokens forever "
                f"(RotatingKVCache keep={cache.keep}, StreamingLLM-style sinks), which pagedmlx does not page")
        return "sliding", cache.max_size
    name = type(cache).__name__
    raise UnsupportedModelError(
        f"model type {model_type(model)!r} is not supported yet: layer {i} needs "
        f"{_REFUSED.get(name, name)} ({name}), which pagedmlx does not keep in pages")


class _Probe:
    """A cache for one probe pass: records K/V shapes, the window a mask asks for, and the
    identity of the K/V it is handed and returns; attends over the new tokens only."""

    def __init__(self, returned: dict[int, int]):
        self.offset = 0
        self.spec = None
        self.received: Optional[int] = None
        self.asked_window: Optional[int] = None
        self.kv: tuple = (None, None)
        self.n_heads: Optional[int] = None
        self.sinks = False
        self._returned = returned  # id(keys returned) -> the slot that returned them

    def make_mask(self, *args, window_size: Optional[int] = None, **kwargs) -> None:
        self.asked_window = window_size or self.asked_window
        return None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.received = id(keys)
        self.spec = (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        self._returned.setdefault(id(keys), self)
        self.kv = (keys, values)  # also keeps the arrays alive, so that no other array reuses their id
        return keys, values

    def record_queries(self, queries: mx.array, sinks: Optional[mx.array]) -> None:  # from the SDPA dispatcher
        self.n_heads, self.sinks = queries.shape[1], sinks is not None

    def keys_and_values(self) -> tuple[mx.array, mx.array]:  # gemma3n's shared layers read their source so
        return self.kv


def plan_layers(model: nn.Module) -> tuple[list[LayerPlan], int]:
    """(the plan of every layer the runner passes a cache to, the model's vocabulary size)."""
    from mlx_lm.models.cache import make_prompt_cache

    kinds = [_cache_kind(model, i, c) for i, c in enumerate(make_prompt_cache(model))]
    num_layers = len(getattr(model, "layers", None) or kinds)
    returned: dict[int, _Probe] = {}
    probes = [_Probe(returned) for _ in range(max(num_layers, len(kinds)))]
    logits = model(mx.array([[1, 2, 3]]), cache=probes)
    mx.eval(logits)
    plan = [LayerPlan(kind, window, spec=p.spec, n_heads=p.n_heads, sinks=p.sinks) for (kind, window), p in zip(kinds, probes)]
    for i, p in enumerate(probes[len(kinds):], len(kinds)):
        if p.received is None:
            break  # slots past the model's own list that no layer uses
        source = returned.get(p.received)
        if source is None or source is p or source.spec is None:
            raise UnsupportedModelError(
                f"model type {model_type(model)!r}: layer {i} computes its own keys and values but the "
                f"model keeps no cache for it")
        plan.append(LayerPlan("shared", source=probes.index(source), n_heads=p.n_heads, sinks=p.sinks))
    _check(model, plan, probes)
    return plan, logits.shape[-1]


def _check(model: nn.Module, plan: list[LayerPlan], probes: list[_Probe]) -> None:
    kind = model_type(model)
    for i, layer in enumerate(plan):
        if layer.kind != "shared" and layer.spec is None:
            raise UnsupportedModelError(f"model type {kind!r}: layer {i} never wrote keys and values through "
                                        f"its cache")
    planned = {layer.window for layer in plan if layer.kind == "sliding"}
    for i, p in enumerate(probes):
        if p.asked_window is not None and p.asked_window not in planned:
            raise UnsupportedModelError(
                f"model type {kind!r}: layer {i} asks for a sliding window of {p.asked_window} tokens through its "
                f"attention mask, but its cache ({'keeps ' + str(plan[i].window) + ' tokens' if i < len(plan) and plan[i].window else 'a KVCache'}) "
                f"does not: mlx-lm applies that window in the mask, which the paged step cannot see; refusing "
                f"rather than attending past the window")
