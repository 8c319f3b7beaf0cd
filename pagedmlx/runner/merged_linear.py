"""Merged projections (vLLM's QKVParallelLinear and MergedColumnParallelLinear) for stock mlx-lm models:
q/k/v, and gate/up, each one product over their concatenated weights instead of two or three.

On a GPU a batch-1 decode step is bound by the host's dispatch of its kernels, not by its weights' bytes
(docs/benchmarks.md, run 51: ~9 us a launch on CUDA, 521 launches a Llama-8B step); merging takes three
launches a layer away. The model's code is left as it is: the group's first module becomes a MergedLinear
that computes every part's output and keeps the others for the modules that take the other parts'
places (MergedPart), which the model calls next with the same input. It does so only inside
`merged_products()` (the runner's forward pass); outside it each module multiplies by its own rows of the
merged weights (views: the very values and shapes it had), so mlx-lm's own generation on the same model
object, the load-time check's reference included, computes exactly what it did before the merge.

A group is merged only where a probe forward pass shows the model calling each of its modules once with
the very same input array (so not Gemma-4's shared-KV layers, which call q_proj alone), where the modules
are plain nn.Linear or nn.QuantizedLinear of one format (not tensor parallelism's sharded layers), and
where the merged product, checked on a random input at merge time, matches the separate ones within the
dtype's tolerance. A part called with another input computes its own rows of the merged weights.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

logger = logging.getLogger("pagedmlx")

GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}
_active = threading.local()


@contextlib.contextmanager
def merged_products() -> Iterator[None]:
    """Merged groups compute one product for all their parts (in this thread) while inside."""
    before = getattr(_active, "on", False)
    _active.on = True
    try:
        yield
    finally:
        _active.on = before


def _linear_kind(m: nn.Module) -> Optional[tuple]:
    """What must match for modules to merge: class, input width, bias, quantization; None: not mergeable."""
    if type(m) is nn.Linear:
        return ("linear", m.weight.shape[1], m.weight.dtype, "bias" in m)
    if type(m) is nn.QuantizedLinear:
        return ("quantized", m.weight.shape[1], m.scales.dtype, "bias" in m, "biases" in m, m.group_size, m.bits,
                getattr(m, "mode", "affine"))
    return None


def _concatenate(mods: list[nn.Module]) -> nn.Module:
    """One module of the same class whose output is the parts' outputs side by side."""
    first = mods[0]
    merged = nn.Linear.__new__(type(first))
    nn.Module.__init__(merged)
    for key, value in first.items():
        if isinstance(value, mx.array):
            merged[key] = mx.concatenate([m[key] for m in mods], axis=0)
    for attr in ("group_size", "bits", "mode"):
        if hasattr(first, attr):
            setattr(merged, attr, getattr(first, attr))
    if isinstance(merged, nn.QuantizedLinear):
        merged.freeze()
    return merged


def _rows(linear: nn.Module, start: int, stop: int) -> nn.Module:
    """A module over the merged weights' output rows [start, stop): views, no copy."""
    part = nn.Linear.__new__(type(linear))
    nn.Module.__init__(part)
    for key, value in linear.items():
        if isinstance(value, mx.array):
            part[key] = value[start:stop]
    for attr in ("group_size", "bits", "mode"):
        if hasattr(linear, attr):
            setattr(part, attr, getattr(linear, attr))
    return part


class MergedLinear(nn.Module):
    """Takes the place of a group's first module: owns the merged weights (`linear`) and returns part 0;
    keeps the other parts of its last input's product until their MergedPart modules take them."""

    def __init__(self, linear: nn.Module, sizes: list[int]):
        super().__init__()
        self.linear = linear
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_separate", [_rows(linear, a, b) for a, b in zip(bounds, bounds[1:])])
        self._forget()

    def _forget(self) -> None:
        object.__setattr__(self, "_input", None)
        object.__setattr__(self, "_parts", None)
        object.__setattr__(self, "_left", 0)

    def __call__(self, x: mx.array) -> mx.array:
        return self.part(x, 0)

    def part(self, x: mx.array, i: int) -> mx.array:
        if not getattr(_active, "on", False):
            return self._separate[i](x)
        if self._input is not x:  # a new input (or a call the probe did not see): the whole product anew
            object.__setattr__(self, "_input", x)
            object.__setattr__(self, "_parts", mx.split(self.linear(x), self._bounds[1:-1], axis=-1))
            object.__setattr__(self, "_left", len(self._bounds) - 1)
        out = self._parts[i]
        object.__setattr__(self, "_left", self._left - 1)
        if self._left <= 0:  # every part taken: hold no activations between steps
            self._forget()
        return out


class MergedPart(nn.Module):
    """Takes the place of a group's other module: its part of the MergedLinear's product (which it
    holds outside the module tree, so the merged weights are counted once)."""

    def __init__(self, owner: MergedLinear, index: int):
        super().__init__()
        object.__setattr__(self, "_owner", owner)
        object.__setattr__(self, "_index", index)

    def __call__(self, x: mx.array) -> mx.array:
        return self._owner.part(x, self._index)


def _probe_calls(model: nn.Module, candidates: dict[tuple[str, int], list[nn.Module]]) -> dict:
    """One token through the model on mlx-lm's own caches; per candidate module, the inputs it was called
    with (their ids, in order)."""
    seen: dict[int, list[int]] = {id(m): [] for mods in candidates.values() for m in mods}
    originals = {}
    for mods in candidates.values():
        for m in mods:
            cls = type(m)
            if cls not in originals:
                originals[cls] = cls.__call__

                def record(self, x, *args, _call=originals[cls], **kwargs):
                    if id(self) in seen:
                        seen[id(self)].append(id(x))
                    return _call(self, x, *args, **kwargs)
                cls.__call__ = record
    try:
        mx.eval(model(mx.array([[1]]), cache=make_prompt_cache(model)))
    finally:
        for cls, call in originals.items():
            cls.__call__ = call
    return seen


def merge_projections(model: nn.Module) -> int:
    """Merge every q/k/v and gate/up group the model calls on one input (module docstring); returns how
    many groups were merged."""
    candidates: dict[tuple[str, int], list[nn.Module]] = {}
    for path, module in model.named_modules():
        for g, names in enumerate(GROUPS):
            mods = [module.get(n) for n in names]
            if all(isinstance(m, nn.Module) for m in mods):
                kinds = {_linear_kind(m) for m in mods}
                if len(kinds) == 1 and None not in kinds:
                    candidates[(path, g)] = mods
    if not candidates:
        return 0
    seen = _probe_calls(model, candidates)
    modules = dict(model.named_modules())
    merged = 0
    for (path, g), mods in candidates.items():
        calls = [seen[id(m)] for m in mods]
        if not all(len(c) == 1 for c in calls) or len({c[0] for c in calls}) != 1:
            continue
        if _merge_group(modules[path], GROUPS[g], mods):
            merged += 1
    return merged


def _merge_group(parent: nn.Module, names: tuple[str, ...], mods: list[nn.Module]) -> bool:
    """Replace the group's modules by a MergedLinear and its MergedParts, once a random input shows the
    merged product equal to the separate ones."""
    linear = _concatenate(mods)
    sizes = [m.weight.shape[0] for m in mods]
    in_dims = mods[0].weight.shape[1] * (32 // mods[0].bits if isinstance(mods[0], nn.QuantizedLinear) else 1)
    dtype = mods[0].scales.dtype if isinstance(mods[0], nn.QuantizedLinear) else mods[0].weight.dtype
    x = mx.random.normal((1, 2, in_dims), key=mx.random.key(0)).astype(dtype)
    want = [m(x) for m in mods]
    got = mx.split(linear(x), [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)], axis=-1)
    tol = _TOLERANCE.get(dtype, 2e-2)
    for w, o in zip(want, got):
        scale = max(1.0, mx.abs(w).max().item())
        if not mx.abs(w.astype(mx.float32) - o.astype(mx.float32)).max().item() <= tol * scale:
            logger.warning("merge_projections: %s do not merge within %g; kept separate", "/".join(names), tol)
            return False
    mx.eval(linear.parameters())
    owner = MergedLinear(linear, sizes)
    parent[names[0]] = owner
    for i, name in enumerate(names[1:], start=1):
        parent[name] = MergedPart(owner, i)
    return True
