"""Serving benchmark: N concurrent streaming clients against one or more OpenAI-compatible servers
(pagedmlx serve, mlx_lm.server, ...) on the same model; output tok/s, TTFT and ITL percentiles,
and a table with each server's ratio to the first one.

    pagedmlx serve --model M --port 8000 &
    mlx_lm.server --model M --port 8080 &
    python scripts/bench/bench_serve.py --target pagedmlx=http://127.0.0.1:8000 \\
        --target mlx-lm=http://127.0.0.1:8080 --model M --clients 1 8 32 64

or let it start each server in turn (one at a time, so they never share the machine), and also run
pagedmlx's offline engine on the same prompts at batch N for the server's overhead:

    python scripts/bench/bench_serve.py --spawn M --clients 1 8 32 64 --offline

Each request streams /v1/completions with a prompt of --prompt-words random plain English
words, temperature 0 and ignore_eos (servers that do not know it just ignore it). TTFT is the time
to the first chunk with text; ITL the gaps between later text chunks, divided by the tokens they
carry when the server reports token ids, else per chunk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

WORDS = ("the quick brown fox jumps over a lazy dog while paged attention keeps every sequence's "
         "cache in fixed size blocks shared across requests").split()


@dataclass
class RequestResult:
    ttft: float = float("nan")
    itls: list[float] = field(default_factory=list)
    tokens: int = 0
    error: str = ""


@dataclass
class RunResult:
    name: str
    wall_s: float
    results: list[RequestResult]

    def ok(self) -> list[RequestResult]:
        return [r for r in self.results if not r.error]

    def tok_per_s(self) -> float:
        return sum(r.tokens for r in self.ok()) / self.wall_s

    def pct(self, what: str, q: float) -> float:
        values = [r.ttft for r in self.ok()] if what == "ttft" else [x for r in self.ok() for x in r.itls]
        return float(np.percentile(values, q)) * 1000 if values else float("nan")


def make_prompts(n: int, words: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


async def one_request(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> RequestResult:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True, "stream_options": {"include_usage": True}}
    res = RequestResult()
    t0 = last = time.perf_counter()
    counted = 0
    try:
        async with client.stream("POST", url + "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    res.tokens = chunk["usage"].get("completion_tokens", res.tokens)
                for choice in chunk.get("choices") or []:
                    ids = choice.get("token_ids")
                    n = len(ids) if ids else (1 if choice.get("text") else 0)
                    if not n:
                        continue
                    now = time.perf_counter()
                    if counted == 0:
                        res.ttft = now - t0
                    else:
                        res.itls.extend([(now - last) / n] * n)
                    last, counted = now, counted + n
    except httpx.HTTPError as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.tokens = res.tokens or counted
    return res


async def run_target(name: str, url: str, args: argparse.Namespace, clients: int) -> RunResult:
    prompts = make_prompts(requests_for(clients, args), args.prompt_words, args.seed)
    limits = httpx.Limits(max_connections=clients)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits) as client:
        await one_request(client, url, args.model, prompts[0], 4)  # warm-up
        queue: asyncio.Queue = asyncio.Queue()
        for p in prompts:
            queue.put_nowait(p)
        results: list[RequestResult] = []

        async def worker():
            while not queue.empty():
                results.append(await one_request(client, url, args.model, queue.get_nowait(), args.max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        return RunResult(name, time.perf_counter() - t0, results)


def print_table(runs: list[RunResult], clients: int) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"streaming completions, {clients} concurrent clients")
    cols = [("output tok/s", lambda r: r.tok_per_s(), True)]
    for what in ("ttft", "itl"):
        for q in (50, 90, 99):
            cols.append((f"{what.upper()} p{q} ms", lambda r, w=what, q=q: r.pct(w, q), False))
    table.add_column("server")
    table.add_column("ok / errors")
    for title, _, _ in cols:
        table.add_column(title, justify="right")
    base = runs[0]
    for run in runs:
        cells = [run.name, f"{len(run.ok())} / {len(run.results) - len(run.ok())}"]
        for _, fn, _higher_better in cols:
            value, ref = fn(run), fn(base)
            ratio = "" if run is base or not ref else f" ({value / ref:.2f}x)"
            cells.append(f"{value:.1f}{ratio}")
        table.add_row(*cells)
    Console(width=160).print(table)
    errors = [r.error for run in runs for r in run.results if r.error]
    if errors:
        Console().print(f"[red]{len(errors)} errors[/], first: {errors[0]}")


def run_offline(model_path: str, args: argparse.Namespace, clients: int) -> RunResult:
    """pagedmlx's offline engine on the same prompts, `clients` requests at a time, for reference."""
    from pagedmlx.engine import LLM
    from pagedmlx.sampling_params import SamplingParams

    llm = LLM(model_path, max_num_seqs=clients)
    prompts = make_prompts(requests_for(clients, args), args.prompt_words, args.seed)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    llm.generate(prompts[:1], params, use_tqdm=False)  # warm-up
    t0 = time.perf_counter()
    outs = []
    for i in range(0, len(prompts), clients):
        outs += llm.generate(prompts[i:i + clients], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return RunResult("pagedmlx offline", wall, [RequestResult(tokens=len(o.token_ids)) for o in outs])


def requests_for(clients: int, args: argparse.Namespace) -> int:
    return args.requests or max(2 * clients, 8)


def spawn(cmd: list[str], url: str, timeout: float = 300.0):
    """Start a server and wait until it answers /v1/models."""
    import subprocess

    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{cmd[0]} exited with {proc.returncode}")
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not start within {timeout:g} s")


def spawned_targets(model: str, args: argparse.Namespace):
    """(name, command, url) for pagedmlx serve and mlx_lm.server on the same model folder."""
    port = 8765
    return [("pagedmlx", [sys.executable, "-m", "pagedmlx.cli", "serve", "--model", model, "--port", str(port),
                          "--max-num-seqs", str(max(args.clients))], f"http://127.0.0.1:{port}"),
            ("mlx_lm.server", [sys.executable, "-m", "mlx_lm", "server", "--model", model, "--port", str(port + 1),
                               "--decode-concurrency", str(max(args.clients))],
             f"http://127.0.0.1:{port + 1}")]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", action="append", default=[], help="NAME=URL (repeat; the first is the baseline)")
    p.add_argument("--spawn", metavar="MODEL", help="start pagedmlx serve, then mlx_lm.server, on this model folder")
    p.add_argument("--offline", action="store_true", help="also run pagedmlx's offline engine (needs --spawn)")
    p.add_argument("--model", default=None, help="model id sent in requests (default: --spawn's, or `default`)")
    p.add_argument("--clients", type=int, nargs="+", default=[32], help="concurrent streaming clients (several: "
                                                                        "one table each)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: 2 x clients, >= 8)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--prompt-words", type=int, default=100)
    p.add_argument("--timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    args.model = args.model or args.spawn or "default"
    runs: dict[int, list[RunResult]] = {n: [] for n in args.clients}
    if args.spawn:
        for name, cmd, url in spawned_targets(args.spawn, args):
            proc = spawn(cmd, url)
            try:
                for n in args.clients:
                    runs[n].append(asyncio.run(run_target(name, url, args, n)))
                    print(f"{name}, {n} clients: {runs[n][-1].tok_per_s():.1f} output tok/s", flush=True)
            finally:
                proc.terminate()
                proc.wait(30)
        if args.offline:
            for n in args.clients:
                runs[n].append(run_offline(args.spawn, args, n))
                print(f"offline engine, batch {n}: {runs[n][-1].tok_per_s():.1f} output tok/s", flush=True)
    for target in args.target:
        name, _, url = target.partition("=")
        for n in args.clients:
            runs[n].append(asyncio.run(run_target(name, url.rstrip("/"), args, n)))
    if not any(runs.values()):
        p.error("give --spawn MODEL or at least one --target NAME=URL")
    for n in args.clients:
        print_table(runs[n], n)


if __name__ == "__main__":
    main()
