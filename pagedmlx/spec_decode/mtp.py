"""The multi-token-prediction (MTP) module of Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoints, as a one-layer
mlx-lm-shaped model that the draft-model machinery runs on its own pages (spec_decode/mtp_proposer.py).

What the checkpoint holds under `mtp.` (vLLM's qwen3_next_mtp.py reads the same): `fc` (2H -> H),
`pre_fc_norm_embedding`, `pre_fc_norm_hidden`, one decoder layer `layers.0` (full attention, the model's
own MLP or MoE) and `norm`; the token embedding and LM head are the target's. A row at position i takes
the embedding of token i + 1 and the target's final hidden state at i (after its last norm), and its
logits propose token i + 2; the next draft row takes the MTP's own output hidden state instead.

mlx-lm drops the `mtp.` weights when it loads or converts these models (their sanitize), so mlx-community
conversions have none: the weights are read here from the original checkpoint's safetensors, and put
through the target's own sanitize as if they were its full-attention layer's (expert stacking and the
like), the norms shifted by one where mlx-lm shifts the model's (zero-centred norms in the checkpoint).
"""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_attention_mask

MTP_MODEL_TYPES = ("qwen3_5", "qwen3_5_moe", "qwen3_next")


def text_model(target: nn.Module) -> nn.Module:
    """The causal LM inside a multimodal wrapper (Qwen3.5 loads wrapped), else the model itself."""
    text = getattr(target, "language_model", None)
    return text if isinstance(text, nn.Module) else target


class MTPBody(nn.Module):
    """embed(token) and the target's hidden state -> fc -> one decoder layer -> norm (MTPModel's `model`)."""

    def __init__(self, args: Any, embed_tokens: nn.Module, layer: nn.Module):
        super().__init__()
        h, eps = args.hidden_size, args.rms_norm_eps
        self.embed_tokens = embed_tokens  # the target's
        self.pre_fc_norm_embedding = nn.RMSNorm(h, eps=eps)
        self.pre_fc_norm_hidden = nn.RMSNorm(h, eps=eps)
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = [layer]
        self.norm = nn.RMSNorm(h, eps=eps)
        self.hidden: Optional[mx.array] = None  # each row's input hidden state, set before a forward (the proposer)

    def __call__(self, inputs: mx.array, cache: Optional[list] = None, input_embeddings: Optional[mx.array] = None):
        e = input_embeddings if input_embeddings is not None else self.embed_tokens(inputs)
        hidden = self.hidden if self.hidden is not None else mx.zeros_like(e)  # zeros: the load-time check
        x = self.fc(mx.concatenate([self.pre_fc_norm_embedding(e), self.pre_fc_norm_hidden(hidden)], axis=-1))
        cache = cache if cache is not None else [None]
        x = self.layers[0](x, mask=create_attention_mask(x, cache[0]), cache=cache[0])
        return self.norm(x)


class MTPModel(nn.Module):
    """An MTP module with the target's embedding and head, shaped as an mlx-lm model (`model`, `lm_head`,
    `layers`, `make_cache`), so that a ModelRunner plans, pages and checks it as any draft model."""

    def __init__(self, target: nn.Module):
        super().__init__()
        text = text_model(target)
        body = text.model
        self.model_type = f"{getattr(text, 'model_type', None) or target.model_type}_mtp"
        self.args = text.args
        full = next((i for i, layer in enumerate(body.layers) if not layer.is_linear), None)
        if full is None:
            raise ValueError("the target has no full-attention layer to build the MTP layer from")
        self.layer_index = full  # the target layer whose kind the MTP layer is (its weights' keys in sanitize)
        self.model = MTPBody(self.args, body.embed_tokens, type(body.layers[full])(self.args, layer_idx=full))
        tied = getattr(self.args, "tie_word_embeddings", False) or not hasattr(text, "lm_head")
        self.lm_head = body.embed_tokens.as_linear if tied else text.lm_head

    def __call__(self, inputs: mx.array, cache: Optional[list] = None) -> mx.array:
        return self.lm_head(self.model(inputs, cache))

    @property
    def layers(self) -> list:
        return self.model.layers

    def make_cache(self) -> list:
        from mlx_lm.models.cache import KVCache

        return [KVCache()]


def check_target(target: nn.Module) -> None:
    """A ValueError naming the reason unless the target is a model type with an MTP module here."""
    kind = getattr(text_model(target), "model_type", None) or getattr(target, "model_type", None)
    if getattr(target, "model_type", None) not in MTP_MODEL_TYPES and kind not in MTP_MODEL_TYPES:
        raise ValueError(f"speculative_config.method 'mtp' needs a target with an MTP module (model types "
                         f"{', '.join(MTP_MODEL_TYPES)}); model type {getattr(target, 'model_type', None)!r} has none")


def safetensors_keys(path: Path) -> dict[str, list[int]]:
    """A .safetensors file's tensor names and shapes, from its header (no tensor is read)."""
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {k: v["shape"] for k, v in header.items() if k != "__metadata__"}


def read_mtp_weights(folder: str | Path) -> tuple[dict[str, mx.array], bool]:
    """The checkpoint's (a folder, or a hub id in the local hub cache) `mtp.` tensors, keyed after `mtp.`
    (`fc.weight`, `layers.0.self_attn.q_proj.weight`, ...), and whether its norms are zero-centred (the
    checkpoint's convolution weights are in the original layout: mlx-lm's own rule for shifting the norms).
    A FileNotFoundError or ValueError naming what is missing."""
    from pagedmlx.loaders.loader import model_folder

    files = sorted((model_folder(str(folder)) or Path(folder)).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"speculative_config.method 'mtp': no .safetensors files in {str(folder)!r}")
    weights, zero_centred = {}, False
    for f in files:
        shapes = safetensors_keys(f)
        zero_centred |= any("conv1d.weight" in k and s[-1] != 1 for k, s in shapes.items())
        names = [k for k in shapes if k.startswith("mtp.") or ".mtp." in k]
        if names:
            loaded = mx.load(str(f))
            weights.update({k[k.index("mtp.") + 4:]: loaded[k] for k in names})
    if not weights:
        raise ValueError(f"speculative_config.method 'mtp': the checkpoint in {str(folder)!r} has no mtp.* weights "
                         "(mlx-lm conversions drop them: use the original Hugging Face checkpoint)")
    return weights, zero_centred


def load_mtp_weights(mtp: MTPModel, target: nn.Module, weights: dict[str, mx.array], zero_centred: bool) -> None:
    """Put the checkpoint's MTP tensors (read_mtp_weights) into `mtp`: the layer's through the target's own
    sanitize as its full-attention layer's; where zero_centred, every norm shifted by one that sanitize left
    as it was (Qwen3-Next's shifts its MoE layers' norms itself). Raises a ValueError naming a missing or
    unexpected tensor."""
    layer_prefix = "layers.0."
    i, wrapped = mtp.layer_index, text_model(target) is not target
    as_target = {f"{'model.language_model' if wrapped else 'model'}.layers.{i}.{k[len(layer_prefix):]}": v
                 for k, v in weights.items() if k.startswith(layer_prefix)}
    sanitized = target.sanitize(dict(as_target)) if hasattr(target, "sanitize") else as_target
    prefix = f"{'language_model.model' if wrapped else 'model'}.layers.{i}."
    untouched = {id(v) for v in as_target.values()}
    params = {f"model.layers.0.{k[len(prefix):]}": (v, id(v) in untouched) for k, v in sanitized.items()
              if k.startswith(prefix)}
    params.update({f"model.{k}": (v, True) for k, v in weights.items() if not k.startswith(layer_prefix)})
    params = {k: v + 1.0 if zero_centred and as_read and v.ndim == 1 and k.endswith("norm.weight") else v
              for k, (v, as_read) in params.items()}
    own = {f"model.{k}" for k, _ in nn.utils.tree_flatten(mtp.model.parameters()) if not k.startswith("embed_tokens.")}
    missing, extra = sorted(own - set(params)), sorted(set(params) - own)
    if missing or extra:
        more = len(missing) + len(extra) - 1
        raise ValueError(f"speculative_config.method 'mtp': the checkpoint's MTP weights do not fit this model "
                         f"({'missing ' + missing[0] if missing else 'unexpected ' + extra[0]}"
                         f"{f' and {more} more' if more else ''})")
    mtp.load_weights(list(params.items()), strict=False)


def make_mtp_model(target: nn.Module, source: Any = None, dtype: Optional[str] = None) -> MTPModel:
    """The target's MTP module. source: the checkpoint folder (its mtp.* weights), a dict of them (keys after
    `mtp.`, in the checkpoint's layout: norms zero-centred), or None: random weights (a `random:` target;
    tests), its norms at one."""
    check_target(target)
    mtp = MTPModel(target)
    if source is not None:
        weights, zero_centred = (dict(source), True) if isinstance(source, dict) else read_mtp_weights(source)
        load_mtp_weights(mtp, target, weights, zero_centred)
    floating = (v.dtype for _, v in nn.utils.tree_flatten(target.parameters()) if mx.issubdtype(v.dtype, mx.floating))
    mtp.model.set_dtype(getattr(mx, dtype) if dtype is not None else next(floating, mx.float32))  # the target's
    mx.eval(mtp.parameters())
    return mtp
