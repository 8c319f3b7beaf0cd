"""The model's load-time check as the runner runs it: a short busy schedule on scratch pages against mlx-lm's own
caches (selfcheck.py), with the runner's own rewrites and kernels giving way, in turn, before the model is refused."""

from __future__ import annotations

import logging
from typing import Optional

from pagedmlx.kernels.check import error_line
from pagedmlx.layers.fused_moe import drop_fused_moe
from pagedmlx.layers.quantized_linear import drop_quantized_gemm
from pagedmlx.layers.skinny_linear import drop_skinny_gemm
from pagedmlx.runner import check_cache
from pagedmlx.runner.kv_budget import out_of_memory
from pagedmlx.runner.plan import UnsupportedModelError, model_type
from pagedmlx.runner.selfcheck import check_paged_forward

logger = logging.getLogger("pagedmlx")


def _check(runner) -> Optional[str]:  # a kernel that fails to build or run counts as a disagreement
    try:
        return check_paged_forward(runner)
    except Exception as exc:  # noqa: BLE001 - MLX raises when a kernel is built or run
        if out_of_memory(exc):  # no kernel's fault: said as it is, not as a model that disagrees
            raise ValueError(f"the model's load-time check ran out of device memory ({exc}): free the memory other "
                             f"processes hold on the device, or serve a smaller model") from exc
        return error_line(exc)


def verify_against_mlx_lm(runner, key: Optional[str] = None) -> None:
    """Run a short busy schedule on scratch pages and compare with mlx-lm's own caches. A split head
    that disagrees gives way to the whole model call before any kernel is blamed (a head that is not
    plain would otherwise switch right kernels off); kernels that still disagree are switched off,
    and the split tried again without them; a model whose pages still disagree is refused. A pass kept under
    `key` (runner/check_cache.py) is not run again."""
    if check_cache.passed(key):
        return logger.info("the model's load-time check passed here before with this setup: not run again")
    err = _check(runner)
    if err is None:
        check_cache.record_pass(key)
    if err is not None and getattr(runner, "fused_moe", 0):  # the newest kernel first (layers/fused_moe.py)
        logger.warning("MoE experts left to MLX's gather_qmm: the paged forward disagrees with them (%s)", err)
        runner.fused_moe = drop_fused_moe(runner.model)
        err = _check(runner)
    if err is not None and runner.skinny:  # our own products give way first (layers/skinny_linear.py)
        logger.warning("few-row products left to MLX's matmul: the paged forward disagrees with them (%s)", err)
        runner.skinny = drop_skinny_gemm(runner.model)
        err = _check(runner)
    if err is not None and runner.quantized_gemm:  # likewise the quantized GEMM (layers/quantized_linear.py)
        logger.warning("quantized products left to MLX's quantized matmul: the paged forward disagrees with them "
                       "(%s)", err)
        runner.quantized_gemm = drop_quantized_gemm(runner.model)
        err = _check(runner)
    if err is not None and runner.fused_norms:  # the fused residual adds give way first (layers/fused_residual.py)
        logger.warning("residual adds not fused with their norms: the paged forward disagrees with them (%s)", err)
        runner.fused_norms = False
        err = _check(runner)
    split = runner._body, runner._head
    if err is not None and runner._head is not None:
        runner._body = runner._head = None
        err = _check(runner)
    if err is not None and runner.kernels.enabled:  # the portable paths may be right
        runner.kernels = runner.kernels.switch_off(f"the model's paged forward disagrees with mlx-lm ({err})")
        if split[1] is not None:
            runner._body, runner._head = split
        err = _check(runner)
        if err is not None and runner._head is not None:
            runner._body = runner._head = None
            err = _check(runner)
    if err is not None:
        raise UnsupportedModelError(
            f"model type {model_type(runner.model)!r} gives different logits on pages than with "
            f"mlx-lm's own cache ({err}); refusing to serve wrong tokens")
