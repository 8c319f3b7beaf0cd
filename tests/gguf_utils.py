"""Writing small GGUF files the way llama.cpp's converter does, for the GGUF loader's tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Optional

import gguf
import mlx.core as mx
import numpy as np
from mlx.utils import tree_map

# (GGUF name, values, stored as): float values are quantized here; uint8 ones are already the type's bytes
Tensor = tuple[str, np.ndarray, Optional[gguf.GGMLQuantizationType]]


ROUND_TRIP = [
    "Hello world 2025!",
    "def square(x):\n    return x ** 2  # 2025\n\n\tindented\ttabs\r\n",
    "café, naïve, Ωμέγα, Straße, 日本語",
    "emoji 🙂👍🏽 and 🇫🇷",
    "  leading and trailing spaces  ",
    "",
]


def stream_decode(tok, ids: list[int]) -> str:
    """The text mlx-lm's streaming detokenizer makes of ids, one token at a time."""
    detok = tok.detokenizer
    detok.reset()
    for i in ids:
        detok.add_token(i)
    detok.finalize()
    return detok.text


def randomize(model) -> None:
    """Seeded random weights; 1-D ones (norms) around 1, so that a swapped or unshifted norm shows."""
    mx.random.seed(0)
    model.update(tree_map(lambda p: mx.random.normal(p.shape) * 0.2 + (p.ndim == 1), model.parameters()))
    mx.eval(model.parameters())


def quantized_round_trip(w: mx.array, qtype: gguf.GGMLQuantizationType) -> mx.array:
    """The values a tensor of this type stores for w."""
    return mx.array(gguf.quants.dequantize(gguf.quants.quantize(np.array(w), qtype), qtype))


def shape_metadata(args, arch: str) -> dict[str, Any]:
    """The {arch}.* keys every decoder-only model has, from mlx-lm ModelArgs."""
    return {
        f"{arch}.block_count": args.num_hidden_layers,
        f"{arch}.context_length": args.max_position_embeddings,
        f"{arch}.embedding_length": args.hidden_size,
        f"{arch}.feed_forward_length": args.intermediate_size,
        f"{arch}.attention.head_count": args.num_attention_heads,
        f"{arch}.attention.head_count_kv": args.num_key_value_heads,
        f"{arch}.attention.layer_norm_rms_epsilon": float(args.rms_norm_eps),
        f"{arch}.rope.freq_base": float(args.rope_theta),
    }


def write_gguf(path: Path, arch: str, metadata: dict[str, Any], tensors: Iterable[Tensor]) -> None:
    writer = gguf.GGUFWriter(str(path), arch)
    for key, value in metadata.items():
        writer.add_key_value(key, value, gguf.GGUFValueType.get_type(value))
    for name, w, qtype in tensors:
        if qtype is None:
            writer.add_tensor(name, w.astype(np.float32))
        elif w.dtype == np.uint8:
            writer.add_tensor(name, w, raw_dtype=qtype)
        else:
            writer.add_tensor(name, gguf.quants.quantize(w.astype(np.float32), qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
