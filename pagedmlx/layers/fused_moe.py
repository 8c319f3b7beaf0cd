"""MoE layers' quantized experts as one launch a product on CUDA (kernels/fused_moe.py), in place of mlx-lm's
gather_qmm over each (token, expert) pair.

fuse_switch_glus() (the runner, beside flatten_quantized) makes mlx-lm's SwitchGLU modules FusedSwitchGLU. Inside
flat_rows() (the runner's forward) one whose kernel use_fused_moe() turned on groups the step's pairs by expert once
(moe_align) and runs its gate, up and down products through the kernel; anywhere else, or with the kernel off, it is
mlx-lm's SwitchGLU, so mlx-lm's generation on the same model object computes exactly what it did. Steps of fewer than
PAGEDMLX_FUSED_MOE_MIN_TOKENS tokens keep gather_qmm: with a token's k experts only, each pair's own tile costs
less than the kernel's blocks (on an H100, 0.68x at one token, 1.19x faster at 8)."""

from __future__ import annotations

import functools
import logging
from typing import Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchGLU

from pagedmlx import envs
from pagedmlx.kernels import fused_moe
from pagedmlx.layers import quantized_linear
from pagedmlx.runner import check_cache

logger = logging.getLogger("pagedmlx")


class FusedSwitchGLU(SwitchGLU):
    """SwitchGLU whose quantized experts, inside flat_rows(), run the fused MoE kernel where use_fused_moe() turned it
    on (_kernel)."""

    _kernel = False
    _min_tokens = 1  # use_fused_moe sets fused_moe.min_tokens()

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:
        if not (self._kernel and quantized_linear.kernels_on() and x.dtype == self.gate_proj.scales.dtype
                and x.size // x.shape[-1] >= self._min_tokens):
            return super().__call__(x, indices)  # (another dtype: gather_qmm's promotion, not the kernel's cast)
        k = indices.shape[-1]
        x = x.reshape(-1, x.shape[-1])
        pairs = x.shape[0] * k
        b = fused_moe.moe_align(indices.reshape(-1, k), self.gate_proj.num_experts)
        up = _product(self.up_proj, x, b.token_rows, b, pairs)
        gate = _product(self.gate_proj, x, b.token_rows, b, pairs)
        y = _product(self.down_proj, self.activation(up, gate), b.pair_rows, b, pairs)
        return y.reshape(*indices.shape, -1)


def _product(layer: QuantizedSwitchLinear, x: mx.array, rows: mx.array, b: fused_moe.Blocks, pairs: int) -> mx.array:
    return fused_moe.grouped_quantized_gemm(x, layer.weight, layer.scales, layer.biases, rows, b.ids, b.experts,
                                            pairs, layer.bits, layer.group_size)


def fuse_switch_glus(model: nn.Module) -> int:
    """Make the model's SwitchGLU modules FusedSwitchGLU (mlx-lm's computation until use_fused_moe turns a kernel
    on); returns how many."""
    mods = [m for _, m in model.named_modules() if type(m) in (SwitchGLU, FusedSwitchGLU)]
    for m in mods:
        m.__class__ = FusedSwitchGLU
    return len(mods)


def _experts(m: FusedSwitchGLU) -> Optional[list[tuple[int, int, int, int]]]:
    """The (N, K, bits, group_size) of its three products where the kernel takes them all: MLX's affine 4- or 8-bit
    experts with 16-bit scales and no bias."""
    shapes = []
    for p in (m.gate_proj, m.up_proj, m.down_proj):
        if type(p) is not QuantizedSwitchLinear or "biases" not in p or "bias" in p:
            return None
        k = p.weight.shape[-1] * 32 // p.bits
        if not fused_moe.supports(k, p.scales.dtype, p.bits, p.group_size, getattr(p, "mode", "affine")):
            return None
        shapes.append((p.weight.shape[1], k, p.bits, p.group_size))
    return shapes


CHECK_TOP_K = 4  # experts a token takes in the check (the kernel's rows come from moe_align, whatever k is)


def use_fused_moe(setting: Optional[bool], model: nn.Module, kernels_enabled: bool) -> int:
    """EngineConfig.quantized_gemm at load (None: on CUDA), as for the quantized GEMM: the fused MoE kernel on for the
    model's FusedSwitchGLU layers it takes, once its check passes at their widths; returns how many layers take it
    (0: mlx-lm's products)."""
    if not (quantized_linear.wanted(setting, kernels_enabled) and envs.PAGEDMLX_FUSED_MOE):
        return 0
    layers = [(m, shapes) for _, m in model.named_modules() if type(m) is FusedSwitchGLU
              and (shapes := _experts(m)) is not None]
    if not layers:
        return 0
    by_dtype: dict = {}
    for m, shapes in layers:
        by_dtype.setdefault(m.gate_proj.scales.dtype, set()).update(shapes)
    for dtype, shapes in by_dtype.items():  # each skipped where it passed before (runner/check_cache.py)
        checked = sorted(shapes)
        run = functools.partial(fused_moe.check_fused_moe, checked, CHECK_TOP_K, dtype)
        if (why := check_cache.kept("fused_moe", run, checked, CHECK_TOP_K, dtype)) is not None:
            logger.warning("MoE experts left to MLX's gather_qmm (fused MoE kernel): %s", why)
            return 0
    for m, _ in layers:
        m._kernel, m._min_tokens = True, fused_moe.min_tokens()
    routings = {(m.gate_proj.num_experts, k) for m, _ in layers for k in _top_ks(model)}
    fused_moe.prebuild_align(sorted(routings))  # before the first steps
    logger.info("%d MoE layers take the fused MoE kernel (layers/fused_moe.py)", len(layers))
    return len(layers)


def _top_ks(model: nn.Module) -> set[int]:
    """The experts a token takes, where the model's modules or their configs name it (a variant of moe_align for
    another k is compiled when first met)."""
    found = set()
    for _, m in model.named_modules():
        for holder in (m, getattr(m, "config", None), getattr(m, "args", None)):
            for name in ("top_k", "num_experts_per_tok", "top_k_experts"):
                if isinstance(value := getattr(holder, name, None), int) and value > 0:
                    found.add(value)
    return found


def drop_fused_moe(model: nn.Module) -> int:
    """Every MoE layer back to mlx-lm's gather_qmm; 0 (the runner's count)."""
    for _, m in model.named_modules():
        if type(m) is FusedSwitchGLU:
            m._kernel = False
    return 0
