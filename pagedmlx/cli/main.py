"""The `pagedmlx` command. One function per subcommand: `add_<name>_parser` declares its options,
`run_<name>` runs it; register both in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Callable, Optional, Sequence

from pagedmlx import envs
from pagedmlx.bench.cli import add_bench_parser, run_bench
from pagedmlx.platform import backend_name, reexec_with_openblas
from pagedmlx.cli.doctor import add_doctor_parser, run_doctor
from pagedmlx.engine.arg_utils import add_engine_args, engine_config, model_arg, positive  # noqa: F401 - model_arg for callers
from pagedmlx.server.launch import add_serve_parser, run_serve


def build_engine(config):
    from pagedmlx.engine.llm_engine import LLMEngine

    return LLMEngine.from_config(config)  # imports pagedmlx.loaders.loader only now


def load_engine(config, command: str):
    """The in-process engine of `command` (generate, bench throughput / latency) behind a spinner; None after
    one line on stderr saying why it could not start (a model path that does not load, a model or draft model
    that cannot be served, a setting the model refuses), as `serve` says it."""
    from rich.console import Console

    console = Console(stderr=True)
    try:
        with console.status("loading the model..."), engine_log_lines(console):
            return build_engine(config)
    except Exception as exc:  # noqa: BLE001 - whatever stopped the load is the user's to fix: said, not a traceback
        console.print(f"[red]pagedmlx {command}: the engine could not start:[/] {type(exc).__name__}: {exc}")
        return None


@contextlib.contextmanager
def engine_log_lines(console):
    """The engine's start-up lines (kernels built, checks kept, ...) under the spinner while it starts: a first start
    on a GPU builds kernels for minutes, and `serve` shows the same lines."""
    import logging

    from rich.logging import RichHandler

    logger = logging.getLogger("pagedmlx")
    handler = RichHandler(console=console, show_time=False, show_path=False, level=logging.INFO)
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(min(level or logging.INFO, logging.INFO))
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


# ---- generate --------------------------------------------------------------------------------

def add_generate_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate offline for one or more prompts")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True,
                   help="a prompt (repeat for a batch: all of them share every forward pass)")
    p.add_argument("--no-chat-template", dest="chat_template", action="store_false",
                   help="send the prompt as raw text (default: as a user message in the model's chat template, "
                        "when it has one)")
    p.add_argument("--chat", action="store_true", help=argparse.SUPPRESS)  # the default now; kept for old scripts
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=None, help="(default: the model's, else 1.0)")
    p.add_argument("--top-p", type=float, default=None, help="(default: the model's, else 1.0)")
    p.add_argument("--top-k", type=int, default=None, help="(default: the model's, else none)")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def run_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    from pagedmlx.engine.core_info import defaults_line

    console = Console(stderr=True, soft_wrap=True)
    engine = load_engine(engine_config(args), "generate")
    if engine is None:
        return 1
    flags = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    try:
        params = engine.get_default_sampling_params(
            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop,
            **{k: v for k, v in flags.items() if v is not None})
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    tok = engine.tokenizer
    chat = args.chat_template and getattr(tok, "has_chat_template", False)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               if chat else p for p in args.prompt]
    console.print(f"[bold]pagedmlx[/] {engine.config.model or 'default model'} on {backend_name()}, "
                  f"{len(prompts)} prompt(s){', chat template' if chat else ''}; "
                  f"sampling: {defaults_line(engine.generation_defaults, engine.config.model)}")
    try:
        _generate(engine, args.prompt, prompts, params, chat, console)
    except ValueError as exc:  # a prompt the engine refuses (longer than the context): said, exit 2
        console.print(f"[red]pagedmlx generate: error:[/] {exc}")
        return 2
    return 0


def _generate(engine, texts: list[str], prompts: list, params, chat: bool, console) -> None:
    """Stream one prompt's answer as it comes, or print each of a batch's at the end; then the stats lines
    mlx_lm.generate prints, on stderr."""
    import mlx.core as mx

    from pagedmlx.cli.generate_stats import GenerationStats

    stats = GenerationStats(len(prompts))
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    finals: dict[str, str] = {}
    with console.status(f"generating {len(prompts)} answers...") if len(prompts) > 1 else contextlib.nullcontext():
        while engine.has_unfinished_requests():
            for out in engine.step():
                stats.add(out)
                if len(prompts) == 1:
                    print(out.new_text, end="", flush=True)
                elif out.finished:
                    finals[out.request_id] = out.text
    if len(prompts) == 1:
        print()
    else:
        for i, prompt in enumerate(texts):
            console.print(f"[bold cyan]> {prompt}[/]")
            print(finals.get(str(i), ""))
    sys.stdout.flush()
    for line in stats.lines(mx.get_peak_memory()):
        console.print(line, markup=False, highlight=False)


# ---- blocks ----------------------------------------------------------------------------------

def add_blocks_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("blocks", help="show a server's KV page pool: who holds which blocks, sharing, cache")
    p.add_argument("--url", default="http://127.0.0.1:8000", help="the server (default http://127.0.0.1:8000)")
    p.add_argument("--api-key", default=None, help="the server's API key (default: $PAGEDMLX_API_KEY)")
    p.add_argument("--watch", action="store_true", help="refresh in place until Ctrl-C")
    p.add_argument("--interval", type=positive(float), default=1.0, help="seconds between refreshes with --watch")
    p.add_argument("--json", action="store_true", help="print one snapshot as JSON and exit")
    p.add_argument("--svg", metavar="FILE", default=None, help="write the view to an SVG file")
    p.add_argument("--png", metavar="FILE", default=None, help="write the pool picture to a PNG file (Pillow)")
    p.add_argument("--rows", type=int, default=20, help="request rows to show (default 20)")


def run_blocks(args: argparse.Namespace, source=None) -> int:
    """`source`: an LLMEngine or AsyncEngine in this process instead of --url (library use, tests)."""
    import json

    from rich.console import Console

    from pagedmlx.blocks.view import SnapshotError, get_snapshot, render, save_svg, watch

    api_key = args.api_key or envs.PAGEDMLX_API_KEY or None
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
        from pagedmlx.blocks.png import save_png

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
    "doctor": (add_doctor_parser, run_doctor),
    "bench": (add_bench_parser, run_bench),
}


def version() -> str:
    """The installed distribution's version, else the package's own (a source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    import pagedmlx

    try:
        return dist_version("pagedmlx")
    except PackageNotFoundError:
        return pagedmlx.__version__


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedmlx", description="Paged-KV inference engine and server for MLX")
    parser.add_argument("--version", action="version", version=f"pagedmlx {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    for add_parser, _ in SUBCOMMANDS.values():
        add_parser(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    if argv is None:  # a process of its own: OpenBLAS for MLX's CPU backend, before anything else is imported
        reexec_with_openblas(sys.argv[1:])
    args = make_parser().parse_args(argv)
    return SUBCOMMANDS[args.command][1](args)


if __name__ == "__main__":
    sys.exit(main())
