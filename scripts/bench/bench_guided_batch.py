"""What guided rows cost a batch (issue 27's target: <= 5% of a batch-64 decode step on the H200 with a
quarter of the rows guided, <= 10% on the CPU): `LLM.generate` of B prompts with G of them under the
regex `[a-z ]+` (a cheap grammar; EOS, which it allows, gets a -100 bias, so every row decodes all its
tokens), against the same batch unguided, interleaved `--rounds` times in one process; the median decode tok/s of each and their
ratio. Guided steps are not overlapped with the next (the mask needs the previous token on the host), so
the ratio includes that loss where async scheduling is on (GPU backends).

    python scripts/bench/bench_guided_batch.py MODEL --batch 64 --guided 16 --gen-len 128
    python scripts/bench/bench_guided_batch.py random:llama-tiny --batch 64 --guided 16   # CPU
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.llm import LLM  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402
from pagedmlx.structured_outputs.params import StructuredOutputsParams  # noqa: E402


def run(llm: LLM, prompts: list[list[int]], guided: int, gen_len: int) -> float:
    """Output tokens per second of one generate call (every row decodes gen_len tokens)."""
    plain = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    no_eos = {t: -100.0 for t in llm.tokenizer.eos_token_ids}
    grammar = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True, logit_bias=no_eos,
                             structured_outputs=StructuredOutputsParams(regex="[a-z ]+"))
    params = [grammar if i < guided else plain for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - t
    assert all(len(o.outputs[0].token_ids) == gen_len for o in outs), "a row ended early"
    return len(prompts) * gen_len / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--guided", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--kv-cache-gb", type=float, default=8.0)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                    help="both sides lockstep (--no-async-scheduling) or overlapped (default: the backend's)")
    args = ap.parse_args()
    llm = LLM(args.model, max_num_seqs=args.batch, kv_cache_memory_gb=args.kv_cache_gb,
              async_scheduling=args.async_scheduling)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 259) for _ in range(args.prompt_len)] for _ in range(args.batch)]
    run(llm, prompts, args.guided, 8)  # warm-up: shapes, kernels, the grammar's compile
    base, guided = [], []
    for _ in range(args.rounds):
        base.append(run(llm, prompts, 0, args.gen_len))
        guided.append(run(llm, prompts, args.guided, args.gen_len))
    b, g = statistics.median(base), statistics.median(guided)
    print(f"{args.model}: batch {args.batch}, {args.guided} guided, {args.gen_len} new tokens, median of {args.rounds}")
    print(f"  unguided {b:,.0f} tok/s   guided {g:,.0f} tok/s   guided / unguided {g / b:.3f} "
          f"(cost {100 * (1 - g / b):.1f}%)")


if __name__ == "__main__":
    main()
