"""The quantized GEMM kernel (kernels/quantized_gemm.py) against MLX's quantized matmul and a bf16 matmul of the same
shape, per product of a model's widths and row count, on the device: microseconds a product (the median of repeats,
each a chain of products over enough weight copies to miss the L2 cache), the weight bytes drawn a second, and the
kernel's speed-up over MLX's product. --sweep also times every launch shape and prints the fastest; --write-config
keeps them as this GPU's tuned launches (kernels/launch_configs.py), which the engine then runs.

A chain's wall time is bound by the host's dispatch (tens of microseconds an MLX op on CUDA) wherever a product
takes less on the device, so where torch is installed (the GPU machine) the times are the device's own: CUPTI's
kernel durations through torch.profiler, summed over the chain. --wall times the chain instead.

  python scripts/bench/bench_quantized_gemm.py --bits 4 --rows 1 2 8 32 64 128 256 [--sweep]
  python scripts/bench/bench_quantized_gemm.py --bits 4 8 --rows 1 16 64 256 --repeats 1 --sweep --skip-mlx \
      --write-config pagedmlx/kernels/configs
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import re
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

from pagedmlx import platform
from pagedmlx.bench import cupti
from pagedmlx.kernels import launch_configs
from pagedmlx.kernels import quantized_gemm as qg
from pagedmlx.kernels.disk_cache import template_hash

# (N, K) of Llama-8B's products as the engine runs them: q/k/v merged (one-row steps), q and o, k and v, gate/up
# merged, down, the head
LLAMA_8B = [(6144, 4096), (4096, 4096), (1024, 4096), (28672, 4096), (4096, 14336), (128256, 4096)]
L2_MISS_BYTES = 256 << 20  # weight copies a chain cycles through: several times an H100's / H200's 50 MB L2


def timed(fn, calls: int, repeats: int, wall: bool = False) -> float:
    """Microseconds a call: the median over repeats of a chain of `calls` calls evaluated together; the device's
    kernel time where CUPTI can be read (device_us), else the chain's wall time."""
    mx.eval(fn(0))
    times = []
    for _ in range(repeats):
        if not wall and (us := device_us(lambda: mx.eval([fn(i) for i in range(calls)]))) is not None:
            times.append(us / calls)
            continue
        t0 = time.perf_counter()
        mx.eval([fn(i) for i in range(calls)])
        times.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(times)


def device_us(run) -> float | None:
    """Microseconds of kernels the device ran for run() (CUPTI); None without torch or CUDA."""
    kernels = cupti.kernel_times(run)
    return None if kernels is None else sum(us for us, _, _ in kernels)


def launches(rows: int) -> list[qg.Launch]:
    """Launch shapes worth timing: the untuned row tiles or a half or a quarter as many, 4, 8 or 16 warps, 1-8
    splits of K, 2 to MAX_STAGES chunks in flight."""
    mt = qg.row_tiles(rows)
    shapes = itertools.product(sorted({mt, max(1, mt // 2), max(1, mt // 4)}), (4, 8, 16), (1, 2, 4, 8),
                               range(2, qg.MAX_STAGES + 1))
    return [qg.Launch(*s) for s in shapes if s[1] < 16 or s[0] * s[3] < 32]  # else past 64K registers a block


def sweep(x: mx.array, ws: list, bits: int, group_size: int, launches: list[qg.Launch], calls: int, repeats: int,
          wall: bool) -> list[tuple[float, qg.Launch]]:
    """(microseconds a product, launch) for each launch shape that builds and runs, fastest first. Under CUPTI one
    profile takes every shape's chains (a profile's start costs more than a chain), each variant's kernels told
    apart by its template in their name."""
    def product(i: int, launch: qg.Launch) -> mx.array:
        return qg.quantized_gemm(x, *ws[i % len(ws)], bits, group_size, launch=launch)

    def chain(launch: qg.Launch) -> list[mx.array]:
        return [product(i, launch) for i in range(calls)]

    runnable = []
    for launch in launches:
        try:
            mx.eval(product(0, launch))
            runnable.append(launch)
        except Exception as exc:  # noqa: BLE001 - a shape past the device's registers or shared memory
            print(f"  {launch}: {str(exc).splitlines()[0][:120]}")
    every = [L for _ in range(repeats) for L in runnable]
    kernels = None if wall else cupti.kernel_times(lambda: [mx.eval(chain(L)) for L in every])
    if kernels is None:
        return sorted(((timed(lambda i, L=launch: product(i, L), calls, repeats, True), launch) for launch in runnable),
                      key=lambda t: t[0])
    times = []
    for launch in runnable:
        tag = re.compile(re.escape(template_hash(qg._template(x.dtype, bits, group_size, launch))) + r"(?![0-9_])")
        hits = [(us, count) for us, count, name in kernels if tag.search(name)]
        if hits:
            times.append((sum(us for us, _ in hits) / sum(c for _, c in hits), launch))
    return sorted(times, key=lambda t: t[0])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bits", type=int, nargs="+", default=[4, 8])
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 2, 8, 16, 32, 64, 128, 256])
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16"])
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--sweep", action="store_true", help="time every launch shape too, and print the best")
    p.add_argument("--wall", action="store_true", help="wall time of a chain (the host's dispatch included)")
    p.add_argument("--skip-mlx", action="store_true", help="no MLX quantized matmul column: on a GPU's first run MLX's "
                   "JIT builds its kernels for each row count, tens of seconds each")
    p.add_argument("--write-config", metavar="DIR", help="with --sweep: write the fastest launches as this GPU's "
                   "tuned config into DIR (kernels/launch_configs.py; the package's own: pagedmlx/kernels/configs)")
    args = p.parse_args()
    platform.use_kernel_cache()  # as the engine: every variant compiled once (prebuild) and kept on disk
    dtype = getattr(mx, args.dtype)
    timing = "wall time of chains" if args.wall or device_us(lambda: None) is None else "device time (CUPTI)"
    print(f"{mx.default_device()}  {args.dtype}  group size {args.group_size}  {timing}")
    print(f"{'bits':>4} {'N':>6} {'K':>6} {'rows':>4} {'MLX us':>8} {'bf16 us':>8} {'ours us':>8} {'GB/s':>6} "
          f"{'vs MLX':>7} {'vs bf16':>7} {'err':>8}" + ("  fastest launches (us)" if args.sweep else ""))
    start = time.perf_counter()
    for bits in args.bits:  # every variant compiled before anything is timed
        shapes = [(n, k, bits, args.group_size) for n, k in LLAMA_8B]
        qg.prebuild(shapes, dtype, args.rows)
        if args.sweep:
            qg.prebuild(shapes, dtype, args.rows, launches=sorted({L for r in args.rows for L in launches(r)}, key=str))
    print(f"  kernel variants ready after {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
    swept: dict = {}
    for bits, (n, k) in itertools.product(args.bits, LLAMA_8B):
        wbytes = n * k * bits // 8
        copies = max(1, -(-L2_MISS_BYTES // wbytes))
        ws = [mx.quantize(mx.random.normal((n, k), dtype, scale=k ** -0.5), group_size=args.group_size, bits=bits)
              for _ in range(copies)]
        dense = [mx.random.normal((n, k), dtype, scale=k ** -0.5) for _ in range(max(1, -(-copies // 4)))]
        reference = qg.reference_product(*ws[0], bits, args.group_size)  # the load-time check's: no JIT of MLX's
        mx.eval(ws, dense)
        calls = max(copies, 16)
        for rows in args.rows:
            x = mx.random.normal((rows, k), dtype)
            mlx_us = float("nan") if args.skip_mlx else timed(
                lambda i: mx.quantized_matmul(x, *ws[i % copies], transpose=True, group_size=args.group_size,
                                              bits=bits), calls, args.repeats, args.wall)
            bf16_us = timed(lambda i: x @ dense[i % len(dense)].T, calls, args.repeats, args.wall)
            ours_us = timed(lambda i: qg.quantized_gemm(x, *ws[i % copies], bits, args.group_size), calls,
                            args.repeats, args.wall)
            want = reference(x)
            got = qg.quantized_gemm(x, *ws[0], bits, args.group_size).astype(mx.float32)
            err = (mx.abs(got - want).max() / mx.abs(want).max()).item()
            line = (f"{bits:>4} {n:>6} {k:>6} {rows:>4} {mlx_us:>8.1f} {bf16_us:>8.1f} {ours_us:>8.1f} "
                    f"{wbytes / ours_us / 1e3:>6.0f} {mlx_us / ours_us:>6.2f}x {bf16_us / ours_us:>6.2f}x {err:>8.1e}")
            if args.sweep:
                ranked = sweep(x, ws, bits, args.group_size, launches(rows), calls, 3, args.wall)
                swept.setdefault((n, k, bits, args.group_size), {})[rows] = ranked
                line += "  " + ", ".join(f"mt{L.mt} wn{L.wn} ks{L.ks} st{L.stages} {us:.1f}" for us, L in ranked[:4])
            print(line + f"  [{time.perf_counter() - start:.0f} s]", flush=True)
        if args.sweep and args.write_config:  # after each shape: a run cut short keeps what it tuned
            print(f"  tuned config: {write_config(swept, args)}", flush=True)


def tuned_launches(by_rows: dict[int, list[tuple[float, qg.Launch]]]) -> Optional[dict]:
    """One weight shape's tuned launches from its sweep: the splits of K (one for every row count, so that a row's
    sums never depend on the step's rows) whose fastest launches lose the least against each row count's fastest,
    relative time summed over the row counts; then each row count's fastest launch with those splits."""
    def best(ranked, ks):
        return min(((us, L) for us, L in ranked if L.ks == ks), default=None, key=lambda t: t[0])

    common = set.intersection(*({L.ks for _, L in ranked} for ranked in by_rows.values()))
    if not common:
        return None
    ks = min(common, key=lambda ks: sum(best(ranked, ks)[0] / ranked[0][0] for ranked in by_rows.values()))
    rows = {str(r): [best(ranked, ks)[1].mt, best(ranked, ks)[1].wn, best(ranked, ks)[1].stages]
            for r, ranked in sorted(by_rows.items())}
    return {"ks": ks, "rows": rows}


def write_config(swept: dict, args: argparse.Namespace) -> Path:
    name, capability = launch_configs.device()
    config = {"kernel": "quantized_gemm", "device_name": name, "compute_capability": capability,
              "mlx": mx.__version__, "dtype": args.dtype, "tuned": datetime.date.today().isoformat(),
              "command": "python scripts/bench/bench_quantized_gemm.py " + " ".join(sys.argv[1:]),
              "shapes": {",".join(map(str, shape)): tuned for shape, by_rows in swept.items()
                         if (tuned := tuned_launches(by_rows)) is not None}}
    path = Path(args.write_config) / launch_configs.file_name("quantized_gemm", name)
    path.parent.mkdir(parents=True, exist_ok=True)
    text = re.sub(r"\[\s*([0-9,\s]+?)\s*\]", lambda m: "[" + ", ".join(m.group(1).split()).replace(",,", ",") + "]",
                  json.dumps(config, indent=1))  # a launch's [mt, wn, st] on one line
    path.write_text(text + "\n")
    return path


if __name__ == "__main__":
    main()
