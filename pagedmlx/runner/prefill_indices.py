"""Host arrays for prefill attention: a step's prefill segments (one request's chunk each), the index
arrays of one SDPA group of them (attention_metadata.PrefillGroup), and the paged prefill kernel's
16-token tiles (attention_metadata.PrefillTiles)."""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from pagedmlx.kernels import prefill_attention
from pagedmlx.core.kv.spec import cdiv


class Segment(NamedTuple):
    """One request's prefill chunk in a step (host side)."""

    row: int  # its first row in the batch
    n: int  # new tokens
    first_pos: int  # position of the first
    key_offset: int  # position of the first key it reads (0, or a page boundary before its window)
    num_keys: int  # keys from key_offset to its last new token
    pages: np.ndarray  # the pages holding them


def group_indices(members: list[tuple[Segment, int]], Lq: int, K: int, P: int, block_size: int,
                   nd: int) -> dict[str, np.ndarray]:
    """A prefill group's host arrays: members (segment, front padding) fill its first segments, P
    in all (added ones read page 0 and prefill row 0). A padding slot repeats its segment's first
    or last query row; for explicit masks its position is the prefix position before the segment
    (front) or the last query's (back), so that every slot sees at least one key."""
    tables = np.zeros((P, cdiv(K, block_size)), np.int32)
    rows = np.zeros((P, Lq), np.int32)
    slots = np.arange(Lq)
    query_pos = np.tile(slots, (P, 1)).astype(np.int32)
    key_offset = np.zeros(P, np.int32)
    out = []
    for p, (seg, front) in enumerate(members):
        tables[p, :len(seg.pages)] = seg.pages
        rows[p] = seg.row - nd + np.clip(slots - front, 0, seg.n - 1)
        query_pos[p] = seg.first_pos + np.minimum(slots - front, seg.n - 1)
        key_offset[p] = seg.key_offset
        out.append(p * Lq + front + np.arange(seg.n))
    return dict(block_table=tables, query_rows=rows.reshape(-1), out_rows=np.concatenate(out),
                query_pos=query_pos, key_offset=key_offset)


def prefill_tile_indices(segments: list[Segment], nd: int, window: Optional[int], n_kv_heads: int,
                         group: int) -> tuple[dict[str, np.ndarray], int]:
    """The prefill kernel's host arrays (PrefillTiles' fields) and its number of splits. A tile's
    keys run from its first token's first key (key_offset without a window) to its last token."""
    table = np.zeros((len(segments), max(len(seg.pages) for seg in segments)), np.int32)
    segs = np.zeros((len(segments), 4), np.int32)
    tiles, keys = [], []
    for i, seg in enumerate(segments):
        table[i, :len(seg.pages)] = seg.pages
        segs[i] = (seg.row - nd, seg.n, seg.first_pos, seg.key_offset)
        tok0 = np.arange(0, seg.n, prefill_attention.PREFILL_TILE)
        hi = seg.first_pos + np.minimum(seg.n, tok0 + prefill_attention.PREFILL_TILE)
        lo = seg.key_offset if window is None else np.maximum(seg.key_offset, seg.first_pos + tok0 - window + 1)
        tiles.append(np.stack([np.full_like(tok0, i), tok0], axis=1))
        keys.append(hi - lo)
    keys = np.concatenate(keys)
    order = np.argsort(-keys, kind="stable")  # the longest tiles start first
    splits, tokens = prefill_attention.prefill_splits(len(keys), n_kv_heads, group, int(keys.max()))
    return dict(prefill_block_table=table, prefill_segs=segs, prefill_tiles=np.concatenate(tiles)[order],
                prefill_split_tokens=np.array([tokens], np.int32)), splits


def prefill_order(order: list[Segment]) -> np.ndarray:
    """For each prefill row in batch order, its index among the groups' outputs, which hold the
    segments in `order`."""
    at, where = 0, {}
    for seg in order:
        where[seg.row] = (at, seg.n)
        at += seg.n
    return np.concatenate([np.arange(where[r][0], where[r][0] + where[r][1]) for r in sorted(where)])
