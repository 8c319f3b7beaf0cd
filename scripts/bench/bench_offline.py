"""Offline throughput: pagedmlx's engine against mlx-lm's BatchGenerator, same model, same run.

For each batch size B, both engines get B prompts of --prompt-len random tokens and generate
--gen-len tokens each (greedy, EOS ignored). Reported per engine:
  decode tok/s  tokens per second over decode steps only (steady state, prefill excluded)
  e2e tok/s     all generated tokens over the whole wall time, prefill included
and the ratio pagedmlx / mlx-lm of each. Each cell is the median of --repeats runs. At batch 1 each
repeat also runs mlx-lm's generate_step (single stream) right after pagedmlx's run, and the last line
compares the two (medians over the interleaved runs, and the median of the runs' ratios).

  python scripts/bench/bench_offline.py                        # random 8-layer 512-wide llama, float32
  python scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --batch-sizes 1 64 256
  python scripts/bench/bench_offline.py --preset llama-8b --quantization 4bit --batch-sizes 1 64 256
  python scripts/bench/bench_offline.py --preset gemma3-27b-16l --dtype bfloat16 --batch-sizes 1 --repeats 5
  python scripts/bench/bench_offline.py --preset gemma3-27b-16l --dtype bfloat16 --batch-sizes 1 64   # sliding windows
  python scripts/bench/bench_offline.py --model path/to/mlx-model
  python scripts/bench/bench_offline.py --arch qwen3.5-27b-16l --dtype bfloat16 --batch-sizes 1 64 --prefill-len 2048
"""

from __future__ import annotations

import argparse
import logging
import dataclasses
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.presets import PRESETS, random_model  # noqa: E402,F401 - the other scripts import them from here
from pagedmlx.bench.presets import parse_quantization  # noqa: E402

def run_prefill(engine, model, prompt: list[int]) -> tuple[float, float]:
    """(pagedmlx, mlx-lm generate_step) prompt tokens per second: one prompt to its first token."""
    from mlx_lm.generate import generate_step

    from pagedmlx.sampling_params import SamplingParams

    engine.add_request(f"p{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    ours = len(prompt) / (time.perf_counter() - t)
    t = time.perf_counter()
    next(generate_step(mx.array(prompt), model, max_tokens=1))
    return ours, len(prompt) / (time.perf_counter() - t)


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def run_pagedmlx(engine, prompts, gen_len: int, loras=None) -> tuple[float, float, dict]:
    """(decode tok/s, end-to-end tok/s, host ms a step by phase) of one batch; loras[i]: request i's
    LoRARequest (bench_lora.py; None: the base model)."""
    from pagedmlx.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params, lora_request=loras[i] if loras else None)
    decode_s, decode_tokens, generated = 0.0, 0, 0
    s0 = dataclasses.replace(engine.stats)
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens_before, sampled_before = engine.stats.num_tokens, engine.stats.num_sampled
        t = time.perf_counter()
        outputs = engine.step()
        dt = time.perf_counter() - t
        for out in outputs:  # a failed step finishes its requests early: never time those
            if out.finished and len(out.token_ids) != gen_len:
                raise SystemExit(f"request {out.request_id} ended after {len(out.token_ids)} of {gen_len} tokens "
                                 f"({out.finish_reason}): see the log above")
        new_tokens = engine.stats.num_tokens - tokens_before
        sampled = engine.stats.num_sampled - sampled_before
        generated += sampled
        if new_tokens == sampled:  # every scheduled token sampled: a pure decode step
            decode_s += dt
            decode_tokens += sampled
    total = time.perf_counter() - start
    s1, n = engine.stats, max(engine.stats.num_steps - s0.num_steps, 1)
    host = {k: 1e3 * (getattr(s1, k) - getattr(s0, k)) / n for k in ("schedule_s", "build_s", "wait_s", "update_s")}
    return decode_tokens / decode_s, generated / total, host


def run_mlx_lm(model, prompts, gen_len: int) -> tuple[float, float]:
    from mlx_lm.generate import BatchGenerator

    gen = BatchGenerator(model, max_tokens=gen_len, completion_batch_size=len(prompts),
                         prefill_batch_size=min(len(prompts), 8))
    start = time.perf_counter()
    with gen.stats() as stats:
        gen.insert(prompts, max_tokens=[gen_len] * len(prompts))
        generated = 0
        while True:
            responses = gen.next_generated()
            if not responses:
                break
            generated += len(responses)
            if all(r.finish_reason is not None for r in responses) and generated >= gen_len * len(prompts):
                break
    total = time.perf_counter() - start
    gen.close()
    return stats.generation_tokens / stats.decode_time, generated / total


def run_generate_step(model, prompt, gen_len: int) -> float:
    """mlx-lm's single-stream generation: decode tok/s after the first token."""
    from mlx_lm.generate import generate_step

    times = []
    t = time.perf_counter()
    for (_, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=gen_len), range(gen_len)):
        now = time.perf_counter()
        times.append(now - t)
        t = now
    return (len(times) - 1) / sum(times[1:])


def measure_machine() -> tuple[float, float]:
    """(copy bandwidth in bytes/s, matmul FLOP/s), measured now on the default device
    (bf16 on a GPU, float32 on the CPU)."""
    from pagedmlx.bench.timing import measure_bandwidth, timed

    gpu = mx.default_device() == mx.gpu
    n = 8192 if gpu else 1024
    a = mx.random.normal((n, n)).astype(mx.bfloat16 if gpu else mx.float32)
    mx.eval(a)
    return measure_bandwidth(2.0 if gpu else 0.25), 2 * n**3 / timed(lambda: a @ a, 10)


def roofline_step(model, batch: int, context: int, bw: float, flops: float) -> tuple[float, float, float]:
    """(bytes, FLOPs, ideal seconds) of one decode step: weights read once, each sequence's KV read
    once; matmul FLOPs 2 x params x batch plus attention."""
    from mlx.utils import tree_flatten

    args = model.args
    params = sum(v.size for k, v in tree_flatten(model.parameters()) if "embed_tokens" not in k or
                 getattr(args, "tie_word_embeddings", False))
    weight_bytes = sum(v.nbytes for k, v in tree_flatten(model.parameters()) if "embed_tokens" not in k or
                       getattr(args, "tie_word_embeddings", False))
    head_dim = getattr(args, "head_dim", None) or args.hidden_size // args.num_attention_heads
    itemsize = next(iter(v for _, v in tree_flatten(model.parameters()))).dtype.size
    kv_per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * head_dim * itemsize
    kv_bytes = batch * context * kv_per_token
    total_bytes = weight_bytes + kv_bytes
    total_flops = (2 * params * batch
                   + 4 * batch * context * args.num_hidden_layers * args.num_attention_heads * head_dim)
    return total_bytes, total_flops, max(total_bytes / bw, total_flops / flops)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an mlx-lm model folder or hub name (default: a random llama preset)")
    ap.add_argument("--preset", "--arch", dest="preset", default="small", choices=PRESETS,
                    help="a random model: llama shapes, gemma3 (sliding windows), qwen3.5 (recurrent state)")
    ap.add_argument("--prefill-len", type=int, default=0, help="also time one prompt of this many tokens to its "
                                                                "first token, against generate_step")
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--quantization", help="the preset's weights quantized (affine, mlx.nn.quantize): 4bit, 8bit, "
                                           "4bit-g128, 4bit-head8 (embeddings and LM head at 8 bits); the dtype is "
                                           "the scales' and activations'")
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "int4"],
                    help="EngineConfig.kv_cache_dtype: pagedmlx's pages (mlx-lm's caches stay 16-bit)")
    ap.add_argument("--json", help="also write the rows to this file")
    ap.add_argument("--no-async", action="store_true", help="step in lockstep (no host/device overlap)")
    ap.add_argument("--ab-async", action="store_true",
                    help="also run every batch in lockstep, right after the async run (same engine)")
    ap.add_argument("--roofline", action="store_true", help="measure the machine and print each step's ideal time")
    ap.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.compile_decode: decode steps replayed through mx.compile (CUDA; default: "
                         "steps of at most 8 requests)")
    ap.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.merge_projections: q/k/v and gate/up one matmul each (default: on GPU "
                         "backends); mlx-lm's runs keep the separate modules either way")
    ap.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.skinny_gemm: products of 2-5 rows as pagedmlx's kernel (default: on CUDA)")
    ap.add_argument("--quantized-gemm", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.quantized_gemm: quantized products of 2-256 rows as pagedmlx's kernel "
                         "(default: on CUDA)")
    ap.add_argument("--skip-peer", action="store_true", help="run pagedmlx only (for sweeps of its own settings)")
    ap.add_argument("--peer-max-batch", type=int, help="run mlx-lm at batch sizes up to this only (larger: pagedmlx "
                                                      "only, mlx-lm's cells nan)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")  # the engine's start-up lines

    from rich.console import Console
    from rich.table import Table

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine
    from pagedmlx.engine.core_info import start_line

    dtype = getattr(mx, args.dtype)
    if args.model:
        from pagedmlx.loaders.loader import load_model

        model, _ = load_model(args.model)
        name = args.model
    else:
        quant = parse_quantization(args.quantization)
        model = random_model(args.preset, dtype, quantization=quant)
        name = (f"random {PRESETS[args.preset]['model_type']} '{args.preset}' ({args.dtype}"
                f"{f', {quant.suffix}' if quant else ''})")
    vocab = getattr(model.args, "vocab_size", None) or model.args.text_config["vocab_size"]
    max_b = max(args.batch_sizes)
    tokens_per_seq = max(args.prompt_len + args.gen_len, args.prefill_len + 1)
    num_blocks = max_b * (-(-tokens_per_seq // args.block_size) + 1) + 8
    console = Console()
    console.print(f"[bold]bench_offline[/] {name}: starting the engine (its load-time checks; a first run on this "
                  "machine also compiles their kernels)")
    t_engine = time.perf_counter()
    engine = LLMEngine(model, None, EngineConfig(
        block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max_b,
        max_num_batched_tokens=max(2048, args.prompt_len, args.prefill_len), long_prefill_token_threshold=0,
        max_model_len=tokens_per_seq + 1, enable_prefix_caching=False,
        async_scheduling=False if args.no_async else (True if args.ab_async else None),
        compile_decode=args.compile_decode, merge_projections=args.merge_projections,
        kv_cache_dtype=args.kv_cache_dtype, skinny_gemm=args.skinny_gemm,
        quantized_gemm=args.quantized_gemm))

    startup_s = time.perf_counter() - t_engine  # the load-time checks and their kernels' builds
    console.print(f"[bold]bench_offline[/] {name} on {mx.default_device()}, {platform.machine()}, "
                  f"prompt {args.prompt_len}, gen {args.gen_len}, {time.strftime('%Y-%m-%d')}, "
                  f"{'async' if engine.async_scheduling else 'lockstep'} steps"
                  f"{', compiled decode steps' if getattr(engine.runner, 'compiled_decode', None) else ''}"
                  f"{', projections merged' if getattr(engine.runner, 'merged_groups', 0) else ''}"
                  f"{f', {args.kv_cache_dtype} pages' if args.kv_cache_dtype != 'auto' else ''}")
    # Warm up both (compilation, allocator). pagedmlx's warm-up has full-length prompts, so that its steps
    # compile the kernels the timed prefill steps use (a kernel's first use is a JIT compile on CUDA).
    run_pagedmlx(engine, make_prompts(min(max_b, 8), args.prompt_len, vocab, 99), 4)
    if not args.skip_peer:
        run_mlx_lm(model, make_prompts(2, 16, vocab, 0), 4)
    mlx_env = " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith(("MLX_", "PAGEDMLX_")))
    console.print(f"  MLX environment: {mlx_env or '(defaults)'}; engine start-up {startup_s:.1f} s "
                  f"(runner {start_line(engine)})", soft_wrap=True)

    single_stream = None
    if 1 in args.batch_sizes and not args.skip_peer:  # a warm-up; batch 1's runs below time it again
        warm = run_generate_step(model, make_prompts(1, args.prompt_len, vocab, 9)[0], args.gen_len)
        console.print(f"  mlx-lm generate_step single stream (warm-up run): {warm:.0f} tok/s")
    prefill = None
    if args.prefill_len:
        run_prefill(engine, model, make_prompts(1, 64, vocab, 7)[0])  # warm-up
        ours_pf, theirs_pf = run_prefill(engine, model, make_prompts(1, args.prefill_len, vocab, 8)[0])
        console.print(f"  prefill {args.prefill_len} tokens: pagedmlx {ours_pf:.0f} tok/s, mlx-lm generate_step "
                      f"{theirs_pf:.0f} tok/s (ratio {ours_pf / theirs_pf:.2f})")
        prefill = dict(tokens=args.prefill_len, pagedmlx=ours_pf, generate_step=theirs_pf)
    bw = flops = None
    if args.roofline:
        bw, flops = measure_machine()
        console.print(f"  measured: copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s")

    rows = []
    for b in args.batch_sizes:
        ours, theirs, lockstep, single = [], [], [], []
        for r in range(args.repeats):
            prompts = make_prompts(b, args.prompt_len, vocab, seed=r)
            peer = not args.skip_peer and (args.peer_max_batch is None or b <= args.peer_max_batch)
            theirs.append(run_mlx_lm(model, prompts, args.gen_len) if peer else (float("nan"),) * 2)
            ours.append(run_pagedmlx(engine, prompts, args.gen_len))
            if b == 1 and not args.skip_peer:  # interleaved with ours: generate_step, the single-stream peer
                single.append(run_generate_step(model, prompts[0], args.gen_len))
            if args.ab_async:
                engine.async_scheduling = False
                lockstep.append(run_pagedmlx(engine, prompts, args.gen_len))
                engine.async_scheduling = True
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        row = dict(batch=b, ours_decode=med(ours, 0), mlx_decode=med(theirs, 0),
                   ours_e2e=med(ours, 1), mlx_e2e=med(theirs, 1), host_ms=ours[-1][2])
        if lockstep:
            row.update(lockstep_decode=med(lockstep, 0), lockstep_host_ms=lockstep[-1][2])
        if single:
            single_stream = statistics.median(single)
            row.update(generate_step=single_stream, generate_step_runs=single,
                       generate_step_ratio=statistics.median(o[0] / g for o, g in zip(ours, single)))
        if bw:
            nbytes, nflops, ideal = roofline_step(model, b, args.prompt_len + args.gen_len // 2, bw, flops)
            row.update(step_ms=1e3 * b / row["ours_decode"], ideal_ms=1e3 * ideal, step_gb=nbytes / 1e9,
                       step_gflop=nflops / 1e9)
        rows.append(row)
        console.print(f"  B={b}: decode {row['ours_decode']:.0f} vs {row['mlx_decode']:.0f} tok/s"
                      + (f" (lockstep {row['lockstep_decode']:.0f})" if lockstep else ""))

    table = Table(title=f"decode throughput, {name}")
    for col in ("batch", "pagedmlx decode tok/s", "mlx-lm decode tok/s", "ratio",
                "pagedmlx e2e tok/s", "mlx-lm e2e tok/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['ours_decode']:.0f}", f"{r['mlx_decode']:.0f}",
                      f"{r['ours_decode'] / r['mlx_decode']:.2f}", f"{r['ours_e2e']:.0f}", f"{r['mlx_e2e']:.0f}",
                      f"{r['ours_e2e'] / r['mlx_e2e']:.2f}")
    console.print(table)
    if single_stream:
        r1 = next(r for r in rows if r["batch"] == 1)
        console.print(f"batch 1: pagedmlx {r1['ours_decode']:.0f} tok/s vs mlx-lm generate_step "
                      f"{single_stream:.0f} tok/s, medians of {args.repeats} interleaved runs (ratio of medians "
                      f"{r1['ours_decode'] / single_stream:.2f}, median of the runs' ratios "
                      f"{r1['generate_step_ratio']:.2f})")
    if bw:
        roof = Table(title="roofline (decode step, context = prompt + gen/2)")
        for col in ("batch", "GB read", "GFLOP", "ideal ms", "pagedmlx ms", "achieved"):
            roof.add_column(col, justify="right")
        for r in rows:
            roof.add_row(str(r["batch"]), f"{r['step_gb']:.2f}", f"{r['step_gflop']:.0f}", f"{r['ideal_ms']:.2f}",
                         f"{r['step_ms']:.2f}", f"{100 * r['ideal_ms'] / r['step_ms']:.0f}%")
        console.print(roof)
    host = Table(title="pagedmlx host time per step, ms (build: graph + dispatch; wait: for the device)")
    for col in ("batch", "mode", "schedule", "build", "wait", "update"):
        host.add_column(col, justify="right")
    for r in rows:
        for mode, key in (("async" if engine.async_scheduling else "lockstep", "host_ms"),
                          ("lockstep", "lockstep_host_ms")):
            if key in r:
                h = r[key]
                host.add_row(str(r["batch"]), mode,
                             *(f"{h[k]:.2f}" for k in ("schedule_s", "build_s", "wait_s", "update_s")))
    console.print(host)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=name, device=str(mx.default_device()), rows=rows,
                                                   single_stream=single_stream, bandwidth=bw, matmul=flops,
                                                   prefill=prefill, startup_s=startup_s), indent=1))


if __name__ == "__main__":
    main()
