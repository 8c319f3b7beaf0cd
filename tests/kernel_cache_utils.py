"""Stand-ins for NVRTC and its worker processes (kernels/disk_cache.py, kernels/compile_workers.py), for tests of
the kernel disk cache on a machine without CUDA."""

from __future__ import annotations

from pagedmlx.kernels import disk_cache


class FakeNVRTC:
    """Compiles nothing: a module's bytes are a stub ELF; records each source and module name it was given."""

    arch = "sm_90a"

    def __init__(self):
        self.sources, self.modules = [], []

    def compile(self, source, module_name, kernel_name):
        self.sources.append(source)
        self.modules.append(module_name)
        return b"\x7fELF cubin", "_ZN3mlx4core2cu" + kernel_name.rsplit(":", 1)[-1]


def fake_compile_workers(monkeypatch, cache_dir, write: bool = True) -> tuple[FakeNVRTC, list]:
    """This process's NVRTC and its worker processes stood in for, with MLX_PTX_CACHE_DIR at cache_dir and 4 CPUs:
    (the compiler, the workers' calls). Each call is recorded as (its sorted module names, arch, worker count); the
    workers write every module (none where write=False), their counts their own as separate processes' are."""
    fake, calls = FakeNVRTC(), []

    def workers(jobs, arch, cache, count):
        calls.append((sorted(job[0] for job in jobs), arch, count))
        ours = dict(disk_cache.stats)
        for job in jobs if write else ():
            disk_cache.write_module(cache, *job, fake)
        disk_cache.stats.update(ours)

    monkeypatch.setattr(disk_cache, "_compiler", lambda: fake)
    monkeypatch.setattr(disk_cache.compile_workers, "compile_in_workers", workers)
    monkeypatch.setattr(disk_cache.os, "cpu_count", lambda: 4)
    monkeypatch.setattr(disk_cache, "stats", {"found": 0, "compiled": 0})
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(cache_dir))
    return fake, calls
