"""Where pagedmlx runs: the backend's name, importing mlx-lm without its open-file limit, the cache folder,
and ending the process without MLX's teardown."""

from __future__ import annotations

import contextlib
import functools
import os
import resource
import sys
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

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


def import_mlx_lm(kernel_cache: bool = True) -> None:
    """Import mlx-lm with its RLIMIT_NOFILE call skipped: importing `mlx_lm.utils` sets the open-file
    limit to (2048, 4096) whatever the operator set, lowering a higher hard limit for good and failing
    under a lower one (server/file_limit.py). The packages that import mlx-lm (runner, models) call it
    first; a no-op once mlx-lm is imported. Also keeps compiled kernels on disk (use_kernel_cache), unless
    kernel_cache is False: the server's front end, which builds no kernel, asks nothing of the GPU."""
    if kernel_cache:
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
    kernel build) at cache_dir()/mlx-ptx/<MLX version>/sm_<compute capability>, unless it is set:
    kernels/disk_cache.py writes pagedmlx's kernels there, and MLX keeps its own built-in ones there too, across
    reboots. The compute capability is in the path because the modules are cubins for one architecture: a home
    folder shared by two kinds of card must not hand one the other's."""
    if envs.MLX_PTX_CACHE_DIR or envs.PAGEDMLX_KERNEL_CACHE is False:
        return
    import mlx.core as mx

    folder = cache_dir() / "mlx-ptx" / mx.__version__
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        info = mx.device_info()
        folder /= f"sm_{info.get('compute_capability_major', 0)}{info.get('compute_capability_minor', 0)}"
    os.environ["MLX_PTX_CACHE_DIR"] = str(folder)


def device_name() -> str:
    """MLX's name for its default device (mx.device_info's device_name; "" where it has none)."""
    import mlx.core as mx

    try:
        return str(mx.device_info().get("device_name", ""))
    except Exception:  # noqa: BLE001 - an MLX without device_info
        return ""


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


OPENBLAS = ("/usr/lib/x86_64-linux-gnu/libopenblas.so.0", "/usr/lib/aarch64-linux-gnu/libopenblas.so.0")


def openblas_to_preload(maps: Optional[str] = None) -> Optional[str]:
    """The installed OpenBLAS that this process has not loaded (Linux: MLX's CPU wheel multiplies with a reference
    BLAS unless OpenBLAS is preloaded, 2-3x slower end to end); None where it is loaded, absent, or not Linux.
    maps: /proc/self/maps's text (read when None)."""
    path = next((p for p in OPENBLAS if os.path.exists(p)), None)
    if path is None or not sys.platform.startswith("linux"):
        return None
    maps = _maps() if maps is None else maps
    return None if not maps or "libopenblas" in maps else path


def reexec_with_openblas(argv: Sequence[str]) -> None:
    """The `pagedmlx` command, run again with OpenBLAS preloaded where it is installed and not loaded (once:
    PAGEDMLX_BLAS_REEXEC marks the second run). PAGEDMLX_BLAS_PRELOAD=0 turns this off."""
    path = openblas_to_preload()
    if path is None or envs.PAGEDMLX_BLAS_REEXEC or not envs.PAGEDMLX_BLAS_PRELOAD:
        return
    preload = " ".join(filter(None, [envs.LD_PRELOAD, path]))
    env = dict(os.environ, LD_PRELOAD=preload, PAGEDMLX_BLAS_REEXEC="1")
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "pagedmlx.cli", *argv], env)


def slow_blas_warning() -> Optional[str]:
    """What to tell a user whose engine multiplies on the CPU with MLX's reference BLAS; None where that is not so."""
    import mlx.core as mx

    maps = _maps()
    if mx.default_device() != mx.cpu or not sys.platform.startswith("linux") or not maps or "libopenblas" in maps:
        return None
    path = openblas_to_preload(maps)
    if path is not None:
        return (f"MLX's CPU backend multiplies with its reference BLAS in this process: start Python with "
                f"LD_PRELOAD={path} for 2-3x the speed (the `pagedmlx` command and `make` do it for you)")
    return ("MLX's CPU backend multiplies with its reference BLAS: install OpenBLAS (Debian/Ubuntu: "
            "apt-get install libopenblas0-pthread) and preload it (LD_PRELOAD) for 2-3x the speed")


def warn_if_slow_blas() -> None:
    """Log slow_blas_warning's line, where there is one (an engine's start)."""
    if (line := slow_blas_warning()) is not None:
        import logging

        logging.getLogger("pagedmlx").warning(line)


def _maps() -> str:
    try:
        return Path("/proc/self/maps").read_text()
    except OSError:
        return ""


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
