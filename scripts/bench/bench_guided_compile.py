"""Does compiling a new grammar slow the others? (issue 27: a new schema's compile must not lengthen
other requests' inter-token latency p90 by more than 10%.) An engine core in its own process
(as `pagedmlx serve` runs it) decodes `--streams` unguided requests; meanwhile a guided request arrives
every `--every` seconds, in one run always with the same schema (compiled once, then from the cache),
in the other with a schema never seen before (its grammar compiles in the core's pool, off the step
loop). The same requests join the batch either way, so the difference is the compiles. The unguided
streams' ITL p50 / p90 of each run and their ratio; the runs alternate `--rounds` times.

    python scripts/bench/bench_guided_compile.py --model random:llama-small --streams 32
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.async_engine import AsyncEngine  # noqa: E402
from pagedmlx.config import EngineConfig  # noqa: E402
from pagedmlx.core.client import CoreProcess  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402
from pagedmlx.structured_outputs.params import StructuredOutputsParams  # noqa: E402


def schema(k: int) -> dict:
    """A schema no earlier request had (its property names carry k): a cache miss, a fresh compile."""
    props = {f"field_{k}_{i}": {"type": t} for i, t in enumerate(["string", "integer", "boolean", "number"] * 3)}
    return {"type": "object", "properties": props, "required": list(props)[:6], "additionalProperties": False}


async def itls(ae: AsyncEngine, streams: int, tokens: int, every: float, seq: list[int], fresh: bool) -> list[float]:
    plain = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    gaps: list[float] = []

    async def one(i: int) -> None:
        last = None
        async for _ in ae.generate([1 + i, 2, 3, 4], plain, f"u{seq[0]}-{i}"):
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now

    async def guided() -> None:
        while True:
            await asyncio.sleep(every)
            seq[0] += 1
            params = SamplingParams(temperature=0.0, max_tokens=8,
                                    structured_outputs=StructuredOutputsParams(json=schema(seq[0] if fresh else 0)))
            asyncio.ensure_future(_drain(ae.generate([5, 6, 7], params, f"g{seq[0]}")))

    feeder = asyncio.ensure_future(guided()) if every > 0 else None
    seq[0] += 1
    await asyncio.gather(*(one(i) for i in range(streams)))
    if feeder is not None:
        feeder.cancel()
    await asyncio.sleep(0.5)
    return gaps


async def _drain(gen) -> None:
    async for _ in gen:
        pass


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:llama-small")
    ap.add_argument("--streams", type=int, default=32)
    ap.add_argument("--tokens", type=int, default=96)
    ap.add_argument("--every", type=float, default=0.1, help="seconds between new-schema requests")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    ae = AsyncEngine(CoreProcess(EngineConfig(model=args.model, max_num_seqs=args.streams + 16)))

    async def run() -> dict[str, list[tuple[float, float]]]:
        seq = [0]
        await itls(ae, 4, 8, args.every, seq, False)  # warm-up, and schema 0 compiled
        out: dict[str, list[tuple[float, float]]] = {"cached schema": [], "new schemas": []}
        for _ in range(args.rounds):
            for name, fresh in (("cached schema", False), ("new schemas", True)):
                g = np.array(await itls(ae, args.streams, args.tokens, args.every, seq, fresh)) * 1000
                out[name].append((float(np.percentile(g, 50)), float(np.percentile(g, 90))))
        return out

    out = asyncio.run(run())
    ae.shutdown(timeout=0)
    med = {k: (statistics.median(p for p, _ in v), statistics.median(q for _, q in v)) for k, v in out.items()}
    a, b = med["cached schema"], med["new schemas"]
    print(f"{args.model}, {args.streams} unguided streams, a guided request every {args.every:g} s, "
          f"median of {args.rounds} rounds")
    print(f"  unguided ITL p50 / p90: guided requests of a cached schema {a[0]:.1f} / {a[1]:.1f} ms; "
          f"of new schemas {b[0]:.1f} / {b[1]:.1f} ms; "
          f"p90 ratio {b[1] / a[1]:.3f}")


if __name__ == "__main__":
    main()
