"""A MoE layer's expert products as one launch each on CUDA (vLLM's fused MoE): the quantized GEMM kernel
(sources/quantized_gemm_cuda.py) with its GROUPED_ROWS prelude, over the step's (token, expert) pairs grouped by
expert.

Why: MLX's CUDA gather_qmm (0.32) multiplies each (token, expert) pair as a batch entry of its own: from 8 pairs on,
a 16-row tile of its tiled kernel (qmm_sm80) for one row, each reading its expert's weights. Here a thread block
takes up to BLOCK_ROWS pairs of one expert and reads that expert's weights once for all of them.

moe_align (vLLM's moe_align_block_size) groups the pairs on the device in one launch of its own kernel
(sources/fused_moe_cuda.py): no host sync, and shapes that depend only on the step's token count, so a compiled
decode step replays it."""

from __future__ import annotations

import functools
import itertools
from typing import NamedTuple, Optional, Sequence

import mlx.core as mx
import numpy as np

from pagedmlx import envs
from pagedmlx.kernels import build, check
from pagedmlx.kernels import quantized_gemm as qg
from pagedmlx.kernels.dialect import CUDA, render
from pagedmlx.kernels.sources import fused_moe_cuda as align_src
from pagedmlx.kernels.sources import quantized_gemm_cuda as src

BLOCK_ROWS = 8  # pairs a thread block takes: one 8-row tile (MT 1)
ALIGN_THREADS = 256  # moe_align's one thread block
WARPS = (2, 4)  # warps a block (16 columns each) below FEW_PAIRS pairs and from there: narrow products, few blocks
FEW_PAIRS = 64


def min_tokens() -> int:
    """The fewest tokens of a step that the kernel takes (PAGEDMLX_FUSED_MOE_MIN_TOKENS, at least 1); fewer keep
    gather_qmm (layers/fused_moe.py)."""
    return max(envs.PAGEDMLX_FUSED_MOE_MIN_TOKENS, 1)


def warps_for(pairs: int) -> int:
    """Warps a block for a product of `pairs` pairs: fewer where few blocks would leave most of the GPU idle."""
    return WARPS[0] if pairs < FEW_PAIRS else WARPS[1]


def max_blocks(pairs: int, num_experts: int) -> int:
    """Row blocks enough for any routing of `pairs` pairs: each expert used rounds its pairs up to a block."""
    return -(-pairs // BLOCK_ROWS) + min(num_experts, pairs)


class Blocks(NamedTuple):
    """A step's (token, expert) pairs grouped by expert (moe_align): ids (blocks * BLOCK_ROWS,) the pairs (t * k + j),
    each expert's from a block's start and -1 after them; experts (blocks,) each block's expert, -1 past the last;
    the row of x each slot reads: its token's (token_rows, the first products) or its own (pair_rows, the last), row 0
    for an empty slot (read, never written)."""

    ids: mx.array
    experts: mx.array
    token_rows: mx.array
    pair_rows: mx.array


@functools.lru_cache(maxsize=None)
def _one_token(k: int) -> tuple[mx.array, mx.array, mx.array]:
    ids = np.full((k, BLOCK_ROWS), -1, np.int32)
    ids[:, 0] = np.arange(k)
    ids = ids.reshape(-1)
    # From numpy: made now, not a lazy op that a compiled step's trace or another thread's stream would hold.
    return mx.array(ids), mx.array(np.zeros_like(ids)), mx.array(np.maximum(ids, 0))


def moe_align(indices: mx.array, num_experts: int) -> Blocks:
    """The Blocks of the experts (T, k) a step's tokens take: max_blocks of them, grouped in one launch (ALIGN_THREADS
    threads); k for one token, whose experts are distinct: a block each, no launch at all."""
    t, k = indices.shape
    if t == 1:
        ids, token_rows, pair_rows = _one_token(k)
        return Blocks(ids, indices.reshape(-1), token_rows, pair_rows)
    pairs = t * k
    slots, n_blocks = max_blocks(pairs, num_experts) * BLOCK_ROWS, max_blocks(pairs, num_experts)
    ids, token_rows, pair_rows, experts = _align_kernel()(
        inputs=[indices.reshape(-1)], template=_align_template(num_experts, k),
        grid=(ALIGN_THREADS, 1, 1), threadgroup=(ALIGN_THREADS, 1, 1),
        output_shapes=[(slots,), (slots,), (slots,), (n_blocks,)], output_dtypes=[mx.int32] * 4)
    return Blocks(ids, experts, token_rows, pair_rows)


@functools.lru_cache(maxsize=None)
def _align_kernel():
    return build.make_kernel(CUDA, "pagedmlx_moe_align", ["indices"],
                             ["ids", "token_rows", "pair_rows", "block_experts"], render(align_src.MOE_ALIGN, CUDA), "")


def _align_template(num_experts: int, k: int) -> list:
    return [("E", num_experts), ("BR", BLOCK_ROWS), ("K", k), ("THREADS", ALIGN_THREADS)]


@functools.lru_cache(maxsize=None)
def _kernel():
    return build.make_kernel(CUDA, "pagedmlx_fused_moe",
                             ["x", "w", "scales", "biases", "counters", "x_rows", "ids", "experts"], ["y", "partials"],
                             qg.quantized_gemm_source(src.GROUPED_ROWS), qg._header(),
                             shared_memory=qg.stages_for(1) * qg.x_slot_bytes(1))


def _template(dtype: mx.Dtype, bits: int, group_size: int, warps: int) -> list:
    return [("T", dtype), ("BITS", bits), ("GS", group_size), ("MT", 1), ("WN", warps), ("KS", 1),
            ("ST", qg.stages_for(1))]


def grouped_quantized_gemm(x: mx.array, w: mx.array, scales: mx.array, biases: mx.array, rows: mx.array,
                           ids: mx.array, experts: mx.array, pairs: int, bits: int, group_size: int) -> mx.array:
    """y (pairs, N): y[ids[s]] = x[rows[s]] @ dequantize(w[e], scales[e], biases[e]).T for each slot s of a block of
    expert e (a moe_align's Blocks: rows its token_rows or pair_rows), for x (rows, K) and MLX's affine (w, scales,
    biases) of E experts' (N, K) weights, as gather_qmm computes it up to the order of its float sums."""
    n, dtype, warps = w.shape[1], scales.dtype, warps_for(pairs)
    return _kernel()(
        inputs=[x.astype(dtype), w, scales, biases, qg._no_counters(), rows, ids, experts],
        template=_template(dtype, bits, group_size, warps),
        grid=(experts.shape[0] * 32 * warps, -(-n // (16 * warps)), 1), threadgroup=(32 * warps, 1, 1),
        output_shapes=[(pairs, n), (1,)], output_dtypes=[dtype, mx.float32])[0]


def supports(k: int, dtype: mx.Dtype, bits: int, group_size: int, mode: str = "affine") -> bool:
    """The kernel takes experts of this format (input width K): the quantized GEMM's."""
    return qg.supports(1, k, dtype, bits, group_size, mode)


def prebuild(shapes: Sequence[tuple[int, int, int, int]], dtype: mx.Dtype) -> None:
    """Compile into the disk cache at once the variants of these (N, K, bits, group_size) experts' products (experts
    of either index dtype: a one-token step's are the router's own)."""
    if hasattr(_kernel(), "prebuild"):
        inputs = [[(dtype, 2), (mx.uint32, 3), (dtype, 3), (dtype, 3)] + [(mx.int32, 1)] * 3 + [(expert_dtype, 1)]
                  for expert_dtype in (mx.int32, mx.uint32)]
        _kernel().prebuild([(ins, [dtype, mx.float32], _template(dtype, bits, gs, warps))
                            for _, _, bits, gs in shapes for warps in WARPS for ins in inputs])


def prebuild_align(routings: Sequence[tuple[int, int]]) -> None:
    """Compile moe_align's variants for these (experts, k) into the disk cache at once."""
    if hasattr(_align_kernel(), "prebuild"):
        _align_kernel().prebuild([([(mx.uint32, 1)], [mx.int32] * 4, _align_template(e, k)) for e, k in routings])


def check_fused_moe(shapes: Sequence[tuple[int, int, int, int]], top_k: int, dtype: mx.Dtype = mx.bfloat16,
                    tokens_checked: Sequence[int] = (1, 3, 37), seed: int = 0) -> Optional[str]:
    """The kernel against each expert's dequantized weights multiplied in float32 (quantized_gemm.reference_product)
    for each (N, K, bits, group_size) experts' product of the model's, over top_k + 1 experts of those widths with
    top_k taken a token at random, as the first products (a token's row) and the last (a pair's row), for each token
    count (37 tokens: an expert's pairs past one block; at top_k 4, fewer and more than FEW_PAIRS pairs). None if
    every output agrees within the dtype's tolerance, else what differs."""
    try:
        return _check(shapes, top_k, dtype, tokens_checked, seed)
    except Exception as exc:  # compilation or launch: MLX raises when the kernel is built or run
        return f"did not compile or run ({check.error_line(exc)})"


def _check(shapes, top_k, dtype, tokens_checked, seed) -> Optional[str]:
    n_experts = top_k + 1
    prebuild(shapes, dtype)
    prebuild_align([(n_experts, top_k)])
    keys = iter(mx.random.split(mx.random.key(seed), len(shapes) * (1 + 4 * len(tokens_checked))))
    for n, k, bits, group_size in shapes:
        w, scales, biases = mx.quantize(mx.random.normal((n_experts, n, k), dtype, scale=k ** -0.5, key=next(keys)),
                                        group_size=group_size, bits=bits)
        references = [qg.reference_product(w[e], scales[e], biases[e], bits, group_size) for e in range(n_experts)]
        for tokens, per_row in itertools.product(tokens_checked, (top_k, 1)):
            route = mx.argsort(mx.random.uniform(shape=(tokens, n_experts), key=next(keys)), axis=-1)[:, :top_k]
            x = mx.random.normal((tokens * top_k // per_row, k), dtype, key=next(keys))
            b = moe_align(route, n_experts)
            got = grouped_quantized_gemm(x, w, scales, biases, b.token_rows if per_row > 1 else b.pair_rows, b.ids,
                                         b.experts, tokens * top_k, bits, group_size).astype(mx.float32)
            flat = np.array(route).reshape(-1)
            want = mx.zeros(got.shape, mx.float32)
            for e in range(n_experts):
                if (pairs := np.nonzero(flat == e)[0]).size:
                    want[mx.array(pairs)] = references[e](x[mx.array(pairs // per_row)])
            if why := qg.disagreement(got, want, dtype, f"{tokens} tokens x {top_k} of {n_experts} experts, {k} @ {n} "
                                      f"x {k}, {bits}-bit, group size {group_size}"):
                return why
    return None
