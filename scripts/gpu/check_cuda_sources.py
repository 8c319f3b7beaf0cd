"""Compile the CUDA-only kernels (recurrent state, paged prefill) with nvcc, without a GPU: each mx.fast.cuda_kernel body is
wrapped the way MLX's CUDA backend wraps it (mlx/backend/cuda/custom_kernel.cpp, build_kernel: the
default header, one __global__ function taking each input's pointer, its shape where the body names
it, and each output's pointer, the template arguments as constexpr / using lines), for the dtypes and
template values the engine uses. A syntax or type error then shows here, not on the GPU machine.

    python scripts/gpu/check_cuda_sources.py [--arch sm_90] [--keep DIR] [--only prefill] [--registers]

--registers prints ptxas's registers, shared memory and spills per kernel (a spill is a failure).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels import prefill_attention  # noqa: E402
from pagedmlx.kernels.sources import recurrent_state_cuda as src  # noqa: E402

# What MLX's default header provides to a body (mlx/backend/cuda/device/utils.cuh, reduced to what is
# visible to kernels: the 16-bit float types, cuda::std, Shape / Strides, cooperative groups, inf).
HEADER = """
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cooperative_groups.h>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, 8>;
using Strides = cuda::std::array<int64_t, 8>;
}
#define inf cuda::std::numeric_limits<float>::infinity()
"""
CUDA_TYPES = {"float32": "float", "float16": "__half", "bfloat16": "__nv_bfloat16", "int32": "int32_t"}


def build(name: str, inputs: list[tuple[str, str]], outputs: list[tuple[str, str]], template: list, body: str) -> str:
    """MLX's build_kernel for inputs (name, dtype) of rank > 0, outputs (name, dtype) and template
    arguments (name, value: an int, a bool, or a dtype name)."""
    params = []
    for arg, dtype in inputs:
        params.append(f"    const {CUDA_TYPES[dtype]}* {arg}")
        if f"{arg}_shape" in body:
            params.append(f"    const __grid_constant__ Shape {arg}_shape")
    params += [f"    {CUDA_TYPES[dtype]}* {arg}" for arg, dtype in outputs]
    lines = []
    for arg, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {arg} = {str(value).lower()};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {arg} = {value};")
        else:
            lines.append(f"  using {arg} = {CUDA_TYPES[value]};")
    return (HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void custom_kernel_{name}(\n" + ",\n".join(params) + ") {\n" + "\n".join(lines)
            + "\n" + body + "\n}\n\n} // namespace mlx::core::cu\n")


def cases():
    """(label, source) for the templates the engine instantiates: model dtypes, Qwen3.5 / Qwen3-Next
    head sizes, both gate kinds, a bias or not."""
    for dt in ("float32", "bfloat16", "float16"):
        for dk, vec in ((128, False), (64, True), (32, False), (256, False)):
            g = "float32"
            yield f"gated_delta {dt} Dk={dk} vec_g={vec}", build(
                "pagedmlx_gated_delta", [("q", dt), ("k", dt), ("v", dt), ("g", g), ("beta", dt), ("state_in", "float32")],
                [("y", dt), ("state_out", "float32")],
                [("InT", dt), ("GT", g), ("StT", "float32"), ("Dk", dk), ("Dv", 128), ("Hk", 16), ("Hv", 48),
                 ("VEC_G", vec)], src.GATED_DELTA)
        for bias in (True, False):
            yield f"depthwise_conv {dt} bias={bias}", build(
                "pagedmlx_depthwise_conv", [("x", dt), ("weight", dt), ("bias", dt)], [("out", dt)],
                [("InT", dt), ("K", 4), ("HAS_BIAS", bias)], src.DEPTHWISE_CONV)
        yield f"write_rows {dt}", build("pagedmlx_write_rows", [("values", dt), ("slots", "int32"), ("pool", dt)],
                                        [("written", "int32")], [("P", dt), ("E", 48 * 128 * 128)], src.WRITE_ROWS)
    yield from prefill_cases()


def prefill_cases():
    """The paged prefill kernels for each head_dim they take, GQA groups of 1..8, window and sinks."""
    sources = prefill_attention.prefill_sources()
    inputs = [("k_pages", None), ("v_pages", None), ("block_table", "int32"), ("segs", "int32"),
              ("tiles", "int32"), ("split_tokens", "int32"), ("scale", "float32"), ("sinks", "float32"),
              ("written", "int32")]
    outputs = {"single": lambda dt: [("out", dt)],
               "split": lambda dt: [("part_acc", "float32"), ("part_m", "float32"), ("part_l", "float32")]}
    for dt in ("bfloat16", "float16"):
        for d in prefill_attention.PREFILL_HEAD_DIMS:
            for g, window, sinks in ((1, 0, 0), (4, 0, 0), (7, 0, 0), (8, 4096, 1)):
                for kind in ("single", "split"):
                    body, header = sources[kind]
                    ins = [("q", dt)] + [(a, t or dt) for a, t in inputs]
                    yield f"prefill {kind} {dt} D={d} G={g} window={window} sinks={sinks}", HEADER + header + build(
                        "pagedmlx_paged_prefill", ins, outputs[kind](dt),
                        [("T", dt), ("D", d), ("G", g), ("BS", 16), ("WINDOW", window)]
                        + ([("SINKS", sinks)] if kind == "single" else []),
                        body).replace(HEADER, "", 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", default="sm_90", help="nvcc -arch (the H200: sm_90)")
    parser.add_argument("--keep", help="write the .cu files here")
    parser.add_argument("--only", help="the cases whose label starts with this")
    parser.add_argument("--registers", action="store_true", help="print ptxas's register and spill report")
    args = parser.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.keep or tmp)
        out.mkdir(parents=True, exist_ok=True)
        for i, (label, source) in enumerate(cases()):
            if args.only and not label.startswith(args.only):
                continue
            path = out / f"kernel{i}.cu"
            path.write_text(source)
            r = subprocess.run(["nvcc", "-std=c++17", f"-arch={args.arch}", "-Xptxas", "-v", "-c", str(path),
                                "-o", str(path) + ".o"], capture_output=True, text=True)
            report = [line.split(":", 1)[1].strip() for line in r.stderr.splitlines() if "Used" in line]
            spills = [line for line in r.stderr.splitlines() if "spill" in line and " 0 bytes spill stores" not in line]
            ok = r.returncode == 0 and "warning" not in r.stderr and not spills
            failed += not ok
            detail = f" ({'; '.join(report)})" if args.registers and report else ""
            print(f"{'PASS' if ok else 'FAIL'} {label}{detail}" + ("" if ok else f"\n{r.stderr}"))
    print(f"{failed} failed" if failed else "all compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
