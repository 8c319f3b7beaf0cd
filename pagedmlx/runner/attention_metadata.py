"""The step's attention metadata: index tensors built on the host once per KV cache group (vLLM's
attention metadata builders), uploaded in one array, and the masks built from them on the device.

A sliding-window group's decode rows get block tables cut to their window's pages; prefill segments
are planned either one by one (long ones: their own keys, MLX's fused causal attention) or padded
together (short ones, under one mask)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Optional, Union

import mlx.core as mx
import numpy as np

from pagedmlx.kv.spec import cdiv
from pagedmlx.runner import paged_kernels
from pagedmlx.scheduler_output import SchedulerOutput

# Prefill segments with at most this many new tokens are attended together, padded to the longest
# of them under one mask (small: the mask is P x L x keys); longer ones one by one with MLX's fused
# causal attention over their own keys, which never builds an (L x keys) mask.
PADDED_MAX_QUERY = 32

# MLX's CUDA attention builds a cuDNN graph for every new (queries, keys) shape: about 48 ms on an
# H200 (scripts/bench/bench_sdpa_shapes.py), paid again whenever a prompt's length is new. There,
# each attention call is padded to a multiple of this many queries and keys, so that a server sees
# a bounded set of shapes. Metal and the CPU build nothing per shape: no padding.
SDPA_SHAPE_QUANTUM = {paged_kernels.CUDA: 256}


def sdpa_shape_quantum(backend: Optional[str]) -> int:
    """The padding quantum for attention shapes on `backend` (PAGEDMLX_SDPA_QUANTUM overrides)."""
    env = os.environ.get("PAGEDMLX_SDPA_QUANTUM")
    return int(env) if env else SDPA_SHAPE_QUANTUM.get(backend, 0)


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
# chunk by chunk (chunked_prefill_segments); longer prompts build the rest when first met.
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
class PrefillSegment:
    """One long prefill chunk: its rows in the batch and the pages its queries read."""

    row_start: int
    num_queries: int
    first_query_pos: int
    key_offset: int  # position of the first gathered key (0, or a page boundary before the window)
    num_keys: int  # keys from key_offset to the segment's last token, plus pad_back
    # Padding that rounds the attention call's shape (see sdpa_padding): pad_front query rows
    # before the segment's, pad_back after, and pad_back keys after its last.
    pad_front: int = 0
    pad_back: int = 0
    block_table: Optional[mx.array] = None  # (nb,) the pages holding those keys
    # "causal" (MLX's fused kernel, aligned to the last key) where the window does not bite, else
    # the (queries, num_keys) band: built once a step, shared by the group's layers.
    mask: Union[str, mx.array] = "causal"


def chunked_prefill_segments(chunk: int, max_keys: int, quantum: int, block_size: int) -> list[PrefillSegment]:
    """The long segments, one per attention shape, of a prompt of max_keys tokens prefilled from
    its start `chunk` tokens a step (its last chunk left out), padded as sdpa_padding pads them;
    their block tables read page 0. What start-up runs once where each shape costs a build."""
    segments, shapes = [], set()
    if chunk <= PADDED_MAX_QUERY or quantum <= 1:
        return segments
    for first_pos in range(0, max_keys - chunk + 1, chunk):
        front, back = sdpa_padding(first_pos, chunk, quantum)
        num_keys = first_pos + chunk + back
        if (front + chunk + back, num_keys) not in shapes:
            shapes.add((front + chunk + back, num_keys))
            segments.append(PrefillSegment(0, chunk, first_pos, 0, num_keys, front, back,
                                           block_table=mx.zeros((cdiv(num_keys, block_size),), mx.int32)))
    return segments


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
    segments: list[PrefillSegment] = field(default_factory=list)  # long prefill chunks, one by one
    # Short prefill chunks, padded to the longest (P of them, Lmax queries, nb pages):
    padded_block_table: Optional[mx.array] = None  # (P, nb)
    padded_query_rows: Optional[mx.array] = None  # (P * Lmax,) batch row of each padded query slot
    padded_out_rows: Optional[mx.array] = None  # (Tp,) padded slot of each real query
    padded_mask: Optional[mx.array] = None  # (P, 1, Lmax, nb * block_size)
    padded_max_query_len: int = 0
    # Where each prefill row's output is among [segments..., padded] (None: already in row order).
    prefill_order: Optional[mx.array] = None  # (Tp,)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decodes


@dataclass
class StepMetadata:
    """A step's model inputs and every group's attention metadata."""

    input_ids: mx.array  # (T,)
    logits_indices: mx.array  # (S,) rows whose logits are sampled
    placeholder_rows: Optional[mx.array]  # (R,) rows whose input token comes from the previous step
    placeholder_src: Optional[mx.array]  # (R,) where in the previous step's sampled tokens
    groups: list[AttentionMetadata]

    @classmethod
    def build(cls, so: SchedulerOutput, block_size: int, windows: list[Optional[int]],
              kernel_kv_heads: Optional[list[int]] = None, pages_in_place: bool = False,
              backend: Optional[str] = None, sdpa_quantum: int = 0) -> "StepMetadata":
        """windows: each group's sliding window (None: full attention). kernel_kv_heads: per group,
        the KV heads the paged-decode kernel is split for (0 or None: decode rows gather pages);
        pages_in_place: the page-write kernel writes new K/V (else MLX scatters them); backend: the
        kernels' (None: paged_kernels.gpu_backend); sdpa_quantum: prefill attention shapes are
        padded to its multiples (sdpa_shape_quantum)."""
        kernel_kv_heads = kernel_kv_heads or [0] * len(windows)
        host = dict(input_ids=so.input_ids, positions=so.positions, logits_indices=so.logits_indices)
        if len(so.placeholder_rows):
            host.update(placeholder_rows=so.placeholder_rows, placeholder_src=so.placeholder_src)
        builders = [_GroupBuilder(so, g, block_size, w, kernel_kv_heads[g], pages_in_place, backend, sdpa_quantum)
                    for g, w in enumerate(windows)]
        for g, b in enumerate(builders):
            host.update({f"{g}.{k}": v for k, v in b.host.items()})
        dev = upload_indices(host)
        groups = [b.finish(dev, f"{g}.", dev["positions"]) for g, b in enumerate(builders)]
        return cls(dev["input_ids"], dev["logits_indices"], dev.get("placeholder_rows"), dev.get("placeholder_src"),
                   groups)


class _GroupBuilder:
    """The host half of one group's AttentionMetadata; `finish` makes it from the uploaded arrays."""

    def __init__(self, so: SchedulerOutput, group: int, block_size: int, window: Optional[int], kernel_heads: int,
                 in_place: bool, backend: Optional[str], quantum: int):
        self.T, self.nd, self.bs, self.window = so.total_num_scheduled_tokens, so.num_decodes, block_size, window
        self.backend, self.quantum = backend, quantum
        self.in_place, self.use_kernel = in_place, kernel_heads > 0 and so.num_decodes > 0
        table, slots = so.block_table[group], so.slot_mapping[group]
        host: dict[str, np.ndarray] = {}
        if self.in_place:
            host["slot_mapping"] = slots
        else:
            host.update(write_blocks=slots // block_size, write_offsets=slots % block_size)
        self.splits = 1
        if self.nd:
            decode_table, decode_lens = _window_tables(table[:self.nd], so.seq_lens[:self.nd],
                                                       so.seq_lens[:self.nd] - 1, block_size, window)
            host.update(decode_block_table=decode_table, decode_seq_lens=decode_lens)
            if self.use_kernel:
                self.splits, tokens = paged_kernels.num_splits(self.nd, kernel_heads, int(decode_lens.max()), window,
                                                               backend)
                host["decode_split_tokens"] = np.array([tokens])
        self.long, self.short = [], []
        if self.T > self.nd:
            self._plan_prefill(so, table, host)
        self.host = host

    def _plan_prefill(self, so: SchedulerOutput, table: np.ndarray, host: dict) -> None:
        nd, bs = self.nd, self.bs
        qsl, seq_lens = so.query_start_loc, so.seq_lens
        for s in range(nd, so.num_reqs):
            n = int(qsl[s + 1] - qsl[s])
            first_pos = int(seq_lens[s]) - n
            first_key = 0 if self.window is None else max(0, first_pos - self.window + 1)
            first_block, end_block = first_key // bs, cdiv(int(seq_lens[s]), bs)
            num_keys = int(seq_lens[s]) - first_block * bs
            seg = (int(qsl[s]), n, first_pos, first_block * bs, num_keys)
            if n > PADDED_MAX_QUERY:
                front, back = sdpa_padding(num_keys - n, n, self.quantum)
                host[f"segment{len(self.long)}"] = _pad_pages(table[s, first_block:end_block],
                                                             cdiv(num_keys + back, bs))
                self.long.append(seg[:4] + (num_keys + back, front, back))
            else:
                self.short.append((seg, table[s, first_block:end_block]))
        if self.short:
            host.update(_padded_indices(self.short, bs, self.quantum))
        if self.long and self.short and self.long[-1][0] > self.short[0][0][0]:  # not [long..., short...]
            host["prefill_order"] = _prefill_order(self.long, [seg for seg, _ in self.short], nd)

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
        md.segments = [PrefillSegment(*seg, block_table=get[f"segment{i}"], mask=self._segment_mask(*seg))
                       for i, seg in enumerate(self.long)]
        if self.short:
            md.padded_block_table, md.padded_query_rows = get["padded_block_table"], get["padded_query_rows"]
            md.padded_out_rows = get["padded_out_rows"]
            q_pos, key_offset = get["padded_query_pos"], get["padded_key_offset"]
            md.padded_max_query_len = q_pos.shape[1]
            key_pos = key_offset[:, None, None] + mx.arange(md.padded_block_table.shape[1] * self.bs)[None, None, :]
            md.padded_mask = causal_mask(key_pos, q_pos[:, :, None], self.window)[:, None]
        return md


    def _segment_mask(self, row_start: int, num_queries: int, first_query_pos: int, key_offset: int,
                      num_keys: int, front: int, back: int) -> Union[str, mx.array]:
        if self.window is None or (key_offset == 0 and first_query_pos + num_queries + back <= self.window):
            return "causal"
        key_pos = mx.arange(key_offset, key_offset + num_keys)[None, :]
        query_pos = mx.arange(first_query_pos - front, first_query_pos + num_queries + back)[:, None]
        return causal_mask(key_pos, query_pos, self.window)


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


def _pad_pages(pages: np.ndarray, n: int) -> np.ndarray:
    """The block table extended to n pages with page 0: read only by padding rows."""
    return pages if len(pages) >= n else np.concatenate([pages, np.zeros(n - len(pages), pages.dtype)])


def _padded_indices(short: list, block_size: int, quantum: int = 0) -> dict[str, np.ndarray]:
    """Short prefill segments padded to the longest: block table, batch row of each padded query
    slot, padded slot of each real query, each slot's query position and each segment's first key.
    quantum: also round the segment count and length up to powers of two and the keys to a
    multiple of it (the attention call's shape: see SDPA_SHAPE_QUANTUM); added segments see key 0."""
    P = len(short)
    L = max(seg[1] for seg, _ in short)
    nb = max(len(t) for _, t in short)
    if quantum > 1:
        P, L = 1 << (P - 1).bit_length(), 1 << (L - 1).bit_length()
        nb = cdiv(-(-nb * block_size // quantum) * quantum, block_size)
    tables = np.zeros((P, nb), np.int32)
    rows = np.zeros((P, L), np.int32)
    q_pos = np.zeros((P, L), np.int32)
    key_offset = np.array([seg[3] for seg, _ in short] + [0] * (P - len(short)), np.int32)
    valid = np.zeros((P, L), bool)
    for p, ((row, n, first_pos, offset, _), t) in enumerate(short):
        tables[p, :len(t)] = t
        rows[p, :n] = row + np.arange(n)
        # A padded slot's query sits at the segment's first key and so sees one key: its softmax
        # stays finite.
        q_pos[p] = offset
        q_pos[p, :n] = first_pos + np.arange(n)
        valid[p, :n] = True
    return dict(padded_block_table=tables, padded_query_rows=rows.reshape(-1),
                padded_out_rows=np.flatnonzero(valid.reshape(-1)), padded_query_pos=q_pos,
                padded_key_offset=key_offset)


def _prefill_order(long: list, short: list, nd: int) -> np.ndarray:
    """For each prefill row in batch order, its index among the outputs laid out as [the long
    segments' rows..., the short segments' rows...]."""
    at, order = 0, {}
    for seg in long + short:
        order[seg[0]] = (at, seg[1])
        at += seg[1]
    return np.concatenate([np.arange(order[r][0], order[r][0] + order[r][1]) for r in sorted(order)])


def causal_mask(key_pos: mx.array, query_pos: mx.array, window: Optional[int]) -> mx.array:
    """Which keys each query sees: up to its own position, and within the window if there is one."""
    mask = key_pos <= query_pos
    if window is not None:
        mask = mask & (key_pos > query_pos - window)
    return mask


def length_mask(seq_lens: mx.array, num_keys: int, window: Optional[int] = None) -> mx.array:
    """(B, 1, 1, num_keys): the gathered keys each decode row sees: those that exist, and under a
    sliding window its last `window` (the decode query is the last key)."""
    key_pos = mx.arange(num_keys)[None, :]
    return causal_mask(key_pos, (seq_lens - 1)[:, None], window)[:, None, None, :]
