"""CUDA kernels compiled once per machine and kept on disk, so that a second start builds none of them.

MLX compiles each custom CUDA kernel with NVRTC the first time a process runs it (a second or more each, and a
model's load-time checks meet dozens) and writes none of them to disk (custom_kernel.cpp asks get_jit_module for
no disk cache; MLX's built-in JIT kernels it does keep); but before compiling any module it reads
MLX_PTX_CACHE_DIR/<module>.ptx if that file exists (mlx/backend/cuda/jit_module.cpp). So the first time a process
meets a kernel variant, CachedCudaKernel renders the very source MLX generates for it (custom_kernel.cpp's
build_kernel: the signature from the inputs' dtypes, template constants, header and body), names the module as MLX
does (the kernel's name and std::hash of that source), and where no file is there yet compiles it with NVRTC as MLX
does (nvrtc.py) and writes it there. Later processes, and MLX in this one, load it instead of compiling.

Safe by construction: MLX reads a file only under the name its own source hashes to, and the file holds what that
very text compiles to, with the one header MLX supplies from memory (utils.cuh) given as nvrtc.py's stand-in, which
declares the signature's types as MLX does; an MLX version that renders differently misses the files and compiles
as before. Any failure here (no NVRTC, no headers, a body that needs more of MLX's header) leaves MLX to compile as
it always has.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable, Optional, Sequence

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.kernels import compile_workers
from pagedmlx.kernels.nvrtc import NVRTC, device_arch
from pagedmlx.platform import backend_name

logger = logging.getLogger("pagedmlx")

_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907

# MLX's names for the CUDA types of a kernel's arguments (dtype_to_cuda_type) and of template dtypes
# (get_type_string).
_CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
               mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
               mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float", mx.float64: "double"}
_TYPE_STRINGS = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.float64: "double",
                 mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
                 mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t"}
_DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
_MAX_FILE_NAME = 245


def std_hash(text: str) -> int:
    """libstdc++'s std::hash<std::string> (std::_Hash_bytes, 64-bit): how MLX names a kernel's module."""
    data = text.encode()
    n = len(data)
    h = (_SEED ^ (n * _MUL)) & _MASK
    aligned = n & ~7
    for i in range(0, aligned, 8):
        k = (int.from_bytes(data[i:i + 8], "little") * _MUL) & _MASK
        h = ((h ^ ((k ^ (k >> 47)) * _MUL & _MASK)) * _MUL) & _MASK
    if n & 7:
        h = ((h ^ int.from_bytes(data[aligned:], "little")) * _MUL) & _MASK
    h = ((h ^ (h >> 47)) * _MUL) & _MASK
    return h ^ (h >> 47)


def template_hash(template: Sequence[tuple[str, Any]]) -> str:
    out = ""
    for _, value in template:
        if isinstance(value, bool):
            out += "_t" if value else "_f"
        elif isinstance(value, int):
            out += f"_{value}"
        else:
            out += "_" + _TYPE_STRINGS[value]
    return out


def render(func_name: str, header: str, source: str, input_names: Sequence[str], inputs: Sequence[tuple[Any, int]],
           output_names: Sequence[str], output_dtypes: Sequence[Any], template: Sequence[tuple[str, Any]]) -> str:
    """The kernel source MLX's build_kernel generates. inputs: (dtype, ndim) of each input."""
    text = _DEFAULT_HEADER + header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
    text += f"__global__ void {func_name}(\n"
    for name, (dtype, ndim) in zip(input_names, inputs):
        text += f"    const {_CUDA_TYPES[dtype]}* {name},\n"
        if ndim > 0:
            if f"{name}_shape" in source:
                text += f"    const __grid_constant__ Shape {name}_shape,\n"
            if f"{name}_strides" in source:
                text += f"    const __grid_constant__ Strides {name}_strides,\n"
            if f"{name}_ndim" in source:
                text += f"    const __grid_constant__ int {name}_ndim,\n"
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        text += f"    {_CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(output_names) - 1 else ") {\n")
    if template:
        for name, value in template:
            if isinstance(value, bool):
                text += f"  constexpr bool {name} = {'true' if value else 'false'};\n"
            elif isinstance(value, int):
                text += f"  constexpr int {name} = {value};\n"
            else:
                text += f"  using {name} = {_CUDA_TYPES[value]};\n"
        text += "\n"
    return text + source + "\n}\n\n} // namespace mlx::core::cu\n"


def ptx_path(cache_dir: Path, module_name: str) -> Path:
    """Where MLX looks for a module (get_ptx_path: names past 245 characters become folders)."""
    path, offset = cache_dir, 0
    while len(module_name) - offset > _MAX_FILE_NAME:
        path /= module_name[offset:offset + _MAX_FILE_NAME]
        offset += _MAX_FILE_NAME
    return path / (module_name[offset:] + ".ptx")


def ptx_cache_dir() -> Path:
    """The folder MLX reads compiled modules from: MLX_PTX_CACHE_DIR, which platform.use_kernel_cache sets."""
    return Path(envs.MLX_PTX_CACHE_DIR or "")


_nvrtc: Optional[NVRTC] = None
_nvrtc_failed = False
# Kernel variants this process met: found in the cache, or compiled and written now.
stats = {"found": 0, "compiled": 0}


def _compiler() -> Optional[NVRTC]:
    """This process's NVRTC for its CUDA GPU; None off CUDA (nothing to compile) or where it cannot be set up."""
    global _nvrtc, _nvrtc_failed
    if _nvrtc is None and not _nvrtc_failed and backend_name() != "CUDA":
        _nvrtc_failed = True
    if _nvrtc is None and not _nvrtc_failed:
        try:
            _nvrtc = NVRTC(device_arch())
        except Exception as exc:  # noqa: BLE001 - no disk cache; MLX compiles as before
            _nvrtc_failed = True
            logger.info("kernel disk cache off: NVRTC could not be set up (%s: %s)", type(exc).__name__, exc)
            logger.debug("NVRTC's set-up", exc_info=True)
    return _nvrtc


def write_module(cache_dir: Path, module_name: str, kernel_name: str, source: str,
                 nvrtc: Optional[NVRTC] = None) -> bool:
    """Compile `source` (with `nvrtc`, default this process's) and write it where MLX reads module_name from,
    unless it is there. True: written now."""
    path = ptx_path(cache_dir, module_name)
    if path.exists():
        stats["found"] += 1
        return False
    nvrtc = nvrtc or _compiler()
    if nvrtc is None:
        return False
    cubin, mangled = nvrtc.compile(source, module_name, kernel_name)
    path.parent.mkdir(parents=True, exist_ok=True)
    # The names first, then the module by rename: MLX reads the .txt once the .ptx exists.
    path.with_suffix(".txt").write_text(f"{kernel_name}\t{mangled}\n")
    tmp = path.with_suffix(f".tmp{os.getpid()}")
    tmp.write_bytes(cubin)
    tmp.replace(path)
    stats["compiled"] += 1
    return True


def stats_line() -> Optional[str]:
    """For the start-up lines: how many kernel variants came from the disk cache; None where none was met."""
    if not stats["found"] and not stats["compiled"]:
        return None
    return (f"kernel cache {ptx_cache_dir()}: {stats['found']} kernel variants loaded, {stats['compiled']} compiled "
            f"and kept")


_SEEN: dict[tuple[str, str], set] = {}  # (kernel name, cache folder) -> the variant keys seeded (CachedCudaKernel)


class _DryPass(threading.local):
    """Per thread (another thread's engine keeps launching): during prebuild_met's dry pass, the variants met, by
    module name: (kernel object, variant key, job)."""
    met: Optional[dict[str, tuple["CachedCudaKernel", tuple, compile_workers.Job]]] = None


_dry = _DryPass()


def collecting() -> bool:
    """True in this thread during prebuild_met's dry pass, when no cached kernel launches (load-time checks then
    count as passed: only the variants they meet matter)."""
    return _dry.met is not None


def prebuild_met(run: Callable[[], object]) -> None:
    """Compile, in worker processes at once, the variants that `run` (load-time checks, say) will meet, before it
    runs: `run` is called once as a dry pass in which every cached kernel's call (in this thread) gives zeros of its
    outputs instead of launching, its variants noted. Without this each variant compiles when first launched, one at
    a time. Does nothing where this process compiles nothing (no NVRTC, or the cache off)."""
    if _compiler() is None or not envs.MLX_PTX_CACHE_DIR:
        return
    before, _dry.met = _dry.met, {}
    try:
        run()
    except Exception:  # noqa: BLE001 - an optimisation: the variants met so far are still built
        logger.info("the dry pass before a prebuild stopped early", exc_info=True)
    finally:
        met, _dry.met = list(_dry.met.values()), before
    cache = ptx_cache_dir()
    found = {job[0] for _, _, job in met if ptx_path(cache, job[0]).exists()}
    built = _compile_missing([job for _, _, job in met])
    stats["found"] += len(found)
    for kernel, key, job in met:  # on disk now: their launches load them (and count nothing again)
        if job[0] in found or job[0] in built:
            kernel._seen.add(key)


def _compile_missing(jobs: Sequence[compile_workers.Job]) -> set[str]:
    """The jobs whose modules are not on disk compiled by worker processes at once; the module names written."""
    cache = ptx_cache_dir()
    missing = [job for job in jobs if not ptx_path(cache, job[0]).exists()]
    workers = min(len(missing), os.cpu_count() or 1, compile_workers.WORKERS)
    if workers < 2:
        return set()
    try:
        compile_workers.compile_in_workers(missing, _compiler().arch, cache, workers)
    except Exception:  # noqa: BLE001 - no worker processes here: the caller compiles them
        logger.info("kernel variants not compiled in worker processes", exc_info=True)
    built = {job[0] for job in missing if ptx_path(cache, job[0]).exists()}
    stats["compiled"] += len(built)
    return built


class CachedCudaKernel:
    """An mx.fast.cuda_kernel whose compiled variants are kept on disk (see the module's docstring)."""

    def __init__(self, kernel: Any, name: str, input_names: Sequence[str], output_names: Sequence[str],
                 source: str, header: str):
        self.kernel, self.name, self.source, self.header = kernel, name, source, header
        self.input_names, self.output_names = list(input_names), list(output_names)
        # The inputs whose rank changes the signature MLX generates (a 0-d input gets no shape arguments).
        self._shaped = [i for i, n in enumerate(input_names)
                        if any(f"{n}_{what}" in source for what in ("shape", "strides", "ndim"))]
        # Variants seeded already, by any object of this name and cache folder (the same source: quantized_gemm.py
        # makes one object per dynamic shared memory size), so that none is rendered and counted twice.
        self._seen = _SEEN.setdefault((name, str(ptx_cache_dir())), set())

    def __call__(self, *, inputs: Sequence[Any], output_dtypes: Sequence[Any], template: Optional[Sequence] = None,
                 **kwargs: Any) -> Any:
        key = self._key(inputs, output_dtypes, template)
        if _dry.met is not None:  # prebuild_met's dry pass: noted, not launched
            job = self._job(inputs, output_dtypes, list(template or [])) if key is not None else None
            if job is not None and key not in self._seen:
                _dry.met[job[0]] = (self, key, job)
            return [mx.zeros(shape, dtype) for shape, dtype in zip(kwargs["output_shapes"], output_dtypes)]
        if key is not None and key not in self._seen:
            self._seen.add(key)
            self._seed(inputs, output_dtypes, list(template or []))
        return self.kernel(inputs=inputs, output_dtypes=output_dtypes, template=template, **kwargs)

    def prebuild(self, variants: Sequence[tuple[Sequence[tuple[Any, int]], Sequence[Any], Sequence]]) -> None:
        """Compile these variants into the cache before their first launches: (inputs' (dtype, ndim), output dtypes,
        template) each. Those not on disk yet are compiled by worker processes at once (compile_workers.py: NVRTC
        compiles one program at a time in a process), any a worker left undone by this process."""
        todo = []
        for inputs, output_dtypes, template in variants:
            arrays = [SimpleNamespace(dtype=dtype, ndim=ndim) for dtype, ndim in inputs]
            key = self._key(arrays, output_dtypes, template)
            if key is not None and key not in self._seen:
                self._seen.add(key)
                todo.append((arrays, list(output_dtypes), list(template)))
        if not todo or _compiler() is None:
            return
        jobs = [job for variant in todo if (job := self._job(*variant)) is not None]
        built = _compile_missing(jobs)
        for job in jobs:
            if job[0] not in built:
                self._write(job)

    def _key(self, inputs: Sequence[Any], output_dtypes: Sequence[Any],
             template: Optional[Sequence]) -> Optional[tuple]:
        try:  # a few microseconds a launch: the variant's key
            return (tuple([x.dtype for x in inputs]), tuple([inputs[i].ndim > 0 for i in self._shaped]),
                    tuple(output_dtypes), tuple(template or ()))
        except (AttributeError, TypeError):  # a Python scalar among the inputs, or a list in the template:
            return None  # MLX builds this variant itself, as it always has

    def _seed(self, arrays: Sequence[Any], output_dtypes: Sequence[Any], template: list) -> None:
        job = self._job(arrays, output_dtypes, template)
        if job is not None:
            self._write(job)

    def _job(self, arrays: Sequence[Any], output_dtypes: Sequence[Any],
             template: list) -> Optional[compile_workers.Job]:
        """(module name, kernel name, source) of a variant as MLX renders it; None if it cannot be rendered."""
        try:
            func = "custom_kernel_" + self.name + template_hash(template)
            source = render(func, self.header, self.source, self.input_names, [(x.dtype, x.ndim) for x in arrays],
                            self.output_names, output_dtypes, template)
            return f"{func}_{std_hash(source):x}", "mlx::core::cu::" + func, source
        except Exception:  # noqa: BLE001 - any failure leaves MLX to build the variant, as it always has
            logger.info("could not render a variant of kernel %s", self.name, exc_info=True)
            return None

    def _write(self, job: compile_workers.Job) -> None:
        try:  # any failure leaves MLX to build the variant, as it always has
            if write_module(ptx_cache_dir(), *job):
                logger.debug("kernel %s compiled into the disk cache", job[0])
        except Exception:  # noqa: BLE001
            logger.info("could not keep a variant of kernel %s on disk", self.name, exc_info=True)


def worker_main(argv: Sequence[str]) -> int:
    """A compile worker (compile_workers.py): ARCH CACHE_DIR JOBS_JSON, the jobs [[module, kernel, source]] each
    written into CACHE_DIR by an NVRTC for ARCH (no GPU touched). 1 if any did not compile (left to the parent)."""
    arch, cache_dir, jobs = argv
    compiler, failed = NVRTC(arch), 0
    for module_name, kernel_name, source in json.loads(Path(jobs).read_text()):
        try:
            write_module(Path(cache_dir), module_name, kernel_name, source, compiler)
        except Exception:  # noqa: BLE001 - the parent compiles it again and says why
            failed += 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
