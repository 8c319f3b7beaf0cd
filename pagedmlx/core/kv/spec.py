"""What the block accounting needs to know of a model's layers (vLLM's kv_cache_interface): each
layer's kind (full attention, a sliding window of W tokens, or a recurrent state), grouped into KV
cache groups."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class FullAttentionSpec:
    """A layer that attends over every earlier token: its pages grow with the sequence."""

    def max_blocks_held(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return cdiv(num_tokens, block_size)


@dataclass(frozen=True)
class SlidingWindowSpec:
    """A layer whose query at position p attends keys in (p - W, p]: pages behind the window are
    freed as the sequence grows."""

    sliding_window: int

    def max_blocks_held(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most pages one request holds at once: its window behind the next token, plus a
        chunk of new tokens, each possibly straddling a page boundary."""
        window = cdiv(self.sliding_window - 1, block_size) + 1
        return min(cdiv(num_tokens, block_size), window + cdiv(max_chunk, block_size) + 1)


@dataclass(frozen=True)
class MambaSpec:
    """Layers with a recurrent state (vLLM's MambaSpec): a running request holds one block, its state
    slot, however long it is. Checkpoints are slots that keep the state at a block boundary, cached
    under that block's hash: a prefix hit resumes from one (and only from one). They are taken every
    `checkpoint_interval` tokens (a multiple of the block size; 0: none, so no prefix hits) and at the
    last full block of each prompt. The pool has `max_checkpoints` slots beyond the running ones;
    checkpoints keep every slot no request holds, least recently used evicted first.
    With speculative decoding a request whose step verifies drafts also holds `num_speculative_blocks`
    (1) spare slot, for that step: the step writes the state there, and it becomes the request's slot
    only if every draft is accepted (core/kv/state_manager.py). The pool has spares for `max_speculating`
    requests at once (the most that speculate: SpeculativeConfig.disable_by_batch_size)."""

    checkpoint_interval: int = 0
    max_checkpoints: int = 0
    num_speculative_blocks: int = 0
    max_speculating: int = 0

    def max_blocks_held(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        return 1 + self.num_speculative_blocks


KVCacheSpec = Union[FullAttentionSpec, SlidingWindowSpec, MambaSpec]


@dataclass
class KVCacheGroupSpec:
    """Layers with one spec share block ids: a new token gets one slot per group."""

    kv_cache_spec: KVCacheSpec
    num_blocks: int
    layer_ids: tuple[int, ...] = ()
    page_size_bytes: int = 0  # one block of every layer of the group (vLLM's page size), for reports
    kv_cache_dtype: str = ""  # what its pages hold ("bfloat16", "int8", "int4", ...), for reports

    @property
    def sliding_window(self) -> Optional[int]:
        return getattr(self.kv_cache_spec, "sliding_window", None)

    @property
    def is_state(self) -> bool:
        return isinstance(self.kv_cache_spec, MambaSpec)

    @property
    def name(self) -> str:
        w = self.sliding_window
        return "state" if self.is_state else "full" if w is None else f"sliding {w}"


@dataclass
class KVCacheConfig:
    block_size: int
    kv_cache_groups: list[KVCacheGroupSpec]

    @classmethod
    def full_attention(cls, num_blocks: int, block_size: int) -> "KVCacheConfig":
        """One group of full-attention layers: a plain-attention model."""
        return cls(block_size, [KVCacheGroupSpec(FullAttentionSpec(), num_blocks)])


def sliding_pool_blocks(window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int) -> int:
    """Pages a sliding-window group needs so that it never runs out before the full-attention
    group does: every running request holds at most its window (plus the page the next token
    starts), and one step adds at most the token budget's pages (plus one boundary page per
    scheduled request). The +1: the null block."""
    per_request = cdiv(window - 1, block_size) + 2
    return max_num_seqs * (per_request + 1) + cdiv(max_num_batched_tokens, block_size) + 1
