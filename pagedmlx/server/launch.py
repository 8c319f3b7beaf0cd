"""`pagedmlx serve` (vLLM's api_server.py): its options, then the engine core (in a process of its
own by default, engine/core_client.py), the app (api.py) and the HTTP server (http_server.py)."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from typing import Any, Callable

from pagedmlx import envs
from pagedmlx.engine.arg_utils import add_engine_args, engine_config, non_negative, port_number, positive
from pagedmlx.platform import hard_exit

LISTEN_BACKLOG = 2048  # uvicorn's default


def _model_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("must not be empty")
    return text


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    add_engine_args(p)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer KEY` on /v1/* "
                                                   "(default: $PAGEDMLX_API_KEY; none if unset)")
    p.add_argument("--admin-key", default=None,
                   help="a second key, for the operator: good on /v1/* too, and the only one that shows the "
                        "prompt text of KV blocks in /v1/engine/kv (default: $PAGEDMLX_ADMIN_KEY; none if unset)")
    p.add_argument("--served-model-name", type=_model_name, default=None,
                   help="model id clients send and responses, /v1/models and metrics show (default: the model "
                        "argument as given; a GGUF file's name without .gguf; the default model's name, "
                        "SmolLM2-135M-Instruct). Without it, `default` is also accepted for the model")
    p.add_argument("--lora-modules", nargs="+", default=None, metavar="NAME=PATH",
                   help="with --enable-lora: mlx-lm adapter folders to serve, each as `model: NAME` (vLLM's "
                        "form; also its JSON form)")
    p.add_argument("--max-waiting", type=positive(int), default=1024, help="waiting requests before 429 (default 1024)")
    p.add_argument("--max-n", type=positive(int), default=16, help="largest n accepted")
    p.add_argument("--max-tokens-cap", type=positive(int), default=None, help="largest max_tokens accepted")
    p.add_argument("--max-body-bytes", type=positive(int), default=None,
                   help="largest request body (default 1 MiB; 32 MiB for a model that takes images)")
    p.add_argument("--max-connections", type=positive(int), default=None,
                   help="open connections at most; beyond it the longest-idle one is closed, or with none idle "
                        "the new one gets 503 (default: 4096, less if the open-file limit is lower)")
    p.add_argument("--header-timeout", type=positive(float), default=10.0,
                   help="seconds a connection gets to send a request's line and headers (default 10)")
    p.add_argument("--body-timeout", type=positive(float), default=30.0,
                   help="seconds a request's body may take once its headers are in; then 408 (default 30)")
    p.add_argument("--drain-timeout", type=non_negative(float), default=30.0,
                   help="on Ctrl-C or SIGTERM, seconds in-flight requests get to finish; the rest end with "
                        "finish_reason \"abort\" (default 30)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug", "trace"])
    p.add_argument("-tp", "--tensor-parallel-size", "--tp", dest="tp", type=positive(int), default=None, metavar="N",
                   help="tensor parallelism: split the model over N ranks. Without a launcher, starts N local "
                        "processes (ring backend on loopback); under mlx.launch, the launcher's ranks are used")
    p.add_argument("--tp-timeout", type=positive(float), default=60.0,
                   help="seconds a step may wait on the other ranks before the server gives up (default 60)")
    add_chat_parsing_args(p)
    add_media_args(p)
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine core in a process of its own, beside the HTTP front end (default); "
                        "--no-engine-process steps it in a thread of the server's process")


def add_chat_parsing_args(p: argparse.ArgumentParser) -> None:
    from pagedmlx.server.parser_names import REASONING_PARSER_NAMES as REASONING
    from pagedmlx.server.parser_names import TOOL_CALL_PARSER_NAMES as TOOL_CALLS

    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice \"auto\": the model's tool calls are parsed into tool_calls (with "
                        "--tool-call-parser, or the parser the model's chat template points to)")
    p.add_argument("--tool-call-parser", default=None, choices=TOOL_CALLS, metavar="NAME",
                   help=f"the model's tool call format: {', '.join(TOOL_CALLS)} (implies --enable-auto-tool-choice)")
    p.add_argument("--reasoning-parser", default=None, choices=REASONING, metavar="NAME",
                   help=f"split the model's reasoning into reasoning_content: {', '.join(REASONING)}")


def add_media_args(p: argparse.ArgumentParser) -> None:
    from pagedmlx.server.chat_media import DEFAULT_LIMIT_MM_PER_PROMPT

    p.add_argument("--allowed-local-media-path", type=_folder, default=None, metavar="DIR",
                   help="chat image parts may name image files under DIR as file:// URLs (default: no local "
                        "files). Remote http(s) URLs are never fetched: send images as data: URLs")
    p.add_argument("--limit-mm-per-prompt", type=_limit_mm, default=None, metavar="JSON",
                   help=f"the most images one request may carry, as JSON: '{{\"image\": 4}}' (default "
                        f"{DEFAULT_LIMIT_MM_PER_PROMPT['image']}; 0: no images)")


def _folder(text: str) -> str:
    if not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a folder")
    return os.path.realpath(text)


def _limit_mm(text: str) -> dict[str, int]:
    from pagedmlx.server.chat_media import parse_limit_mm_per_prompt

    try:
        return parse_limit_mm_per_prompt(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc))


def media_options(args: argparse.Namespace) -> Any:
    from pagedmlx.server.chat_media import MediaOptions

    return MediaOptions(args.allowed_local_media_path, **({"limit_mm_per_prompt": args.limit_mm_per_prompt}
                                                          if args.limit_mm_per_prompt else {}))


def chat_parsing(args: argparse.Namespace, tokenizer: Any) -> Any:
    """serve's ChatParsing; ValueError (naming the choices) where --enable-auto-tool-choice finds no parser."""
    from pagedmlx.server.chat_tools import ChatParsing, resolve_tool_call_parser

    enable = args.enable_auto_tool_choice or args.tool_call_parser is not None
    name = resolve_tool_call_parser(args.tool_call_parser, enable, tokenizer)
    return ChatParsing(tool_call_parser=name, enable_auto_tool_choice=enable, reasoning_parser=args.reasoning_parser)


def run_serve(args: argparse.Namespace) -> int:
    from pagedmlx.server.file_limit import raise_file_limit
    from pagedmlx.tp.launcher import launched_backend, launched_rank

    # mlx-lm is imported later (pagedmlx.platform.import_mlx_lm, which keeps the operator's open-file limit: see
    # file_limit.py), once the engine-core process has started: nothing before that imports it.
    nofile = raise_file_limit()
    config = engine_config(args)
    launcher = launched_backend()
    distributed = bool(args.tp) or launcher is not None
    if distributed:
        from pagedmlx.tp.engine import unsupported

        why = unsupported(config)
        if why:
            _console().print(f"[red]pagedmlx serve:[/] {why}")
            return 2
    if distributed and (not args.engine_process or launcher == "mpi" or (launcher and launched_rank() != 0)):
        return _serve_in_thread_or_worker(args, config, _console())  # ranks > 0 serve rank 0's steps there
    try:
        sockets = listen_sockets(args.host, args.port)
    except OSError as exc:
        _console().print(f"[red]pagedmlx serve: cannot listen on {args.host}:{args.port}:[/] {exc}")
        return 1
    # The engine core starts first: everything below is imported while it loads the model.
    core = _spawn_core(args, config, distributed) if args.engine_process else None
    from pagedmlx.engine.core_client import CoreStartupError

    console = _console()
    try:
        with console.status("loading the model..."):
            async_engine = _start_engine(args, config, core)
    except CoreStartupError as exc:
        console.print(f"[red]pagedmlx: the engine could not start:[/] {exc}")
        return 1
    return _serve(args, async_engine, console, nofile, sockets=sockets)


def _console():
    from rich.console import Console

    return Console(stderr=True, soft_wrap=True)  # a log file gets each line whole, not cut at 80 columns


def listen_sockets(host: str, port: int) -> list[socket.socket]:
    """The server's listening sockets (every address of `host`, as uvicorn binds them), taken before the engine
    starts. vLLM binds its socket then too, so that a port in use fails at once; these also listen, so that a
    client that connects while the model loads waits in the backlog for its answer (as with mlx_lm.server, which
    loads at the first request) instead of being refused. /health answers once the engine is ready."""
    sockets: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in dict.fromkeys(socket.getaddrinfo(
                host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)):
            sock = socket.socket(family, kind, proto)
            sockets.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            sock.bind(addr)
            sock.listen(LISTEN_BACKLOG)
    except OSError:
        for sock in sockets:
            sock.close()
        raise
    return sockets


def _spawn_core(args: argparse.Namespace, config: Any, distributed: bool):
    from pagedmlx.engine.core_client import CoreProcess  # light: the core process starts before the rest is imported

    argv = list(getattr(sys, "orig_argv", [sys.executable, *sys.argv]))
    return CoreProcess(config, distributed=distributed, tp=args.tp, tp_timeout=args.tp_timeout, argv=argv,
                       log_level=args.log_level, wait=False)


def _start_engine(args: argparse.Namespace, config: Any, core: Any):
    """The AsyncEngine over `core` (a CoreProcess just started) once it is ready, or, where `core` is None, over
    an engine built in this process."""
    if core is not None:
        core.wait_ready(while_starting=_import_server, on_tokenizer=_read_tokenizer)
    else:
        from pagedmlx.engine.llm_engine import LLMEngine

        core = LLMEngine.from_config(config).core
    from pagedmlx.engine.async_engine import AsyncEngine

    return AsyncEngine(core, max_waiting=args.max_waiting)


def _import_server() -> None:
    """The front end's modules, imported while the engine core loads the model (seconds of a start)."""
    from pagedmlx.platform import import_mlx_lm

    import_mlx_lm(kernel_cache=False)  # first: keep the operator's open-file limit (file_limit.py)
    import pagedmlx.engine.async_engine  # noqa: F401
    import pagedmlx.server.api  # noqa: F401
    import pagedmlx.server.http_server  # noqa: F401
    import pydantic.v1  # noqa: F401 - what FastAPI imports as the app's first route is added


def _read_tokenizer(tokenizer: Any) -> None:
    """What the app reads from the tokenizer, read while the engine core builds the engine."""
    from pagedmlx.server.prompts import longest_token_chars

    longest_token_chars(tokenizer)


def served_model_name(args: argparse.Namespace, model: str | None) -> str:
    """--served-model-name, else the model's own name, as vLLM's --model string (pypi_models.model_name)."""
    if args.served_model_name:
        return args.served_model_name
    from pagedmlx.loaders.pypi_models import model_name

    return model_name(model)


def _serving_models(args: argparse.Namespace, async_engine: Any, name: str):
    """The served model and its --lora-modules, read and checked by the engine (ValueError saying why)."""
    import asyncio

    from pagedmlx.server.serving_models import LoRAModulePath, ServingModels

    modules = [LoRAModulePath.parse(m) for m in args.lora_modules or []]
    if modules and not async_engine.info.max_loras:
        raise ValueError("--lora-modules needs --enable-lora")
    # `default` stays good for the base model unless the operator named it (clients written against older servers)
    aliases = () if args.served_model_name else ("default",)
    models = ServingModels(async_engine, name, async_engine.max_model_len, modules, aliases)
    asyncio.run(models.init_static_loras())
    return models


def _serve_in_thread_or_worker(args: argparse.Namespace, config: Any, console: Any) -> int:
    """Tensor parallelism where the engine core stays in this process: ranks > 0 of a launcher, and
    rank 0 under MPI (a spawned child cannot join an MPI world) or with --no-engine-process."""
    from pagedmlx.engine.async_engine import AsyncEngine
    from pagedmlx.loaders.loader import load_model
    from pagedmlx.tp import engine as tp_engine
    from pagedmlx.tp.group import join_group

    group = join_group(args.tp)  # None: one process
    if group is not None and group.rank() > 0:
        return tp_engine.run_worker(load_model(config.model, lazy=True, dtype=config.dtype)[0], config, group,
                                    args.tp_timeout)
    with console.status("loading the model..."):
        if group is None:
            from pagedmlx.engine.core import EngineCore

            core = EngineCore.from_config(config)
        else:
            core = tp_engine.build_engine(*load_model(config.model, lazy=True, dtype=config.dtype), config, group,
                                          args.tp_timeout)
            core.load_generation_defaults(config.model)
    from pagedmlx.server.file_limit import raise_file_limit

    on_lost = core.runner.on_lost if group is not None else None
    return _serve(args, AsyncEngine(core, max_waiting=args.max_waiting), console, raise_file_limit(), on_lost)


def _serve(args: argparse.Namespace, async_engine: Any, console: Any, nofile: tuple[int, int],
           on_lost: Callable[[Callable[[BaseException], None]], None] | None = None,
           sockets: list[socket.socket] | None = None) -> int:
    """Serve `async_engine` on `sockets` (listen_sockets), or on --host and --port bound here."""
    from pagedmlx.engine.core_info import defaults_line
    from pagedmlx.server.api import build_app
    from pagedmlx.server.file_limit import RESERVED_FDS
    from pagedmlx.server.http_server import EngineWatch, make_server, max_connections
    from pagedmlx.server.serving import ServerLimits
    from pagedmlx.multimodal import load_mm_processor
    from pagedmlx.server.chat_media import VISION_MAX_BODY_BYTES

    info = async_engine.info
    name = served_model_name(args, info.model)
    mm_processor = load_mm_processor(info.model) if info.takes_images else None  # None: text only
    media = media_options(args)
    body = args.max_body_bytes or (VISION_MAX_BODY_BYTES if mm_processor else ServerLimits.max_body_bytes)
    limits = ServerLimits(max_body_bytes=body, max_n=args.max_n, max_tokens=args.max_tokens_cap,
                          header_timeout=args.header_timeout, body_timeout=args.body_timeout,
                          max_connections=args.max_connections)
    api_key = args.api_key or envs.PAGEDMLX_API_KEY or None
    admin_key = args.admin_key or envs.PAGEDMLX_ADMIN_KEY or None
    try:
        parsing = chat_parsing(args, async_engine.tokenizer)
    except ValueError as exc:
        console.print(f"[red]pagedmlx: {exc}[/]")
        async_engine.shutdown(timeout=0)
        hard_exit(1, "stopped: bad tool call options")
        return 1
    try:
        models = _serving_models(args, async_engine, name)
    except ValueError as exc:
        console.print(f"[red]pagedmlx: {exc}[/]", soft_wrap=True)
        async_engine.shutdown(timeout=0)
        hard_exit(1, "stopped: bad LoRA options")
        return 1
    app = build_app(async_engine, name, api_key=api_key, limits=limits, drain_timeout=args.drain_timeout,
                    admin_key=admin_key, parsing=parsing, models=models, media=media,
                    mm_processor=mm_processor)
    url = f"http://{args.host}:{args.port}/v1"
    where = (f"a process of its own (pid {info.pid})" if async_engine.engine is None
             else "a thread of the server's process")
    console.print(f"[bold]pagedmlx[/] serving [cyan]{name}[/] on [bold]{info.backend}[/]; engine core: {where}")
    console.print(f"  KV pool: {info.kv_pool}; max_model_len {info.max_model_len}; max_num_seqs {info.max_num_seqs}")
    for line in info.rank_lines:
        console.print(f"  {line}", soft_wrap=True)
    if info.kernel_lines:
        console.print("  kernels per KV cache group:")
    for line in info.kernel_lines:
        console.print(f"    {line}", soft_wrap=True, markup=False, highlight=False)
    if info.start_line:
        console.print(f"  start-up: {info.start_line}", soft_wrap=True, markup=False, highlight=False)
    console.print(f"  sampling defaults: {defaults_line(info.generation_defaults, info.model)}")
    console.print(f"  tool calls: {parsing.describe()}; reasoning parser: {parsing.reasoning_parser or 'none'}")
    if info.takes_images or info.images_refused:
        console.print(f"  images: {media.describe()}; request bodies up to {body} bytes" if mm_processor else
                      f"  images: refused ({info.images_refused or 'no image processor'})", soft_wrap=True)
    if info.max_loras:
        console.print(f"  LoRA: {', '.join(models.lora_requests) or 'no adapters yet'}; max_loras {info.max_loras}, "
                      f"max_lora_rank {info.max_lora_rank}; run-time loading "
                      f"{'with the admin key' if admin_key else 'off (no --admin-key)'}")
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
    watch = EngineWatch(async_engine, server, console)
    if on_lost is not None:
        on_lost(watch.fail)  # a lost tensor-parallel rank
    # uvicorn re-raises the signal it handled once it has shut down: SIGTERM (systemd, launchd, Docker)
    # must end like Ctrl-C, here, and not kill the process (exit 143, no cleanup).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        server.run(sockets)  # a signal: stop accepting, drain, then the lifespan stops the engine
    except KeyboardInterrupt:
        pass
    finally:
        async_engine.shutdown(timeout=0)
    shutdown = getattr(async_engine.engine, "shutdown", None)
    if shutdown is not None:
        shutdown()  # tensor parallelism in this process: the other ranks exit
    if watch.error is not None:
        hard_exit(1, "stopped after the error above")
    console.print("pagedmlx: stopped")
    hard_exit(0)  # everything has drained and the engine has stopped: skip MLX's teardown
    return 0
