"""Study: what a compiled decode step (runner/compiled_step.py: mx.compile of the paged forward per
step key, vLLM's CUDA graphs in spirit; EngineConfig.compile_decode) saves the host at batch 1, on the
CUDA path's graph (page-write and decode kernels, bench_host_step.KernelStandIn for each).

For one batch-1 decode step of each preset (layer structure at tiny widths, bench_host_step.tiny_model)
it times, in the main thread's CPU time (fastest quartile of --iters calls):
  forward       ModelRunner.forward: metadata, caches, the model's Python, the kernels' launches
  compiled      the same step through mx.compile: metadata upload and one compiled call
  mlx-lm        the model's call on mlx-lm's own caches (generate_step's graph, without its sampling)
Recurrent-state layers compile only with their in-place state kernels, not stood in for here (Qwen3.5
is not studied; bench_host_step.py --kernel-standins --compile-decode runs whole steps of it).

  python scripts/bench/study_compiled_step.py [--presets llama-8b gemma3-27b-16l] [--iters 40]

The last column compares the two forwards' logits (the stand-ins make them garbage, but the same
garbage: it checks the traced step against the built one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_host_step import make_engine, tiny_model, use_kernel_standins  # noqa: E402
from scripts.bench.bench_offline import make_prompts  # noqa: E402

from pagedmlx.runner.compiled_step import CompiledDecode  # noqa: E402


def cpu_us(fn, iters: int) -> float:
    """fn's graph building, without the dispatch that the runner does itself for in-place steps."""
    times, async_eval = [], mx.async_eval
    for _ in range(iters):
        mx.async_eval = lambda *arrays: None
        try:
            t = time.thread_time()
            out = fn()
            times.append(time.thread_time() - t)
        finally:
            mx.async_eval = async_eval
        mx.eval(out)
    return 1e6 * statistics.quantiles(times[2:], n=4)[0]


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache

    from pagedmlx.sampling_params import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["llama-8b", "gemma3-27b-16l"])
    ap.add_argument("--iters", type=int, default=40)
    args = ap.parse_args()
    print(f"study_compiled_step on {mx.default_device()}, {time.strftime('%Y-%m-%d %H:%M')}: one batch-1 decode "
          f"step, CUDA path with kernel stand-ins, main-thread CPU µs (fastest quartile of {args.iters})")
    print(f"{'preset':>16} | {'forward':>8} {'compiled':>8} {'mlx-lm':>8} | max |forward - compiled|")
    for preset in args.presets:
        model = tiny_model(preset)
        engine = make_engine(model, 128, 16)
        use_kernel_standins(engine)
        prompt = make_prompts(1, 128, 512, 9)[0]
        engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
        engine.step()
        so = engine.scheduler.schedule()
        runner = engine.runner
        compiled = CompiledDecode(runner)
        compiled_call = lambda: compiled(so, None)  # noqa: E731
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(prompt)[None], cache=cache))
        token = mx.array([[3]])

        def mlx_lm_call():
            for c in cache:
                c.offset = len(prompt) if isinstance(getattr(c, "offset", None), int) else c.offset
            return model(token, cache=cache)

        us = [cpu_us(lambda: runner.forward(so), args.iters), cpu_us(compiled_call, args.iters),
              cpu_us(mlx_lm_call, args.iters)]
        diff = mx.abs(runner.forward(so) - compiled_call()).max().item()
        print(f"{preset:>16} | {us[0]:8.0f} {us[1]:8.0f} {us[2]:8.0f} | {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
