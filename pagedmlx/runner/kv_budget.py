"""How many bytes the KV pool gets (vLLM's gpu_memory_utilization and its profile run).

On a GPU backend the pool takes what is left of `gpu_memory_utilization` of the device's memory (CUDA: the
card's; Metal: MLX's recommended working set) once the weights and everything else already allocated are
counted, less the peak of one step of `max_num_batched_tokens` tokens, measured by running one through the
model's own forward at start. On the CPU, whose RAM the rest of the machine shares, the pool is sized to the
model: as many bytes as its weights, at least CPU_MIN_BYTES, at most CPU_MAX_FRACTION of RAM.
`kv_cache_memory_gb` (and `num_blocks`) override either. Recurrent-state slots and a draft model's pages come
out of the same budget (runner/model.py sizes the groups inside it).

Memory this process's arrays do not account for (other processes on the card, CUDA contexts) is counted too, as vLLM
counts its non-torch memory: where MLX says what is free on the device (CUDA: mx.device_info's free_memory, across
processes), the pool never takes more than what is free less the step's peak and FREE_MARGIN, and a given
`kv_cache_memory_gb` that does not fit is refused by name instead of failing in the allocator.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from pagedmlx.config import EngineConfig

logger = logging.getLogger("pagedmlx")

DEFAULT_MAX_MODEL_LEN = 8192  # where neither the config nor the model names one
CPU_MIN_BYTES = 512 * 2**20
CPU_MAX_FRACTION = 0.25
FREE_MARGIN = 2**30  # left free on the device beyond the step's peak (CUDA graphs, MLX's small buffers)


@dataclass
class KVBudget:
    nbytes: int
    how: str  # how it was sized, for the start-up line


def release_cache() -> None:
    """MLX's cached buffers given back to the device (the load-time checks leave gigabytes of them)."""
    mx.synchronize()
    mx.clear_cache()
    mx.synchronize()  # CUDA's memory pool hands freed memory back at a synchronization


def free_device_bytes(on_gpu: bool) -> Optional[int]:
    """Bytes free on this process's GPU now, whoever holds the rest, once MLX has given back its cached buffers;
    None where MLX does not say (Metal, the CPU)."""
    if not on_gpu:
        return None
    release_cache()
    free = mx.device_info().get("free_memory")
    return int(free) if free else None


def out_of_memory(exc: BaseException) -> bool:
    """Whether MLX's allocator raised `exc` for want of device memory (CUDA's cudaMalloc*, Metal's)."""
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


@contextlib.contextmanager
def pool_allocation(nbytes: int) -> Iterator[None]:
    """Around the pools' allocation: MLX's cached buffers given back first, and an allocator's out-of-memory error
    said as what to change."""
    release_cache()
    try:
        yield
    except RuntimeError as exc:
        if not out_of_memory(exc):
            raise
        raise ValueError(f"the KV pool ({nbytes / 1e9:.2f} GB) could not be allocated ({exc}): lower "
                         f"gpu_memory_utilization (--gpu-memory-utilization) or kv_cache_memory_gb (--kv-cache-gb), "
                         f"or free the device's memory that other processes hold") from exc


def device_memory(on_gpu: bool) -> tuple[int, str]:
    """(bytes, what they are) of the memory the pool is planned against."""
    if on_gpu:
        info = mx.device_info()
        for key, what in (("max_recommended_working_set_size", "recommended working set"),
                          ("total_memory", "device memory"), ("memory_size", "device memory")):
            if info.get(key):
                return int(info[key]), what
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "RAM"


def weights_nbytes(model: nn.Module) -> int:
    """Bytes of the model's parameters (about what a step reads at batch 1)."""
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def held_bytes(model: nn.Module) -> int:
    """What this process holds on the device before the pool: the weights and all else allocated."""
    return max(mx.get_active_memory(), weights_nbytes(model))


def step_peak_bytes(body: Optional[Callable], head: Optional[Callable], tokens: int, sampled: int) -> Optional[int]:
    """Bytes one step of `tokens` rows (`sampled` of them through the LM head) allocates beyond what is held,
    from a forward through the model's own path (no pages); None where that path does not run alone."""
    if body is None or head is None:
        return None
    mx.synchronize()
    held = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        hidden = body(mx.zeros((tokens, 1), mx.int32))
        logits = head(hidden[:sampled, -1:]).astype(mx.float32)
        mx.eval(logits)
    except Exception:  # noqa: BLE001 - a model whose layers need a cache; the caller falls back
        logger.debug("the profile step did not run", exc_info=True)
        return None
    finally:
        hidden = logits = None
        mx.synchronize()
    peak = mx.get_peak_memory() - held
    mx.clear_cache()
    return max(peak, 0)


def kv_cache_budget(config: EngineConfig, model: nn.Module, body: Optional[Callable], head: Optional[Callable],
                    on_gpu: Optional[bool] = None) -> KVBudget:
    """The KV pool's bytes (pages and state slots together), and how they were sized. on_gpu: size as on a GPU
    backend (None: where this process computes)."""
    on_gpu = mx.default_device() == mx.gpu if on_gpu is None else on_gpu
    if config.kv_cache_memory_gb is not None:
        nbytes, free = int(config.kv_cache_memory_gb * 1e9), free_device_bytes(on_gpu)
        if free is not None and nbytes > free - FREE_MARGIN:
            raise ValueError(f"kv_cache_memory_gb {config.kv_cache_memory_gb:g} (--kv-cache-gb) does not fit: "
                             f"{free / 1e9:.2f} GB are free on the device, less {FREE_MARGIN / 1e9:.2f} GB kept free; "
                             f"give less, or leave it out to size the pool by --gpu-memory-utilization")
        return KVBudget(nbytes, f"kv_cache_memory_gb {config.kv_cache_memory_gb:g}")
    total, what = device_memory(on_gpu)
    weights = weights_nbytes(model)
    if not on_gpu:
        nbytes = int(min(CPU_MAX_FRACTION * total, max(weights, CPU_MIN_BYTES)))
        return KVBudget(nbytes, f"CPU: the model's {weights / 1e9:.2f} GB of weights, at least "
                                f"{CPU_MIN_BYTES / 1e9:.2f} GB, at most {CPU_MAX_FRACTION:g} of "
                                f"{total / 1e9:.1f} GB RAM")
    util = config.gpu_memory_utilization
    held = held_bytes(model)
    tokens = config.max_num_batched_tokens
    peak = step_peak_bytes(body, head, tokens, min(config.max_num_seqs, tokens))
    if peak is None:  # the step could not run alone: keep a tenth of the device for it
        peak, peak_text = int(0.1 * total), f"{0.1 * total / 1e9:.1f} GB for a step (not profiled)"
    else:
        peak_text = f"{peak / 1e9:.2f} GB a {tokens}-token step's peak"
    nbytes = int(util * total) - held - peak
    others = f", {(held - weights) / 1e9:.2f} GB other arrays (another engine's pool?)" if held - weights > 1e9 else ""
    how = (f"gpu_memory_utilization {util:g} x {total / 1e9:.1f} GB {what} - {held / 1e9:.2f} GB held (weights "
           f"{weights / 1e9:.2f} GB{others}) - {peak_text}")
    free = free_device_bytes(on_gpu)
    if free is not None and nbytes > free - peak - FREE_MARGIN:  # others hold part of the fraction
        nbytes = free - peak - FREE_MARGIN
        how += (f"; lowered to {nbytes / 1e9:.2f} GB: {free / 1e9:.2f} GB free on the device (other processes "
                f"hold {max(total - free - held, 0) / 1e9:.2f} GB) - the step - {FREE_MARGIN / 1e9:.2f} GB kept free")
    if nbytes <= 0:
        raise ValueError(f"no memory left for KV pages: {how} = {nbytes / 1e9:.2f} GB; raise gpu_memory_utilization "
                         f"(--gpu-memory-utilization), lower max_num_batched_tokens, give kv_cache_memory_gb, or "
                         f"free the device's memory that other processes hold")
    return KVBudget(nbytes, how)


def max_model_len(config: EngineConfig, model: nn.Module, kv_cache_config) -> int:
    """config.max_model_len, else the model's max_position_embeddings, else DEFAULT_MAX_MODEL_LEN; capped (with a
    warning) at what the pool's pages hold (recurrent states hold any length)."""
    limit = (config.max_model_len or getattr(getattr(model, "args", None), "max_position_embeddings", None)
             or DEFAULT_MAX_MODEL_LEN)
    paged = [g for g in kv_cache_config.kv_cache_groups if not g.is_state]
    capacity = paged[0].num_blocks * config.block_size if paged else limit
    if limit > capacity:
        logger.warning("max_model_len %d exceeds the KV pool (%d tokens); capping it", limit, capacity)
    return min(limit, capacity)
