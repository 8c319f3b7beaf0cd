"""The `pagedmlx` command. One function per subcommand: `add_<name>_parser` declares its options,
`run_<name>` runs it; register both in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, Optional, Sequence


def backend_name() -> str:
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        if mx.metal.is_available():
            return "Metal"
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return "CUDA"
        return "GPU"
    return "CPU"


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that builds an engine."""
    p.add_argument("--model", default=None, help="mlx-lm folder or hub name, a .gguf file, or random:llama-tiny "
                                                 "(a random-weight test model) (default: SmolLM2)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in pages")
    pool.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV pool size in GB (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype of unquantized weights (default: as loaded)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting-queue order (priority: a request's `priority`, lower first)")


def engine_config(args: argparse.Namespace):
    from pagedmlx.config import EngineConfig

    return EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        scheduling_policy=args.scheduling_policy, dtype=args.dtype)


def build_engine(args: argparse.Namespace):
    from pagedmlx.engine import LLMEngine

    return LLMEngine.from_config(engine_config(args))  # imports pagedmlx.loader only now


# ---- serve -----------------------------------------------------------------------------------

def _positive(kind: type) -> Callable[[str], object]:
    def parse(text: str) -> object:
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value
    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* "
                                                   "(default: $PAGEDMLX_API_KEY; none if unset)")
    p.add_argument("--admin-key", default=None,
                   help="a second key, for the operator: good on /v1/* too, and the only one that shows the "
                        "prompt text of KV blocks in /v1/engine/kv (default: $PAGEDMLX_ADMIN_KEY; none if unset)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the --model string, or `default`)")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting requests before 429 (default 1024)")
    p.add_argument("--max-n", type=int, default=16, help="largest n accepted")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens accepted")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--max-connections", type=_positive(int), default=None,
                   help="open connections at most; beyond it the longest-idle one is closed, or with none idle "
                        "the new one gets 503 (default: 4096, less if the open-file limit is lower)")
    p.add_argument("--header-timeout", type=_positive(float), default=10.0,
                   help="seconds a connection gets to send a request's line and headers (default 10)")
    p.add_argument("--body-timeout", type=_positive(float), default=30.0,
                   help="seconds a request's body may take once its headers are in; then 408 (default 30)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C or SIGTERM, seconds in-flight requests get to finish; the rest end with "
                        "finish_reason \"abort\" (default 30)")
    p.add_argument("--log-level", default="info")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism: split the model over N ranks. Without a launcher, starts N local "
                        "processes (ring backend on loopback); under mlx.launch, the launcher's ranks are used")
    p.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds a step may wait on the other ranks before the server gives up (default 60)")


def run_serve(args: argparse.Namespace) -> int:
    from pagedmlx.server.file_limit import RESERVED_FDS, import_mlx_lm, raise_file_limit

    import_mlx_lm()  # first: keep the operator's open-file limit (file_limit.py)
    nofile = raise_file_limit()
    from rich.console import Console

    from pagedmlx.async_engine import AsyncEngine
    from pagedmlx.server.api import build_app
    from pagedmlx.server.http_server import make_server, max_connections
    from pagedmlx.server.serving import ServerLimits

    console = Console(stderr=True)
    from pagedmlx import distributed  # tensor parallelism, when launched so or asked for with --tp

    group = distributed.join_group(args.tp)  # None: one process
    if group is not None and group.rank() > 0:
        return distributed.run_worker(distributed.load_model(args.model)[0], engine_config(args), group,
                                      args.tp_timeout)
    with console.status("loading the model..."):
        engine = build_engine(args) if group is None else distributed.build_engine(
            *distributed.load_model(args.model), engine_config(args), group, args.tp_timeout)
    name = args.served_model_name or args.model or "default"  # as vLLM: the --model string
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_tokens=args.max_tokens_cap,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections)
    api_key = args.api_key or os.environ.get("PAGEDMLX_API_KEY") or None
    admin_key = args.admin_key or os.environ.get("PAGEDMLX_ADMIN_KEY") or None
    app = build_app(async_engine, name, api_key=api_key, limits=limits, drain_timeout=args.drain_timeout,
                    admin_key=admin_key)
    pool = engine.runner.kv_pool
    url = f"http://{args.host}:{args.port}/v1"
    console.print(f"[bold]pagedmlx[/] serving [cyan]{name}[/] on [bold]{backend_name()}[/]")
    console.print(f"  KV pool: {pool.num_blocks} blocks x {engine.config.block_size} tokens = "
                  f"{pool.nbytes / 1e9:.2f} GB; max_model_len {engine.max_model_len}; "
                  f"max_num_seqs {engine.config.max_num_seqs}")
    for line in getattr(engine, "rank_lines", []):
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  API key: {'required' if api_key else 'none'}; admin key: {'set' if admin_key else 'none'}; "
                  f"URL: [link={url}]{url}[/link]")
    console.print(f"  connections: at most {max_connections(app)} open (open-file limit {nofile[0]}); "
                  f"{limits.header_timeout:g} s for headers, {limits.body_timeout:g} s for a body; "
                  f"drain {args.drain_timeout:g} s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print("[yellow]warning:[/] listening beyond this machine without --api-key")
    if max_connections(app) > nofile[0] - RESERVED_FDS:
        console.print(f"[yellow]warning:[/] --max-connections {max_connections(app)} leaves fewer than {RESERVED_FDS} "
                      f"of the {nofile[0]} open files for the rest: raise the limit (ulimit -n, LimitNOFILE)")
    server = make_server(app, args.host, args.port, args.log_level)
    lost = distributed.exit_on_rank_loss(engine, async_engine, server, console) if group else None
    # uvicorn re-raises the signal it handled once it has shut down: SIGTERM (systemd, launchd, Docker)
    # must end like Ctrl-C, here, and not kill the process (exit 143, no cleanup).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run()  # a signal: stop accepting, drain, then the lifespan stops the engine
    except KeyboardInterrupt:
        pass
    finally:
        async_engine.shutdown(timeout=0)
    if group is not None:
        engine.shutdown()  # the other ranks exit
        if lost["error"] is not None:
            distributed.hard_exit(1, "stopped after the error above")
    console.print("pagedmlx: stopped")
    # Everything has drained and the engine thread is joined. Skip the interpreter's teardown: MLX's
    # static destructors, after an engine ran on a second thread, abort now and then ("terminate
    # called without an active exception", exit -6: seen in 2 of ~10 stress runs here on
    # 2026-12-03; MLX issue #3126 is the same class of exit crash).
    distributed.hard_exit(0)


# ---- generate --------------------------------------------------------------------------------

def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate offline for one or more prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch: all of them share every forward pass)")
    p.add_argument("--chat", action="store_true", help="wrap each prompt as a user message in the chat template")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def run_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pagedmlx.request import SamplingParams

    console = Console(stderr=True)
    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop)
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    with console.status("loading the model..."):
        engine = build_engine(args)
    tok = engine.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               if args.chat else p for p in args.prompt]
    console.print(f"[bold]pagedmlx[/] {args.model or 'default model'} on {backend_name()}, "
                  f"{len(prompts)} prompt(s)")
    if len(prompts) == 1:  # stream the one answer as it comes
        engine.add_request("0", prompts[0], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text, end="", flush=True)
        print()
        return 0
    from pagedmlx.engine import LLM

    for prompt, out in zip(args.prompt, LLM.from_engine(engine).generate(prompts, params, use_tqdm=True)):
        console.print(f"[bold cyan]> {prompt}[/]")
        print(out.text)
    return 0


# ---- blocks ----------------------------------------------------------------------------------

def add_blocks_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blocks", help="show a server's KV page pool: who holds which blocks, sharing, cache")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $PAGEDMLX_API_KEY)")
    p.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.add_argument("--svg", metavar="FILE", default=None, help="write the view to an SVG file")
    p.add_argument("--png", metavar="FILE", default=None, help="write the pool picture to a PNG file (Pillow)")
    p.add_argument("--rows", type=int, default=20, help="request rows to show (default 20)")


def run_blocks(args: argparse.Namespace, source=None) -> int:
    """`source`: an LLMEngine or AsyncEngine in this process instead of --url (library use, tests)."""
    import json

    from rich.console import Console

    from pagedmlx.kv.view import SnapshotError, get_snapshot, render, save_svg, watch

    api_key = args.api_key or os.environ.get("PAGEDMLX_API_KEY") or None
    source = args.url if source is None else source
    console = Console()
    try:
        if args.watch:
            watch(lambda: get_snapshot(source, api_key), args.interval, console)
            return 0
        snap = get_snapshot(source, api_key)
    except SnapshotError as exc:
        Console(stderr=True).print(f"[red]pagedmlx blocks:[/] {exc}")
        return 1
    if args.json:
        print(json.dumps(snap))
        return 0
    if args.svg:
        save_svg(snap, args.svg, max_rows=args.rows)
    if args.png:
        from pagedmlx.kv.png import save_png

        save_png(snap, args.png)
    if args.svg or args.png:
        console.print("wrote " + " and ".join(f for f in (args.svg, args.png) if f))
        return 0
    console.print(render(snap, console.width, args.rows))
    return 0


# ---- main ------------------------------------------------------------------------------------

SUBCOMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]] = {
    "serve": (add_serve_parser, run_serve),
    "generate": (add_generate_parser, run_generate),
    "blocks": (add_blocks_parser, run_blocks),
}


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmlx", description="Paged-KV inference engine and server for MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in SUBCOMMANDS.values():
        add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = make_parser().parse_args(argv)
    return SUBCOMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
