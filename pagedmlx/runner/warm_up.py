"""Start-up work of a ModelRunner (runner/model.py), so that the first requests meet no compilation: the
paged kernels each layer runs, compiled on page 0, and the attention shapes a long prompt's chunks meet,
built once."""

from __future__ import annotations

import logging
import time

import mlx.core as mx

from pagedmlx.config import EngineConfig
from pagedmlx.kernels import disk_cache, prefill_attention
from pagedmlx.runner.attention import decode_kernel_takes, paged_decode, warm_up_prefill
from pagedmlx.runner.attention_metadata import WARM_UP_MAX_KEYS, chunked_prefill_groups
from pagedmlx.runner.kv_quant import QuantizedPages, read_pages

logger = logging.getLogger("pagedmlx")


def warm_up(runner, config: EngineConfig, max_model_len: int) -> None:
    """Compile the paged kernels the model's layers run (compile_kernels), then build the
    attention shapes a long prompt's chunks meet (warm_up_attention) where
    config.warm_up_attention says so (default: where attention shapes are padded, CUDA, unless
    the prefill kernel takes the chunks beside decodes: it builds nothing per shape). A
    failure is logged: what it was to build is then built when first met."""
    if runner.kernels.paged or runner.kernels.prefill:
        start = time.perf_counter()
        try:
            n = runner.compile_kernels()
            logger.info("compiled %d paged kernel variants in %.1f s", n, time.perf_counter() - start)
        except Exception:  # noqa: BLE001 - an optimisation: serving goes on
            logger.warning("compiling the paged kernels failed; they will be compiled when first run",
                           exc_info=True)
    if (kept := disk_cache.stats_line()) is not None:
        logger.info(kept)
    enabled = config.warm_up_attention
    chunk = config.long_prefill_token_threshold
    if enabled is None:  # where shapes are padded, and chunks beside decodes call SDPA
        full = [g for g, w in zip(runner.prefill_heads, runner.windows) if w is None]
        max_query = prefill_attention.PREFILL_KERNEL_MAX_QUERY
        kernel = all(g is not None for g in full) and chunk and chunk <= max_query
        enabled = runner.sdpa_quantum > 1 and not kernel
    if not (enabled and chunk):
        return
    start, max_keys = time.perf_counter(), min(max_model_len, WARM_UP_MAX_KEYS)
    try:
        n = runner.warm_up_attention(chunk, max_keys)
    except Exception:  # noqa: BLE001 - an optimisation: serving goes on
        logger.warning("building the prefill attention shapes failed; they will be built when first met",
                       exc_info=True)
        return
    logger.info("built %d prefill attention shapes (prompts up to %d tokens, %d-token chunks) in %.1f s",
                n, max_keys, chunk, time.perf_counter() - start)

def compile_kernels(runner) -> int:
    """Run once on page 0 each variant of the decode and prefill kernels that the layers use
    (head shape, window, sinks; unsplit and split), so that MLX compiles them before the first
    request (2-3 s each on the H200) rather than in its steps; quantized pages' gathers too.
    Returns the kernel variants run."""
    kinds = {}
    for i, p in enumerate(runner.plan):
        if p.has_pages or p.kind == "shared":
            owner = p.source if p.kind == "shared" else i
            kinds.setdefault((runner.plan[owner].spec, p.n_heads, runner.windows[runner.group_of[owner]], p.sinks),
                             owner)
    runs = 0
    for ((n_kv, dk, dv, dt), h, window, sinks), layer in kinds.items():
        k_pages, v_pages = read_pages(runner.kv_pool, layer)
        bs = k_pages.shape[2]
        sink = mx.zeros((h,), mx.float32) if sinks else None
        outs = []
        for splits in (1, 2):
            if runner.kernels.decode and decode_kernel_takes(h, k_pages, v_pages, runner.kernels.backend):
                outs.append(paged_decode(
                    mx.zeros((1, h, dk), dt), k_pages, v_pages, mx.zeros((1, 2), mx.int32), mx.array([2 * bs]),
                    1.0, splits, mx.array([bs], mx.int32), window=window, sinks=sink, backend=runner.kernels.backend))
            if runner.kernels.prefill and prefill_attention.supports_prefill(dk, dv, h, n_kv, dt,
                                                                           runner.kv_quant.get(layer)):
                tile = prefill_attention.PREFILL_TILE
                outs.append(prefill_attention.paged_prefill(
                    mx.zeros((tile, h, dk), dt), k_pages, v_pages, mx.zeros((1, -(-tile // bs)), mx.int32),
                    mx.array([[0, tile, 0, 0]], mx.int32), mx.array([[0, 0]], mx.int32), 1.0, splits,
                    mx.array([tile // 2], mx.int32), window=window, sinks=sink))
        runs += len(outs)
        if isinstance(k_pages, QuantizedPages):
            # Chunks longer than the prefill kernel takes (a prompt with no decodes beside it) gather and
            # dequantize quantized pages: MLX builds those gathers (packed words, scales) on first use, which
            # would otherwise land inside the first long prompts' steps. Page 0's rows, once, build them here.
            rows = mx.zeros((1, n_kv, 1), mx.int32)
            outs += [k_pages.gather_rows(rows, 1), v_pages.gather_rows(rows, 1)]
        mx.eval(outs)
    return runs

def warm_up_attention(runner, chunk: int, max_keys: int) -> int:
    """Run once each padded attention shape of a prompt of max_keys tokens prefilled `chunk`
    tokens a step, for each kind of full-attention layer (windows read a window's keys: their
    shapes repeat anyway). On CUDA each first call builds a cuDNN graph (~50 ms) that MLX keeps
    for the calling thread. Returns the number of shapes."""
    groups = chunked_prefill_groups(chunk, max_keys, runner.sdpa_quantum, runner.block_size)
    kinds = {}
    for i, p in enumerate(runner.plan):
        if p.kind == "full":
            kinds.setdefault((p.spec, p.n_heads, p.sinks), i)
    for (_, n_heads, sinks), i in kinds.items():
        warm_up_prefill(n_heads, *read_pages(runner.kv_pool, i), sinks, groups)
    return len(groups) * len(kinds)
