"""The serving metrics, as vLLM's `calculate_metrics` defines them, from the requests' records.

Over the successful requests: TTFT (time to first token), TPOT ((E2EL - TTFT) / (output tokens - 1),
for requests of more than one token), ITL (every gap between two chunks with text, all requests
pooled), E2EL (end-to-end latency); each as mean, median, std and the chosen percentiles, in ms.
Throughputs divide by the benchmark's duration; goodput counts the requests that meet every
--goodput SLO (a one-token request's TPOT counts as 0 there). With no sample, a statistic is 0.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from pagedmlx.bench.client import RequestRecord

METRICS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
           "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass
class Stats:
    mean: float
    median: float
    std: float
    percentiles: list[tuple[float, float]]  # (p, value)


@dataclass
class BenchmarkMetrics:
    completed: int
    failed: int
    total_input: int
    total_output: int
    request_throughput: float
    request_goodput: float
    output_throughput: float
    total_token_throughput: float
    output_lens: list[int]  # per request, 0 for a failed one
    stats: dict[str, Stats] = field(default_factory=dict)  # "ttft", "tpot", "itl", "e2el"; in ms


def stats_ms(seconds: Sequence[float], percentiles: Sequence[float]) -> Stats:
    x = np.asarray(seconds if len(seconds) else [0.0], dtype=np.float64) * 1000.0
    return Stats(float(np.mean(x)), float(np.median(x)), float(np.std(x)),
                 [(p, float(np.percentile(x, p))) for p in percentiles])


def calculate_metrics(records: Sequence[RequestRecord], duration: float, percentiles: Sequence[float],
                      goodput: Optional[dict[str, float]] = None) -> BenchmarkMetrics:
    """`goodput`: SLOs in ms by metric name ("ttft", "tpot", "e2el")."""
    ok = [r for r in records if r.success]
    output_lens = [r.output_tokens if r.success else 0 for r in records]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    values = {"ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [x for r in ok for x in r.itl],
              "e2el": [r.latency for r in ok]}
    good = 0
    if goodput:
        per_request = {"ttft": lambda r: r.ttft, "e2el": lambda r: r.latency,
                       "tpot": lambda r: (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0}
        good = sum(all(per_request[name](r) <= slo / 1000.0 for name, slo in goodput.items()) for r in ok)
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(output_lens)
    return BenchmarkMetrics(
        completed=len(ok), failed=len(records) - len(ok), total_input=total_input, total_output=total_output,
        request_throughput=len(ok) / duration, request_goodput=good / duration,
        output_throughput=total_output / duration, total_token_throughput=(total_input + total_output) / duration,
        output_lens=output_lens, stats={name: stats_ms(v, percentiles) for name, v in values.items()})


def parse_goodput(pairs: Optional[Sequence[str]]) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (ms), as vLLM's --goodput."""
    slos: dict[str, float] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition(":")
        try:
            slos[name] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise argparse.ArgumentTypeError(f"--goodput takes KEY:MS pairs (ttft:500 tpot:50), got {pair!r}")
        if name not in GOODPUT_METRICS:
            raise argparse.ArgumentTypeError(f"--goodput: {name!r} is not one of {', '.join(GOODPUT_METRICS)}")
        if slos[name] < 0:
            raise argparse.ArgumentTypeError(f"--goodput: {pair!r}: the SLO must be >= 0 ms")
    return slos


def percentile_word(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def result_fields(m: BenchmarkMetrics, records: Sequence[RequestRecord], duration: float,
                  selected: Sequence[str], goodput: bool) -> dict:
    """The benchmark's part of vLLM's result JSON (its names), the per-request lists included."""
    out = {"duration": duration, "completed": m.completed, "failed": m.failed,
           "total_input_tokens": m.total_input, "total_output_tokens": m.total_output,
           "request_throughput": m.request_throughput, "request_goodput": m.request_goodput if goodput else None,
           "output_throughput": m.output_throughput, "total_token_throughput": m.total_token_throughput,
           "input_lens": [r.prompt_len for r in records], "output_lens": m.output_lens,
           "ttfts": [r.ttft for r in records], "itls": [r.itl for r in records],
           "generated_texts": [r.generated_text for r in records], "errors": [r.error for r in records]}
    for name in selected:
        s = m.stats[name]
        out.update({f"mean_{name}_ms": s.mean, f"median_{name}_ms": s.median, f"std_{name}_ms": s.std})
        out.update({f"p{percentile_word(p)}_{name}_ms": v for p, v in s.percentiles})
    return out


def result_lines(m: BenchmarkMetrics, duration: float, selected: Sequence[str], max_concurrency: Optional[int],
                 request_rate: float, goodput: bool) -> list[str]:
    """vLLM's "Serving Benchmark Result" block, line for line."""
    row = lambda label, value: f"{label:<40} {value:<10.2f}" if isinstance(value, float) else f"{label:<40} {value:<10}"
    lines = [f"{' Serving Benchmark Result ':=^50}", row("Successful requests:", m.completed),
             row("Failed requests:", m.failed)]
    if max_concurrency is not None:
        lines.append(row("Maximum request concurrency:", max_concurrency))
    if request_rate != float("inf"):
        lines.append(row("Request rate configured (RPS):", float(request_rate)))
    lines += [row("Benchmark duration (s):", duration), row("Total input tokens:", m.total_input),
              row("Total generated tokens:", m.total_output),
              row("Request throughput (req/s):", m.request_throughput)]
    if goodput:
        lines.append(row("Request goodput (req/s):", m.request_goodput))
    lines += [row("Output token throughput (tok/s):", m.output_throughput),
              row("Total Token throughput (tok/s):", m.total_token_throughput)]
    for name in selected:
        short, header = METRICS[name]
        s = m.stats[name]
        lines += [f"{header:-^50}", row(f"Mean {short} (ms):", s.mean), row(f"Median {short} (ms):", s.median)]
        lines += [row(f"P{percentile_word(p)} {short} (ms):", v) for p, v in s.percentiles]
    return lines
