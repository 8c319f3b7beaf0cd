"""Compiled decode steps (runner/compiled_step.py): a decode-only step replayed through mx.compile must
give what the step built layer by layer gives. They run where pages are written in place (CUDA); on
the CPU the runner builds its steps as on CUDA with a stand-in for every kernel (zeros that depend on
the kernel's inputs: garbage tokens, but the same garbage both ways), which checks the trace itself:
its inputs, its keys (batch sizes, block tables padded to a power of two pages, async placeholders).
On a CUDA GPU (skipped elsewhere), the real kernels: compiled and built steps give the same tokens."""

from __future__ import annotations

import math
from typing import Optional

import mlx.core as mx
import pytest
from utils import make_model, run_staggered, shared_prefix_prompts

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.kernels import build, decode_attention, decode_attention_quant, page_write, recurrent_state
from pagedmlx.kernels.dialect import CUDA
from pagedmlx.kernels.selector import KernelPlan
from pagedmlx.runner.compiled_step import AUTO_MAX_DECODES, HOT_STEPS, CompiledDecode, table_bucket
from pagedmlx.sampling_params import SamplingParams

ON_CUDA = build.gpu_backend() == CUDA


class StandIn:
    def __init__(self, backend, name, input_names, output_names, source, header):
        pass

    def __call__(self, *, inputs, output_shapes, output_dtypes, **launch):
        return [mx.depends(mx.zeros(s, dt), inputs) for s, dt in zip(output_shapes, output_dtypes)]


@pytest.fixture
def standins(monkeypatch):
    monkeypatch.setattr(build, "make_kernel", StandIn)
    caches = (decode_attention._kernels, decode_attention_quant._kernels, page_write._write_kernel,
              page_write._quant_write_kernel, page_write._quantizing_write_kernel, recurrent_state._kernel)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def _engine(arch: str, compiled: Optional[bool], standins: bool, kv_cache_dtype: str = "auto",
            max_num_seqs: int = 4, model=None, **config) -> LLMEngine:
    # A model of its own (seed 3): the stand-ins class-swap a state model's modules (install_kernels).
    model = model if model is not None else make_model(arch, seed=3 if standins else 0)
    engine = LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=96, max_num_seqs=max_num_seqs,
                                                 async_scheduling=True, compile_decode=compiled,
                                                 kv_cache_dtype=kv_cache_dtype, **config))
    if standins:
        runner = engine.runner
        state = [p.state.owner for p in runner.plan if p.state is not None]
        runner.kernels = KernelPlan(CUDA, decode=True, page_write=True, state=bool(state))
        # int8: the write quantizes; int4: mx.quantize first
        runner.kv_pool.quantize_in_write = kv_cache_dtype == "int8"
        if state:  # the state kernels too, writing the state pool "in place"
            recurrent_state.install_kernels(model, state)
            runner.state_pool.in_place = True
        runner.compiled_decode = (None if compiled is False else
                                  CompiledDecode(runner, None if compiled else AUTO_MAX_DECODES))
    return engine


def test_table_bucket():
    assert [table_bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17)] == [1, 2, 4, 4, 8, 16, 16, 32]


# quantized pages (head_dim 32: qwen3's test model): written in place too, so compiled as well
ARCHS = [("llama", "auto"), ("gemma3-tiny", "auto"), ("qwen3_5-tiny", "auto"), ("qwen3", "int8"), ("qwen3", "int4")]


def _prompts(kv_cache_dtype: str) -> list[list[int]]:
    prompts = shared_prefix_prompts(5, seed=5)
    return prompts if kv_cache_dtype == "auto" else [[t % 448 for t in p] for p in prompts]  # qwen3's vocabulary


@pytest.mark.skipif(ON_CUDA, reason="the stand-ins are for a machine without the kernels")
@pytest.mark.parametrize("arch,kv_cache_dtype", ARCHS)
def test_compiled_steps_equal_built_steps_with_standins(standins, arch, kv_cache_dtype):
    prompts = _prompts(kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    built = run_staggered(_engine(arch, False, True, kv_cache_dtype), prompts, params, seed=1)
    engine = _engine(arch, True, True, kv_cache_dtype)
    compiled = run_staggered(engine, prompts, params, seed=1)
    assert compiled == built
    keys = engine.runner.compiled_decode.fns
    assert len(keys) >= 3  # batch sizes and table buckets: several keys, each traced once
    assert any(dict((n, s) for n, s, _ in k[0]).get("prev_sampled") is not None for k in keys)  # async placeholders


def test_by_default_small_steps_where_pages_are_written_in_place(standins):
    assert EngineConfig().compile_decode is None
    engine = _engine("llama", None, True, max_num_seqs=16)
    prompts = shared_prefix_prompts(12, seed=5)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    built = run_staggered(_engine("llama", False, True, max_num_seqs=16), prompts, params, seed=1)
    assert run_staggered(engine, prompts, params, seed=1) == built
    sizes = {dict((n, s) for n, s, _ in k[0])["input_ids"][0] for k in engine.runner.compiled_decode.fns}
    assert sizes and min(sizes) <= AUTO_MAX_DECODES < engine.scheduler.config.max_num_seqs


@pytest.mark.parametrize("arch,kv_cache_dtype", [("llama", "auto"), ("gemma3-tiny", "auto"), ("qwen3", "int8"),
                                                 ("qwen3", "int4")])
def test_scattered_pages_compiled_steps_equal_mlx_lm(monkeypatch, arch, kv_cache_dtype):
    """Where MLX scatters the new K/V (the CPU, Metal), a decode step's trace takes the pools as its state:
    each replay scatters into the pools it is handed and hands the new arrays back to KVPool's lists.
    A busy engine so compiled gives every request the tokens of the engine built step by step, which equal
    mlx-lm's alone (test_batched_equals_solo); the traces ran, and its pages end equal to the built engine's."""
    prompts = _prompts(kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference = _engine(arch, False, False, kv_cache_dtype)
    built = run_staggered(reference, prompts, params, seed=1)
    real, replays = CompiledDecode.__call__, []

    def counted(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        replays.append(out is not None and not self.new_trace)
        return out

    monkeypatch.setattr(CompiledDecode, "__call__", counted)
    engine = _engine(arch, None, False, kv_cache_dtype)
    runner = engine.runner
    assert runner.compiled_decode is not None and not runner.pages_in_place
    assert run_staggered(engine, prompts, params, seed=1) == built
    assert runner.compiled_decode is not None and sum(replays) > len(runner.compiled_decode.fns)  # proven, replayed
    # the same schedule wrote the same pages: the replays' scatters reached KVPool's lists
    for a, b in zip(runner.kv_pool.arrays, reference.runner.kv_pool.arrays, strict=True):
        assert mx.array_equal(a, b).item()


def _with_traces_wrapped(monkeypatch, wrap) -> LLMEngine:
    """A llama engine on scattered pages whose traces are `wrap(forward)`, run on a staggered schedule: its
    tokens must be the built engine's; returns the engine."""
    prompts = _prompts("auto")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    built = run_staggered(_engine("llama", False, False), prompts, params, seed=1)
    real = CompiledDecode._trace
    monkeypatch.setattr(CompiledDecode, "_trace", lambda self, *a, **k: wrap(real(self, *a, **k)))
    engine = _engine("llama", None, False)
    assert run_staggered(engine, prompts, params, seed=1) == built
    return engine


def test_a_trace_that_fails_part_way_leaves_the_pools_as_they_were(monkeypatch, caplog):
    """A trace that fails after some layers scattered into the pools (an operation mx.compile cannot trace,
    e.g. a kernel that evaluates its inputs) would leave tracers in KVPool's lists: they are put back, the
    compiled steps switch off with one warning, and the engine's tokens are the built engine's."""
    def failing(forward):
        def fail(*arrays):
            forward(*arrays)  # every layer scattered into the (traced) pools
            raise ValueError("cannot trace this")
        return fail

    engine = _with_traces_wrapped(monkeypatch, failing)
    assert engine.runner.compiled_decode is None and "compiled decode steps off" in caplog.text


def test_a_new_trace_over_scattered_pages_that_disagrees_is_switched_off(monkeypatch, caplog):
    """Where pages are scattered (Metal, the CPU), each new trace's first replay is compared with the step built
    as usual (which writes the same rows again): a trace whose logits differ switches compiled steps off with one
    warning. Its writes cannot be trusted, so the pages are zeroed and every running request recomputes: the
    tokens are the built engine's."""
    engine = _with_traces_wrapped(monkeypatch, lambda forward: lambda *arrays: forward(*arrays) * 3 + 1)
    assert engine.runner.compiled_decode is None and "differ from the built step's" in caplog.text
    assert "KV pages were lost" in caplog.text and engine.scheduler.num_preemptions > 0


def test_pages_a_failed_first_replay_left_unreadable_are_zeroed_and_recomputed(monkeypatch, caplog):
    """A new trace's first replay that fails after taking the pools over can leave an array in KVPool's lists
    that fails whenever it is read (here a tracer the trace leaked, as a trace that fails part way would).
    Falling back to a built step would then fail every later step; instead the pages are zeroed, every running
    request recomputes with built steps, and each gets the built engine's tokens."""
    real = CompiledDecode.__call__
    leaked = []

    def leak(x):
        leaked.append(x * 1)
        return x

    def poisoned(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.new_trace and not leaked:
            keys = self.runner.kv_pool.keys
            i = next(i for i, a in enumerate(keys) if a is not None)
            mx.compile(leak)(mx.zeros(keys[i].shape, keys[i].dtype))
            keys[i] = leaked[0]
        return out

    monkeypatch.setattr(CompiledDecode, "__call__", poisoned)
    engine = _with_traces_wrapped(monkeypatch, lambda forward: forward)
    assert leaked and engine.runner.compiled_decode is None
    assert "KV pages were lost" in caplog.text and engine.scheduler.num_preemptions > 0
    assert all(a is not None and a.shape == b.shape
               for a, b in zip(engine.runner.kv_pool.keys, engine.runner.kv_pool.values)
               if b is not None)


def test_scattered_state_models_are_not_compiled():
    """A recurrent-state model's state pool is scattered too, outside the trace's state: its steps are built."""
    engine = LLMEngine(make_model("qwen3_5-tiny"), None, EngineConfig(block_size=4, num_blocks=32, compile_decode=True))
    assert not engine.runner.pages_in_place and engine.runner.compiled_decode is None


def test_by_default_a_larger_step_is_compiled_once_its_key_is_hot(standins):
    """A steady batch of 12 (> AUTO_MAX_DECODES) decodes: each key's first HOT_STEPS - 1 steps are built,
    the next ones replay its trace; the tokens are the built engine's."""
    engine = _engine("llama", None, True, max_num_seqs=16)
    compiled = engine.runner.compiled_decode
    results, real = [], compiled.__call__

    class Spy(CompiledDecode):  # (a dunder is looked up on the class: the instance's class is swapped)
        def __call__(self, so, prev, lora=None):
            out = real(so, prev, lora)
            results.append((so.num_decodes, out is not None))
            return out

    compiled.__class__ = Spy
    prompts = [p[:9] for p in shared_prefix_prompts(12, seed=6)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def run(e: LLMEngine) -> dict[str, list[int]]:
        for i, p in enumerate(prompts):
            e.add_request(str(i), p, params)
        done = {}
        while e.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in e.step() if o.finished})
        return done

    assert run(engine) == run(_engine("llama", False, True, max_num_seqs=16))
    steady = [hit for n, hit in results if n == 12]
    rows = lambda key: dict((n, s) for n, s, _ in key[0])["input_ids"][0]  # noqa: E731
    traces = sum(rows(k) == 12 for k in compiled.fns)
    cold = {k: n for k, n in compiled.seen.items() if rows(k) == 12}  # keys whose steps ended before they were hot
    # each key (a new one when the tables reach a new bucket of pages) built until it is hot, then replayed
    assert traces >= 1 and steady.count(False) == (HOT_STEPS - 1) * traces + sum(cold.values())
    assert steady.count(True) > len(steady) / 2 and len(cold) <= 1
    assert not _engine("qwen3_5-tiny", None, True).runner.compiled_decode.larger  # state models: small steps only


@pytest.mark.skipif(ON_CUDA, reason="the stand-ins are for a machine without the kernels")
def test_compiled_steps_with_merged_projections_equal_built_ones(standins):
    """Merged q/k/v and gate/up (layers/merged_linear.py, a GPU's default) traced and replayed: a merged
    module keeps its input's product only while the trace builds, and the replayed steps equal the built."""
    from pagedmlx.loaders.random_model import random_model

    prompts = _prompts("auto")
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    model = random_model("llama-tiny", 3)
    built = run_staggered(_engine("llama", False, True, model=model, merge_projections=True), prompts, params, seed=1)
    engine = _engine("llama", True, True, model=model, merge_projections=True)
    assert engine.runner.merges and engine.runner.compiled_decode is not None
    assert run_staggered(engine, prompts, params, seed=1) == built
    assert engine.runner.compiled_decode.fns
    layer = model.model.layers[0]
    assert layer.self_attn.q_proj._input is None and layer.mlp.gate_proj._input is None


@pytest.mark.gpu
@pytest.mark.skipif(not ON_CUDA, reason="a CUDA GPU runs the kernels")
@pytest.mark.parametrize("arch,kv_cache_dtype", ARCHS)
def test_compiled_steps_equal_built_steps_on_cuda(arch, kv_cache_dtype):
    prompts = _prompts(kv_cache_dtype)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    built = run_staggered(_engine(arch, False, False, kv_cache_dtype), prompts, params, seed=1)
    engine = _engine(arch, True, False, kv_cache_dtype)
    assert engine.runner.compiled_decode is not None
    assert run_staggered(engine, prompts, params, seed=1) == built
    assert engine.runner.compiled_decode.fns


def test_lora_steps_compile_and_new_adapter_weights_make_new_traces(standins, tmp_path):
    """A LoRA engine's decode steps compile, adapter rows included: a key holds the step's slots and the
    adapters' generation, so a slot that takes another adapter's weights gets a new trace (a replay of
    the old one would add the old adapter). Three adapters through two slots, staggered, with base rows:
    the tokens are the built engine's."""
    from lora_utils import fresh, make_adapter

    from pagedmlx.lora.request import LoRARequest

    base = fresh()
    adapters = [LoRARequest(f"a{i}", i + 1, make_adapter(str(tmp_path / f"a{i}"), base, rank=4, scale=10.0, seed=i))
                for i in range(3)]
    prompts = shared_prefix_prompts(9, seed=2)
    loras = [adapters[i % 3] if i % 4 != 3 else None for i in range(len(prompts))]

    def run(compiled: Optional[bool]) -> tuple[dict[str, list[int]], LLMEngine]:
        engine = LLMEngine(base(), None, EngineConfig(block_size=4, num_blocks=96, max_num_seqs=4, enable_lora=True,
                                                      max_loras=2, max_lora_rank=4, compile_decode=compiled))
        runner = engine.runner
        runner.kernels = KernelPlan(CUDA, decode=True, page_write=True)
        runner.compiled_decode = None if compiled is False else CompiledDecode(runner, AUTO_MAX_DECODES)
        pending, done = list(enumerate(zip(prompts, loras))), {}
        while pending or engine.has_unfinished_requests():
            if pending and len(engine.scheduler.running) < 3:
                i, (p, lora) = pending.pop(0)
                engine.add_request(str(i), p, SamplingParams(temperature=0.0, max_tokens=6 + i % 5, ignore_eos=True),
                                   lora_request=lora)
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return done, engine

    built, _ = run(False)
    done, engine = run(None)
    assert done == built
    lora_keys = [k[3] for k in engine.runner.compiled_decode.fns if k[3] is not None]
    assert lora_keys and len({generation for _, _, generation in lora_keys}) >= 2


def test_verifying_steps_run_as_decode_rows_and_compile(standins):
    """Speculative steps (each request's last token and 3 drafts) run every token as a decode row
    where the decode kernel runs, so they replay a trace too; the tokens are the built engine's."""
    config = dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": 64,
                                      "min_acceptance_rate": 0.0})

    def run(compiled: Optional[bool]) -> tuple[dict, list]:
        engine = _engine("llama", compiled, True, **config)
        engine.drafter.proposer.propose = lambda req, room: [5, 6, 7][:room]
        steps = []
        if compiled is not False:
            cd, real = engine.runner.compiled_decode, engine.runner.compiled_decode.__call__

            class Spy(CompiledDecode):
                def __call__(self, so, prev, lora=None):
                    out = real(so, prev, lora)
                    steps.append((so.total_num_scheduled_tokens > so.num_reqs, out is not None))
                    return out

            cd.__class__ = Spy
        return run_staggered(engine, shared_prefix_prompts(4, seed=7), params, seed=1), steps

    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    built, _ = run(False)
    compiled, steps = run(True)
    assert compiled == built
    assert any(verify and replayed for verify, replayed in steps)


@pytest.mark.skipif(ON_CUDA, reason="the stand-ins are for a machine without the kernels")
def test_compiled_steps_return_the_hidden_states_an_mtp_module_reads(standins):
    """With an MTP module (spec_decode/mtp_proposer.py) the target keeps every step's hidden states: a compiled
    step returns them from its trace. Requests with penalties do not speculate: their decode-only steps
    compile, beside the speculating requests' verifying steps (built); tokens equal the built engine's."""
    from test_spec_mtp import mtp_spec, random_mtp_weights

    spec = mtp_spec(2, random_mtp_weights(make_model("qwen3_5-tiny", seed=3)))
    prompts = [p[:12] for p in shared_prefix_prompts(4, seed=5)]
    plain = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    penalized = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, repetition_penalty=1.1)

    def run(compiled: bool) -> tuple[dict, LLMEngine]:
        engine = _engine("qwen3_5-tiny", compiled, True, speculative_config=spec,
                         model=make_model("qwen3_5-tiny", seed=3))
        for i, p in enumerate(prompts):
            engine.add_request(str(i), [t % 512 for t in p], penalized if i < 2 else plain)
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        return done, engine

    built, _ = run(False)
    compiled, engine = run(True)
    assert compiled == built
    assert engine.runner.keep_hidden and any(key[-1] for key in engine.runner.compiled_decode.fns)
    assert engine.scheduler.spec_decoding_stats.num_draft_tokens > 0


def test_the_proofs_relative_error_counts_equal_infinities_as_equal():
    """A vocabulary masked with -inf on both sides agrees (it was NaN, which switched compiled steps off);
    -inf on one side only, or a NaN, never passes."""
    from pagedmlx.runner.selfcheck import relative_error

    inf, nan = float("inf"), float("nan")
    assert relative_error(mx.array([2.0, -inf]), mx.array([2.0, -inf])) == 0.0
    assert relative_error(mx.array([2.2, -inf]), mx.array([2.0, -inf])) == pytest.approx(0.1)
    assert relative_error(mx.array([2.0, 0.0]), mx.array([2.0, -inf])) == inf
    assert relative_error(mx.array([2.0, -inf]), mx.array([2.0, 0.0])) == inf
    assert math.isnan(relative_error(mx.array([nan, 1.0]), mx.array([1.0, 1.0])))
