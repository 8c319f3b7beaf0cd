"""Compiled decode steps (vLLM's CUDA graphs, in spirit): a decode-only step's forward pass is traced
once per key through mx.compile and replayed after that, so the model's Python (every layer's
projections, norms, RoPE, the paged caches and the kernels' launches) runs once per key instead of
once per step. At batch 1 that Python is most of the host's work per step.

A key is what a trace freezes: the step's index arrays by name and shape, each group's KV splits,
and the previous step's sampled-token array's shape (async scheduling). Block tables grow a page at
a time, so the decode tables are padded to a power of two pages (the kernels read only up to each
sequence's length): a sequence meets a new key at 2, 4, 8, ... pages, and when its splits change.

Where the page-write kernel writes pages in place (CUDA), a trace takes the pools as constants. Where
MLX scatters the new K/V into them (Metal, the CPU), the trace takes the pools as its state
(mx.compile's inputs / outputs): each replay scatters into the pools it is handed (MLX donates their
buffers: no copy) and hands the new arrays back to KVPool's lists; each new trace's first replay is
checked against the step built as usual (ModelRunner._prove_trace; a pass kept). Models with recurrent-state layers
are compiled only where the state kernels write in place too. A step of short segments (speculative
decoding's verifying 1 + k tokens) whose tokens all run as decode rows (attention_metadata.decode_token_rows)
is decode-only here too, on models without recurrent state, and compiled once hot (a short prompt's step
is a key of its own that seldom comes again). Quantized KV pages are written in place where 16-bit ones are
(page_write.reshape_and_cache_quantized: mx.quantize, then the copy), so they compile too. Steps with
prefill rows or a recurrent segment (a 1-token prompt) run as built. A step with adapter rows (LoRA)
is a key by its slots and the adapters' generation (a slot's new weights: a new trace), compiled only
once hot (below), so that adapters taking turns in the slots never cost a trace a step. By default
(EngineConfig.compile_decode None) steps of at most AUTO_MAX_DECODES requests are compiled at once:
there the host's Python bounds the step, and such keys are few. A larger step is compiled once its
key has come HOT_STEPS times (a steady batch: its size and table bucket unchanged), so that a batch
whose size changes every step never pays a trace per step; at most MAX_TRACES traces are kept, the
least recently used dropped first. Not for models with recurrent-state layers: on the H200 Llama-8B's
256-request steps ran 1.35x faster compiled, the Qwen3.5 shape's 1.02x (the model's
Python is not what bounds its step), not worth a trace per key. Where the runner keeps its hidden
states (an MTP module reads them: ModelRunner.keep_hidden), the trace returns them with the logits.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from pagedmlx.runner.attention_metadata import StepMetadata, _GroupBuilder, decode_token_rows, upload_indices
from pagedmlx.runner.state import StateMetadata
from pagedmlx.core.sched.output import SchedulerOutput

AUTO_MAX_DECODES = 8
HOT_STEPS = 3
MAX_TRACES = 16
_STATE_FIELDS = ("decode_rows", "decode_read", "decode_write", "save_rows", "save_slots", "order")


def table_bucket(num_blocks: int) -> int:
    """Pages a decode block table is padded to: the next power of two."""
    return 1 << max(num_blocks - 1, 0).bit_length()


class CompiledDecode:
    """The runner's decode-only steps, compiled per key (see the module docstring)."""

    def __init__(self, runner: Any, max_decodes: Optional[int] = None):
        """runner: the ModelRunner (not imported here: it imports this module); max_decodes: the largest
        step compiled at its first step (None: any); larger ones wait for HOT_STEPS steps of their key."""
        self.runner = runner
        self.max_decodes = max_decodes
        self.fns: OrderedDict[tuple, Callable] = OrderedDict()
        self.seen: dict[tuple, int] = {}  # steps of each larger key not compiled yet
        self.new_trace = False  # the last call traced its key (runner.forward proves it where pages are scattered)
        self.last_key: Optional[tuple] = None  # ... and that key
        self.larger = not any(p.state is not None for p in runner.plan)  # larger steps compiled when hot

    @staticmethod
    def runs_on(runner: Any) -> bool:
        """Whether a runner's decode steps can be compiled: pages written in place, or scattered by MLX
        into pools the trace takes as its state (then no recurrent-state layers, whose pool is scattered too)."""
        return runner.kernels.page_write or not any(p.state is not None for p in runner.plan)

    def takes(self, so: SchedulerOutput) -> bool:
        r = self.runner
        has_state = len(so.state_slots) > 0
        decode_only = so.num_decodes == so.total_num_scheduled_tokens
        return (self.runs_on(r)
                and (decode_only or not has_state and all(r.kernel_kv_heads) and decode_token_rows(so) is not None)
                and (self.larger or self.max_decodes is None or so.num_reqs <= self.max_decodes)
                and (not has_state or (r.kernels.state and bool((so.state_slots[:, 0] >= 0).all()))))

    def __call__(self, so: SchedulerOutput, prev_sampled: Optional[mx.array], lora: Any = None) -> Optional[mx.array]:
        """The step's logits through its key's trace; None where the key is not hot yet (build the step).
        lora: the step's adapter rows (LoRAModelManager.prepare_step), None without."""
        r = self.runner
        positions = so.rope_positions if len(so.rope_positions) else so.positions  # RoPE's (M-RoPE: shifted)
        host = dict(input_ids=so.input_ids, positions=positions, logits_indices=so.logits_indices)
        if len(so.placeholder_rows):
            host.update(placeholder_rows=so.placeholder_rows, placeholder_src=so.placeholder_src)
        builders = [_GroupBuilder(so, g, r.block_size, w, r.kernel_kv_heads[g], r.kernels.page_write,
                                  r.kernels.backend, r.sdpa_quantum, r.prefill_heads[g])
                    for g, w in enumerate(r.windows)]
        for g, b in enumerate(builders):
            if "decode_block_table" in b.host:
                table = b.host["decode_block_table"]
                padded = np.zeros((table.shape[0], table_bucket(table.shape[1])), table.dtype)  # np.pad: 20x slower
                padded[:, :table.shape[1]] = table
                b.host["decode_block_table"] = padded
            host.update({f"{g}.{k}": v for k, v in b.host.items()})
        if lora is not None:
            host.update(lora.host)
        dev = upload_indices(host)
        state_md = StateMetadata.build(so) if len(so.state_slots) else None
        state = {} if state_md is None else {f: getattr(state_md, f) for f in _STATE_FIELDS
                                              if getattr(state_md, f) is not None}
        arrays = {**dev, **{f"state.{k}": v for k, v in state.items()},
                  **(r.lora_manager.slot_arrays(lora) if lora is not None else {})}
        if prev_sampled is not None and "placeholder_rows" in dev:
            arrays["prev_sampled"] = prev_sampled
        names = tuple(arrays)
        key = (tuple((n, arrays[n].shape, arrays[n].dtype) for n in names), tuple(b.splits for b in builders),
               state_md.num_decodes if state_md is not None else None,
               (lora.slots, lora.dora_slots, r.lora_manager.generation) if lora is not None else None, r.keep_hidden,
               r.kv_pool.serial)  # a trace holds its pool's arrays (or, where they are scattered, its lists)
        fn = self.fns.get(key)
        self.new_trace, self.last_key = fn is None, key
        if fn is None:
            rows_of_segments = so.num_decodes < so.total_num_scheduled_tokens  # a one-off prompt's length: no trace
            if lora is not None or rows_of_segments or self.max_decodes is not None and so.num_reqs > self.max_decodes:
                if len(self.seen) > 4 * MAX_TRACES:
                    self.seen.clear()
                self.seen[key] = self.seen.get(key, 0) + 1
                if self.seen[key] < HOT_STEPS:
                    return None
                del self.seen[key]
            trace = self._trace(names, builders, state_md is not None, so.num_decodes, lora)
            if r.kernels.page_write:
                fn = mx.compile(trace)
            else:  # the pools as the trace's state: scattered into, handed back (pools_state)
                pools = pools_state(r.kv_pool)
                fn = mx.compile(trace, inputs=pools, outputs=pools)
            self.fns[key] = fn
            while len(self.fns) > MAX_TRACES:
                self.fns.popitem(last=False)
        self.fns.move_to_end(key)
        # Only tracing (a key's first call) can fail part way with tracers in the pools' lists: snapshot then.
        pools = pools_state(r.kv_pool) if self.new_trace and not r.kernels.page_write else None
        saved = [list(side) for side in pools] if pools is not None else None
        try:
            out = fn(*(arrays[n] for n in names))
        except Exception:
            if saved is not None:  # a trace that failed part way left tracers in the pools' lists
                for side, arrays_before in zip(pools, saved):
                    side[:] = arrays_before
            raise
        if r.keep_hidden:  # the trace's hidden states are its output's, not the runner's (a tracer)
            out, r.last_hidden = out
        return out

    def _trace(self, names: tuple, builders: list, has_state: bool, num_decodes: int, lora: Any = None) -> Callable:
        """The step's forward over its uploaded index arrays, as mx.compile traces it."""
        r = self.runner

        def forward(*arrays: mx.array) -> mx.array:
            d = dict(zip(names, arrays))
            groups = [b.finish(d, f"{g}.", d["positions"]) for g, b in enumerate(builders)]
            md = StepMetadata(d["input_ids"], d["logits_indices"], d.get("placeholder_rows"),
                              d.get("placeholder_src"), groups)
            state_md = (StateMetadata(num_decodes, **{k[6:]: v for k, v in d.items() if k.startswith("state.")})
                        if has_state else None)
            inputs = md.input_ids
            if md.placeholder_rows is not None:
                prev = d["prev_sampled"]
                inputs = mx.put_along_axis(inputs, md.placeholder_rows, prev[md.placeholder_src].astype(inputs.dtype),
                                           axis=0)
            caches = r.make_caches(md, r.kv_pool, state_md, r.state_pool)
            if lora is None:
                logits = r.logits(inputs[:, None], caches, md.logits_indices)
            else:
                with r.lora_manager.step(lora, d, traced=True):
                    logits = r.logits(inputs[:, None], caches, md.logits_indices)
            return (logits, r.last_hidden) if r.keep_hidden else logits

        return forward


def pools_state(pool: Any) -> list:
    """A KVPool's lists of arrays (None where a layer owns no pages), as mx.compile's inputs / outputs:
    a traced step's scatters replace their entries."""
    return [pool.keys, pool.values, pool.k_scales, pool.k_biases, pool.v_scales, pool.v_biases]
