"""Concurrency stress test for a pagedmlx server: many streaming clients, every answer verified.

    python scripts/stress.py --random-model llama-tiny --clients 64 --duration 60   # spawns a server
    python scripts/stress.py --url http://127.0.0.1:8000 --requests 2000            # a running one

Jobs are prompts with their sampling parameters: completions over shared documents, chats under
shared system prompts, branches of one multi-turn conversation, short unrelated prompts; greedy or
seeded; each prompt carries a unique marker `[#qNNN]`. First every job is sent alone, one at a
time: the server's own answer is its reference. Then N clients loop over random jobs (streaming
mostly; some whole, some hanging up mid-stream, some deliberately invalid; a quarter with a fresh
cache_salt, so that they compute everything the others find in the prefix cache) for --duration
seconds or --requests requests.

Exit 1 when an answer differs from its reference (tokens, text, finish reason or prompt), a
response carries another prompt's marker (completions echo their prompt), an invalid request gets
anything but a 4xx, anything gets a 5xx or a transport error, or the pool (GET /v1/engine/kv) still
holds blocks after the run. Reports requests/s, output tok/s, TTFT and inter-token latency
percentiles, errors by kind, preemptions and the prefix-cache hit rate during the load.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

import httpx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from stress_check import Reference, Result, check_pool, marker, report, verify  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORDS = ("the quick brown fox jumps over the lazy dog hello world how are you today paged attention keeps "
         "the kv cache in fixed size blocks what is the capital of france paris").split()


# ---- the workload -------------------------------------------------------------------------------

@dataclass
class Job:
    key: str
    marker: str
    endpoint: str  # "completions" or "chat/completions"
    body: dict  # without model and stream fields

    @property
    def echoed(self) -> bool:
        return self.endpoint == "completions"


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def make_jobs(n: int, seed: int, max_tokens: int) -> list[Job]:
    """Deterministic jobs with mixed lengths, shared prefixes and multi-turn branches."""
    rng = random.Random(seed)
    systems = [_words(rng, k).capitalize() + "." for k in (12, 40, 100)]
    convo: list[dict] = [{"role": "system", "content": systems[1]}]
    for t in range(3):
        convo += [{"role": "user", "content": _words(rng, 8 + 6 * t) + "?"},
                  {"role": "assistant", "content": _words(rng, 10 + 4 * t) + "."}]
    jobs = []
    for i in range(n):
        m = marker(i)
        question = f"{m} {_words(rng, rng.randint(3, 30))}?"
        shared = systems[i // 4 % 3]
        family = i % 4
        if family == 0:  # a completion over a shared document
            endpoint, body = "completions", {"prompt": f"{shared} {question}", "echo": True}
        elif family == 1:  # a chat under a shared system prompt
            endpoint, body = "chat/completions", {"messages": [{"role": "system", "content": shared},
                                                              {"role": "user", "content": question}]}
        elif family == 2:  # a branch of one multi-turn conversation, after 0 to 3 turns
            turns = i // 4 % 4
            endpoint, body = "chat/completions", {"messages": convo[:1 + 2 * turns] +
                                                  [{"role": "user", "content": question}]}
        else:  # a prompt that shares nothing
            endpoint, body = "completions", {"prompt": f"{question} {_words(rng, rng.randint(1, 60))}", "echo": True}
        if i % 3 == 2:
            body.update(temperature=0.8, top_p=0.95, seed=1000 + i)
            if i % 6 == 5:
                body["top_k"] = 40
        else:
            body["temperature"] = 0.0
            if i % 7 == 3:
                body["repetition_penalty"] = 1.1
        body.update(max_tokens=rng.randint(max(1, max_tokens // 8), max_tokens), ignore_eos=i % 2 == 0,
                    return_token_ids=True)
        jobs.append(Job(f"j{i:03d}", m, endpoint, body))
    return jobs


def invalid_requests(model: str, api_key: Optional[str]) -> list[tuple[str, str, Any, dict]]:
    """(name, endpoint, body as JSON or raw text, extra headers): each must get a 4xx."""
    hi = {"model": model, "prompt": "hi"}
    chat = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    cases = [
        ("bad_json", "completions", '{"model": ', {}),
        ("temperature_type", "completions", {**hi, "temperature": "hot"}, {}),
        ("temperature_range", "completions", {**hi, "temperature": 150}, {}),
        ("max_tokens_huge", "completions", {**hi, "max_tokens": 10 ** 7}, {}),
        ("unknown_model", "completions", {**hi, "model": "no-such-model"}, {}),
        ("token_out_of_vocab", "completions", {"model": model, "prompt": [1, 2, 10 ** 9]}, {}),
        ("n_too_large", "completions", {**hi, "n": 10 ** 4}, {}),
        ("missing_prompt", "completions", {"model": model}, {}),
        ("logit_bias_key", "completions", {**hi, "logit_bias": {"x": 1}}, {}),
        ("empty_messages", "chat/completions", {"model": model, "messages": []}, {}),
        ("top_p_zero", "chat/completions", {**chat, "top_p": 0}, {}),
        ("stream_negative_max_tokens", "chat/completions", {**chat, "stream": True, "max_tokens": -1}, {}),
    ]
    if api_key:
        cases.append(("wrong_api_key", "completions", hi, {"Authorization": "Bearer wrong"}))
    return cases


# ---- one request -------------------------------------------------------------------------------

def _parse_whole(data: dict, res: Result) -> None:
    choice = data["choices"][0]
    res.text = choice["text"] if "text" in choice else (choice["message"]["content"] or "")
    res.token_ids = choice.get("token_ids") or []
    res.finish_reason = choice.get("finish_reason")
    res.prompt_tokens = (data.get("usage") or {}).get("prompt_tokens")
    res.prompt_token_ids = choice.get("prompt_token_ids") or data.get("prompt_token_ids")


async def _read_stream(resp: httpx.Response, res: Result, t0: float, hang_up_after: Optional[int]) -> None:
    last = t0
    async for line in resp.aiter_lines():
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        chunk = json.loads(line[6:])
        if "error" in chunk:
            res.error_kind, res.error = "stream_error", str(chunk["error"].get("message"))
            return
        if chunk.get("usage"):
            res.prompt_tokens = chunk["usage"]["prompt_tokens"]
        for choice in chunk.get("choices") or []:
            res.text += (choice["text"] if "text" in choice else (choice.get("delta") or {}).get("content")) or ""
            ids = choice.get("token_ids") or []
            if ids:
                now = time.perf_counter()
                if res.ttft is None:
                    res.ttft = now - t0
                else:
                    res.itls.extend([(now - last) / len(ids)] * len(ids))
                last = now
                res.token_ids += ids
            res.finish_reason = choice.get("finish_reason") or res.finish_reason
        if hang_up_after is not None and len(res.token_ids) >= hang_up_after:
            return  # leaving the `async with` closes the connection mid-stream


async def send(client: httpx.AsyncClient, url: str, job: Job, mode: str, model: str,
               rng: Optional[random.Random] = None, salt: Optional[str] = None) -> Result:
    """mode: whole (not streamed), stream, or disconnect (hang up after 1-3 tokens). A `salt` (vLLM's
    cache_salt) keeps the request out of everyone else's prefix-cache entries: it computes afresh."""
    body = {**job.body, "model": model, **({"cache_salt": salt} if salt else {})}
    res = Result(job.key, mode)
    t0 = time.perf_counter()
    try:
        if mode == "whole":
            r = await client.post(f"{url}/v1/{job.endpoint}", json=body)
            res.status = r.status_code
            if r.status_code == 200:
                _parse_whole(r.json(), res)
            else:
                res.error = r.text[:300]
        else:
            body.update(stream=True, stream_options={"include_usage": True})
            hang_up_after = (rng or random).randint(1, 3) if mode == "disconnect" else None
            async with client.stream("POST", f"{url}/v1/{job.endpoint}", json=body) as r:
                res.status = r.status_code
                if r.status_code == 200:
                    await _read_stream(r, res, t0, hang_up_after)
                else:
                    res.error = (await r.aread())[:300].decode(errors="replace")
    except httpx.TimeoutException as exc:
        res.error_kind, res.error = "timeout", f"{job.key}: {type(exc).__name__}"
    except httpx.HTTPError as exc:
        res.error_kind, res.error = "transport", f"{job.key}: {type(exc).__name__}: {exc}"
    res.latency = time.perf_counter() - t0
    return res


async def send_invalid(client: httpx.AsyncClient, url: str, case: tuple) -> Result:
    name, endpoint, body, headers = case
    res = Result(name, "invalid")
    kw = {"content": body, "headers": {"content-type": "application/json", **headers}} if isinstance(body, str) \
        else {"json": body, "headers": headers}
    try:
        r = await client.post(f"{url}/v1/{endpoint}", **kw)
        res.status = r.status_code
    except httpx.HTTPError as exc:
        res.error_kind, res.error = "transport", f"{name}: {type(exc).__name__}: {exc}"
    return res


# ---- the run -----------------------------------------------------------------------------------

async def load(client: httpx.AsyncClient, url: str, model: str, jobs: list[Job], invalid: list,
               args: argparse.Namespace) -> tuple[list[Result], float]:
    results: list[Result] = []
    deadline = time.monotonic() + args.duration
    tickets = itertools.count()

    async def worker(cid: int) -> None:
        rng = random.Random(args.seed * 7919 + cid)
        while (next(tickets) < args.requests) if args.requests else time.monotonic() < deadline:
            x = rng.random()
            if x < args.invalid_frac:
                results.append(await send_invalid(client, url, rng.choice(invalid)))
                continue
            mode = ("disconnect" if x < args.invalid_frac + args.disconnect_frac else
                    "whole" if x < args.invalid_frac + args.disconnect_frac + args.whole_frac else "stream")
            salt = f"s{cid}-{rng.random()}" if rng.random() < args.salt_frac else None
            results.append(await send(client, url, rng.choice(jobs), mode, model, rng, salt))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(c) for c in range(args.clients)))
    return results, time.perf_counter() - t0


async def get_kv(client: httpx.AsyncClient, url: str) -> dict:
    r = await client.get(f"{url}/v1/engine/kv")
    r.raise_for_status()
    return r.json()


async def wait_idle(client: httpx.AsyncClient, url: str, timeout: float) -> dict:
    """The pool once nothing holds a block any more (or as it is when `timeout` runs out)."""
    deadline = time.monotonic() + timeout
    while True:
        snap = await get_kv(client, url)
        if check_pool(snap) is None or time.monotonic() > deadline:
            return snap
        await asyncio.sleep(0.1)


async def run(url: str, args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=args.clients + 8, max_keepalive_connections=args.clients + 8)
    async with httpx.AsyncClient(timeout=args.timeout, limits=limits, headers=headers) as client:
        model = (await client.get(f"{url}/v1/models")).json()["data"][0]["id"]
        jobs = make_jobs(args.jobs, args.seed, args.max_tokens)
        refs: dict[str, Reference] = {}
        t0 = time.perf_counter()
        for job in jobs:  # alone, one at a time: the server's own answers
            res = await send(client, url, job, "whole", model)
            if res.status != 200 or res.error_kind:
                print(f"stress: reference for {job.key} failed: HTTP {res.status} {res.error}", file=sys.stderr)
                return 1
            refs[job.key] = Reference(res.token_ids, res.text, res.finish_reason, res.prompt_tokens,
                                      res.prompt_token_ids)
        ref_s = time.perf_counter() - t0
        before = await get_kv(client, url)
        results, wall = await load(client, url, model, jobs, invalid_requests(model, args.api_key), args)
        after = await wait_idle(client, url, args.idle_timeout)
    verdict = verify(results, refs, {j.key: j.marker for j in jobs}, {j.key: j.echoed for j in jobs})
    leak = check_pool(after)
    if leak:
        verdict.add("leak", leak)
    report(results, wall, ref_s, before, after, verdict, model, args)
    return 1 if verdict.failed else 0


# ---- a server of our own -----------------------------------------------------------------------

class SpawnedServer:
    """`pagedmlx serve` in a child process on a free loopback port."""

    def __init__(self, model: Optional[str], args: argparse.Namespace):
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        cmd = [sys.executable, "-m", "pagedmlx.cli", "serve", *(["--model", model] if model else []),
               "--port", str(port),
               "--num-blocks", str(args.num_blocks), "--max-model-len", str(args.max_model_len),
               "--max-num-seqs", str(args.max_num_seqs), "--log-level", "warning", "--drain-timeout", "5",
               *shlex.split(args.server_args)]
        if args.api_key:
            cmd += ["--api-key", args.api_key]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, text=True)

    def wait_healthy(self, timeout: float = 180.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the server did not come up in {timeout:.0f} s:\n{self.output()}")
            time.sleep(0.2)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def output(self, tail: int = 4000) -> str:
        self.log.seek(0)
        return self.log.read()[-tail:]


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_argument_group("target")
    target.add_argument("--url", default=None, help="a running server (default http://127.0.0.1:8000)")
    target.add_argument("--spawn", action="store_true", help="start `pagedmlx serve` for the run")
    target.add_argument("--model", default=None, help="with --spawn: the model to serve (default: SmolLM2)")
    target.add_argument("--random-model", default=None, metavar="ARCH",
                        help="spawn a server on a random-weight model (e.g. llama-tiny); implies --spawn")
    target.add_argument("--api-key", default=os.environ.get("PAGEDMLX_API_KEY"))
    target.add_argument("--num-blocks", type=int, default=1024, help="with --spawn: KV pool pages (default 1024)")
    target.add_argument("--max-model-len", type=int, default=1024, help="with --spawn (default 1024)")
    target.add_argument("--max-num-seqs", type=int, default=256, help="with --spawn (default 256)")
    target.add_argument("--server-args", default="", help="with --spawn: more `pagedmlx serve` options")
    load_ = p.add_argument_group("load")
    load_.add_argument("--clients", type=int, default=64, help="concurrent clients (default 64)")
    load_.add_argument("--duration", type=float, default=30.0, help="seconds of load (default 30)")
    load_.add_argument("--requests", type=int, default=None, help="stop after this many requests instead")
    load_.add_argument("--jobs", type=int, default=48, help="distinct prompts (default 48)")
    load_.add_argument("--max-tokens", type=int, default=32, help="largest max_tokens of a job (default 32)")
    load_.add_argument("--disconnect-frac", type=float, default=0.1, help="requests that hang up mid-stream")
    load_.add_argument("--invalid-frac", type=float, default=0.05, help="deliberately invalid requests")
    load_.add_argument("--whole-frac", type=float, default=0.15, help="requests not streamed")
    load_.add_argument("--salt-frac", type=float, default=0.25,
                       help="requests with a fresh cache_salt: no prefix-cache hits, same answers")
    load_.add_argument("--seed", type=int, default=0)
    load_.add_argument("--timeout", type=float, default=120.0, help="per request, seconds")
    load_.add_argument("--idle-timeout", type=float, default=15.0,
                       help="seconds the pool gets to drain to zero blocks in use after the load")
    args = p.parse_args(argv)
    if args.random_model:
        args.spawn, args.model = True, f"random:{args.random_model}"
    if args.spawn and args.url:
        p.error("--url and --spawn exclude each other")
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    if not args.spawn:
        return asyncio.run(run((args.url or "http://127.0.0.1:8000").rstrip("/"), args))
    server = SpawnedServer(args.model, args)
    try:
        server.wait_healthy()
        rc = asyncio.run(run(server.url, args))
    finally:
        server_rc = server.stop()
    if server_rc != 0:
        print(f"stress: the server exited with {server_rc}:\n{server.output()}", file=sys.stderr)
        return 1
    if rc:
        print(f"stress: server log tail:\n{server.output(2000)}", file=sys.stderr)
    return rc


if __name__ == "__main__":
    sys.exit(main())
