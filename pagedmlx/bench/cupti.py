"""The device's own kernel times for a piece of MLX work on CUDA: CUPTI's kernel records, read through
torch.profiler where torch is installed (the GPU machine's image has it; pagedmlx does not depend on it).
Wall time on CUDA includes the host's dispatch of every MLX op, which bounds short kernels; these do not."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx


def kernel_times(run: Callable[[], object]) -> Optional[list[tuple[float, int, str]]]:
    """[(microseconds, launches, kernel name)] of the kernels the device ran for run() (waited for), longest
    first; None without torch or a CUDA device."""
    try:
        import torch
        from torch.profiler import ProfilerActivity, profile
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.zeros(1, device="cuda")  # CUPTI needs the CUDA context
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        mx.synchronize()
    rows = [(getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0), e.count, e.key)
            for e in prof.key_averages()]
    return sorted((r for r in rows if r[0] > 0), reverse=True)
