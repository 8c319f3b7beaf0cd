"""Paged decode attention over quantized pages (kv_cache_dtype int8 / int4), CUDA and Metal: the lanes
decode kernel (decode_attention.py) with its rows dequantized in the inner loop
(sources/decode_attention_quant.py). Same grid, splits, window and sinks, same merge kernel. On CUDA,
where the 16-bit kernel runs on tensor cores (decode_attention.uses_tensor_cores), the quantized pages'
tensor-core kernel runs instead (sources/decode_attention_quant_mma_cuda.py: tiles dequantized into
shared memory); the lanes kernel takes the rest (Metal, other head dims). Never trusted unchecked: the
selector runs check.py's quantized checks on every GPU until a GPU suite has run them
(tests/test_gpu_kernels.py)."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx

from pagedmlx import envs
from pagedmlx.kernels import build, decode_attention
from pagedmlx.kernels.dialect import CUDA, render
from pagedmlx.kernels.sources import decode_attention as src
from pagedmlx.kernels.sources import decode_attention_mma_cuda as mma_src
from pagedmlx.kernels.sources import decode_attention_quant as qsrc
from pagedmlx.kernels.sources import decode_attention_quant_mma_cuda as qmma_src
from pagedmlx.core.kv.cache_dtype import KVQuant

_INPUTS = ["q", "k_pages", "v_pages", "k_scales", "k_biases", "v_scales", "v_biases", "block_table", "seq_lens",
           "split_tokens", "scale", "sinks", "written"]


def quant_decode_sources(backend: str, mma: bool = False) -> dict[str, tuple[str, str]]:
    """{kernel: (body, header)} of the quantized decode kernels (single, split), rendered for `backend`;
    mma: the tensor-core kernel (CUDA only)."""
    if mma and backend != CUDA:
        raise ValueError("the tensor-core kernel is CUDA only")
    if mma:
        header = render(src.HEADER, backend) + mma_src.MMA_HEADER + qmma_src.QUANT_MMA_HEADER
        accumulate = render(qmma_src.quantized_accumulate_mma(mma_src.ACCUMULATE_MMA), backend)
    else:
        header = render(src.HEADER + qsrc.QUANT_HEADER, backend)
        accumulate = render(qsrc.quantized_accumulate(src.ACCUMULATE), backend)
    merge_warps = accumulate + render(src.MERGE_WARPS, backend)
    return {"single": (merge_warps + render(src.WRITE_OUT, backend), header),
            "split": (merge_warps + render(src.WRITE_SPLIT, backend), header)}


@functools.lru_cache(maxsize=None)
def _kernels(backend: str, mma: bool = False):
    s = quant_decode_sources(backend, mma)
    name = "pagedmlx_paged_decode_quant" + ("_mma" if mma else "")
    single = build.make_kernel(backend, name, _INPUTS, ["out"], *s["single"])
    split = build.make_kernel(backend, name + "_split", _INPUTS, ["part_acc", "part_m", "part_l"], *s["split"])
    return single, split


def refusal(head_dim: int, v_dim: int, n_heads: int, n_kv_heads: int, dtype: mx.Dtype, quant: KVQuant,
            backend: Optional[str] = None) -> Optional[str]:
    """Why the quantized decode kernel does not take the layer (dtype: its scales'); None: it does."""
    why = decode_attention.layer_refusal(head_dim, v_dim, n_heads, n_kv_heads, dtype, backend)
    if why is not None:
        return why
    if uses_tensor_cores(head_dim, n_heads // n_kv_heads, dtype, quant, backend or build.gpu_backend() or CUDA):
        return None
    s = decode_attention.SETTINGS[backend or build.gpu_backend() or "cuda"]
    _, vec = decode_attention.kernel_layout(head_dim, n_heads // n_kv_heads, dtype, s.vectors)
    if vec * quant.bits % 32 or quant.group_size % vec:
        return f"{vec} channels a lane do not fill whole words of {quant.bits}-bit values in one group"
    return None


def supports_mma(head_dim: int, group: int, dtype: mx.Dtype, quant: KVQuant) -> bool:
    """The tensor-core kernel takes quantized pages of this shape: the 16-bit one's shapes, whole
    16-byte pieces (16 int8 / 32 int4 channels) inside one group, a whole number of pieces a lane."""
    piece = 128 // quant.bits if quant.bits in (4, 8) else 0
    return (decode_attention.supports_mma(head_dim, group, dtype) and piece > 0 and quant.group_size % piece == 0
            and head_dim % quant.group_size == 0 and (head_dim * quant.bits) % 256 == 0)


def uses_tensor_cores(head_dim: int, group: int, dtype: mx.Dtype, quant: KVQuant, backend: Optional[str],
                      settings: Optional[decode_attention.Settings] = None) -> bool:
    """The quantized decode kernel accumulates on tensor cores: where the 16-bit kernel of the same shape
    does (CUDA, unless PAGEDMLX_DECODE_MMA=0) and supports_mma takes the quantization."""
    return (decode_attention.uses_tensor_cores(head_dim, group, dtype, backend, settings)
            and supports_mma(head_dim, group, dtype, quant))


@functools.lru_cache(maxsize=None)
def _launch(D: int, G: int, bs: int, dt: mx.Dtype, quant: KVQuant, window: int, sinks: bool, backend: str,
            s: decode_attention.Settings) -> tuple[list, int, bool]:
    """(template, threads, tensor cores) of a layer's launch: the same every step, so made once."""
    flags = [("QBITS", quant.bits), ("QGROUP", quant.group_size), ("WINDOW", window), ("SINKS", int(sinks))]
    # the 16-bit tensor-core kernel's warps (decode_attention._launch)
    if uses_tensor_cores(D, G, dt, quant, backend, s):
        threads = 32 * max(1, min(4, 256 // D))
        # int8 with one group a row: scale and bias after the products (PAGEDMLX_QUANT_AFTER=0: dequantized tiles);
        # PAGEDMLX_QUANT_PREFETCH=0: no next tile staged in registers (fewer registers, more resident warps)
        after = [("SCALE_AFTER", int(envs.PAGEDMLX_QUANT_AFTER)),
                 ("QPREFETCH", int(envs.PAGEDMLX_QUANT_PREFETCH))]
        return [("T", dt), ("D", D), ("G", G), ("BS", bs), ("THREADS", threads)] + flags + after, threads, True
    tpt, vec = decode_attention.kernel_layout(D, G, dt, s.vectors)
    return ([("T", dt), ("D", D), ("G", G), ("R", 1), ("BS", bs), ("THREADS", s.threads), ("TPT", tpt),
             ("VEC", vec), ("U", s.unroll), ("PF", s.prefetch)] + flags, s.threads, False)


def paged_decode_quantized(q: mx.array, k_pages, v_pages, block_table: mx.array, seq_lens: mx.array, scale: float,
                           splits: int, split_tokens: mx.array, written: Optional[mx.array] = None,
                           window: Optional[int] = None, sinks: Optional[mx.array] = None,
                           init_value: Optional[float] = None, settings: Optional[decode_attention.Settings] = None,
                           backend: Optional[str] = None) -> mx.array:
    """decode_attention.paged_decode over QuantizedPages (runner/kv_quant.py): q (B, H, D) -> (B, H, D)
    in the scales' dtype. settings: other than the backend's SETTINGS (tests force the lanes kernel)."""
    backend = backend or build.gpu_backend()
    s = settings or decode_attention.SETTINGS[backend]
    quant = k_pages.quant
    B, H, D = q.shape
    _, n_kv, bs, _ = k_pages.shape
    dt, G = k_pages.dtype, H // n_kv
    sink_input = (build.device_constant(0.0, mx.float32) if sinks is None
                  else sinks if sinks.dtype == mx.float32 else sinks.astype(mx.float32))
    inputs = [q if q.dtype == dt else q.astype(dt), k_pages.packed, v_pages.packed, k_pages.scales, k_pages.biases,
              v_pages.scales, v_pages.biases, block_table, seq_lens, split_tokens,
              build.device_constant(scale, mx.float32), sink_input,
              written if written is not None else build.device_constant(0, mx.int32)]
    template, threads, mma = _launch(D, G, bs, dt, quant, int(window or 0), sinks is not None, backend, s)
    single, split = _kernels(backend, mma)
    grid = (n_kv * threads, B, splits)  # a thread group per (kv head, sequence, split): R = 1
    if splits == 1:
        return single(inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
                      output_shapes=[(B, H, D)], output_dtypes=[dt], init_value=init_value)[0]
    part_acc, part_m, part_l = split(
        inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
        output_shapes=[(splits, B, H, D), (splits, B, H), (splits, B, H)],
        output_dtypes=[mx.float32, mx.float32, mx.float32], init_value=init_value)
    return decode_attention.merge_kernel(backend)(
        inputs=[part_acc, part_m, part_l, sink_input],
        template=[("T", dt), ("D", D), ("SINKS", int(sinks is not None))],
        grid=(H * D, B, 1), threadgroup=(D, 1, 1), output_shapes=[(B, H, D)], output_dtypes=[dt],
        init_value=init_value)[0]
