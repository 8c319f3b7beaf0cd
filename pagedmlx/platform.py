"""Where pagedmlx runs: the backend's name, importing mlx-lm without its open-file limit, the cache folder,
and ending the process without MLX's teardown."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
from pathlib import Path
from typing import Callable, Iterator

from pagedmlx import envs

_before_exit: list[Callable[[], None]] = []


@contextlib.contextmanager
def _no_file_limit_changes() -> Iterator[None]:
    real = resource.setrlimit

    def setrlimit(which: int, limits: tuple[int, int]) -> None:
        if which != resource.RLIMIT_NOFILE:
            real(which, limits)

    resource.setrlimit = setrlimit
    try:
        yield
    finally:
        resource.setrlimit = real


def import_mlx_lm() -> None:
    """Import mlx-lm with its RLIMIT_NOFILE call skipped: importing `mlx_lm.utils` sets the open-file
    limit to (2048, 4096) whatever the operator set, lowering a higher hard limit for good and failing
    under a lower one (server/file_limit.py). The packages that import mlx-lm (runner, models) call it
    first; a no-op once mlx-lm is imported. Also keeps compiled kernels on disk (use_kernel_cache)."""
    use_kernel_cache()
    with _no_file_limit_changes():
        import mlx_lm.utils  # noqa: F401


def cache_dir() -> Path:
    """$PAGEDMLX_CACHE_DIR, else $XDG_CACHE_HOME/pagedmlx, else ~/.cache/pagedmlx."""
    if envs.PAGEDMLX_CACHE_DIR:
        return Path(envs.PAGEDMLX_CACHE_DIR).expanduser()
    base = envs.XDG_CACHE_HOME or Path.home() / ".cache"
    return Path(base).expanduser() / "pagedmlx"


def use_kernel_cache() -> None:
    """Point MLX's compiled-module cache (MLX_PTX_CACHE_DIR, read once by MLX's CUDA backend before its first
    kernel build) at cache_dir()/mlx-ptx/<MLX version>, unless it is set: kernels/disk_cache.py writes pagedmlx's
    kernels there, and MLX keeps its own built-in ones there too, across reboots."""
    if envs.MLX_PTX_CACHE_DIR or envs.PAGEDMLX_KERNEL_CACHE is False:
        return
    import mlx.core as mx

    os.environ["MLX_PTX_CACHE_DIR"] = str(cache_dir() / "mlx-ptx" / mx.__version__)


def backend_name() -> str:
    """"Metal", "CUDA", "GPU" (another MLX GPU backend) or "CPU": where MLX computes by default."""
    import mlx.core as mx

    return gpu_backend_name() if mx.default_device().type == mx.gpu else "CPU"


@functools.cache
def gpu_backend_name() -> str:
    """"Metal", "CUDA" or "GPU": the MLX build's GPU backend, fixed for the process, so probed once
    (kernels/build.gpu_backend asks too)."""
    import mlx.core as mx

    if mx.metal.is_available():
        return "Metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "CUDA"
    return "GPU"


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
