"""Offline throughput: pagedmlx's engine against mlx-lm's BatchGenerator, same model, same run.

For each batch size B, both engines get B prompts of --prompt-len random tokens and generate
--gen-len tokens each (greedy, EOS ignored). Reported per engine:
  decode tok/s  tokens per second over decode steps only (steady state, prefill excluded)
  e2e tok/s     all generated tokens over the whole wall time, prefill included
and the ratio pagedmlx / mlx-lm of each. Each cell is the median of --repeats runs.

  python scripts/bench_offline.py                        # random 8-layer 512-wide llama, float32
  python scripts/bench_offline.py --preset llama-8b --dtype bfloat16 --batch-sizes 1 64 256
  python scripts/bench_offline.py --model path/to/mlx-model
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

PRESETS = {
    "small": dict(hidden_size=512, num_hidden_layers=8, intermediate_size=1408, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=32000),
    "llama-8b": dict(hidden_size=4096, num_hidden_layers=32, intermediate_size=14336, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
}


def random_llama(preset: str, dtype: mx.Dtype):
    from mlx_lm.models import llama

    cfg = dict(model_type="llama", rms_norm_eps=1e-5, tie_word_embeddings=False, **PRESETS[preset])
    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs.from_dict(cfg))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def make_prompts(batch: int, prompt_len: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(batch)]


def run_pagedmlx(engine, prompts, gen_len: int) -> tuple[float, float]:
    from pagedmlx.request import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"b{time.monotonic_ns()}-{i}", p, params)
    decode_s, decode_tokens, generated = 0.0, 0, 0
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        tokens_before, sampled_before = engine.stats.num_tokens, engine.stats.num_sampled
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        new_tokens = engine.stats.num_tokens - tokens_before
        sampled = engine.stats.num_sampled - sampled_before
        generated += sampled
        if new_tokens == sampled:  # every scheduled token sampled: a pure decode step
            decode_s += dt
            decode_tokens += sampled
    total = time.perf_counter() - start
    return decode_tokens / decode_s, generated / total


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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="an mlx-lm model folder or hub name (default: a random llama preset)")
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32, 64, 128])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine

    dtype = getattr(mx, args.dtype)
    if args.model:
        from pagedmlx.loader import load_model

        model, _ = load_model(args.model)
        name = args.model
    else:
        model = random_llama(args.preset, dtype)
        name = f"random llama '{args.preset}' ({args.dtype})"
    vocab = model.args.vocab_size
    max_b = max(args.batch_sizes)
    tokens_per_seq = args.prompt_len + args.gen_len
    num_blocks = max_b * (-(-tokens_per_seq // args.block_size) + 1) + 8
    engine = LLMEngine(model, None, EngineConfig(
        block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=max_b,
        max_num_batched_tokens=max(2048, args.prompt_len), long_prefill_token_threshold=0,
        max_model_len=tokens_per_seq + 1, enable_prefix_caching=False))

    console = Console()
    console.print(f"[bold]bench_offline[/] {name} on {mx.default_device()}, {platform.machine()}, "
                  f"prompt {args.prompt_len}, gen {args.gen_len}, {time.strftime('%Y-%m-%d')}")
    # Warm up both (compilation, allocator).
    run_pagedmlx(engine, make_prompts(2, 16, vocab, 0), 4)
    run_mlx_lm(model, make_prompts(2, 16, vocab, 0), 4)

    rows = []
    for b in args.batch_sizes:
        ours, theirs = [], []
        for r in range(args.repeats):
            prompts = make_prompts(b, args.prompt_len, vocab, seed=r)
            theirs.append(run_mlx_lm(model, prompts, args.gen_len))
            ours.append(run_pagedmlx(engine, prompts, args.gen_len))
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        row = dict(batch=b, ours_decode=med(ours, 0), mlx_decode=med(theirs, 0),
                   ours_e2e=med(ours, 1), mlx_e2e=med(theirs, 1))
        rows.append(row)
        console.print(f"  B={b}: decode {row['ours_decode']:.0f} vs {row['mlx_decode']:.0f} tok/s")

    table = Table(title=f"decode throughput, {name}")
    for col in ("batch", "pagedmlx decode tok/s", "mlx-lm decode tok/s", "ratio",
                "pagedmlx e2e tok/s", "mlx-lm e2e tok/s", "ratio"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(str(r["batch"]), f"{r['ours_decode']:.0f}", f"{r['mlx_decode']:.0f}",
                      f"{r['ours_decode'] / r['mlx_decode']:.2f}", f"{r['ours_e2e']:.0f}", f"{r['mlx_e2e']:.0f}",
                      f"{r['ours_e2e'] / r['mlx_e2e']:.2f}")
    console.print(table)
    s = engine.stats
    console.print(f"pagedmlx host share of step time: {100 * s.host_fraction():.1f}% "
                  f"(schedule {1e3 * s.schedule_s / s.num_steps:.2f} ms, update {1e3 * s.update_s / s.num_steps:.2f} ms "
                  f"per step)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(model=name, device=str(mx.default_device()), rows=rows), indent=1))


if __name__ == "__main__":
    main()
