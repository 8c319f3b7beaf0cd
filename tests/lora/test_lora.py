"""Batched multi-LoRA (pagedmlx/lora/): in one busy engine, rows of four mlx-lm adapters (LoRA and
DoRA, different keys, layers, ranks and scales) and of the base model give each request exactly the
tokens mlx-lm gives that prompt alone with its adapter loaded (greedy, float32); pages computed
with one adapter never serve another; bad adapters are refused with their reason and the engine
goes on."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from lora_utils import ADAPTER_SPECS, References, fresh, make_adapter
from utils import ARCHS, assert_no_leaks, make_prompts

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.lora.request import LoRARequest
from pagedmlx.loaders.random_model import build_model
from pagedmlx.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    base = fresh()
    return [LoRARequest(f"a{i}", i + 1, make_adapter(str(root / f"a{i}"), base, **spec))
            for i, spec in enumerate(ADAPTER_SPECS)]


@pytest.fixture(scope="module")
def refs():
    return References(fresh())


def lora_engine(model: nn.Module = None, **kw) -> LLMEngine:
    cfg = dict(block_size=4, num_blocks=160, max_num_batched_tokens=96, long_prefill_token_threshold=48,
               max_num_seqs=32, enable_lora=True, max_loras=4, max_lora_rank=8)
    cfg.update(kw)
    return LLMEngine(model if model is not None else fresh()(), None, EngineConfig(**cfg))


def spy_steps(engine: LLMEngine) -> list[tuple[int, bool]]:
    """Per step with adapter rows: (distinct adapters, whether base rows ran beside them)."""
    seen, manager = [], engine.runner.lora_manager
    real = manager.prepare_step

    def spy(ids, counts):
        out = real(ids, counts)
        if out is not None:
            seen.append((len(out.slots), bool((ids == 0).any())))
        return out

    manager.prepare_step = spy
    return seen


def run_staggered(engine: LLMEngine, prompts, loras, params, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    pending = list(enumerate(zip(prompts, loras)))
    done: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i, (p, lora) = pending.pop(0)
                engine.add_request(str(i), p, params, lora_request=lora)
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    return done


@pytest.mark.parametrize("max_loras,max_cpu_loras,overlap,merged", [(4, None, False, False), (2, 2, True, False),
                                                                     (4, None, False, True)])
def test_busy_engine_of_four_adapters_and_the_base_equals_mlx_lm_alone(adapters, refs, max_loras, max_cpu_loras,
                                                                       overlap, merged):
    """64 staggered requests, a quarter of the adapter ones on each adapter and every seventh on the
    base, through chunked prefill, shared prefixes and preemption. With 2 slots (and 2 adapters kept
    on the host, the others read again from their folders) the others wait their turn: a step
    never holds more adapters than slots; there, steps also overlap (async scheduling). merged: the
    base's projections merged (layers/merged_linear.py, a GPU's default), the adapters on their parts."""
    prompts = make_prompts(64, ARCHS["llama"]["vocab_size"], seed=7)
    # Every third prompt extends one of three shared prefixes: those run with the prefix's adapter,
    # so that requests of one adapter find each other's pages.
    prefixes = sorted({tuple(p[:40]) for p in prompts[::3]})
    loras = [None if i % 7 == 6 else adapters[prefixes.index(tuple(p[:40])) if i % 3 == 0 else i % 4]
             for i, p in enumerate(prompts)]
    engine = lora_engine(max_loras=max_loras, max_cpu_loras=max_cpu_loras, async_scheduling=overlap,
                         merge_projections=merged)
    assert (engine.runner.merged_groups > 0) == merged
    steps = spy_steps(engine)
    done = run_staggered(engine, prompts, loras, GREEDY, seed=3)

    assert max(n for n, _ in steps) == max_loras  # rows of several adapters in one step, never more than slots
    assert any(base for _, base in steps)  # ... beside base rows
    assert engine.kv_cache_manager.stats.hits > 0
    if max_loras == 4:
        assert engine.scheduler.num_preemptions > 0 and engine.kv_cache_manager.stats.preempted_hits > 0
    changed = 0
    for i, (p, lora) in enumerate(zip(prompts, loras)):
        path, name = (lora.lora_path, lora.lora_name) if lora else (None, "base")
        refs.check(done[str(i)], path, p, GREEDY.max_tokens, f"request {i} ({name}, {len(p)} tokens)")
        changed += lora is not None and refs(path, p, GREEDY.max_tokens) != refs(None, p, GREEDY.max_tokens)
    assert changed >= 40  # the adapters really change the tokens
    assert (engine.stats.num_overlapped > 0) == overlap
    assert_no_leaks(engine)


def test_a_cached_page_of_one_adapter_never_serves_another(adapters, refs):
    """The same 40-token prompt under a0, a1, the base, then a0 again: only the second a0 request
    finds pages (a0's); the block hashes of one prompt differ by adapter."""
    from pagedmlx.core.kv.block_hash import hash_request_blocks

    prompt = [(13 * j) % 500 + 1 for j in range(40)]
    engine = lora_engine()
    got = {}
    for name, lora in [("a0", adapters[0]), ("a1", adapters[1]), ("base", None), ("a0 again", adapters[0])]:
        engine.add_request(name, prompt, GREEDY, lora_request=lora)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    got[name] = out
        refs.check(got[name].token_ids, lora.lora_path if lora else None, prompt, GREEDY.max_tokens, name)
    assert [got[n].num_cached_tokens for n in ("a0", "a1", "base", "a0 again")] == [0, 0, 0, 36]
    hashes = {}
    for lid in (None, 1, 2):
        hashes[lid] = []
        lora = adapters[lid - 1] if lid else None
        hash_request_blocks(prompt, 4, hashes[lid], (("lora", lid, lora.lora_name, lora.lora_path),) if lid else None)
    assert not set(hashes[None]) & set(hashes[1]) and not set(hashes[1]) & set(hashes[2])
    assert_no_leaks(engine)


QWEN2_BIASED = dict(model_type="qwen2", hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                    num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, vocab_size=512,
                    tie_word_embeddings=False)


def _quantized_llama() -> nn.Module:
    model = fresh()()
    nn.quantize(model, group_size=32, bits=4, class_predicate=lambda p, m: isinstance(m, nn.Linear) and "layers" in p)
    return model


def keys_paths(model: nn.Module, keys: list[str]) -> list[str]:
    """The paths of every layer's modules named by keys."""
    return [f"model.layers.{i}.{k}" for i in range(len(model.model.layers)) for k in keys]


@pytest.mark.parametrize("base_name,merged", [("4-bit llama", False), ("qwen2 with biases", False),
                                              ("4-bit llama", True), ("qwen2 with biases", True)])
def test_lora_and_dora_on_quantized_and_biased_layers_equal_mlx_lm(tmp_path, base_name, merged):
    """Where DoRA's product is not the base layer's (a QuantizedLinear, which mlx-lm's DoRALinear
    dequantizes; a Linear with a bias, which it adds after the norm), DoRA rows take their own and
    LoRA and base rows in the same step still get theirs. merged: the base's q/k/v and gate/up merged
    (layers/merged_linear.py, a GPU's default), the adapters on their parts."""
    base = _quantized_llama if base_name == "4-bit llama" else (lambda: build_model(QWEN2_BIASED, 0))
    keys = ["self_attn.q_proj", "self_attn.v_proj", "mlp.up_proj"]
    loras = [LoRARequest(name, i + 1, make_adapter(str(tmp_path / name), base, rank=4, scale=6.0, seed=i + 5,
                                                   keys=keys, dora=name == "dora"))
             for i, name in enumerate(["lora", "dora"])]
    refs = References(base)
    prompts = make_prompts(12, 500, seed=2)
    assign = [loras[0], loras[1], None] * 4
    engine = lora_engine(base(), max_loras=2, merge_projections=merged)
    assert (engine.runner.merged_groups > 0) == merged
    done = run_staggered(engine, prompts, assign, GREEDY, seed=1)
    assert set(engine.runner.lora_manager.layers) == set(keys_paths(engine.runner.model, keys))
    for i, (p, lora) in enumerate(zip(prompts, assign)):
        refs.check(done[str(i)], lora.lora_path if lora else None, p, GREEDY.max_tokens, (i, lora))
    assert_no_leaks(engine)


def test_bad_adapters_are_refused_with_their_reason_and_the_engine_goes_on(tmp_path, adapters, refs):
    base = fresh()
    engine = lora_engine()
    make_adapter(str(tmp_path / "big"), base, rank=16, scale=1.0, seed=1, keys=["self_attn.q_proj"])
    make_adapter(str(tmp_path / "other"), fresh("llama-tiny-tied"), rank=4, scale=1.0, seed=1,
                 keys=["self_attn.v_proj", "mlp.up_proj"])  # 2 layers too, other widths
    make_adapter(str(tmp_path / "head"), base, rank=4, scale=1.0, seed=1, keys=["lm_head"])
    full = tmp_path / "full"
    full.mkdir()
    (full / "adapter_config.json").write_text('{"fine_tune_type": "full", "num_layers": 2}')
    (full / "adapters.safetensors").write_bytes((tmp_path / "big" / "adapters.safetensors").read_bytes())
    cases = [
        ("big", "rank 16 exceeds max_lora_rank 8"),
        ("other", "shapes do not match the base model"),
        ("head", "keys outside the transformer layers (lm_head)"),
        ("full", "a full fine-tune is a whole model"),
        ("missing", "No adapter found"),
    ]
    for i, (name, reason) in enumerate(cases):
        with pytest.raises(ValueError, match=rf"^adapter '{name}' .*{reason}".replace("(", r"\(").replace(")", r"\)")):
            engine.add_request(name, [1, 2, 3], GREEDY, lora_request=LoRARequest(name, 10 + i, str(tmp_path / name)))
    assert engine.add_lora(adapters[0]) and not engine.add_lora(adapters[0])
    with pytest.raises(ValueError, match="lora_int_id 1 already names adapter 'a0'"):
        engine.add_request("x", [1, 2], GREEDY, lora_request=LoRARequest("impostor", 1, adapters[1].lora_path))
    assert not engine.has_unfinished_requests() and engine.list_loras() == {1}
    prompt = [5, 6, 7, 8, 9]
    engine.add_request("ok", prompt, GREEDY, lora_request=adapters[0])
    out = [o for o in engine.step() + engine.step() if o.finished]
    while engine.has_unfinished_requests():
        out += [o for o in engine.step() if o.finished]
    assert out[0].token_ids == refs(adapters[0].lora_path, prompt, GREEDY.max_tokens)
    plain = LLMEngine(fresh()(), None, EngineConfig(block_size=4, num_blocks=32))
    with pytest.raises(ValueError, match="LoRA is not enabled"):
        plain.add_request("x", prompt, GREEDY, lora_request=adapters[0])
    assert_no_leaks(engine)


def test_an_adapter_removed_while_its_requests_run_serves_them_to_the_end(adapters, refs):
    engine = lora_engine(max_loras=1)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], [2, 7, 1, 8, 2, 8]]
    engine.add_request("r0", prompts[0], GREEDY, lora_request=adapters[0])
    engine.add_request("r1", prompts[1], GREEDY, lora_request=adapters[1])  # waits: one slot
    engine.step()
    assert engine.remove_lora(1) and engine.list_loras() == {2}
    assert not engine.remove_lora(1) and not engine.remove_lora(99)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    assert done["r0"] == refs(adapters[0].lora_path, prompts[0], GREEDY.max_tokens)
    assert done["r1"] == refs(adapters[1].lora_path, prompts[1], GREEDY.max_tokens)
    manager = engine.runner.lora_manager
    manager.add_adapter(adapters[1])  # forgets what no request runs with any more
    assert manager.get_adapter(1) is None and 1 not in manager._slot_of
    assert all(not layer.lora_slots or layer.lora_slots == {1} for layer in manager.layers.values())
    # The id is free again: another folder may take it, and never a page of the adapter it named.
    engine.add_request("r2", prompts[0], GREEDY, lora_request=LoRARequest("a2", 1, adapters[2].lora_path))
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id], cached = out.token_ids, out.num_cached_tokens
    assert done["r2"] == refs(adapters[2].lora_path, prompts[0], GREEDY.max_tokens) and cached == 0
    assert_no_leaks(engine)


def test_llm_generate_takes_one_adapter_for_all_prompts_or_one_per_prompt(adapters, refs):
    from pagedmlx import LLM

    llm = LLM.from_engine(lora_engine())
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5], [8, 9, 7, 9]]
    for loras in ([adapters[3], None, adapters[2]], adapters[1]):
        outs = llm.generate(prompts, GREEDY, lora_request=loras)
        each = loras if isinstance(loras, list) else [loras] * 3
        for p, lora, out in zip(prompts, each, outs):
            assert out.lora_request is lora
            assert out.outputs[0].token_ids == refs(lora.lora_path if lora else None, p, GREEDY.max_tokens)
    with pytest.raises(ValueError, match="got 2 lora requests for 3 prompts"):
        llm.generate(prompts, GREEDY, lora_request=adapters[:2])


def test_the_base_model_runs_as_before_beside_an_idle_lora_engine(adapters):
    """Wrapped layers outside a step are their base layers: mlx-lm's own call on the engine's model
    object gives the base model's logits, bit for bit."""
    base = fresh()()
    engine = lora_engine(base)
    engine.add_request("a", [1, 2, 3, 4, 5], GREEDY, lora_request=adapters[1])
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.runner.lora_manager.layers  # wrapped
    x = mx.array([[1, 2, 3, 4, 5]])
    assert mx.array_equal(base(x), fresh()()(x)).item()


def test_the_scheduler_runs_at_most_max_loras_adapters_and_the_rest_wait_their_turn():
    """With 2 slots, a request for a third adapter waits (passed over, keeping its place) while
    later requests for running adapters or the base go ahead; it runs once a slot frees."""
    from sched_utils import FakeModel, make_request, make_scheduler

    sched = make_scheduler(num_blocks=64, max_num_batched_tokens=64)
    sched.config.max_loras = 2
    ids = [1, 2, 3, 1, 0, 3, 2, 4]
    for i, lid in enumerate(ids):
        lora = LoRARequest(f"a{lid}", lid, f"/adapters/{lid}") if lid else None
        sched.add_request(make_request(f"r{i}", [i + 1] * (3 + i), max_tokens=2 + i % 3, lora_request=lora))
    model, first_step = FakeModel(sched), {}
    for step in range(100):
        if not sched.has_unfinished_requests():
            break
        out, _ = model.step()
        running = {r.lora_request.lora_int_id for r in sched.running if r.lora_request is not None}
        assert len(running) <= 2 and len(set(out.lora_int_ids.tolist()) - {0}) <= 2
        if len(out.lora_int_ids):
            assert out.lora_int_ids.tolist() == [ids[int(rid[1:])] for rid in out.req_ids]
        for rid in out.req_ids:
            first_step.setdefault(rid, step)
    assert not sched.has_unfinished_requests()
    assert first_step["r2"] > first_step["r4"] == first_step["r3"] == 0  # r2 (adapter 3) waited, r3 / r4 did not
