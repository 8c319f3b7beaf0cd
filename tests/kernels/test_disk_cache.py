"""The kernel disk cache (kernels/disk_cache.py): the module names MLX gives custom kernels, the source it
renders for them, and files written where MLX reads them. On a CUDA GPU, the rendered source is checked
against the one MLX prints for the same call, and a written module is what the next call loads."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import pytest

from pagedmlx.kernels import build, disk_cache
from pagedmlx.kernels.dialect import CUDA

ON_CUDA = build.gpu_backend() == CUDA

STD_HASH_CPP = r"""
#include <functional>
#include <iostream>
#include <string>
int main() {
  std::string line, all;
  while (std::getline(std::cin, line)) {
    std::cout << std::hex << std::hash<std::string>{}(line) << "\n";
  }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ builds libstdc++'s std::hash")
def test_std_hash_is_libstdcxx(tmp_path):
    src, exe = tmp_path / "h.cpp", tmp_path / "h"
    src.write_text(STD_HASH_CPP)
    subprocess.run(["g++", "-O1", "-o", str(exe), str(src)], check=True)
    texts = ["", "a", "abcdefg", "abcdefgh", "abcdefghi", "custom_kernel_x" * 37, "ü UTF-8 ✓ bytes"]
    out = subprocess.run([str(exe)], input="\n".join(texts) + "\n", capture_output=True, text=True, check=True)
    assert out.stdout.split() == [f"{disk_cache.std_hash(t):x}" for t in texts]


def test_render_declares_what_mlx_declares():
    body = "const int n = block_table_shape[1];\n  out[0] = x[0] * n;"
    text = disk_cache.render("custom_kernel_k_4_t_float", "// header\n", body, ["x", "block_table", "s"],
                             [(mx.float16, 2), (mx.int32, 2), (mx.float32, 0)], ["out"], [mx.bfloat16],
                             [("N", 4), ("FLAG", True), ("T", mx.float32)])
    assert text.startswith('\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
                           "// header\nnamespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n")
    assert ("__global__ void custom_kernel_k_4_t_float(\n    const __half* x,\n    const int32_t* block_table,\n"
            "    const __grid_constant__ Shape block_table_shape,\n    const float* s,\n"
            "    __nv_bfloat16* out) {\n  constexpr int N = 4;\n  constexpr bool FLAG = true;\n"
            "  using T = float;\n\n" + body + "\n}\n\n} // namespace mlx::core::cu\n") in text
    assert disk_cache.template_hash([("N", 4), ("FLAG", True), ("T", mx.bfloat16)]) == "_4_t_bfloat16_t"


def test_long_module_names_become_folders_as_mlx_splits_them(tmp_path):
    name = "m" * 600
    assert disk_cache.ptx_path(tmp_path, name) == tmp_path / ("m" * 245) / ("m" * 245) / ("m" * 110 + ".ptx")
    assert disk_cache.ptx_path(tmp_path, "short") == tmp_path / "short.ptx"


class FakeNVRTC:
    def __init__(self):
        self.sources = []

    def compile(self, source, module_name, kernel_name):
        self.sources.append(source)
        return b"\x7fELF cubin", "_ZN3mlx4core2cu" + kernel_name.rsplit(":", 1)[-1]


def test_a_module_is_written_once_with_its_kernel_name(tmp_path, monkeypatch):
    fake = FakeNVRTC()
    monkeypatch.setattr(disk_cache, "_compiler", lambda: fake)
    monkeypatch.setattr(disk_cache, "stats", {"found": 0, "compiled": 0})
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert disk_cache.stats_line() is None
    assert disk_cache.write_module(tmp_path, "mod_1f", "mlx::core::cu::custom_kernel_k", "src")
    assert (tmp_path / "mod_1f.ptx").read_bytes() == b"\x7fELF cubin"
    assert (tmp_path / "mod_1f.txt").read_text() == "mlx::core::cu::custom_kernel_k\t_ZN3mlx4core2cucustom_kernel_k\n"
    assert not disk_cache.write_module(tmp_path, "mod_1f", "mlx::core::cu::custom_kernel_k", "src")
    assert fake.sources == ["src"] and sorted(p.name for p in tmp_path.iterdir()) == ["mod_1f.ptx", "mod_1f.txt"]
    assert disk_cache.stats_line() == f"kernel cache {tmp_path}: 1 kernel variants loaded, 1 compiled and kept"


def test_each_variant_is_seeded_once_under_mlxs_module_name(tmp_path, monkeypatch):
    fake, calls = FakeNVRTC(), []
    monkeypatch.setattr(disk_cache, "_compiler", lambda: fake)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    kernel = disk_cache.CachedCudaKernel(lambda **kw: calls.append(kw), "k_abc", ["x"], ["y"], "y[0] = x[0];", "")
    for _ in range(3):
        kernel(inputs=[mx.zeros((4,))], output_dtypes=[mx.float32], output_shapes=[(4,)], template=[("N", 2)],
               grid=(1, 1, 1), threadgroup=(1, 1, 1))
    kernel(inputs=[mx.zeros((4,), mx.float16)], output_dtypes=[mx.float32], output_shapes=[(4,)],
           template=[("N", 2)], grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert len(calls) == 4 and len(fake.sources) == 2  # two variants: float32 and float16 inputs
    names = sorted(p.stem for p in tmp_path.glob("*.ptx"))
    assert names == sorted(f"custom_kernel_k_abc_2_{disk_cache.std_hash(s):x}" for s in fake.sources)


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="a CUDA GPU runs MLX's own kernel build")
def test_the_rendered_source_is_the_one_mlx_builds_and_a_kept_module_is_loaded():
    header = "template <typename T> __device__ T twice(T v) { return v + v; }\n"
    body = "  uint i = threadIdx.x;\n  if (i < x_shape[0]) y[i] = twice(x[i]) + (T)N;"
    name = f"pagedmlx_cache_probe_{os.getpid()}"
    template = [("N", 3), ("T", mx.float32)]
    x = mx.arange(8, dtype=mx.float32)
    call = dict(inputs=[x], output_shapes=[(8,)], output_dtypes=[mx.float32], grid=(8, 1, 1), threadgroup=(8, 1, 1))
    mlx_kernel = mx.fast.cuda_kernel(name, ["x"], ["y"], body, header=header)
    printed = _stdout_of(lambda: mx.eval(mlx_kernel(**call, template=template, verbose=True)))
    func = "custom_kernel_" + name + disk_cache.template_hash(template)
    mine = disk_cache.render(func, header, body, ["x"], [(mx.float32, 1)], ["y"], [mx.float32], template)
    assert mine in printed
    # NVRTC, as set up here, compiles that text into a cubin, and names the kernel as MLX looks it up.
    with tempfile.TemporaryDirectory() as d:
        module = f"{func}_{disk_cache.std_hash(mine):x}"
        assert disk_cache.write_module(Path(d), module, "mlx::core::cu::" + func, mine)
        assert (Path(d) / f"{module}.ptx").read_bytes()[:4] == b"\x7fELF"
        assert (Path(d) / f"{module}.txt").read_text().startswith(f"mlx::core::cu::{func}\t_Z")
    out = disk_cache.CachedCudaKernel(mlx_kernel, name, ["x"], ["y"], body, header)(**call, template=template)[0]
    assert out.tolist() == [2 * i + 3 for i in range(8)]


def _stdout_of(fn) -> str:
    """What fn prints on the process's stdout (MLX prints from C++)."""
    with tempfile.TemporaryFile(mode="w+") as f, contextlib.ExitStack():
        saved = os.dup(1)
        os.dup2(f.fileno(), 1)
        try:
            fn()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        f.seek(0)
        return f.read()
