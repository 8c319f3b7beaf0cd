"""Server-probe findings, replayed against a real `pagedmlx serve` (loopback only):
idle sockets past mlx-lm's old open-file cap, 1 MiB prompts while /health is polled, a lone surrogate
escape, HEAD /health, and SIGTERM with streams running. Prints one line per finding.

  python scripts/probe_server.py                          # random:llama-tiny, as the probe ran it
  python scripts/probe_server.py --model <path> --idle 3000
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import signal
import socket
import subprocess
import sys
import time

import httpx


def start(model: str, port: int, log_path: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedmlx.cli", "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    proc = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200:
                return proc
        except httpx.TransportError:
            time.sleep(0.2)
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"the server did not start; see {log_path}")


def idle_sockets(url: str, port: int, n: int) -> str:
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(n)]
    codes, slowest = [], 0.0
    with httpx.Client(timeout=5) as client:
        for _ in range(5):
            t = time.monotonic()
            try:
                codes.append(client.get(url + "/health", headers={"connection": "close"}).status_code)
            except httpx.HTTPError as e:
                codes.append(type(e).__name__)
            slowest = max(slowest, time.monotonic() - t)
    t, closed = time.monotonic(), 0
    for s in socks:
        s.settimeout(30)
        try:
            closed += s.recv(1) == b""
        except OSError:
            pass
        s.close()
    return (f"{n:,} idle sockets: /health {codes}, slowest {slowest * 1000:.0f} ms; "
            f"{closed:,} closed by the server within {time.monotonic() - t:.1f} s")


async def _while_polling_health(url: str, requests: list) -> tuple[list[int], float, float]:
    slowest, stop = 0.0, asyncio.Event()
    async with httpx.AsyncClient(timeout=120) as client:
        async def poll():
            nonlocal slowest
            while not stop.is_set():
                t = time.monotonic()
                await client.get(url + "/health")
                slowest = max(slowest, time.monotonic() - t)
                await asyncio.sleep(0.02)

        poller = asyncio.create_task(poll())
        await asyncio.sleep(0.1)
        t = time.monotonic()
        responses = await asyncio.gather(*(client.post(url + path, json=body) for path, body in requests))
        took = time.monotonic() - t
        await asyncio.sleep(0.1)
        stop.set()
        await poller
    return [r.status_code for r in responses], took, slowest


def huge_prompts(url: str, model: str) -> str:
    text = ("lorem ipsum dolor sit amet " * 40000)[: 1024 * 1024 - 1000]
    body = {"model": model, "prompt": text, "max_tokens": 2}
    statuses, took, slowest = asyncio.run(_while_polling_health(url, [("/v1/completions", body)] * 8))
    return f"8 x 1 MiB prompts: statuses {statuses} in {took:.2f} s; slowest /health meanwhile {slowest * 1000:.0f} ms"


def contract(url: str, model: str) -> str:
    raw = b'{"model": "%s", "prompt": "Hel\\ud800lo"}' % model.encode()
    r = httpx.post(url + "/v1/completions", content=raw, headers={"content-type": "application/json"})
    head = httpx.head(url + "/health").status_code
    return f"lone surrogate in prompt: {r.status_code} (param {r.json()['error'].get('param')!r}); HEAD /health: {head}"


def sigterm_under_load(url: str, model: str, proc: subprocess.Popen, streams: int) -> str:
    body = {"model": model, "prompt": "hi", "max_tokens": 400, "stream": True, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            async def one():
                last, reason = None, None
                async with client.stream("POST", url + "/v1/completions", json=body) as r:
                    async for line in r.aiter_lines():
                        if line.startswith("data:"):
                            last = line[5:].strip()
                            if '"finish_reason":"' in last.replace(" ", ""):
                                reason = last.replace(" ", "").split('"finish_reason":"')[1].split('"')[0]
                return f"{reason}+{last}"

            tasks = [asyncio.create_task(one()) for _ in range(streams)]
            await asyncio.sleep(0.5)
            t = time.monotonic()
            proc.send_signal(signal.SIGTERM)
            ends = await asyncio.gather(*tasks, return_exceptions=True)
            return ends, t

    ends, t = asyncio.run(run())
    code = proc.wait(120)
    return (f"SIGTERM with {streams} streams running: exit {code} after {time.monotonic() - t:.1f} s; "
            f"streams ended {ends}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="random:llama-tiny")
    ap.add_argument("--port", type=int, default=18431)
    ap.add_argument("--idle", type=int, default=2100, help="idle connections to open (mlx-lm capped files at 2,048)")
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--log", default="probe_server.log")
    args = ap.parse_args()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, max(soft, args.idle + 1024)), hard))
    url = f"http://127.0.0.1:{args.port}"
    proc = start(args.model, args.port, args.log)
    try:
        print(idle_sockets(url, args.port, args.idle))
        print(huge_prompts(url, args.model))
        print(contract(url, args.model))
        print(sigterm_under_load(url, args.model, proc, args.streams))
    finally:
        if proc.poll() is None:
            proc.kill()
    with open(args.log, "rb") as f:
        print(f"server log: {len(f.read()):,} bytes ({args.log})")


if __name__ == "__main__":
    main()
