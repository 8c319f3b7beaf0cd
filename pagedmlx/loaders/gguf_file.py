"""Read a GGUF file (llama.cpp's format): its metadata as plain Python values and its tensors as MLX
arrays. Q4_0, Q4_1 and Q8_0 become MLX's own affine quantization (packed weight, scales, biases; group
size 32), which holds exactly the same numbers; every other quantized type is dequantized to float32
with gguf-py's reference implementation of llama.cpp's formulas."""

from __future__ import annotations

import functools
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, quants

GROUP_SIZE = 32  # the block size of every type kept packed

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?", 10: "<u8", 11: "<i8", 12: "<f8"}
_STRING, _ARRAY = 8, 9
_FLOATS = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
_PACKED = {GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q8_0}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # row-major (numpy) order: GGUF lists the fastest dimension first
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file


class _Cursor:
    def __init__(self, buf: mmap.mmap):
        self.buf, self.pos = buf, 0

    def scalar(self, kind: int) -> Any:
        fmt = _SCALARS[kind]
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar(10)
        self.pos += n
        return self.buf[self.pos - n:self.pos].decode("utf-8", errors="replace")

    def value(self, kind: int) -> Any:
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            return self.scalar(kind)
        item, count = self.scalar(4), self.scalar(10)
        if item in _NUMPY:  # one read for the whole array (262k token scores, types)
            values = np.frombuffer(self.buf, _NUMPY[item], count, self.pos)
            self.pos += values.nbytes
            return values.tolist()
        return [self.value(item) for _ in range(count)]


class GGUFFile:
    """A memory-mapped GGUF file: `metadata`, `tensors` (TensorInfo by name) and `load()`."""

    def __init__(self, path: Path):
        self.path = path
        with open(path, "rb") as f:
            self._buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        c = _Cursor(self._buf)
        if self._buf[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        c.pos = 4
        version = c.scalar(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} of {path} is not supported (2 and 3 are)")
        num_tensors, num_kv = c.scalar(10), c.scalar(10)
        self.metadata: dict[str, Any] = {}
        for _ in range(num_kv):
            key = c.string()
            self.metadata[key] = c.value(c.scalar(4))
        infos = []
        for _ in range(num_tensors):
            name = c.string()
            dims = [c.scalar(10) for _ in range(c.scalar(4))]
            infos.append((name, tuple(reversed(dims)), c.scalar(4), c.scalar(10)))
        align = int(self.metadata.get("general.alignment", 32))
        start = -(-c.pos // align) * align
        self.tensors = {name: TensorInfo(name, shape, _qtype(t, name, path), start + offset)
                        for name, shape, t, offset in infos}

    def _blocks(self, t: TensorInfo) -> np.ndarray:
        """The tensor's bytes as (rows, bytes per row), gguf-py's layout for quantized data."""
        block, size = GGML_QUANT_SIZES[t.qtype]
        row = t.shape[-1] // block * size
        rows = int(np.prod(t.shape[:-1], dtype=np.int64))
        return np.frombuffer(self._buf, np.uint8, rows * row, t.offset).reshape(rows, row)

    def load(self, t: TensorInfo) -> dict[str, mx.array]:
        """{"weight": array} for a float or dequantized tensor; {"weight", "scales", "biases"} for a
        packed one (what MLX's quantized layers hold)."""
        data = self._blocks(t)
        if t.qtype in _FLOATS:
            return {"weight": mx.array(data.view(_FLOATS[t.qtype]).reshape(t.shape))}
        if t.qtype == GGMLQuantizationType.BF16:
            return {"weight": mx.array(data.view(np.uint16).reshape(t.shape)).view(mx.bfloat16)}
        if t.qtype in _PACKED:
            return _affine(data, t)
        return {"weight": mx.array(quants.dequantize(data, t.qtype).reshape(t.shape))}


def _qtype(value: int, name: str, path: Path) -> GGMLQuantizationType:
    try:
        qtype = GGMLQuantizationType(value)
    except ValueError:
        raise ValueError(f"tensor {name!r} of {path} has an unknown type {value}") from None
    if not readable(qtype):
        raise ValueError(f"tensor {name!r} of {path} has type {qtype.name}, which pagedmlx cannot read")
    return qtype


@functools.lru_cache(maxsize=None)
def readable(qtype: GGMLQuantizationType) -> bool:
    """Whether gguf-py can dequantize the type (every type llama.cpp stores weights in)."""
    if qtype not in GGML_QUANT_SIZES:
        return False
    try:
        quants.dequantize(np.zeros((1, GGML_QUANT_SIZES[qtype][1]), np.uint8), qtype)
    except NotImplementedError:
        return False
    return True


def _affine(data: np.ndarray, t: TensorInfo) -> dict[str, mx.array]:
    """Q8_0: d * q (q int8); Q4_0: d * (q - 8); Q4_1: d * q + m (q 4-bit): MLX's scale * q + bias with
    q unsigned, packed little-endian into uint32 (4 bits: element 2i in the low nibble of byte i)."""
    rows = data.shape[0]
    blocks = data.reshape(rows, -1, GGML_QUANT_SIZES[t.qtype][1])
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    if t.qtype == GGMLQuantizationType.Q8_0:
        q, bias = blocks[..., 2:] ^ np.uint8(0x80), -128 * d
    else:
        offset = 4 if t.qtype == GGMLQuantizationType.Q4_1 else 2
        bias = blocks[..., 2:4].copy().view(np.float16)[..., 0] if offset == 4 else -8 * d
        qs = blocks[..., offset:]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)  # GGML: the low nibbles are elements 0..15
        q = nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)
    packed = np.ascontiguousarray(q).reshape(rows, -1).view(np.uint32)
    shape = t.shape[:-1]
    return {"weight": mx.array(packed.reshape(*shape, -1)), "scales": mx.array(d.reshape(*shape, -1)),
            "biases": mx.array(bias.reshape(*shape, -1))}
