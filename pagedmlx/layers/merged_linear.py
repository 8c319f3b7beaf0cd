"""Merged projections (vLLM's QKVParallelLinear and MergedColumnParallelLinear) for stock mlx-lm models:
the projections a module applies to one input (q/k/v, gate/up, a linear-attention layer's four input
projections) as one product over their concatenated weights.

On a GPU a batch-1 decode step is bound by the host's dispatch of its kernels, not by its weights' bytes
(~9 us a launch on CUDA, 521 launches a Llama-8B step); merging takes three
launches a layer away (see ANY_ROWS for when). The model's code is left as it is: the group's first
module becomes a MergedLinear that computes every part's output and keeps the others for the modules
that take the other parts' places (MergedPart), which the model calls next with the same input. It
does so only inside
`merged_products()` (the runner's forward pass); outside it each module multiplies by its own rows of the
merged weights (views: the very values and shapes it had), so mlx-lm's own generation on the same model
object, the load-time check's reference included, computes exactly what it did before the merge.

Groups are found, not named: the siblings in one module that a probe (a three-token prefill, then a
decode) shows called on the very same input arrays, call for call (so not Gemma-4's shared-KV layers,
which call q_proj alone), that are plain nn.Linear or nn.QuantizedLinear of one format and input width
(not tensor parallelism's sharded layers). A group merges where the merged product, checked on a random
input at merge time, matches the separate ones within the dtype's tolerance. A part called on another
input than its group's last one gets the whole product of that input (right, if slower).
"""

from __future__ import annotations

import logging
from typing import ContextManager, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from pagedmlx.layers.quantized_linear import QUANTIZED_LINEAR
from pagedmlx.runner.thread_flag import ThreadFlag

logger = logging.getLogger("pagedmlx")

_TOLERANCE = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 2e-2}
# A part of a merged product is a column slice: over several rows (tokens) it is not row-contiguous, and
# where its reader needs that, MLX copies it first. MLX's CUDA RoPE copies non-contiguous 4-D inputs (the
# runner's queries and keys are (T, heads, 1, head_dim)) and custom kernels copy their inputs (the page
# write's values): merged q/k/v over T > 1 rows would cost three copies to save two products. Groups whose
# parts feed elementwise ops or a concatenation only (gate/up into the MLP's activation; Qwen3.5's Gated
# DeltaNet inputs: qkv into the convolution's concatenate, z, b and a into elementwise gates) merge for any
# rows; every other group for single-row steps (batch-1 decodes, draft forwards), where each part is
# row-contiguous.
ANY_ROWS = ({"gate_proj", "up_proj"}, {"w1", "w3"}, {"in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"})


_active = ThreadFlag()


def merged_products() -> ContextManager[None]:
    """Merged groups compute one product for all their parts (in this thread) while inside."""
    return _active.scope()


def _linear_kind(m: nn.Module) -> Optional[tuple]:
    """What must match for modules to merge: class, input width, bias, quantization; None: not mergeable."""
    if type(m) is nn.Linear:
        return ("linear", m.weight.shape[1], m.weight.dtype, "bias" in m)
    if type(m) in QUANTIZED_LINEAR:  # layers/quantized_linear.py's swap included
        return ("quantized", m.weight.shape[1], m.scales.dtype, "bias" in m, "biases" in m, m.group_size, m.bits,
                getattr(m, "mode", "affine"))
    return None


def _like(linear: nn.Module, arrays: dict[str, mx.array]) -> nn.Module:
    """A module of `linear`'s class and quantization over these arrays (weight, scales, biases, bias)."""
    module = nn.Linear.__new__(type(linear))
    nn.Module.__init__(module)
    for key, value in arrays.items():
        module[key] = value
    for attr in ("group_size", "bits", "mode"):
        if hasattr(linear, attr):
            setattr(module, attr, getattr(linear, attr))
    if isinstance(module, nn.QuantizedLinear):
        module.freeze()
    return module


def _concatenate(mods: list[nn.Module]) -> nn.Module:
    """One module of the same class whose output is the parts' outputs side by side."""
    keys = [k for k, v in mods[0].items() if isinstance(v, mx.array)]
    return _like(mods[0], {k: mx.concatenate([m[k] for m in mods], axis=0) for k in keys})


def _rows(linear: nn.Module, start: int, stop: int) -> nn.Module:
    """A module over the merged weights' output rows [start, stop): views, no copy."""
    return _like(linear, {k: v[start:stop] for k, v in linear.items() if isinstance(v, mx.array)})


class MergedLinear(nn.Module):
    """Takes the place of a group's first module: owns the merged weights (`linear`) and returns part 0;
    keeps the other parts of its last input's product until their MergedPart modules take them."""

    def __init__(self, linear: nn.Module, sizes: list[int], any_rows: bool = False):
        """any_rows: merged for inputs of any number of rows; else for single-row inputs only (ANY_ROWS)."""
        super().__init__()
        self.linear = linear
        object.__setattr__(self, "_any_rows", any_rows)
        bounds = [0]
        for n in sizes:
            bounds.append(bounds[-1] + n)
        object.__setattr__(self, "_bounds", bounds)
        object.__setattr__(self, "_separate", [_rows(linear, a, b) for a, b in zip(bounds, bounds[1:])])
        self._forget()

    def _forget(self) -> None:
        object.__setattr__(self, "_input", None)
        object.__setattr__(self, "_whole", None)
        object.__setattr__(self, "_parts", None)
        object.__setattr__(self, "_left", 0)

    def __call__(self, x: mx.array) -> mx.array:
        return self.part(x, 0)

    def merges(self, x: mx.array) -> bool:
        """Whether a call on x takes the merged product (inside merged_products(), rows permitting)."""
        return _active.on and (self._any_rows or x.size == x.shape[-1])

    def part(self, x: mx.array, i: int) -> mx.array:
        if not self.merges(x):
            return self._separate[i](x)
        return self._take(x, i)[1]

    def part_in_whole(self, x: mx.array, i: int) -> Optional[tuple[mx.array, int, int]]:
        """part(x, i) as (the whole product, its width, the part's first column); None where x takes no
        merged product (call part)."""
        if not self.merges(x):
            return None
        whole, _ = self._take(x, i)
        return whole, self._bounds[-1], self._bounds[i]

    def _take(self, x: mx.array, i: int) -> tuple[mx.array, mx.array]:
        if self._input is not x:  # a new input (or a call the probe did not see): the whole product anew
            whole = self.linear(x)
            object.__setattr__(self, "_input", x)
            object.__setattr__(self, "_whole", whole)
            object.__setattr__(self, "_parts", mx.split(whole, self._bounds[1:-1], axis=-1))
            object.__setattr__(self, "_left", len(self._bounds) - 1)
        out = self._whole, self._parts[i]
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


def separate(module: nn.Module) -> nn.Module:
    """The plain Linear / QuantizedLinear a merged module stands for (its own rows of the merged weights,
    as views), for code that reads a projection's weights (LoRA); any other module as it is."""
    if isinstance(module, MergedLinear):
        return module._separate[0]
    if isinstance(module, MergedPart):
        return module._owner._separate[module._index]
    return module


def part_in_whole(module: nn.Module, x: mx.array) -> Optional[tuple[mx.array, int, int]]:
    """module(x) for a merged module inside merged_products(), as (the group's whole product of x, its width,
    the part's first column), so that a kernel reads the part in place (the LoRA kernel); None for any other
    module, or where the call takes no merged product (call the module)."""
    if isinstance(module, MergedLinear):
        return module.part_in_whole(x, 0)
    if isinstance(module, MergedPart):
        return module._owner.part_in_whole(x, module._index)
    return None


def _probe_calls(model: nn.Module, modules: list[nn.Module]) -> dict[int, list[mx.array]]:
    """Three tokens, then one more, through the model on mlx-lm's own caches (a prefill and a decode);
    per module (by id), the inputs it was called with, in order."""
    seen: dict[int, list[mx.array]] = {id(m): [] for m in modules}
    originals = {}
    for cls in {type(m) for m in modules}:
        originals[cls] = cls.__call__

        def record(self, x, *args, _call=originals[cls], **kwargs):
            if id(self) in seen:
                seen[id(self)].append(x)
            return _call(self, x, *args, **kwargs)
        cls.__call__ = record
    try:
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array([[1, 2, 3]]), cache=cache))
        mx.eval(model(mx.array([[4]]), cache=cache))
    finally:
        for cls, call in originals.items():
            cls.__call__ = call
    return seen


def _sibling_groups(model: nn.Module) -> list[tuple[nn.Module, list[str]]]:
    """Per parent module, its plain projections of one format and input width that the probe saw called
    on the very same inputs, call for call: (parent, their names), two names or more."""
    parents = []
    for _, parent in model.named_modules():
        kids = {name: m for name, m in parent.items() if isinstance(m, nn.Module) and _linear_kind(m) is not None}
        if len(kids) >= 2:
            parents.append((parent, kids))
    if not parents:
        return []
    try:
        seen = _probe_calls(model, [m for _, kids in parents for m in kids.values()])
    except Exception as exc:  # noqa: BLE001 - an optimisation: a model the probe cannot run keeps its modules
        logger.warning("merge_projections: the probe pass failed (%s); projections kept separate", exc)
        return []
    groups = []
    for parent, kids in parents:
        left = [n for n in kids if seen[id(kids[n])]]
        while left:
            first, calls = left[0], seen[id(kids[left[0]])]
            same = [n for n in left if _linear_kind(kids[n]) == _linear_kind(kids[first])
                    and len(seen[id(kids[n])]) == len(calls)
                    and all(a is b for a, b in zip(seen[id(kids[n])], calls))]
            if len(same) >= 2:
                groups.append((parent, same))
            left = [n for n in left if n not in same]
    return groups


def merge_projections(model: nn.Module) -> int:
    """Merge, in every module, the projections the model calls on one input (module docstring: q/k/v,
    gate/up, a linear-attention layer's input projections); returns how many groups were merged."""
    merged = 0
    for parent, names in _sibling_groups(model):
        if _merge_group(parent, tuple(names), [parent[n] for n in names]):
            merged += 1
    return merged


def _merge_group(parent: nn.Module, names: tuple[str, ...], mods: list[nn.Module]) -> bool:
    """Replace the group's modules by a MergedLinear and its MergedParts, once a random input shows the
    merged product equal to the separate ones."""
    linear = _concatenate(mods)
    sizes = [m.weight.shape[0] for m in mods]
    in_dims = mods[0].weight.shape[1] * (32 // mods[0].bits if isinstance(mods[0], nn.QuantizedLinear) else 1)
    dtype = mods[0].scales.dtype if isinstance(mods[0], nn.QuantizedLinear) else mods[0].weight.dtype
    if not mx.issubdtype(dtype, mx.floating):  # microscaled modes (mxfp4, nvfp4): scales are 8-bit exponents
        dtype = mx.float32
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
    owner = MergedLinear(linear, sizes, any_rows=set(names) in ANY_ROWS)
    parent[names[0]] = owner
    for i, name in enumerate(names[1:], start=1):
        parent[name] = MergedPart(owner, i)
    return True
