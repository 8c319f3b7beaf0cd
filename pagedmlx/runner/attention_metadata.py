"""The step's attention metadata: index tensors built on the host once per KV cache group (vLLM's
attention metadata builders), uploaded in one array, and the masks built from them on the device.

A sliding-window group's decode rows get block tables cut to their window's pages. Prefill segments
(one request's chunk each) are attended by the paged prefill kernel where it runs (CUDA): all of
them in one launch, cut into 16-token tiles (PrefillTiles). Elsewhere in groups, one attention call
per group: long segments of the same padded shape together, with MLX's fused causal attention over
exactly their keys; short ones padded to the longest, under one mask."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from pagedmlx.core.kv.spec import cdiv
from pagedmlx.kernels import decode_attention, prefill_attention
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.runner.masks import causal_mask, length_mask
from pagedmlx.runner.prefill_indices import Segment, group_indices, prefill_order, prefill_tile_indices
from pagedmlx.core.sched.output import SchedulerOutput

# Prefill segments with at most this many new tokens are attended together, padded to the longest
# of them under one mask (small: the mask is P x L x keys); longer ones one by one with MLX's fused
# causal attention over their own keys, which never builds an (L x keys) mask.
PADDED_MAX_QUERY = 32

# Where the paged decode kernel runs, a step whose prefill segments have at most this many tokens each
# (a speculative step's verifying 1 + k, short prompts) runs every token as a decode row: its request's
# block-table row, keys up to its own position. The step is then decode-only, which compiled steps
# (compiled_step.py) replay. Each row reads its own keys, so a segment of n tokens reads its context
# n times where the prefill path reads it once: rows only while those extra reads stay under
# DECODE_ROWS_MAX_EXTRA_KEYS keys (Llama-8B: 128 KiB a key over its layers, 4 GiB at the bound, a
# quarter of its weights). Elsewhere decode rows gather their pages, once a row: segments stay prefill.
DECODE_ROWS_MAX_QUERY = 16
DECODE_ROWS_MAX_EXTRA_KEYS = 32768


def decode_token_rows(so: SchedulerOutput) -> Optional[np.ndarray]:
    """Each token's request, where the step has prefill segments, none has more than
    DECODE_ROWS_MAX_QUERY tokens and their extra key reads stay within DECODE_ROWS_MAX_EXTRA_KEYS;
    None otherwise."""
    T, nd, qsl = so.total_num_scheduled_tokens, so.num_decodes, so.query_start_loc
    if T == nd:
        return None
    n = np.diff(qsl[nd:])
    if int(n.max()) > DECODE_ROWS_MAX_QUERY or int(((n - 1) * so.seq_lens[nd:]).sum()) > DECODE_ROWS_MAX_EXTRA_KEYS:
        return None
    return np.repeat(np.arange(so.num_reqs, dtype=np.int32), np.diff(qsl))


# MLX's CUDA attention builds a cuDNN graph for every new (queries, keys) shape: about 48 ms on an
# H200, paid again whenever a prompt's length is new. There,
# each attention call is padded to a multiple of this many queries and keys, so that a server sees
# a bounded set of shapes. Metal and the CPU build nothing per shape: no padding.
SDPA_SHAPE_QUANTUM = {CUDA: 256}


def sdpa_shape_quantum(backend: Optional[str]) -> int:
    """The padding quantum for attention shapes on `backend` (EngineConfig.sdpa_quantum overrides)."""
    return SDPA_SHAPE_QUANTUM.get(backend, 0)


def sdpa_padding(num_prefix_keys: int, num_queries: int, quantum: int) -> tuple[int, int]:
    """(front, back): query rows to add before and after a segment of num_queries new tokens that
    follow num_prefix_keys gathered keys, and keys to add after the last, such that the queries and
    the keys are both multiples of `quantum` while causal attention aligned to the last key still
    puts each real query at its own position. The front rows are the last prefix positions (they
    see only real keys); the back rows alone see the added keys. Their outputs are dropped."""
    if quantum <= 1:
        return 0, 0
    front = num_prefix_keys % quantum
    return front, -(front + num_queries) % quantum


# Start-up builds the attention shapes that prompts of up to this many tokens meet when prefilled
# chunk by chunk (chunked_prefill_groups); longer prompts build the rest when first met.
WARM_UP_MAX_KEYS = 32768


def upload_indices(host: dict[str, np.ndarray]) -> dict[str, mx.array]:
    """Send a step's int32 index arrays to the device as ONE array, each then a view (slice) of it:
    every MLX array made from host memory is an allocation and a copy of its own, and a step has
    a dozen index arrays."""
    flat = [np.ascontiguousarray(a, np.int32).reshape(-1) for a in host.values()]
    # At least 4 int32s: MLX's CUDA allocator keeps arrays of <= 8 bytes in a shared managed pool
    # that kernels' own tiny outputs live in too.
    buf = mx.array(np.concatenate(flat + [np.zeros(4, np.int32)]))
    out, start = {}, 0
    for (name, a), part in zip(host.items(), flat):
        out[name] = buf[start:start + part.size].reshape(a.shape)
        start += part.size
    return out


@dataclass
class PrefillTiles:
    """The paged prefill kernel's work in one step (prefill_attention.paged_prefill says the layout)."""

    block_table: mx.array  # (S, nb) each segment's pages from its key_offset
    segs: mx.array  # (S, 4) first prefill row, new tokens, first position, key_offset
    tiles: mx.array  # (NT, 2) segment and first token of each 16-token tile, the most keys first
    splits: int
    split_tokens: mx.array  # (1,) keys per split


@dataclass
class PrefillGroup:
    """Prefill segments attended in one call: P of them, each padded to the same Lq query slots and
    K keys. Queries are gathered from the step's prefill rows into (P, H, Lq, D) and the real slots'
    outputs taken back."""

    num_queries: int  # Lq: query slots per segment, padding included
    num_keys: int  # K: keys per segment from its first gathered page, padding included
    block_table: mx.array  # (P, cdiv(K, block_size)): each segment's pages from its first gathered key
    query_rows: mx.array  # (P * Lq,) prefill row of each slot (a padding slot repeats a row of its segment)
    out_rows: mx.array  # (real queries,) the slot of each real query, segment by segment
    # "causal" (MLX's fused kernel, aligned to the last key: every segment shares Lq and K, and the
    # padding keeps each query at its place, see sdpa_padding) or a (P, 1, Lq, K) boolean mask.
    mask: Union[str, mx.array] = "causal"
    pads: tuple = ()  # host: (front, back) padding of each real segment (for tests and inspection)
    _page_rows: dict = field(default_factory=dict, repr=False)

    def page_rows(self, num_kv_heads: int) -> mx.array:
        """page_rows of the block table: built once a step, shared by the group's layers."""
        if num_kv_heads not in self._page_rows:
            self._page_rows[num_kv_heads] = page_rows(self.block_table, num_kv_heads)
        return self._page_rows[num_kv_heads]


def page_rows(block_table: mx.array, h: int) -> mx.array:
    """(B, h, nb): the (page, head) row of each sequence's head and page in pages seen as (P * h, ...).
    Gathering those rows lands straight in (B, h, keys) order: gathering pages and then moving the
    head axis forward copied everything twice (2.5x slower on the CPU)."""
    return block_table[:, None, :] * h + mx.arange(h, dtype=block_table.dtype)[None, :, None]


def chunked_prefill_groups(chunk: int, max_keys: int, quantum: int, block_size: int) -> list[PrefillGroup]:
    """One group per attention shape that a prompt of max_keys tokens meets when it is prefilled
    from its start `chunk` tokens a step (its last chunk left out), padded as a step pads it, with
    page 0 for every key and zero-based rows. What start-up runs once where each shape costs a build."""
    groups, shapes = [], set()
    if chunk <= PADDED_MAX_QUERY or quantum <= 1:
        return groups
    for first_pos in range(0, max_keys - chunk + 1, chunk):
        front, back = sdpa_padding(first_pos, chunk, quantum)
        shape = (front + chunk + back, first_pos + chunk + back)
        if shape not in shapes:
            shapes.add(shape)
            seg = Segment(0, chunk, first_pos, 0, shape[1] - back, np.zeros(cdiv(shape[1], block_size), np.int32))
            host = group_indices([(seg, front)], *shape, 1, block_size, 0)
            groups.append(PrefillGroup(*shape, **{k: mx.array(v) for k, v in host.items() if k in _DEVICE_FIELDS}))
    return groups


@dataclass
class AttentionMetadata:
    """One KV cache group's index tensors for one step (vLLM builds one per group), made on the host
    and uploaded with the other groups' in one array."""

    num_tokens: int
    num_decodes: int
    pages_in_place: bool  # the page-write kernel writes the pages (CUDA); else MLX scatters into them
    block_size: int
    window: Optional[int] = None  # sliding window W, or None for full attention
    backend: Optional[str] = None  # the kernels' (the runner's KernelPlan): not detected per layer call
    positions: Optional[mx.array] = None  # (T,)
    slot_mapping: Optional[mx.array] = None  # (T,) block * block_size + offset of each new token (in place)
    write_blocks: Optional[mx.array] = None  # (T,) page of each new token (scatter)
    write_offsets: Optional[mx.array] = None  # (T,) slot inside that page (scatter)
    # Decodes read their pages through decode_block_table, whose first page may be inside the
    # sequence (a window's first page): decode_seq_lens count the keys from that page on.
    decode_block_table: Optional[mx.array] = None  # (Bd, nb)
    decode_seq_lens: Optional[mx.array] = None  # (Bd,)
    decode_mask: Optional[mx.array] = None  # (Bd, 1, 1, nb * block_size) keys each decode sees (gather path)
    use_decode_kernel: bool = False
    decode_splits: int = 1
    decode_split_tokens: Optional[mx.array] = None  # (1,)
    prefill_tiles: Optional[PrefillTiles] = None  # the prefill kernel's work; else prefill_groups
    prefill_groups: list[PrefillGroup] = field(default_factory=list)
    # Where each prefill row's output is among the groups' outputs, concatenated (None: already in
    # row order).
    prefill_order: Optional[mx.array] = None  # (Tp,)
    _decode_rows: dict = field(default_factory=dict, repr=False)
    _write_index: dict = field(default_factory=dict, repr=False)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes

    def write_index(self, num_kv_heads: int) -> tuple[mx.array, mx.array, mx.array]:
        """(page, head, slot) of every new token's row of each head, each (T, num_kv_heads): the scatter
        path's page-write index, built once a step and shared by the group's layers (an index with a
        slice in it costs each layer's write an arange, broadcasts and casts)."""
        if num_kv_heads not in self._write_index:
            shape = (self.num_tokens, num_kv_heads)
            heads = mx.broadcast_to(mx.arange(num_kv_heads, dtype=mx.int32)[None, :], shape)
            self._write_index[num_kv_heads] = (mx.broadcast_to(self.write_blocks[:, None], shape), heads,
                                               mx.broadcast_to(self.write_offsets[:, None], shape))
        return self._write_index[num_kv_heads]

    def decode_page_rows(self, num_kv_heads: int) -> mx.array:
        """page_rows of decode_block_table (gather path): built once a step, shared by the group's layers."""
        if num_kv_heads not in self._decode_rows:
            self._decode_rows[num_kv_heads] = page_rows(self.decode_block_table, num_kv_heads)
        return self._decode_rows[num_kv_heads]


@dataclass
class StepMetadata:
    """A step's model inputs and every group's attention metadata."""

    input_ids: mx.array  # (T,)
    logits_indices: mx.array  # (S,) rows whose logits are sampled
    placeholder_rows: Optional[mx.array]  # (R,) rows whose input token comes from the previous step
    placeholder_src: Optional[mx.array]  # (R,) where in the previous step's sampled tokens
    groups: list[AttentionMetadata]
    extra: dict[str, mx.array] = field(default_factory=dict)  # the caller's own per-step arrays (LoRA rows)

    @classmethod
    def build(cls, so: SchedulerOutput, block_size: int, windows: list[Optional[int]],
              kernel_kv_heads: Optional[list[int]] = None, pages_in_place: bool = False,
              backend: Optional[str] = None, sdpa_quantum: int = 0,
              prefill_heads: Optional[list[Optional[tuple[int, int]]]] = None,
              extra: Optional[dict[str, np.ndarray]] = None,
              image_spans: Optional[np.ndarray] = None) -> "StepMetadata":
        """windows: each group's sliding window (None: full attention). kernel_kv_heads: per group,
        the KV heads the paged-decode kernel is split for (0 or None: decode rows gather pages);
        pages_in_place: the page-write kernel writes new K/V (else MLX scatters them); backend: the
        kernels' (None: kernels.build.gpu_backend); sdpa_quantum: prefill attention shapes are
        padded to its multiples (sdpa_shape_quantum); prefill_heads: per group, (KV heads, query
        heads per KV head) where the paged prefill kernel attends its prefill rows (None: groups); extra:
        int arrays uploaded with the rest (StepMetadata.extra); image_spans: (T, 2) the positions [lo, hi) of the
        image each row's token lies in, which it also sees (bidirectional images: lo == hi elsewhere); such a
        step's prefill rows go through prefill groups under explicit masks, never the kernels."""
        kernel_kv_heads = kernel_kv_heads or [0] * len(windows)
        prefill_heads = prefill_heads or [None] * len(windows)
        positions = so.rope_positions if len(so.rope_positions) else so.positions  # RoPE's (M-RoPE: shifted)
        host = dict(input_ids=so.input_ids, positions=positions, logits_indices=so.logits_indices,
                    **{f"extra.{k}": v for k, v in (extra or {}).items()})
        if len(so.placeholder_rows):
            host.update(placeholder_rows=so.placeholder_rows, placeholder_src=so.placeholder_src)
        builders = [_GroupBuilder(so, g, block_size, w, kernel_kv_heads[g], pages_in_place, backend, sdpa_quantum,
                                  prefill_heads[g], image_spans) for g, w in enumerate(windows)]
        for g, b in enumerate(builders):
            host.update({f"{g}.{k}": v for k, v in b.host.items()})
        dev = upload_indices(host)
        groups = [b.finish(dev, f"{g}.", dev["positions"]) for g, b in enumerate(builders)]
        return cls(dev["input_ids"], dev["logits_indices"], dev.get("placeholder_rows"), dev.get("placeholder_src"),
                   groups, {k[6:]: v for k, v in dev.items() if k.startswith("extra.")})


class _GroupBuilder:
    """The host half of one group's AttentionMetadata; `finish` makes it from the uploaded arrays."""

    def __init__(self, so: SchedulerOutput, group: int, block_size: int, window: Optional[int], kernel_heads: int,
                 in_place: bool, backend: Optional[str], quantum: int, prefill_heads: Optional[tuple[int, int]],
                 image_spans: Optional[np.ndarray] = None):
        self.image_spans = image_spans
        if image_spans is not None:
            prefill_heads = None
        rows = decode_token_rows(so) if kernel_heads > 0 and image_spans is None else None  # every token a decode row
        self.T, self.bs, self.window = so.total_num_scheduled_tokens, block_size, window
        self.nd = so.num_decodes if rows is None else self.T
        self.backend, self.quantum, self.prefill_heads = backend, quantum, prefill_heads
        self.prefill_splits = 0  # the prefill kernel's splits; 0: prefill groups
        self.in_place, self.use_kernel = in_place, kernel_heads > 0 and self.nd > 0
        table, slots = so.block_table[group], so.slot_mapping[group]
        host: dict[str, np.ndarray] = {}
        if self.in_place:
            host["slot_mapping"] = slots
        else:
            host.update(write_blocks=slots // block_size, write_offsets=slots % block_size)
        self.splits = 1
        if self.nd:
            if rows is None:
                rows_table, query_pos = table[:self.nd], so.seq_lens[:self.nd] - 1
            else:
                rows_table, query_pos = table[rows], so.positions
            decode_table, decode_lens = _window_tables(rows_table, query_pos + 1, query_pos, block_size, window)
            host.update(decode_block_table=decode_table, decode_seq_lens=decode_lens)
            if self.use_kernel:
                self.splits, tokens = decode_attention.num_splits(self.nd, kernel_heads, int(decode_lens.max()),
                                                                  window, backend)
                host["decode_split_tokens"] = np.array([tokens])
        self.groups: list[tuple] = []  # (Lq, K, explicit mask, pads) of each prefill group
        if self.T > self.nd:
            self._plan_prefill(so, table, host)
        self.host = host

    def _segments(self, so: SchedulerOutput, table: np.ndarray) -> list["Segment"]:
        """The step's prefill segments, each with the pages from its first key's (under a window)."""
        bs, qsl, seq_lens = self.bs, so.query_start_loc, so.seq_lens
        segments = []
        for s in range(self.nd, so.num_reqs):
            n = int(qsl[s + 1] - qsl[s])
            first_pos = int(seq_lens[s]) - n
            first_key = 0 if self.window is None else max(0, first_pos - self.window + 1)
            first_block, end_block = first_key // bs, cdiv(int(seq_lens[s]), bs)
            segments.append(Segment(int(qsl[s]), n, first_pos, first_block * bs,
                                     int(seq_lens[s]) - first_block * bs, table[s, first_block:end_block]))
        return segments

    def _plan_prefill(self, so: SchedulerOutput, table: np.ndarray, host: dict) -> None:
        """The prefill kernel's tiles where it runs and takes the step's chunks (none longer than
        PREFILL_KERNEL_MAX_QUERY); else group the step's prefill segments: long ones by padded
        shape (sdpa_padding), short ones all together padded to the longest; one attention call
        per group."""
        nd, bs, quantum = self.nd, self.bs, self.quantum
        segments = self._segments(so, table)
        max_query = prefill_attention.PREFILL_KERNEL_MAX_QUERY
        if self.prefill_heads is not None and max(seg.n for seg in segments) <= max_query:
            tiles, self.prefill_splits = prefill_tile_indices(segments, nd, self.window, *self.prefill_heads)
            host.update(tiles)
            return
        by_shape: dict[tuple[int, int], list] = {}
        short = []
        for seg in segments:
            if seg.n > PADDED_MAX_QUERY:
                front, back = sdpa_padding(seg.num_keys - seg.n, seg.n, quantum)
                by_shape.setdefault((front + seg.n + back, seg.num_keys + back), []).append((seg, front, back))
            else:
                short.append((seg, 0, 0))
        plans = [(Lq, K, members, self.image_spans is not None
                  or any(self._needs_band(seg, back) for seg, _, back in members))
                 for (Lq, K), members in by_shape.items()]
        if short:  # under one mask: each its own length and keys
            Lq, nb = max(seg.n for seg, _, _ in short), max(len(seg.pages) for seg, _, _ in short)
            if quantum > 1:
                Lq, nb = 1 << (Lq - 1).bit_length(), cdiv(cdiv(nb * bs, quantum) * quantum, bs)
            plans.append((Lq, nb * bs, short, True))
        for i, (Lq, K, members, explicit) in enumerate(plans):
            P = len(members) if quantum <= 1 else 1 << (len(members) - 1).bit_length()
            idx = group_indices([(seg, front) for seg, front, _ in members], Lq, K, P, bs, nd)
            host.update({f"group{i}.{k}": v for k, v in idx.items() if explicit or k in _DEVICE_FIELDS})
            if self.image_spans is not None:
                spans = self.image_spans[nd + idx["query_rows"]].reshape(P, Lq, 2)
                host.update({f"group{i}.image_lo": spans[..., 0], f"group{i}.image_hi": spans[..., 1]})
            self.groups.append((Lq, K, explicit, tuple((front, back) for _, front, back in members)))
        order = [seg for _, _, members, _ in plans for seg, _, _ in members]
        if any(a.row > b.row for a, b in zip(order, order[1:])):
            host["prefill_order"] = prefill_order(order)

    def _needs_band(self, seg: "Segment", back: int) -> bool:
        """A window that bites: some query (the padding's included) has keys before its window."""
        return self.window is not None and not (seg.key_offset == 0 and seg.first_pos + seg.n + back <= self.window)

    def finish(self, dev: dict[str, mx.array], prefix: str, positions: mx.array) -> AttentionMetadata:
        get = {k[len(prefix):]: v for k, v in dev.items() if k.startswith(prefix)}
        md = AttentionMetadata(self.T, self.nd, self.in_place, self.bs, self.window, self.backend, positions,
                               slot_mapping=get.get("slot_mapping"), write_blocks=get.get("write_blocks"),
                               write_offsets=get.get("write_offsets"),
                               decode_block_table=get.get("decode_block_table"),
                               decode_seq_lens=get.get("decode_seq_lens"),
                               use_decode_kernel=self.use_kernel, decode_splits=self.splits,
                               decode_split_tokens=get.get("decode_split_tokens"),
                               prefill_order=get.get("prefill_order"))
        if self.nd and not self.use_kernel:
            md.decode_mask = length_mask(md.decode_seq_lens, md.decode_block_table.shape[1] * self.bs, self.window)
        if self.prefill_splits:
            md.prefill_tiles = PrefillTiles(get["prefill_block_table"], get["prefill_segs"], get["prefill_tiles"],
                                            self.prefill_splits, get["prefill_split_tokens"])
        for i, (Lq, K, explicit, pads) in enumerate(self.groups):
            g = {k: get[f"group{i}.{k}"] for k in _DEVICE_FIELDS}
            mask = "causal"
            if explicit:  # built once a step, shared by the group's layers
                key_pos = get[f"group{i}.key_offset"][:, None, None] + mx.arange(K)[None, None, :]
                mask = causal_mask(key_pos, get[f"group{i}.query_pos"][:, :, None], self.window)
                if self.image_spans is not None:  # over the causal mask and the window: the row's own image
                    lo, hi = get[f"group{i}.image_lo"][:, :, None], get[f"group{i}.image_hi"][:, :, None]
                    mask = mask | ((key_pos >= lo) & (key_pos < hi))
                mask = mask[:, None]
            md.prefill_groups.append(PrefillGroup(Lq, K, mask=mask, pads=pads, **g))
        return md


_DEVICE_FIELDS = ("block_table", "query_rows", "out_rows")


def _window_tables(table: np.ndarray, seq_lens: np.ndarray, query_pos: np.ndarray, block_size: int,
                   window: Optional[int]) -> tuple[np.ndarray, np.ndarray]:
    """Decode rows' block tables cut to the pages their query reads, and the key counts from each
    table's first page. Full attention: every page. A window: from the page of its first key."""
    if window is None:
        return table[:, :cdiv(int(seq_lens.max()), block_size)], seq_lens
    first_block = np.maximum(query_pos - window + 1, 0) // block_size
    num_blocks = cdiv(window - 1, block_size) + 1
    cols = first_block[:, None] + np.arange(num_blocks)[None, :]
    cols = np.minimum(cols, table.shape[1] - 1)  # past the end: any page (masked off)
    return np.take_along_axis(table, cols, axis=1), seq_lens - first_block * block_size
