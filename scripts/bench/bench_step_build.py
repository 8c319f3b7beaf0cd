"""Host time to build one step's graph (Python and MLX graph construction, before any evaluation),
for steps that carry P prefill chunks beside a few decodes: what a burst of long prompts costs the
host each step, whatever the backend (on CUDA, encoding the graph comes on top). Llama-8B's layer
count and head layout at tiny widths, so that evaluating the steps in between is quick on a CPU.

  python scripts/bench/bench_step_build.py                  # this checkout
  (cd ../old-checkout && python .../bench_step_build.py)    # the same numbers for another revision
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_offline import make_prompts  # noqa: E402

ARCH = dict(model_type="llama", hidden_size=256, num_hidden_layers=32, intermediate_size=512, num_attention_heads=32,
            num_key_value_heads=8, head_dim=8, vocab_size=1000, rms_norm_eps=1e-5, rope_theta=10000.0,
            tie_word_embeddings=False)


def build_times(num_prefills: int, chunk: int, prefix: int, iters: int) -> list[float]:
    """Seconds to build the graph of a step with 2 decodes and num_prefills chunks of `chunk` tokens
    at `prefix` tokens into their prompts."""
    from mlx_lm.utils import _get_classes

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine
    from pagedmlx.sampling_params import SamplingParams

    model_class, args_class = _get_classes(ARCH)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(ARCH))
    n = num_prefills + 2
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=n * ((prefix + 2 * chunk) // 16 + 2) + 8,
                                                 max_num_seqs=n, max_num_batched_tokens=n * chunk,
                                                 long_prefill_token_threshold=chunk, enable_prefix_caching=False,
                                                 async_scheduling=False),
                       verify_model=False)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i, p in enumerate(make_prompts(2, 8, ARCH["vocab_size"], 1)):
        engine.add_request(f"d{i}", p, params)
    engine.step()  # the two short prompts prefill, then decode
    for i, p in enumerate(make_prompts(num_prefills, prefix + 2 * chunk, ARCH["vocab_size"], 2)):
        engine.add_request(f"p{i}", p, params)
    while len(engine.scheduler.waiting) or min(r.num_computed_tokens for r in engine.scheduler.running
                                               if r.request_id.startswith("p")) < prefix:
        engine.step()
    so = engine.scheduler.schedule()
    assert so.num_decodes >= 2 and so.num_reqs - so.num_decodes == num_prefills, "not the step asked for"
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        logits = engine.runner.forward(so)
        times.append(time.perf_counter() - t)
        mx.eval(logits, [a for a in engine.runner.kv_pool.keys + engine.runner.kv_pool.values if a is not None])
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prefills", type=int, nargs="+", default=[1, 8, 30])
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--iters", type=int, default=7)
    args = ap.parse_args()
    print(f"bench_step_build on {mx.default_device()}, {time.strftime('%Y-%m-%d')}: 32 layers, 2 decodes + P chunks "
          f"of {args.chunk} tokens at {args.prefix} tokens in")
    print(f"{'P':>4} | {'build ms (median)':>18} {'min':>8}")
    for p in args.prefills:
        t = build_times(p, args.chunk, args.prefix, args.iters)
        print(f"{p:>4} | {1e3 * statistics.median(t):18.2f} {1e3 * min(t):8.2f}")


if __name__ == "__main__":
    main()
