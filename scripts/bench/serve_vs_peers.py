"""pagedmlx serve against mlx_lm.server, and both against pagedmlx's offline engine, on one model
folder: each server is started in turn (so they never share the machine) and gets the same
`pagedmlx bench serve` load at each --clients value (max concurrency); with --offline the engine
runs the same prompts at the same batch (`bench throughput`'s run: LLM.generate, max_num_seqs = N).
Prints each run's vLLM result block, then one table per concurrency with ratios to pagedmlx serve.

    python scripts/bench/serve_vs_peers.py /tmp/smollm2-mlx --clients 1 8 32 64 --offline \\
        --random-input-len 128 --random-output-len 64

Every `pagedmlx bench serve` option applies (--random-*, --dataset-name, --request-rate, ...);
--ignore-eos and --text-prompts are on (mlx_lm.server takes no token-id prompts; the text is drawn
from the model's own vocabulary: --tokenizer defaults to the folder), and --num-prompts defaults to
2 x clients (at least 8).
"""

from __future__ import annotations

import argparse
import copy
import gc
import subprocess
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.cli import add_serve_args  # noqa: E402
from pagedmlx.bench.datasets import SampleRequest, encode, get_samples, load_tokenizer, random_requests  # noqa: E402
from pagedmlx.bench.serve import bench_serve  # noqa: E402
from pagedmlx.bench.throughput import run_throughput  # noqa: E402

PORT = 8765


def server_commands(model: str, clients: int) -> list[tuple[str, list[str], int]]:
    """(name, command, port) of each server, configured for `clients` requests at once."""
    py = sys.executable
    return [("pagedmlx serve", [py, "-m", "pagedmlx.cli", "serve", model, "--port", str(PORT), "--max-num-seqs",
                                str(clients)], PORT),
            ("mlx_lm.server", [py, "-m", "mlx_lm", "server", "--model", model, "--port", str(PORT + 1),
                               "--decode-concurrency", str(clients)], PORT + 1)]


def spawn(cmd: list[str], port: int, timeout: float = 600.0) -> subprocess.Popen:
    """Start a server; return once it answers GET /v1/models."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{' '.join(cmd)} exited with status {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(1)
    proc.kill()
    raise RuntimeError(f"{' '.join(cmd)} did not answer within {timeout:g} s")


def run_args(args: argparse.Namespace, clients: int, port: int) -> argparse.Namespace:
    run = copy.copy(args)
    run.max_concurrency, run.port, run.base_url = clients, port, None
    run.num_prompts = args.num_prompts or max(2 * clients, 8)
    return run


def offline(args: argparse.Namespace, clients: int, tokenizer) -> dict:
    """The offline engine on the served prompts (as token ids) at batch `clients`: bench serve's fields."""
    from pagedmlx.llm import LLM

    run = run_args(args, clients, 0)
    samples = [SampleRequest(encode(tokenizer, s.prompt) if isinstance(s.prompt, str) else s.prompt, s.prompt_len,
                             s.expected_output_len) for s in get_samples(run, tokenizer)]
    warmup = random_requests(1, len(samples[0].prompt), samples[0].expected_output_len, seed=args.seed + 1,
                             tokenizer=tokenizer)[0]
    llm = LLM(args.model_dir, max_num_seqs=clients)
    result = run_throughput(llm, samples, warmup, temperature=args.temperature, use_tqdm=not args.disable_tqdm)
    del llm
    gc.collect()
    print(f"pagedmlx offline, batch {clients}: {result['output_tokens_per_second']:.1f} output tok/s", flush=True)
    return {"completed": len(samples), "failed": 0, "output_throughput": result["output_tokens_per_second"]}


COLUMNS = [("output tok/s", "output_throughput"), ("TTFT p50 ms", "p50_ttft_ms"), ("TTFT p90 ms", "p90_ttft_ms"),
           ("TPOT p50 ms", "p50_tpot_ms"), ("ITL p50 ms", "p50_itl_ms"), ("ITL p99 ms", "p99_itl_ms")]


def print_table(clients: int, rows: list[tuple[str, dict]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{clients} concurrent clients (ratios: to {rows[0][0]})")
    table.add_column("")
    table.add_column("ok / failed")
    for title, _ in COLUMNS:
        table.add_column(title, justify="right")
    base = rows[0][1]
    for name, result in rows:
        cells = [name, f"{result['completed']} / {result['failed']}"]
        for _, key in COLUMNS:
            value, ref = result.get(key), base.get(key)
            ratio = f" ({value / ref:.2f}x)" if value is not None and ref and result is not base else ""
            cells.append("" if value is None else f"{value:.1f}{ratio}")
        table.add_row(*cells)
    Console(width=160).print(table)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_dir", help="an mlx-lm model folder both servers can load")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32, 64], help="max concurrency values to run")
    p.add_argument("--servers", nargs="+", default=["pagedmlx serve", "mlx_lm.server"], help="which servers to run")
    p.add_argument("--offline", action="store_true", help="also run pagedmlx's offline engine at each batch")
    add_serve_args(p)
    p.set_defaults(num_prompts=None, ignore_eos=True, text_prompts=True, random_input_len=128, random_output_len=64)
    args = p.parse_args()
    args.model, args.tokenizer = args.model or args.model_dir, args.tokenizer or args.model_dir
    results: dict[int, list[tuple[str, dict]]] = {n: [] for n in args.clients}
    for name, cmd, port in server_commands(args.model_dir, max(args.clients)):
        if name not in args.servers:
            continue
        print(f"starting {name}: {' '.join(cmd)}", flush=True)
        proc = spawn(cmd, port)
        try:
            for n in args.clients:
                print(f"\n{name}, {n} clients", flush=True)
                results[n].append((name, bench_serve(run_args(args, n, port))))
        finally:
            proc.terminate()
            proc.wait(60)
    if args.offline:
        tokenizer = load_tokenizer(args.tokenizer)
        for n in args.clients:
            results[n].append(("pagedmlx offline", offline(args, n, tokenizer)))
    for n in args.clients:
        if results[n]:
            print_table(n, results[n])


if __name__ == "__main__":
    main()
