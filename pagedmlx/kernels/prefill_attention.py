"""Paged prefill attention, for attention layers (full, sliding window, shared KV, attention sinks), on
CUDA only (tensor cores, sm_80+), from sources/prefill_attention_cuda.py: every prefill segment of a
step causally over its pages, in one launch, in 16-token tiles (attention_metadata.PrefillTiles
builds its indices). Split partials are merged by the decode kernels' merge (decode_attention.py).
Where it runs: selector.select_kernels (16-bit floats, the head dims below) and, per step, chunks of
at most PREFILL_KERNEL_MAX_QUERY tokens; elsewhere prefill rows attend through MLX's SDPA.
"""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from pagedmlx.kernels import build, decode_attention
from pagedmlx.kernels.dialect import CUDA, render
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.kernels.sources import decode_attention_quant_mma_cuda as quant_mma_src
from pagedmlx.kernels.sources import prefill_attention_cuda as prefill_src
from pagedmlx.kernels.sources import prefill_attention_quant_cuda as quant_prefill_src
from pagedmlx.core.kv.spec import cdiv
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.runner.kv_quant import QuantizedPages

_PREFILL_INPUTS = ["q", "k_pages", "v_pages", "block_table", "segs", "tiles", "split_tokens", "scale", "sinks",
                   "written"]
_QUANT_INPUTS = ["k_scales", "k_biases", "v_scales", "v_biases"]  # after those, for quantized pages
PREFILL_TILE = 16  # query tokens per tile (sources/prefill_attention_cuda.py: TQ)
PREFILL_HEAD_DIMS = (64, 128)
PREFILL_MAX_GROUP = 8  # query heads per KV head: one warp each, at most 256 threads a block
# Split the keys while the tiles alone would keep fewer warps in flight than this (132 SMs x 16),
# each split at least PREFILL_MIN_SPLIT keys.
PREFILL_TARGET_WARPS = 2112
PREFILL_MIN_SPLIT = 1024
# Steps whose prefill segments all have at most this many new tokens go through the kernel; larger
# chunks through MLX's attention (cuDNN), which runs one 8,192-token chunk 2-3x faster and one of 512
# tokens over 8k keys 1.4x faster, while the kernel is 1.2-1.4x faster at 256 tokens a segment and
# 3.3x on a burst's step of 30 such segments (H200, bench_prefill_attention.py and
# profile_prefill_steps.py). CUDA's chunk cap beside decodes is 256.
PREFILL_KERNEL_MAX_QUERY = 256


def prefill_sources(quantized: bool = False) -> dict[str, tuple[str, str]]:
    """{kernel: (body, header)} of the paged prefill kernels (CUDA only); quantized: over quantized pages
    (sources/prefill_attention_quant_cuda.py)."""
    header = mma_src.MMA_HEADER + prefill_src.PREFILL_HEADER + (quant_mma_src.QUANT_MMA_HEADER if quantized else "")
    body = render(quant_prefill_src.quantized_prefill(prefill_src.ACCUMULATE) if quantized else prefill_src.ACCUMULATE,
                  CUDA)
    return {"single": (body + render(prefill_src.WRITE_OUT, CUDA), header),
            "split": (body + render(prefill_src.WRITE_SPLIT, CUDA), header)}


@functools.lru_cache(maxsize=None)
def _prefill_kernels(quantized: bool = False):
    s = prefill_sources(quantized)
    inputs = _PREFILL_INPUTS + (_QUANT_INPUTS if quantized else [])
    name = "pagedmlx_paged_prefill" + ("_quant" if quantized else "")
    single = build.make_kernel(CUDA, name, inputs, ["out"], *s["single"])
    split = build.make_kernel(CUDA, name + "_split", inputs, ["part_acc", "part_m", "part_l"], *s["split"])
    return single, split


def supports_prefill(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype,
                     quant: Optional[KVQuant] = None) -> bool:
    """The prefill kernel takes the layer: 16-bit floats, one head_dim it is built for, <= 8 heads per KV head;
    quant: its pages are quantized so (4 or 8 bits, groups of a multiple of 32)."""
    if quant is not None:
        return quant_prefill_refusal(k_dim, v_dim, n_heads, n_kv_heads, dtype, quant) is None
    return prefill_refusal(k_dim, v_dim, n_heads, n_kv_heads, dtype) is None


def prefill_refusal(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype) -> Optional[str]:
    """Why the prefill kernel does not take the layer; None: it does."""
    if dtype not in (mx.float16, mx.bfloat16):
        return f"{str(dtype).split('.')[-1]} pages (tensor cores: 16-bit floats only)"
    if k_dim != v_dim:
        return f"keys of head_dim {k_dim}, values of {v_dim}"
    if k_dim not in PREFILL_HEAD_DIMS:
        return f"head_dim {k_dim} (built for {', '.join(map(str, PREFILL_HEAD_DIMS))})"
    if n_heads % n_kv_heads or n_heads // n_kv_heads > PREFILL_MAX_GROUP:
        return f"{n_heads} query heads over {n_kv_heads} KV heads (at most {PREFILL_MAX_GROUP} per KV head)"
    return None


def quant_prefill_refusal(k_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype,
                          quant: KVQuant) -> Optional[str]:
    """Why the prefill kernel does not take a layer of quantized pages (dtype: their scales'); None: it does."""
    if quant.bits not in (4, 8) or quant.group_size % 32:
        return f"int{quant.bits} pages in groups of {quant.group_size} (built for 4 and 8 bits, groups of 32k)"
    return prefill_refusal(k_dim, v_dim, n_heads, n_kv_heads, dtype)


def prefill_splits(num_tiles: int, n_kv_heads: int, group: int, max_keys: int) -> tuple[int, int]:
    """(splits, keys per split) for tiles whose longest key range is max_keys."""
    warps = num_tiles * n_kv_heads * group
    if warps >= PREFILL_TARGET_WARPS or max_keys < 2 * PREFILL_MIN_SPLIT:
        return 1, max(max_keys, 1)
    splits = min(max_keys // PREFILL_MIN_SPLIT, cdiv(PREFILL_TARGET_WARPS, warps))
    tokens = cdiv(max_keys, splits)
    return cdiv(max_keys, tokens), tokens


def paged_prefill(q: mx.array, k_pages: mx.array, v_pages: mx.array, block_table: mx.array, segs: mx.array,
                  tiles: mx.array, scale: float, splits: int, split_tokens: mx.array,
                  written: Optional[mx.array] = None, window: Optional[int] = None, sinks: Optional[mx.array] = None,
                  init_value: Optional[float] = None) -> mx.array:
    """Causal attention of every prefill segment over its pages, in one launch (CUDA).
    q (Tp, H, D): the step's prefill rows; segs (S, 4) int32: per segment its first row in q, its new
    tokens n, the position of the first and key_offset (the position of the first key its row of
    block_table (S, nb) holds: 0, or a page boundary before its window); tiles (NT, 2) int32: (segment,
    first token) of each 16-token tile; splits x split_tokens (1,) must cover each tile's keys
    (prefill_splits). window, sinks, written, init_value: as paged_decode. k_pages, v_pages: arrays, or
    QuantizedPages (runner/kv_quant.py: their packed words, scales and biases read, dequantized in the
    kernel). -> (Tp, H, D), pages' dtype."""
    Tp, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    G = H // n_kv
    quantized = isinstance(k_pages, QuantizedPages)
    sink_input = build.device_constant(0.0, mx.float32) if sinks is None else sinks.astype(mx.float32)
    inputs = [q if q.dtype == k_pages.dtype else q.astype(k_pages.dtype),
              k_pages.packed if quantized else k_pages, v_pages.packed if quantized else v_pages, block_table, segs,
              tiles, split_tokens, build.device_constant(scale, mx.float32), sink_input,
              written if written is not None else build.device_constant(0, mx.int32)]
    template = [("T", k_pages.dtype), ("D", D), ("G", G), ("BS", bs), ("WINDOW", int(window or 0))]
    if quantized:
        inputs += [k_pages.scales, k_pages.biases, v_pages.scales, v_pages.biases]
        template += [("QBITS", k_pages.quant.bits), ("QGROUP", k_pages.quant.group_size)]
    launch = dict(grid=(tiles.shape[0] * 32 * G, n_kv, splits), threadgroup=(32 * G, 1, 1), init_value=init_value)
    single, split = _prefill_kernels(quantized)
    if splits == 1:
        return single(inputs=inputs, template=template + [("SINKS", int(sinks is not None))],
                      output_shapes=[(Tp, H, D)], output_dtypes=[k_pages.dtype], **launch)[0]
    # Split: the merge adds the sink term.
    parts = split(inputs=inputs, template=template,
                  output_shapes=[(splits, Tp, H, D), (splits, Tp, H), (splits, Tp, H)],
                  output_dtypes=[mx.float32] * 3, **launch)
    merge = decode_attention.merge_kernel(CUDA)  # the decode kernels' merge: the same partials' layout
    return merge(inputs=[*parts, sink_input],
                 template=[("T", k_pages.dtype), ("D", D), ("SINKS", int(sinks is not None))],
                 grid=(H * D, Tp, 1), threadgroup=(D, 1, 1), output_shapes=[(Tp, H, D)],
                 output_dtypes=[k_pages.dtype], init_value=init_value)[0]
