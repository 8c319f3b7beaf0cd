"""ModelRunner: runs one step's tokens through a stock mlx-lm model with its KV in pages."""

from __future__ import annotations

import contextlib
import logging
from typing import Optional, Protocol

import mlx.core as mx
import mlx.nn as nn

from pagedmlx.config import EngineConfig
from pagedmlx.core.kv.spec import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, SlidingWindowSpec,
                                   sliding_pool_blocks)
from pagedmlx.kernels import build, mlx_jit_warm, prefill_attention, recurrent_state
from pagedmlx.kernels.check import error_line
from pagedmlx.kernels.selector import select_lora_kernel
from pagedmlx.core.kv.cache_dtype import bytes_per_token, layer_quant
from pagedmlx.runner.attention import (KVPool, PagedLayerCache, install_paged_attention)
from pagedmlx.runner.compiled_step import AUTO_MAX_DECODES, CompiledDecode
from pagedmlx.layers.fused_residual import fuse_norms, fused_residuals
from pagedmlx.runner.lm_head import split_lm_head
from pagedmlx.layers.merged_linear import merge_projections, merged_products
from pagedmlx.layers.fused_moe import fuse_switch_glus, use_fused_moe
from pagedmlx.layers.quantized_linear import flat_rows, flatten_quantized, use_quantized_gemm
from pagedmlx.layers.skinny_linear import skinny_products, use_skinny_gemm
from pagedmlx.runner.attention_metadata import (StepMetadata, sdpa_shape_quantum)
from pagedmlx.runner.plan import UnsupportedModelError, model_type, plan_layers
from pagedmlx.runner.selfcheck import LOGIT_TOLERANCE, relative_error
from pagedmlx.runner import check_cache, warm_up
from pagedmlx.runner.verify import verify_against_mlx_lm
from pagedmlx.runner.kernel_paths import select_kernel_plan
from pagedmlx.runner.kv_budget import kv_cache_budget, pool_allocation, weights_nbytes
from pagedmlx.runner.start_times import StartTimes
from pagedmlx.runner.state import (StateLayerCache, StateMetadata, StatePool, install_regrouping, pages_budget,
                                   state_group)
from pagedmlx.core.sched.output import SchedulerOutput

logger = logging.getLogger("pagedmlx")

__all__ = ["ModelRunner", "Runner", "UnsupportedModelError", "model_type", "weights_nbytes"]


def _merges_projections(config: EngineConfig) -> bool:  # EngineConfig.merge_projections: None on GPU backends
    return config.merge_projections if config.merge_projections is not None else mx.default_device() == mx.gpu


class PagesLost(RuntimeError):
    """The runner zeroed its pages (ModelRunner.repair_pages): every running request must recompute."""


class Runner(Protocol):
    """What the engine asks of a runner (ModelRunner here; tp/driver.py's TPDriver on rank 0)."""

    kv_cache_config: KVCacheConfig
    vocab_size: int
    pages_in_place: bool

    def forward(self, so: SchedulerOutput, prev_sampled: Optional[mx.array] = None) -> mx.array: ...

    def repair_pages(self) -> bool: ...


class ModelRunner:
    """Owns the model and its page pools; turns a SchedulerOutput into the logits of sampled rows."""

    def __init__(self, model: nn.Module, config: EngineConfig, verify: bool = True, draft_block_bytes: int = 0,
                 identity: Optional[str] = None):
        """draft_block_bytes: a draft model's bytes per block of the full-attention group (spec_decode/draft_model.py),
        counted in the KV budget. identity: what names the weights (runner/check_cache.py), None: unnamed."""
        self.start_times = StartTimes()
        self.model = model
        self.identity = identity
        self.draft_block_bytes = draft_block_bytes
        self.block_size = config.block_size
        with mlx_jit_warm.building(model):  # MLX's quantized matmul tiles built in other processes meanwhile
            self._merge_and_plan(config, model)
        self.start_times.lap("MLX's quantized matmul built ahead")
        self.kv_budget = kv_cache_budget(config, model, self._body, self._head) if config.num_blocks is None else None
        self.start_times.lap("KV budget's profile step")
        self.kv_cache_config = self._kv_cache_config(config)
        paged = [g for g in self.kv_cache_config.kv_cache_groups if not g.is_state]  # the state group is last
        self.windows = [g.sliding_window for g in paged]
        self.group_of = {i: g for g, group in enumerate(paged) for i in group.layer_ids}
        # Where the paged kernels run and pass their load-time check, decode rows read the pages
        # through the block table (and on CUDA new K/V are written in place); elsewhere MLX
        # scatters the writes and decode rows gather the pages.
        self.kernels = select_kernel_plan(self.plan, self.kv_quant, self.windows, self.block_size, config)
        self.fused_norms = fuse_norms(config.fuse_norms, model, self._body, self.kernels)
        self.start_times.lap("paged kernels' checks")
        self.skinny = use_skinny_gemm(config.skinny_gemm, model, self.kernels.enabled)
        self.start_times.lap("skinny GEMM's check")
        self.quantized_gemm = use_quantized_gemm(config.quantized_gemm, model, self.kernels.enabled)
        self.fused_moe = use_fused_moe(config.quantized_gemm, model, self.kernels.enabled)
        self.start_times.lap("quantized GEMM's check")
        self.sdpa_quantum = (config.sdpa_quantum if config.sdpa_quantum is not None
                             else sdpa_shape_quantum(build.gpu_backend()))
        if self.kernels.state:
            recurrent_state.install_kernels(model, [p.state.owner for p in self.plan if p.state is not None])
        self.state_pool: Optional[StatePool] = None
        self.lora_manager = None  # after the check below: it runs the base model
        self.mm = None  # images: a MultiModalRunner (pagedmlx/multimodal/runner.py), set by the engine
        self.compiled_decode: Optional[CompiledDecode] = None
        self.keep_hidden = False  # logits() keeps the body's output (T, 1, H) in last_hidden
        self.last_hidden: Optional[mx.array] = None
        if verify:
            self._verify_against_mlx_lm(check_cache.runner_check_key(self, identity))
        self.start_times.lap("forward against mlx-lm")
        with pool_allocation(sum(g.num_blocks * g.page_size_bytes for g in self.kv_cache_config.kv_cache_groups)):
            self.kv_pool = self.make_pool(self.kv_cache_config)
            self.state_pool = self.make_state_pool(self.kv_cache_config)
        self.start_times.lap("pools")
        self.lora_manager = self._make_lora_manager(config) if config.enable_lora else None
        # Decode-only steps through mx.compile (runner/compiled_step.py).
        self.compiled_decode = (CompiledDecode(self, None if config.compile_decode else AUTO_MAX_DECODES)
                                if config.compile_decode is not False and CompiledDecode.runs_on(self) else None)

    def _merge_and_plan(self, config: EngineConfig, model: nn.Module) -> None:
        """Merged projections, the layer plan (refusing what cannot be paged), the LM head split off, the KV pages'
        quantization per layer."""
        self.merges = _merges_projections(config)  # False: separate products, even where another runner merged
        self.merged_groups = merge_projections(model) if self.merges else 0
        flatten_quantized(model)  # after the merge: its modules too
        fuse_switch_glus(model)
        self.start_times.lap("merge probe")
        if self.merged_groups:
            logger.info("merged %d projection groups (layers/merged_linear.py)", self.merged_groups)
        # Routed first: the plan's probe sees each layer's query heads and sinks through the dispatcher.
        routed = install_paged_attention(model)
        self.plan, self.vocab_size = plan_layers(model)  # refuses the layers it cannot page, by name
        install_regrouping(model, self.plan)
        if routed == 0 and any(p.has_pages for p in self.plan):
            raise UnsupportedModelError(
                f"model type {model_type(model)!r} does not call mlx-lm's scaled_dot_product_attention")
        self._body, self._head = split_lm_head(model)
        self.kv_quant = {i: q for i, p in enumerate(self.plan) if p.has_pages
                         and (q := layer_quant(config.kv_cache_dtype, config.kv_cache_group_size, p.spec[1], p.spec[2],
                                               config.kv_cache_rotate))}
        self.start_times.lap("layer plan")

    def _make_lora_manager(self, config: EngineConfig):
        """Batched LoRA (pagedmlx/lora/): adapters on the layers that run token-major, as every row does."""
        from pagedmlx.lora.model_manager import LoRAModelManager

        if any(p.state is not None for p in self.plan):
            raise UnsupportedModelError(f"enable_lora: model type {model_type(self.model)!r} has recurrent-state "
                                        "layers, whose rows are regrouped by request; LoRA is not served there yet")
        backend, why = select_lora_kernel(self.kernels)
        return LoRAModelManager(self.model, config.max_loras, config.max_lora_rank, config.max_cpu_loras,
                                kernel_backend=backend, kernel_reason=why)

    @property
    def pages_in_place(self) -> bool:
        """Pages written by a kernel in place (CUDA): a step may be dispatched while the previous
        one still runs. Elsewhere MLX scatters into the pools, which copies a pool that anything
        else (a step in flight) still references."""
        return self.kernels.page_write

    @property
    def kernel_kv_heads(self) -> list[int]:
        """Per KV cache group with pages, the KV heads the decode kernel is split for (0: pages gathered)."""
        groups = [g for g in self.kv_cache_config.kv_cache_groups if not g.is_state]
        return [self.plan[g.layer_ids[0]].spec[0] if self.kernels.decode else 0 for g in groups]

    @property
    def prefill_heads(self) -> list[Optional[tuple[int, int]]]:
        """Per KV cache group with pages, (KV heads, query heads per KV head) where the paged prefill
        kernel attends its prefill rows: it runs here and takes every layer that reads the group's
        pages (shared layers included). None: the group's prefill rows attend in groups of SDPA calls."""
        groups = [g for g in self.kv_cache_config.kv_cache_groups if not g.is_state]
        if not self.kernels.prefill:
            return [None] * len(groups)
        out = []
        for g in groups:
            ids = set(g.layer_ids)
            owners = {i: p.source if p.kind == "shared" else i for i, p in enumerate(self.plan)
                      if i in ids or (p.kind == "shared" and p.source in ids)}
            shapes = {(self.plan[o].spec, self.plan[i].n_heads, self.kv_quant.get(o)) for i, o in owners.items()}
            heads = {(spec[0], h // spec[0]) for spec, h, _ in shapes}
            ok = len(heads) == 1 and all(prefill_attention.supports_prefill(dk, dv, h, n_kv, dt, q)
                                         for (n_kv, dk, dv, dt), h, q in shapes)
            out.append(heads.pop() if ok else None)
        return out

    @property
    def layer_specs(self) -> list[tuple[int, int, int, mx.Dtype]]:
        """(n_kv_heads, k_dim, v_dim, dtype) of every layer that owns pages."""
        return [p.spec for p in self.plan if p.has_pages]

    @property
    def num_blocks(self) -> int:
        return self.kv_cache_config.kv_cache_groups[0].num_blocks

    def group_bytes_per_block(self, group: KVCacheGroupSpec) -> int:
        return self.block_size * sum(self.layer_bytes_per_token(i) for i in group.layer_ids)

    def layer_bytes_per_token(self, i: int) -> int:
        """One token's keys and values in layer i's pages (scales and biases included where quantized)."""
        h, dk, dv, dt = self.plan[i].spec
        return bytes_per_token(h, dk, dv, dt.size, self.kv_quant.get(i))

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block of the first group (the only group of a plain-attention model)."""
        return self.group_bytes_per_block(self.kv_cache_config.kv_cache_groups[0])

    def warm_up(self, config: EngineConfig, max_model_len: int) -> None:
        """The paged kernels compiled and the prefill attention shapes built before the first request
        (runner/warm_up.py)."""
        warm_up.warm_up(self, config, max_model_len)

    def compile_kernels(self) -> int:
        return warm_up.compile_kernels(self)

    def warm_up_attention(self, chunk: int, max_keys: int) -> int:
        return warm_up.warm_up_attention(self, chunk, max_keys)

    def _kv_cache_config(self, config: EngineConfig) -> KVCacheConfig:
        """KV cache groups by layer kind (full first), sized: sliding groups get what their windows can hold at once
        (sliding_pool_blocks), never more than the full group; the full group gets config.num_blocks, or the rest of
        the KV budget (runner/kv_budget.py). Without a full-attention group every group is sized like one."""
        by_spec: dict = {}
        for i, layer in enumerate(self.plan):
            if layer.has_pages:
                spec = FullAttentionSpec() if layer.kind == "full" else SlidingWindowSpec(layer.window)
                by_spec.setdefault(spec, []).append(i)
        specs = sorted(by_spec, key=lambda s: getattr(s, "sliding_window", 0))
        groups = [KVCacheGroupSpec(s, 0, tuple(by_spec[s])) for s in specs]
        has_full = FullAttentionSpec() in by_spec
        caps = [None if not has_full or g.sliding_window is None else
                sliding_pool_blocks(g.sliding_window, self.block_size, config.max_num_seqs,
                                    config.max_num_batched_tokens) for g in groups]
        state = state_group(self.plan, config)
        draft = self.draft_block_bytes
        bpb = [self.group_bytes_per_block(g) + (draft if g.sliding_window is None else 0) for g in groups]

        def sized(n: int) -> list[int]:
            return [n if cap is None else min(n + 1, cap) for cap in caps]

        n = config.num_blocks
        if n is None:  # the most full-group blocks whose groups fit the memory budget (after the state slots)
            budget, lo, hi = pages_budget(self.kv_budget, state, config), 2, 1 << 40
            while lo < hi:
                mid = (lo + hi + 1) // 2
                lo, hi = (mid, hi) if sum(c * b for c, b in zip(sized(mid), bpb)) <= budget else (lo, mid - 1)
            n = lo
        quantized = f"{config.kv_cache_dtype} rotated" if config.kv_cache_rotate else config.kv_cache_dtype
        for g, count in zip(groups, sized(n)):
            g.num_blocks, g.page_size_bytes = max(count, 2), self.group_bytes_per_block(g)
            g.kv_cache_dtype = (quantized if g.layer_ids[0] in self.kv_quant
                                else str(self.plan[g.layer_ids[0]].spec[3]).split(".")[-1])
        return KVCacheConfig(self.block_size, groups + ([state] if state is not None else []))

    def make_pool(self, kv_cache_config: KVCacheConfig, quantized: bool = True) -> KVPool:
        """The pages of kv_cache_config's groups; quantized=False: in the model's dtype whatever kv_cache_dtype."""
        layers = [(i, (g.num_blocks, self.plan[i].spec)) for g in kv_cache_config.kv_cache_groups if not g.is_state
                  for i in g.layer_ids]
        return KVPool(self.block_size, layers, len(self.plan), self.kv_quant if quantized else None,
                      quantize_in_write=self.kernels.quantize_in_write)

    def make_state_pool(self, kv_cache_config: KVCacheConfig) -> Optional[StatePool]:
        group = next((g for g in kv_cache_config.kv_cache_groups if g.is_state), None)
        if group is None:
            return None
        return StatePool(group.num_blocks, [(i, self.plan[i].state) for i in group.layer_ids], len(self.plan),
                         in_place=self.kernels.state)

    def make_caches(self, md: StepMetadata, pool: KVPool, state_md: Optional[StateMetadata] = None,
                    state_pool: Optional[StatePool] = None) -> list:
        """One cache per planned layer; a shared layer's reads its source's pages; a state layer's
        is read by its regrouped owner; a CacheList layer gets both (in the model's order)."""
        from mlx_lm.models.cache import CacheList

        caches: list = []
        for i, layer in enumerate(self.plan):
            if layer.kind == "shared":
                source = caches[layer.source]
                caches.append(PagedLayerCache(i, pool, source.md, source=source))
                continue
            parts = {"attention": PagedLayerCache(i, pool, md.groups[self.group_of[i]]) if layer.has_pages else None,
                     "state": (StateLayerCache(i, len(layer.state.arrays), state_pool, state_md) if layer.state
                               else None)}
            caches.append(CacheList(*(parts[p] for p in layer.cache_list)) if layer.cache_list
                          else parts["attention"] or parts["state"])
        return caches

    def forward(self, so: SchedulerOutput, prev_sampled: Optional[mx.array] = None,
                kv_pool: Optional[KVPool] = None, state_pool: Optional[StatePool] = None) -> mx.array:
        """Logits (S, V) of the rows in so.logits_indices. `prev_sampled`: the previous step's
        sampled tokens, still on the device, for the rows in so.placeholder_rows. `kv_pool`,
        `state_pool`: other pages and states than the runner's own (the load-time check's scratch pools).

        Lazy where MLX scatters the pages. Where kernels write them in place, the step is
        dispatched (mx.async_eval) before this returns: MLX sees no dependency between one step's
        page reads and the next step's writes, so steps must reach the device in order."""
        lora = self.lora_manager.prepare_step(so.lora_int_ids, so.num_scheduled_tokens) if self.lora_manager else None
        compiled = self.compiled_decode is not None and kv_pool is None and not so.mm_features
        if compiled and self.compiled_decode.takes(so):
            try:
                logits = self.compiled_decode(so, prev_sampled, lora)
                if logits is not None and self.compiled_decode.new_trace and not self.pages_in_place:
                    key = check_cache.trace_check_key(self, self.identity, self.compiled_decode.last_key)
                    if not check_cache.passed(key):
                        logits = self._prove_trace(so, prev_sampled, lora, logits)
                        check_cache.record_pass(key)
                if logits is not None:
                    if self.pages_in_place:  # as below
                        mx.async_eval(logits)
                    return logits
            except PagesLost:
                raise
            except Exception as exc:  # noqa: BLE001 - an optimisation: the step is built instead
                logger.warning("compiled decode steps off: %s", error_line(exc))
                self.compiled_decode = None
                if self.repair_pages():  # a new trace's first replay failed after taking the pools over
                    raise PagesLost("a compiled decode step failed while writing the pages") from exc
        return self._built_forward(so, prev_sampled, kv_pool, state_pool, lora)

    def repair_pages(self) -> bool:
        """After a failed step: where MLX scatters the pages, the pools' lists may hold that step's graph,
        which fails again whenever a later step reads it. If so, every page and state is zeroed (their
        contents are lost: the engine has every running request recompute) and True is returned.
        Pages written in place (CUDA) keep their arrays: the failed step's rows are simply uncached."""
        if self.mm is not None:  # images' rows the failed step encoded may hold its graph: encoded again when needed
            self.mm.encoder_cache.clear()
        if self.pages_in_place:
            return False
        try:
            mx.eval(self.kv_pool.arrays, self.state_pool.flat if self.state_pool is not None else [])
            return False
        except Exception:  # noqa: BLE001 - whatever failed, those arrays cannot be read
            self.kv_pool.reset()
            if self.state_pool is not None:
                self.state_pool.reset()
            return True

    def _prove_trace(self, so: SchedulerOutput, prev_sampled: Optional[mx.array], lora, compiled: mx.array) -> mx.array:
        """A new trace over scattered pages (Metal, the CPU: traces the GPU suite does not run) against the
        step built as usual, once a trace (a pass is kept on disk: check_cache.trace_check_key): the built step
        writes the same rows again. One that disagrees
        beyond the load-time check's tolerance switches compiled steps off. Its writes may have reached
        other rows than the built step's, and no page can be trusted then: they are zeroed and PagesLost
        has the engine recompute every running request."""
        mx.eval(compiled)  # first: the built step's writes then take the pools' buffers over (no copy of a pool)
        built = self._built_forward(so, prev_sampled, None, None, lora)
        err, tol = relative_error(compiled, built), LOGIT_TOLERANCE.get(built.dtype, 6e-2)
        if err <= tol:
            return compiled
        self.compiled_decode = None
        self.kv_pool.reset()
        raise PagesLost(f"a new compiled decode trace's logits differ from the built step's by {err:.2e} > {tol:.0e}; "
                        "compiled decode steps are off")

    def _built_forward(self, so: SchedulerOutput, prev_sampled: Optional[mx.array], kv_pool: Optional[KVPool],
                       state_pool: Optional[StatePool], lora) -> mx.array:
        md = StepMetadata.build(so, self.block_size, self.windows, self.kernel_kv_heads, self.kernels.page_write,
                                self.kernels.backend, self.sdpa_quantum, self.prefill_heads,
                                lora.host if lora is not None else None,
                                self.mm.image_spans(so) if self.mm is not None else None)
        state_md = StateMetadata.build(so) if len(so.state_slots) else None
        caches = self.make_caches(md, kv_pool or self.kv_pool, state_md, state_pool or self.state_pool)
        inputs = md.input_ids
        if md.placeholder_rows is not None:
            inputs = mx.put_along_axis(inputs, md.placeholder_rows,
                                       prev_sampled[md.placeholder_src].astype(inputs.dtype), axis=0)
        mm = self.mm.step_kwargs(so, inputs) if so.mm_features or so.free_encoder_mm_hashes else {}  # images
        # each row's adapter slot, for the wrapped layers while the graph is built
        with (self.lora_manager.step(lora, md.extra) if lora is not None else contextlib.nullcontext(),
              self.mm.forward_context(so) if mm else contextlib.nullcontext()):
            logits = self.logits(inputs[:, None], caches, md.logits_indices, **mm)
        if self.pages_in_place:
            mx.async_eval(logits)
        return logits

    def logits(self, inputs: mx.array, caches: list, logits_indices: mx.array, **kwargs) -> mx.array:
        """The model over inputs (T, 1) on `caches`; logits (S, V) of the rows logits_indices. kwargs: the text
        model's other inputs (input_embeddings of a step with image rows)."""
        with (merged_products() if self.merges else contextlib.nullcontext(), flat_rows(),
              fused_residuals() if self.fused_norms else contextlib.nullcontext(),
              skinny_products() if self.skinny else contextlib.nullcontext()):
            if self._head is not None:
                hidden = self._body(inputs, cache=caches, **kwargs)
                if self.keep_hidden:  # every row's final hidden state, for an MTP module (spec_decode/mtp_proposer.py)
                    self.last_hidden = hidden
                return self._head(hidden[logits_indices, 0])  # (S, H): one matrix (layers/quantized_linear.py)
            return self.model(inputs, cache=caches, **kwargs)[logits_indices][:, 0, :]

    def _verify_against_mlx_lm(self, key: Optional[str] = None) -> None:
        verify_against_mlx_lm(self, key)  # runner/verify.py
