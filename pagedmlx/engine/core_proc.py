"""The engine-core process (vLLM's EngineCoreProc): spawned by engine/core_client.py's CoreProcess, it builds
the engine (the model and MLX live only here), says "ready", then runs the busy loop (engine/core_loop.py).

- Input: a thread reads the ZeroMQ socket and queues each message, so that the loop never waits on
  a socket between steps; outputs go out on the loop's own thread.
- Signals: Ctrl-C reaches the whole process group and systemd's SIGTERM the whole service, but the
  front end owns the shutdown (it drains, then tells the core to stop), so both are ignored here.
- The front end gone (killed, crashed): the core exits at once, not holding the device's memory.
"""

from __future__ import annotations

import logging
import multiprocessing
import queue
import signal
import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable, Optional

logger = logging.getLogger("pagedmlx")


@dataclass
class CoreArgs:
    config: Any  # EngineConfig
    input_path: str
    output_path: str
    distributed: bool = False  # tensor parallelism: this process becomes rank 0 ...
    tp: Optional[int] = None  # ... of `tp` ranks (None: the launcher's)
    tp_timeout: float = 60.0
    argv: Optional[list[str]] = None  # the server's command line, which `--tp N` starts the other ranks with
    log_level: str = "info"


def run_engine_core(args: CoreArgs) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    level = 5 if args.log_level == "trace" else args.log_level.upper()  # uvicorn's TRACE_LOG_LEVEL
    logging.basicConfig(level=level, format="%(levelname)s:     engine core: %(message)s")
    _exit_with_parent()
    import zmq

    from pagedmlx.engine.messages import decode, encode
    from pagedmlx.platform import hard_exit

    ctx = zmq.Context()
    output = ctx.socket(zmq.PUSH)
    output.setsockopt(zmq.SNDHWM, 0)
    output.connect(args.output_path)

    def send(message: tuple) -> None:
        output.send_multipart(encode(message), copy=False)

    sent: list = []

    def send_tokenizer(tokenizer: Any) -> None:  # the front end unpickles it while this process builds the engine
        send(("tokenizer", tokenizer))
        sent.append(tokenizer)

    try:
        core = build_core(args, send_tokenizer)
    except BaseException as exc:  # noqa: BLE001 - the front end says why and exits
        if not isinstance(exc, (ValueError, OSError)):  # not a setting or a path the user can fix: where it failed
            logger.error("the engine could not be built", exc_info=True)
        send(("failed", f"{type(exc).__name__}: {exc}"))
        output.close(linger=5000)
        ctx.term()
        hard_exit(1)
    from pagedmlx.engine.core_info import CoreInfo
    from pagedmlx.engine.core_loop import CoreLoop

    info = CoreInfo.of(core)
    if sent and info.tokenizer is sent[-1]:
        info.tokenizer = None  # the front end has it
    send(("ready", info))
    inbox: queue.Queue = queue.Queue()
    reader = ctx.socket(zmq.PULL)
    reader.setsockopt(zmq.RCVHWM, 0)
    reader.connect(args.input_path)

    def read() -> None:
        try:
            while True:
                inbox.put(decode(reader.recv_multipart()))
        except zmq.ZMQError:  # the context is ending (ctx.term below): this thread closes its own socket
            pass
        finally:
            reader.close(linger=0)

    threading.Thread(target=read, name="pagedmlx-core-input", daemon=True).start()
    code = 0
    try:
        CoreLoop(core, inbox, send).run()
    except BaseException as exc:  # noqa: BLE001 - the front end answers 503 and exits
        logger.exception("the engine core died")
        send(("dead", exc))
        code = 1
    if hasattr(core, "shutdown"):  # tensor parallelism: the other ranks exit
        core.shutdown()
    output.close(linger=5000)  # the last messages reach the front end (up to 5 s) before term() returns
    ctx.term()
    hard_exit(code)  # skip MLX's teardown: nothing is left to release


def build_core(args: CoreArgs, on_loaded: Callable[[Any], None]) -> Any:
    """The EngineCore this process steps (rank 0's, under tensor parallelism); on_loaded(tokenizer) once the
    model is read."""
    from pagedmlx.engine.core import EngineCore

    group = None
    if args.distributed:
        from pagedmlx.tp.group import join_group

        group = join_group(args.tp, argv=args.argv)
    if group is None:
        return EngineCore.from_config(args.config, on_loaded=on_loaded)
    from pagedmlx.loaders.loader import load_model
    from pagedmlx.tp import engine as tp_engine

    model, tokenizer = load_model(args.config.model, lazy=True, dtype=args.config.dtype)
    on_loaded(tokenizer)
    core = tp_engine.build_engine(model, tokenizer, args.config, group, args.tp_timeout)
    core.load_generation_defaults(args.config.model)
    return core


def _exit_with_parent() -> None:
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        print("pagedmlx engine core: the server process is gone; exiting", file=sys.stderr, flush=True)
        from pagedmlx.platform import hard_exit

        hard_exit(1)

    threading.Thread(target=watch, name="pagedmlx-parent-watch", daemon=True).start()
