"""Where kernels are built: the GPU backend this process builds for, the one function that turns
rendered source into an MLX kernel (mx.fast.cuda_kernel or mx.fast.metal_kernel), and the small
device constants the launches pass. Every kernel module calls these through this module
(`build.make_kernel`, `build.gpu_backend`), so that a test can stand in for them in one place. CUDA kernels
are kept on disk once compiled (disk_cache.py)."""

from __future__ import annotations

import functools
import hashlib
from typing import Optional

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.kernels.dialect import CUDA, METAL
from pagedmlx.kernels.disk_cache import CachedCudaKernel
from pagedmlx.platform import gpu_backend_name

_BACKENDS = {"CUDA": CUDA, "Metal": METAL}  # platform.gpu_backend_name -> the dialect's name


def gpu_backend() -> Optional[str]:
    """CUDA or METAL where MLX's default device is a GPU of that backend; None elsewhere."""
    return _BACKENDS.get(gpu_backend_name()) if mx.default_device() == mx.gpu else None


def make_kernel(backend: str, name: str, inputs: list[str], outputs: list[str], source: str, header: str,
                shared_memory: int = 0):
    """The one place kernels are built (tests stand in for it). Sources are already rendered; the
    name carries their hash, so no cache keyed by name (MLX's JIT caches) serves an older text.
    shared_memory: the dynamic shared memory (bytes, CUDA) each launch gets."""
    name = f"{name}_{hashlib.sha1((header + source).encode()).hexdigest()[:10]}"
    if backend == CUDA:
        kernel = mx.fast.cuda_kernel(name, inputs, outputs, source, header=header, shared_memory=shared_memory)
        if not envs.MLX_PTX_CACHE_DIR:  # no folder MLX reads modules from: nothing to keep
            return kernel
        return CachedCudaKernel(kernel, name, inputs, outputs, source, header)
    return mx.fast.metal_kernel(name, inputs, outputs, source, header=header)


@functools.lru_cache(maxsize=None)
def device_constant(value: float, dtype: mx.Dtype) -> mx.array:
    """A device constant, made once: a host-made array per layer call would cost an upload each.
    Padded past 8 bytes: MLX's CUDA allocator pools arrays of <= 8 bytes in managed pages that
    the host writes small arrays into too."""
    return mx.full((4,), value, dtype)
