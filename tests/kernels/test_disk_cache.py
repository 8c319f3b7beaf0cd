"""The kernel disk cache (kernels/disk_cache.py): the module names MLX gives custom kernels, the source it
renders for them, and files written where MLX reads them. Where NVRTC and the CUDA headers are found (no GPU
needed), rendered sources compile with nvrtc.py's header: a probe, and the variants a Llama-8B start meets (slow).
On a CUDA GPU, the rendered source is checked against the one MLX prints for the same call, and a process
loads the module written under its name and computes with it."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import mlx.core as mx
import pytest

from pagedmlx.kernels import (add_rms_norm, build, compile_workers, decode_attention, disk_cache, nvrtc,
                              page_write, prefill_attention, quantized_gemm, selector, skinny_gemm)
from pagedmlx.kernels.dialect import CUDA
from kernel_cache_utils import FakeNVRTC, fake_compile_workers

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


def test_the_paged_kernels_checks_have_their_variants_compiled_at_once_before_they_run(tmp_path, monkeypatch):
    """The load-time checks' kernel variants (prefill, decode split and unsplit, the page write) are named by a dry
    pass that launches nothing, compiled by worker processes at once, and then found on disk by the checks' own
    launches: none is compiled one at a time as it is met. The dry pass decides nothing (it records no pass)."""
    launched = []
    fake, calls = fake_compile_workers(monkeypatch, tmp_path)

    def launch(output_shapes, output_dtypes, **kw):
        launched.append(kw["template"])
        return [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes)]

    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda *a, **kw: launch, raising=False)
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    recorded = []
    monkeypatch.setattr(selector.check_cache, "record_pass", recorded.append)
    for cache in KERNEL_CACHES:
        cache.cache_clear()
    run = functools.partial(selector.select_kernels, [(8, 128, 128, mx.bfloat16)], [32], 16, windows=(None, 512))
    try:
        disk_cache.prebuild_met(run)
        given = [names for names, _, _ in calls]
        assert launched == [] and recorded == [] and len(given) == 1 and len(given[0]) == 10  # two windows
        plan = run()
    finally:
        for cache in KERNEL_CACHES:
            cache.cache_clear()
    kinds = {re.sub(r"_[0-9a-f]{10}_.*", "", name.removeprefix("custom_kernel_pagedmlx_")) for name in given[0]}
    assert kinds == {"paged_prefill", "paged_prefill_split", "paged_decode_mma", "paged_decode_mma_split",
                     "paged_decode_merge", "reshape_and_cache"}  # split launches too: the dry pass's checks go on
    # The real checks (these zeros fail the first) load what the workers compiled, and compile nothing themselves.
    assert not plan.decode and recorded == [] and launched
    assert sorted(p.stem for p in tmp_path.glob("*.ptx")) == given[0] and len(fake.sources) == len(given[0])
    assert disk_cache.stats == {"found": 0, "compiled": len(given[0])}


def test_a_dry_pass_is_its_threads_own_and_ends_even_when_its_run_fails(tmp_path, monkeypatch):
    """Another thread's kernels (an engine serving in the same process) launch as ever during a dry pass, and a run
    that raises ends the dry pass (logged, not raised: the real run reports what is wrong)."""
    launched = []
    monkeypatch.setattr(disk_cache, "_compiler", FakeNVRTC)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    kernel = disk_cache.CachedCudaKernel(lambda **kw: launched.append(threading.get_ident()) or ["launched"],
                                         "k_dry", ["x"], ["y"], "y[0] = x[0];", "")
    call = functools.partial(kernel, inputs=[mx.zeros((4,))], output_dtypes=[mx.float32], output_shapes=[(4,)],
                             template=[("N", 2)], grid=(1, 1, 1), threadgroup=(1, 1, 1))
    outputs = []

    def run():
        other = threading.Thread(target=lambda: outputs.append(call()))
        other.start()
        other.join()
        outputs.append(call())
        raise RuntimeError("a check that fails to run")

    disk_cache.prebuild_met(run)
    assert len(launched) == 1 and launched[0] != threading.get_ident() and outputs[0] == ["launched"]
    assert outputs[1][0].tolist() == [0.0] * 4  # this thread's call: the dry pass's zeros, not launched
    assert not disk_cache.collecting()
    call()
    assert launched[-1] == threading.get_ident()


def _quantized_gemm_kernel(monkeypatch, launched):
    def run(*, inputs, output_shapes, output_dtypes, **kw):
        launched.append(kw["template"])
        return [mx.zeros(s, dt) for s, dt in zip(output_shapes, output_dtypes)]

    kernel = disk_cache.CachedCudaKernel(run, "pagedmlx_quantized_gemm_x", ["x", "w", "scales", "biases",
                                         "counters"], ["y", "partials"], quantized_gemm.quantized_gemm_source(), "")
    monkeypatch.setattr(quantized_gemm, "_kernel", lambda shared_memory: kernel)


@pytest.mark.parametrize("workers_write", [True, False], ids=["workers", "workers-failed"])
def test_prebuild_compiles_each_variant_once_in_workers_and_launches_then_find_them(tmp_path, monkeypatch,
                                                                                    workers_write):
    """The quantized GEMM's check has the variants it will launch compiled first by worker processes at once
    (compile_workers.py; NVRTC compiles one program at a time in a process): each once, under the very module names
    its launches seed, so that those launches compile nothing. What the workers leave undone this process
    compiles."""
    launched = []
    fake, calls = fake_compile_workers(monkeypatch, tmp_path, write=workers_write)
    _quantized_gemm_kernel(monkeypatch, launched)
    shapes, rows = [(4096, 4096, 4, 64), (28672, 4096, 4, 64), (4096, 14336, 8, 32)], (1, 9, 64)
    quantized_gemm.prebuild(shapes, mx.bfloat16, rows)
    variants = {(bits, gs, tuple(quantized_gemm.launch_for(n, k, r, bits, gs).__dict__.values()))
                for n, k, bits, gs in shapes for r in rows}
    assert [(len(names), arch, count) for names, arch, count in calls] == [(len(variants), "sm_90a", 4)]
    assert len(fake.sources) == len(variants) > 4
    assert disk_cache.stats == {"found": 0, "compiled": len(variants)}
    quantized_gemm.prebuild(shapes, mx.bfloat16, rows)  # known variants: nothing again
    for n, k, bits, gs in shapes:
        w, scales, biases = mx.quantize(mx.zeros((n, k), mx.bfloat16), group_size=gs, bits=bits)
        for r in rows:
            quantized_gemm.quantized_gemm(mx.zeros((r, k), mx.bfloat16), w, scales, biases, bits, gs)
    assert len(launched) == len(shapes) * len(rows) and len(fake.sources) == len(variants) and len(calls) == 1
    assert len(list(tmp_path.glob("*.ptx"))) == len(variants)


def test_objects_of_one_kernel_name_seed_a_variant_once(tmp_path, monkeypatch):
    """The quantized GEMM makes one kernel object per dynamic shared memory size, all of one source: a variant its
    prebuild compiled through one of them is neither rendered nor counted again when another launches it."""
    fake = FakeNVRTC()
    monkeypatch.setattr(disk_cache, "_compiler", lambda: fake)
    monkeypatch.setattr(disk_cache, "stats", {"found": 0, "compiled": 0})
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    run = lambda **kw: [mx.zeros(s, dt) for s, dt in zip(kw["output_shapes"], kw["output_dtypes"])]  # noqa: E731
    first, second = (disk_cache.CachedCudaKernel(run, "k_same", ["x"], ["y"], "y[0] = x[0];", "") for _ in range(2))
    first.prebuild([([(mx.float32, 1)], [mx.float32], [("N", 2)])])
    second(inputs=[mx.zeros((4,))], output_dtypes=[mx.float32], output_shapes=[(4,)], template=[("N", 2)],
           grid=(1, 1, 1), threadgroup=(1, 1, 1))
    assert len(fake.sources) == 1 and disk_cache.stats == {"found": 0, "compiled": 1}


def test_a_worker_writes_its_share_and_keeps_going_past_a_failed_variant(tmp_path, monkeypatch):
    """disk_cache.worker_main as a worker process runs it: a compiler for the parent's architecture, each job written
    where MLX reads it, a job that does not compile left (the worker says so in its exit code)."""
    made = []

    class Compiler(FakeNVRTC):
        def __init__(self, arch):
            super().__init__()
            made.append(arch)

        def compile(self, source, module_name, kernel_name):
            if source == "broken":
                raise RuntimeError("NVRTC could not compile")
            return super().compile(source, module_name, kernel_name)

    monkeypatch.setattr(disk_cache, "NVRTC", Compiler)
    jobs = tmp_path / "jobs.json"
    jobs.write_text(json.dumps([["mod_a", "mlx::core::cu::k_a", "a"], ["mod_b", "mlx::core::cu::k_b", "broken"],
                                ["mod_c", "mlx::core::cu::k_c", "c"]]))
    assert disk_cache.worker_main(["sm_90a", str(tmp_path), str(jobs)]) == 1
    assert made == ["sm_90a"] and sorted(p.name for p in tmp_path.glob("*.ptx")) == ["mod_a.ptx", "mod_c.ptx"]


def test_workers_are_processes_that_import_pagedmlx_as_the_parent_does(tmp_path):
    """compile_in_workers starts `python -m pagedmlx.kernels.disk_cache` children (subprocess: the engine core
    is a daemon process) with the parent's import path; without NVRTC they write nothing and end."""
    job = ("mod_x", "mlx::core::cu::k_x", "src")
    compile_workers.compile_in_workers([job, job], "sm_90a", tmp_path, 2)
    if not _have_nvrtc():
        assert not list(tmp_path.iterdir())


def _have_nvrtc() -> bool:
    try:
        nvrtc.load_library()
        return True
    except OSError:
        return False


def test_the_skinny_gemms_check_prebuilds_the_variants_its_launches_meet(tmp_path, monkeypatch):
    fake, launched = FakeNVRTC(), []
    monkeypatch.setattr(disk_cache, "_compiler", lambda: fake)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))

    def run(*, output_shapes, output_dtypes, template, **kw):
        launched.append(template)
        return [mx.zeros(s, dt) for s, dt in zip(output_shapes, output_dtypes)]

    kernels = {mma: disk_cache.CachedCudaKernel(run, f"skinny_{mma}", ["x", "w"], ["y"],
                                                skinny_gemm.skinny_gemm_source(CUDA, mma), "")
               for mma in (False, True)}
    monkeypatch.setattr(skinny_gemm, "_kernel", lambda backend, mma=False: kernels[mma])
    shapes, rows = [(4096, 4096), (6144, 4096), (4096, 14336)], (2, 3, 5)
    skinny_gemm.prebuild(CUDA, shapes, mx.bfloat16, rows)
    compiled = len(fake.sources)
    assert compiled == len({tuple(skinny_gemm._launch(CUDA, n, k, mx.bfloat16, r)[1]) for n, k in shapes for r in rows})
    for n, k in shapes:
        for r in rows:
            skinny_gemm.skinny_gemm(mx.zeros((r, k), mx.bfloat16), mx.zeros((n, k), mx.bfloat16), CUDA)
    assert len(launched) == len(shapes) * len(rows) and len(fake.sources) == compiled


# Shape and Strides by value between two inputs: the output reads right only where their layout is MLX's.
PROBE_HEADER = "template <typename T> __device__ T twice(T v) { return v + v; }\n"
PROBE_BODY = ("  const int i = threadIdx.x;\n"
              "  if (i < x_shape[0]) y[i] = twice(x[i]) + (T)N + z[0] * (T)x_strides[0] + (T)z_shape[0];")
ELF = b"\x7fELF"


def _render_probe(func: str, template, body: str = PROBE_BODY) -> str:
    return disk_cache.render(func, PROBE_HEADER, body, ["x", "z"], [(mx.float32, 1), (mx.float32, 1)], ["y"],
                             [mx.float32], template)


def _probe_call() -> dict:
    """y[i] = 2 i + N + 100 * 1 + 3."""
    return dict(inputs=[mx.arange(8, dtype=mx.float32), mx.array([100.0, 0.0, 0.0])], output_shapes=[(8,)],
                output_dtypes=[mx.float32], grid=(8, 1, 1), threadgroup=(8, 1, 1))


@functools.cache
def _nvrtc_here():
    """NVRTC set up for an H100 (sm_90a) as disk_cache sets it up; None without the library or the headers."""
    try:
        lib = nvrtc.load_library()
    except OSError:
        return None
    includes = nvrtc.include_paths()
    if not all(any((Path(p) / f).exists() for p in includes) for f in ("cuda_fp16.h", "cuda/std/array")):
        return None
    return nvrtc.NVRTC("sm_90a", includes, lib)


needs_nvrtc = pytest.mark.skipif(_nvrtc_here() is None, reason="NVRTC and the CUDA headers (CUDA_HOME) compile")


@needs_nvrtc
def test_nvrtc_compiles_a_rendered_source_with_mlxs_shape_and_strides():
    func = "custom_kernel_probe_3_float"
    source = _render_probe(func, [("N", 3), ("T", mx.float32)])
    cubin, lowered = _nvrtc_here().compile(source, f"{func}_{disk_cache.std_hash(source):x}", "mlx::core::cu::" + func)
    assert cubin[:4] == ELF
    config = Path(nvrtc.include_paths()[0]) / "mlx" / "backend" / "cuda" / "device" / "config.h"
    max_ndim = re.search(r"#define MAX_NDIM (\d+)", config.read_text()).group(1)
    # (const float*, array<int, MAX_NDIM>, array<long long, MAX_NDIM>, const float*, array<int, MAX_NDIM>, float*)
    assert re.fullmatch(rf"_ZN3mlx4core2cu{len(func)}{func}EPKfN4cuda3std3__\d+5arrayIiLm{max_ndim}EEENS\d+_IxLm"
                        rf"{max_ndim}EEES\d+_S\d+_Pf", lowered), lowered


def llama_start():
    """The kernel variants a Llama-8B start meets (bfloat16, 32 query heads on 8 KV heads of 128, 16-token pages):
    paged prefill and decode, unsplit and split (and their merge), the page write, residual add + RMSNorm, skinny
    GEMMs of its widths."""
    dt, h, kv, d, bs = mx.bfloat16, 32, 8, 128, 16
    one, pages = mx.zeros((1,), mx.int32), mx.zeros((4, kv, bs, d), dt)
    for splits in (1, 2):
        prefill_attention.paged_prefill(mx.zeros((16, h, d), dt), pages, pages, mx.zeros((1, 2), mx.int32),
                                        mx.zeros((1, 4), mx.int32), mx.zeros((1, 2), mx.int32), 1.0, splits, one)
        decode_attention.paged_decode(mx.zeros((2, h, d), dt), pages, pages, mx.zeros((2, 2), mx.int32),
                                      mx.array([32, 20]), 1.0, splits, one, backend=CUDA)
    page_write.reshape_and_cache(mx.zeros((3, kv, 1, d), dt), mx.zeros((3, kv, 1, d), dt), pages, pages,
                                 mx.zeros((3,), mx.int32), backend=CUDA)
    add_rms_norm.add_rms_norm(mx.zeros((3, 4096), dt), mx.zeros((3, 4096), dt), mx.zeros((4096,), dt), 1e-5, CUDA)
    for rows, k, n in ((2, 4096, 6144), (4, 4096, 1024), (8, 14336, 4096), (8, 4096, 28672)):
        skinny_gemm.skinny_gemm(mx.zeros((rows, k), dt), mx.zeros((n, k), dt), CUDA, mma=False)


KERNEL_CACHES = (decode_attention._kernels, page_write._write_kernel, prefill_attention._prefill_kernels,
                 add_rms_norm._kernel, skinny_gemm._kernel)


@pytest.mark.slow
@needs_nvrtc
def test_the_variants_a_llama_start_meets_compile_into_the_cache(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(disk_cache, "_compiler", _nvrtc_here)
    monkeypatch.setattr(disk_cache, "stats", {"found": 0, "compiled": 0})
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    zeros = lambda output_shapes, output_dtypes, **_: [mx.zeros(s, t) for s, t in zip(output_shapes, output_dtypes)]
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda *a, **kw: zeros, raising=False)
    monkeypatch.setattr(build, "gpu_backend", lambda: CUDA)
    for cache in KERNEL_CACHES:
        cache.cache_clear()
    try:
        with caplog.at_level("INFO", logger="pagedmlx"):
            llama_start()
    finally:
        for cache in KERNEL_CACHES:
            cache.cache_clear()
    modules = sorted(tmp_path.glob("*.ptx"))
    assert len(modules) == disk_cache.stats["compiled"] >= 11, caplog.text[-3000:]
    for module in modules:
        assert module.read_bytes()[:4] == ELF
        name, lowered = module.with_suffix(".txt").read_text().rstrip("\n").split("\t")
        func = name.removeprefix("mlx::core::cu::")
        assert module.stem.startswith(func + "_") and lowered.startswith(f"_ZN3mlx4core2cu{len(func)}{func}E")


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="a CUDA GPU runs MLX's own kernel build")
def test_the_rendered_source_is_the_one_mlx_builds_and_a_kept_module_is_loaded(tmp_path):
    name = f"pagedmlx_cache_probe_{os.getpid()}"
    template = [("N", 3), ("T", mx.float32)]
    mlx_kernel = mx.fast.cuda_kernel(name, ["x", "z"], ["y"], PROBE_BODY, header=PROBE_HEADER)
    printed = _stdout_of(lambda: mx.eval(mlx_kernel(**_probe_call(), template=template, verbose=True)))
    assert _render_probe("custom_kernel_" + name + disk_cache.template_hash(template), template) in printed
    # A fresh process: MLX reads MLX_PTX_CACHE_DIR once, before its first kernel build.
    root = Path(__file__).resolve().parents[2]
    path = os.pathsep.join([str(root), str(root / "tests" / "kernels"), os.environ.get("PYTHONPATH", "")])
    r = subprocess.run([sys.executable, "-c", f"import test_disk_cache as t; t.run_kept_modules({str(tmp_path)!r})"],
                       env=dict(os.environ, MLX_PTX_CACHE_DIR=str(tmp_path), PYTHONPATH=path), cwd=root,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["decoy"] == [-1.0] * 8  # MLX ran the module kept under the name of its source, not its own build
    assert out["kept"] == [2 * i + 4 + 103 for i in range(8)]  # compiled here with nvrtc.py's header
    assert out["stats"] == {"found": 0, "compiled": 1}


def run_kept_modules(cache: str) -> None:
    """(The GPU test's second process.) A decoy module kept under the name of one variant's source, and another
    variant kept by CachedCudaKernel; prints what each call computed."""
    name = f"pagedmlx_cache_probe_{os.getpid()}"
    mlx_kernel = mx.fast.cuda_kernel(name, ["x", "z"], ["y"], PROBE_BODY, header=PROBE_HEADER)
    template = [("N", 3), ("T", mx.float32)]
    func = "custom_kernel_" + name + disk_cache.template_hash(template)
    decoy = _render_probe(func, template, "  (void)x_shape; (void)x_strides; (void)z_shape;\n  y[threadIdx.x] = -1.0f;")
    cubin, lowered = disk_cache._compiler().compile(decoy, "decoy", "mlx::core::cu::" + func)
    path = disk_cache.ptx_path(Path(cache), f"{func}_{disk_cache.std_hash(_render_probe(func, template)):x}")
    path.with_suffix(".txt").write_text(f"mlx::core::cu::{func}\t{lowered}\n")
    path.write_bytes(cubin)
    out = {"decoy": mlx_kernel(**_probe_call(), template=template)[0].tolist()}
    kept = disk_cache.CachedCudaKernel(mlx_kernel, name, ["x", "z"], ["y"], PROBE_BODY, PROBE_HEADER)
    out["kept"] = kept(**_probe_call(), template=[("N", 4), ("T", mx.float32)])[0].tolist()
    out["stats"] = disk_cache.stats
    print(json.dumps(out))


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


def test_a_start_off_cuda_sets_up_no_compiler_and_runs_no_dry_pass(tmp_path, monkeypatch):
    """The CPU (and Metal) have no CUDA kernels to build: an engine's start there asks nothing of NVRTC (whose set-up
    fails there, and said so in the server's log) and runs no dry pass."""
    from pagedmlx.engine.llm_engine import LLMEngine
    from utils import make_model

    def no_compiler(*args):
        raise AssertionError("NVRTC set up off CUDA")

    monkeypatch.setattr(disk_cache, "NVRTC", no_compiler)
    monkeypatch.setattr(disk_cache, "_nvrtc", None)
    monkeypatch.setattr(disk_cache, "_nvrtc_failed", False)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    assert LLMEngine(make_model("llama")).runner.kernels.backend is None
    disk_cache.prebuild_met(no_compiler)
    assert disk_cache._compiler() is None
