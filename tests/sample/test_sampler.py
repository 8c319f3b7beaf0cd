"""Sampler: greedy/sampled rows side by side, per-request reproducibility, filters, penalties, logprobs."""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pagedmlx.request import Request
from pagedmlx.sample.sampler import Sampler, apply_bias_and_penalties, gumbel_noise, to_host
from pagedmlx.sampling_params import SamplingParams

_ids = itertools.count()
sampler = Sampler()
# Chi-square critical values at p = 0.001 (df -> value); seeds are fixed, so the tests are deterministic.
CHI2_001 = {2: 13.816, 5: 20.515, 7: 24.322}


def make_req(prompt=(1, 2, 3), outputs=(), step=None, seed=0, **kw) -> Request:
    """A request with `outputs` generated so far, or `step` dummy outputs (its step counter)."""
    r = Request(f"r{next(_ids)}", list(prompt), SamplingParams(seed=seed, **kw))
    for t in outputs:
        r.append_output_token(t)
    if step is not None:  # fast path for long dummy histories
        r.output_token_ids += [0] * step
        r.all_token_ids += [0] * step
    return r


def sample(logits, reqs):
    return to_host(sampler(mx.array(np.asarray(logits, dtype=np.float32)), reqs))


def tokens(logits, reqs) -> list[int]:
    return [row.token_id for row in sample(logits, reqs)]


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x.astype(np.float64)
    m = x.max(-1, keepdims=True)
    return x - m - np.log(np.exp(x - m).sum(-1, keepdims=True))


def chi2(counts: np.ndarray, probs: np.ndarray) -> float:
    expected = probs * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


# --- greedy -------------------------------------------------------------------------------------

def test_greedy_rows_equal_argmax_alone_and_mixed():
    logits = np.random.default_rng(0).normal(size=(8, 64)).astype(np.float32) * 3
    assert tokens(logits, [make_req(temperature=0.0, seed=i) for i in range(8)]) == list(logits.argmax(-1))
    reqs = [make_req(temperature=0.0 if i % 2 == 0 else 1.3, top_k=5 * (i % 3), top_p=0.9, seed=i)
            for i in range(8)]
    got = tokens(logits, reqs)
    assert [got[i] for i in range(0, 8, 2)] == list(logits[::2].argmax(-1))


def test_top_k_1_is_greedy():
    logits = np.random.default_rng(1).normal(size=(16, 100)).astype(np.float32)
    reqs = [make_req(temperature=2.0, top_k=1, seed=i, step=i) for i in range(16)]
    assert tokens(logits, reqs) == list(logits.argmax(-1))


# --- reproducibility and distribution ----------------------------------------------------------

def _others(rng, n, V):
    """Random neighbours: other params, penalties, logprobs, greedy rows."""
    out = []
    for i in range(n):
        kind = i % 4
        kw = [dict(temperature=0.0), dict(temperature=0.5, top_k=7, logprobs=3),
              dict(temperature=1.7, top_p=0.5, min_p=0.05, presence_penalty=1.0, repetition_penalty=1.3),
              dict(temperature=1.0, frequency_penalty=0.5, logit_bias={3: 5.0})][kind]
        out.append(make_req(outputs=list(rng.integers(0, V, size=5)), seed=int(rng.integers(2**63)), **kw))
    return out


def test_same_seed_and_step_same_token_in_any_batch():
    V = 500
    rng = np.random.default_rng(2)
    flat = np.zeros(V, np.float32)  # flat logits: the token is decided by the noise alone
    for seed in [0, 7, 2**40 + 3, 2**63 - 1]:
        for step in [0, 1, 17]:
            kw = dict(seed=seed, step=step, temperature=0.8, top_p=0.95, logprobs=2)
            alone = sample(flat[None], [make_req(**kw)])[0]
            for n_before, n_after in [(0, 3), (5, 0), (2, 9), (13, 4)]:
                reqs = _others(rng, n_before, V) + [make_req(**kw)] + _others(rng, n_after, V)
                logits = rng.normal(size=(len(reqs), V)).astype(np.float32)
                logits[n_before] = flat
                row = sample(logits, reqs)[n_before]
                assert (row.token_id, row.logprob) == alone[:2]
                # Flat logits tie everywhere: which tied tokens fill the top list is unspecified.
                assert [lp for _, lp in row.top_logprobs] == [lp for _, lp in alone.top_logprobs]


def test_noise_rows_are_batch_independent_and_distinct():
    V = 257
    seeds, steps = [5, 5, 6, 5 + 2**32, 2**63 - 1], [0, 1, 0, 0, 9]
    batch = np.array(gumbel_noise(seeds, steps, V))
    for i, (s, t) in enumerate(zip(seeds, steps)):
        assert np.array_equal(np.array(gumbel_noise([s], [t], V))[0], batch[i])
    for i, j in itertools.combinations(range(len(seeds)), 2):
        assert abs(np.corrcoef(batch[i], batch[j])[0, 1]) < 0.25  # no shared or shifted stream
        assert not np.array_equal(batch[i], batch[j])
    assert np.isfinite(batch).all()


def test_different_steps_and_seeds_give_different_streams():
    V = 1000
    flat = np.zeros((300, V), np.float32)
    by_step = tokens(flat, [make_req(seed=42, step=t) for t in range(300)])
    by_seed = tokens(flat, [make_req(seed=s, step=0) for s in range(300)])
    assert len(set(by_step)) > 230 and len(set(by_seed)) > 230  # ~ 300 * (1 - e^-0.3) = 259 expected
    assert by_step != by_seed


@pytest.mark.parametrize("over", ["seeds", "steps"])
def test_frequencies_match_softmax(over):
    n, T = 4000, 0.7
    base = np.array([1.0, 0.5, 0.0, -0.5, 2.0, 0.3, -1.0, 1.2], np.float32)
    reqs = [make_req(seed=i if over == "seeds" else 99, step=0 if over == "seeds" else i, temperature=T)
            for i in range(n)]
    counts = np.bincount(tokens(np.tile(base, (n, 1)), reqs), minlength=8)
    probs = np.exp(log_softmax(base / T))
    assert chi2(counts, probs) < CHI2_001[7]
    # It can fail: the same counts do not fit the untempered distribution.
    assert chi2(counts, np.exp(log_softmax(base))) > 100


def test_top_k_frequencies_renormalised():
    n = 3000
    base = np.array([0.0, 1.0, -1.0, 0.8, 0.9, -2.0], np.float32)
    counts = np.bincount(tokens(np.tile(base, (n, 1)), [make_req(seed=i, top_k=3) for i in range(n)]),
                         minlength=6)
    assert set(np.flatnonzero(counts)) == {1, 3, 4}
    top = base[[1, 3, 4]]
    assert chi2(counts[[1, 3, 4]], np.exp(log_softmax(top))) < CHI2_001[2]


# --- filters ------------------------------------------------------------------------------------

def test_top_k_restricts_support():
    logits = np.random.default_rng(3).normal(size=(1, 50)).astype(np.float32)
    got = tokens(np.repeat(logits, 500, 0), [make_req(seed=i, top_k=5, temperature=1.5) for i in range(500)])
    assert set(got) == set(np.argsort(-logits[0])[:5])


def test_top_p_restricts_support_to_nucleus():
    probs = np.array([0.04, 0.4, 0.01, 0.3, 0.15, 0.1])
    logits = np.log(probs).astype(np.float32)[None]
    got = tokens(np.repeat(logits, 1000, 0), [make_req(seed=i, top_p=0.65) for i in range(1000)])
    assert set(got) == {1, 3}  # 0.4 < 0.65, 0.4 + 0.3 >= 0.65
    assert chi2(np.bincount(got, minlength=6)[[1, 3]], np.array([4, 3]) / 7) < 10.83  # df = 1
    got = tokens(np.repeat(logits, 1000, 0), [make_req(seed=i, top_p=0.75) for i in range(1000)])
    assert set(got) == {1, 3, 4}
    # top_p counts mass within what top_k kept, renormalised: 0.4 / 0.7 >= 0.55 keeps token 1 alone.
    got = tokens(np.repeat(logits, 300, 0), [make_req(seed=i, top_k=2, top_p=0.55) for i in range(300)])
    assert set(got) == {1}
    # ... and within what min_p kept: min_p=0.5 keeps {1, 3}, then 0.4 / 0.7 >= 0.55 again.
    got = tokens(np.repeat(logits, 300, 0), [make_req(seed=i, min_p=0.5, top_p=0.55) for i in range(300)])
    assert set(got) == {1}


def test_min_p_drops_tokens_below_fraction_of_max():
    probs = np.array([0.06, 0.5, 0.1, 0.3, 0.04])
    logits = np.log(probs).astype(np.float32)[None]
    got = tokens(np.repeat(logits, 1000, 0), [make_req(seed=i, min_p=0.15) for i in range(1000)])
    assert set(got) == {1, 2, 3}  # kept: p >= 0.075


def test_logit_bias_forces_and_bans():
    V = 40
    logits = np.random.default_rng(4).normal(size=(60, V)).astype(np.float32)
    reqs = [make_req(seed=i, temperature=1.0 + i % 3, logit_bias={7: 100.0}) for i in range(30)]
    best = int(logits[0].argmax())
    reqs += [make_req(seed=i, temperature=0.0 if i % 2 else 1.0, logit_bias={best: -100.0, V + 3: 5.0})
             for i in range(30)]
    logits[30:] = logits[0]
    got = tokens(logits, reqs)
    assert got[:30] == [7] * 30
    assert best not in got[30:]
    assert [got[i] for i in range(31, 60, 2)] == [int(np.argsort(-logits[0])[1])] * 15


# --- penalties ----------------------------------------------------------------------------------

def reference_processed(logits: np.ndarray, reqs: list[Request]) -> np.ndarray:
    """Straightforward per-row reference (vLLM v1 order: bias, repetition, frequency, presence)."""
    out = logits.astype(np.float32).copy()
    V = out.shape[1]
    for i, r in enumerate(reqs):
        p = r.sampling_params
        for t, b in p.logit_bias.items():
            if t < V:
                out[i, t] += np.float32(b)
        outputs = [t for t in r.output_token_ids if t < V]
        if p.repetition_penalty != 1.0:
            for t in set(r.prompt_token_ids) | set(outputs):
                rp = np.float32(p.repetition_penalty)
                out[i, t] = out[i, t] / rp if out[i, t] > 0 else out[i, t] * rp
        counts = np.bincount(outputs, minlength=V).astype(np.float32)
        out[i] -= np.float32(p.frequency_penalty) * counts
        out[i] -= np.float32(p.presence_penalty) * (counts > 0)
    return out


def _penalty_batch(V=30):
    rng = np.random.default_rng(5)
    kws = [dict(), dict(presence_penalty=1.5), dict(frequency_penalty=0.7),
           dict(repetition_penalty=1.8, logit_bias={2: 3.0}), dict(),
           dict(presence_penalty=-0.5, frequency_penalty=-1.0, repetition_penalty=0.6),
           dict(repetition_penalty=2.5)]
    reqs = [make_req(prompt=list(rng.integers(0, V, 6)), outputs=list(rng.integers(0, V // 3, 12)),
                     temperature=0.0, logprobs=4, **kw) for kw in kws]
    return rng.normal(size=(len(reqs), V)).astype(np.float32) * 2, reqs


def test_penalties_match_numpy_reference():
    logits, reqs = _penalty_batch()
    ref = reference_processed(logits, reqs)
    assert not np.allclose(ref, logits)
    mx_logits = mx.array(logits)
    np.testing.assert_allclose(np.array(apply_bias_and_penalties(mx_logits, reqs)), ref, rtol=1e-6, atol=1e-6)
    assert np.array_equal(np.array(mx_logits), logits)  # the input is not modified
    rows = sample(logits, reqs)
    assert [r.token_id for r in rows] == list(ref.argmax(-1))
    lsm = log_softmax(ref)
    want = lsm[np.arange(len(reqs)), ref.argmax(-1)]
    np.testing.assert_allclose([r.logprob for r in rows], want, atol=1e-5)


def test_out_of_range_ids_are_ignored():
    logits, reqs = _penalty_batch()
    reqs[1].append_output_token(10_000)  # out of vocab: ignored, no crash
    reqs[3].sampling_params.logit_bias[999] = 50.0
    got = np.array(apply_bias_and_penalties(mx.array(logits), reqs))
    np.testing.assert_allclose(got, reference_processed(logits, reqs), rtol=1e-6, atol=1e-6)


# --- logprobs -----------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [mx.float32, mx.float16, mx.bfloat16])
def test_logprobs_and_top_logprobs(dtype):
    V = 50
    logits = mx.array(np.random.default_rng(6).normal(size=(5, V)).astype(np.float32) * 2).astype(dtype)
    reqs = [make_req(seed=0, logprobs=None), make_req(seed=1, logprobs=0), make_req(seed=2, logprobs=3),
            make_req(seed=3, logprobs=5, temperature=0.0), make_req(seed=4, logprobs=1, top_k=2)]
    out = sampler(logits, reqs)
    assert out.top_token_ids.shape == (5, 5) and out.top_token_ids.dtype == mx.int32
    assert out.sampled_token_ids.dtype == mx.int32 and out.logprobs.dtype == mx.float32
    rows = to_host(out)
    lsm = log_softmax(np.array(logits.astype(mx.float32)))
    assert rows[0].logprob is None and rows[0].top_logprobs is None
    assert rows[1].top_logprobs == []
    assert rows[3].token_id == int(lsm[3].argmax())
    for i in range(1, 5):
        assert rows[i].logprob == pytest.approx(lsm[i, rows[i].token_id], abs=1e-5)
        top = rows[i].top_logprobs
        assert len(top) == reqs[i].sampling_params.logprobs
        assert [t for t, _ in top] == list(np.argsort(-lsm[i])[:len(top)])
        np.testing.assert_allclose([lp for _, lp in top], np.sort(lsm[i])[::-1][:len(top)], atol=1e-5)


def test_logprobs_absent_or_only_sampled():
    logits = mx.array(np.random.default_rng(7).normal(size=(2, 10)).astype(np.float32))
    out = sampler(logits, [make_req(), make_req(seed=1)])
    assert out.logprobs is None and out.top_token_ids is None and out.top_logprobs is None
    out = sampler(logits, [make_req(logprobs=0), make_req(seed=1)])
    assert out.logprobs is not None and out.top_token_ids is None
    assert to_host(out)[1].logprob is None
    assert to_host(sampler(mx.zeros((0, 10)), [])) == []


# --- property -----------------------------------------------------------------------------------

def allowed_set(row: np.ndarray, p: SamplingParams, tol: float = 1e-4) -> set[int]:
    """Tokens a sampled row may pick (with a little slack at the cut-offs), from the definitions."""
    probs = np.exp(log_softmax(row / p.temperature))
    ok = probs >= p.min_p * probs.max() * (1 - tol)
    order = [t for t in np.argsort(-probs, kind="stable") if ok[t]]
    if 0 < p.top_k < len(order):
        kth = probs[order[p.top_k - 1]]
        order = [t for t in order if probs[t] >= kth * (1 - tol)]
    q = probs[order] / probs[order].sum()
    ahead = np.cumsum(q) - q
    return {t for t, a in zip(order, ahead) if p.top_p >= 1.0 or a < p.top_p + tol}


row_params = st.fixed_dictionaries(dict(
    temperature=st.one_of(st.just(0.0), st.floats(0.05, 3.0)),
    top_k=st.integers(0, 45), top_p=st.one_of(st.just(1.0), st.floats(0.01, 1.0)),
    min_p=st.one_of(st.just(0.0), st.floats(0.0, 1.0)), seed=st.integers(0, 2**63 - 1),
    step=st.integers(0, 5), logprobs=st.one_of(st.none(), st.integers(0, 5))))


@settings(max_examples=150, deadline=None)
@given(st.lists(row_params, min_size=1, max_size=6), st.integers(2, 40), st.integers(0, 2**32 - 1),
       st.floats(0.1, 8.0))
def test_property_sampled_token_in_allowed_set(rows, V, data_seed, scale):
    logits = (np.random.default_rng(data_seed).normal(size=(len(rows), V)) * scale).astype(np.float32)
    reqs = [make_req(**kw) for kw in rows]
    got = tokens(logits, reqs)
    for i, (tok, r) in enumerate(zip(got, reqs)):
        p = r.sampling_params
        if p.greedy:
            assert tok == int(logits[i].argmax())
        else:
            assert tok in allowed_set(logits[i], p)
        assert tokens(logits[i:i + 1], [make_req(**rows[i])]) == [tok]  # same token alone


# --- guided decoding: the grammar's bitmask (pagedmlx/structured_outputs) ----------------------------

def _words(allowed: list[set[int]], vocab: int) -> np.ndarray:
    """Bitmask rows in llguidance's layout: bit t % 32 of int32 word t // 32."""
    words = np.zeros((len(allowed), (vocab + 31) // 32), dtype=np.uint32)
    for i, ids in enumerate(allowed):
        for t in ids:
            words[i, t // 32] |= np.uint32(1 << (t % 32))
    return words.view(np.int32)


@pytest.mark.parametrize("rows", [[1, 3], [0, 1, 2, 3]])
def test_grammar_bitmask_masks_only_its_rows(rows):
    """Guided rows keep exactly their allowed tokens (bit 31 included: a negative int32 word), the
    others are untouched; ids past the mask's words (a model's padded rows) are disallowed."""
    from pagedmlx.sample.sampler import apply_grammar_bitmask

    rng = np.random.default_rng(3)
    vocab, V = 70, 100  # the tokenizer's 70 ids in 3 words; the model has 100 rows
    logits = rng.normal(size=(4, V)).astype(np.float32)
    allowed = [set(rng.choice(vocab, size=5, replace=False).tolist()) | {31, 63} for _ in rows]
    out = np.array(apply_grammar_bitmask(mx.array(logits), np.array(rows, np.int32), _words(allowed, vocab)))
    for r in range(4):
        if r not in rows:
            assert (out[r] == logits[r]).all()
            continue
        ids = allowed[rows.index(r)]
        keep = np.array([t in ids for t in range(V)])
        assert (out[r][keep] == logits[r][keep]).all() and np.isneginf(out[r][~keep]).all()


def test_sampler_takes_only_allowed_tokens_and_logprobs_renormalise():
    """Greedy and sampled guided rows take an allowed token whatever the logits say; logprobs are
    over the allowed tokens (vLLM masks before its logprobs), an unguided row's are unchanged."""
    from pagedmlx.structured_outputs.manager import GrammarBitmask

    rng = np.random.default_rng(4)
    V = 64
    logits = (rng.normal(size=(3, V)) * 3).astype(np.float32)
    allowed = [{5, 40}, {7, 8, 9}]
    for temp in (0.0, 1.0):
        reqs = [make_req(temperature=temp, seed=i, logprobs=3) for i in range(3)]
        got = sampler(mx.array(logits), reqs, GrammarBitmask(np.array([0, 2], np.int32), _words(allowed, V)))
        out = to_host(got)
        assert out[0].token_id in allowed[0] and out[2].token_id in allowed[1]
        for row, ids in ((0, allowed[0]), (2, allowed[1])):
            lp = log_softmax(logits[row][sorted(ids)])
            want = dict(zip(sorted(ids), lp))
            assert out[row].logprob == pytest.approx(want[out[row].token_id], abs=1e-5)
            finite = {t: v for t, v in out[row].top_logprobs if np.isfinite(v)}
            assert set(finite) == ids and all(v == pytest.approx(want[t], abs=1e-5) for t, v in finite.items())
        full = log_softmax(logits[1])
        assert out[1].logprob == pytest.approx(full[out[1].token_id], abs=1e-5)
