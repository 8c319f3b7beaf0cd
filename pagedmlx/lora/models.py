"""LoRAModel: one mlx-lm adapter folder read and checked against the served model (vLLM's
vllm/lora/models.py, for mlx-lm's format).

The folder is what `mlx_lm.lora` writes: adapter_config.json (fine_tune_type "lora" or "dora",
num_layers, lora_parameters {rank, scale, dropout, keys}) and adapters.safetensors with, per targeted
module, `<path>.lora_a` (in, rank), `<path>.lora_b` (rank, out) and for DoRA `<path>.m` (out,). The
targets are chosen as mlx-lm's linear_to_lora_layers chooses them: the `keys` (by default every
linear module of a layer) of the last `num_layers` layers of `model.layers`. Anything this engine
cannot serve the way mlx-lm would compute it is refused here, with the reason, before any request
runs with it: a missing or unreadable folder, a full fine-tune, a rank above max_lora_rank, targets
that are not Linear / QuantizedLinear layers, weights for modules the model does not have or of
other shapes (an adapter trained on another base model)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.lora.request import LoRARequest

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapters.safetensors"
FINE_TUNE_TYPES = ("lora", "dora")


class LoRAError(ValueError):
    """An adapter that cannot be served; the message begins "adapter '<name>'" and says why."""


@dataclass
class LoRALayerWeights:
    """One targeted module's low-rank pair (vLLM's name), in mlx-lm's layout."""

    module_name: str  # its path in the model, e.g. model.layers.1.self_attn.q_proj
    lora_a: mx.array  # (in, rank)
    lora_b: mx.array  # (rank, out)
    # DoRA: m / ||W + scale * (A B)^T|| per output row, as mlx-lm's DoRALinear scales its output
    # (computed once here: W is the served base weight, fixed); None for LoRA.
    norm_scale: Optional[mx.array] = None

    @property
    def rank(self) -> int:
        return int(self.lora_a.shape[1])


@dataclass
class LoRAModel:
    id: int
    name: str
    path: str
    rank: int
    scale: float
    fine_tune_type: str  # "lora" or "dora"
    loras: dict[str, LoRALayerWeights]  # by module path

    @property
    def is_dora(self) -> bool:
        return self.fine_tune_type == "dora"

    @classmethod
    def from_local_checkpoint(cls, request: LoRARequest, model: nn.Module, max_lora_rank: int) -> "LoRAModel":
        name = request.lora_name
        folder = Path(request.lora_path)

        def fail(reason: str) -> LoRAError:
            return LoRAError(f"adapter {name!r} ({request.lora_path}): {reason}")

        if not (folder / ADAPTER_CONFIG).is_file() or not (folder / ADAPTER_WEIGHTS).is_file():
            raise fail(f"No adapter found: the folder needs {ADAPTER_CONFIG} and {ADAPTER_WEIGHTS} (mlx-lm's format)")
        try:
            config = json.loads((folder / ADAPTER_CONFIG).read_text())
            weights = mx.load(str(folder / ADAPTER_WEIGHTS))
        except (OSError, ValueError, RuntimeError) as exc:
            raise fail(f"could not be read: {exc}") from None
        fine_tune_type = config.get("fine_tune_type", "lora")
        if fine_tune_type not in FINE_TUNE_TYPES:
            raise fail(f"fine_tune_type {fine_tune_type!r} is not an adapter this engine serves (lora or dora)"
                       + ("; a full fine-tune is a whole model: serve it as the model" if fine_tune_type == "full"
                          else ""))
        params = config.get("lora_parameters")
        if not isinstance(params, dict) or "rank" not in params or "scale" not in params:
            raise fail("adapter_config.json needs lora_parameters with rank and scale (mlx-lm's names; "
                       "mlx-lm's scale is not alpha)")
        rank, scale = params["rank"], params["scale"]
        if not isinstance(rank, int) or rank < 1:
            raise fail(f"rank must be an integer >= 1, got {rank!r}")
        if rank > max_lora_rank:
            raise fail(f"rank {rank} exceeds max_lora_rank {max_lora_rank} (--max-lora-rank)")
        if not isinstance(scale, (int, float)) or not math.isfinite(scale):
            raise fail(f"scale must be a finite number, got {scale!r}")
        num_layers = config.get("num_layers")
        if not isinstance(num_layers, int):
            raise fail(f"num_layers must be an integer, got {num_layers!r}")
        try:
            targets = target_modules(model, num_layers, params.get("keys"))
        except ValueError as exc:
            raise fail(str(exc)) from None
        loras = _read_weights(targets, weights, rank, float(scale), fine_tune_type == "dora", fail)
        return cls(request.lora_int_id, name, request.lora_path, rank, float(scale), fine_tune_type, loras)


def linear_dims(layer: nn.Module) -> tuple[int, int]:
    """(in, out) of a Linear or QuantizedLinear, as mlx-lm's LoRALinear.from_base reads them."""
    out_dims, in_dims = layer.weight.shape
    if isinstance(layer, nn.QuantizedLinear):
        in_dims = in_dims * 32 // layer.bits
    return int(in_dims), int(out_dims)


def dense_weight(layer: nn.Module) -> mx.array:
    """The base weight (out, in), dequantized as mlx-lm's DoRALinear does."""
    if isinstance(layer, nn.QuantizedLinear):
        return mx.dequantize(layer.weight, layer.scales, layer.biases, group_size=layer.group_size,
                             bits=layer.bits, mode=layer.mode)
    return layer.weight


def _is_lora_candidate(module: Any) -> bool:
    """What mlx-lm's linear_to_lora_layers converts when an adapter names no keys."""
    from mlx_lm.models.switch_layers import QuantizedSwitchLinear, SwitchLinear

    types = (nn.Linear, nn.QuantizedLinear, SwitchLinear, QuantizedSwitchLinear, nn.Embedding, nn.QuantizedEmbedding)
    return hasattr(module, "to_lora") or isinstance(module, types)


def target_modules(model: nn.Module, num_layers: int, keys: Optional[list[str]]) -> dict[str, nn.Module]:
    """The modules mlx-lm would turn into LoRA layers, by path; ValueError for those this engine
    cannot serve (not Linear / QuantizedLinear, or outside the transformer layers)."""
    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"the model ({type(model).__name__}) has no `layers`, which mlx-lm's adapters target")
    paths = {id(m): p for p, m in model.named_modules()}
    if keys is None:
        found: set[str] = set()
        for layer in layers:
            found.update(k for k, m in _named(layer) if _is_lora_candidate(m))
        keys = sorted(found)
    keys = set(keys)
    targets: dict[str, nn.Module] = {}
    for layer in layers[-max(num_layers, 0):]:
        for key, module in _named(layer):
            if key in keys:
                targets[f"{paths[id(layer)]}.{key}"] = module
    outside = [p for p, _ in _named(model) if p in keys]
    if outside:
        raise ValueError(f"keys outside the transformer layers ({', '.join(sorted(outside))}) are not served: "
                         "only linear layers inside model.layers take adapters here")
    bad = {p: type(m).__name__ for p, m in targets.items()
           if not isinstance(m, (nn.Linear, nn.QuantizedLinear)) or hasattr(m, "to_lora")}
    if bad:
        first = sorted(bad)[:3]
        raise ValueError(f"only Linear and QuantizedLinear layers take adapters here, not "
                         f"{', '.join(f'{p} ({bad[p]})' for p in first)}" + (" ..." if len(bad) > 3 else ""))
    if not targets:
        raise ValueError(f"no module of the model matches the adapter's keys {sorted(keys)[:6]}")
    return targets


def _named(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """named_modules, where a layer already wrapped for LoRA (layers.py's LinearWithLoRA, which says so
    with `wraps_base_layer`: no import of layers.py, which imports this module) stands for the layer it wraps."""
    from pagedmlx.layers.merged_linear import MergedLinear, separate

    items = module.named_modules()
    wrapped = {p for p, m in items if getattr(m, "wraps_base_layer", False)}
    # a merged projection (layers/merged_linear.py) stands for its own rows; its merged weights are no layer
    merged_weights = {f"{p}.base_layer.linear" if p in wrapped else f"{p}.linear" for p, m in items
                      if isinstance(m.base_layer if p in wrapped else m, MergedLinear)}
    return [(p, separate(m.base_layer if p in wrapped else m)) for p, m in items
            if not (p.endswith("base_layer") and p[:-len(".base_layer")] in wrapped) and p not in merged_weights]


def _read_weights(targets: dict[str, nn.Module], weights: dict[str, mx.array], rank: int, scale: float,
                  dora: bool, fail) -> dict[str, LoRALayerWeights]:
    """Each target's pair from the file, checked against the model; a target the file leaves out
    keeps mlx-lm's initial B = 0, i.e. changes nothing (and is not stored)."""
    expected: dict[str, tuple[int, ...]] = {}
    for path, module in targets.items():
        in_dims, out_dims = linear_dims(module)
        expected[f"{path}.lora_a"] = (in_dims, rank)
        expected[f"{path}.lora_b"] = (rank, out_dims)
        if dora:
            expected[f"{path}.m"] = (out_dims,)
    unknown = sorted(set(weights) - set(expected))
    if unknown:
        raise fail(f"{len(unknown)} tensors are not adapter parameters of this model's targeted layers "
                   f"(trained on another base model?): {', '.join(unknown[:4])}" + (" ..." if len(unknown) > 4 else ""))
    wrong = [f"{k}: {tuple(w.shape)} != the model's {expected[k]}" for k, w in sorted(weights.items())
             if tuple(w.shape) != expected[k]]
    if wrong:
        raise fail(f"shapes do not match the base model (trained on another base model?): {'; '.join(wrong[:3])}"
                   + (" ..." if len(wrong) > 3 else ""))
    out = {}
    for path, module in targets.items():
        a, b = weights.get(f"{path}.lora_a"), weights.get(f"{path}.lora_b")
        if a is None or b is None:
            continue  # mlx-lm's LoRA layer with B = 0 (and DoRA's m = ||W||): the base layer
        norm_scale = None
        if dora:
            w = dense_weight(module)
            m = weights.get(f"{path}.m")
            if m is None:
                m = mx.linalg.norm(w.astype(mx.float32), axis=1)
            # mlx-lm's DoRALinear.__call__, with its fixed W: m / ||W + scale * B^T A^T|| per output row
            norm_scale = m / mx.linalg.norm(w + (scale * b.T) @ a.T, axis=1)
        out[path] = LoRALayerWeights(path, a, b, norm_scale)
    mx.eval([x for w in out.values() for x in (w.lora_a, w.lora_b, w.norm_scale) if x is not None])
    return out
