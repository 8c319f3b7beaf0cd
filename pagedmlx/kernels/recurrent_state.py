"""Recurrent-state kernels, for state layers (Gated DeltaNet, short convolutions), on CUDA only
(sources in sources/recurrent_state_cuda.py).

On CUDA, mlx-lm runs the gated delta rule (Qwen3.5 / 3.6, Qwen3-Next) as a Python loop over tokens of
a compiled one-step function: a 512-token prefill chunk is 512 dispatches per layer. Here:
- gated_delta: one kernel for a whole chunk (or a whole decode batch), in place of mlx-lm's
  `gated_delta_ops`;
- depthwise_conv1d: the layers' short convolution over [conv state; new rows];
- write_rows: new states into the pool at their slots, in place (see runner/state.py's StatePool).
The first two replace mlx-lm's code only inside a regrouped state layer of a paged step (`active`):
mlx-lm's own generation in the same process keeps its own path. Whether a runner uses them is its
KernelPlan's `state` (selector.py): on CUDA, unless PAGEDMLX_CUDA_KERNELS=0 or the model's
load-time check disagreed. Every other backend keeps mlx-lm's.
"""

from __future__ import annotations

import contextlib
import functools
import math
from typing import Iterator, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.kernels import build
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.kernels.sources import recurrent_state_cuda as src

_active = 0  # > 0 inside a regrouped state layer's call whose runner uses the kernels


@contextlib.contextmanager
def active(on: bool) -> Iterator[None]:
    global _active
    _active += on
    try:
        yield
    finally:
        _active -= on


@functools.lru_cache(maxsize=None)
def _kernel(name: str):
    inputs, outputs, source = {
        "gated_delta": (["q", "k", "v", "g", "beta", "state_in"], ["y", "state_out"], src.GATED_DELTA),
        "depthwise_conv": (["x", "weight", "bias"], ["out"], src.DEPTHWISE_CONV),
        "write_rows": (["values", "slots", "pool"], ["written"], src.WRITE_ROWS),
    }[name]
    return build.make_kernel(CUDA, f"pagedmlx_{name}", inputs, outputs, source, "")


def supports_gated_delta(q: mx.array, v: mx.array, g: mx.array) -> bool:
    Dk, Hk, Hv = q.shape[3], q.shape[2], v.shape[2]
    return Dk % 32 == 0 and Dk <= 256 and Hv % Hk == 0 and g.ndim in (3, 4)


def gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array,
                init_value: Optional[float] = None) -> tuple[mx.array, mx.array]:
    """mlx-lm's gated_delta_ops without a mask: q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g [B, T, Hv]
    (or [B, T, Hv, Dk]), beta [B, T, Hv], state [B, Hv, Dv, Dk] -> (y [B, T, Hv, Dv], new state)."""
    B, T, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    k, v, beta = (a if a.dtype == q.dtype else a.astype(q.dtype) for a in (k, v, beta))
    template = [("InT", q.dtype), ("GT", g.dtype), ("StT", state.dtype), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk),
                ("Hv", Hv), ("VEC_G", g.ndim == 4)]
    return tuple(_kernel("gated_delta")(
        inputs=[q, k, v, g, beta, state], template=template, grid=(32, Dv, B * Hv), threadgroup=(32, 4, 1),
        output_shapes=[(B, T, Hv, Dv), state.shape], output_dtypes=[q.dtype, state.dtype], init_value=init_value))


def depthwise_conv1d(x: mx.array, weight: mx.array, bias: Optional[mx.array] = None,
                     init_value: Optional[float] = None) -> mx.array:
    """nn.Conv1d with groups = channels, no padding: x [B, L, C], weight [C, K, 1] -> [B, L - K + 1, C]."""
    B, L, C = x.shape
    K = weight.shape[1]
    template = [("InT", x.dtype), ("K", K), ("HAS_BIAS", bias is not None)]
    n = B * (L - K + 1) * C
    return _kernel("depthwise_conv")(
        inputs=[x, weight, bias if bias is not None else weight], template=template, grid=(max(n, 1), 1, 1),
        threadgroup=(256, 1, 1), output_shapes=[(B, L - K + 1, C)], output_dtypes=[x.dtype],
        init_value=init_value)[0]


def write_rows(values: mx.array, slots: mx.array, pool: mx.array) -> mx.array:
    """pool[slots] = values (values in the pool's dtype), in place. Returns a (1,) int32 zero that the
    step's output must depend on (a view of a 4-element output: see build.device_constant)."""
    E = math.prod(pool.shape[1:])
    return _kernel("write_rows")(
        inputs=[values, slots, pool], template=[("P", pool.dtype), ("E", E)], grid=(max(values.shape[0] * E, 1), 1, 1),
        threadgroup=(256, 1, 1), output_shapes=[(4,)], output_dtypes=[mx.int32])[0][:1]


# ---- where the kernels replace mlx-lm's code ----------------------------------------------------

def _gated_delta_ops(original):
    def gated_delta_ops(q, k, v, g, beta, state=None, mask=None):
        if _active and mask is None and state is not None and supports_gated_delta(q, v, g):
            return gated_delta(q, k, v, g, beta, state)
        return original(q, k, v, g, beta, state, mask)

    gated_delta_ops._pagedmlx_original = original
    return gated_delta_ops


class KernelConv1d:
    """Mixed into a state owner's depthwise nn.Conv1d: the kernel inside a paged step's state layer."""

    def __call__(self, x: mx.array) -> mx.array:
        w = self.weight
        if (_active and self.groups == x.shape[-1] == w.shape[0] and w.shape[2] == 1
                and self.padding == 0
                and self.stride == 1 and self.dilation == 1):
            return depthwise_conv1d(x, w, self.get("bias"))
        return super().__call__(x)


@functools.lru_cache(maxsize=None)
def _kernel_class(cls: type) -> type:
    return type(f"Kernel{cls.__name__}", (KernelConv1d, cls), {"__module__": cls.__module__})


def install_kernels(model: nn.Module, owners: list[str]) -> None:
    """The gated delta kernel in mlx-lm's gated_delta module, and the conv kernel in the owners'
    depthwise convolutions (class-swapped, parameters unchanged); both run only while `active`."""
    from mlx_lm.models import gated_delta as mlx_gated_delta

    if not hasattr(mlx_gated_delta.gated_delta_ops, "_pagedmlx_original"):
        mlx_gated_delta.gated_delta_ops = _gated_delta_ops(mlx_gated_delta.gated_delta_ops)
    for name, module in model.named_modules():
        if (isinstance(module, nn.Conv1d) and not isinstance(module, KernelConv1d)
                and any(name.startswith(owner + ".") for owner in owners)):
            module.__class__ = _kernel_class(type(module))
