"""The `pagedmlx` command. One function per subcommand: `add_<name>_parser` declares its options,
`run_<name>` runs it; register both in SUBCOMMANDS."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from typing import Callable, Optional, Sequence

from pagedmlx.platform import backend_name, hard_exit
from pagedmlx.bench.cli import add_bench_parser, run_bench
from pagedmlx.doctor import add_doctor_parser, run_doctor


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """Options shared by every subcommand that builds an engine (vLLM's names)."""
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="mlx-lm folder or hub name, a .gguf file, or random:llama-tiny (a random-weight test "
                        "model) (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", default=None, help="the same as MODEL")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    pool = p.add_mutually_exclusive_group()
    pool.add_argument("--num-blocks", type=int, default=None, help="KV pool size in pages")
    pool.add_argument("--kv-cache-gb", type=float, default=2.0, help="KV pool size in GB (default 2)")
    p.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="token budget of one step (default: 8192 on a GPU, 512 on the CPU)")
    p.add_argument("--long-prefill-token-threshold", type=int, default=None,
                   help="largest prefill chunk of one request while others decode (0: no cap; "
                        "default: 256 on CUDA, 512 elsewhere)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share KV pages of common prefixes between requests")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None,
                   help="build step N+1 while step N runs (default: on GPU backends)")
    p.add_argument("--warm-up-attention", action=argparse.BooleanOptionalAction, default=None,
                   help="build the attention shapes of long prompts before serving (default: on CUDA)")
    p.add_argument("--prefill-kernel", action=argparse.BooleanOptionalAction, default=None,
                   help="attend prefill rows with the paged prefill kernel (default: where it runs, CUDA)")
    p.add_argument("--generation-config", choices=["auto", "vllm"], default="auto",
                   help="sampling defaults: the model's generation_config.json (auto) or vLLM's own (vllm)")
    p.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                   help="compute dtype of unquantized weights (default: as loaded)")
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs",
                   help="waiting-queue order (priority: a request's `priority`, lower first)")
    p.add_argument("--state-checkpoint-interval", type=int, default=1024,
                   help="models with recurrent state: save a state checkpoint every so many tokens (0: none), "
                        "besides each prompt's last full block; prefix hits resume only from checkpoints")
    p.add_argument("--max-state-checkpoints", type=int, default=None,
                   help="state slots for checkpoints beside the max-num-seqs running ones (default: max-num-seqs)")


def model_arg(args: argparse.Namespace) -> Optional[str]:
    if args.model_tag and args.model and args.model_tag != args.model:
        raise SystemExit(f"pagedmlx: two models given: {args.model_tag!r} and --model {args.model!r}")
    return args.model_tag or args.model


def engine_config(args: argparse.Namespace):
    from pagedmlx.config import EngineConfig

    return EngineConfig(model=model_arg(args), block_size=args.block_size, num_blocks=args.num_blocks,
                        kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=args.max_num_seqs,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        long_prefill_token_threshold=args.long_prefill_token_threshold,
                        max_model_len=args.max_model_len, enable_prefix_caching=args.enable_prefix_caching,
                        async_scheduling=args.async_scheduling, warm_up_attention=args.warm_up_attention,
                        prefill_kernel=args.prefill_kernel,
                        generation_config=args.generation_config,
                        scheduling_policy=args.scheduling_policy, dtype=args.dtype,
                        state_checkpoint_interval=args.state_checkpoint_interval,
                        max_state_checkpoints=args.max_state_checkpoints)


def build_engine(config):
    from pagedmlx.engine import LLMEngine

    return LLMEngine.from_config(config)  # imports pagedmlx.loader only now


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
    p.add_argument("-tp", "--tensor-parallel-size", "--tp", dest="tp", type=int, default=None, metavar="N",
                   help="tensor parallelism: split the model over N ranks. Without a launcher, starts N local "
                        "processes (ring backend on loopback); under mlx.launch, the launcher's ranks are used")
    p.add_argument("--tp-timeout", type=float, default=60.0,
                   help="seconds a step may wait on the other ranks before the server gives up (default 60)")


def run_serve(args: argparse.Namespace) -> int:
    from pagedmlx.platform import import_mlx_lm
    from pagedmlx.server.file_limit import RESERVED_FDS, raise_file_limit

    import_mlx_lm()  # first: keep the operator's open-file limit (file_limit.py)
    nofile = raise_file_limit()
    from rich.console import Console

    from pagedmlx.async_engine import AsyncEngine
    from pagedmlx.server.api import build_app
    from pagedmlx.server.http_server import make_server, max_connections
    from pagedmlx.server.serving import ServerLimits
    from pagedmlx.tp.group import launched_backend

    console = Console(stderr=True)
    config = engine_config(args)
    group = None
    if args.tp or launched_backend() is not None:  # tensor parallelism, when launched so or asked for with --tp
        from pagedmlx.loader import load_model
        from pagedmlx.tp import engine as tp_engine
        from pagedmlx.tp.group import join_group

        group = join_group(args.tp)  # None: one process
    if group is not None and group.rank() > 0:
        return tp_engine.run_worker(load_model(config.model, lazy=True)[0], config, group, args.tp_timeout)
    with console.status("loading the model..."):
        if group is None:
            engine = build_engine(config)
        else:
            engine = tp_engine.build_engine(*load_model(config.model, lazy=True), config, group, args.tp_timeout)
            engine.load_generation_defaults(config.model)
    name = args.served_model_name or config.model or "default"  # as vLLM: the --model string
    async_engine = AsyncEngine(engine, max_waiting=args.max_waiting)
    limits = ServerLimits(max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_tokens=args.max_tokens_cap,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections)
    api_key = args.api_key or os.environ.get("PAGEDMLX_API_KEY") or None
    admin_key = args.admin_key or os.environ.get("PAGEDMLX_ADMIN_KEY") or None
    app = build_app(async_engine, name, api_key=api_key, limits=limits, drain_timeout=args.drain_timeout,
                    admin_key=admin_key)
    url = f"http://{args.host}:{args.port}/v1"
    console.print(f"[bold]pagedmlx[/] serving [cyan]{name}[/] on [bold]{backend_name()}[/]")
    console.print(f"  KV pool: {kv_pool_line(engine)}; max_model_len {engine.max_model_len}; "
                  f"max_num_seqs {engine.config.max_num_seqs}")
    for line in getattr(engine, "rank_lines", []):
        console.print(f"  {line}", soft_wrap=True)
    console.print(f"  sampling defaults: {defaults_line(engine)}")
    console.print(f"  API key: {'required' if api_key else 'none'}; admin key: {'set' if admin_key else 'none'}; "
                  f"URL: [link={url}]{url}[/link]")
    console.print(f"  connections: at most {max_connections(app)} open (open-file limit {nofile[0]}); "
                  f"{limits.header_timeout:g} s for headers, {limits.body_timeout:g} s for a body; "
                  f"drain {args.drain_timeout:g} s")
    if args.host not in ("127.0.0.1", "localhost", "::1") and not api_key:
        console.print("[yellow]warning:[/] listening beyond this machine without --api-key")
    if max_connections(app) > nofile[0] - RESERVED_FDS:
        console.print(f"[yellow]warning:[/] {max_connections(app)} connections leave fewer than {RESERVED_FDS} "
                      f"of the {nofile[0]} open files for the rest: raise the limit (ulimit -n, LimitNOFILE)")
    server = make_server(app, args.host, args.port, args.log_level)
    lost = tp_engine.exit_on_rank_loss(engine, async_engine, server, console) if group else None
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
            hard_exit(1, "stopped after the error above")
    console.print("pagedmlx: stopped")
    hard_exit(0)  # everything has drained and the engine thread is joined: skip MLX's teardown


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


def kv_pool_line(engine) -> str:
    """Each KV cache group's pages: "4096 blocks x 16 tokens = 1.07 GB" or, for a hybrid model,
    one such part per group ("full: ...; sliding 1024: ...")."""
    config = engine.runner.kv_cache_config
    parts = [f"{g.num_blocks} blocks x {config.block_size} tokens = {g.num_blocks * g.page_size_bytes / 1e9:.2f} GB"
             if not g.is_state else state_pool_text(g, engine.config.max_num_seqs) for g in config.kv_cache_groups]
    if len(parts) == 1 and not config.kv_cache_groups[0].is_state:
        return parts[0]
    return "; ".join(f"{g.name} ({len(g.layer_ids)} layers): {part}" for g, part in zip(config.kv_cache_groups, parts))


def state_pool_text(group, max_num_seqs: int) -> str:
    """The recurrent-state slots: "128 slots (64 running + 64 checkpoints) x 147.0 MiB = 19.73 GB"."""
    page = group.page_size_bytes
    size = f"{page / 2**20:.1f} MiB" if page >= 2**20 / 10 else f"{page / 2**10:.1f} KiB"
    return (f"{group.num_blocks} slots ({max_num_seqs} running + {group.num_blocks - max_num_seqs} checkpoints) x "
            f"{size} = {group.num_blocks * page / 1e9:.2f} GB")


def defaults_line(engine) -> str:
    given = engine.generation_defaults
    if not given:
        return "vLLM's (temperature 1.0, top_p 1.0); a request's own values win"
    source = "the model's generation config" if engine.config.model else "the default model's card"
    return ", ".join(f"{k} {v}" for k, v in given.items()) + f" ({source}); a request's own values win"


def run_generate(args: argparse.Namespace) -> int:
    from rich.console import Console

    console = Console(stderr=True)
    with console.status("loading the model..."):
        engine = build_engine(engine_config(args))
    flags = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    try:
        params = engine.get_default_sampling_params(
            max_tokens=args.max_tokens, seed=args.seed, stop=args.stop, **{k: v for k, v in flags.items() if v is not None})
    except ValueError as exc:
        console.print(f"[red]error:[/] {exc}")
        return 2
    tok = engine.tokenizer
    chat = args.chat_template and getattr(tok, "has_chat_template", False)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True)
               if chat else p for p in args.prompt]
    console.print(f"[bold]pagedmlx[/] {engine.config.model or 'default model'} on {backend_name()}, "
                  f"{len(prompts)} prompt(s){', chat template' if chat else ''}; sampling: {defaults_line(engine)}")
    if len(prompts) == 1:  # stream the one answer as it comes
        engine.add_request("0", prompts[0], params)
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text, end="", flush=True)
        print()
        return 0
    from pagedmlx.llm import LLM

    outs = LLM.from_engine(engine).generate([{"prompt_token_ids": p} if chat else p for p in prompts], params,
                                            use_tqdm=True)
    for prompt, out in zip(args.prompt, outs):
        console.print(f"[bold cyan]> {prompt}[/]")
        print(out.outputs[0].text)
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

    from pagedmlx.blocks.view import SnapshotError, get_snapshot, render, save_svg, watch

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
