"""Where a served token's CPU time goes: `pagedmlx serve` under N streaming clients, with the CPU
seconds of the server's front-end process and of its engine-core process (Linux: /proc) divided by
the tokens streamed. CPU time per token is steady where wall-clock throughput on a shared machine is
not, so it compares front-end designs (a thread or a process for the core, the SSE path, uvloop) by
what each token costs, not by how busy the machine happened to be.

    python scripts/bench/profile_frontend.py --clients 64 --config process= --config thread=--no-engine-process
    python scripts/bench/profile_frontend.py --tree old=/tmp/old-checkout --tree new=.   # two source trees

Each config (or tree) serves `--model` (default random:llama-tiny) alone in turn; the client streams
/v1/completions with `--prompt-len` token ids, `--max-tokens` new tokens, greedy, ignore_eos, keeping
`--clients` requests in flight for `--requests` requests. The table gives each run's ratio to the first.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

import httpx
import numpy as np

CLK_TCK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


@dataclass
class Run:
    name: str
    wall_s: float = 0.0
    tokens: int = 0
    errors: int = 0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    front_cpu: float = 0.0
    core_cpu: float = 0.0
    client_cpu: float = 0.0

    def per_1k(self, cpu: float) -> float:
        return 1000 * cpu / max(self.tokens, 1)


async def stream_one(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int, run: Run) -> None:
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = last = time.perf_counter()
    first = True
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                run.errors += 1
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    run.tokens += chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                now = time.perf_counter()
                (run.ttfts if first else run.itls).append(now - (t0 if first else last))
                first, last = False, now
    except httpx.HTTPError:
        run.errors += 1


async def load(url: str, args: argparse.Namespace, run: Run) -> None:
    rng = random.Random(0)
    prompts = [[rng.randrange(1, 400) for _ in range(args.prompt_len)] for _ in range(args.requests)]
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=args.clients)) as client:
        await stream_one(client, url, prompts[0], 4, Run("warm-up"))

        async def worker():
            while not queue.empty():
                await stream_one(client, url, queue.get_nowait(), args.max_tokens, run)

        t0, c0 = time.perf_counter(), time.process_time()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        run.wall_s, run.client_cpu = time.perf_counter() - t0, time.process_time() - c0


def serve_and_load(name: str, cmd: list[str], env: dict, cwd: str, args: argparse.Namespace) -> Run:
    port = args.port
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([*cmd, "--port", str(port), "--log-level", "warning"], env=env, cwd=cwd,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 300
        while True:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{name}: the server did not start ({shlex.join(cmd)})")
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.5)
        pids = [proc.pid] + [c for c in children(proc.pid) if "spawn_main" in open(f"/proc/{c}/cmdline").read()]
        before = [cpu_seconds(p) for p in pids]
        run = Run(name)
        asyncio.run(load(url, args, run))
        after = [cpu_seconds(p) for p in pids]
        run.front_cpu = after[0] - before[0]
        run.core_cpu = sum(after[1:]) - sum(before[1:])
        return run
    finally:
        proc.terminate()
        proc.wait(60)


def print_table(runs: list[Run], clients: int) -> None:
    from rich.console import Console
    from rich.table import Table

    cols = [("output tok/s", lambda r: r.tokens / r.wall_s),
            ("TTFT p50 ms", lambda r: 1000 * float(np.percentile(r.ttfts, 50))),
            ("TTFT p90 ms", lambda r: 1000 * float(np.percentile(r.ttfts, 90))),
            ("ITL p50 ms", lambda r: 1000 * float(np.percentile(r.itls, 50))),
            ("ITL p90 ms", lambda r: 1000 * float(np.percentile(r.itls, 90))),
            ("front-end CPU s / 1k tok", lambda r: r.per_1k(r.front_cpu)),
            ("core CPU s / 1k tok", lambda r: r.per_1k(r.core_cpu)),
            ("client CPU s / 1k tok", lambda r: r.per_1k(r.client_cpu))]
    table = Table(title=f"pagedmlx serve, {clients} streaming clients")
    table.add_column("run")
    table.add_column("tokens / errors")
    for title, _ in cols:
        table.add_column(title, justify="right")
    for run in runs:
        cells = [run.name, f"{run.tokens} / {run.errors}"]
        for _, fn in cols:
            value, ref = fn(run), fn(runs[0])
            cells.append(f"{value:.3g}" + ("" if run is runs[0] or not ref else f" ({value / ref:.2f}x)"))
        table.add_row(*cells)
    Console(width=200).print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="random:llama-tiny")
    p.add_argument("--config", action="append", default=[], help="NAME=EXTRA SERVE ARGS (repeat)")
    p.add_argument("--tree", action="append", default=[], help="NAME=PATH: serve from this source tree (repeat)")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=None, help="default: 4 x clients")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--prompt-len", type=int, default=100)
    p.add_argument("--port", type=int, default=8391)
    p.add_argument("--repeat", type=int, default=1, help="run the configs in turn this many times")
    args = p.parse_args()
    args.requests = args.requests or 4 * args.clients
    base = [sys.executable, "-m", "pagedmlx.cli", "serve", args.model, "--max-num-seqs", str(args.clients)]
    targets = []
    for spec in args.config or ["default="]:
        name, _, extra = spec.partition("=")
        targets.append((name, base + shlex.split(extra), dict(os.environ), os.getcwd()))
    for spec in args.tree:
        name, _, path = spec.partition("=")
        path = os.path.abspath(path)  # run from there: `python -m` puts the working folder first on sys.path
        targets.append((name, base, dict(os.environ, PYTHONPATH=path), path))
    runs = []
    for _ in range(args.repeat):
        for name, cmd, env, cwd in targets:
            runs.append(serve_and_load(name, cmd, env, cwd, args))
            r = runs[-1]
            print(f"{name}: {r.tokens / r.wall_s:.0f} tok/s, front-end {r.per_1k(r.front_cpu):.3f} s / 1k tok, "
                  f"core {r.per_1k(r.core_cpu):.3f}", flush=True)
    print_table(runs, args.clients)


if __name__ == "__main__":
    main()
