"""The kernels' checks against the portable path, run at load (selector.select_kernels) and by
`pagedmlx doctor`: paged decode against the gather path (windows, sinks, splits), the page write
against a scatter with a read of its pages in the same graph, and paged prefill against a float64
reference. Each yields (check, ok, detail); a kernel that fails to build or run fails its check.
"""

from __future__ import annotations

from typing import ContextManager, Optional

import mlx.core as mx
import numpy as np

from pagedmlx.kernels import decode_attention, decode_attention_quant, disk_cache, page_write, prefill_attention
from pagedmlx.core.kv.cache_dtype import KVQuant
from pagedmlx.runner.attention import gather_decode
from pagedmlx.runner.kv_quant import QuantizedPages
from pagedmlx.runner.prefill_indices import Segment, prefill_tile_indices
from pagedmlx.runner.masks import length_mask
from pagedmlx.runner.thread_flag import ThreadFlag

TOLERANCE = {mx.float32: 2e-3, mx.float16: 2e-2, mx.bfloat16: 4e-2}

Shape = tuple[int, int, int, mx.Dtype]  # (query heads, kv heads, head_dim, dtype)


def run_checks(backend: str, shapes: list[Shape], block_size: int, page_write: bool,
               windows: tuple[Optional[int], ...] = (None,), sinks: tuple[bool, ...] = (False,),
               prefill_shapes: tuple[Shape, ...] = ()):
    """Yields (check, ok, detail) per check; stops after the first failure."""
    for (h, n_kv, d, dt), window, with_sinks in [(x, w, s) for x in prefill_shapes for w in windows for s in sinks]:
        name = f"prefill H={h} kv={n_kv} D={d} {_dtype_name(dt)}" + (f" window={window}" if window else "") + \
            (" sinks" if with_sinks else "")
        ok, detail = _guarded(check_prefill, h, n_kv, d, dt, block_size, window, with_sinks)
        yield name, ok, detail
        if not ok:
            return
    cases = [(shape, w, s) for shape in shapes for w in windows for s in sinks]
    for (h, n_kv, d, dt), window, with_sinks in cases:
        name = f"decode H={h} kv={n_kv} D={d} {_dtype_name(dt)}" + (f" window={window}" if window else "") + \
            (" sinks" if with_sinks else "")
        ok, detail = _guarded(check_decode, backend, h, n_kv, d, dt, block_size, window, with_sinks)
        yield name, ok, detail
        if not ok:
            return
    if page_write:
        for h, n_kv, d, dt in shapes or [(1, 1, 64, mx.float16)]:
            ok, detail = _guarded(check_page_write, backend, h, n_kv, d, dt, block_size)
            yield f"page write kv={n_kv} D={d} {_dtype_name(dt)}", ok, detail
            if not ok:
                return


_replaying = ThreadFlag()  # inside passed_before() (this thread): every check counts as passed, unrun


def passed_before() -> ContextManager[None]:
    """Checks that passed here before (runner/check_cache.py) count as passed without running, in this thread, so
    that a selector decides as it did then, check for check."""
    return _replaying.scope()


def _guarded(check, *args, **kwargs) -> tuple[bool, str]:
    if _replaying.on:
        return True, "ok"
    try:
        err = check(*args, **kwargs)
    except Exception as exc:  # compilation or launch: MLX raises when the kernel is built or run
        err = f"did not compile or run ({error_line(exc)})"
    if disk_cache.collecting():  # a dry pass (disk_cache.prebuild_met): no kernel ran, every check goes on
        return True, "ok"
    return err is None, err or "ok"


def error_line(exc: Exception) -> str:
    """The exception's type and first line, for a warning (a compiler's message runs to pages)."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}"


def _dtype_name(dtype: mx.Dtype) -> str:
    return str(dtype).split(".")[-1]


def _random_pages(rng, num_blocks: int, n_kv: int, bs: int, d: int, dtype: mx.Dtype):
    k = mx.array(rng.standard_normal((num_blocks, n_kv, bs, d)).astype(np.float32)).astype(dtype)
    v = mx.array(rng.standard_normal((num_blocks, n_kv, bs, d)).astype(np.float32)).astype(dtype)
    return k, v


def _compare(got: mx.array, want: mx.array, dtype: mx.Dtype) -> Optional[str]:
    if disk_cache.collecting():  # a dry pass's zeros: each check goes on to its next launch (its split ones)
        return None
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    err = mx.abs(got - want).max().item()
    tol = TOLERANCE[dtype] * max(1.0, mx.abs(want).max().item())
    return None if np.isfinite(err) and err <= tol else f"max |difference| {err:.2e} > {tol:.1e}"


def check_decode(backend: str, h: int, n_kv: int, d: int, dtype: mx.Dtype, bs: int,
                 window: Optional[int] = None, sinks: bool = False, seed: int = 0) -> Optional[str]:
    """Decode rows of lengths around block boundaries and a long one, unsplit and split in 3 (its
    boundaries fall inside blocks), against the gather path in float32. None if all agree."""
    rng = np.random.default_rng(seed)
    lens = np.array([1, bs, bs + 1, 3 * bs + 5, 8 * bs + 3], np.int32)
    nb = -(-int(lens.max()) // bs)
    k_pages, v_pages = _random_pages(rng, len(lens) * nb + 2, n_kv, bs, d, dtype)
    table = mx.array(rng.permutation(len(lens) * nb + 2)[: len(lens) * nb].reshape(len(lens), nb).astype(np.int32))
    seq_lens = mx.array(lens)
    q = mx.array(rng.standard_normal((len(lens), h, d)).astype(np.float32)).astype(dtype)
    sink = mx.array(rng.standard_normal(h).astype(np.float32) * 2) if sinks else None
    scale = d ** -0.5
    want = gather_decode(q.astype(mx.float32), k_pages.astype(mx.float32), v_pages.astype(mx.float32), table, scale,
                         length_mask(seq_lens, nb * bs, window), sink)
    span = int(min(lens.max(), window or lens.max()))
    for splits in (1, 3):
        tokens = -(-span // splits)
        got = decode_attention.paged_decode(q, k_pages, v_pages, table, seq_lens, scale, -(-span // tokens),
                                         mx.array([tokens], mx.int32), window=window, sinks=sink,
                                         init_value=float("nan"), backend=backend)
        err = _compare(got, want, dtype)
        if err:
            return f"{err} ({splits} split{'s' if splits > 1 else ''})"
    return None


def check_decode_quantized(backend: str, h: int, n_kv: int, d: int, dtype: mx.Dtype, quant: KVQuant, bs: int,
                           window: Optional[int] = None, sinks: bool = False, seed: int = 0,
                           settings: Optional[decode_attention.Settings] = None) -> Optional[str]:
    """check_decode for the quantized decode kernel (on tensor cores where CUDA runs them, unless `settings`
    say otherwise): the same lengths and splits over int8 / int4 pages, against the gather path over the same
    pages dequantized to float32."""
    rng = np.random.default_rng(seed)
    lens = np.array([1, bs, bs + 1, 3 * bs + 5, 8 * bs + 3], np.int32)
    nb = -(-int(lens.max()) // bs)
    pages = [QuantizedPages(*mx.quantize(x, group_size=quant.group_size, bits=quant.bits), quant)
             for x in _random_pages(rng, len(lens) * nb + 2, n_kv, bs, d, dtype)]
    full = [mx.dequantize(p.packed, p.scales.astype(mx.float32), p.biases.astype(mx.float32), quant.group_size,
                          quant.bits) for p in pages]
    table = mx.array(rng.permutation(len(lens) * nb + 2)[: len(lens) * nb].reshape(len(lens), nb).astype(np.int32))
    seq_lens = mx.array(lens)
    q = mx.array(rng.standard_normal((len(lens), h, d)).astype(np.float32)).astype(dtype)
    sink = mx.array(rng.standard_normal(h).astype(np.float32) * 2) if sinks else None
    want = gather_decode(q.astype(mx.float32), *full, table, d ** -0.5, length_mask(seq_lens, nb * bs, window), sink)
    span = int(min(lens.max(), window or lens.max()))
    for splits in (1, 3):
        tokens = -(-span // splits)
        got = decode_attention_quant.paged_decode_quantized(
            q, *pages, table, seq_lens, d ** -0.5, -(-span // tokens), mx.array([tokens], mx.int32), window=window,
            sinks=sink, init_value=float("nan"), settings=settings, backend=backend)
        err = _compare(got, want, dtype)
        if err:
            return f"{err} ({splits} split{'s' if splits > 1 else ''})"
    return None


def check_page_write(backend: str, h: int, n_kv: int, d: int, dtype: mx.Dtype, bs: int, seed: int = 0) -> Optional[str]:
    """The page write against a numpy scatter (skipped slots included), and a decode read of the
    pages in the same graph, ordered by `written`, that must see the new keys."""
    rng = np.random.default_rng(seed)
    num_blocks, B = 6, 3
    k_pages, v_pages = _random_pages(rng, num_blocks, n_kv, bs, d, dtype)
    mx.eval(k_pages, v_pages)
    want_k, want_v = np.array(k_pages.astype(mx.float32)), np.array(v_pages.astype(mx.float32))
    table = mx.array(rng.permutation(num_blocks)[: 2 * B].reshape(B, 2).astype(np.int32))
    lens = np.array([1, bs + 1, 2 * bs], np.int32)
    slots = np.array([int(table[b, (n - 1) // bs].item()) * bs + (n - 1) % bs for b, n in enumerate(lens)] + [-1],
                     np.int32)
    keys = mx.array(rng.standard_normal((B + 1, n_kv, 1, d)).astype(np.float32) * 3).astype(dtype)
    values = mx.array(rng.standard_normal((B + 1, n_kv, 1, d)).astype(np.float32) * 3).astype(dtype)
    for i, s in enumerate(slots[:B]):
        want_k[s // bs, :, s % bs] = np.array(keys[i, :, 0].astype(mx.float32))
        want_v[s // bs, :, s % bs] = np.array(values[i, :, 0].astype(mx.float32))
    written = page_write.reshape_and_cache(keys, values, k_pages, v_pages, mx.array(slots), backend=backend)
    q = mx.array(rng.standard_normal((B, h, d)).astype(np.float32)).astype(dtype)
    seq_lens = mx.array(lens)
    got = decode_attention.paged_decode(q, k_pages, v_pages, table, seq_lens, d ** -0.5, 1,
                                     mx.array([2 * bs], mx.int32), written, init_value=float("nan"), backend=backend)
    mx.eval(got)
    if not (np.array_equal(np.array(k_pages.astype(mx.float32)), want_k)
            and np.array_equal(np.array(v_pages.astype(mx.float32)), want_v)):
        return "the pages differ from a scatter of the same rows"
    want = gather_decode(q.astype(mx.float32), mx.array(want_k), mx.array(want_v), table, d ** -0.5,
                         length_mask(seq_lens, 2 * bs))
    err = _compare(got, want, dtype)
    return None if err is None else f"a read in the same graph missed the write ({err})"


def _raw(a: mx.array) -> np.ndarray:
    """An array's bits (numpy has no bfloat16): uint32 words, or the scales' 16 / 32 bits as unsigned ints."""
    return np.array(a if a.dtype == mx.uint32 else a.view({2: mx.uint16, 4: mx.uint32}[a.dtype.size]))


def check_page_write_quantized(backend: str, h: int, n_kv: int, d: int, dtype: mx.Dtype, quant: KVQuant, bs: int,
                               seed: int = 0, quantizing: bool = False, quantize=None) -> Optional[str]:
    """The quantized page write against a numpy scatter of mx.quantize's parts of the same rows (bit for bit,
    skipped slots included), and a decode read of the pages in the same graph, ordered by `written`, that
    must see the new rows (the quantized decode kernel where it takes the shape, else the gather path).
    quantizing: the write that quantizes the rows itself (page_write.reshape_and_cache_quantizing), on rows
    that include groups all negative, all zero, constant and tiny; else the one that copies mx.quantize's
    parts (reshape_and_cache_quantized). quantize: what makes the reference parts of a (rows, n_kv, d)
    array (default mx.quantize on the device)."""
    rng = np.random.default_rng(seed)
    num_blocks, B = 6, 3
    quantize = quantize or (lambda x: mx.quantize(x, group_size=quant.group_size, bits=quant.bits))
    pages = [quantize(x) for x in _random_pages(rng, num_blocks, n_kv, bs, d, dtype)]
    mx.eval(pages)
    want = [[_raw(a) for a in side] for side in pages]
    table = mx.array(rng.permutation(num_blocks)[: 2 * B].reshape(B, 2).astype(np.int32))
    lens = np.array([1, bs + 1, 2 * bs], np.int32)
    slots = np.array([int(table[b, (n - 1) // bs].item()) * bs + (n - 1) % bs for b, n in enumerate(lens)] + [-1],
                     np.int32)
    rows = [_rows_to_quantize(rng, B + 1, n_kv, d, quant.group_size, hard=quantizing).astype(dtype) for _ in range(2)]
    new = [quantize(x) for x in rows]
    for side, parts in zip(want, new):
        for page, part in zip(side, parts):
            for i, s in enumerate(slots[:B]):
                page[s // bs, :, s % bs] = _raw(part)[i]
    if quantizing:
        written = page_write.reshape_and_cache_quantizing(rows[0][:, :, None], rows[1][:, :, None], *pages,
                                                          mx.array(slots), quant, backend=backend)
    else:
        written = page_write.reshape_and_cache_quantized(*new, *pages, mx.array(slots), backend=backend)
    q = mx.array(rng.standard_normal((B, h, d)).astype(np.float32)).astype(dtype)
    seq_lens = mx.array(lens)
    read = [QuantizedPages(*side, quant) for side in pages]
    if decode_attention_quant.refusal(d, d, h, n_kv, dtype, quant, backend) is None:
        got = decode_attention_quant.paged_decode_quantized(q, *read, table, seq_lens, d ** -0.5, 1,
                                                            mx.array([2 * bs], mx.int32), written,
                                                            init_value=float("nan"), backend=backend)
    else:  # the gather path's read, ordered by `written` the same way
        got = gather_decode(q, *read, table, d ** -0.5, length_mask(seq_lens, 2 * bs), written=written)
    mx.eval(got)
    for side, wside, name in zip(pages, want, ("keys", "values")):
        for a, w, part in zip(side, wside, ("packed values", "scales", "biases")):
            if not np.array_equal(_raw(a), w):
                n = int(np.sum(_raw(a) != w))
                return (f"the pages' {name} {part} differ from a scatter of mx.quantize's parts of the same rows "
                        f"({n} of {w.size})")
    full = [mx.dequantize(mx.array(w[0]), mx.array(w[1]).view(dtype).astype(mx.float32),
                          mx.array(w[2]).view(dtype).astype(mx.float32), quant.group_size, quant.bits) for w in want]
    err = _compare(got, gather_decode(q.astype(mx.float32), *full, table, d ** -0.5, length_mask(seq_lens, 2 * bs)),
                   dtype)
    return None if err is None else f"a read in the same graph missed the write ({err})"


def _rows_to_quantize(rng, n: int, n_kv: int, d: int, group_size: int, hard: bool) -> mx.array:
    """(n, n_kv, d) float32 rows; hard: the first rows' groups all negative, all zero, constant, tiny
    (each an edge of the affine quantizer: which end the bias takes, a scale at its floor)."""
    x = rng.standard_normal((n, n_kv, d)).astype(np.float32) * 3
    if hard:
        g = group_size
        x[0, :, :g] = -np.abs(x[0, :, :g]) - 0.5
        x[1, :, d - g:] = 0
        x[0, -1, d - g:] = 1.25
        x[2, 0, :g] *= 1e-9
    return mx.array(x)


def prefill_reference(q: np.ndarray, k_pages: np.ndarray, v_pages: np.ndarray, segments: list[Segment],
                      scale: float, window: Optional[int] = None, sinks: Optional[np.ndarray] = None) -> np.ndarray:
    """Causal attention of each segment's queries (rows of q (Tp, H, D)) over its keys read from
    its pages, in float64: what the prefill kernel computes. Segment rows count from q's first."""
    Tp, H, D = q.shape
    n_kv, bs = k_pages.shape[1], k_pages.shape[2]
    out = np.zeros((Tp, H, v_pages.shape[-1]))
    for seg in segments:
        keys = np.arange(seg.key_offset, seg.first_pos + seg.n)
        pages = seg.pages[(keys - seg.key_offset) // bs]
        k = k_pages[pages, :, keys % bs].astype(np.float64).repeat(H // n_kv, axis=1)  # (K, H, D)
        v = v_pages[pages, :, keys % bs].astype(np.float64).repeat(H // n_kv, axis=1)
        pos = seg.first_pos + np.arange(seg.n)
        see = keys[None, :] <= pos[:, None]
        if window:
            see &= keys[None, :] > pos[:, None] - window
        s = np.einsum("qhd,khd->hqk", q[seg.row:seg.row + seg.n].astype(np.float64), k) * scale
        s = np.where(see[None], s, -np.inf)
        m = s.max(-1, keepdims=True)
        if sinks is not None:
            m = np.maximum(m, sinks[:, None, None])
        p = np.exp(s - m)
        denom = p.sum(-1, keepdims=True) + (np.exp(sinks[:, None, None] - m) if sinks is not None else 0)
        out[seg.row:seg.row + seg.n] = np.einsum("hqk,khd->qhd", p / denom, v)
    return out


def random_segments(rng, shapes: list[tuple[int, int]], bs: int,
                    window: Optional[int] = None) -> tuple[list[Segment], int, int]:
    """Prefill segments of (prefix, new tokens), one after another in the rows, each on pages of its
    own in random order, from the page of its first key (under a window) on. Returns (segments,
    rows, pages in the pool)."""
    nb = max(-(-(p + n) // bs) for p, n in shapes)
    num_blocks = len(shapes) * nb + 2
    perm = rng.permutation(num_blocks).astype(np.int32)
    segments, row = [], 0
    for i, (prefix, n) in enumerate(shapes):
        first_block = (0 if not window else max(0, prefix - window + 1)) // bs
        pages = perm[i * nb:(i + 1) * nb][first_block:-(-(prefix + n) // bs)]
        segments.append(Segment(row, n, prefix, first_block * bs, prefix + n - first_block * bs, pages))
        row += n
    return segments, row, num_blocks


def check_prefill(h: int, n_kv: int, d: int, dtype: mx.Dtype, bs: int, window: Optional[int] = None,
                  sinks: bool = False, seed: int = 0, quant: Optional[KVQuant] = None) -> Optional[str]:
    """Prefill segments of 1 to 70 new tokens after prefixes of 0 to 9 blocks and a few (tile,
    page and split boundaries inside them), unsplit and split, against prefill_reference. quant: over
    quantized pages (mx.quantize of random ones), against the reference over their dequantized values."""
    rng = np.random.default_rng(seed)
    shapes = [(0, 1), (0, 17), (bs - 1, 5), (3 * bs + 2, 40), (9 * bs + 5, 70), (bs, 16)]  # (prefix, new tokens)
    segments, row, num_blocks = random_segments(rng, shapes, bs, window)
    k_pages, v_pages = _random_pages(rng, num_blocks, n_kv, bs, d, dtype)
    q = rng.standard_normal((row, h, d)).astype(np.float32)
    sink = rng.standard_normal(h).astype(np.float32) * 2 if sinks else None
    scale = d ** -0.5
    if quant is not None:
        k_pages, v_pages = (QuantizedPages(*mx.quantize(p, group_size=quant.group_size, bits=quant.bits), quant)
                            for p in (k_pages, v_pages))
    kf, vf = (np.array(p.astype(mx.float32)) if quant is None else
              np.array(mx.dequantize(p.packed, p.scales, p.biases, quant.group_size, quant.bits).astype(mx.float32))
              for p in (k_pages, v_pages))
    qd = mx.array(q).astype(dtype)
    want = mx.array(prefill_reference(np.array(qd.astype(mx.float32)), kf, vf, segments, scale, window, sink)
                    .astype(np.float32))
    host, splits = prefill_tile_indices(segments, 0, window, n_kv, h // n_kv)
    dev = {k: mx.array(v) for k, v in host.items()}
    for forced in (None, 3):
        if forced:
            keys = (int(host["prefill_split_tokens"][0]) if splits == 1
                    else splits * int(host["prefill_split_tokens"][0]))
            dev["prefill_split_tokens"] = mx.array([-(-keys // forced)], mx.int32)
        got = prefill_attention.paged_prefill(qd, k_pages, v_pages, dev["prefill_block_table"], dev["prefill_segs"],
                                          dev["prefill_tiles"], scale, forced or splits, dev["prefill_split_tokens"],
                                          window=window, sinks=None if sink is None else mx.array(sink),
                                          init_value=float("nan"))
        err = _compare(got, want, dtype)
        if err:
            return f"{err} ({forced or splits} split{'s' if (forced or splits) > 1 else ''})"
    return None
