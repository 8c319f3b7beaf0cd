"""nvcc compiles the CUDA kernels as MLX's CUDA backend would build them, without a GPU.

A kernel call made through pagedmlx's own launch code (kernels/*.py) with build.make_kernel standing in
as RecordingCudaKernel records the source MLX's build_kernel makes for that call (the kernel emulator's
cuda_source: MLX's default header, one __global__ function taking each input's pointer, its shape where
the body names it, each output's pointer, the template arguments as constexpr / using lines;
mlx/backend/cuda/custom_kernel.cpp, 0.32) and returns zeros. compile_sources() then compiles every
recorded source in one translation unit, each in a namespace of its own, for the H200 (sm_90): a syntax
or type error, a warning or a register spill shows here, not on the GPU machine.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
from kernel_emulator import cuda_source

# What MLX's default header gives a body (mlx/backend/cuda/device/utils.cuh, reduced to what kernels
# see: the 16-bit float types, cuda::std, Shape / Strides, cooperative groups, inf).
MLX_HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}
using mlx::core::cu::Shape;  // for the kernels below, each in a namespace of its own
#define inf cuda::std::numeric_limits<float>::infinity()
"""


def have_nvcc() -> bool:
    return shutil.which("nvcc") is not None


class RecordingCudaKernel:
    """Stands in for build.make_kernel: records the CUDA source of each call (sources: (label, text))."""

    sources: list[tuple[str, str]] = []
    label = ""  # the case being recorded, set by the caller

    def __init__(self, backend: str, name: str, input_names, output_names, source: str, header: str,
                 shared_memory: int = 0):
        assert backend == "cuda", backend
        self.name, self.input_names, self.output_names = name, list(input_names), list(output_names)
        self.source, self.header = source, header

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None,
                 verbose=False):
        text = cuda_source(self.name, self.input_names, self.output_names, self.source, self.header, inputs,
                           template, output_dtypes)
        RecordingCudaKernel.sources.append((f"{RecordingCudaKernel.label} {self.name}", text))
        return [mx.zeros(s, dt) for s, dt in zip(output_shapes, output_dtypes)]


def compile_sources(sources: list[tuple[str, str]], arch: str = "sm_90") -> tuple[list[str], str]:
    """Compile every (label, source) in one translation unit. Returns (failures, ptxas's report):
    a failure is a compile error or warning (all labels then), or a kernel that spills registers."""
    unit = MLX_HEADER + "".join(f"\nnamespace case{i} {{\n{text}\n}}  // namespace case{i}\n"
                                for i, (_, text) in enumerate(sources))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "kernels.cu"
        path.write_text(unit)
        r = subprocess.run(["nvcc", "-std=c++17", f"-arch={arch}", "-Xptxas", "-v", "-c", str(path),
                            "-o", str(path) + ".o"], capture_output=True, text=True)
    if r.returncode or "warning" in r.stderr:
        return [f"nvcc: {r.stderr[:6000]}"], r.stderr
    failures = []
    # ptxas -v: per entry function "Compiling entry function '_ZN5case3...'", then its properties.
    for entry in re.split(r"ptxas info\s*: Compiling entry function ", r.stderr)[1:]:
        case = _case(entry)
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", entry)
        if case is not None and spill and (int(spill.group(1)) or int(spill.group(2))):
            failures.append(f"{sources[case][0]}: {spill.group(0)}")
    return failures, r.stderr


def _case(entry: str) -> "int | None":
    """The case number of a mangled entry name: _ZN6case263mlx... is namespace case26 (its name's length, 6,
    comes first; the digits after it belong to the next name's length)."""
    m = re.search(r"_ZN(\d+)case(\d+)", entry)
    if not m:
        return None
    return int(m.group(2)[:int(m.group(1)) - len("case")])
