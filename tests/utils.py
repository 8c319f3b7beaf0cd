"""Test helpers (vLLM keeps its in tests/.../utils.py): random-weight models, mlx-lm's reference
generation, running an engine to completion, leak checks, waiting for a server."""

from __future__ import annotations

import functools
import random
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import httpx
import mlx.core as mx
import pytest
import numpy as np

from pagedmlx.loaders.random_model import RANDOM_ARCHS, random_model, tiny_tokenizer

# The tests' names for the package's random-weight architectures (pagedmlx/loaders/random_model.py).
_TEST_ARCHS = {"llama": "llama-tiny", "llama_tied": "llama-tiny-tied", "qwen3": "qwen3-tiny"}
ARCHS = {name: RANDOM_ARCHS[arch] for name, arch in _TEST_ARCHS.items()}

make_tokenizer = tiny_tokenizer  # a tiny real HF tokenizer padded to vocab_size (cached)


@functools.lru_cache(maxsize=None)
def make_model(arch: str, seed: int = 0):
    return random_model(_TEST_ARCHS.get(arch, arch), seed)


# Greedy tokens are compared exactly, except at rounding's near ties. A float32 product can change in its last bits
# with its batch: OpenBLAS picks its GEMM kernel and blocking by shape (on AMD EPYC its Zen kernels give a row other
# bits at another row count), so a busy engine's logits can differ from the same prompt's alone by ~1e-5. Where the
# reference's best two logits lie closer than ROUNDING_GAP, either token is right.
ROUNDING_GAP = 1e-3
# Logprobs of one prompt in two rows of a batch: ~1e-6 apart where rows round apart.
LOGPROB_ROUNDING = 1e-5
# Quantized pages turn such a last bit into a whole quantization step where a key or value sits on a rounding
# boundary: logits then move by up to ~3e-2 (int8 pages under OpenBLAS's Zen kernels).
QUANTIZED_GAP = 0.1


@dataclass
class Greedy:
    """A reference's greedy tokens, each step's runner-up and the chosen token's lead over it (in logits)."""

    tokens: list[int] = field(default_factory=list)
    runner_up: list[int] = field(default_factory=list)
    lead: list[float] = field(default_factory=list)

    def add(self, token: int, logprobs: mx.array) -> None:
        """Record a step from its vocabulary's logprobs."""
        lp = np.array(logprobs.astype(mx.float32), dtype=np.float64)
        best, lp[token] = lp[token], -np.inf
        self.tokens.append(token)
        self.runner_up.append(int(lp.argmax()))
        self.lead.append(float(best - lp.max()))


Reference = Callable[[list[int], int], Greedy]  # (prompt, max_tokens) -> the prompt's greedy continuation


def mlx_lm_greedy(model, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = (),
                  make_cache: Optional[Callable[[], list]] = None) -> Greedy:
    """mlx-lm's own generation for one prompt alone: the reference every engine output must equal. Stops after a
    token in stop_ids (included), as the engine does at EOS; make_cache gives its prompt cache (default: mlx-lm's)."""
    from mlx_lm.generate import generate_step

    out = Greedy()
    cache = make_cache() if make_cache else None
    steps = generate_step(mx.array(prompt), model, max_tokens=max_tokens, prompt_cache=cache)
    for (tok, logprobs), _ in zip(steps, range(max_tokens)):
        out.add(int(tok), logprobs)
        if out.tokens[-1] in stop_ids:
            break
    return out


def solo_greedy(model, prompt: list[int], max_tokens: int, stop_ids: tuple[int, ...] = ()) -> list[int]:
    """mlx-lm's greedy tokens for one prompt alone (mlx_lm_greedy)."""
    return mlx_lm_greedy(model, prompt, max_tokens, stop_ids).tokens


def engine_greedy(engine, params) -> Reference:
    """A reference that runs each prompt alone on `engine` (idle) with greedy `params`, logprobs on."""
    def run(prompt: list[int], max_tokens: int) -> Greedy:
        engine.add_request("reference", prompt, replace(params, max_tokens=max_tokens, logprobs=2))
        out = run_to_completion(engine)["reference"]
        return Greedy(list(out.token_ids), [lp.top[1][0] for lp in out.logprobs],
                      [lp.top[0][1] - lp.top[1][1] for lp in out.logprobs])
    return run


def greedy_mismatch(got: list[int], prompt: list[int], max_tokens: int, reference: Reference,
                    gap: float = ROUNDING_GAP) -> Optional[str]:
    """None where `got` is the reference's greedy continuation of `prompt`, else why not. Where `got` takes the
    reference's runner-up at a step that led it by at most `gap` (rounding may pick either there), the reference
    goes on from `got`'s token, and so does the comparison: a fault after a near tie still fails."""
    start = 0
    while True:
        want = reference(prompt + got[:start], max_tokens - start) if start < max_tokens else Greedy()
        rest = got[start:]
        n = next((i for i, (a, b) in enumerate(zip(rest, want.tokens)) if a != b), None)
        if n is None:
            return None if rest == want.tokens else f"{got} against {got[:start] + want.tokens}"
        if rest[n] != want.runner_up[n] or want.lead[n] > gap:
            return (f"token {start + n} is {rest[n]}, the reference's {want.tokens[n]} "
                    f"({want.lead[n]:.2g} ahead of {want.runner_up[n]}): {got}")
        start += n + 1


def assert_greedy(got: list[int], prompt: list[int], max_tokens: int, reference: Reference, what: object = "",
                  gap: float = ROUNDING_GAP) -> None:
    """`got` is the reference's greedy continuation of `prompt`, up to rounding's near ties (greedy_mismatch)."""
    why = greedy_mismatch(got, prompt, max_tokens, reference, gap)
    assert why is None, f"{what}: {why}"


def solo_mismatch(got: list[int], model, prompt: list[int], max_tokens: int,
                  stop_ids: tuple[int, ...] = ()) -> Optional[str]:
    """greedy_mismatch against mlx-lm's greedy output for `prompt` alone."""
    return greedy_mismatch(got, prompt, max_tokens, functools.partial(mlx_lm_greedy, model, stop_ids=stop_ids))


def assert_solo_greedy(got: list[int], model, prompt: list[int], max_tokens: int, what: object = "",
                       stop_ids: tuple[int, ...] = ()) -> None:
    """`got` is mlx-lm's greedy output for `prompt` alone, up to rounding's near ties (greedy_mismatch)."""
    why = solo_mismatch(got, model, prompt, max_tokens, stop_ids)
    assert why is None, f"{what}: {why}"


def run_to_completion(engine) -> dict:
    """Step until every request finished; the final output of each, by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def make_prompts(n: int, vocab: int, seed: int) -> list[list[int]]:
    """Random lengths 1..300; a third extend one of three long shared prefixes."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(vocab) for _ in range(rng.randint(40, 120))] for _ in range(3)]
    prompts = []
    for i in range(n):
        if i % 3 == 0:
            base = rng.choice(prefixes)
            prompts.append(base + [rng.randrange(vocab) for _ in range(rng.randint(0, 60))])
        else:
            prompts.append([rng.randrange(vocab) for _ in range(rng.randint(1, 300))])
    return prompts


def shared_prefix_prompts(n: int, seed: int, max_len: int = 60) -> list[list[int]]:
    """Lengths 1..max_len; a third extend a shared 30-token prefix; two are 1-token prompts."""
    rng = random.Random(seed)
    shared = [rng.randrange(1, 500) for _ in range(30)]
    out = [[rng.randrange(1, 500)], [7]]
    for i in range(n - 2):
        if i % 3 == 0:
            out.append(shared + [rng.randrange(1, 500) for _ in range(rng.randint(0, 30))])
        else:
            out.append([rng.randrange(1, 500) for _ in range(rng.randint(2, max_len))])
    return out


def run_staggered(engine, prompts, params, seed: int) -> dict[str, list[int]]:
    """Add requests a few at a time between steps; collect each one's final tokens."""
    rng = random.Random(seed)
    pending = list(enumerate(prompts))
    done: dict[str, list[int]] = {}
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randint(0, 4)):
            if pending:
                i, p = pending.pop(0)
                engine.add_request(str(i), p, params)
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
    return done


def assert_no_leaks(engine) -> None:
    """Every page of every KV cache group is free and no request holds any; no request holds a state
    slot or a checkpoint (checkpoints stay cached in the free queue)."""
    manager = engine.kv_cache_manager
    for pool in manager.block_pools:
        assert all(b.ref_cnt == 0 for b in pool.blocks), [b for b in pool.blocks if b.ref_cnt]
        assert pool.get_num_free_blocks() == pool.num_blocks
    assert not manager.req_to_blocks
    state = manager.state_manager
    if state is not None:
        assert not state.req_to_blocks and not state.step_blocks and not state.saved


def assert_samples_equal_alone(make_engine: Callable, prompts: list[list[int]], params) -> None:
    """n > 1 seeded samples from a busy engine equal the same samples run alone, in an engine of their
    own; the busy engine leaks nothing."""
    from pagedmlx.llm import LLM

    busy = make_engine()
    outs = LLM.from_engine(busy).generate(prompts, params)
    for p, out in zip(prompts, outs):
        alone = LLM.from_engine(make_engine()).generate([p], params)[0]
        assert [c.token_ids for c in out.outputs] == [c.token_ids for c in alone.outputs]
    assert_no_leaks(busy)


# Chi-square critical values at p = 1e-4 by degrees of freedom: a correct sampler fails such a test once
# in 10,000 runs.
CHI2_P1E4 = {1: 15.14, 2: 18.42, 3: 21.11, 4: 23.51, 5: 25.74, 6: 27.86, 7: 29.88, 8: 31.83, 9: 33.72, 10: 35.56}


def chi_square(observed, expected) -> float:
    """Pearson's statistic of observed counts against expected counts (same total)."""
    observed, expected = np.asarray(observed, float), np.asarray(expected, float)
    return float(((observed - expected) ** 2 / expected).sum())


def wait_healthy(url: str, alive: Callable[[], bool] = lambda: True, timeout: float = 60.0,
                 why: Optional[Callable[[], str]] = None) -> None:
    """Poll url/health until it answers 200; fail if `alive()` turns false or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        assert alive() and time.monotonic() < deadline, why() if why else "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            time.sleep(0.1)


def fast_first(n: int, values: list, unpack: bool = True) -> list:
    """Parametrize values of which the first n run in `make test` (what CI runs); the rest are marked slow and
    run in `make test-all`. unpack: each value is a tuple of several parameters."""
    slow = pytest.mark.slow
    return [v if i < n else pytest.param(*(v if unpack else (v,)), marks=slow) for i, v in enumerate(values)]


def emulated_busy_engine(model):
    """An engine whose steps mix decodes of up to 8 requests with 16-token chunks of prompts, not compiled (the kernel
    emulator evaluates: no traces), for the emulated kernels' busy == solo tests."""
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine

    return LLMEngine(model, None, EngineConfig(block_size=4, num_blocks=256, max_num_batched_tokens=48,
                                               long_prefill_token_threshold=16, max_num_seqs=8, compile_decode=False))


def float32_quantized_matmul(real=mx.quantized_matmul):
    """MLX's quantized product as a GPU computes it: the weights dequantized once into x's dtype, float32 sums
    (MLX's CPU product sums bfloat16 inputs less exactly: 1% of the largest output at K = 128)."""
    def product(x, w, scales, biases=None, transpose=True, group_size=64, bits=4, **kw):
        if x.dtype == mx.float32:
            return real(x, w, scales, biases, transpose=transpose, group_size=group_size, bits=bits, **kw)
        weights = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                                bits=bits).astype(x.dtype).astype(mx.float32)
        return (x.astype(mx.float32) @ (weights.T if transpose else weights)).astype(x.dtype)
    return product


def float32_gather_qmm(real=mx.gather_qmm):
    """MLX's gather_qmm as a GPU computes it: the experts' weights dequantized once into x's dtype, float32 sums (MLX's
    CPU product sums bfloat16 inputs less exactly)."""
    def product(x, w, scales, biases=None, lhs_indices=None, rhs_indices=None, transpose=True, group_size=64, bits=4,
                mode="affine", sorted_indices=False, **kw):
        if x.dtype == mx.float32 or mode != "affine" or lhs_indices is not None:
            return real(x, w, scales, biases, lhs_indices=lhs_indices, rhs_indices=rhs_indices, transpose=transpose,
                        group_size=group_size, bits=bits, mode=mode, sorted_indices=sorted_indices, **kw)
        dense = mx.dequantize(w, scales.astype(mx.float32), biases.astype(mx.float32), group_size=group_size,
                              bits=bits).astype(x.dtype).astype(mx.float32)[rhs_indices]
        out = x.astype(mx.float32) @ (mx.swapaxes(dense, -1, -2) if transpose else dense)
        return out.astype(x.dtype)
    return product
