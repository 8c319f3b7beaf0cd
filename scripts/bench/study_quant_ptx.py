"""Study (static, no GPU): the quantized tensor-core decode kernel's PTX, instruction by opcode, and ptxas's
register count, for the Llama-8B head shape (D 128, 4 query heads a KV head) in each page format. nvcc builds
the very source MLX's CUDA backend would build for the call (tests/nvcc_utils.py records it), for the H200
(sm_90). Its 16-byte pieces are unrolled, so the static count tracks the tile loop's work. Where cuobjdump is
on the PATH too, the machine code's tile loop (the longest backward branch's body: one 16-token tile a warp)
is counted as well, beside the 16-bit kernel's. Neither is a timing: the GPU's step times are
bench_kv_quant.py --speed's.

  python scripts/bench/study_quant_ptx.py          # needs nvcc (CUDA 12+) on the PATH; PREFETCH=0 rows last
  # cuobjdump without a CUDA toolkit's: pip download --no-deps nvidia-cuda-cuobjdump, unzip, add its bin/ to PATH
"""

from __future__ import annotations

import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from nvcc_utils import MLX_HEADER, RecordingCudaKernel  # noqa: E402

from pagedmlx.kernels import build, decode_attention, decode_attention_quant  # noqa: E402
from pagedmlx.kv_cache_dtype import KVQuant  # noqa: E402
from pagedmlx.runner.kv_quant import QuantizedPages  # noqa: E402


def kernel_source(dtype: mx.Dtype, quant: KVQuant, d: int = 128, g: int = 4) -> str:
    RecordingCudaKernel.sources = []
    decode_attention_quant._kernels.cache_clear()
    pages = [QuantizedPages(*mx.quantize(mx.zeros((2, 2, 16, d), dtype), quant.group_size, quant.bits), quant)
             for _ in range(2)]
    one = mx.zeros((1,), mx.int32)
    decode_attention_quant.paged_decode_quantized(mx.zeros((1, 2 * g, d), dtype), *pages, mx.zeros((1, 2), mx.int32),
                                                  one, 1.0, 1, one, backend="cuda")
    return MLX_HEADER + RecordingCudaKernel.sources[0][1]


def ptx_opcodes(source: str) -> tuple[collections.Counter, str]:
    with tempfile.TemporaryDirectory() as tmp:
        cu = Path(tmp) / "k.cu"
        cu.write_text(source)
        ptx = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-ptx", str(cu), "-o", "-"],
                             capture_output=True, text=True, check=True).stdout
        regs = subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-Xptxas", "-v", "-c", str(cu), "-o",
                               str(cu) + ".o"], capture_output=True, text=True, check=True).stderr
    ops = collections.Counter()
    for line in ptx.splitlines():
        line = line.strip()
        if line.endswith(";") and not line.startswith((".", "//")):
            op = re.sub(r"^@!?%\w+\s+", "", line).split()[0]
            ops[op.split(".")[0]] += 1
    return ops, ",".join(re.findall(r"Used (\d+) registers", regs))


def sixteen_bit_source(dtype: mx.Dtype, d: int = 128, g: int = 4) -> str:
    RecordingCudaKernel.sources = []
    decode_attention._kernels.cache_clear()
    pages = mx.zeros((2, 2, 16, d), dtype)
    one = mx.zeros((1,), mx.int32)
    decode_attention.paged_decode(mx.zeros((1, 2 * g, d), dtype), pages, pages, mx.zeros((1, 2), mx.int32), one, 1.0,
                                  1, one, backend="cuda")
    return MLX_HEADER + RecordingCudaKernel.sources[0][1]


def sass_tile_loop(source: str) -> tuple[int, collections.Counter]:
    """Instructions of the longest loop of the machine code (a backward branch's body) and their opcodes."""
    with tempfile.TemporaryDirectory() as tmp:
        cu, cubin = Path(tmp) / "k.cu", Path(tmp) / "k.cubin"
        cu.write_text(source)
        subprocess.run(["nvcc", "-std=c++17", "-arch=sm_90", "-cubin", str(cu), "-o", str(cubin)],
                       capture_output=True, check=True)
        sass = subprocess.run(["cuobjdump", "-sass", str(cubin)], capture_output=True, text=True, check=True).stdout
    lines = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^\s+/\*([0-9a-f]{4,})\*/\s+(.*)$", sass, re.M)]
    best: list[str] = []
    for addr, text in lines:
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            body = [t for a, t in lines if int(m.group(1), 16) <= a <= addr]
            best = max(best, body, key=len)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in best)
    return len(best), ops


def main() -> None:
    build.make_kernel = RecordingCudaKernel
    sass = shutil.which("cuobjdump") is not None
    print("quantized tensor-core decode kernel, D 128, G 4, sm_90 PTX (static)"
          + (", and the machine code's tile loop" if sass else " (cuobjdump not on the PATH: no machine code)"))
    print(f"{'pages':>30} | {'instructions':>12} | {'registers':>9} | {'SASS loop':>9} | most frequent")
    rows = [(dtype, quant, True) for dtype in (mx.bfloat16, mx.float16) for quant in (None, KVQuant(8, 128), KVQuant(4, 64))]
    for dtype, quant, prefetch in rows + [(mx.bfloat16, KVQuant(8, 128), False), (mx.bfloat16, KVQuant(4, 64), False)]:
        if not prefetch:  # PAGEDMLX_QUANT_PREFETCH=0
            os.environ["PAGEDMLX_QUANT_PREFETCH"] = "0"
            decode_attention_quant._launch.cache_clear()
        source = sixteen_bit_source(dtype) if quant is None else kernel_source(dtype, quant)
        ops, regs = ptx_opcodes(source)
        loop = f"{sass_tile_loop(source)[0]:>9}" if sass else f"{'':>9}"
        top = ", ".join(f"{k} {n}" for k, n in ops.most_common(6))
        name = (f"{str(dtype).split('.')[-1]} " + (f"int{quant.bits}/{quant.group_size}" if quant else "16-bit")
                + ("" if prefetch else " no prefetch*"))
        print(f"{name:>30} | {sum(ops.values()):>12} | {regs:>9} | {loop} | {top}")
    os.environ.pop("PAGEDMLX_QUANT_PREFETCH", None)
    print("* PAGEDMLX_QUANT_PREFETCH=0: each piece loaded where it is stored, in a loop of its own that the tile loop's "
          "count holds once (it runs once a piece: 4 a tile at D 128)")


if __name__ == "__main__":
    main()
