"""Run the recurrent-state CUDA kernels' bodies on the CPU, against MLX's own ops: a check of their
index math and numerics that needs no GPU (the GPU check is scripts/gpu/gpu_check_state.py).

Each body is wrapped as MLX wraps it (scripts/gpu/check_cuda_sources.py) and compiled by g++ as host code:
a C++ thread per CUDA thread of a block, a block at a time; warp shuffles go through a per-warp
barrier, so warp-synchronous code runs as written. Outputs start as NaN, so an element a kernel never
writes fails. Needs g++ (C++20) and the CUDA headers (cuda_bf16.h) under $CUDA_HOME or /usr/local/cuda.

    python scripts/gpu/emulate_state_kernels.py
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.kernels.sources import recurrent_state_cuda as src  # noqa: E402
from scripts.gpu.check_cuda_sources import CUDA_TYPES, build  # noqa: E402

HOST = """
#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <limits>
#include <thread>
#include <vector>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define __global__
#define __grid_constant__
struct Dim { unsigned x = 0, y = 0, z = 0; };
thread_local Dim threadIdx, blockIdx;
Dim blockDim, gridDim;
struct Warp { std::barrier<> bar{32}; float buf[32]; };
thread_local Warp* warp_ = nullptr;
thread_local int lane_ = 0;
float __shfl_xor_sync(unsigned, float v, int o) {
    warp_->buf[lane_] = v;
    warp_->bar.arrive_and_wait();
    float r = warp_->buf[lane_ ^ o];
    warp_->bar.arrive_and_wait();
    return r;
}
namespace mlx::core::cu {
using Shape = std::array<int32_t, 8>;
}
namespace cooperative_groups {}
"""

LAUNCH = """
template <typename F> void launch(Dim grid, Dim block, F kernel) {
    gridDim = grid; blockDim = block;
    const unsigned n = block.x * block.y * block.z;
    for (unsigned bz = 0; bz < grid.z; ++bz) for (unsigned by = 0; by < grid.y; ++by) for (unsigned bx = 0; bx < grid.x; ++bx) {
        std::vector<Warp> warps((n + 31) / 32);
        std::vector<std::thread> threads;
        for (unsigned t = 0; t < n; ++t) threads.emplace_back([&, t] {
            threadIdx = {t % block.x, (t / block.x) % block.y, t / (block.x * block.y)};
            blockIdx = {bx, by, bz};
            warp_ = &warps[t / 32];
            lane_ = t % 32;
            kernel();
        });
        for (auto& th : threads) th.join();
    }
}
template <typename T> std::vector<T> load(const char* path, size_t n) {
    std::vector<T> v(n);
    FILE* f = fopen(path, "rb"); fread(v.data(), sizeof(T), n, f); fclose(f);
    return v;
}
template <typename T> void save(const char* path, const std::vector<T>& v) {
    FILE* f = fopen(path, "wb"); fwrite(v.data(), sizeof(T), v.size(), f); fclose(f);
}
"""


def _raw(a: mx.array) -> np.ndarray:
    return np.array(a.view(mx.uint16) if a.dtype in (mx.bfloat16, mx.float16) else a)


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


def run(name: str, body: str, inputs: dict[str, mx.array], outputs: dict[str, tuple[tuple, mx.Dtype]],
        template: list, grid: tuple, block: tuple, tmp: Path, readback: tuple[str, ...] = ()) -> dict[str, mx.array]:
    """Emulate one launch (grid counts threads, as in mx.fast.cuda_kernel); `readback`: inputs the
    kernel writes in place, returned too."""
    kernel = build(name, [(k, _dtype_name(v)) for k, v in inputs.items()],
                   [(k, str(dt).split(".")[-1]) for k, (_, dt) in outputs.items()], template, body)
    kernel = kernel[kernel.index("namespace mlx::core::cu {\n\nnamespace cg"):]
    lines = ["int main() {", "    using namespace mlx::core::cu;"]
    args = []
    for k, v in inputs.items():
        _raw(v).tofile(tmp / f"{k}.bin")
        lines.append(f"    auto {k} = load<{CUDA_TYPES[_dtype_name(v)]}>(\"{tmp / k}.bin\", {v.size});")
        args.append(f"{k}.data()")
        if f"{k}_shape" in body:
            lines.append(f"    Shape {k}_shape{{{', '.join(map(str, v.shape))}}};")
            args.append(f"{k}_shape")
    for k, (shape, dt) in outputs.items():
        t = CUDA_TYPES[str(dt).split(".")[-1]]
        fill = "std::numeric_limits<float>::quiet_NaN()" if dt != mx.int32 else "-7"
        lines.append(f"    std::vector<{t}> {k}({int(np.prod(shape))}, static_cast<{t}>({fill}));")
        args.append(f"{k}.data()")
    blocks = [-(-g // b) for g, b in zip(grid, block)]
    lines.append(f"    launch(Dim{{{blocks[0]}, {blocks[1]}, {blocks[2]}}}, Dim{{{block[0]}, {block[1]}, {block[2]}}}, "
                 f"[&] {{ custom_kernel_{name}({', '.join(args)}); }});")
    lines += [f"    save(\"{tmp / k}.out\", {k});" for k in (*outputs, *readback)] + ["}"]
    cpp = tmp / f"{name}.cpp"
    cpp.write_text(HOST + kernel + LAUNCH + "\n".join(lines) + "\n")
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    subprocess.run(["g++", "-std=c++20", "-O1", "-pthread", "-w", f"-I{cuda}/include", str(cpp), "-o", str(cpp) + ".x"],
                   check=True)
    subprocess.run([str(cpp) + ".x"], check=True)
    out = {}
    for k, (shape, dt) in {**outputs, **{k: (inputs[k].shape, inputs[k].dtype) for k in readback}}.items():
        np_dt = {mx.float32: np.float32, mx.int32: np.int32}.get(dt, np.uint16)
        a = mx.array(np.fromfile(tmp / f"{k}.out", np_dt).reshape(shape))
        out[k] = a.view(dt) if np_dt is np.uint16 else a
    return out


def check_gated_delta(tmp: Path, dtype: mx.Dtype, B: int, T: int, Hk: int, Hv: int, Dk: int, Dv: int, vec: bool) -> float:
    from mlx_lm.models.gated_delta import gated_delta_ops

    mx.random.seed(0)
    q, k = (mx.random.normal((B, T, Hk, Dk)).astype(dtype) * 0.3 for _ in range(2))
    v = mx.random.normal((B, T, Hv, Dv)).astype(dtype)
    g = mx.random.uniform(0.5, 1.0, (B, T, Hv, Dk) if vec else (B, T, Hv))
    beta = mx.random.uniform(0, 1, (B, T, Hv)).astype(dtype)
    state = mx.random.normal((B, Hv, Dv, Dk)) * 0.1
    want_y, want_s = gated_delta_ops(q, k, v, g, beta, state)
    template = [("InT", _dtype_name(q)), ("GT", "float32"), ("StT", "float32"), ("Dk", Dk), ("Dv", Dv), ("Hk", Hk),
                ("Hv", Hv), ("VEC_G", vec)]
    got = run("pagedmlx_gated_delta", src.GATED_DELTA, dict(q=q, k=k, v=v, g=g, beta=beta, state_in=state),
              dict(y=((B, T, Hv, Dv), dtype), state_out=((B, Hv, Dv, Dk), mx.float32)), template,
              (32, Dv, B * Hv), (32, 4, 1), tmp)
    return max(_rel(got["y"], want_y), _rel(got["state_out"], want_s))


def check_conv(tmp: Path, dtype: mx.Dtype, bias: bool) -> float:
    import mlx.nn as nn

    mx.random.seed(1)
    C, K = 40, 4
    conv = nn.Conv1d(C, C, K, groups=C, bias=bias)
    conv.set_dtype(dtype)
    x = mx.random.normal((3, 9, C)).astype(dtype)
    want = conv(x)
    inputs = dict(x=x, weight=conv.weight, bias=conv.bias if bias else conv.weight)
    got = run("pagedmlx_depthwise_conv", src.DEPTHWISE_CONV, inputs, dict(out=(want.shape, dtype)),
              [("InT", _dtype_name(x)), ("K", K), ("HAS_BIAS", bias)], (want.size, 1, 1), (256, 1, 1), tmp)
    return _rel(got["out"], want)


def check_write_rows(tmp: Path, dtype: mx.Dtype) -> float:
    pool = mx.random.normal((6, 3, 5)).astype(dtype)
    values = mx.random.normal((3, 3, 5)).astype(dtype)
    slots = mx.array([4, -1, 1], mx.int32)
    got = run("pagedmlx_write_rows", src.WRITE_ROWS, dict(values=values, slots=slots, pool=pool),
              dict(written=((4,), mx.int32)), [("P", _dtype_name(pool)), ("E", 15)], (45, 1, 1), (256, 1, 1), tmp,
              readback=("pool",))
    want = mx.array(pool)
    want[mx.array([4, 1])] = values[mx.array([0, 2])]
    return _rel(got["pool"], want) if got["written"][0].item() == 0 else float("inf")


def _rel(got: mx.array, want: mx.array) -> float:
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    if mx.isnan(got).any().item():
        return float("inf")
    return (mx.abs(got - want).max() / (mx.abs(want).max() + 1e-6)).item()


TOL = {mx.float32: 1e-5, mx.bfloat16: 2e-2, mx.float16: 2e-3}


def main() -> int:
    failed = 0
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        cases = [(f"gated_delta {dt} B={B} T={T} Hk={Hk} Hv={Hv} Dk={Dk} Dv={Dv} vec={vec}", dt,
                  lambda dt=dt, a=(B, T, Hk, Hv, Dk, Dv, vec): check_gated_delta(tmp, dt, *a))
                 for dt in (mx.float32, mx.bfloat16)
                 for B, T, Hk, Hv, Dk, Dv, vec in ((3, 1, 2, 4, 32, 8, False), (1, 6, 1, 2, 64, 12, True),
                                                   (2, 3, 2, 2, 32, 5, False))]
        cases += [(f"depthwise_conv {dt} bias={b}", dt, lambda dt=dt, b=b: check_conv(tmp, dt, b))
                  for dt in (mx.float32, mx.bfloat16) for b in (True, False)]
        cases += [(f"write_rows {dt}", dt, lambda dt=dt: check_write_rows(tmp, dt)) for dt in (mx.float32, mx.float16)]
        for label, dt, fn in cases:
            err = fn()
            ok = err <= TOL[dt]
            failed += not ok
            print(f"{'PASS' if ok else 'FAIL'} {label}: max relative error {err:.2e}")
    print(f"{failed} failed" if failed else "all equal within tolerance")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
