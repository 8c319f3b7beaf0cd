"""The `pagedmlx` command. One function per subcommand: `add_<name>_parser` declares its options,
`run_<name>` runs it; register both in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import os
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
    p.add_argument("--model", default=None, help="mlx-lm folder or hub name, or a .gguf file (default: SmolLM2)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in pages")
    pool.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV pool size in GB (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048, help="token budget of one step")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting-queue order (priority: a request's `priority`, lower first)")


def engine_config(args: argparse.Namespace):
    from pagedmlx.config import EngineConfig

    return EngineConfig(model=args.model, block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                        scheduling_policy=args.scheduling_policy)


def build_engine(args: argparse.Namespace):
    from pagedmlx.engine import LLMEngine

    return LLMEngine.from_config(engine_config(args))  # imports pagedmlx.loader only now


# ---- serve -----------------------------------------------------------------------------------

def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* "
                                                   "(default: $PAGEDMLX_API_KEY; none if unset)")
    p.add_argument("--served-model-name", default=None,
                   help="model id clients must send (default: the --model string, or `default`)")
    p.add_argument("--max-waiting", type=int, default=1024, help="waiting requests before 429 (default 1024)")
    p.add_argument("--max-n", type=int, default=16, help="largest n accepted")
    p.add_argument("--max-tokens-cap", type=int, default=None, help="largest max_tokens accepted")
    p.add_argument("--max-body-bytes", type=int, default=1 << 20, help="largest request body (default 1 MiB)")
    p.add_argument("--drain-timeout", type=float, default=30.0,
                   help="on Ctrl-C, seconds in-flight requests get to finish before they are aborted")
    p.add_argument("--log-level", default="info")
    p.add_argument("--tp", type=int, default=None, metavar="N",
                   help="tensor parallelism: split the model over N ranks. Without a launcher, starts N local "
                        "processes (ring backend on loopback); under mlx.launch, the launcher's ranks are used")
    p.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds a step may wait on the other ranks before the server gives up (default 60)")


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from rich.console import Console

    from pagedmlx.async_engine import AsyncEngine
    from pagedmlx.server.api import build_app
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
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_tokens=args.max_tokens_cap)
    api_key = args.api_key or os.environ.get("PAGEDMLX_API_KEY") or None
    app = build_app(async_engine, name, api_key=api_key, limits=limits, drain_timeout=args.drain_timeout)
    pool = engine.runner.kv_pool
    url = f"http://{args.host}:{args.port}/v1"
    console.print(f"[bold]pagedmlx[/] serving [cyan]{name}[/] on [bold]{backend_name()}[/]")
    console.print(f"  KV pool: {pool.num_blocks} blocks x {engine.config.block_size} tokens = "
                  f"{pool.nbytes / 1e9:.2f} GB; max_model_len {engine.max_model_len}; "
                  f"max_num_seqs {engine.config.max_num_seqs}")
    for line in getattr(engine, "rank_lines", []):
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  API key: {'required' if api_key else 'none'}; URL: [link={url}]{url}[/link]")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print("[yellow]warning:[/] listening beyond this machine without --api-key")
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level,
                            timeout_graceful_shutdown=int(args.drain_timeout) + 1)
    server = uvicorn.Server(config)
    lost = distributed.exit_on_rank_loss(engine, async_engine, server, console) if group else None
    try:
        server.run()  # Ctrl-C: stop accepting, drain, then the lifespan stops the engine
    except KeyboardInterrupt:  # uvicorn re-raises the signal it handled once it has shut down
        pass
    finally:
        async_engine.shutdown(timeout=0)
    if group is not None:
        engine.shutdown()  # the other ranks exit
        if lost["error"] is not None:
            distributed.hard_exit(1, "stopped after the error above")
    console.print("pagedmlx: stopped")
    return 0


# ---- main ------------------------------------------------------------------------------------

SUBCOMMANDS: dict[str, tuple[Callable[[argparse._SubParsersAction], None], Callable[[argparse.Namespace], int]]] = {
    "serve": (add_serve_parser, run_serve),
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
