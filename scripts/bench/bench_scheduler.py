#!/usr/bin/env python3
"""CPU cost of one scheduler step (schedule() + update_from_output()) for a batch of decodes.

Each batch size gets its own scheduler holding that many running requests. Their contexts grow
by one token a step from `--context - steps/2` to `--context + steps/2`, staggered over one block
so that every step some requests fill a block (and hash it) while the others only append. Prefill
steps are run first and not timed; then `--steps` decode steps are timed one by one. No model: the
"sampled" tokens are random ids. The max column includes Python's garbage collector, which now and
then walks every live object (all requests' token lists and block hashes).

    python scripts/bench/bench_scheduler.py              # batches 32, 64, 128, 256
    python scripts/bench/bench_scheduler.py --batches 256 --steps 2000
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.config import EngineConfig  # noqa: E402
from pagedmlx.kv.manager import KVCacheManager  # noqa: E402
from pagedmlx.request import Request  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402
from pagedmlx.scheduler import Scheduler  # noqa: E402


def make_decoding_scheduler(batch: int, context: int, block_size: int, steps: int, seed: int) -> Scheduler:
    rng = random.Random(seed)
    max_len = context + block_size + steps + 8
    num_blocks = batch * (-(-max_len // block_size) + 1)
    # A budget that prefills every prompt in the first (untimed) step: all requests start decoding
    # together and none runs out of max_tokens during the timed steps.
    config = EngineConfig(block_size=block_size, num_blocks=num_blocks, max_num_seqs=max(batch, 1),
                          max_num_batched_tokens=batch * max_len, long_prefill_token_threshold=0,
                          max_model_len=max_len + 16)
    sched = Scheduler(config, KVCacheManager(num_blocks, block_size), config.max_model_len)
    for i in range(batch):
        prompt_len = context - steps // 2 + i % block_size  # staggered: block boundaries spread over steps
        prompt = [rng.randrange(1, 32000) for _ in range(prompt_len)]
        sched.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=steps + 2), eos_token_ids=(0,)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in sched.requests.values()):
        out = sched.schedule()
        sched.update_from_output(out, [rng.randrange(1, 32000) for _ in out.sampled_req_ids])
    assert len(sched.running) == batch, "warm-up left requests waiting"
    return sched


def time_steps(sched: Scheduler, steps: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    tokens = [rng.randrange(1, 32000) for _ in range(4096)]
    times = []
    gc.collect()
    for step in range(steps):
        t0 = time.perf_counter()
        out = sched.schedule()
        sched.update_from_output(out, tokens[step % 2048: step % 2048 + len(out.sampled_req_ids)])
        times.append(time.perf_counter() - t0)
        assert out.num_decodes == len(out.req_ids) == len(sched.running), "a timed step was not all decodes"
    return times


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--profile", action="store_true", help="cProfile the timed steps of the largest batch")
    args = ap.parse_args()

    rows = []
    for batch in args.batches:
        sched = make_decoding_scheduler(batch, args.context, args.block_size, args.steps, args.seed)
        if args.profile and batch == max(args.batches):
            import cProfile
            import pstats
            prof = cProfile.Profile()
            prof.enable()
            times = time_steps(sched, args.steps, args.seed)
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(15)
        else:
            times = time_steps(sched, args.steps, args.seed)
        ms = [t * 1e3 for t in times]
        rows.append((batch, statistics.median(ms), percentile(ms, 0.9), max(ms),
                     statistics.median(ms) * 1e3 / batch))

    header = ("batch", "median ms", "p90 ms", "max ms", "median us/req")
    print(f"scheduler step = schedule() + update_from_output(); contexts {args.context - args.steps // 2}.."
          f"{args.context + args.steps // 2} tokens, block_size {args.block_size}, {args.steps} timed decode "
          f"steps per batch")
    print("  ".join(f"{h:>13}" for h in header))
    for batch, med, p90, mx, per in rows:
        print(f"{batch:>13}  {med:>13.3f}  {p90:>13.3f}  {mx:>13.3f}  {per:>13.2f}")


if __name__ == "__main__":
    main()
