"""Host work per token of speculative decoding with a draft model at batch 1: pagedmlx's engine steps
against mlx-lm's speculative_generate_step, on the same (target, draft) pair at tiny widths, so that what
is timed is Python and graph construction, not the device (bench_host_step.py does the same for plain
decoding). The target has a preset's layers (default Llama-8B's 32); the draft is its first N layers,
and the target's later layers add nothing (their output projections are zeroed), so that every draft is
accepted in both engines and a round gives k + 1 tokens.

pagedmlx runs its CUDA path (--kernel-standins, default on): page-write and paged-decode kernels
answered by stand-ins (bench_host_step.KernelStandIn), decode steps compiled, as on the H200. Per
output token: "python" is the main thread's CPU time (time.thread_time) less the time inside
mx.async_eval / mx.eval ("dispatch": on a CPU the small ops run there too). A round's host work is what
the device waits for at batch 1, as nothing overlaps it: the next round needs this one's accepted tokens.

Figures: median over interleaved runs of each run's CPU µs per output token; a shared CPU only adds time.

  python scripts/bench/bench_spec_host.py                      # llama-8b layers, draft layers:4, k 4
  python scripts/bench/bench_spec_host.py --profile 30          # + cProfile of our rounds
  PROFILE_SORT=cumulative python scripts/bench/bench_spec_host.py --profile 45   # the profile by cumulative time
  python scripts/bench/bench_spec_host.py --phases              # + our rounds' host time by phase (spec_phases.py)
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_draft import make_draft, scale_tail  # noqa: E402
from scripts.bench.bench_host_step import tiny_model, use_kernel_standins  # noqa: E402
from scripts.bench.bench_offline import make_prompts  # noqa: E402
from scripts.bench.profile_step import Clock  # noqa: E402
from scripts.bench.spec_phases import PhaseClock  # noqa: E402


def make_engine(model, draft, k: int, prompt_len: int, gen_len: int, standins: bool, compiled: bool = True):
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine
    from pagedmlx.spec_decode.config import SpeculativeConfig

    n = prompt_len + gen_len + k + 1
    spec = SpeculativeConfig(method="draft_model", model=draft, num_speculative_tokens=k, disable_by_batch_size=1)
    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=-(-n // 16) + 9, max_num_seqs=1,
                                                 max_num_batched_tokens=max(512, prompt_len), max_model_len=n + 1,
                                                 enable_prefix_caching=False, speculative_config=spec,
                                                 compile_decode=compiled))
    if standins:
        use_kernel_standins(engine, compile_decode=compiled)
        draft_engine = type("DraftRunner", (), {"runner": engine.draft_proposer.runner, "model": draft})()
        use_kernel_standins(draft_engine, compile_decode=compiled)
    return engine


def engine_us(engine, prompt: list[int], gen_len: int, profiler=None) -> dict:
    """CPU µs per output token of the engine's steps after the prefill: python, dispatch; and tokens a round."""
    from pagedmlx.sampling_params import SamplingParams

    stats = engine.scheduler.spec_decoding_stats
    engine.add_request(f"h{time.monotonic_ns()}", prompt, SamplingParams(temperature=0.0, max_tokens=gen_len,
                                                                         ignore_eos=True))
    engine.step()  # the prefill and the first token
    drafts, tokens = stats.num_drafts, 0
    with Clock(time.thread_time) as c:
        if profiler is not None:
            profiler.enable()
        t = time.thread_time()
        while engine.has_unfinished_requests():
            tokens += sum(len(o.new_token_ids) for o in engine.step())
        total = time.thread_time() - t
        if profiler is not None:
            profiler.disable()
    rounds = max(stats.num_drafts - drafts, 1)
    return {"python": 1e6 * (total - c.wait - c.dispatch) / tokens, "dispatch": 1e6 * c.dispatch / tokens,
            "per_round": tokens / rounds}


def mlx_lm_us(model, draft, prompt: list[int], gen_len: int, k: int) -> dict:
    """The same for mlx-lm's speculative_generate_step (its prefill and first token excluded)."""
    from mlx_lm.generate import speculative_generate_step

    it = speculative_generate_step(mx.array(prompt), model, draft, num_draft_tokens=k, max_tokens=gen_len)
    next(it)
    tokens = from_draft = 0
    with Clock(time.thread_time) as c:
        t = time.thread_time()
        for _, _, fd in it:
            tokens += 1
            from_draft += bool(fd)
        total = time.thread_time() - t
    return {"python": 1e6 * (total - c.wait - c.dispatch) / tokens, "dispatch": 1e6 * c.dispatch / tokens,
            "per_round": tokens / max(tokens - from_draft, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-8b")
    ap.add_argument("--draft-layers", type=int, default=4)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--gen-len", type=int, default=96)
    ap.add_argument("--kernel-standins", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--compile-decode", action=argparse.BooleanOptionalAction, default=True,
                    help="our decode and verifying steps through mx.compile (default on, as on the H200)")
    ap.add_argument("--profile", type=int, default=0, metavar="N", help="cProfile of our rounds: the N costliest")
    ap.add_argument("--phases", action="store_true", help="our rounds' host time (CPU time) by phase")
    args = ap.parse_args()
    model = tiny_model(args.preset)
    scale_tail(model, args.draft_layers, 0.0)
    draft = make_draft(model, f"layers:{args.draft_layers}", None)
    engine = make_engine(model, draft, args.k, args.prompt_len, args.gen_len, args.kernel_standins,
                         args.compile_decode)
    prompt = make_prompts(1, args.prompt_len, 512, 9)[0]
    engine_us(engine, prompt[:16], 16)  # warm up both (the compiled steps' traces)
    mlx_lm_us(model, draft, prompt[:16], 16, args.k)
    ours, theirs = [], []
    for _ in range(args.runs):
        ours.append(engine_us(engine, prompt, args.gen_len))
        theirs.append(mlx_lm_us(model, draft, prompt, args.gen_len, args.k))
    med = {name: {f: statistics.median(r[f] for r in runs) for f in runs[0]}
           for name, runs in (("pagedmlx + draft", ours), ("mlx-lm speculative", theirs))}
    print(f"bench_spec_host on {mx.default_device()}, {time.strftime('%Y-%m-%d %H:%M')}: {args.preset} layers at tiny "
          f"widths, draft = its first {args.draft_layers}, k {args.k}, batch 1, prompt {args.prompt_len}, "
          f"{args.gen_len} tokens, median of {args.runs} interleaved runs"
          f"{', CUDA path (kernel stand-ins, compiled decode)' if args.kernel_standins else ''}")
    print("| engine | python µs/token | dispatch µs/token | tokens/round | python µs/round |")
    print("|---|---:|---:|---:|---:|")
    for name, m in med.items():
        print(f"| {name} | {m['python']:.0f} | {m['dispatch']:.0f} | {m['per_round']:.2f} | "
              f"{m['python'] * m['per_round']:.0f} |")
    a, b = med["pagedmlx + draft"], med["mlx-lm speculative"]
    print(f"python per token, pagedmlx / mlx-lm: {a['python'] / b['python']:.2f}x")
    if args.phases:
        stats = engine.scheduler.spec_decoding_stats
        before = stats.num_drafts
        with PhaseClock(engine, time.thread_time) as clock:
            engine_us(engine, prompt, args.gen_len)
        clock.print(stats.num_drafts - before, "main thread's CPU time")
    if args.profile:
        prof = cProfile.Profile()
        engine_us(engine, prompt, args.gen_len, prof)
        pstats.Stats(prof).sort_stats(os.environ.get("PROFILE_SORT", "tottime")).print_stats(args.profile)


if __name__ == "__main__":
    main()
