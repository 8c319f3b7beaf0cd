"""ModelRunner: runs one step's tokens through a stock mlx-lm model with its KV in pages."""

from __future__ import annotations

from typing import Callable, Optional

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.runner.attention import AttentionMetadata, KVPool, PagedLayerCache, install_paged_attention
from pagedmlx.runner.kernel_check import select_kernels
from pagedmlx.scheduler_output import SchedulerOutput


class UnsupportedModelError(ValueError):
    pass


class _ShapeProbe:
    """A cache that records each layer's K/V shapes and attends over the new tokens only."""

    def __init__(self):
        self.offset = 0
        self.spec = None
        self.n_heads, self.sinks = None, False

    def record_queries(self, queries, sinks) -> None:  # called by the attention dispatcher
        self.n_heads, self.sinks = queries.shape[1], sinks is not None

    def make_mask(self, *args, **kwargs):
        return None

    def update_and_fetch(self, keys, values):
        self.spec = (keys.shape[1], keys.shape[3], values.shape[3], keys.dtype)
        return keys, values


def model_type(model: nn.Module) -> str:
    args = getattr(model, "args", None)
    return getattr(args, "model_type", None) or getattr(model, "model_type", None) or type(model).__module__


def _check_cache_types(model: nn.Module) -> int:
    """Refuse models whose layers need more than a plain KV cache. Returns the number of layers."""
    from mlx_lm.models.cache import KVCache, make_prompt_cache

    caches = make_prompt_cache(model)
    for i, c in enumerate(caches):
        if type(c) is not KVCache:
            kind = {"RotatingKVCache": "sliding-window attention",
                    "ArraysCache": "recurrent (SSM / linear attention) state",
                    "MambaCache": "recurrent (SSM) state"}.get(type(c).__name__, type(c).__name__)
            raise UnsupportedModelError(
                f"model type {model_type(model)!r} is not supported yet: layer {i} needs {kind} "
                f"({type(c).__name__}), which pagedmlx does not keep in pages")
    return len(caches)


class ModelRunner:
    """Owns the model and its page pool; turns a SchedulerOutput into the logits of sampled rows."""

    def __init__(self, model: nn.Module, block_size: int, num_blocks: Optional[int] = None,
                 kv_cache_memory_gb: float = 2.0, verify: bool = True):
        self.model = model
        self.block_size = block_size
        self.num_layers = _check_cache_types(model)
        if install_paged_attention(model) == 0:
            raise UnsupportedModelError(
                f"model type {model_type(model)!r} does not call mlx-lm's scaled_dot_product_attention")
        self._body, self._head = self._split_head()
        self.layer_specs = self._probe_layer_specs()
        # Where the paged kernels run and pass their load-time check, decode rows read the pages
        # through the block table (and on CUDA new K/V are written in place); elsewhere MLX
        # scatters the writes and decode rows gather the pages.
        self.kernels = select_kernels(self.layer_specs, self.query_heads, block_size, sinks=self.has_sinks)
        self.decode_kernel_kv_heads = self.layer_specs[0][0] if self.kernels.decode else 0
        if verify:
            self._verify_against_mlx_lm()
        if num_blocks is None:
            num_blocks = max(2, int(kv_cache_memory_gb * 1e9) // self.bytes_per_block)
        self.kv_pool = KVPool(num_blocks, block_size, self.layer_specs)

    @property
    def pages_in_place(self) -> bool:
        """Pages written by a kernel in place (CUDA): a step may be dispatched while the previous
        one still runs. Elsewhere MLX scatters into the pools, which copies a pool that anything
        else (a step in flight) still references."""
        return self.kernels.page_write

    @property
    def num_blocks(self) -> int:
        return self.kv_pool.num_blocks

    @property
    def bytes_per_block(self) -> int:
        return sum(self.block_size * h * (dk + dv) * dt.size for h, dk, dv, dt in self.layer_specs)

    def _split_head(self) -> tuple[Optional[Callable], Optional[Callable]]:
        """Find the transformer body and LM head so that only sampled rows are projected to the
        vocabulary. Models that do more between the two (logit scaling, soft-capping) are caught
        by the verification below and run whole."""
        m = self.model
        body = getattr(m, "model", None)
        if not callable(body):
            return None, None
        if getattr(m, "lm_head", None) is not None:
            return body, m.lm_head
        if getattr(getattr(m, "args", None), "tie_word_embeddings", False) and hasattr(body, "embed_tokens"):
            return body, body.embed_tokens.as_linear
        return None, None

    def _probe_layer_specs(self) -> list[tuple[int, int, int, mx.Dtype]]:
        probes = [_ShapeProbe() for _ in range(self.num_layers)]
        logits = self.model(mx.array([[1]]), cache=probes)
        mx.eval(logits)
        self.vocab_size = logits.shape[-1]
        self.query_heads = [p.n_heads for p in probes]
        self.has_sinks = any(p.sinks for p in probes)
        if any(p.spec is None for p in probes):
            raise UnsupportedModelError(
                f"model type {model_type(self.model)!r}: some layers never wrote K/V through their cache")
        return [p.spec for p in probes]

    def forward(self, so: SchedulerOutput, prev_sampled: Optional[mx.array] = None) -> mx.array:
        """Logits (S, V) of the rows in so.logits_indices. `prev_sampled`: the previous step's
        sampled tokens, still on the device, for the rows in so.placeholder_rows.

        Lazy where MLX scatters the pages. Where kernels write them in place, the step is
        dispatched (mx.async_eval) before this returns: MLX sees no dependency between one step's
        page reads and the next step's writes, so steps must reach the device in order."""
        md = AttentionMetadata.build(so, self.block_size, self.decode_kernel_kv_heads, self.kernels.page_write)
        caches = [PagedLayerCache(i, self.kv_pool, md) for i in range(self.num_layers)]
        inputs = md.input_ids
        if md.placeholder_rows is not None:
            inputs = mx.put_along_axis(inputs, md.placeholder_rows,
                                       prev_sampled[md.placeholder_src].astype(inputs.dtype), axis=0)
        inputs = inputs[:, None]
        if self._head is not None:
            h = self._body(inputs, cache=caches)
            logits = self._head(h[md.logits_indices])[:, 0, :]
        else:
            logits = self.model(inputs, cache=caches)[md.logits_indices][:, 0, :]
        if self.pages_in_place:
            mx.async_eval(logits)
        return logits

    def _verify_against_mlx_lm(self) -> None:
        """Run a short mixed step on pages and compare with mlx-lm's own KVCache; fall back to the
        whole model call if the split head disagrees, refuse the model if pages disagree."""
        from pagedmlx.runner.selfcheck import check_paged_forward

        err = check_paged_forward(self)
        if err is not None and self.kernels.enabled:  # the portable path may still be right
            self.kernels = self.kernels.switch_off(f"the model's paged forward disagrees with mlx-lm ({err})")
            self.decode_kernel_kv_heads = 0
            err = check_paged_forward(self)
        if err is not None and self._head is not None:
            self._body = self._head = None
            err = check_paged_forward(self)
        if err is not None:
            raise UnsupportedModelError(
                f"model type {model_type(self.model)!r} gives different logits on pages than with "
                f"mlx-lm's KVCache ({err}); refusing to serve wrong tokens")
