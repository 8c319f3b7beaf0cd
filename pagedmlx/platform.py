"""Where pagedmlx runs: the backend's name, and ending the process without MLX's teardown."""

from __future__ import annotations

import os
import sys
from typing import Callable

_before_exit: list[Callable[[], None]] = []


def backend_name() -> str:
    """"Metal", "CUDA", "GPU" (another MLX GPU backend) or "CPU": where MLX computes by default."""
    import mlx.core as mx

    if mx.default_device().type == mx.gpu:
        if mx.metal.is_available():
            return "Metal"
        cuda = getattr(mx, "cuda", None)
        if cuda is not None and cuda.is_available():
            return "CUDA"
        return "GPU"
    return "CPU"


def on_hard_exit(fn: Callable[[], None]) -> None:
    """Run fn() in hard_exit, before the process ends (e.g. kill child processes)."""
    _before_exit.append(fn)


def hard_exit(code: int, why: str = "") -> None:
    """End the process now, skipping the interpreter's teardown: a thread stuck in a collective
    would block a normal exit, and MLX's static destructors, after an engine ran on a second
    thread, abort now and then (MLX issue #3126 is the same class of exit crash)."""
    if why:
        print(f"pagedmlx: {why}; exiting", file=sys.stderr, flush=True)
    for fn in _before_exit:
        fn()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
