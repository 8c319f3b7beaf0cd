"""NVRTC through ctypes, set up as MLX's CUDA JIT sets it up (mlx/backend/cuda/jit_module.cpp, 0.32): the same
options (--device-as-default-execution-space, --gpu-architecture=sm_XY with an 'a' from compute capability 9 on,
MLX's include folder, its CCCL folder, the CUDA headers) and the device header the rendered sources include.

MLX does not read that header from disk: nvrtcCreateProgram gets MLX's own copies of its device headers, built
into libmlx, under names such as "mlx/backend/cuda/device/utils.cuh", and the wheel has no such file. Those copies
are out of pagedmlx's reach, so a rendered source is compiled with UTILS_CUH under that name instead: what the
signature MLX renders needs (the 16-bit float types, Shape, Strides) and nothing more; pagedmlx's kernel bodies use
none of MLX's device helpers. Shape and Strides are kernel parameters passed by value, so they are spelled as
MLX spells them, with MAX_NDIM from MLX's own config.h (in the wheel's include folder): the parameters of a module
built here have the layout MLX launches it with.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Optional, Sequence

import mlx.core as mx

from pagedmlx import envs

UTILS_NAME = "mlx/backend/cuda/device/utils.cuh"
UTILS_CUH = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}  // namespace mlx::core::cu
"""


def device_arch() -> str:
    """MLX's target for this process's GPU: sm_90a on an H100 (cuda_kernel's SASS, compute capability 9+ 'a')."""
    info = mx.device_info()
    major, minor = int(info["compute_capability_major"]), int(info["compute_capability_minor"])
    return f"sm_{major}{minor}{'a' if major >= 9 else ''}"


def include_paths() -> list[str]:
    """MLX's include_path_args: site-packages/mlx/include, its cccl folder, then the CUDA headers of the nvidia
    wheel, else of $CUDA_HOME (or /usr/local/cuda). A toolkit's own cccl folder stands in where MLX's is absent."""
    include = Path(mx.__file__).resolve().parent / "include"
    cuda = include.parent.parent / "nvidia" / "cu13" / "include"
    if not cuda.exists():
        cuda = Path(envs.CUDA_HOME or "/usr/local/cuda") / "include"
    cccl = include / "cccl" if (include / "cccl").exists() else cuda / "cccl"
    return [str(p) for p in (include, cccl, cuda) if p.exists()]


def load_library() -> ctypes.CDLL:
    """libnvrtc: the one MLX loaded, else the nvidia wheel's."""
    wheel = Path(mx.__file__).resolve().parent.parent / "nvidia" / "cu13" / "lib" / "libnvrtc.so.13"
    for name in ("libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so", str(wheel)):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise OSError("libnvrtc not found")


class NVRTC:
    def __init__(self, arch: str, includes: Optional[Sequence[str]] = None, lib: Optional[ctypes.CDLL] = None):
        self.arch, self.lib = arch, lib or load_library()
        self.options = [b"--device-as-default-execution-space", f"--gpu-architecture={arch}".encode(),
                        *(f"--include-path={p}".encode() for p in (include_paths() if includes is None else includes))]

    def compile(self, source: str, module_name: str, kernel_name: str) -> tuple[bytes, str]:
        """(cubin, lowered name of kernel_name)."""
        lib, prog = self.lib, ctypes.c_void_p()
        headers = (ctypes.c_char_p * 1)(UTILS_CUH.encode())
        names = (ctypes.c_char_p * 1)(UTILS_NAME.encode())
        self._ok(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{module_name}.cu".encode(), 1,
                                        headers, names), "nvrtcCreateProgram")
        try:
            self._ok(lib.nvrtcAddNameExpression(prog, kernel_name.encode()), "nvrtcAddNameExpression")
            opts = (ctypes.c_char_p * len(self.options))(*self.options)
            if lib.nvrtcCompileProgram(prog, len(self.options), opts) != 0:
                size = ctypes.c_size_t()
                lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
                log = ctypes.create_string_buffer(size.value + 1)
                lib.nvrtcGetProgramLog(prog, log)
                raise RuntimeError(f"NVRTC could not compile {module_name}: {log.value.decode(errors='replace')}")
            lowered = ctypes.c_char_p()
            self._ok(lib.nvrtcGetLoweredName(prog, kernel_name.encode(), ctypes.byref(lowered)), "nvrtcGetLoweredName")
            mangled = lowered.value.decode()
            size = ctypes.c_size_t()
            self._ok(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize")
            cubin = ctypes.create_string_buffer(size.value)
            self._ok(lib.nvrtcGetCUBIN(prog, cubin), "nvrtcGetCUBIN")
            return cubin.raw, mangled
        finally:
            lib.nvrtcDestroyProgram(ctypes.byref(prog))

    @staticmethod
    def _ok(code: int, what: str) -> None:
        if code != 0:
            raise RuntimeError(f"{what} failed ({code})")
