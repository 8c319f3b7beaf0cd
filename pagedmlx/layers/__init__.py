"""Weight rewrites beside the forward: stock mlx-lm modules swapped at load for merged projections
(merged_linear.py), the few-row GEMM (skinny_linear.py) and fused residual adds (fused_residual.py).
Each keeps the model's own weights and falls back to the stock module where it cannot take a layer."""

from pagedmlx.platform import import_mlx_lm

import_mlx_lm()  # before any module of this package imports mlx-lm
