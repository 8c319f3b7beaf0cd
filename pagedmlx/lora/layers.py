"""LinearWithLoRA (vLLM's vllm/lora/layers.py): a targeted Linear or QuantizedLinear whose rows each
add their own adapter's low-rank product, and PunicaWrapper (vLLM's punica wrapper): the step's
per-row adapter slots that every such layer reads.

A step's T tokens are T rows (token-major, DESIGN.md). Each wrapped layer keeps every resident
adapter's A and B stacked by slot (slot 0 is zeros: rows without an adapter). A step that uses the
k slots `used` computes, for all rows at once,

    base(x) + scale[row] * (((x @ A[used]^T) * mask) @ B[used])

with A[used] (k * R, in) and B[used] (k * R, out) the used slots' stacks side by side and mask (T, k * R)
one where a column belongs to the row's own slot: two dense products as wide as the step's adapters
(no per-row gather, which MLX's CUDA gather_mm runs slowly), no Python loop over rows or adapters.
A row adds its own adapter's (x @ A) @ B, the other columns being exact zeros; rows without an
adapter add exactly zero, so base rows give the base model's values; adapter rows give mlx-lm's
LoRALinear's (and DoRALinear's) values. A layer that no row of the step targets runs its base layer alone.

On a GPU whose load-time check passed (kernels/lora.py), LoRA layers of the step (not DoRA) run one
kernel instead of those products: each tiny product is a launch that costs more than the product.
There, wrapped layers that the model calls one after the other on the same input (q/k/v, gate/up:
siblings) share one launch. Which layers are siblings is learned from the first step with adapter
rows (the model's own calls, so no model family is named here); in later steps the first sibling
called computes the later ones' outputs too and keeps them for their calls. A sibling's output is
taken only when it is called with that same input array in that same step: a plan that does not
hold any more costs a wasted product, never a wrong value, and switches the sharing off."""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass, field
from typing import Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.kernels import lora as lora_kernel
from pagedmlx.lora.models import LoRALayerWeights, dense_weight, linear_dims
from pagedmlx.layers.merged_linear import part_in_whole, separate

logger = logging.getLogger(__name__)


@dataclass
class LoRAStep:
    """One step's adapter rows, uploaded with the step's other indices (attention_metadata.py)."""

    num_rows: int
    indices: mx.array  # (T,) each row's slot; 0: no adapter
    used: mx.array  # (k,) the non-zero slots the rows use, ascending
    used_columns: mx.array  # (k * max_rank,) the slot each column of the stacked products belongs to
    slots: frozenset  # host: `used`
    dora_slots: frozenset  # host: those of them holding DoRA adapters
    slot_scales: mx.array  # (num_slots,) each slot's scale (0 for slot 0)
    slot_dora: Optional[mx.array] = None  # (num_slots,) bool, where a DoRA row is in the step
    traced: bool = False  # built inside mx.compile's trace (compiled_step.py): nothing may be kept past it
    _scales: dict = field(default_factory=dict, repr=False)
    _masks: dict = field(default_factory=dict, repr=False)
    _dora_rows: Optional[mx.array] = field(default=None, repr=False)

    def row_scales(self, dtype: mx.Dtype) -> mx.array:
        """(T, 1) each row's adapter scale in `dtype` (built once a step per dtype)."""
        if dtype not in self._scales:
            self._scales[dtype] = self.slot_scales.astype(dtype)[self.indices][:, None]
        return self._scales[dtype]

    def column_mask(self, dtype: mx.Dtype) -> mx.array:
        """(T, k * max_rank): 1 where a column of the stacked products is the row's own slot's."""
        if dtype not in self._masks:
            self._masks[dtype] = (self.indices[:, None] == self.used_columns[None, :]).astype(dtype)
        return self._masks[dtype]

    def dora_rows(self) -> mx.array:
        if self._dora_rows is None:
            self._dora_rows = self.slot_dora[self.indices][:, None]
        return self._dora_rows


class PunicaWrapper:
    """The step's LoRAStep, shared by every LinearWithLoRA; None outside a step the runner runs, so
    that the model called any other way (mlx-lm's own generate, the load-time check) is the base."""

    def __init__(self, kernel_backend: Optional[str] = None) -> None:
        self.step: Optional[LoRAStep] = None
        self.kernel_backend = kernel_backend  # kernels/lora.py's add_lora runs LoRA (not DoRA) steps here
        # Siblings (module docstring): each layer's later siblings, learned from one step's calls
        self.siblings: Optional[dict[int, tuple]] = None  # id(layer) -> its later siblings; None: learn next step
        self.share_launches = True
        self._calls: list[tuple[mx.array, list]] = []  # the learning step's: (input, layers called on it)
        self._kept: dict[int, tuple[mx.array, mx.array]] = {}  # id(sibling) -> (its input, its output)

    def begin_step(self, step: LoRAStep) -> None:
        self.step = step

    def end_step(self, completed: bool = True) -> None:
        """After the step's forward pass: learn the siblings, or check the plan held (outputs kept for
        siblings that were never called on their input: stop sharing). A step that raised (completed
        False) teaches and proves nothing."""
        self.step = None
        if not completed:
            self._calls, self._kept = [], {}
            return
        if self.siblings is None and self._calls:
            self.siblings = {id(layer): tuple(layers[i + 1:]) for _, layers in self._calls
                             for i, layer in enumerate(layers) if len(layers) > 1}
        if self._kept:
            self._stop_sharing(f"{len(self._kept)} sibling outputs computed in one launch were never asked for")
        self._calls, self._kept = [], {}

    def _stop_sharing(self, why: str) -> None:
        if self.share_launches:
            self.share_launches = False
            logger.warning("LoRA: %s; sibling projections run one launch each from now on", why)

    def forget_siblings(self) -> None:
        """A layer was wrapped: learn the siblings again."""
        self.siblings = None

    def note_call(self, layer: "LinearWithLoRA", x: mx.array) -> None:
        """In the learning step, every wrapped layer's call in order (with adapter rows or not)."""
        if self._calls and self._calls[-1][0] is x:
            self._calls[-1][1].append(layer)
        else:
            self._calls.append((x, [layer]))

    def add_lora_linear(self, layer: "LinearWithLoRA", x: mx.array) -> mx.array:
        step = self.step
        lead, out_dims = x.shape[:-1], layer.output_size
        rows = math.prod(lead)
        if rows != step.num_rows:
            raise RuntimeError(f"LoRA: a targeted layer ran on {rows} rows but the step has {step.num_rows}: this "
                               f"model does not run its layers token-major, which batched adapters need")
        kept = self._kept.pop(id(layer), None)
        if kept is not None:
            if kept[0] is x:
                return kept[1]
            self._stop_sharing("a sibling was called on another input than the one its output was computed on")
        if self._on_kernel(layer, rows):
            later = [s for s in (self.siblings or {}).get(id(layer), ())
                     if self.share_launches and self._on_kernel(s, rows)]
            layers = [layer, *later]
            ys, parts = [], []
            for m in layers:  # a merged projection's part is read in place from its group's product
                whole = part_in_whole(m.base_layer, x)
                ys.append(m.base_layer(x).reshape(rows, m.output_size) if whole is None
                          else whole[0].reshape(rows, whole[1]))
                parts.append(None if whole is None else (whole[2], m.output_size))
            outs = lora_kernel.add_lora_siblings(
                x.reshape(rows, x.shape[-1]), ys, [m._lora_a_stacked for m in layers],
                [m._lora_b_stacked for m in layers], step.indices, step.slot_scales, self.kernel_backend,
                y_parts=parts)
            outs = [o.reshape(*lead, m.output_size) for m, o in zip(layers, outs)]
            self._kept.update((id(m), (x, o)) for m, o in zip(later, outs[1:]))
            return outs[0]
        a_used, b_used = layer.used_stacks(step)
        a = x.reshape(rows, x.shape[-1]) @ a_used.T
        z = ((a * step.column_mask(a.dtype)) @ b_used).reshape(*lead, out_dims)
        scales = step.row_scales(z.dtype).reshape(*lead, 1)
        y = layer.base_layer(x)
        if step.dora_slots.isdisjoint(layer.dora_slots):
            return _add_scaled(y, scales, z)
        lora = (scales * z).astype(x.dtype)  # mlx-lm's (scale * z)
        # DoRA (mlx-lm's DoRALinear): (m / ||W + scale B^T A^T||) * (x W^T + scale z) + bias; the norm
        # factor is 1 in every other slot.
        norm_scale = layer._norm_scale_stacked[step.indices].astype(x.dtype).reshape(*lead, out_dims)
        if layer.plain:  # x W^T is base(x): one product serves every row
            return norm_scale * (y + lora)
        base = separate(layer.base_layer)
        dora = norm_scale * (x @ dense_weight(base).T + lora)
        if "bias" in base:
            dora = dora + base.bias
        return mx.where(step.dora_rows().reshape(*lead, 1), dora, y + lora)

    def _on_kernel(self, layer: "LinearWithLoRA", rows: int) -> bool:
        """Whether the layer's rows of this step run the kernel: it has adapter rows, none of them DoRA."""
        step = self.step
        return (self.kernel_backend is not None and rows <= lora_kernel.MAX_ROWS
                and not step.slots.isdisjoint(layer.lora_slots) and step.dora_slots.isdisjoint(layer.dora_slots))


@functools.partial(mx.compile, shapeless=True)
def _add_scaled(y: mx.array, scales: mx.array, z: mx.array) -> mx.array:
    """mlx-lm's LoRALinear epilogue, y + (scale * z).astype(y.dtype), as one fused kernel."""
    return y + (scales * z).astype(y.dtype)


class LinearWithLoRA(nn.Module):
    """A Linear / QuantizedLinear of the model with num_slots adapter slots of rank up to max_rank.
    The stacks are "_"-named: not model parameters (model.parameters() stays the base model's)."""

    wraps_base_layer = True  # models.py finds wrapped layers by this (it cannot import this module)

    def __init__(self, base_layer: nn.Module, punica: PunicaWrapper, num_slots: int, max_rank: int,
                 dtype: mx.Dtype):
        super().__init__()
        self.base_layer = base_layer  # called for the base product (merged, where layers/merged_linear.py merged it)
        self.punica = punica
        weights = separate(base_layer)  # the projection's own weights
        self.input_size, self.output_size = linear_dims(weights)
        self.max_rank = max_rank
        self.plain = isinstance(weights, nn.Linear) and "bias" not in weights
        self._lora_a_stacked = mx.zeros((num_slots, max_rank, self.input_size), dtype)
        self._lora_b_stacked = mx.zeros((num_slots, max_rank, self.output_size), dtype)
        self._norm_scale_stacked: Optional[mx.array] = None  # (num_slots, out), once a DoRA adapter lands
        self.lora_slots: frozenset = frozenset()  # host: slots holding a pair for this layer
        self.dora_slots: frozenset = frozenset()
        self._used: tuple = ((), None, None)  # (slots, A, B) of the last step's used slots: most steps reuse them

    @property
    def weight(self) -> mx.array:  # code that reads a projection's weight (shapes, dtype) still finds it
        return separate(self.base_layer).weight

    def __call__(self, x: mx.array) -> mx.array:
        step = self.punica.step
        if step is not None and self.punica.siblings is None:
            self.punica.note_call(self, x)
        if step is None or step.slots.isdisjoint(self.lora_slots):
            return self.base_layer(x)
        return self.punica.add_lora_linear(self, x)

    def used_stacks(self, step: LoRAStep) -> tuple[mx.array, mx.array]:
        """The step's used slots' A (k * R, in) and B (k * R, out), side by side in slot order."""
        key = tuple(sorted(step.slots))
        if self._used[0] == key:
            return self._used[1], self._used[2]
        k_rank = step.used_columns.shape[0]
        used = (key, self._lora_a_stacked[step.used].reshape(k_rank, -1),
                self._lora_b_stacked[step.used].reshape(k_rank, -1))
        if not step.traced:  # a trace's arrays are placeholders
            self._used = used
        return used[1], used[2]

    def set_lora(self, slot: int, weights: LoRALayerWeights) -> list[mx.array]:
        """Put an adapter's pair in `slot` (rank padded with zeros to max_rank); returns what to evaluate."""
        r, pad = weights.rank, self.max_rank - weights.rank
        self._used = ((), None, None)
        dtype = self._lora_a_stacked.dtype
        self._lora_a_stacked[slot] = mx.pad(weights.lora_a.T.astype(dtype), [(0, pad), (0, 0)])
        self._lora_b_stacked[slot] = mx.pad(weights.lora_b.astype(dtype), [(0, pad), (0, 0)])
        self.lora_slots = self.lora_slots | {slot}
        out = [self._lora_a_stacked, self._lora_b_stacked]
        if weights.norm_scale is not None:
            if self._norm_scale_stacked is None:
                self._norm_scale_stacked = mx.ones((self._lora_a_stacked.shape[0], self.output_size), mx.float32)
            self._norm_scale_stacked[slot] = weights.norm_scale.astype(mx.float32)
            self.dora_slots = self.dora_slots | {slot}
            out.append(self._norm_scale_stacked)
        elif slot in self.dora_slots:
            self._reset_norm(slot)
            out.append(self._norm_scale_stacked)
        assert r <= self.max_rank
        return out

    def reset_lora(self, slot: int) -> list[mx.array]:
        """Empty `slot` (zeros: its rows get the base layer)."""
        if slot not in self.lora_slots:
            return []
        self._lora_a_stacked[slot] = 0
        self._lora_b_stacked[slot] = 0
        self._used = ((), None, None)
        self.lora_slots = self.lora_slots - {slot}
        out = [self._lora_a_stacked, self._lora_b_stacked]
        if slot in self.dora_slots:
            self._reset_norm(slot)
            out.append(self._norm_scale_stacked)
        return out

    def _reset_norm(self, slot: int) -> None:
        self._norm_scale_stacked[slot] = 1
        self.dora_slots = self.dora_slots - {slot}
