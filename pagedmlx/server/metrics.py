"""Prometheus metrics, under vLLM's names where vLLM has one (so that its dashboards work).

Counters are declared without the `_total` suffix, as vLLM declares them; prometheus_client
appends it on exposition (`vllm:prompt_tokens` is scraped as `vllm:prompt_tokens_total`).
Each app has its own CollectorRegistry. Request-level metrics are observed by a listener in
the engine thread; engine-level ones are read from a snapshot taken in the engine thread at
scrape time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedmlx.engine.async_engine import RequestTiming
from pagedmlx.outputs import EngineOutput

if TYPE_CHECKING:  # read in the core's process (EngineSnapshot.take), never imported by the front end
    from pagedmlx.engine.core import EngineCore

# vLLM's buckets.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
               20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
               240.0, 480.0, 960.0, 1920.0, 7680.0)


@dataclass
class EngineSnapshot:
    """Engine state worth a gauge or a counter, read in the engine thread."""

    num_running: int
    num_waiting: int
    kv_usage: float
    groups: list[tuple[str, int, int, int]]  # per KV cache group: (name, blocks, free, cached free)
    prefix_queries: int
    prefix_hits: int
    num_preemptions: int
    num_steps: int
    step_schedule_s: float
    step_forward_s: float
    step_update_s: float
    step_tokens: int
    state_checkpoint_hits: int = 0
    state_checkpoints_saved: int = 0
    guided_requests: int = 0
    grammar_compiles: int = 0
    # Speculative decoding (spec_decode/metrics.py's SpecDecodingStats; zeros when it is off)
    spec_decode_num_drafts: int = 0
    spec_decode_num_draft_tokens: int = 0
    spec_decode_num_accepted_tokens: int = 0
    spec_decode_num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # per KV cache group with pages: (name, what its pages hold, bytes of one token over the group's layers)
    bytes_per_token: list[tuple[str, str, int]] = field(default_factory=list)
    # Speculation on recurrent-state models: steps whose drafts were partly rejected, and the tokens
    # recomputed after them (their state is restored to before the step: docs/state-layers.md)
    state_rollbacks: int = 0
    state_recomputed_tokens: int = 0
    # draft_model / mtp with prompt lookup: drafts the lookup gave instead of the model (spec_decode/drafter.py)
    spec_decode_num_lookup_drafts: int = 0

    @classmethod
    def take(cls, engine: EngineCore) -> "EngineSnapshot":
        kv = engine.kv_cache_manager
        groups = [(spec.name, m.block_pool.num_blocks, m.block_pool.get_num_free_blocks(),
                   m.block_pool.num_cached_free_blocks())
                  for spec, m in zip(kv.kv_cache_config.kv_cache_groups, kv.managers)]
        s = engine.stats
        state, guided = kv.state_manager, engine.structured_output_manager
        spec = engine.scheduler.spec_decoding_stats
        spec_counts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens,
                       list(spec.num_accepted_tokens_per_pos)) if spec is not None else (0, 0, 0, [])
        snap = cls(len(engine.scheduler.running), len(engine.scheduler.waiting), kv.usage, groups,
                   kv.stats.queries, kv.stats.hits,
                   engine.scheduler.num_preemptions, s.num_steps, s.schedule_s, s.forward_s, s.update_s,
                   s.num_tokens, state.num_checkpoint_hits if state else 0, state.num_checkpoints_saved if state else 0,
                   guided.num_requests, guided.num_compiles, *spec_counts,
                   [(g.name, g.kv_cache_dtype, g.page_size_bytes // kv.kv_cache_config.block_size)
                    for g in kv.kv_cache_config.kv_cache_groups if not g.is_state])
        if state is not None:
            snap.state_rollbacks, snap.state_recomputed_tokens = state.num_rollbacks, state.num_recomputed_tokens
        if engine.drafter is not None and engine.drafter.lookup is not None:
            snap.spec_decode_num_lookup_drafts = engine.drafter.num_lookup_drafts
        return snap


class ServerMetrics:
    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        self._model = model_name
        r, labels = self.registry, ["model_name"]

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=r).labels(model_name)

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=r).labels(model_name)

        def histogram(name: str, doc: str, buckets) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r).labels(model_name)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        # One series per KV cache group ("full", "sliding 1024", "state", ...): each group has its own pool;
        # the "state" group's blocks are recurrent-state slots (cached free ones: checkpoints).
        group_labels = ["model_name", "kv_cache_group"]
        self.blocks_total = Gauge("pagedmlx:kv_blocks_total", "KV-cache blocks in the group's page pool.",
                                  group_labels, registry=r)
        self.blocks_free = Gauge("pagedmlx:kv_blocks_free", "Free KV-cache blocks (cached or not).", group_labels,
                                 registry=r)
        self.blocks_cached_free = Gauge("pagedmlx:kv_blocks_cached_free",
                                        "Free KV-cache blocks that still hold a reusable prefix.", group_labels,
                                        registry=r)
        self.bytes_per_token = Gauge("pagedmlx:kv_cache_bytes_per_token",
                                     "Bytes one token takes in the group's pages, over its layers (scales included).",
                                     group_labels + ["kv_cache_dtype"], registry=r)
        self._engine_counters = {
            "prefix_queries": counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens."),
            "prefix_hits": counter("vllm:prefix_cache_hits",
                                   "Prefix cache hits, in terms of number of cached tokens."),
            "num_preemptions": counter("vllm:num_preemptions", "Cumulative number of preemptions."),
            "num_steps": counter("pagedmlx:steps", "Engine steps that ran a forward pass."),
            "step_schedule_s": counter("pagedmlx:step_schedule_seconds", "Step time spent scheduling."),
            "step_forward_s": counter("pagedmlx:step_forward_seconds",
                                      "Step time spent in the forward pass and sampling (device work)."),
            "step_update_s": counter("pagedmlx:step_update_seconds",
                                     "Step time spent appending tokens and checking stops (text is the front end's)."),
            "step_tokens": counter("pagedmlx:step_tokens", "Tokens scheduled over all steps."),
            "state_checkpoint_hits": counter("pagedmlx:state_checkpoint_hits",
                                             "Requests that resumed from a recurrent-state checkpoint."),
            "state_checkpoints_saved": counter("pagedmlx:state_checkpoints_saved",
                                               "Recurrent-state checkpoints saved."),
            "guided_requests": counter("pagedmlx:structured_output_requests",
                                       "Requests decoded under a grammar (structured outputs, forced tool calls)."),
            "grammar_compiles": counter("pagedmlx:grammar_compiles",
                                        "Grammars compiled (the others came from the cache)."),
            # vLLM's spec-decode counters (acceptance rate: rate(accepted) / rate(draft_tokens))
            "spec_decode_num_drafts": counter("vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
            "spec_decode_num_draft_tokens": counter("vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
            "spec_decode_num_accepted_tokens": counter("vllm:spec_decode_num_accepted_tokens",
                                                       "Number of accepted tokens."),
            "state_rollbacks": counter("pagedmlx:spec_decode_state_rollbacks",
                                       "Verifying steps of recurrent-state requests whose drafts were partly "
                                       "rejected (state restored to before the step)."),
            "state_recomputed_tokens": counter("pagedmlx:spec_decode_state_recomputed_tokens",
                                               "Accepted tokens computed again after such a rollback."),
            "spec_decode_num_lookup_drafts": counter("pagedmlx:spec_decode_num_lookup_drafts",
                                                     "Drafts taken from the prompt lookup instead of the draft "
                                                     "model or MTP module (of vllm:spec_decode_num_drafts)."),
        }
        self._seen = {name: 0.0 for name in self._engine_counters}
        self.accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos",
                                        "Accepted tokens per draft position.", ["model_name", "position"], registry=r)
        self._seen_per_pos: list[int] = []
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                ["model_name", "finished_reason"], registry=r)
        self.ttft = histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of e2e request latency in seconds.", E2E_BUCKETS)

    def on_output(self, out: EngineOutput, timing: RequestTiming, now: float) -> None:
        """AsyncEngine listener (engine thread): timing holds the state before this output."""
        n = len(out.new_token_ids)
        if n:
            self.generation_tokens.inc(n)
            if timing.first_token is None:
                self.ttft.observe(now - timing.arrival)
                self.prompt_tokens.inc(len(out.prompt_token_ids))
            else:
                self.itl.observe((now - timing.last_token) / n)
        if out.finished:
            self.e2e.observe(now - timing.arrival)
            if out.finish_reason in ("stop", "length", "abort"):
                self._success.labels(self._model, out.finish_reason).inc()

    def update(self, snap: Optional[EngineSnapshot]) -> None:
        if snap is None:
            return
        self.running.set(snap.num_running)
        self.waiting.set(snap.num_waiting)
        self.kv_usage.set(snap.kv_usage)
        for name, total, free, cached in snap.groups:
            self.blocks_total.labels(self._model, name).set(total)
            self.blocks_free.labels(self._model, name).set(free)
            self.blocks_cached_free.labels(self._model, name).set(cached)
        for name, dtype, per_token in snap.bytes_per_token:
            self.bytes_per_token.labels(self._model, name, dtype).set(per_token)
        for name, counter in self._engine_counters.items():
            total = getattr(snap, name)
            if total > self._seen[name]:
                counter.inc(total - self._seen[name])
                self._seen[name] = total
        per_pos = snap.spec_decode_num_accepted_tokens_per_pos
        self._seen_per_pos += [0] * (len(per_pos) - len(self._seen_per_pos))
        for pos, total in enumerate(per_pos):
            child = self.accepted_per_pos.labels(self._model, str(pos))  # every position shows, 0 included
            if total > self._seen_per_pos[pos]:
                child.inc(total - self._seen_per_pos[pos])
                self._seen_per_pos[pos] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)
