"""Kernel variants compiled by worker processes, for the disk cache's prebuild (disk_cache.py).

NVRTC compiles one program at a time within a process (with CUDA 13, two threads compiled four quantized GEMM
variants no faster than one; two processes, 1.65x faster), and a first start on a machine meets dozens of
variants, a few seconds each. So up to WORKERS interpreters run disk_cache.py's worker_main at once, each compiling
its share of the variants straight into the cache folder. They are started with `subprocess`, not multiprocessing:
the engine core is a daemon process, which multiprocessing lets have no children. A worker touches no GPU (NVRTC is
a compiler; the architecture comes from the parent). A variant a worker did not write is left to the caller.

    python -m pagedmlx.kernels.disk_cache ARCH CACHE_DIR JOBS_JSON    # a worker (disk_cache.worker_main)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Sequence

WORKERS = 16
WORKER = "pagedmlx.kernels.disk_cache"  # the module a worker runs (named, not imported: it imports this one)
TIMEOUT_S = 600  # a worker still compiling after this is stopped; its variants are left to the caller

Job = tuple[str, str, str]  # (module name, kernel name, rendered source)


def compile_in_workers(jobs: Sequence[Job], arch: str, cache_dir: Path, workers: int) -> None:
    """Write each job's module into cache_dir from `workers` processes compiling at once, round robin."""
    with tempfile.TemporaryDirectory(prefix="pagedmlx-nvrtc-") as tmp:
        procs = []
        for i in range(workers):
            path = Path(tmp) / f"jobs{i}.json"
            path.write_text(json.dumps([list(job) for job in jobs[i::workers]]))
            procs.append(subprocess.Popen([sys.executable, "-m", WORKER, arch, str(cache_dir), str(path)],
                                          env=child_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        deadline = time.monotonic() + TIMEOUT_S
        for proc in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def child_env(**extra: str) -> dict[str, str]:
    """The parent's environment, with its import path (a child process imports pagedmlx as the parent did) and
    `extra` variables."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), **extra}
