"""Batched LoRA in one kernel a layer (vLLM's punica bgmv shrink + expand), on CUDA and Metal, from one
source (sources/lora.py, in the portable dialect): each row adds its own adapter's scaled low-rank
product to the base layer's output, slot 0 adding nothing.

MLX's own ops need four launches a layer for the same (lora/layers.py: the stacked products, the
column mask, the scaled add); on the H200 those took 58 us a Llama-8B projection at 64 rows against
26 us for the projection itself, because each tiny product
is launch-bound. Where it runs is decided at load (check_add_lora against the stacked path).

Projections of one input (q/k/v, gate/up: siblings, lora/layers.py) run as one launch of add_lora_siblings:
each group takes a tile of one of them. On the H200 a launch cost about 9 us (MLX's dispatch and the
launch) whatever it computed, so launches, not
products, set what adapters add to a step."""

from __future__ import annotations

import functools
from typing import Optional

import mlx.core as mx
import numpy as np

from pagedmlx.kernels import build
from pagedmlx.kernels.dialect import render
from pagedmlx.kernels.sources import lora as src

THREADS = 256  # a group's (sources/lora.py)
GROUPS = 128  # groups a launch aims at (about one a streaming multiprocessor of an H100 / H200)
# Rows a launch takes: each row reads its adapter's A and B (R * (IN + OUT) values, from L2) once per
# tile, so the kernel's traffic grows with the rows while the stacked products' (lora/layers.py: two
# small GEMMs, a mask and a scaled add) barely do. Decode steps fit; long prefill steps take MLX's products.
MAX_ROWS = 512


def tiles_for(rows: int, out_dims: int) -> int:
    """Groups a row (tiles of its output columns). Each recomputes the row's shrink, R * IN reads of A
    from L2, so a row takes as few as keep ~GROUPS groups busy: 2 at 64 rows, 1 from 128, OUT / 256 at 1."""
    return max(1, min(-(-out_dims // THREADS), -(-GROUPS // rows)))


def lora_prelude(n: int) -> str:
    """The kernel's first lines for a launch of n sibling projections: the projection m whose tile the
    group takes (tiles of projection m start at group START{m}), and its arrays and widths by the
    names the body reads."""
    def pick(name: str) -> str:
        expr = f"{name}{n - 1}"
        for m in range(n - 2, -1, -1):
            expr = f"(m == {m} ? {name}{m} : {expr})"
        return expr

    which = " + ".join(f"(GROUP_X >= START{k})" for k in range(1, n))
    return ((f"    const int m = {which};\n" if n > 1 else "")
            + "".join(f"    const int {c} = {pick(c)};\n" for c in ("OUT", "CHUNK", "YS", "YOFF"))
            + f"    const int tile = GROUP_X - {pick('START').replace('START0', '0')};\n"
            + "".join(f"    auto {a} = {pick(a)};\n" for a in ("y", "out", "lora_a", "lora_b")))


def add_lora_source(backend: str, n: int = 1) -> str:
    return render(lora_prelude(n) + src.ADD_LORA, backend)


@functools.lru_cache(maxsize=None)
def _kernel(backend: str, n: int = 1):
    inputs = ["x", *(f"{a}{m}" for a in ("y", "lora_a", "lora_b") for m in range(n)), "indices", "scales"]
    return build.make_kernel(backend, f"pagedmlx_add_lora{n}", inputs, [f"out{m}" for m in range(n)],
                             add_lora_source(backend, n), render(src.HEADER, backend))


def add_lora(x: mx.array, y: mx.array, lora_a: mx.array, lora_b: mx.array, indices: mx.array, scales: mx.array,
             backend: Optional[str] = None, tiles: Optional[int] = None) -> mx.array:
    """y + scales[s] * ((x @ lora_a[s].T) @ lora_b[s]) for each row with slot s = indices[row] (y where s is 0).
    x (T, IN), y (T, OUT) in the activations' dtype; lora_a (S, R, IN), lora_b (S, R, OUT); indices (T,)
    int32; scales (S,) float32. tiles: groups a row (default tiles_for's)."""
    return add_lora_siblings(x, [y], [lora_a], [lora_b], indices, scales, backend, tiles)[0]


def add_lora_siblings(x: mx.array, ys: list, lora_as: list, lora_bs: list, indices: mx.array, scales: mx.array,
                      backend: Optional[str] = None, tiles: Optional[int] = None,
                      y_parts: Optional[list] = None) -> list:
    """add_lora for projections of the same x in one launch: [add_lora(x, ys[m], lora_as[m], lora_bs[m], ...)],
    each output as add_lora's alone (same arithmetic). The stacks share their slots and rank. y_parts[m]:
    (first column, width) of projection m's base output in ys[m], a merged product (layers/merged_linear.py)
    read in place; None (or y_parts None): all of ys[m]."""
    rows, in_dims = x.shape
    parts = [p or (0, y.shape[1]) for p, y in zip(y_parts or [None] * len(ys), ys)]
    outs = [w for _, w in parts]
    vec = 16 // x.dtype.size  # elements a 16-byte load; a width that is no multiple is read one at a time
    vin = vec if in_dims % vec == 0 else 1
    vout = vec if all(n % vec == 0 for (off, w), y in zip(parts, ys) for n in (off, w, y.shape[1])) else 1
    step = THREADS * vout
    template = [("T", x.dtype), ("IN", in_dims), ("R", lora_as[0].shape[1]), ("VIN", vin), ("VOUT", vout)]
    groups = 0  # along x: every projection's tiles, one after the other
    for m, out_dims in enumerate(outs):
        chunk = -(-out_dims // ((tiles or tiles_for(rows, out_dims)) * step)) * step  # output columns a group
        template += [(f"OUT{m}", out_dims), (f"CHUNK{m}", chunk), (f"YS{m}", ys[m].shape[1]),
                     (f"YOFF{m}", parts[m][0])] + ([(f"START{m}", groups)] if m else [])
        groups += -(-out_dims // chunk)
    return _kernel(backend or build.gpu_backend(), len(ys))(
        inputs=[x, *ys, *lora_as, *lora_bs, indices, scales], template=template,
        grid=(groups * THREADS, rows, 1), threadgroup=(THREADS, 1, 1),
        output_shapes=[(rows, o) for o in outs], output_dtypes=[ys[0].dtype] * len(ys))


def check_add_lora(backend: str, dtype: mx.Dtype = mx.bfloat16, seed: int = 0) -> Optional[str]:
    """The kernel against the same products in float64 (numpy) on random cases: rows of three adapters and
    of none, ranks padded with zeros, output widths that are no multiple of the tile; one projection at
    three tilings, then three siblings of different widths in one launch (widths that take 16-byte loads
    and widths that do not), then siblings read in place as parts of one merged product. None if every output
    agrees within the dtype's tolerance, else what differs."""
    rng = np.random.default_rng(seed)
    rows, in_dims, slots, rank = 9, 600, 4, 20  # ranks in two chunks, rows and tiles partial
    idx = np.array([0, 1, 2, 3, 1, 0, 3, 3, 2], np.int32)
    scales = np.array([0, 2.0, 0.5, 1.25], np.float32)
    x = rng.standard_normal((rows, in_dims)) / 4
    cases = [((1300,), tiles, False) for tiles in sorted({1, 2, tiles_for(rows, 1300)})]  # tiles of 1300, 768, 256
    cases += [((1300, 520, 264), None, False), ((1024, 256, 520), 1, False)]
    cases += [((1024, 256, 256), None, True), ((1300, 520, 264), 1, True)]  # parts of one merged product, in place
    for outs, tiles, merged in cases:
        ys = [rng.standard_normal((rows, o)) for o in outs]
        starts = np.cumsum([0, *outs[:-1]]).tolist()
        a = [rng.standard_normal((slots, rank, in_dims)) / 8 for _ in outs]
        b = [rng.standard_normal((slots, rank, o)) / 2 for o in outs]
        for am, bm in zip(a, b):
            am[0], bm[0], am[2, 5:], bm[2, 5:] = 0, 0, 0, 0  # slot 0 empty; slot 2 of rank 5
        args = [[mx.array(v.astype(np.float32)).astype(dtype) for v in vs] for vs in ([x], ys, a, b)]
        inputs, parts = args[1], None
        if merged:
            inputs, parts = [mx.concatenate(args[1], axis=1)] * len(outs), list(zip(starts, outs))
        got = add_lora_siblings(args[0][0], inputs, *args[2:], mx.array(idx), mx.array(scales), backend=backend,
                                tiles=tiles, y_parts=parts)
        for m, (y, am, bm, out) in enumerate(zip(args[1], a, b, got)):
            where = (f"({len(outs)} projections{', parts of one product' if merged else ''}, the {m}th {outs[m]} "
                     f"wide, {tiles or 'default'} groups a row)")
            want = ys[m] + scales[idx, None] * np.einsum("tr,tro->to", np.einsum("ti,tri->tr", x, am[idx]), bm[idx])
            out = np.array(out.astype(mx.float32))
            if not np.array_equal(out[idx == 0], np.array(y.astype(mx.float32))[idx == 0]):
                return f"rows without an adapter differ from the base output {where}"
            tol = {mx.float32: 1e-4, mx.float16: 1e-2, mx.bfloat16: 4e-2}[dtype]
            err = float(np.max(np.abs(out - want)) / (np.max(np.abs(want)) + 1e-6))
            if not (np.isfinite(err) and err <= tol):
                return f"max relative difference {err:.2e} > {tol:.0e} {where}"
    return None
