"""The verifier of scripts/stress.py: what one response must satisfy, the run's verdict and its report.

Kept apart from the load generator so that tests can feed it doctored results (a server that
mixes up responses must fail)."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np

MARKER_RE = re.compile(r"\[#q\d{3,}\]")

# Error kinds that fail the run; the others are only reported.
FATAL = {"mismatch", "text_mismatch", "finish_mismatch", "prompt_mismatch", "marker_leak", "marker_missing",
         "http_5xx", "stream_error", "invalid_not_4xx", "valid_4xx", "transport", "timeout", "leak",
         "reference"}


def marker(index: int) -> str:
    return f"[#q{index:03d}]"


@dataclass
class Reference:
    """The server's own answer for a job's prompt sent alone (before the load)."""

    token_ids: list[int]
    text: str
    finish_reason: Optional[str]
    prompt_tokens: Optional[int] = None
    prompt_token_ids: Optional[list[int]] = None


@dataclass
class Result:
    """One request of the load. `mode`: stream, whole, disconnect or invalid."""

    job: str
    mode: str
    status: int = 0
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: Optional[str] = None
    prompt_tokens: Optional[int] = None
    prompt_token_ids: Optional[list[int]] = None
    error: str = ""  # transport / timeout / stream_error detail
    error_kind: str = ""
    ttft: Optional[float] = None
    itls: list[float] = field(default_factory=list)
    latency: float = 0.0


def check_invalid(status: int) -> Optional[str]:
    """A deliberately invalid request must get a 4xx, never a 5xx nor a 2xx."""
    if 400 <= status < 500:
        return None
    return "http_5xx" if status >= 500 else "invalid_not_4xx"


def check_answer(res: Result, ref: Reference, own_marker: str, echoed: bool) -> list[tuple[str, str]]:
    """Problems with one answered (not disconnected, not invalid) request, as (kind, detail)."""
    problems: list[tuple[str, str]] = []
    if res.error_kind:
        return [(res.error_kind, res.error)]
    if res.status != 200:
        return [("http_5xx" if res.status >= 500 else "valid_4xx", f"HTTP {res.status}: {res.error}")]
    if res.token_ids != ref.token_ids:
        problems.append(("mismatch", f"{res.job}: tokens {res.token_ids[:8]}... != solo {ref.token_ids[:8]}..."))
    elif res.text != ref.text:
        problems.append(("text_mismatch", f"{res.job}: text {res.text[:40]!r} != solo {ref.text[:40]!r}"))
    if res.finish_reason != ref.finish_reason:
        problems.append(("finish_mismatch", f"{res.job}: finish {res.finish_reason} != solo {ref.finish_reason}"))
    if (res.prompt_tokens is not None and ref.prompt_tokens is not None and res.prompt_tokens != ref.prompt_tokens) \
            or (res.prompt_token_ids is not None and ref.prompt_token_ids is not None
                and res.prompt_token_ids != ref.prompt_token_ids):
        problems.append(("prompt_mismatch", f"{res.job}: the server answered another prompt"))
    # A real model may write marker-like text itself (it continues patterns): a marker counts as
    # foreign only when the request's own solo answer did not write it too.
    foreign = set(MARKER_RE.findall(res.text)) - set(MARKER_RE.findall(ref.text)) - {own_marker}
    if foreign:
        problems.append(("marker_leak", f"{res.job} ({own_marker}) carries {sorted(foreign)[:3]}"))
    if echoed and own_marker not in res.text:
        problems.append(("marker_missing", f"{res.job}: the echo lacks its own marker {own_marker}"))
    return problems


def check_pool(snap: dict) -> Optional[str]:
    """After the load every page must be back: no block in use, no request left."""
    p, s = snap["pool"], snap["scheduler"]
    if p["used"] or s["running"] or s["waiting"] or p["free"] + p["cached_free"] != p["num_blocks"]:
        return (f"{p['used']} blocks still in use, {s['running']} running, {s['waiting']} waiting "
                f"after the run")
    return None


@dataclass
class Verdict:
    errors: Counter = field(default_factory=Counter)
    examples: dict = field(default_factory=dict)

    def add(self, kind: str, detail: str = "") -> None:
        self.errors[kind] += 1
        self.examples.setdefault(kind, detail)

    @property
    def failed(self) -> bool:
        return any(kind in FATAL for kind in self.errors)


def verify(results: list[Result], refs: dict[str, Reference], markers: dict[str, str],
           echoed: dict[str, bool]) -> Verdict:
    """Every result against its job's solo answer; invalid ones for 4xx; disconnects for no 5xx."""
    verdict = Verdict()
    for res in results:
        if res.mode == "invalid":
            kind = check_invalid(res.status)
            if kind:
                verdict.add(kind, f"{res.job}: HTTP {res.status}")
            else:
                verdict.add(f"invalid_{res.status}")  # expected: counted, not fatal
        elif res.mode == "disconnect":
            if res.error_kind:
                verdict.add(res.error_kind, f"{res.job}: {res.error}")
            elif res.status != 200:
                verdict.add("http_5xx" if res.status >= 500 else "valid_4xx", f"{res.job}: HTTP {res.status}")
        elif res.status == 429:
            verdict.add("rate_limited", res.job)
        else:
            for kind, detail in check_answer(res, refs[res.job], markers[res.job], echoed[res.job]):
                verdict.add(kind, detail)
    return verdict


def percentiles(values: list[float], qs=(50, 90, 99)) -> list[float]:
    """Percentiles in milliseconds (NaN when there is nothing to measure)."""
    if not values:
        return [float("nan")] * len(qs)
    return [float(v) * 1000 for v in np.percentile(values, qs)]


def report(results: list[Result], wall: float, ref_s: float, before: dict, after: dict, verdict: Verdict,
           model: str, args: Any) -> None:
    from rich.console import Console
    from rich.table import Table

    answered = [r for r in results if r.mode in ("stream", "whole") and r.status == 200 and not r.error_kind]
    tokens = sum(len(r.token_ids) for r in results if r.mode != "invalid")
    modes = {m: sum(1 for r in results if r.mode == m) for m in ("stream", "whole", "disconnect", "invalid")}
    pc0, pc1 = before["prefix_cache"], after["prefix_cache"]
    queries, hits = pc1["queries"] - pc0["queries"], pc1["hits"] - pc0["hits"]
    ttft = percentiles([r.ttft for r in results if r.ttft is not None])
    itl = percentiles([x for r in results for x in r.itls])
    table = Table(title=f"stress: {args.clients} clients against {model}, {wall:.1f} s", show_header=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("requests", f"{len(results)}: {modes['stream']} streamed, {modes['whole']} whole, "
                              f"{modes['disconnect']} hung up mid-stream, {modes['invalid']} invalid")
    table.add_row("verified", f"{len(answered)} answers equal the server's solo answer for their prompt "
                              f"({args.jobs} prompts, references took {ref_s:.1f} s)" if not verdict.failed
                  else f"{len(answered)} answered; see the errors below")
    table.add_row("requests/s", f"{len(results) / wall:.1f}")
    table.add_row("output tok/s", f"{tokens / wall:.1f}")
    table.add_row("TTFT ms", "p50 {:.1f}   p90 {:.1f}   p99 {:.1f}".format(*ttft))
    table.add_row("ITL ms", "p50 {:.1f}   p90 {:.1f}   p99 {:.1f}".format(*itl))
    table.add_row("preemptions", str(after["scheduler"]["preemptions"] - before["scheduler"]["preemptions"]))
    table.add_row("prefix cache", f"hit rate {hits / queries:.1%} ({hits} of {queries} prompt tokens)"
                  if queries else "no queries")
    pool = after["pool"]
    table.add_row("pool after", f"{pool['used']} of {pool['num_blocks']} blocks in use, "
                                f"{pool['cached_free']} cached, {after['scheduler']['running']} running, "
                                f"{after['scheduler']['waiting']} waiting")
    table.add_row("verdict", "[bold red]FAIL[/]" if verdict.failed else "[bold green]PASS[/]")
    from rich.markup import escape  # markers look like markup: "[#q012]"

    console = Console()
    console.print(table)
    if verdict.errors:
        errors = Table(title="errors and expected refusals by kind")
        for col in ("kind", "count", "fails the run", "first example"):
            errors.add_column(col, overflow="fold")
        for kind, count in sorted(verdict.errors.items()):
            errors.add_row(kind, str(count), "yes" if kind in FATAL else "no", escape(verdict.examples.get(kind) or ""))
        console.print(errors)
