"""Quantized KV pages (kv_cache_dtype int8 / int4) against full-precision pages.

Quality (default; the real SmolLM2-135M-Instruct, float32 on the CPU unless --dtype): per kv_cache_dtype,
the perplexity of a fixed text (prompt logprobs through the engine, 128-token prefill chunks so that later
chunks read earlier ones from the pages), greedy agreement with the `auto` pages over --max-tokens
generated tokens for a few chat prompts (teacher-forced: along auto's answers, how often these pages'
top-1 token is auto's; free-running: tokens equal before the first difference, and position by position),
and the pool's capacity in tokens for the same memory (this model, and in bf16).

Speed (--speed, for the GPU): decode steps of a random Llama-8B (bf16) at --batch sequences of --context
tokens, pages filled at random (a step's cost does not depend on the values), auto vs int8 vs int4 pages,
median step time and its ratio to auto; then, for the KV memory that auto pages need at the largest
--batch, the batch that int8 / int4 pages fit in it, and its step time and tok/s. --variants: instead, the
tensor-core kernel's int8 variants (VARIANTS) against auto pages, interleaved over --repeats rounds in one
process, the median of each round's ratio.

    python scripts/bench/bench_kv_quant.py                              # quality, CPU
    python scripts/bench/bench_kv_quant.py --speed --batch 64 256       # GPU
    python scripts/bench/bench_kv_quant.py --speed --variants --batch 64 256 --repeats 3   # int8 kernel A/B
    python scripts/bench/bench_kv_quant.py --formats auto int4 int4+rot int8+rot   # kv_cache_rotate's quality
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

DTYPES = ("auto", "int8", "int4")
# --variants' rows: (kv_cache_dtype, environment, decode splits' target thread groups x)
VARIANTS = {"auto": ("auto", {}, 1), "int8": ("int8", {}, 1),
            "int8-dequant": ("int8", {"PAGEDMLX_QUANT_AFTER": "0"}, 1),  # dequantized tiles, not scale-after
            "int8-noprefetch": ("int8", {"PAGEDMLX_QUANT_PREFETCH": "0"}, 1),
            "int8-dequant-noprefetch": ("int8", {"PAGEDMLX_QUANT_AFTER": "0", "PAGEDMLX_QUANT_PREFETCH": "0"}, 1),
            "int8-splits2": ("int8", {}, 2),
            "int4": ("int4", {}, 1)}

TEXT = (
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based ink and a wooden screw press into a system that could produce books far "
    "faster than scribes. Before this, most books in Europe were copied by hand, a slow and expensive process "
    "that kept written knowledge in the hands of a few. Within fifty years of Gutenberg's first Bible, printing "
    "shops had opened in more than two hundred cities, and millions of volumes were in circulation. The effects "
    "were wide. Scholars could compare identical copies of a text, which made errors easier to find and "
    "correct. Pamphlets spread news and arguments quickly, and the Reformation owed much of its reach to cheap "
    "printed sheets. Spelling and grammar slowly became more uniform as printers settled on common forms. "
    "Scientific results could be shared across borders, so that an observation made in Italy might be tested "
    "in England within a few months. Not everyone welcomed the change. Some feared that too many books would "
    "confuse readers, and authorities in several countries tried to control what could be printed through "
    "licences and censorship. Yet the number of presses kept growing. By the eighteenth century, newspapers "
    "appeared daily in major cities, lending libraries let people borrow what they could not afford to buy, "
    "and literacy rates rose steadily. The industrial revolution brought steam-powered presses and machine-made "
    "paper, which lowered costs again and made mass-market books and magazines possible. In the twentieth "
    "century, offset printing and later digital typesetting changed how pages were prepared, but the basic idea "
    "remained the same: make many identical copies of a text so that many people can read it. Today, screens "
    "carry much of what presses once did, yet printed books remain common, and the habits of reading, citing "
    "and publishing that the press created still shape how knowledge is shared."
)
QUESTIONS = ["Explain how a refrigerator keeps food cold.", "Write a short story about a lighthouse keeper.",
             "What are the main causes of inflation?", "Describe the water cycle for a ten-year-old.",
             "Give advice to someone learning to play the guitar.", "Why is the sky blue?"]


def quality(args: argparse.Namespace) -> None:
    from pagedmlx.core.kv.cache_dtype import bytes_per_token, layer_quant
    from pagedmlx.llm import LLM
    from pagedmlx.loaders.loader import load_model
    from pagedmlx.sampling_params import SamplingParams

    model, tok = load_model(args.model)
    if args.dtype:
        import mlx.core as mx

        model.set_dtype(getattr(mx, args.dtype))
    ids = tok.encode(TEXT)
    prompts = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    rows, ref = [], None
    for fmt in args.formats:
        rotate = fmt.endswith("+rot")
        dtype, _, group = fmt.removesuffix("+rot").partition(":")
        group = int(group) if group else None
        llm = LLM(model, tok, kv_cache_dtype=dtype, kv_cache_group_size=group, kv_cache_rotate=rotate,
                  kv_cache_memory_gb=args.kv_cache_gb, max_num_batched_tokens=128,
                  long_prefill_token_threshold=128, enable_prefix_caching=False)
        t = time.perf_counter()
        out = llm.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=0))[0]
        lps = [d[t].logprob for d, t in zip(out.prompt_logprobs[1:], out.prompt_token_ids[1:])]
        ppl = math.exp(-sum(lps) / len(lps))
        gens = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
        ref = ref or (ppl, gens, llm.engine.runner.num_blocks)
        # Teacher-forced: along auto's own greedy answers, how often these pages' top-1 is auto's next token.
        forced = llm.generate([p + g for p, g in zip(prompts, ref[1])], SamplingParams(max_tokens=1, prompt_logprobs=1))
        top1 = [d[t].rank == 1 for o, p in zip(forced, prompts)
                for d, t in zip(o.prompt_logprobs[len(p):], o.prompt_token_ids[len(p):])]
        secs = time.perf_counter() - t
        runner = llm.engine.runner
        prefix = [next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(g)) for g, r in zip(gens, ref[1])]
        same = sum(a == b for g, r in zip(gens, ref[1]) for a, b in zip(g, r)) / sum(len(g) for g in gens)
        h, dk, dv, dt = runner.plan[0].spec
        q = layer_quant(dtype, group, dk, dv)
        bf16 = bytes_per_token(h, dk, dv, 2, None) / bytes_per_token(h, dk, dv, 2, q)
        rows.append((dtype + (", rotated" if rotate else ""), ppl, ppl / ref[0] - 1, sum(top1) / len(top1),
                     statistics.mean(prefix), min(prefix), same,
                     runner.num_blocks / ref[2], bf16, q.group_size if q else "-", secs))
    print(f"\n{args.model or 'SmolLM2-135M-Instruct'} ({dt}), perplexity of a {len(ids)}-token text; greedy "
          f"{args.max_tokens} tokens x {len(prompts)} chat prompts vs auto pages; capacity vs auto at "
          f"{args.kv_cache_gb} GB\n")
    print("| kv_cache_dtype | group | perplexity | vs auto | top-1 = auto's (teacher-forced) | free-running: equal "
          "prefix (mean / min) | equal positions | tokens in same memory (this model's pages) | (bf16 model) | s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for d, ppl, rel, top1, mean_p, min_p, same, cap, bf16, g, secs in rows:
        print(f"| {d} | {g} | {ppl:.3f} | {rel:+.2%} | {top1:.1%} | {mean_p:.0f} / {min_p} | {same:.1%} | {cap:.2f}x | "
              f"{bf16:.2f}x | {secs:.0f} |")


def _step_ms(model, batch: int, ctx: int, bs: int, dtype: str, steps: int, quantizing: bool = True,
             rotate: bool = False) -> tuple[float, str]:
    """Median decode step of `batch` sequences of ctx tokens on random pages; and the decode path.
    quantizing=False: quantized pages written by mx.quantize and the copying page write, not the kernel that
    quantizes (where that one passed its check)."""
    import mlx.core as mx

    from pagedmlx.config import EngineConfig
    from pagedmlx.runner.kernel_paths import kernel_path_lines
    from pagedmlx.runner.model import ModelRunner
    from pagedmlx.core.sched.output import decode_only_output

    per_seq = -(-ctx // bs)
    runner = ModelRunner(model, EngineConfig(block_size=bs, num_blocks=batch * per_seq + 1, kv_cache_dtype=dtype,
                                             kv_cache_rotate=rotate), verify=False)
    pool = runner.kv_pool
    pool.quantize_in_write = pool.quantize_in_write and quantizing
    for side in ("keys", "values", "k_scales", "k_biases", "v_scales", "v_biases"):
        arrays = getattr(pool, side)
        for i, a in enumerate(arrays):
            if a is None:
                continue
            if a.dtype == mx.uint32:
                arrays[i] = mx.random.randint(0, 1 << 31, a.shape).astype(mx.uint32)
            else:
                arrays[i] = (mx.random.normal(a.shape) * (0.02 if "scales" in side else 1.0)).astype(a.dtype)
            mx.eval(arrays[i])  # one layer's temporaries at a time
    so = decode_only_output(batch, ctx, bs)
    samples = []
    for i in range(steps + 2):  # two warm-up steps (kernel builds)
        t = time.perf_counter()
        mx.eval(runner.forward(so))
        if i >= 2:
            samples.append(time.perf_counter() - t)
    path = kernel_path_lines(runner)[0].split(": ", 1)[1].split(";")[0]
    del runner, pool, so
    gc.collect()  # the runner's cycles (its compiled step) hold the pools until collected
    mx.clear_cache()
    return 1e3 * statistics.median(samples), path


@contextlib.contextmanager
def _variant(env: dict, split_factor: int):
    """The decode kernels' launches as under `env` (read when a launch is first made) and with split_factor x
    the thread groups that decode splits aim for."""
    import dataclasses

    from pagedmlx.kernels import decode_attention, decode_attention_quant
    from pagedmlx.kernels.dialect import CUDA

    old_env = {k: os.environ.get(k) for k in env}
    old_settings = decode_attention.SETTINGS[CUDA]
    os.environ.update(env)
    decode_attention.SETTINGS[CUDA] = dataclasses.replace(old_settings,
                                                          target_blocks=old_settings.target_blocks * split_factor)
    decode_attention_quant._launch.cache_clear()
    try:
        yield
    finally:
        for k, v in old_env.items():
            os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
        decode_attention.SETTINGS[CUDA] = old_settings
        decode_attention_quant._launch.cache_clear()


def variants(args: argparse.Namespace, model) -> None:
    """Each --variants row at each --batch, rounds interleaved; the median over rounds of step / auto's step."""
    names = ["auto"] + [n for n in (args.variants or VARIANTS) if n != "auto"]
    print("| batch | variant | step ms (median) | vs auto (median of rounds) | per round |")
    print("|---|---|---|---|---|")
    for batch in args.batch:
        ms = {name: [] for name in names}
        for _ in range(args.repeats):
            for name in names:
                dtype, env, factor = VARIANTS[name]
                with _variant(env, factor):
                    ms[name].append(_step_ms(model, batch, args.context, args.block_size, dtype, args.steps)[0])
        for name, times in ms.items():
            ratios = [t / a for t, a in zip(times, ms["auto"])]
            print(f"| {batch} | {name} | {statistics.median(times):.2f} | {statistics.median(ratios):.3f}x | "
                  f"{', '.join(f'{r:.3f}' for r in ratios)} |", flush=True)


def speed(args: argparse.Namespace) -> None:
    from pagedmlx.bench.presets import preset_model
    from pagedmlx.core.kv.cache_dtype import bytes_per_token, layer_quant

    model, _ = preset_model(args.preset, "bfloat16")
    spec = model.args
    h, d = spec.num_key_value_heads, spec.hidden_size // spec.num_attention_heads
    print(f"\npreset:{args.preset} bf16, {args.context}-token context, block {args.block_size}, median of "
          f"{args.steps} decode steps\n")
    if args.variants is not None:
        return variants(args, model)
    print("| batch | kv_cache_dtype | step ms | vs auto | tok/s | decode path |")
    print("|---|---|---|---|---|---|")
    base = {}
    for batch in args.batch:
        for dtype in DTYPES:
            ms, path = _step_ms(model, batch, args.context, args.block_size, dtype, args.steps)
            base.setdefault(batch, ms)
            print(f"| {batch} | {dtype} | {ms:.2f} | {ms / base[batch]:.2f}x | {batch / ms * 1e3:,.0f} | {path} |",
                  flush=True)
            if args.compare_write and dtype != "auto":
                ms, path = _step_ms(model, batch, args.context, args.block_size, dtype, args.steps, quantizing=False)
                print(f"| {batch} | {dtype}, mx.quantize + copy | {ms:.2f} | {ms / base[batch]:.2f}x | "
                      f"{batch / ms * 1e3:,.0f} | {path} |", flush=True)
            if args.rotate and dtype != "auto":
                ms, path = _step_ms(model, batch, args.context, args.block_size, dtype, args.steps, rotate=True)
                print(f"| {batch} | {dtype}, rotated | {ms:.2f} | {ms / base[batch]:.2f}x | "
                      f"{batch / ms * 1e3:,.0f} | {path} |", flush=True)
    budget_batch = max(args.batch)
    per_token = {dt: bytes_per_token(h, d, d, 2, layer_quant(dt, None, d, d)) for dt in DTYPES}
    print(f"\nthe KV memory of {budget_batch} x {args.context} tokens of auto pages "
          f"({budget_batch * args.context * per_token['auto'] * spec.num_hidden_layers / 2**30:.1f} GiB):\n")
    print("| kv_cache_dtype | batch that fits | step ms | tok/s | tok/s vs auto |")
    print("|---|---|---|---|---|")
    ref = None
    for dtype in DTYPES:
        batch = budget_batch * per_token["auto"] // per_token[dtype]
        ms, _ = _step_ms(model, batch, args.context, args.block_size, dtype, args.steps)
        tps = batch / ms * 1e3
        ref = ref or tps
        print(f"| {dtype} | {batch} | {ms:.2f} | {tps:,.0f} | {tps / ref:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--speed", action="store_true", help="decode speed on the GPU instead of quality")
    p.add_argument("--model", default=None, help="quality: a model (default SmolLM2-135M-Instruct)")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"], help="quality: model dtype")
    p.add_argument("--formats", nargs="+", default=["auto", "int8", "int4", "int8:32", "int4:32"],
                   help="quality: kv_cache_dtype[:group size][+rot] each (auto first: the reference; +rot: "
                        "kv_cache_rotate)")
    p.add_argument("--max-tokens", type=int, default=256, help="quality: greedy tokens per prompt")
    p.add_argument("--kv-cache-gb", type=float, default=0.5, help="quality: the pool's memory")
    p.add_argument("--preset", default="llama-8b", help="speed: the random-weight model")
    p.add_argument("--batch", type=int, nargs="+", default=[64, 256], help="speed: batch sizes")
    p.add_argument("--context", type=int, default=2048, help="speed: tokens per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=20, help="speed: timed decode steps per point")
    p.add_argument("--rotate", action="store_true",
                   help="speed: each quantized format also with kv_cache_rotate (Hadamard-rotated keys and values)")
    p.add_argument("--compare-write", action="store_true",
                   help="speed: each quantized format also with mx.quantize before a copying page write")
    p.add_argument("--variants", nargs="*", choices=list(VARIANTS), default=None,
                   help="speed: these kernel variants (none named: all) against auto pages instead, in interleaved "
                        "rounds")
    p.add_argument("--repeats", type=int, default=3, help="speed --variants: interleaved rounds")
    args = p.parse_args()
    speed(args) if args.speed else quality(args)


if __name__ == "__main__":
    main()
