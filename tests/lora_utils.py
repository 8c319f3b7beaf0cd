"""LoRA test helpers: random-weight adapters made with mlx-lm's own LoRA layers (nonzero B, so that
they change the output) and saved in mlx-lm's format, and mlx-lm's own generation with an adapter
loaded as `mlx_lm.load(..., adapter_path=...)` loads it."""

from __future__ import annotations

import json
import os
from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten
from utils import assert_solo_greedy, solo_greedy

from pagedmlx.loaders.random_model import random_model


def fresh(arch: str = "llama-tiny") -> Callable[[], nn.Module]:
    """A factory of the random-weight model (a new instance each call: adapters change the tree)."""
    return lambda: random_model(arch, 0)


def make_adapter(path: str, base: Callable[[], nn.Module], *, rank: int, scale: float, seed: int,
                 keys: Optional[list[str]] = None, num_layers: int = -1, dora: bool = False,
                 dropout: float = 0.0, b_std: float = 0.2) -> str:
    """Train nothing: mlx-lm's linear_to_lora_layers on the base, B (and DoRA's m) randomised, the
    trainable parameters saved as mlx_lm.lora saves them."""
    from mlx_lm.tuner.utils import linear_to_lora_layers

    model = base()
    model.freeze()
    params = {"rank": rank, "scale": scale, "dropout": dropout, **({"keys": keys} if keys is not None else {})}
    linear_to_lora_layers(model, num_layers, params, use_dora=dora)
    mx.random.seed(seed)
    for _, module in model.named_modules():
        if "lora_b" in module:
            module.lora_b = mx.random.normal(module.lora_b.shape) * b_std
            if dora:
                module.m = module.m * (1 + 0.3 * mx.random.normal(module.m.shape))
    os.makedirs(path, exist_ok=True)
    mx.save_safetensors(os.path.join(path, "adapters.safetensors"), dict(tree_flatten(model.trainable_parameters())))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"fine_tune_type": "dora" if dora else "lora", "num_layers": num_layers, "lora_parameters": params,
                   "model": "random"}, f)
    return path


def with_adapter(base: Callable[[], nn.Module], path: Optional[str]) -> nn.Module:
    """The base with the adapter applied as mlx_lm.load(model, adapter_path=path) applies it."""
    from mlx_lm.utils import load_adapters

    model = base()
    if path is not None:
        load_adapters(model, path)
    model.eval()
    return model


class References:
    """mlx-lm's solo greedy tokens, per adapter path (None: the base) and prompt."""

    def __init__(self, base: Callable[[], nn.Module]):
        self.base, self.models = base, {}

    def model(self, path: Optional[str]) -> nn.Module:
        if path not in self.models:
            self.models[path] = with_adapter(self.base, path)
        return self.models[path]

    def __call__(self, path: Optional[str], prompt: list[int], max_tokens: int) -> list[int]:
        return solo_greedy(self.model(path), prompt, max_tokens)

    def check(self, got: list[int], path: Optional[str], prompt: list[int], max_tokens: int, what: object) -> None:
        """`got` is the adapter's greedy output for `prompt` alone, up to rounding's near ties (utils)."""
        assert_solo_greedy(got, self.model(path), prompt, max_tokens, what)


# Four adapters that differ in everything the format lets them: keys, layers, rank, scale, DoRA.
ADAPTER_SPECS = [
    dict(rank=4, scale=10.0, keys=["self_attn.q_proj", "self_attn.v_proj"], num_layers=2, seed=1),
    dict(rank=8, scale=5.0, num_layers=1, seed=2, dropout=0.05),  # every linear of the last layer
    dict(rank=4, scale=8.0, keys=["self_attn.q_proj", "mlp.down_proj"], num_layers=-1, seed=3, dora=True),
    dict(rank=2, scale=20.0, keys=["mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj"], num_layers=-1, seed=4),
]
