"""platform.py: OpenBLAS for MLX's CPU backend, found on its own by the `pagedmlx` command and named otherwise."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from pagedmlx import platform

OPENBLAS = next((p for p in platform.OPENBLAS if os.path.exists(p)), None)
needs_openblas = pytest.mark.skipif(OPENBLAS is None or not sys.platform.startswith("linux"),
                                    reason="an installed OpenBLAS on Linux")


@needs_openblas
def test_openblas_to_preload_reads_what_the_process_loaded():
    assert platform.openblas_to_preload("7f00-7f01 r-xp 0 08:01 1 /usr/lib/libc.so.6\n") == OPENBLAS
    assert platform.openblas_to_preload(f"7f00-7f01 r-xp 0 08:01 1 {OPENBLAS}\n") is None


@needs_openblas
def test_the_command_runs_itself_again_with_openblas_preloaded(monkeypatch):
    calls = []
    monkeypatch.setattr(platform.os, "execve", lambda exe, argv, env: calls.append((argv, env)))
    monkeypatch.setattr(platform, "openblas_to_preload", lambda: OPENBLAS)
    for var in ("PAGEDMLX_BLAS_REEXEC", "PAGEDMLX_BLAS_PRELOAD"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("LD_PRELOAD", "/opt/other.so")
    platform.reexec_with_openblas(["serve", "--port", "9"])
    [(argv, env)] = calls
    assert argv[1:] == ["-m", "pagedmlx.cli", "serve", "--port", "9"]
    assert env["LD_PRELOAD"] == f"/opt/other.so {OPENBLAS}" and env["PAGEDMLX_BLAS_REEXEC"] == "1"
    monkeypatch.setenv("PAGEDMLX_BLAS_REEXEC", "1")  # the second run does not run again
    platform.reexec_with_openblas(["serve"])
    monkeypatch.delenv("PAGEDMLX_BLAS_REEXEC")
    monkeypatch.setenv("PAGEDMLX_BLAS_PRELOAD", "0")  # turned off
    platform.reexec_with_openblas(["serve"])
    assert len(calls) == 1


@needs_openblas
def test_an_engine_without_openblas_says_how_to_get_it():
    env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
    code = "from pagedmlx.platform import slow_blas_warning; print(slow_blas_warning())"
    bare = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert f"LD_PRELOAD={OPENBLAS}" in bare.stdout
    fast = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env=dict(env, LD_PRELOAD=OPENBLAS))
    assert fast.stdout.strip() == "None"


def test_the_servers_front_end_asks_nothing_of_the_gpu(monkeypatch):
    """The front end builds no kernel, so it never points MLX's kernel cache at the device (which asks the GPU for its
    compute capability, and on CUDA can hold a context's memory beside the engine core's)."""
    from pagedmlx.server import launch

    asked = []
    monkeypatch.setattr(platform, "use_kernel_cache", lambda: asked.append(True))
    launch._import_server()
    assert asked == []
    platform.import_mlx_lm()  # the engine's packages do
    assert asked == [True]
