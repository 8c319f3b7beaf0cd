"""Multimodal inputs as they travel with a request (vLLM's MultiModalFeatureSpec and PlaceholderRange).

Everything here crosses the engine-core process boundary as msgpack (engine/messages.py): arrays are
bytes + dtype + shape, never pickled objects."""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

import msgspec
import numpy as np


class TensorData(msgspec.Struct, array_like=True, frozen=True):
    """An array as raw bytes (C order) with its dtype name and shape."""

    data: bytes
    dtype: str  # numpy's name: "float32", "int32", "bfloat16" is carried as "float32"
    shape: tuple[int, ...]

    @classmethod
    def from_array(cls, array: Any) -> "TensorData":
        """From a numpy array, an mx.array or anything np.asarray takes (bfloat16 goes as float32)."""
        import mlx.core as mx

        if isinstance(array, mx.array):
            array = np.array(array.astype(mx.float32) if array.dtype == mx.bfloat16 else array)
        a = np.ascontiguousarray(np.asarray(array))
        return cls(a.tobytes(), a.dtype.name, tuple(int(d) for d in a.shape))

    def numpy(self) -> np.ndarray:
        return np.frombuffer(self.data, dtype=np.dtype(self.dtype)).reshape(self.shape)

    def mx(self):
        import mlx.core as mx

        return mx.array(self.numpy())


class PlaceholderRange(msgspec.Struct, array_like=True, frozen=True):
    """Where an item's placeholder tokens lie in the prompt: token ids [offset, offset + length)."""

    offset: int
    length: int

    @property
    def end(self) -> int:
        return self.offset + self.length


class MultiModalFeatureSpec(msgspec.Struct, array_like=True, frozen=True):
    """One image of a request: its content hash, its placeholder range and the processed inputs its encoder takes
    (pixel_values, and per family e.g. image_position_ids), one item each (a leading batch axis of 1)."""

    data: dict[str, TensorData]
    modality: str
    identifier: str  # the content hash: prefix-cache key and encoder-cache key
    mm_position: PlaceholderRange


def content_hash(data: dict[str, TensorData], extra: Sequence[Any] = ()) -> str:
    """The identifier of processed inputs: SHA-256 over every array's name, dtype, shape and bytes (and `extra`,
    e.g. the model's name), so two images that process alike share their embeddings and pages."""
    h = hashlib.sha256()
    for name in sorted(data):
        t = data[name]
        h.update(f"{name}:{t.dtype}:{t.shape}".encode())
        h.update(t.data)
    h.update(repr(tuple(extra)).encode())
    return h.hexdigest()


def check_features(features: Sequence[MultiModalFeatureSpec], prompt_token_ids: Sequence[int]) -> None:
    """Features in prompt order, disjoint, inside the prompt: a clear ValueError naming the item otherwise."""
    end = 0
    for i, f in enumerate(features):
        if not isinstance(f, MultiModalFeatureSpec):
            raise ValueError(f"mm_features[{i}] must be a MultiModalFeatureSpec, got {type(f).__name__}")
        pos = f.mm_position
        if pos.length <= 0 or pos.offset < end or pos.end > len(prompt_token_ids):
            raise ValueError(f"mm_features[{i}] ({f.modality} {f.identifier[:12]}): placeholder range "
                             f"[{pos.offset}, {pos.end}) must be non-empty, after the previous item's "
                             f"(which ends at {end}) and inside the prompt ({len(prompt_token_ids)} tokens)")
        end = pos.end
