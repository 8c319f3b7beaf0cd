"""Two settings of one benchmark, each in processes of its own, taking turns (A B A B ...), so that what a process
brings with it (where the host placed it, its allocator, MLX's caches) spreads over both. For effects smaller than
the spread between processes of the same command, which on the H100s was up to 1.36x at 8 requests' decode
(runs 62-63, docs/benchmarks.md). The command must take --json FILE (bench_offline.py does); the table has each
batch size's decode tok/s, median over the processes, and B / A.

  python scripts/bench/ab_processes.py --runs 3 --b=--skinny-gemm -- \\
      python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --batch-sizes 8 --skip-peer
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from rich.console import Console
from rich.table import Table


def run_once(command: list[str], extra: str, timeout: float) -> dict:
    """One process of the command with `extra` args; its --json rows (empty where it failed or timed out)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rows.json"
        try:
            done = subprocess.run([*command, *shlex.split(extra), "--json", str(out)], timeout=timeout,
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            return {}
        if done.returncode != 0 or not out.exists():
            print(done.stdout[-2000:], done.stderr[-2000:], file=sys.stderr)
            return {}
        return json.loads(out.read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3, help="processes of each setting")
    ap.add_argument("--a", default="", help="setting A's extra arguments (default none)")
    ap.add_argument("--b", required=True, help="setting B's extra arguments")
    ap.add_argument("--timeout", type=float, default=180, help="seconds a process may take")
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- then the benchmark's command")
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    console = Console()
    results: dict[str, list[dict]] = {"A": [], "B": []}
    for i in range(args.runs):
        for name, extra in (("A", args.a), ("B", args.b)):
            res = run_once(command, extra, args.timeout)
            results[name].append(res)
            decode = {r["batch"]: round(r["ours_decode"]) for r in res.get("rows", [])}
            console.print(f"  run {i + 1} {name} ({extra or 'as given'}): decode tok/s {decode or 'failed'}, "
                          f"start-up {res.get('startup_s', float('nan')):.1f} s")
    batches = sorted({r["batch"] for res in results["A"] + results["B"] for r in res.get("rows", [])})
    table = Table(title=f"decode tok/s, medians over processes taking turns: A = {args.a or 'as given'}, "
                        f"B = {args.b}")
    for col in ("batch", "A runs", "B runs", "A median", "B median", "B / A"):
        table.add_column(col, justify="right")

    def runs(name: str, b: int) -> list[float]:
        return [r["ours_decode"] for res in results[name] for r in res.get("rows", []) if r["batch"] == b]

    for b in batches:
        a, bb = runs("A", b), runs("B", b)
        ma, mb = (statistics.median(a) if a else float("nan")), (statistics.median(bb) if bb else float("nan"))
        table.add_row(str(b), " ".join(f"{x:.0f}" for x in a), " ".join(f"{x:.0f}" for x in bb), f"{ma:.0f}",
                      f"{mb:.0f}", f"{mb / ma:.2f}")
    startup = {n: [res["startup_s"] for res in results[n] if "startup_s" in res] for n in results}
    console.print(table)
    console.print("engine start-up, s: " + "; ".join(f"{n} {' '.join(f'{s:.1f}' for s in v)}" for n, v in startup.items()))


if __name__ == "__main__":
    main()
