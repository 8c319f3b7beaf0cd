"""The load of `bench serve`: every request sent at its arrival time, at most `max_concurrency` in
flight, from this process (`run_load`) or split over several client processes (`run_processes`),
each timing its own CPU use, so that the report can say when the client was the bottleneck."""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import queue
import time
from dataclasses import asdict, dataclass
from typing import Callable, Optional, Sequence

import httpx

from pagedmlx.bench.arrivals import arrival_times
from pagedmlx.bench.client import RequestRecord, send_request

TIMEOUT = httpx.Timeout(6 * 3600.0, connect=60.0)  # as vLLM's 6 h: a benchmark waits for slow servers


@dataclass
class Load:
    """What the requests ask for and how they arrive; `bodies[i]` goes with `prompt_lens[i]`."""

    url: str
    bodies: list[dict]
    prompt_lens: list[Optional[int]]
    headers: dict
    max_concurrency: Optional[int] = None
    request_rate: float = float("inf")
    burstiness: float = 1.0
    seed: int = 0


@dataclass
class LoadResult:
    records: list[RequestRecord]
    start: float  # time.perf_counter() at the first send (one clock for all processes of this machine)
    end: float
    cpu_s: float  # this process's CPU time (time.process_time) over [start, end]

    @property
    def busy(self) -> float:
        """The share of the wall time this process spent on the CPU."""
        return self.cpu_s / max(self.end - self.start, 1e-9)


async def run_load(load: Load, on_done: Optional[Callable[[], None]] = None) -> LoadResult:
    """Send every request of `load` from this process; records in the order of `load.bodies`."""
    n = load.max_concurrency
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=n)  # None: no limit
    times = arrival_times(len(load.bodies), load.request_rate, load.burstiness, load.seed)
    gate = asyncio.Semaphore(n) if n else None
    async with httpx.AsyncClient(timeout=TIMEOUT, limits=limits) as client:
        async def one(i: int) -> RequestRecord:
            delay = start + times[i] - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is not None:
                async with gate:
                    rec = await send_request(client, load.url, load.bodies[i], load.headers, load.prompt_lens[i])
            else:
                rec = await send_request(client, load.url, load.bodies[i], load.headers, load.prompt_lens[i])
            if on_done is not None:
                on_done()
            return rec

        cpu, start = time.process_time(), time.perf_counter()
        records = await asyncio.gather(*(one(i) for i in range(len(load.bodies))))
        end = time.perf_counter()
        return LoadResult(list(records), start, end, time.process_time() - cpu)


def split_load(load: Load, parts: int) -> list[Load]:
    """`parts` loads that together are `load`: request i goes to part i % parts; each part gets its
    share of the concurrency and 1/parts of the rate (Poisson processes add up to one of the sum)."""
    n = load.max_concurrency
    if n is not None and n < parts:
        raise ValueError(f"--max-concurrency {n} is less than --num-processes {parts}")
    return [Load(load.url, load.bodies[i::parts], load.prompt_lens[i::parts], load.headers,
                 None if n is None else n // parts + (i < n % parts), load.request_rate / parts, load.burstiness,
                 load.seed + i) for i in range(parts)]


def merge_results(parts: Sequence[LoadResult]) -> LoadResult:
    """The parts of `split_load` back in request order, over the span from the first start to the last end."""
    records: list[Optional[RequestRecord]] = [None] * sum(len(p.records) for p in parts)
    for i, part in enumerate(parts):
        records[i::len(parts)] = part.records
    return LoadResult(records, min(p.start for p in parts), max(p.end for p in parts), sum(p.cpu_s for p in parts))


def _worker(index: int, load: Load, ready, go, counter, results) -> None:
    """One client process (spawned): say it is ready, wait for the others, send its part, hand back its records."""
    def done() -> None:
        with counter.get_lock():
            counter.value += 1

    with ready.get_lock():
        ready.value += 1
    go.wait()
    res = asyncio.run(run_load(load, done))
    results.put((index, [asdict(r) for r in res.records], res.start, res.end, res.cpu_s))


def run_processes(load: Load, num_processes: int, progress: Optional[Callable[[int], None]] = None
                  ) -> tuple[LoadResult, list[LoadResult]]:
    """`load` split over `num_processes` spawned client processes that start together; the merged
    result and each process's own. `progress(n)` is called with the number of requests done so far."""
    ctx = mp.get_context("spawn")
    ready, go, counter, results = ctx.Value("i", 0), ctx.Event(), ctx.Value("i", 0), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(i, part, ready, go, counter, results), daemon=True)
             for i, part in enumerate(split_load(load, num_processes))]
    for p in procs:
        p.start()
    parts: dict[int, LoadResult] = {}

    def check_alive() -> None:
        for i, p in enumerate(procs):
            if i not in parts and p.exitcode not in (None, 0):
                raise RuntimeError(f"client process {i} exited with status {p.exitcode}")

    try:
        while ready.value < num_processes:
            check_alive()
            time.sleep(0.05)
        go.set()
        while len(parts) < num_processes:
            try:
                index, records, start, end, cpu = results.get(timeout=0.2)
                parts[index] = LoadResult([RequestRecord(**r) for r in records], start, end, cpu)
            except queue.Empty:
                check_alive()
            if progress is not None:
                progress(counter.value)
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    ordered = [parts[i] for i in range(num_processes)]
    return merge_results(ordered), ordered
