"""Recurrent-state layers on the paged engine: a busy engine gives each request of Qwen3.5 / 3.6 (dense
and MoE), Qwen3-Next, LFM2, Nemotron-H, Granite-4-H, Falcon-H1 and Mamba2 models exactly what mlx-lm's
generate_step gives that prompt alone (tiny random-weight float32 models, pages of 4 tokens, a state
checkpoint every 8 tokens), and resumes from checkpoints only."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from utils import (assert_no_leaks, assert_samples_equal_alone, assert_solo_greedy, make_model, run_staggered,
                   shared_prefix_prompts, solo_mismatch)

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.core.kv.state_manager import StateManager
from pagedmlx.runner import state as runner_state
from pagedmlx.runner.plan import UnsupportedModelError
from pagedmlx.sampling_params import SamplingParams

STATE_ARCHS = ["qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen3_next-tiny", "lfm2-tiny", "nemotron_h-tiny",
               "granitemoehybrid-tiny", "falcon_h1-tiny", "mamba2-tiny"]
BS, INTERVAL = 4, 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def state_engine(model, num_blocks: int = 60, interval: int = INTERVAL, **kwargs) -> LLMEngine:
    """Chunks of up to 40 tokens mixed with decodes; a pool small enough to preempt."""
    config = dict(block_size=BS, num_blocks=num_blocks, max_num_batched_tokens=64, long_prefill_token_threshold=40,
                  max_num_seqs=12, state_checkpoint_interval=interval)
    return LLMEngine(model, None, EngineConfig(**{**config, **kwargs}))


def has_pages(engine: LLMEngine) -> bool:
    return any(not g.is_state for g in engine.runner.kv_cache_config.kv_cache_groups)


@pytest.mark.parametrize("arch", STATE_ARCHS)
def test_busy_engine_equals_solo(arch):
    model = make_model(arch)
    engine = state_engine(model)
    assert engine.runner.kv_cache_config.kv_cache_groups[-1].name == "state"
    mixed = []
    real_forward = engine.runner.forward

    def forward(so, *args, **kwargs):  # steps that run decodes and prefill chunks together
        mixed.append(0 < so.num_decodes < so.num_reqs and max(so.num_scheduled_tokens) > 1)
        return real_forward(so, *args, **kwargs)

    engine.runner.forward = forward
    prompts = shared_prefix_prompts(20, seed=5)
    done = run_staggered(engine, prompts, GREEDY, seed=2)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i} ({len(p)} tokens)")
    assert any(mixed)
    assert engine.kv_cache_manager.stats.hits > 0  # later requests resumed from the shared prefix's checkpoints
    if has_pages(engine):  # a state-only model (mamba2) holds one slot per request: nothing to preempt
        assert engine.scheduler.num_preemptions > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["qwen3_5-tiny", "falcon_h1-tiny"])
def test_overlapped_steps_equal_solo(arch):
    """Step N+1 built while step N runs (its decodes' input tokens still on the device): the states
    step N writes land before step N+1 reads them."""
    model = make_model(arch)
    engine = state_engine(model, async_scheduling=True)
    prompts = shared_prefix_prompts(12, seed=3)
    done = run_staggered(engine, prompts, GREEDY, seed=4)
    assert engine.stats.num_overlapped > 0
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, f"request {i}")
    assert_no_leaks(engine)


def expected_hit(saved: set[int], computed: int) -> int:
    """The checkpoint a next turn resumes from: the last one its cached pages still cover."""
    return max((c for c in saved if c <= computed // BS * BS), default=0)


@pytest.mark.parametrize("arch,overlap", [(a, None) for a in STATE_ARCHS] + [("qwen3_5-tiny", True),
                                                                           ("mamba2-tiny", True)])
def test_multi_turn_resumes_from_checkpoints(arch, overlap):
    """Three conversations, three turns each: every turn resumes from the last checkpoint the previous
    turns left (the prompt's last full block, or an interval one in the answer), equal to mlx-lm.
    overlap: async scheduling (the GPU's default), where a step's last token is not known when it is
    scheduled: the checkpoint and the page it ends are keyed later (StepBlock.hashes, KVCacheManager.free)."""
    model = make_model(arch)
    engine = state_engine(model, num_blocks=400, async_scheduling=overlap)
    rng = random.Random(4)
    history = {c: [rng.randrange(1, 500) for _ in range(rng.randint(5, 30))] for c in range(3)}
    saved = {c: set() for c in history}
    for turn in range(3):
        for c, prompt in history.items():
            engine.add_request(f"{c}.{turn}", prompt, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        for c, prompt in history.items():
            out = done[f"{c}.{turn}"]
            assert_solo_greedy(out.token_ids, model, prompt, GREEDY.max_tokens, f"conversation {c}, turn {turn}")
            computed = len(prompt) + len(out.token_ids) - 1
            if turn:
                assert out.num_cached_tokens == expected_hit(saved[c], len(prompt) - 1) > 0
            last_full = (len(prompt) - 1) // BS * BS
            saved[c] |= {p for p in range(INTERVAL, computed + 1, INTERVAL)} | ({last_full} - {0})
            history[c] = prompt + out.token_ids + [rng.randrange(1, 500) for _ in range(rng.randint(1, 12))]
    assert_no_leaks(engine)


def test_preempted_request_resumes_from_its_checkpoint():
    """The newest request is preempted when pages run out; its head pages and checkpoints stay cached
    (the tail of a chain is evicted first), and it resumes from the last checkpoint they cover. (A
    chunk saves one checkpoint, its last: chunks of 8 tokens here save one every 8.)"""
    model = make_model("qwen3_5-tiny")
    engine = state_engine(model, num_blocks=24, long_prefill_token_threshold=INTERVAL)
    rng = random.Random(8)
    prompts = {"old": [rng.randrange(1, 500) for _ in range(30)], "new": [rng.randrange(1, 500) for _ in range(40)]}
    params = {rid: SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
              for rid, n in (("old", 40), ("new", 16))}
    engine.add_request("old", prompts["old"], params["old"])
    engine.step()
    engine.add_request("new", prompts["new"], params["new"])
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    stats = engine.kv_cache_manager.stats
    assert engine.scheduler.num_preemptions > 0 and stats.preempted_hits > 0
    for rid, prompt in prompts.items():
        assert_solo_greedy(done[rid], model, prompt, params[rid].max_tokens)
    assert_no_leaks(engine)


@pytest.mark.parametrize("arch", ["qwen3_5-tiny", "nemotron_h-tiny", "falcon_h1-tiny"])
def test_seeded_samples_and_n_equal_alone(arch):
    """n > 1 seeded samples in a busy engine equal the same samples run alone."""
    model = make_model(arch)
    params = SamplingParams(n=2, temperature=1.0, seed=4, max_tokens=8, ignore_eos=True)
    assert_samples_equal_alone(lambda: state_engine(model, num_blocks=200), shared_prefix_prompts(8, seed=9), params)


def test_aborts_and_a_failed_step_free_slots_and_keep_only_written_checkpoints(monkeypatch):
    """A failed step ends its requests and frees their slots; the checkpoint an earlier step wrote stays
    (a later request resumes from it), the ones the failed step was to write are forgotten. An abort
    mid-prefill or mid-decode frees the slot too."""
    model = make_model("qwen3_5-tiny")
    engine = state_engine(model, num_blocks=200)
    prompt = [random.Random(2).randrange(1, 500) for _ in range(30)]
    engine.add_request("a", prompt, GREEDY)
    engine.step()  # a's prompt, saving a checkpoint at its last full block (28)
    real_forward = engine.runner.forward
    monkeypatch.setattr(engine.runner, "forward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))
    engine.add_request("b", prompt + [9] * 12, GREEDY)  # resumes from a's checkpoint, would save at 40
    outs = engine.step()
    assert sorted((o.request_id, o.finish_reason) for o in outs) == [("a", "error"), ("b", "error")]
    assert_no_leaks(engine)
    monkeypatch.setattr(engine.runner, "forward", real_forward)
    longer = prompt + [9] * 12 + [5]
    engine.add_request("c", longer, GREEDY)
    engine.add_request("d", longer[:20], GREEDY)
    engine.step()
    assert engine.scheduler.requests["c"].num_cached_tokens == 28  # a's checkpoint; b's pages and checkpoint are gone
    engine.abort_request(["d"])  # mid-decode
    engine.add_request("e", longer, SamplingParams(temperature=0.0, max_tokens=2))
    engine.abort_request(["e"])  # before its first step
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert_solo_greedy(done["c"], model, longer, GREEDY.max_tokens)
    assert_no_leaks(engine)


def test_a_prefix_hit_needs_a_checkpoint():
    """Without checkpoints a state model's hit is 0 however many of its pages are cached; a lookup
    that found pages but no checkpoint covering them is an error, never a resume."""
    model = make_model("qwen3_5-tiny")
    engine = state_engine(model, num_blocks=200, interval=0)
    assert engine.kv_cache_manager.state_manager.block_pool.num_blocks == 12  # no checkpoint slots
    prompt = [random.Random(1).randrange(1, 500) for _ in range(33)]
    for turn, p in enumerate([prompt, prompt + [5, 6, 7]]):
        engine.add_request(str(turn), p, GREEDY)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert done[str(turn)].num_cached_tokens == 0
        assert_solo_greedy(done[str(turn)].token_ids, model, p, 8, turn)
    assert len(engine.kv_cache_manager.block_pool.cached_block_hash_to_block) >= 8  # the pages were there
    assert engine.kv_cache_manager.stats.hits == 0

    pages_only = StateManager.find_longest_cache_hit
    engine.kv_cache_manager.state_manager.checkpoint_interval = INTERVAL
    engine.kv_cache_manager.state_manager.find_longest_cache_hit = (
        lambda hashes, max_blocks: [None] * max_blocks)  # a state manager that "hits" wherever pages do
    engine.add_request("2", prompt + [5, 6, 7, 8], GREEDY)
    with pytest.raises(RuntimeError, match="no state checkpoint that covers it"):
        engine.step()
    assert pages_only is StateManager.find_longest_cache_hit


def _independent_rows(self, call, x, rebuild):
    """The negative control: every row its own sequence (what token-major rows are without regrouping),
    each starting from its request's state as of the step's start; the last row's state is kept."""
    md, pool, n = self.md, self.pool, self.num_arrays
    zero = [mx.zeros((1, *a.shape[1:]), a.dtype) for a in pool.arrays[self.layer]]
    starts = []
    if md.num_decodes:
        starts.append(pool.read(self.layer, md.decode_read))
    for seg in md.segments:
        start = pool.read(self.layer, seg.read) if seg.read >= 0 else zero
        starts.append([mx.repeat(a, seg.num_rows, axis=0) for a in start])
    cache = runner_state.ArraysCache(n)
    cache.cache = [mx.concatenate([s[j] for s in starts]) for j in range(n)]
    a, kw = rebuild(x, cache)
    out = call(a, kw)
    if md.num_decodes:
        pool.write(self.layer, md.decode_write, [s[:md.num_decodes] for s in cache.cache])
    for seg in md.segments:
        last = seg.row_start + seg.num_rows - 1
        pool.write(self.layer, seg.write_slots, [s[last:last + 1] for s in cache.cache])
    return out


@pytest.mark.parametrize("arch", ["qwen3_5-tiny", "lfm2-tiny", "nemotron_h-tiny"])
def test_negative_control_rows_as_independent_sequences_give_other_tokens(arch, monkeypatch):
    monkeypatch.setattr(runner_state.StateLayerCache, "regroup", _independent_rows)
    model = make_model(arch)
    with pytest.raises(UnsupportedModelError, match="different logits on pages"):  # the load-time check sees it
        state_engine(model)
    monkeypatch.setattr("pagedmlx.runner.model.ModelRunner._verify_against_mlx_lm", lambda self, key=None: None)
    prompts = shared_prefix_prompts(6, seed=1)
    done = run_staggered(state_engine(model, num_blocks=200), prompts, GREEDY, seed=1)
    assert sum(solo_mismatch(done[str(i)], model, p, GREEDY.max_tokens) is not None for i, p in enumerate(prompts)) > 0


def test_state_writes_do_not_copy_the_pool():
    """A step writes its requests' states into the pool in place: its peak memory stays far below one
    layer's state array (a copying write would allocate the whole array again)."""
    model = make_model("qwen3_5-tiny")
    big = LLMEngine(model, None, EngineConfig(block_size=BS, num_blocks=200, max_num_seqs=2000,
                                              state_checkpoint_interval=0))
    layer_bytes = max(a.nbytes for arrays in big.runner.state_pool.arrays if arrays for a in arrays)
    rng = random.Random(3)
    for i in range(4):
        big.add_request(str(i), [rng.randrange(1, 500) for _ in range(20)], GREEDY)
    big.step()  # the prompts; then decodes
    peaks = []
    for _ in range(4):
        mx.synchronize()
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        big.step()
        mx.synchronize()
        peaks.append(mx.get_peak_memory() - before)
    assert max(peaks) < layer_bytes / 4, (peaks, layer_bytes)


def test_an_owner_that_also_attends_is_refused_by_name():
    """baichuan_m1 keeps a convolution state inside its attention module: running that module per request
    would take attention off the pages, so it is refused, naming the layer and why."""
    from pagedmlx.loaders.random_model import build_model

    cfg = dict(model_type="baichuan_m1", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0, sliding_window=8,
               sliding_window_layers=[0], conv_window=2, rms_norm_eps=1e-5)
    with pytest.raises(UnsupportedModelError, match=r"'baichuan_m1': layer 0's recurrent state belongs to "
                                                    r"'model.layers.0.self_attn', which also attends"):
        LLMEngine(build_model(cfg), None, EngineConfig(block_size=BS, num_blocks=32))


@pytest.mark.parametrize("arch", ["qwen3_5-tiny", "mamba2-tiny"])
def test_blocks_view_metrics_and_startup_line_show_state_slots(arch):
    from rich.console import Console

    from pagedmlx.blocks.snapshot import kv_snapshot
    from pagedmlx.blocks.view import render
    from pagedmlx.engine.core_info import kv_pool_line
    from pagedmlx.server.metrics import EngineSnapshot, ServerMetrics

    engine = state_engine(make_model(arch), num_blocks=200)
    for i, p in enumerate(shared_prefix_prompts(6, seed=3)):
        engine.add_request(str(i), p, GREEDY)
    for _ in range(3):
        engine.step()
    assert "state" in kv_pool_line(engine) and "slots (12 running + 12 checkpoints)" in kv_pool_line(engine)
    snap = kv_snapshot(engine)
    state = snap["groups"][-1]["state"]
    assert state["running_slots"] == len(engine.scheduler.running) == 6 and state["checkpoint_interval"] == INTERVAL
    console = Console(record=True, width=160)
    console.print(render(snap, 160))
    text = console.export_text()
    assert "6 running" in text and "checkpoints" in text and "slots" in text
    metrics = ServerMetrics("m")
    metrics.update(EngineSnapshot.take(engine))
    exposition = metrics.render().decode()
    assert 'pagedmlx:kv_blocks_total{kv_cache_group="state",model_name="m"} 24.0' in exposition
    assert "pagedmlx:state_checkpoints_saved_total" in exposition
    while engine.has_unfinished_requests():
        engine.step()
    assert_no_leaks(engine)


def test_state_slots_are_counted_in_the_kv_budget_first():
    model = make_model("qwen3_5-tiny")
    with pytest.raises(ValueError, match=r"512 recurrent-state slots \(256 running \+ 256 checkpoints\)"):
        LLMEngine(model, None, EngineConfig(kv_cache_memory_gb=0.001, max_num_seqs=256))
    sizes = {}
    for seqs in (8, 64):
        groups = LLMEngine(model, None, EngineConfig(kv_cache_memory_gb=0.01, max_num_seqs=seqs),
                           verify_model=False).runner.kv_cache_config.kv_cache_groups
        sizes[seqs] = sum(g.num_blocks * g.page_size_bytes for g in groups), groups[0].num_blocks
    assert sizes[8][0] <= 0.01e9 and sizes[64][0] <= 0.01e9 and sizes[64][1] < sizes[8][1]


def test_state_kernels_that_fail_at_load_are_switched_off_and_mlx_lm_serves(monkeypatch, caplog):
    """Where the CUDA state kernels would run but fail (to build, to run, or to agree), the load-time
    check switches them off with one warning and the model is served by mlx-lm's own state code, with
    the same tokens: never refused, never wrong. (A stand-in: this CPU pretends to be a CUDA GPU whose
    kernels raise.)"""
    import logging

    from pagedmlx.kernels import build, recurrent_state

    def broken(name):
        raise RuntimeError("[cuda::kernel] no CUDA here")

    monkeypatch.setattr(recurrent_state, "_kernel", broken)
    monkeypatch.delenv("PAGEDMLX_CUDA_KERNELS", raising=False)
    model = make_model("qwen3_5-tiny")
    config = EngineConfig(block_size=4, num_blocks=64, max_num_batched_tokens=64)
    with monkeypatch.context() as gpu, caplog.at_level(logging.WARNING, logger="pagedmlx"):
        gpu.setattr(build, "gpu_backend", lambda: "cuda")
        engine = LLMEngine(model, None, config)
        warnings = [r.getMessage() for r in caplog.records if "state CUDA kernels off" in r.getMessage()]
        assert len(warnings) == 1 and "no CUDA here" in warnings[0]
        assert not engine.runner.kernels.state and not engine.runner.state_pool.in_place
        # The switch is the runner's own: a later runner in the process starts with the kernels on.
        assert LLMEngine(model, None, config, verify_model=False).runner.state_pool.in_place
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [7]]
    done = run_staggered(engine, prompts, GREEDY, seed=1)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], model, p, GREEDY.max_tokens, i)


def test_state_kernels_are_named_by_their_source(monkeypatch):
    """Built by build.make_kernel, whose names carry the source's hash: MLX's on-disk JIT cache,
    keyed by name, never serves a kernel built from an older source."""
    from pagedmlx.kernels import build, recurrent_state

    built = []
    monkeypatch.setattr(build, "make_kernel", lambda *args: built.append(args))
    recurrent_state._kernel.cache_clear()
    try:
        for name in ("gated_delta", "depthwise_conv", "write_rows"):
            recurrent_state._kernel(name)
    finally:
        recurrent_state._kernel.cache_clear()
    assert [(b[0], b[1]) for b in built] == [("cuda", "pagedmlx_gated_delta"), ("cuda", "pagedmlx_depthwise_conv"),
                                             ("cuda", "pagedmlx_write_rows")]
