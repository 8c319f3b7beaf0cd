"""Speculative decoding's parts without a model: the n-gram proposer against brute force, the config's
errors, the sampler's verification statistics (temperature > 0), a scheduler simulation whose fake KV
catches any page that serves a rejected draft, the metrics and the front end's stop strings."""

from __future__ import annotations

import argparse
import pickle
import random

import mlx.core as mx
import numpy as np
import pytest
from sched_utils import EOS, check_invariants, make_request, make_scheduler
from sched_utils import assert_no_leaks as assert_sched_no_leaks
from utils import CHI2_P1E4, chi_square

from pagedmlx.config import EngineConfig, SpeculativeConfig
from pagedmlx.request import Request
from pagedmlx.sample.sampler import Sampler
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.spec_decode.ngram_proposer import NgramProposer, find_ngram_draft
from pagedmlx.sample.rejection_sampler import verify

# ---- the n-gram proposer ----------------------------------------------------------------------------


def brute_force_draft(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    """The definition: the longest suffix n-gram (min_n..max_n) with an earlier occurrence, its most
    recent one, and the k tokens after it."""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        for start in range(L - n - 1, -1, -1):
            if tokens[start:start + n] == tokens[L - n:]:
                return tokens[start + n:start + n + k]
    return []


def test_ngram_draft_examples():
    f = lambda t, lo, hi, k: find_ngram_draft(np.array(t), lo, hi, k).tolist()  # noqa: E731
    assert f([1, 2, 3, 4, 1, 2, 3], 2, 3, 4) == [4, 1, 2, 3]  # vLLM's docstring example
    assert f([1, 2, 9, 1, 2, 7, 1, 2], 2, 2, 3) == [7, 1, 2]  # the most recent occurrence, not the first
    assert f([5, 1, 2, 3, 8, 2, 3, 9, 1, 2, 3], 2, 3, 2) == [8, 2]  # the longest n-gram wins over a later shorter one
    assert f([4, 4, 4, 4], 2, 3, 5) == [4]  # an occurrence overlapping the suffix: only what follows it
    assert f([1, 2, 3, 4, 5], 1, 3, 4) == [] and f([7], 1, 1, 2) == [] and f([], 1, 2, 2) == []
    assert f([1, 2, 3, 1, 2], 3, 4, 4) == []  # only a 2-gram recurs: below prompt_lookup_min


def test_ngram_draft_equals_brute_force():
    rng = random.Random(0)
    for _ in range(3000):
        tokens = [rng.randrange(rng.choice([2, 3, 5])) for _ in range(rng.randint(0, 40))]
        lo = rng.randint(1, 3)
        hi, k = rng.randint(lo, 5), rng.randint(1, 5)
        got = find_ngram_draft(np.array(tokens, np.int64), lo, hi, k).tolist()
        assert got == brute_force_draft(tokens, lo, hi, k), (tokens, lo, hi, k)


def test_proposer_context_grows_with_the_request():
    proposer = NgramProposer(3, 1, 2)
    req = Request("r", [1, 2, 3], SamplingParams())
    for t in [1, 2, 3, 4] * 40:
        req.append_output_token(t)
        assert proposer.context(req).tolist() == req.all_token_ids
    assert proposer.propose(req, 2) == [1, 2] and proposer.propose(req, 9) == [1, 2, 3]


# ---- the config ------------------------------------------------------------------------------------

@pytest.mark.parametrize("value,message", [
    ({"method": "eagle", "num_speculative_tokens": 2}, "method 'eagle' is not supported yet"),
    ({"method": "ngram"}, "num_speculative_tokens is required"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens must be an integer >= 1, got 0"),
    ({"num_speculative_tokens": "4"}, "num_speculative_tokens must be an integer"),
    ({"num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     r"prompt_lookup_min \(4\) must be <="),
    ({"num_speculative_tokens": 2, "prompt_lookup_max": 0}, "prompt_lookup_max must be an integer >= 1"),
    ({"num_speculative_tokens": 2, "bogus": 1}, "unknown field 'bogus'"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "model is required with method 'draft_model'"),
    ({"method": "ngram", "num_speculative_tokens": 2, "model": "org/draft"}, "needs method 'draft_model'"),
    ({"num_speculative_tokens": 2, "min_acceptance_rate": 2}, "min_acceptance_rate must be a number in"),
    ({"num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size must be an integer >= 1"),
    ('{"method": "ngram", ', "speculative_config is not valid JSON"),
    ([1, 2], "must be a JSON object"),
])
def test_a_bad_config_names_its_field(value, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(speculative_config=value)


def test_config_defaults_json_cli_and_pickle():
    assert (SpeculativeConfig(num_speculative_tokens=3).prompt_lookup_min, SpeculativeConfig(
        num_speculative_tokens=3).prompt_lookup_max) == (5, 5)  # vLLM's
    c = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4}')
    assert c.speculative_config == SpeculativeConfig("ngram", 4, 4, 4)
    assert EngineConfig(
        speculative_config={"model": "[ngram]", "num_speculative_tokens": 2}).speculative_config.method == "ngram"
    draft = EngineConfig(speculative_config='{"model": "org/draft", "num_speculative_tokens": 4}').speculative_config
    assert (draft.method, draft.model) == ("draft_model", "org/draft")  # vLLM's default method for a model
    assert pickle.loads(pickle.dumps(c)).speculative_config == c.speculative_config  # crosses to the core process
    from pagedmlx.engine.arg_utils import add_engine_args, engine_config

    p = argparse.ArgumentParser()
    add_engine_args(p)
    cfg = engine_config(p.parse_args(["--speculative-config", '{"num_speculative_tokens": 3, "prompt_lookup_min": 2}']))
    assert cfg.speculative_config == SpeculativeConfig("ngram", 3, 2, 2)
    assert engine_config(p.parse_args([])).speculative_config is None
    with pytest.raises(SystemExit):
        p.parse_args(["--speculative-config", '{"num_speculative_tokens": -1}'])


# ---- the sampler's verification, temperature > 0 -----------------------------------------------------


@pytest.mark.parametrize("temperature,top_k,draft", [(1.0, 0, 1), (0.7, 4, 0), (0.7, 4, 5)])
def test_verification_keeps_the_target_distribution(temperature, top_k, draft):
    """20,000 seeded requests, one draft each, in one sampler call: the first row's token t0 follows the
    target p (softmax of the logits / T, top_k applied); the draft is accepted (t0 == draft) with
    probability p(draft) (binomial, 4.5 sigma); rejected rows follow p without the draft, renormalised.
    A draft top_k cuts (token 5) is never accepted."""
    N, V = 20_000, 6
    row = np.array([2.0, 1.5, 1.0, 0.5, 0.0, -0.5], np.float32)
    x = row / temperature
    if top_k:
        x[np.argsort(-x)[top_k:]] = -np.inf
    p = np.exp(x - x.max())
    p /= p.sum()
    params = SamplingParams(temperature=temperature, top_k=top_k or 0, seed=0)
    reqs = [Request(str(i), [1], SamplingParams(**{**params.__dict__, "seed": i})) for i in range(N)]
    logits = mx.array(np.tile(row, (2 * N, 1)))
    out = Sampler()(logits, reqs, None, [1] * N)
    t0 = np.array(out.sampled_token_ids.tolist()).reshape(N, 2)[:, 0]
    support = p > 0
    counts = np.bincount(t0, minlength=V)
    assert counts[~support].sum() == 0
    assert chi_square(counts[support], N * p[support]) < CHI2_P1E4[support.sum() - 1]
    accepted = int((t0 == draft).sum())
    assert abs(accepted - N * p[draft]) <= 4.5 * np.sqrt(N * p[draft] * (1 - p[draft])) + 1e-9
    rest = support.copy()
    rest[draft] = False
    rejected = np.bincount(t0[t0 != draft], minlength=V)[rest]
    assert chi_square(rejected, rejected.sum() * p[rest] / p[rest].sum()) < CHI2_P1E4[rest.sum() - 1]
    # Row 1 (the bonus row) draws its own noise: the next position's, not row 0's again.
    t1 = np.array(out.sampled_token_ids.tolist()).reshape(N, 2)[:, 1]
    assert (t0 != t1).mean() > 0.3


def test_verify_keeps_the_agreeing_prefix_and_the_next_token():
    kept, starts = verify([5, 6, 7, 9, 1, 2, 3, 4], [3, 0, 2], np.array([5, 6, 8, 2, 3]))
    assert kept == [[5, 6, 7], [1], [2, 3, 4]] and starts == [0, 4, 5]


# ---- the scheduler with drafts: a fake model that remembers which token wrote each slot --------------

def test_scheduler_never_serves_a_rejected_draft():
    """Requests over a 5-token alphabet whose "model" is a function of the last three tokens, so that
    identical prefixes recur (prefix hits), n-gram drafts are partly right, and EOS (0) may end a request
    inside its accepted drafts. Each slot holds the token last written there; every step, every context
    a request reads through its block table (before its new tokens) must be its own verified tokens: a
    cached page that still held a rejected draft would show. Small pool: preemption; small budget:
    chunked prefill and cut drafts. Outputs equal the same model run without speculation."""
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, prompt_lookup_max=2)
    sched = make_scheduler(num_blocks=14, block_size=4, max_num_batched_tokens=20, max_model_len=48,
                           speculative_config=spec)
    V = 5

    def target(ctx) -> int:
        return (ctx[-1] * 7 + ctx[-2] * 3 + (ctx[-3] if len(ctx) > 2 else 1) + (len(ctx) % 13 == 0)) % V

    def solo(prompt, max_tokens):
        ctx, out = list(prompt), []
        while len(out) < max_tokens and len(ctx) < 48:
            out.append(target(ctx))
            ctx.append(out[-1])
            if out[-1] == EOS:
                break
        return out

    rng = random.Random(5)
    stems = [[rng.randrange(1, V) for _ in range(rng.randint(4, 12))] for _ in range(3)]
    prompts = [rng.choice(stems) + [rng.randrange(1, V) for _ in range(rng.randint(0, 6))] for _ in range(30)]
    kv = np.full(len(sched.kv_cache_manager.block_pool.blocks) * 4, -1, np.int64)
    pending, done, steps = list(enumerate(prompts)), {}, 0
    while pending or sched.has_unfinished_requests():
        steps += 1
        assert steps < 2000, "requests did not finish"
        for _ in range(rng.randint(0, 4)):
            if pending:
                i, p = pending.pop(0)
                sched.add_request(make_request(str(i), p, max_tokens=rng.randint(6, 24)))
        out = sched.schedule()
        if out.is_empty:
            continue
        kv[out.slot_mapping[0]] = out.input_ids
        drafts = out.scheduled_spec_decode_tokens
        sampled = []
        for i, rid in enumerate(out.req_ids):
            req = sched.requests[rid]
            start = int(out.seq_lens[i]) - out.num_scheduled_tokens[i]
            pos = np.arange(start)
            assert kv[out.block_table[0, i, pos // 4] * 4 + pos % 4].tolist() == req.all_token_ids[:start], rid
        for rid in out.sampled_req_ids:
            req, d = sched.requests[rid], drafts.get(rid, [])
            rows = [target(req.all_token_ids + d[:j]) for j in range(len(d) + 1)]
            sampled.append(verify(rows, [len(d)], np.array(d, np.int64))[0][0])
        for u in sched.update_from_output(out, sampled):
            if u.finished:
                done[u.request.request_id] = (u.request.prompt_token_ids, u.request.output_token_ids,
                                              u.request.sampling_params.max_tokens)
        proposals = {}
        for req in sched.running:
            if req.num_computed_tokens == req.num_tokens - 1:
                proposals[req.request_id] = find_ngram_draft(np.array(req.all_token_ids), 1, 2, 3).tolist()
        sched.update_draft_token_ids(proposals)
        check_invariants(sched)
    for prompt, output, max_tokens in done.values():
        assert output == solo(prompt, max_tokens), prompt
    stats = sched.spec_decoding_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    assert sched.num_preemptions > 0 and sched.kv_cache_manager.stats.hits > 0
    assert any(o[-1] == EOS for _, o, _ in done.values())
    assert_sched_no_leaks(sched)


# ---- metrics and the front end -----------------------------------------------------------------------

def test_metrics_export_vllms_spec_decode_counters():
    from pagedmlx.server.metrics import EngineSnapshot, ServerMetrics

    m = ServerMetrics("m")
    base = dict(num_running=0, num_waiting=0, kv_usage=0.0, groups=[], prefix_queries=0, prefix_hits=0,
                num_preemptions=0, num_steps=0, step_schedule_s=0.0, step_forward_s=0.0, step_update_s=0.0,
                step_tokens=0)
    m.update(EngineSnapshot(**base, spec_decode_num_drafts=3, spec_decode_num_draft_tokens=9,
                            spec_decode_num_accepted_tokens=4, spec_decode_num_accepted_tokens_per_pos=[2, 1, 1]))
    m.update(EngineSnapshot(**base, spec_decode_num_drafts=5, spec_decode_num_draft_tokens=15,
                            spec_decode_num_accepted_tokens=7, spec_decode_num_accepted_tokens_per_pos=[4, 2, 1],
                            state_rollbacks=2, state_recomputed_tokens=5, spec_decode_num_lookup_drafts=3))
    text = m.render().decode()
    for line in ['vllm:spec_decode_num_drafts_total{model_name="m"} 5.0',
                 'vllm:spec_decode_num_draft_tokens_total{model_name="m"} 15.0',
                 'vllm:spec_decode_num_accepted_tokens_total{model_name="m"} 7.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 4.0',
                 'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="2"} 1.0',
                 'pagedmlx:spec_decode_state_rollbacks_total{model_name="m"} 2.0',
                 'pagedmlx:spec_decode_state_recomputed_tokens_total{model_name="m"} 5.0',
                 'pagedmlx:spec_decode_num_lookup_drafts_total{model_name="m"} 3.0']:
        assert line in text, line


def test_a_stop_string_inside_a_steps_tokens_ends_the_output_at_its_token():
    from utils import ARCHS, make_tokenizer  # noqa: I001

    from pagedmlx.engine.output_processor import OutputProcessor
    from pagedmlx.outputs import EngineCoreOutput

    tok = make_tokenizer(ARCHS["llama"]["vocab_size"])
    ids = tok.encode(" one two three four five", add_special_tokens=False)
    cut = next(i for i in range(1, len(ids)) if "two" in tok.decode(ids[:i + 1]))
    proc = OutputProcessor(tok)
    proc.add_request("r", [1], SamplingParams(stop=["two"]))
    [out], to_abort = proc.process([EngineCoreOutput("r", ids, None, None)])
    assert out.finished and out.finish_reason == "stop" and out.stop_reason == "two" and to_abort == ["r"]
    assert out.token_ids == ids[:cut + 1] and out.text == tok.decode(ids[:cut + 1]).split("two")[0]


def test_a_draft_model_drafts_fewer_tokens_where_they_are_rejected():
    """best_num_drafts: all k near certain acceptance, fewer as acceptance falls, the more so the dearer a
    draft token; the Drafter asks a costed proposer for that many per request, from the request's own
    accepted and rejected drafts, and asks a free one (n-gram) for all k whatever its acceptance."""
    from pagedmlx.spec_decode.drafter import Drafter, best_num_drafts

    assert [best_num_drafts(a, 0.25, 4) for a in (1.0, 0.95, 0.7, 0.5, 0.0)] == [4, 4, 2, 1, 1]
    assert best_num_drafts(0.9, 0.05, 8) > best_num_drafts(0.9, 0.25, 8) > best_num_drafts(0.9, 1.0, 8)
    assert best_num_drafts(0.5, 0.0, 6) == 6  # free drafts: the more the better

    class Recorder:
        def __init__(self):
            self.rooms = []

        def propose_batch(self, items):
            self.rooms.append([room for _, room in items])
            return {}

    config = SpeculativeConfig(method="draft_model", model="random:llama-tiny", num_speculative_tokens=4,
                               min_acceptance_rate=0.0)
    for cost, expect in ((0.25, [4, 1]), (0.0, [4, 4])):
        proposer = Recorder()
        drafter = Drafter(config, 1000, proposer, cost_ratio=cost)
        req = make_request("r", list(range(10)), max_tokens=100)
        req.num_computed_tokens = req.num_tokens - 1
        drafter.propose_draft_token_ids([req])  # no history yet: all k
        for _ in range(6):  # half of each draft's first token rejected
            drafter.observe(req, 4, 0)
            drafter.observe(req, 4, 1)
        drafter.propose_draft_token_ids([req])
        assert [min(rooms[0], 4) for rooms in proposer.rooms] == expect, cost  # the proposer drafts min(k, room)


def test_a_new_request_starts_from_the_draft_models_recent_acceptance():
    """The drafter's prior: a draft model whose drafts every request rejects makes a new request start paused
    (PAUSE_TOKENS), instead of spending the seven failed drafts its own estimate would take to fall from 1.0;
    it drafts again after the pause, and good drafts raise the prior back. The n-gram proposer keeps no prior:
    its acceptance is the text's."""
    from pagedmlx.spec_decode.drafter import PAUSE_TOKENS, Drafter

    class Recorder:
        def __init__(self):
            self.asked = []

        def propose_batch(self, items):
            self.asked += [req.request_id for req, _ in items]
            return {}

    def ready(rid):
        req = make_request(rid, list(range(10)), max_tokens=200)
        req.num_computed_tokens = req.num_tokens - 1
        return req

    config = SpeculativeConfig(method="draft_model", model="random:llama-tiny", num_speculative_tokens=3,
                               min_acceptance_rate=0.15)
    proposer = Recorder()
    drafter = Drafter(config, 1000, proposer, cost_ratio=0.25)
    first = ready("a")
    drafter.propose_draft_token_ids([first])
    assert proposer.asked == ["a"]  # nothing known yet: it drafts
    for _ in range(8):
        drafter.observe(first, 3, 0)
    assert drafter.prior.rate < 0.15 and drafter.paused(first)
    late = ready("b")
    drafter.propose_draft_token_ids([late])
    assert proposer.asked == ["a"] and drafter.paused(late)  # starts paused: no draft asked for
    for _ in range(PAUSE_TOKENS):
        late.append_output_token(7)
    late.num_computed_tokens = late.num_tokens - 1
    drafter.propose_draft_token_ids([late])
    assert proposer.asked == ["a", "b"]  # after its pause it tries again
    for _ in range(6):
        drafter.observe(late, 3, 3)
    assert drafter.prior.rate > 0.8
    fresh = ready("c")
    drafter.propose_draft_token_ids([fresh])
    assert proposer.asked[-1] == "c"

    ngram = Drafter(SpeculativeConfig(method="ngram", num_speculative_tokens=3, min_acceptance_rate=0.15), 1000)
    assert ngram.prior is None
    req = ready("d")
    ngram.propose_draft_token_ids([req])
    for _ in range(8):
        ngram.observe(req, 3, 0)
    assert not ngram.paused(ready("e"))
