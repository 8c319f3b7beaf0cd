"""The paged kernels' sources run on the CPU (emu.h), standing in for the kernel objects that
mx.fast.metal_kernel and mx.fast.cuda_kernel return, for tests on a machine without either GPU.

The Metal source is the one MLX itself generates for the call, signature and template
instantiation included: MLX's CPU build prints it while mx.export_function traces the call. The
CUDA source follows MLX's CUDA build_kernel (mlx/backend/cuda/custom_kernel.cpp, 0.32). g++
compiles it against emu.h; inputs are MLX's own buffers (writes through an input, as the page
write does, land in the MLX array as on a GPU). What this cannot show: the Metal and CUDA
compilers' own rules (address spaces are erased, CUDA's compile is checked by nvcc where present),
and speed.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import mlx.core as mx
import numpy as np

HERE = Path(__file__).resolve().parent
CACHE = Path(tempfile.gettempdir()) / "pagedmlx-kernel-emulator"
CUDA_TYPES = {mx.float32: "float", mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.int32: "int32_t",
              mx.int64: "int64_t", mx.uint32: "uint32_t"}
ATTRIBUTES = {"thread_position_in_grid": "emu::pos3()", "thread_position_in_threadgroup": "emu::tid3()",
              "threadgroup_position_in_grid": "emu::group3()", "threadgroups_per_grid": "emu::groups3()",
              "threads_per_threadgroup": "emu::tg3()", "thread_index_in_simdgroup": "emu::lane()",
              "simdgroup_index_in_threadgroup": "emu::simd()", "thread_index_in_threadgroup": "emu::tid()"}


def have_compiler() -> bool:
    return shutil.which("g++") is not None


@contextlib.contextmanager
def _stdout_to(path: str):
    """C++ std::cout, where MLX prints a kernel's generated source, into a file."""
    import sys

    sys.stdout.flush()
    saved = os.dup(1)
    with open(path, "w") as f:
        os.dup2(f.fileno(), 1)
        try:
            yield
        finally:
            os.dup2(saved, 1)
            os.close(saved)


def metal_source(name, input_names, output_names, source, header, inputs, **call) -> str:
    """The Metal source MLX generates for kernel(inputs=inputs, **call)."""
    kernel = mx.fast.metal_kernel(name, input_names, output_names, source, header=header)
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "stdout.txt")
        with _stdout_to(out):
            mx.export_function(os.path.join(d, "k.mlxfn"),
                               lambda *xs: kernel(inputs=list(xs), verbose=True, **call), *inputs)
        text = Path(out).read_text()
    match = re.search(r"Generated source code for `[^`]*`:\n```\n(.*)\n```", text, re.S)
    if match is None:
        raise RuntimeError(f"MLX printed no generated source: {text[:500]}")
    return match.group(1)


def cuda_source(name, input_names, output_names, source, header, inputs, template, output_dtypes) -> str:
    """The CUDA source MLX's build_kernel makes for this call."""
    params = []
    for n, x in zip(input_names, inputs):
        params.append(f"    const {CUDA_TYPES[x.dtype]}* {n}")
        if x.ndim and n + "_shape" in source:
            params.append(f"    const __grid_constant__ Shape {n}_shape")
    params += [f"    {CUDA_TYPES[dt]}* {n}" for n, dt in zip(output_names, output_dtypes)]
    consts = "".join(f"  using {n} = {CUDA_TYPES[v]};\n" if isinstance(v, mx.Dtype) else
                     f"  constexpr {'bool' if isinstance(v, bool) else 'int'} {n} = {str(v).lower()};\n"
                     for n, v in template)
    return (header + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + consts + "\n" + source
            + "\n}\n\n} // namespace mlx::core::cu\n")


def _signature(text: str, prefix: str) -> tuple[str, list[str]]:
    m = re.search(prefix + r" void (\w+)\((.*?)\) \{", text, re.S)
    return m.group(1), [p.strip() for p in m.group(2).split(",\n")]


def _wrapper(backend: str, text: str) -> tuple[str, list[str]]:
    """The source with an extern "C" entry point, and the buffer names in argument order."""
    buffers, args = [], []
    if backend == "metal":
        inst = re.search(r"\ntemplate \[\[host_name\(\"\w+\"\)\]\] \[\[kernel\]\] decltype\((.*?)\) .*;\n", text)
        fn = inst.group(1) if inst else None
        text = text[:inst.start()] + "\n" if inst else text
        name, params = _signature(text, r"\[\[kernel\]\]")
        for p in params:
            m = re.fullmatch(r"(.*?)\s*(\w+) \[\[(\w+)(?:\(\d+\))?\]\]", p, re.S)
            ptype, pname, attr = m.groups()
            if attr == "buffer":
                args.append(f"({ptype})bufs[{len(buffers)}]")
                buffers.append(pname)
            else:
                args.append(ATTRIBUTES[attr])
        call = fn or name
    else:
        name, params = _signature(text, "__global__")
        for p in params:
            ptype, pname = p.rsplit(" ", 1)
            args.append(f"*(const Shape*)bufs[{len(buffers)}]" if "Shape" in ptype
                        else f"({ptype})bufs[{len(buffers)}]")
            buffers.append(pname)
        call = "mlx::core::cu::" + name
    partial = "true" if backend == "metal" else "false"
    entry = (f'\nextern "C" int emu_run(void** bufs, const unsigned* grid, const unsigned* tg) {{\n'
             f"  return emu::launch(grid, tg, {partial}, [&]() {{ {call}({', '.join(args)}); }});\n}}\n")
    return text + entry, buffers


def compile_kernel(backend: str, text: str):
    """(library, buffer names): the kernel compiled against emu.h, cached by its text."""
    full, buffers = _wrapper(backend, text)
    prelude = f"#define EMU_{backend.upper()}\n#include \"{HERE / 'emu.h'}\"\n"
    if backend == "cuda":
        prelude += "namespace cooperative_groups {}\n"
    code = prelude + full
    CACHE.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha1(code.encode() + (HERE / "emu.h").read_bytes()).hexdigest()[:16]
    lib = CACHE / f"{key}.so"
    if not lib.exists():  # each process its own source and output file: test workers may build the same kernel
        src, tmp = CACHE / f"{key}.{os.getpid()}.cpp", f"{lib}.{os.getpid()}.tmp"
        src.write_text(code)
        cmd = ["g++", "-std=c++20", os.environ.get("EMU_OPT", "-O1"), "-g", "-shared", "-fPIC", "-U_FORTIFY_SOURCE",
               "-Wno-attributes", "-Wno-unknown-pragmas", "-Wno-unused", "-o", tmp, str(src)]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode:
            raise RuntimeError(f"g++ failed on the {backend} source ({src}):\n{done.stderr[:4000]}")
        os.replace(tmp, lib)
        src.unlink(missing_ok=True)
    dll = ctypes.CDLL(str(lib))
    dll.emu_run.restype = ctypes.c_int
    return dll, buffers


def _host(x: mx.array) -> np.ndarray:
    """A numpy view of an MLX array's own memory (bfloat16 as its bits)."""
    mx.eval(x)
    view = x.view(mx.uint16) if x.dtype == mx.bfloat16 else x
    mx.eval(view)
    a = np.asarray(memoryview(view))
    return a if a.flags.c_contiguous else np.ascontiguousarray(a)


def _alloc(shape, dtype: mx.Dtype, init_value) -> mx.array:
    """A fresh output; unset elements NaN (-12345 for ints), so that a skipped write shows."""
    if dtype == mx.int32:
        return mx.array(np.full(shape, -12345 if init_value is None else int(init_value), np.int32))
    out = mx.array(np.full(shape, float("nan") if init_value is None else init_value, np.float32)).astype(dtype)
    mx.eval(out)
    return out


class EmulatedKernel:
    """Called like the object mx.fast.metal_kernel / cuda_kernel returns; runs the source on the CPU.
    `sources` collects every generated text (tests inspect them)."""

    sources: list[str] = []

    def __init__(self, backend: str, name: str, input_names, output_names, source: str, header: str,
                 shared_memory: int = 0):  # dynamic shared memory: the emulated source sizes its arrays itself
        self.backend, self.name = backend, name
        self.input_names, self.output_names = list(input_names), list(output_names)
        self.source, self.header = source, header

    def __call__(self, *, inputs, template, grid, threadgroup, output_shapes, output_dtypes, init_value=None,
                 verbose=False):
        mx.eval(inputs)
        if self.backend == "metal":
            text = metal_source(self.name, self.input_names, self.output_names, self.source, self.header, inputs,
                                template=template, grid=grid, threadgroup=threadgroup, output_shapes=output_shapes,
                                output_dtypes=output_dtypes)
        else:
            text = cuda_source(self.name, self.input_names, self.output_names, self.source, self.header, inputs,
                               template, output_dtypes)
        EmulatedKernel.sources.append(text)
        dll, buffers = compile_kernel(self.backend, text)
        outputs = [_alloc(s, dt, init_value) for s, dt in zip(output_shapes, output_dtypes)]
        arrays = dict(zip(self.input_names, inputs)) | dict(zip(self.output_names, outputs))
        host = []
        for b in buffers:
            if b.endswith("_shape") and b not in arrays:
                shape = list(arrays[b[:-len("_shape")]].shape)
                host.append(np.array(shape + [0] * (10 - len(shape)), np.int32))
            else:
                host.append(_host(arrays[b]))
        ptrs = (ctypes.c_void_p * len(host))(*[h.ctypes.data for h in host])
        dims = [(ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(*threadgroup)]
        if dll.emu_run(ptrs, *dims):
            raise RuntimeError(f"{self.name}: a shuffle or barrier that not every lane reached (deadlock)")
        return outputs


def clear_kernel_caches() -> None:
    """Forget every kernel object the kernel modules keep (their lru caches), so that the next call builds
    through whatever build.make_kernel is then (the emulator, a recorder, MLX's own)."""
    from pagedmlx.kernels import (decode_attention, decode_attention_quant, lora, page_write, prefill_attention,
                                  recurrent_state)

    for f in (decode_attention._kernels, decode_attention.supports, decode_attention_quant._kernels,
              page_write._write_kernel, page_write._quant_write_kernel, page_write._quantizing_write_kernel,
              prefill_attention._prefill_kernels, recurrent_state._kernel, lora._kernel):
        f.cache_clear()
