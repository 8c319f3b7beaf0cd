"""Step by step, where a burst of long prompts spends its time: N prompts of L tokens arrive together
(default 32 x 3,968, Llama-8B shape), each engine step's shape (decode rows, prefill chunks, the
longest chunk), its wall time and the time inside mx.async_eval; then, for the step with the most
chunks, that step's prefill attention alone on the engine's own pages and block tables, through the
prefill kernel and through the grouped SDPA path (as bench_prefill_attention.py does for synthetic
steps). Run it once per setting, each in a fresh process: what a process built before moves the
figures (cuDNN graphs, compiled kernels).

  python scripts/bench/profile_prefill_steps.py --prefill-kernel on
  python scripts/bench/profile_prefill_steps.py --prefill-kernel off
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_offline import PRESETS, make_prompts, random_model  # noqa: E402
from scripts.bench.profile_step import Clock  # noqa: E402
from scripts.bench.timing import timed_chain  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-8b", choices=PRESETS)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--length", type=int, default=3968)
    ap.add_argument("--prefill-kernel", default="default", choices=["default", "on", "off"])
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "int8", "int4"])
    args = ap.parse_args()

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine
    from pagedmlx.runner.attention import paged_attention, read_pages
    from pagedmlx.runner.attention_metadata import StepMetadata
    from pagedmlx.sampling_params import SamplingParams

    model = random_model(args.preset, getattr(mx, args.dtype))
    kernel = {"default": None, "on": True, "off": False}[args.prefill_kernel]
    bs = 16
    engine = LLMEngine(model, None, EngineConfig(
        block_size=bs, num_blocks=args.prompts * (-(-args.length // bs) + 2) + 8, max_num_seqs=args.prompts,
        max_model_len=args.length + 2, enable_prefix_caching=False, prefill_kernel=kernel,
        kv_cache_dtype=args.kv_cache_dtype))
    runner = engine.runner
    print(f"profile_prefill_steps {args.preset} {args.dtype} on {mx.default_device()}, {time.strftime('%Y-%m-%d')}: "
          f"{args.prompts} x {args.length}, {args.kv_cache_dtype} pages, prefill kernel {args.prefill_kernel} "
          f"(per group: {runner.prefill_heads}), chunk cap {engine.config.long_prefill_token_threshold}")
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)  # decodes beside the chunks
    engine.add_request("w", make_prompts(1, 256, model.args.vocab_size, 1)[0], params)  # compile what runs
    while engine.has_unfinished_requests():
        engine.step()
    seen = []
    forward = runner.forward

    def spy(so, *a, **k):
        seen.append(so)
        return forward(so, *a, **k)

    runner.forward = spy
    for i, p in enumerate(make_prompts(args.prompts, args.length, model.args.vocab_size, 7)):
        engine.add_request(str(i), p, params)
    rows, start = [], time.perf_counter()
    while engine.has_unfinished_requests():
        n = len(seen)
        with Clock() as clock:
            t = time.perf_counter()
            engine.step()
            dt = time.perf_counter() - t
        for so in seen[n:]:
            chunks = so.num_scheduled_tokens[so.num_decodes:]
            rows.append((so.num_decodes, len(chunks), max(chunks, default=0), so.total_num_scheduled_tokens))
        rows[-1] += (dt, clock.dispatch, clock.wait) if len(seen) > n else ()
    total = time.perf_counter() - start
    print(f"{'step':>4} {'decodes':>7} {'chunks':>6} {'longest':>7} {'tokens':>6} {'ms':>8} {'in async_eval':>13} "
          f"{'waiting':>8}")
    for i, r in enumerate(rows):
        print(f"{i:>4} {r[0]:>7} {r[1]:>6} {r[2]:>7} {r[3]:>6}" + (
            f" {1e3 * r[4]:>8.1f} {1e3 * r[5]:>13.1f} {1e3 * r[6]:>8.1f}" if len(r) > 4 else ""))
    print(f"all done in {total:.2f} s")

    so = max(seen, key=lambda s: s.num_reqs - s.num_decodes)
    layer = next(i for i, k in enumerate(runner.kv_pool.keys) if k is not None)
    k_pages, v_pages = read_pages(runner.kv_pool, layer)
    H, D = runner.plan[layer].n_heads, k_pages.shape[-1]
    q = mx.random.normal((so.total_num_scheduled_tokens, H, 1, D)).astype(k_pages.dtype)
    paths = [("prefill kernel", [(k_pages.shape[1], H // k_pages.shape[1])])] if runner.kernels.prefill else []
    for name, heads in paths + [("SDPA groups", None)]:
        md = StepMetadata.build(so, bs, runner.windows, runner.kernel_kv_heads, runner.pages_in_place,
                                runner.kernels.backend, runner.sdpa_quantum, heads).groups[0]
        if heads and md.prefill_tiles is None:
            print(f"  {name}: not taken by the kernel's policy (a chunk over the limit)")
            continue
        ms = 1e3 * timed_chain(lambda x, md=md: paged_attention(x, k_pages, v_pages, md, D ** -0.5), q, 8, 5)
        print(f"  the step with {so.num_reqs - so.num_decodes} chunks + {so.num_decodes} decodes, layer {layer} "
              f"attention alone: {name} {ms:.3f} ms")


if __name__ == "__main__":
    main()
