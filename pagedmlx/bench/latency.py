"""`pagedmlx bench latency`: how long the offline engine takes to run one batch of requests to the end,
as `vllm bench latency`: --batch-size random prompts of --input-len tokens, each generating exactly
--output-len tokens (ignore_eos), given to one `LLM.generate` call; --num-iters-warmup untimed
iterations, then --num-iters timed ones; the mean, standard deviation and percentiles of their wall
times, and vLLM's JSON fields. Prefix caching is off unless asked for (as vLLM's): the same prompts
run every iteration. At --batch-size 1 it is the single-stream figure speculative decoding is for: with
--speculative-config it also reports the drafts' acceptance."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Callable, Optional

import numpy as np

PERCENTAGES = (10, 25, 50, 75, 90, 99)


def check_latency_args(args: argparse.Namespace, max_model_len: Optional[int] = None) -> None:
    """A ValueError naming the flag, its value and its allowed range (the lengths against the model's
    max_model_len once it is known)."""
    for flag in ("batch_size", "input_len", "output_len", "n", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    if max_model_len is not None and args.input_len + args.output_len > max_model_len:
        raise ValueError(f"--input-len {args.input_len} + --output-len {args.output_len} exceeds the model's "
                         f"max_model_len {max_model_len} (raise --max-model-len or --num-blocks, or shorten them)")


def time_iterations(run: Callable[[], Any], warmup: int, iters: int, show_progress: bool = True) -> list[float]:
    """Wall seconds of `iters` calls of run(), after `warmup` untimed ones; a progress bar on stderr."""
    from rich.console import Console
    from rich.progress import track

    console = Console(stderr=True)
    for _ in track(range(warmup), "warm-up iterations", console=console, disable=not (show_progress and warmup)):
        run()
    latencies = []
    for _ in track(range(iters), "timed iterations", console=console, disable=not (show_progress and iters)):
        start = time.perf_counter()
        run()
        latencies.append(time.perf_counter() - start)
    return latencies


def latency_result(latencies: list[float]) -> dict[str, Any]:
    """vLLM's fields: avg_latency, std_latency, latencies, percentiles {10: ..., 99: ...} (seconds)."""
    a = np.asarray(latencies, dtype=np.float64)
    return {"avg_latency": float(a.mean()), "std_latency": float(a.std()), "latencies": a.tolist(),
            "percentiles": dict(zip(PERCENTAGES, np.percentile(a, PERCENTAGES).tolist()))}


def result_lines(result: dict[str, Any], output_tokens: int) -> list[str]:
    lines = [f"Avg latency: {result['avg_latency']} seconds", f"Std latency: {result['std_latency']} seconds"]
    lines += [f"{p}% percentile latency: {v} seconds" for p, v in result["percentiles"].items()]
    median = result["percentiles"][50]
    lines.append(f"Output tokens per second at the median: {output_tokens / median:.2f} "
                 f"({output_tokens} tokens an iteration)")
    return lines


def bench_latency(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """Build the engine from `args` (`pagedmlx serve`'s engine options), run, print, save --output-json;
    None where the engine could not start (said on stderr)."""
    from pagedmlx.bench.datasets import random_requests
    from pagedmlx.cli import load_engine
    from pagedmlx.engine.arg_utils import engine_config
    from pagedmlx.llm import LLM
    from pagedmlx.sampling_params import SamplingParams

    check_latency_args(args)  # before the model loads
    engine = load_engine(engine_config(args), "bench latency")
    if engine is None:
        return None
    check_latency_args(args, engine.max_model_len)
    samples = random_requests(args.batch_size, args.input_len, args.output_len, seed=args.seed,
                              tokenizer=engine.tokenizer, vocab_size=engine.vocab_size)
    prompts = [{"prompt_token_ids": s.prompt} for s in samples]
    params = SamplingParams(n=args.n, temperature=args.temperature, top_p=1.0, max_tokens=args.output_len,
                            ignore_eos=True, detokenize=not args.disable_detokenize)
    llm = LLM.from_engine(engine)
    stats = engine.scheduler.spec_decoding_stats

    def run() -> None:
        llm.generate(prompts, params, use_tqdm=False)

    time_iterations(run, args.num_iters_warmup, 0, not args.disable_tqdm)
    fields = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    before = {f: getattr(stats, f) for f in fields} if stats is not None else None
    result = latency_result(time_iterations(run, 0, args.num_iters, not args.disable_tqdm))
    print("\n".join(result_lines(result, args.batch_size * args.n * args.output_len)))
    spec = {f: getattr(stats, f) - before[f] for f in fields} if stats is not None else {"num_drafts": 0}
    if spec["num_drafts"]:
        result["spec_decode"] = spec
        print(f"Speculative decoding: {spec['num_accepted_tokens']} of {spec['num_draft_tokens']} draft tokens "
              f"accepted ({spec['num_accepted_tokens'] / spec['num_draft_tokens']:.2f}), mean acceptance length "
              f"{1 + spec['num_accepted_tokens'] / spec['num_drafts']:.2f}")
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=4)
    return result
