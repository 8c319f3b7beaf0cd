"""`pagedmlx bench throughput`: the offline engine (`LLM.generate`) on the prompts `bench serve`
sends, all given to one call, as `vllm bench throughput`: every request runs to its max_tokens
(ignore_eos); one warm-up request of the same shape first, on a prompt of its own so that the
timed prompts find nothing of it in the prefix cache, excluded from the timing."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any, Optional, Sequence

from pagedmlx.bench.datasets import SampleRequest, check_dataset_args, get_samples, random_requests


def run_throughput(llm: Any, samples: Sequence[SampleRequest], warmup: SampleRequest, temperature: float = 1.0,
                   use_tqdm: bool = True) -> dict[str, Any]:
    """Time `llm.generate` over `samples` (token-id prompts); vLLM's result fields."""
    from pagedmlx.sampling_params import SamplingParams

    def params(s: SampleRequest) -> SamplingParams:
        return SamplingParams(temperature=temperature, top_p=1.0, max_tokens=s.expected_output_len, ignore_eos=True)

    def prompt(s: SampleRequest) -> Any:
        return {"prompt_token_ids": s.prompt} if isinstance(s.prompt, list) else s.prompt

    llm.generate([prompt(warmup)], [params(warmup)], use_tqdm=False)
    start = time.perf_counter()
    outs = llm.generate([prompt(s) for s in samples], [params(s) for s in samples], use_tqdm=use_tqdm)
    elapsed = time.perf_counter() - start
    prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
    output_tokens = sum(len(c.token_ids) for o in outs for c in o.outputs)
    total = prompt_tokens + output_tokens
    return {"elapsed_time": elapsed, "num_requests": len(samples), "total_num_tokens": total,
            "requests_per_second": len(samples) / elapsed, "tokens_per_second": total / elapsed,
            "output_tokens_per_second": output_tokens / elapsed, "total_prompt_tokens": prompt_tokens,
            "total_output_tokens": output_tokens}


def result_lines(result: dict[str, Any]) -> list[str]:
    return [f"Throughput: {result['requests_per_second']:.2f} requests/s, {result['tokens_per_second']:.2f} total "
            f"tokens/s, {result['output_tokens_per_second']:.2f} output tokens/s",
            f"Total num prompt tokens:  {result['total_prompt_tokens']}",
            f"Total num output tokens:  {result['total_output_tokens']}"]


def bench_throughput(args: argparse.Namespace) -> Optional[dict[str, Any]]:
    """Build the engine from `args` (`pagedmlx serve`'s engine options), run, print, save --output-json;
    None where the engine could not start (said on stderr)."""
    from pagedmlx.cli import load_engine
    from pagedmlx.engine.arg_utils import engine_config
    from pagedmlx.llm import LLM

    check_dataset_args(args)  # before the model loads
    engine = load_engine(engine_config(args), "bench throughput")
    if engine is None:
        return None
    tokenizer, vocab = engine.tokenizer, engine.vocab_size
    samples = get_samples(args, tokenizer, as_ids=True, vocab_size=vocab)
    first = samples[0]
    warmup = random_requests(1, first.prompt_len or args.random_input_len, first.expected_output_len,
                             seed=args.seed + 1, tokenizer=tokenizer, vocab_size=vocab)[0]
    result = run_throughput(LLM.from_engine(engine), samples, warmup, args.temperature, not args.disable_tqdm)
    print("\n".join(result_lines(result)))
    if args.output_json:
        with open(args.output_json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=4)
    return result
