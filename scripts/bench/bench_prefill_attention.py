"""Prefill attention over pages, one layer call: the paged prefill kernel (CUDA) against the grouped
SDPA path it replaces (queries and pages gathered, MLX's attention per padded shape), for the step
shapes the prefill benchmarks meet. Both read the same pages through the same step metadata
(attention_metadata.StepMetadata, built from a SchedulerOutput as the runner builds it).

Prints per case milliseconds per layer call (timed_chain: --layers calls in one graph, median of
--iters), the kernel's attention TFLOP/s (causal FLOPs actually needed) and the ratio SDPA / kernel.
--kv-cache-dtype int8 / int4: both over quantized pages (the kernel dequantizing its tiles, the SDPA path
gathering and dequantizing), and the kernel over the same pages in 16 bits beside them.
Each SDPA shape is run once before timing (its cuDNN graph built), as start-up's warm-up would.

  python scripts/bench/bench_prefill_attention.py              # Llama-8B heads, bf16, on the GPU machine
  python scripts/bench/bench_prefill_attention.py --kv-cache-dtype int8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.runner.attention import paged_attention  # noqa: E402
from pagedmlx.runner.attention_metadata import StepMetadata, sdpa_shape_quantum  # noqa: E402
from pagedmlx.kernels import prefill_attention  # noqa: E402
from pagedmlx.kernels.build import gpu_backend  # noqa: E402
from pagedmlx.kv_cache_dtype import layer_quant  # noqa: E402
from pagedmlx.runner.kv_quant import QuantizedPages  # noqa: E402
from pagedmlx.scheduler_output import SchedulerOutput  # noqa: E402
from scripts.bench.timing import timed_chain  # noqa: E402

# name -> [(prefix tokens, new tokens)] of the step's prefill segments
CASES = {
    "mixed: 256 at 16k": [(16128, 256)],
    "mixed: 256 at 2k": [(2048, 256)],
    "1x32k: 8192 at 0": [(0, 8192)],
    "1x32k: 8192 at 24k": [(24576, 8192)],
    "512 at 8k": [(8192, 512)],
    "4 x 512 at 2k": [(2048, 512)] * 4,
    "8x8k: 8 x 1024 at 4k": [(4096, 1024)] * 8,
    "32x4k: 32 x 256 at 2k": [(2048, 256)] * 32,
    "32x4k: 30 x 256 + 2 x 32": [(1024, 256)] * 30 + [(3840, 32)] * 2,
}


def step(segments: list[tuple[int, int]], block_size: int) -> SchedulerOutput:
    """A prefill-only step: each segment its own pages, laid out one request after another."""
    lens = [p + n for p, n in segments]
    nb = max(-(-x // block_size) for x in lens)
    table = np.arange(len(segments) * nb, dtype=np.int32).reshape(len(segments), nb)
    qsl = np.concatenate([[0], np.cumsum([n for _, n in segments])]).astype(np.int32)
    positions = np.concatenate([np.arange(p, p + n) for p, n in segments]).astype(np.int32)
    rows = np.repeat(np.arange(len(segments)), [n for _, n in segments])
    slots = table[rows, positions // block_size] * block_size + positions % block_size
    return SchedulerOutput(req_ids=[str(i) for i in range(len(segments))], num_scheduled_tokens=[n for _, n in segments],
                           num_decodes=0, input_ids=np.zeros(len(positions), np.int32), positions=positions,
                           slot_mapping=slots[None].astype(np.int32), query_start_loc=qsl,
                           seq_lens=np.array(lens, np.int32), block_table=table[None],
                           logits_indices=qsl[1:] - 1, sampled_req_ids=[])


def causal_flops(segments: list[tuple[int, int]], H: int, D: int) -> float:
    """Q K^T and P V over the keys each query sees: 4 D flops per (query, key, head)."""
    return sum(4 * D * H * (n * p + n * (n + 1) / 2) for p, n in segments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16", choices=["float16", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "int4"])
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    prefill_attention.PREFILL_KERNEL_MAX_QUERY = 1 << 30  # time the kernel on every shape, not only those it takes
    H, n_kv, D, bs, dt = args.heads, args.kv_heads, args.head_dim, args.block_size, getattr(mx, args.dtype)
    backend = gpu_backend()
    console = Console()
    console.print(f"bench_prefill_attention on {mx.default_device()} ({backend}), H={H} kv={n_kv} D={D} {args.dtype}")
    quant = layer_quant(args.kv_cache_dtype, None, D, D)
    table = Table("case", "queries", "kernel ms", "kernel TFLOP/s", "SDPA groups ms", "SDPA / kernel",
                  *(["16-bit kernel ms", "kernel / 16-bit"] if quant else []))
    for name in args.cases:
        segments = CASES[name]
        so = step(segments, bs)
        num_blocks = int(so.block_table.max()) + 1
        k_pages = mx.random.normal((num_blocks, n_kv, bs, D)).astype(dt)
        v_pages = mx.random.normal((num_blocks, n_kv, bs, D)).astype(dt)
        q = mx.random.normal((so.total_num_scheduled_tokens, H, 1, D)).astype(dt)
        mx.eval(k_pages, v_pages, q)
        pages = {"16": (k_pages, v_pages)}
        if quant:
            pages["q"] = tuple(QuantizedPages(*mx.quantize(p, group_size=quant.group_size, bits=quant.bits), quant)
                               for p in (k_pages, v_pages))
            mx.eval([(p.packed, p.scales, p.biases) for p in pages["q"]])
        times = {}
        runs = [("kernel", [(n_kv, H // n_kv)], "q" if quant else "16"), ("groups", None, "q" if quant else "16")]
        for path, heads, kind in runs + ([("kernel16", [(n_kv, H // n_kv)], "16")] if quant else []):
            if path.startswith("kernel") and backend != "cuda":
                continue
            md = StepMetadata.build(so, bs, [None], backend=backend, sdpa_quantum=sdpa_shape_quantum(backend),
                                    prefill_heads=heads).groups[0]
            kp, vp = pages[kind]
            times[path] = timed_chain(lambda x, md=md, kp=kp, vp=vp: paged_attention(x, kp, vp, md, D ** -0.5), q,
                                      args.layers, args.iters)
        flops = causal_flops(segments, H, D)
        k, g = times.get("kernel"), times["groups"]
        k16 = times.get("kernel16")
        table.add_row(name, str(so.total_num_scheduled_tokens), f"{1e3 * k:.3f}" if k else "-",
                      f"{flops / k / 1e12:.0f}" if k else "-", f"{1e3 * g:.3f}", f"{g / k:.2f}x" if k else "-",
                      *([f"{1e3 * k16:.3f}" if k16 else "-", f"{k / k16:.2f}x" if k and k16 else "-"] if quant else []))
    console.print(table)


if __name__ == "__main__":
    main()
