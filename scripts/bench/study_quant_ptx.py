"""Study (static, no GPU): the quantized tensor-core decode kernel's PTX, instruction by opcode, and ptxas's
register count, for the Llama-8B head shape (D 128, 4 query heads a KV head) in each page format. nvcc builds
the very source MLX's CUDA backend would build for the call (tests/nvcc_utils.py records it), for the H200
(sm_90). Its 16-byte pieces are unrolled, so the static count tracks the tile loop's work; it is not a
timing: the GPU's step times are bench_kv_quant.py --speed's.

  python scripts/bench/study_quant_ptx.py          # needs nvcc (CUDA 12+) on the PATH
"""

from __future__ import annotations

import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from nvcc_utils import MLX_HEADER, RecordingCudaKernel  # noqa: E402

from pagedmlx.kernels import build, decode_attention_quant  # noqa: E402
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


def main() -> None:
    build.make_kernel = RecordingCudaKernel
    print("quantized tensor-core decode kernel, D 128, G 4, sm_90 PTX (static)")
    print(f"{'pages':>22} | {'instructions':>12} | {'registers':>9} | most frequent")
    for dtype in (mx.bfloat16, mx.float16):
        for quant in (KVQuant(8, 128), KVQuant(4, 64)):
            ops, regs = ptx_opcodes(kernel_source(dtype, quant))
            top = ", ".join(f"{k} {n}" for k, n in ops.most_common(6))
            name = f"{str(dtype).split('.')[-1]} int{quant.bits}/{quant.group_size}"
            print(f"{name:>22} | {sum(ops.values()):>12} | {regs:>9} | {top}")


if __name__ == "__main__":
    main()
