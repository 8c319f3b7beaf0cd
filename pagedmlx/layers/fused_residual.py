"""Fused residual adds (vLLM's fused_add_rms_norm in its decoder layers) for stock mlx-lm pre-norm models.

A pre-norm layer computes `h = x + attn(norm1(x)); out = h + mlp(norm2(h))`, and the next layer (or the model's
final norm) normalizes `out` first: each residual add is one launch and the RMSNorm after it another. Inside
`fused_residuals()` (the runner's forward pass) a layer returns the pair (h, mlp output) unadded, and whoever
takes it next, the next layer's input norm or the final norm, adds and normalizes in one launch
(kernels/add_rms_norm.py): two launches a layer fewer, where a small batch's GPU step is bound by dispatching
them.

The model's code is left as it is: its layers and final norm become subclasses whose calls do this only
inside `fused_residuals()`, so mlx-lm's own generation on the same model object (the load-time check's
reference included) runs exactly as before. Layers are found, not named: every layer of the body must have
nn.RMSNorm `input_layernorm` / `post_attention_layernorm`, `self_attn` and `mlp`, and the body an nn.RMSNorm
`norm`; then a probe (a prefill and a decode on mlx-lm's own caches) must give the body's own output within the
kernel's tolerance, or the swap is undone. A layer that does more than the standard pattern (scaled residuals,
extra norms) fails the probe and keeps its own call.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, ContextManager, NamedTuple, Optional

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import make_prompt_cache

from pagedmlx.kernels import add_rms_norm
from pagedmlx.kernels.check import error_line
from pagedmlx.runner.selfcheck import relative_error
from pagedmlx.runner.thread_flag import ThreadFlag

logger = logging.getLogger("pagedmlx")


_active = ThreadFlag()


def fused_residuals() -> ContextManager[None]:
    """Fused layers pass their residual unadded (in this thread) while inside."""
    return _active.scope()


class Residual(NamedTuple):
    """The residual stream h and a sublayer's output r, still to be added."""
    h: mx.array
    r: mx.array


def _add_norm(res: Residual, norm: nn.RMSNorm) -> tuple[mx.array, mx.array]:
    return add_rms_norm.add_rms_norm(res.h, res.r, norm.weight, norm.eps, norm._pagedmlx_backend)


def _layer_call(self, x, *args, **kwargs):
    if not _active.on:
        return type(self).__bases__[0].__call__(self, x, *args, **kwargs)
    if isinstance(x, Residual):
        h, n = _add_norm(x, self.input_layernorm)
    else:
        h, n = x, self.input_layernorm(x)
    h, n = _add_norm(Residual(h, self.self_attn(n, *args, **kwargs)), self.post_attention_layernorm)
    return Residual(h, self.mlp(n))


def _norm_call(self, x):
    if isinstance(x, Residual):
        return _add_norm(x, self)[1]
    return type(self).__bases__[0].__call__(self, x)


@functools.lru_cache(maxsize=None)
def _fused_class(cls: type, call) -> type:
    return type(f"Fused{cls.__name__}", (cls,), {"__call__": call, "_pagedmlx_fused": True})


def _own_class(m: Any) -> type:
    """The module's class before a swap (another runner on the same model may have swapped it)."""
    cls = type(m)
    return cls.__bases__[0] if cls.__dict__.get("_pagedmlx_fused") else cls


def _is_norm(m: Any) -> bool:
    return _own_class(m) is nn.RMSNorm


def _candidate(body: Any) -> Optional[str]:
    """Why the body cannot be fused, or None."""
    layers = getattr(body, "layers", None)
    if not isinstance(body, nn.Module) or not isinstance(layers, list) or not layers:
        return "no list of layers"
    if not _is_norm(getattr(body, "norm", None)):
        return "no nn.RMSNorm final norm"
    for layer in layers:
        if not (_is_norm(getattr(layer, "input_layernorm", None))
                and _is_norm(getattr(layer, "post_attention_layernorm", None))
                and isinstance(getattr(layer, "self_attn", None), nn.Module)
                and isinstance(getattr(layer, "mlp", None), nn.Module)):
            return f"a layer ({type(layer).__name__}) is not a pre-norm block of nn.RMSNorm, self_attn and mlp"
    return None


def _swap(body: nn.Module, backend: Optional[str]) -> list:
    """The modules whose classes this call swapped (none that another runner's call already did)."""
    swapped = []
    for m, call in [*((layer, _layer_call) for layer in body.layers), (body.norm, _norm_call)]:
        if type(m) is _own_class(m):
            m.__class__ = _fused_class(type(m), call)
            swapped.append(m)
    for norm in [body.norm,
                 *(n for layer in body.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]:
        norm._pagedmlx_backend = backend
    return swapped


def fuse_norms(setting: bool, model: nn.Module, body: Any, plan: Any) -> bool:
    """EngineConfig.fuse_norms at load: when asked (off by default: on an H100 it made Llama-8B's batch-1 decode
    0.87x as fast, docs/benchmarks.md), fuse where the kernel runs here (a GPU backend whose kernels are on) and
    passes its check at the model's width and dtype, and the body passes its probe. Says why not."""
    from pagedmlx.kernels.selector import select_norm_kernel

    if not setting or body is None:
        return False
    why = _candidate(body)
    backend = None
    if why is None:
        backend, why = select_norm_kernel(plan, body.norm.weight.shape[0], body.norm.weight.dtype)
    if why is None:
        why = fuse_residual_norms(model, body, backend)
    if why is not None:
        logger.warning("residual adds not fused with their norms: %s", why)
        return False
    logger.info("fused %d layers' residual adds with the RMSNorms after them (layers/fused_residual.py)",
                len(body.layers))
    return True


def fuse_residual_norms(model: nn.Module, body: Any, backend: Optional[str]) -> Optional[str]:
    """Fuse the body's residual adds with the norms after them (inside fused_residuals()), launching
    kernels/add_rms_norm.py for `backend`. None where it did, else why not (the body left as it was)."""
    why = _candidate(body)
    if why is not None:
        return why
    swapped = _swap(body, backend)
    try:
        why = _probe(model, body)
    except Exception as exc:  # noqa: BLE001 - a body that cannot take the pairs: it keeps its own calls
        why = f"the probe failed ({error_line(exc)})"
    if why is not None:
        for m in swapped:
            m.__class__ = type(m).__bases__[0]
    return why


def _probe(model: nn.Module, body: nn.Module) -> Optional[str]:
    """The body's output fused against its own on mlx-lm's caches: a 3-token prefill, then a decode."""
    dtype = body.norm.weight.dtype
    tol = add_rms_norm.TOLERANCE.get(dtype, 2e-2)
    caches = [make_prompt_cache(model), make_prompt_cache(model)]
    for tokens in ([[1, 2, 3]], [[4]]):
        inputs = mx.array(tokens)
        want = body(inputs, cache=caches[0])
        with fused_residuals():
            got = body(inputs, cache=caches[1])
        if not isinstance(got, mx.array) or got.shape != want.shape:
            return "the body's output is not the final norm's"
        err = relative_error(got, want)
        if not err <= tol:
            return f"the fused body differs from the model's own by {err:.2e} > {tol:.0e}"
    return None
