"""Host work per decode step at batch 1: pagedmlx's whole engine step against mlx-lm's generate_step,
on models with the presets' layer structure (layer count, layer kinds, windows, recurrent layers) at
tiny widths, so that what is timed is Python and graph construction, not the device.

pagedmlx (lockstep steps): schedule + build (runner.forward, sampler) + process (update, stop checks,
outputs): the step's Python, without mx.async_eval (dispatch) and the wait for the sampled token.
mlx-lm: its _step (model call on a KVCache, logsumexp, argmax), as generate_step runs it per token.
On a CPU mx.async_eval runs most of the graph (tiny ops), so dispatch is reported apart, with the
graph's node count (export_to_dot): on CUDA each node is about one kernel launch to encode.
Times are the main thread's CPU time (time.thread_time): on a shared CPU, wall time also counts
the other processes' and MLX's own threads' turns on the cores, which is not host work of ours.
Runs are interleaved (pagedmlx, mlx-lm, pagedmlx, ...); each figure is the median over runs of each
run's fastest quartile of steps (interference only adds time). "nodes": operations in one decode step's
graph (export_to_dot), a count no noise touches.

  python scripts/bench/bench_host_step.py                              # the three presets
  python scripts/bench/bench_host_step.py --presets llama-8b --runs 5 --profile   # + cProfile of the step
  python scripts/bench/bench_host_step.py --kernel-standins    # the CUDA path's graph (see below)

--kernel-standins: the engine builds its steps as on CUDA (page-write, paged-decode and recurrent-state
kernels), each kernel call answered by a stand-in that returns zeros
depending on its inputs: the host work of the CUDA path without a GPU (less MLX's own cost of a
cuda_kernel call, which renders the kernel's source each call); the tokens are garbage. Its node
count leaves the stand-ins' own extra nodes out (one per kernel output).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.presets import PRESETS  # noqa: E402
from scripts.bench.bench_offline import make_prompts  # noqa: E402
from scripts.bench.profile_step import Clock  # noqa: E402

_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             vocab_size=512)
_TINY_GDN = dict(linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16)


def tiny_config(preset: str) -> dict:
    """The preset's config at tiny widths: its layers, kinds and windows kept."""
    cfg = dict(PRESETS[preset])
    if "text_config" in cfg:
        cfg["text_config"] = dict(cfg["text_config"], **_TINY, **_TINY_GDN)
        return cfg
    cfg.update(_TINY)
    cfg.pop("query_pre_attn_scalar", None)
    return cfg


def tiny_model(preset: str):
    from mlx_lm.utils import _get_classes

    cfg = tiny_config(preset)
    model_class, args_class = _get_classes(cfg)
    mx.random.seed(0)
    model = model_class(args_class.from_dict(cfg))
    mx.eval(model.parameters())
    return model


class KernelStandIn:
    """build.make_kernel's stand-in: each call's outputs are zeros that depend on its inputs."""

    calls = 0

    def __init__(self, backend, name, input_names, output_names, source, header):
        self.name = name

    def __call__(self, *, inputs, output_shapes, output_dtypes, **launch):
        KernelStandIn.calls += len(output_shapes)
        return [mx.depends(mx.zeros(shape, dtype), inputs) for shape, dtype in zip(output_shapes, output_dtypes)]


def use_kernel_standins(engine, compile_decode: bool = False) -> None:
    """Make the engine's runner build its steps as on CUDA, with KernelStandIn for every kernel;
    compile_decode: its decode-only steps through mx.compile (EngineConfig.compile_decode)."""
    from pagedmlx.kernels import build, decode_attention, page_write, recurrent_state
    from pagedmlx.kernels.dialect import CUDA
    from pagedmlx.kernels.selector import KernelPlan

    build.make_kernel = KernelStandIn
    for cache in (decode_attention._kernels, page_write._write_kernel, recurrent_state._kernel):
        cache.cache_clear()
    runner = engine.runner
    owners = [p.state.owner for p in runner.plan if p.state is not None]
    runner.kernels = KernelPlan(CUDA, decode=True, page_write=True, state=bool(owners))
    if owners:  # the recurrent-state kernels too, writing the state pool "in place"
        recurrent_state.install_kernels(engine.model, owners)
        runner.state_pool.in_place = True
    if compile_decode:
        from pagedmlx.runner.compiled_step import CompiledDecode

        engine.runner.compiled_decode = CompiledDecode(engine.runner)


def make_engine(model, prompt_len: int, gen_len: int):
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine

    n = prompt_len + gen_len
    return LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=-(-n // 16) + 9, max_num_seqs=1,
                                               max_num_batched_tokens=max(512, prompt_len), max_model_len=n + 1,
                                               enable_prefix_caching=False, async_scheduling=False))


def engine_host_us(engine, prompt: list[int], gen_len: int, profiler=None) -> dict:
    """Median CPU µs per decode step of the step's Python (schedule + build + process), and of mx.async_eval."""
    from pagedmlx.sampling_params import SamplingParams

    engine.add_request(f"h{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=gen_len,
                                                                         ignore_eos=True))
    engine.step()  # the prefill
    rows = []
    while engine.has_unfinished_requests():
        if profiler is not None:
            profiler.enable()
        with Clock(time.thread_time) as c:
            t = time.thread_time()
            engine.step()
            total = time.thread_time() - t
        if profiler is not None:
            profiler.disable()
        rows.append((total - c.wait - c.dispatch, c.dispatch))
    rows = rows[2:-1]
    return {k: 1e6 * quartile([r[i] for r in rows]) for i, k in enumerate(("host", "dispatch"))}


def quartile(xs: list[float]) -> float:
    """The first quartile: a step's time without the interference a shared CPU adds."""
    return statistics.quantiles(xs, n=4)[0]


def generate_step_host_us(model, prompt: list[int], gen_len: int) -> tuple[float, float]:
    """Median µs per token of generate_step's _step (Python), and of its mx.async_eval."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
    mx.eval([c.state for c in cache])
    y = mx.array(prompt[-1:])
    build, dispatch = [], []
    for _ in range(gen_len):
        t = time.thread_time()
        logits = model(y[None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, keepdims=True)
        next_y = mx.argmax(logprobs, axis=-1)
        t1 = time.thread_time()
        mx.async_eval(next_y, logprobs.squeeze(0))
        build.append(t1 - t)
        dispatch.append(time.thread_time() - t1)
        next_y.item()
        y = next_y
    return 1e6 * quartile(build[2:]), 1e6 * quartile(dispatch[2:])


def graph_nodes(*outputs: mx.array) -> int:
    """Nodes (operations) in the graph of `outputs`: on CUDA about one kernel launch each."""
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as f:
        mx.export_to_dot(f.name, *outputs)
        return sum("shape=rectangle" in line for line in open(f.name))


def step_nodes(engine, model, prompt: list[int]) -> tuple[int, int]:
    """(pagedmlx, mlx-lm) nodes of one batch-1 decode step's graph: forward, page writes, greedy token."""
    from mlx_lm.models.cache import make_prompt_cache

    from pagedmlx.sampling_params import SamplingParams

    core = getattr(engine, "engine_core", engine)
    engine.add_request(f"n{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=4,
                                                                         ignore_eos=True))
    engine.step()
    so = core.scheduler.schedule()
    calls, async_eval = KernelStandIn.calls, mx.async_eval
    mx.async_eval = lambda *arrays: None  # the runner dispatches in-place steps itself: count them first
    try:
        token = mx.argmax(core.runner.forward(so), axis=-1)
    finally:
        mx.async_eval = async_eval
    pools = [a for a in core.runner.kv_pool.keys + core.runner.kv_pool.values if a is not None]
    ours = graph_nodes(token, *pools) - (KernelStandIn.calls - calls)
    engine.abort_request([so.req_ids[0]])
    while engine.has_unfinished_requests():
        engine.step()
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array(prompt[:-1])[None], cache=cache))
    logits = model(mx.array(prompt[-1:])[None], cache=cache)[:, -1, :]
    logprobs = logits - mx.logsumexp(logits, keepdims=True)
    states = [s for c in cache for s in (c.state if isinstance(c.state, (list, tuple)) else [c.state])
              if isinstance(s, mx.array)]
    return ours, graph_nodes(mx.argmax(logprobs, axis=-1), logprobs, *states)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--presets", nargs="+", default=["llama-8b", "gemma3-27b-16l", "qwen3.5-27b-16l"])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=48)
    ap.add_argument("--profile", action="store_true", help="print the top of a cProfile of the engine's steps")
    ap.add_argument("--kernel-standins", action="store_true", help="the engine's CUDA path, kernels stood in for")
    ap.add_argument("--compile-decode", action="store_true", help="with --kernel-standins: decode steps compiled")
    args = ap.parse_args()
    print(f"bench_host_step on {mx.default_device()}, {time.strftime('%Y-%m-%d %H:%M')}: batch 1, prompt "
          f"{args.prompt_len}, {args.gen_len} tokens, median of {args.runs} interleaved runs, tiny widths"
          f"{', CUDA path (kernel stand-ins)' if args.kernel_standins else ''}"
          f"{', decode steps compiled' if args.compile_decode else ''}")
    print(f"{'preset':>16} {'layers':>6} | {'engine step µs':>14} {'dispatch':>8} {'nodes':>6} | "
          f"{'generate_step µs':>16} {'dispatch':>8} {'nodes':>6} | {'engine / mlx-lm':>15}")
    for preset in args.presets:
        model = tiny_model(preset)
        engine = make_engine(model, args.prompt_len, args.gen_len)
        if args.kernel_standins:
            use_kernel_standins(engine, args.compile_decode)
        prompt = make_prompts(1, args.prompt_len, 512, 9)[0]
        engine_host_us(engine, prompt[:16], 8)  # warm up both
        generate_step_host_us(model, prompt[:16], 8)
        ours, theirs = [], []
        for _ in range(args.runs):
            ours.append(engine_host_us(engine, prompt, args.gen_len))
            theirs.append(generate_step_host_us(model, prompt, args.gen_len))
        med = {k: statistics.median(o[k] for o in ours) for k in ours[0]}
        peer, peer_dispatch = (statistics.median(t[i] for t in theirs) for i in (0, 1))
        layers = len(model.layers)
        nodes = step_nodes(engine, model, prompt)
        print(f"{preset:>16} {layers:>6} | {med['host']:14.0f} {med['dispatch']:8.0f} {nodes[0]:6d} | {peer:16.0f} "
              f"{peer_dispatch:8.0f} {nodes[1]:6d} | {med['host'] / peer:15.2f}", flush=True)
        if args.profile:
            prof = cProfile.Profile()
            engine_host_us(engine, prompt, args.gen_len, prof)
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
