"""Where a decode step's time goes; at batch 1 against mlx-lm's generate_step, same model, same run.

For each engine it times whole steps and the time spent inside mx.async_eval (handing the graph to
the device: on CUDA, encoding and launching it) and in mx.eval / host reads (waiting). What is left
is Python building the graph. A second pass times each engine's forward alone in lockstep: the
graph built (Python), then evaluated (dispatch + device + sync), which bounds the device time.

--kernels also lists the device's kernels by time over a few overlapped steps (CUPTI, through torch.profiler where
torch is installed, as on the GPU machine) beside the steps' wall time: a step whose kernels add up to much less
than its wall time is bound by the host.

  python scripts/bench/profile_step.py --preset llama-8b --dtype bfloat16 [--quantization 4bit] [--batch 64 --kernels]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_offline import PRESETS, make_prompts, parse_quantization, random_model  # noqa: E402


class Clock:
    """Accumulates the time spent in mx.async_eval and mx.eval while installed, by `timer` (wall time;
    time.thread_time: the calling thread's CPU time)."""

    def __init__(self, timer=time.perf_counter):
        self.dispatch = self.wait = 0.0
        self._timer = timer
        self._async_eval, self._eval = mx.async_eval, mx.eval

    def __enter__(self):
        def timed(fn, field):
            def wrapper(*args, **kwargs):
                t = self._timer()
                try:
                    return fn(*args, **kwargs)
                finally:
                    setattr(self, field, getattr(self, field) + self._timer() - t)
            return wrapper
        mx.async_eval, mx.eval = timed(self._async_eval, "dispatch"), timed(self._eval, "wait")
        return self

    def __exit__(self, *exc):
        mx.async_eval, mx.eval = self._async_eval, self._eval


def profile_generate_step(model, prompt, gen_len: int) -> dict:
    from mlx_lm.generate import generate_step

    steps = []
    it = generate_step(mx.array(prompt), model, max_tokens=gen_len)
    next(it)  # prefill and the first token
    for _ in range(gen_len - 1):
        with Clock() as c:
            t = time.perf_counter()
            next(it)
            steps.append((time.perf_counter() - t, c.dispatch, c.wait))
    return summarize(steps)


def profile_pagedmlx(engine, prompts, gen_len: int) -> dict:
    from pagedmlx.sampling_params import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(f"profile-{time.monotonic_ns()}-{i}", prompt,
                           SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True))
    while engine.scheduler.waiting:  # prefill
        engine.step()
    s0 = dataclasses.replace(engine.stats)
    steps = []
    while engine.has_unfinished_requests():
        with Clock() as c:
            t = time.perf_counter()
            engine.step()
            steps.append((time.perf_counter() - t, c.dispatch, c.wait))
    n = engine.stats.num_steps - s0.num_steps
    host = {k: 1e3 * (getattr(engine.stats, k) - getattr(s0, k)) / n for k in ("build_s", "wait_s")}
    return dict(summarize(steps[2:-2]), **host)


def summarize(steps: list[tuple[float, float, float]]) -> dict:
    med = lambda i: 1e3 * statistics.median(s[i] for s in steps)  # noqa: E731
    return dict(step=med(0), dispatch=med(1), wait=med(2), python=med(0) - med(1) - med(2))


def forward_alone(fn, n: int = 20) -> tuple[float, float]:
    """(ms to build the graph, ms to evaluate it) for fn() -> array, medians over n calls."""
    build, run = [], []
    for _ in range(n):
        t = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        build.append(t1 - t)
        run.append(t2 - t1)
    return 1e3 * statistics.median(build), 1e3 * statistics.median(run)


def step_kernels(engine, prompts, steps: int = 10) -> tuple[float, float, list[tuple[float, int, str]]]:
    """(wall ms a step, device ms a step, [(device ms a step, launches a step, kernel)]) over `steps` overlapped
    decode steps, from CUPTI's kernel records (torch.profiler)."""
    from pagedmlx.bench import cupti
    from pagedmlx.sampling_params import SamplingParams

    for i, prompt in enumerate(prompts):
        engine.add_request(f"kernels-{i}", prompt, SamplingParams(temperature=0.0, max_tokens=steps + 8,
                                                                  ignore_eos=True))
    while engine.scheduler.waiting:
        engine.step()
    for _ in range(3):
        engine.step()
    walls = []

    def run():  # the steps' wall time without the profiler's own start and stop
        t = time.perf_counter()
        for _ in range(steps):
            engine.step()
        mx.synchronize()
        walls.append((time.perf_counter() - t) / steps * 1e3)

    kernels = cupti.kernel_times(run)
    while engine.has_unfinished_requests():
        engine.step()
    if kernels is None:
        raise SystemExit("--kernels needs torch with CUDA (CUPTI), as on the GPU machine")
    rows = [(us / 1e3 / steps, count // steps, name) for us, count, name in kernels]
    return walls[0], sum(r[0] for r in rows), rows


def main() -> None:
    from mlx_lm.models.cache import make_prompt_cache
    from rich.console import Console
    from rich.table import Table

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--batch", type=int, default=1, help="decode rows per step (mlx-lm's rows: batch 1 only)")
    ap.add_argument("--quantization", help="the preset quantized as bench_offline.py's --quantization")
    ap.add_argument("--kernels", action="store_true", help="the device's kernels by time (CUDA, torch installed)")
    args = ap.parse_args()
    model = random_model(args.preset, getattr(mx, args.dtype), quantization=parse_quantization(args.quantization))
    prompts = make_prompts(args.batch, args.prompt_len, model.args.vocab_size, 9)
    prompt = prompts[0]
    n = args.prompt_len + args.gen_len
    engine = LLMEngine(model, None, EngineConfig(
        block_size=16, num_blocks=args.batch * (-(-n // 16) + 1) + 8, max_num_seqs=args.batch,
        max_num_batched_tokens=max(2048, args.prompt_len), max_model_len=n + 1, enable_prefix_caching=False))
    engine.async_scheduling = False
    profile_pagedmlx(engine, [p[:16] for p in prompts], 8)  # warm up (kernel compilation), both modes
    engine.async_scheduling = True
    profile_pagedmlx(engine, [p[:16] for p in prompts], 8)
    rows = {}
    if args.batch == 1:
        profile_generate_step(model, prompt[:16], 8)
        rows["mlx-lm generate_step"] = profile_generate_step(model, prompt, args.gen_len)
    engine.async_scheduling = False
    rows["pagedmlx (lockstep)"] = profile_pagedmlx(engine, prompts, args.gen_len)
    engine.config.async_min_batch, engine.async_scheduling = 1, True
    rows["pagedmlx (overlapped)"] = profile_pagedmlx(engine, prompts, args.gen_len)

    console = Console()
    console.print(f"profile_step {args.preset} {args.dtype} on {mx.default_device()}, prompt {args.prompt_len}, "
                  f"{time.strftime('%Y-%m-%d')}")
    table = Table(title=f"batch-{args.batch} decode step, ms (medians)")
    for col in ("engine", "step", "in async_eval", "in eval", "python + host reads"):
        table.add_column(col, justify="right")
    for name, r in rows.items():
        table.add_row(name, *(f"{r[k]:.2f}" for k in ("step", "dispatch", "wait", "python")))
    console.print(table)
    for name in ("pagedmlx (lockstep)", "pagedmlx (overlapped)"):
        console.print(f"  {name}: engine stats per step (means): build {rows[name]['build_s']:.2f} ms "
                      f"(graph + async_eval), wait {rows[name]['wait_s']:.2f} ms (sampled tokens to the host)")

    if args.kernels:
        wall, busy, kernels = step_kernels(engine, prompts)
        ktable = Table(title=f"kernels, batch {args.batch}: {wall:.2f} ms a step, {busy:.2f} ms of it on the device")
        for col in ("ms a step", "launches a step", "kernel"):
            ktable.add_column(col, justify="right" if col != "kernel" else "left")
        for ms, count, name in kernels[:20]:
            ktable.add_row(f"{ms:.3f}", str(count), name[:100])
        console.print(ktable)
    if args.batch > 1:
        return
    # Forward alone, lockstep: mlx-lm's model with its KVCache, ours through the runner's forward.
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt)[None], cache=cache))
    tok = mx.array([[1]])

    def mlx_lm_forward():
        for c in cache:  # stay at the same length: each call decodes the same position
            c.offset = args.prompt_len
        return model(tok, cache=cache)

    alone = Table(title="forward alone, lockstep, ms (medians of 20)")
    for col in ("engine", "build graph", "evaluate (dispatch + device)"):
        alone.add_column(col, justify="right")
    alone.add_row("mlx-lm model + KVCache", *(f"{x:.2f}" for x in forward_alone(mlx_lm_forward)))
    console.print(alone)


if __name__ == "__main__":
    main()
