"""Study: what a compiled decode step (mx.compile of the paged forward per shape bucket, vLLM's CUDA graphs
in spirit) would save the host at batch 1. Not wired into the engine: the CUDA path's graph (page-write
and decode kernels, bench_host_step.KernelStandIn for each) is built once per step key and replayed.

For one batch-1 decode step of each preset (layer structure at tiny widths, bench_host_step.tiny_model)
it times, in the main thread's CPU time (fastest quartile of --iters calls):
  forward       ModelRunner.forward: metadata, caches, the model's Python, the kernels' launches
  compiled      the same step through mx.compile: metadata upload and one compiled call
  mlx-lm        the model's call on mlx-lm's own caches (generate_step's graph, without its sampling)
Only where the pages are written in place (CUDA) can the step be compiled this way: elsewhere the
scatter replaces the pool arrays, which a compiled graph cannot do; likewise recurrent-state layers
need their in-place state kernels (not stood in for here: Qwen3.5 is not studied). A step's key is everything the
trace froze: token and decode counts, index shapes (block tables grow a page at a time, so a real
engine would pad them to buckets) and each group's KV splits.

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


class CompiledDecode:
    """A decode-only step's forward, compiled once per key (see the module docstring)."""

    def __init__(self, runner):
        self.runner = runner
        self.fns: dict = {}

    def __call__(self, so) -> mx.array:
        from pagedmlx.runner.attention_metadata import StepMetadata, _GroupBuilder, upload_indices

        r = self.runner
        assert so.num_decodes == so.total_num_scheduled_tokens, "decode-only steps"
        host = dict(input_ids=so.input_ids, positions=so.positions, logits_indices=so.logits_indices)
        builders = [_GroupBuilder(so, g, r.block_size, w, r.kernel_kv_heads[g], r.kernels.page_write,
                                  r.kernels.backend, r.sdpa_quantum, r.prefill_heads[g]) for g, w in enumerate(r.windows)]
        for g, b in enumerate(builders):
            host.update({f"{g}.{k}": v for k, v in b.host.items()})
        dev = upload_indices(host)
        names = list(dev)
        key = (tuple((n, dev[n].shape) for n in names), tuple(b.splits for b in builders))
        fn = self.fns.get(key)
        if fn is None:
            def forward(*arrays: mx.array) -> mx.array:
                d = dict(zip(names, arrays))
                groups = [b.finish(d, f"{g}.", d["positions"]) for g, b in enumerate(builders)]
                md = StepMetadata(d["input_ids"], d["logits_indices"], None, None, groups)
                caches = r.make_caches(md, r.kv_pool)
                if r._head is None:  # the runner runs the model whole (ModelRunner._split_head)
                    return r.model(md.input_ids[:, None], cache=caches)[md.logits_indices][:, 0, :]
                return r._head(r._body(md.input_ids[:, None], cache=caches)[md.logits_indices])[:, 0, :]
            fn = self.fns[key] = mx.compile(forward)
        return fn(*(dev[n] for n in names))


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
        cache = make_prompt_cache(model)
        mx.eval(model(mx.array(prompt)[None], cache=cache))
        token = mx.array([[3]])

        def mlx_lm_call():
            for c in cache:
                c.offset = len(prompt) if isinstance(getattr(c, "offset", None), int) else c.offset
            return model(token, cache=cache)

        us = [cpu_us(lambda: runner.forward(so), args.iters), cpu_us(lambda: compiled(so), args.iters),
              cpu_us(mlx_lm_call, args.iters)]
        diff = mx.abs(runner.forward(so) - compiled(so)).max().item()
        print(f"{preset:>16} | {us[0]:8.0f} {us[1]:8.0f} {us[2]:8.0f} | {diff:.1e}", flush=True)


if __name__ == "__main__":
    main()
