"""Prefix-cache keys: a block's hash chains its parent's, its token ids and extra keys."""

from __future__ import annotations

import hashlib
from array import array
from typing import NamedTuple, Optional, Sequence


class BlockHash(NamedTuple):
    """The prefix-cache key of one full block.

    `digest` is a SHA-256 over the parent's digest, the block's tokens and its extra keys, so it
    stands for the whole token chain; `token_ids` and `extra_keys` are kept in the key too, so a
    dict lookup compares the tokens themselves and a digest collision can never share a block.
    """

    digest: bytes
    token_ids: tuple[int, ...]
    extra_keys: Optional[tuple] = None


ROOT_DIGEST = b"pagedmlx-root"


def hash_block_tokens(
    parent: Optional[BlockHash], token_ids: Sequence[int], extra_keys: Optional[tuple] = None
) -> BlockHash:
    h = hashlib.sha256(parent.digest if parent is not None else ROOT_DIGEST)
    h.update(array("q", token_ids).tobytes())
    if extra_keys is not None:
        h.update(repr(extra_keys).encode())
    return BlockHash(h.digest(), tuple(token_ids), extra_keys)


def hash_request_blocks(
    token_ids: Sequence[int],
    block_size: int,
    existing: list[BlockHash],
    extra_keys: Optional[tuple] = None,
    mm_features: Sequence = (),
) -> None:
    """Append to `existing` the hashes of the full blocks of `token_ids` not hashed yet. mm_features: the
    request's images (multimodal/inputs.py), whose identifiers join the keys of the blocks holding their tokens."""
    parent = existing[-1] if existing else None
    for start in range(len(existing) * block_size, len(token_ids) - block_size + 1, block_size):
        keys = extra_keys
        if mm_features:
            keys = mm_extra_keys(mm_features, start, start + block_size, extra_keys)
        parent = hash_block_tokens(parent, token_ids[start:start + block_size], keys)
        existing.append(parent)


def mm_extra_keys(mm_features: Sequence, start: int, end: int, extra_keys: Optional[tuple]) -> Optional[tuple]:
    """vLLM's mm extra keys: the identifiers of the images with placeholder tokens in [start, end), after the
    request's other keys. The same text with another image never shares the block; the same image does."""
    ids = tuple(f.identifier for f in mm_features if f.mm_position.offset < end and f.mm_position.end > start)
    if not ids:
        return extra_keys
    return (extra_keys or ()) + (("mm",) + ids,)
