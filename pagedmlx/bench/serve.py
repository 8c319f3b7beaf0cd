"""`pagedmlx bench serve`: a client-only benchmark of any OpenAI-compatible server (pagedmlx serve,
mlx_lm.server, vLLM), as `vllm bench serve`: one test request (a failure stops the run), the
warm-ups, then the load; vLLM's result block and, with --save-result, its JSON fields.

The client times its own CPU use: when a client process was on the CPU more than CLIENT_BUSY of the
wall time, the figures may measure the client rather than the server, and the report says so and
suggests --num-processes."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
from collections import Counter
from datetime import datetime
from typing import Any, Optional

import httpx

from pagedmlx import envs
from pagedmlx.bench.client import CHAT_ENDPOINT, COMPLETIONS_ENDPOINT, request_body
from pagedmlx.bench.datasets import get_samples, load_tokenizer
from pagedmlx.bench.load import Load, LoadResult, run_load, run_processes
from pagedmlx.bench.metrics import METRICS, calculate_metrics, parse_goodput, result_fields, result_lines

CLIENT_BUSY = 0.8


class BenchError(Exception):
    """A benchmark that cannot run: the message says why."""


def base_url_of(args: argparse.Namespace) -> str:
    """--base-url (a trailing /v1 dropped: endpoints carry it), else http://--host:--port."""
    if args.base_url:
        url = args.base_url.rstrip("/")
        return url[:-3] if url.endswith("/v1") else url
    host = f"[{args.host}]" if ":" in args.host else args.host
    return f"http://{host}:{args.port}"


def endpoint_of(args: argparse.Namespace) -> str:
    return args.endpoint or (CHAT_ENDPOINT if args.backend == "openai-chat" else COMPLETIONS_ENDPOINT)


def auth_headers(api_key: Optional[str]) -> dict:
    key = api_key or envs.OPENAI_API_KEY or envs.PAGEDMLX_API_KEY
    return {"Authorization": f"Bearer {key}"} if key else {}


def first_model(base_url: str, headers: dict) -> str:
    """The first model id the server lists (GET /v1/models)."""
    try:
        resp = httpx.get(base_url + "/v1/models", headers=headers, timeout=30.0)
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, ValueError, KeyError, IndexError) as exc:
        raise BenchError(f"no model id from {base_url}/v1/models ({exc}); give --model") from exc


def selected_metrics(args: argparse.Namespace) -> tuple[list[str], list[float]]:
    names = [m.strip() for m in args.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in names if m not in METRICS]
    if unknown:
        raise BenchError(f"--percentile-metrics: unknown {', '.join(unknown)} (choose from {', '.join(METRICS)})")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",") if p.strip()]
    except ValueError as exc:
        raise BenchError(f"--metric-percentiles takes numbers like 50,90,99 ({exc})") from exc
    if not all(0 <= p <= 100 for p in percentiles):
        raise BenchError(f"--metric-percentiles must lie in [0, 100], got {args.metric_percentiles}")
    return names, percentiles


def check_args(args: argparse.Namespace) -> None:
    for name in ("num_prompts", "num_processes", "max_concurrency"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise BenchError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.max_concurrency is not None and args.max_concurrency < args.num_processes:
        raise BenchError(f"--max-concurrency {args.max_concurrency} is less than --num-processes {args.num_processes}")
    if not (args.request_rate > 0 and args.burstiness > 0):
        raise BenchError("--request-rate and --burstiness must be > 0")


def bench_serve(args: argparse.Namespace) -> dict[str, Any]:
    """Run the benchmark `args` describes (the `bench serve` options); print and return vLLM's result
    fields (plus the client's CPU use); save them with --save-result."""
    check_args(args)
    base_url, endpoint = base_url_of(args), endpoint_of(args)
    chat = endpoint.rstrip("/").endswith("chat/completions")
    headers = auth_headers(args.api_key)
    model = args.model or first_model(base_url, headers)
    selected, percentiles = selected_metrics(args)
    try:
        goodput = parse_goodput(args.goodput)
    except argparse.ArgumentTypeError as exc:
        raise BenchError(str(exc)) from exc
    tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer else None
    try:
        samples = get_samples(args, tokenizer, chat=chat)
    except (ValueError, OSError) as exc:
        raise BenchError(str(exc)) from exc
    try:
        extra = json.loads(args.extra_body) if args.extra_body else None
    except json.JSONDecodeError as exc:
        raise BenchError(f"--extra-body is not JSON: {exc}") from exc
    bodies = [request_body(endpoint, model, s, args.ignore_eos, args.temperature, extra) for s in samples]
    load = Load(base_url + endpoint, bodies, [s.prompt_len for s in samples], headers, args.max_concurrency,
                args.request_rate, args.burstiness, args.seed)

    print("Starting initial single prompt test run...")
    test = Load(load.url, bodies[:1], load.prompt_lens[:1], headers)
    rec = asyncio.run(run_load(test)).records[0]
    if not rec.success:
        raise BenchError(f"the initial test run failed, check the benchmark's arguments: {rec.error}")
    print("Initial test run completed.")
    if args.num_warmups > 0:
        print(f"Warming up with {args.num_warmups} requests...")
        asyncio.run(run_load(Load(load.url, bodies[:1] * args.num_warmups, load.prompt_lens[:1] * args.num_warmups,
                                  headers, args.max_concurrency)))
        print("Warmup run completed.")
    print("Starting main benchmark run...")
    print(f"Traffic request rate: {args.request_rate}")
    print(f"Burstiness factor: {args.burstiness} "
          f"({'Poisson process' if args.burstiness == 1.0 else 'Gamma distribution'})")
    print(f"Maximum request concurrency: {args.max_concurrency}", flush=True)
    result, parts = _run(load, args.num_processes, args.disable_tqdm)

    duration = result.end - result.start
    metrics = calculate_metrics(result.records, duration, percentiles, goodput)
    lines = result_lines(metrics, duration, selected, args.max_concurrency, args.request_rate, bool(goodput))
    busiest = max(p.busy for p in parts)
    cpu_per_token = result.cpu_s * 1000.0 / metrics.total_output if metrics.total_output else 0.0
    lines += [f"{'Client':-^50}", f"{'Client processes:':<40} {len(parts):<10}",
              f"{'Client CPU time (s):':<40} {result.cpu_s:<10.2f}",
              f"{'Client CPU per output token (ms):':<40} {cpu_per_token:<10.3f}",
              f"{'Client busy (% of wall, busiest proc):':<40} {100 * busiest:<10.1f}", "=" * 50]
    print("\n".join(lines))
    _report_errors(result)
    if busiest > CLIENT_BUSY:
        suggest = max(2 * len(parts), math.ceil(result.cpu_s / duration / 0.5))
        cores = os.cpu_count() or 1
        print(f"warning: a client process was on the CPU {busiest:.0%} of the benchmark's wall time, so the client, "
              f"not the server, may be what limits these figures; split it over more processes: "
              f"--num-processes {suggest}" + (f" (this machine has {cores} cores for the client and anything else "
                                              f"it runs, the server too if it is here)" if suggest > cores else ""))

    out = {"date": datetime.now().strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if chat else "openai",
           "endpoint": endpoint, "base_url": base_url, "label": None, "model_id": model,
           "tokenizer_id": args.tokenizer, "num_prompts": args.num_prompts,
           "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
           "burstiness": args.burstiness if math.isfinite(args.burstiness) else "inf",
           "max_concurrency": args.max_concurrency}
    out.update(result_fields(metrics, result.records, duration, selected, bool(goodput)))
    out.update(num_processes=len(parts), client_cpu_time_s=result.cpu_s, client_cpu_ms_per_output_token=cpu_per_token,
               client_busy_fraction=busiest)
    if args.save_result:
        path = save_result(out, args)
        print(f"saved {path}")
    return out


def _run(load: Load, num_processes: int, disable_progress: bool) -> tuple[LoadResult, list[LoadResult]]:
    from pagedmlx.bench.progress import request_progress

    with request_progress(len(load.bodies), disable_progress) as progress:
        if num_processes <= 1:
            result = asyncio.run(run_load(load, progress.advance))
            return result, [result]
        return run_processes(load, num_processes, progress.update)


def _report_errors(result: LoadResult, shown: int = 3) -> None:
    errors = Counter(r.error for r in result.records if not r.success)
    if errors:
        print(f"{sum(errors.values())} requests failed; the first errors:")
        for error, count in errors.most_common(shown):
            print(f"  {count} x {error.splitlines()[-1] if error else '?'}")


def save_result(out: dict, args: argparse.Namespace) -> str:
    """vLLM's file name: {backend}-{rate}qps[-concurrency{N}]-{model}-{date}.json, in --result-dir."""
    name = args.result_filename
    if not name:
        concurrency = f"-concurrency{args.max_concurrency}" if args.max_concurrency is not None else ""
        model = out["model_id"].rstrip("/").split("/")[-1].replace(":", "-")
        name = f"{out['backend']}-{args.request_rate}qps{concurrency}-{model}-{out['date']}.json"
    if args.result_dir:
        os.makedirs(args.result_dir, exist_ok=True)
        name = os.path.join(args.result_dir, name)
    with open(name, "w", encoding="utf-8") as f:
        json.dump(out, f)
    return name
