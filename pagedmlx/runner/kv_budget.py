"""How many bytes the KV pool gets (vLLM's gpu_memory_utilization and its profile run).

On a GPU backend the pool takes what is left of `gpu_memory_utilization` of the device's memory (CUDA: the
card's; Metal: MLX's recommended working set) once the weights and everything else already allocated are
counted, less the peak of one step of `max_num_batched_tokens` tokens, measured by running one through the
model's own forward at start. On the CPU, whose RAM the rest of the machine shares, the pool is sized to the
model: as many bytes as its weights, at least CPU_MIN_BYTES, at most CPU_MAX_FRACTION of RAM.
`kv_cache_memory_gb` (and `num_blocks`) override either. Recurrent-state slots and a draft model's pages come
out of the same budget (runner/model.py sizes the groups inside it).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from pagedmlx.config import EngineConfig

logger = logging.getLogger("pagedmlx")

DEFAULT_MAX_MODEL_LEN = 8192  # where neither the config nor the model names one
CPU_MIN_BYTES = 512 * 2**20
CPU_MAX_FRACTION = 0.25


@dataclass
class KVBudget:
    nbytes: int
    how: str  # how it was sized, for the start-up line


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
    if config.kv_cache_memory_gb is not None:
        return KVBudget(int(config.kv_cache_memory_gb * 1e9), f"kv_cache_memory_gb {config.kv_cache_memory_gb:g}")
    on_gpu = mx.default_device() == mx.gpu if on_gpu is None else on_gpu
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
    peak_text = f"{peak / 1e9:.2f} GB a {tokens}-token step's peak"
    if peak is None:  # the step could not run alone: keep a tenth of the device for it
        peak, peak_text = int(0.1 * total), f"{0.1 * total / 1e9:.1f} GB for a step (not profiled)"
    nbytes = int(util * total) - held - peak
    others = f", {(held - weights) / 1e9:.2f} GB other arrays (another engine's pool?)" if held - weights > 1e9 else ""
    how = (f"gpu_memory_utilization {util:g} x {total / 1e9:.1f} GB {what} - {held / 1e9:.2f} GB held (weights "
           f"{weights / 1e9:.2f} GB{others}) - {peak_text}")
    if nbytes <= 0:
        raise ValueError(f"no memory left for KV pages: {how} = {nbytes / 1e9:.2f} GB; raise gpu_memory_utilization "
                         f"(--gpu-memory-utilization), lower max_num_batched_tokens, or give kv_cache_memory_gb")
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
