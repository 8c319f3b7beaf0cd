"""Speculative decoding with the checkpoint's MTP module (spec_decode/mtp.py, mtp_proposer.py): its drafts are
what the module computes by mlx-lm's own caches from the target's hidden states (first and later drafts);
greedy output equals mlx-lm's solo generation token for token (busy engines of Qwen3.5, its MoE and
Qwen3-Next: chunked prefill, preemption, prefix hits, recurrent-state rollback); the weights load from a
checkpoint's `mtp.*` tensors through the target's sanitize; what cannot be served is refused by name.

No checkpoint with MTP weights is at hand: the modules are random, so their drafts are mostly rejected
(the engine's verification is the draft model's, tested with accepted drafts in test_spec_draft_model.py)."""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from test_spec_decode import GREEDY
from test_state_layers import state_engine
from utils import assert_no_leaks, assert_solo_greedy, make_model, run_staggered, shared_prefix_prompts

from pagedmlx.config import EngineConfig
from pagedmlx.engine.llm_engine import LLMEngine
from pagedmlx.spec_decode.mtp import make_mtp_model, read_mtp_weights, text_model

MTP_ARCHS = ["qwen3_5-tiny", "qwen3_5_moe-tiny", "qwen3_next-tiny"]
VOCAB = 512


def mtp_spec(k: int = 3, weights=None) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": 64, "min_acceptance_rate": 0.0,
            "model": weights}


def random_mtp_weights(target, seed: int = 5) -> dict:
    """MTP tensors as a checkpoint holds them (keys after `mtp.`, norms zero-centred), random."""
    mx.random.seed(seed)
    module = make_mtp_model(target)
    out = {}
    for k, v in nn.utils.tree_flatten(module.model.parameters()):
        if k.startswith("embed_tokens."):
            continue
        w = mx.random.normal(v.shape) * 0.05 if v.ndim == 1 else mx.random.normal(v.shape) * v.shape[-1] ** -0.5
        out[k] = w.astype(v.dtype)
    return out


def reference_drafts(target, mtp, tokens: list[int], k: int) -> list[int]:
    """The MTP's k greedy drafts after `tokens`, by mlx-lm caches: the target's final hidden states of all but
    the last token, the module over tokens[1:] with them, then its own hidden state for each later draft."""
    from mlx_lm.models.cache import KVCache

    hidden = text_model(target).model(mx.array([tokens[:-1]]))  # (1, n - 1, H)
    cache = [KVCache()]
    mtp.model.hidden = hidden
    out = mtp.model(mx.array([tokens[1:]]), cache)
    drafts = []
    for _ in range(k):
        drafts.append(int(mx.argmax(mtp.lm_head(out[:, -1]), axis=-1).item()))
        mtp.model.hidden = out[:, -1:]
        out = mtp.model(mx.array([[drafts[-1]]]), cache)
    mtp.model.hidden = None
    return drafts


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_drafts_are_the_modules_over_the_targets_hidden_states(arch):
    """After a prompt's prefill and after rounds whose drafts were rejected, the proposed drafts equal the
    module's own computation (alignment: token i + 1 with hidden state i, later drafts on its own state).
    The prompt prefills in three steps (40 tokens a step), and its first catch-up takes two (64 rows a step)."""
    target = make_model(arch)
    engine = state_engine(target, num_blocks=80, speculative_config=mtp_spec(3, random_mtp_weights(target)))
    mtp = engine.draft_proposer.runner.model
    prompt = [(7 * i + 3) % VOCAB for i in range(100)]
    engine.add_request("a", prompt, GREEDY)
    checked = 0
    while engine.has_unfinished_requests() and checked < 4:
        engine.step()
        req = engine.scheduler.requests.get("a")
        if req is None or not req.spec_token_ids:
            continue
        drafts = req.spec_token_ids.values()
        assert drafts == reference_drafts(target, mtp, list(req.all_token_ids), len(drafts)), checked
        checked += 1
    assert checked == 4


@pytest.mark.parametrize("arch", MTP_ARCHS)
def test_busy_engine_with_mtp_equals_solo(arch):
    """Shared prefixes (prefix hits), prompts longer than a step's budget (chunked prefill), a pool small
    enough to preempt; the recurrent states roll back what the target rejects."""
    target = make_model(arch)
    prompts = [[t % VOCAB for t in p] for p in shared_prefix_prompts(14, seed=4)]
    prompts += [[(5 * i + j) % VOCAB for j in range(90)] for i in range(2)]
    engine = state_engine(target, speculative_config=mtp_spec(3, random_mtp_weights(target)))
    done = run_staggered(engine, prompts, GREEDY, seed=3)
    for i, p in enumerate(prompts):
        assert_solo_greedy(done[str(i)], target, p, GREEDY.max_tokens, f"request {i} (prompt {len(p)} tokens)")
    stats = engine.scheduler.spec_decoding_stats
    assert stats.num_draft_tokens > 0 and engine.scheduler.num_preemptions > 0
    assert engine.kv_cache_manager.stats.hits > 0
    assert_no_leaks(engine)


def test_seeded_sampling_with_mtp_gives_the_tokens_it_gives_without():
    target = make_model("qwen3_5-tiny")
    from pagedmlx.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, seed=7, ignore_eos=True)
    prompts = [[(3 * i + j) % VOCAB for j in range(9 + i)] for i in range(4)]
    plain = run_staggered(state_engine(target), prompts, params, seed=1)
    spec = run_staggered(state_engine(target, speculative_config=mtp_spec(2, random_mtp_weights(target))), prompts,
                         params, seed=1)
    assert spec == plain


def test_weights_load_from_a_checkpoints_mtp_tensors(tmp_path):
    """The module's tensors from safetensors as a Hugging Face checkpoint holds them (`mtp.` keys, norms
    zero-centred: the checkpoint's convolutions are in their original layout), next to the model's own."""
    target = make_model("qwen3_5-tiny")
    weights = random_mtp_weights(target)
    conv = {"model.language_model.layers.0.linear_attn.conv1d.weight": mx.zeros((8, 1, 4))}  # unsanitized layout
    mx.save_safetensors(str(tmp_path / "model-00001.safetensors"), {**conv, "lm_head.weight": mx.zeros((4, 4))})
    mx.save_safetensors(str(tmp_path / "model-00002.safetensors"), {f"mtp.{k}": v for k, v in weights.items()})
    read, zero_centred = read_mtp_weights(tmp_path)
    assert zero_centred and sorted(read) == sorted(weights)
    module = make_mtp_model(target, str(tmp_path))
    got = dict(nn.utils.tree_flatten(module.model.parameters()))
    for k, v in weights.items():
        want = v + 1.0 if k.endswith("norm.weight") else v
        assert got[k].dtype == want.dtype and np.array_equal(np.array(got[k].astype(mx.float32)),
                                                             np.array(want.astype(mx.float32))), k
    assert module.lm_head is text_model(target).lm_head or not hasattr(text_model(target), "lm_head")


def test_what_cannot_be_served_is_refused(tmp_path):
    with pytest.raises(ValueError, match="needs a target with an MTP module.*'llama'"):
        LLMEngine(make_model("llama"), None, EngineConfig(block_size=4, speculative_config=mtp_spec(2, {})))
    target = make_model("qwen3_5-tiny")
    with pytest.raises(ValueError, match="give speculative_config.model"):
        LLMEngine(target, None, EngineConfig(block_size=4, speculative_config=mtp_spec(2)))
    weights = random_mtp_weights(target)
    weights.pop("fc.weight")
    with pytest.raises(ValueError, match="do not fit this model \\(missing model.fc.weight\\)"):
        make_mtp_model(target, weights)
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {"lm_head.weight": mx.zeros((4, 4))})
    with pytest.raises(ValueError, match="has no mtp.\\* weights"):
        read_mtp_weights(tmp_path)
    with pytest.raises(FileNotFoundError, match="no .safetensors files"):
        read_mtp_weights(tmp_path / "missing")


def test_a_served_random_target_gets_a_random_module():
    """`pagedmlx serve random:qwen3_5-tiny --speculative-config '{"method": "mtp", ...}'`: the config's JSON,
    the target loaded by name, a module of random weights; tokens equal mlx-lm's solo generation."""
    from pagedmlx.engine.core import EngineCore
    from pagedmlx.loaders.random_model import random_model

    config = EngineConfig(model="random:qwen3_5-tiny", block_size=4, num_blocks=64, max_model_len=128,
                          speculative_config='{"method": "mtp", "num_speculative_tokens": 2}')
    core = EngineCore.from_config(config)
    assert type(core.draft_proposer).__name__ == "MTPProposer" and core.runner.keep_hidden
    prompt = [3, 14, 15, 92, 65, 35]
    core.add_request("a", prompt, GREEDY)
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() for t in o.new_token_ids]
    assert_solo_greedy(tokens, random_model("qwen3_5-tiny", 0), prompt, GREEDY.max_tokens)


def test_a_draft_token_costs_the_modules_weights_and_the_head_not_the_embedding():
    """The drafter's cost of a draft token (its k per request): the MTP layer, fc, norms and the LM head."""
    from pagedmlx.runner.model import weights_nbytes

    target = make_model("qwen3_5-tiny")
    engine = state_engine(target, speculative_config=mtp_spec(2, random_mtp_weights(target)))
    mtp = engine.draft_proposer.runner.model
    text = text_model(target)
    own = weights_nbytes(mtp.model) - weights_nbytes(mtp.model.embed_tokens)
    head = weights_nbytes(text.lm_head) if hasattr(text, "lm_head") else weights_nbytes(text.model.embed_tokens)
    assert engine.draft_proposer.weight_bytes == own + head
    assert engine.drafter.cost_ratio == pytest.approx((own + head) / weights_nbytes(target))


def test_speculation_that_stops_and_resumes_with_the_batch_size_equals_solo():
    """More requests than disable_by_batch_size: steps overlap (async scheduling) and keep no hidden states
    while they run; as requests finish the rest speculate again, the module catching up after the gap."""
    target = make_model("qwen3_5-tiny")
    prompts = [[(11 * i + 5 * j) % VOCAB for j in range(6 + 3 * i)] for i in range(6)]
    params = [dataclasses.replace(GREEDY, max_tokens=30 if i == 5 else 4 + 2 * i) for i in range(6)]
    spec = {**mtp_spec(2, random_mtp_weights(target)), "disable_by_batch_size": 2}
    engine = state_engine(target, num_blocks=120, speculative_config=spec, async_scheduling=True)
    for i, (p, sp) in enumerate(zip(prompts, params)):
        engine.add_request(str(i), p, sp)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
    for i, (p, sp) in enumerate(zip(prompts, params)):
        assert_solo_greedy(done[str(i)], target, p, sp.max_tokens, i)
    assert engine.scheduler.spec_decoding_stats.num_draft_tokens > 0
    assert engine.stats.num_overlapped > 0  # steps overlapped while the batch was large


def test_a_paused_request_keeps_no_hidden_states():
    """A request whose drafts keep failing pauses (min_acceptance_rate); while it is paused no step's hidden
    states are kept for it (each would hold its whole step's array), and it resumes after the gap."""
    target = make_model("qwen3_5-tiny")
    spec = {**mtp_spec(2, random_mtp_weights(target)), "min_acceptance_rate": 0.9}
    engine = state_engine(target, speculative_config=spec)
    params = dataclasses.replace(GREEDY, max_tokens=60)
    prompt = [(7 * j + 1) % VOCAB for j in range(10)]
    engine.add_request("a", prompt, params)
    proposer, drafter = engine.draft_proposer, engine.drafter
    kept_while_paused, tokens = 0, []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
        req = engine.scheduler.requests.get("a")
        if req is not None and drafter.paused(req):
            kept_while_paused = max(kept_while_paused, len(proposer._chunks.get(req, (0, []))[1]))
    assert drafter.num_paused >= 1 and kept_while_paused <= 1
    assert engine.scheduler.spec_decoding_stats.num_drafts >= 2  # it speculated again after a pause
    assert_solo_greedy(tokens, target, prompt, 60)
