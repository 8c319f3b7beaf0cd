"""Load-time check that a model gives on pages the logits it gives with mlx-lm's own caches: the
whole paged forward (plan, pages, windows, state slots, and the kernels the runner's KernelPlan
runs), against mlx-lm. The runner calls it (model.py); it reads the runner through CheckedRunner,
never by importing model.py, so that the two modules are no import circle."""

from __future__ import annotations

import functools
import logging
from typing import Callable, Optional, Protocol

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from pagedmlx import envs
from pagedmlx.core.kv.manager import KVCacheManager
from pagedmlx.layers.quantized_linear import flat_rows
from pagedmlx.core.kv.spec import KVCacheConfig, KVCacheGroupSpec, MambaSpec, cdiv
from pagedmlx.request import Request
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.runner.attention import KVPool
from pagedmlx.runner.routing import RoutingMatch, routing_match
from pagedmlx.runner.state import StatePool
from pagedmlx.core.sched.output import SchedulerOutput, build_scheduler_output

logger = logging.getLogger("pagedmlx")
# float32: 5e-3, not less: on tensor-core GPUs MLX multiplies float32 in TF32 by default
# (MLX_ENABLE_TF32), and the paged and mlx-lm passes round differently (1.06e-3 seen on an H200).
# A wrong page, position or window shows up as an O(1) difference.
LOGIT_TOLERANCE = {mx.float32: 5e-3, mx.float16: 3e-2, mx.bfloat16: 6e-2}  # relative to the logits' scale


def _schedule(block_size: int, window: int, vocab: int) -> tuple[dict[str, list[int]], list[list[tuple[str, int]]]]:
    """Prompts and steps: "a" longer than the largest window plus two blocks, in three chunks (the
    first ends inside the window, the last starts a window past it, so pages behind the window are
    freed and never read again); "c" short, then decoded; "b" a 1-token prompt, then decoded."""
    span = max(window, 2 * block_size)
    first = max(2, window // 2 + 1)
    length = span + 2 * block_size + 3
    rng = np.random.default_rng(0)
    a = rng.integers(1, vocab, length).tolist()
    second = min(length - 1, first + span)
    steps = [[("a", first), ("c", 3)], [("a", second - first), ("b", 1), ("c", 1)],
             [("a", length - second), ("c", 1), ("b", 1)]]
    return {"a": a, "b": [5, 2, 7], "c": [3, 1, 4, 1, 5]}, steps


class CheckedRunner(Protocol):
    """What the check uses of a ModelRunner: its model and layout, scratch pools in the runner's
    layout, and a forward that takes them."""

    model: nn.Module
    block_size: int
    windows: list[Optional[int]]
    vocab_size: int
    kv_cache_config: KVCacheConfig

    def make_pool(self, kv_cache_config: KVCacheConfig, quantized: bool = True) -> KVPool: ...

    def make_state_pool(self, kv_cache_config: KVCacheConfig) -> Optional[StatePool]: ...

    def forward(self, so: SchedulerOutput, prev_sampled: Optional[mx.array] = None, kv_pool: Optional[KVPool] = None,
                state_pool: Optional[StatePool] = None) -> mx.array: ...


def check_paged_forward(runner: CheckedRunner, errors: Optional[dict[str, float]] = None) -> Optional[str]:
    """A busy schedule on a scratch pool: chunked prefill across a window, a 1-token prompt and
    decodes. The scratch pages are in the model's dtype whatever kv_cache_dtype (quantized pages
    differ from mlx-lm's own cache by design; tests/test_kv_quant.py checks them). Returns None if
    every compared logit row matches mlx-lm within the dtype's tolerance (relative to the logits'
    scale), else a description of the mismatch. `errors`, if given, receives each prompt's largest
    relative difference (scripts/gpu/check_families.py prints them)."""
    bs = runner.block_size
    window = max((w for w in runner.windows if w), default=0)
    tokens, steps = _schedule(bs, window, runner.vocab_size)
    fed = {"a": len(tokens["a"]), "b": 1, "c": 3}  # prompt lengths; the rest is fed one per decode
    reqs = {k: Request(k, t[:fed[k]], SamplingParams(max_tokens=8)) for k, t in tokens.items()}
    num_blocks = sum(cdiv(len(t), bs) for t in tokens.values()) + 2
    config = KVCacheConfig(bs, [KVCacheGroupSpec(MambaSpec() if g.is_state else g.kv_cache_spec, num_blocks + 1,
                                                 g.layer_ids) for g in runner.kv_cache_config.kv_cache_groups])
    manager, pool = KVCacheManager(config, enable_caching=False), runner.make_pool(config, quantized=False)
    state_pool = runner.make_state_pool(config)
    got: dict[str, dict[int, mx.array]] = {k: {} for k in tokens}
    with routing_match() as routes:
        return _run(runner, tokens, steps, reqs, manager, pool, state_pool, got, routes, errors)


def _run(runner: CheckedRunner, tokens: dict[str, list[int]], steps: list[list[tuple[str, int]]],
         reqs: dict[str, Request], manager: KVCacheManager, pool: KVPool, state_pool: Optional[StatePool],
         got: dict[str, dict[int, mx.array]], routes: RoutingMatch,
         errors: Optional[dict[str, float]]) -> Optional[str]:
    """check_paged_forward's steps and comparisons, with the paged forward's expert routing recorded in `routes`
    and replayed into mlx-lm's (runner/routing.py)."""
    bs, dtype = runner.block_size, None
    for step in steps:
        for rid, n in step:
            req = reqs[rid]
            while req.num_computed_tokens + n > req.num_tokens:  # a decode: feed the next fixed token
                req.append_output_token(tokens[rid][req.num_tokens])
            if manager.allocate_slots(req, n) is None:
                return "the scratch pool was too small (a bug in the check)"
        so = build_scheduler_output([(reqs[r], n) for r, n in step], manager.get_block_ids, bs, [], set(),
                                    manager.get_state_slots if state_pool is not None else None)
        rows = _compared_rows(so)
        so.logits_indices = np.asarray(sorted(rows), np.int32)
        with routes.record(_row_tokens(so)):
            logits = runner.forward(so, kv_pool=pool, state_pool=state_pool)
        dtype, logits = logits.dtype, logits.astype(mx.float32)
        for j, row in enumerate(so.logits_indices.tolist()):
            rid, pos = rows[row]
            got[rid][pos] = logits[j]
        for rid, n in step:
            reqs[rid].num_computed_tokens += n
    tol = LOGIT_TOLERANCE.get(dtype, 6e-2)
    for rid, t in tokens.items():
        chunks = [n for s in steps for r, n in s if r == rid]
        routes.reset()
        want = _mlx_lm_logits(runner.model, t, sorted(got[rid]), chunks, routes.follow, rid)
        err, pos = _max_error(got[rid], want)
        if errors is not None:
            errors[rid] = err
        drift, gap = routes.drift.ratio, routes.worst.ratio
        if err <= tol and drift <= tol and gap <= 2 * tol and not envs.PAGEDMLX_CHECK_REPORT:
            continue
        noise = _self_noise(runner.model, t, sorted(got[rid]), chunks, steps, routes, rid, want)
        route_bound = max(tol, 4 * routes.noise.ratio)
        if envs.PAGEDMLX_CHECK_REPORT:
            logger.warning("check, prompt %r (%s): logits %.2e from mlx-lm's (mlx-lm against itself %.2e); router "
                           "values %.2e (itself %.2e); %d choices forced, %.2e apart; bound %.0e", rid, dtype, err,
                           noise, drift, routes.noise.ratio, routes.forced, gap, tol)
        if not gap <= 2 * route_bound:  # NaN included; each side's values may stray by route_bound
            where = routes.worst.where
            return (f"prompt {rid!r} position {where[1]}: the paged forward routes to other experts than mlx-lm "
                    f"where they are no near tie (router values {gap:.2e} of their scale apart > {2 * route_bound:.1e};"
                    f" mlx-lm's own router values move {routes.noise.ratio:.2e} with rounding)")
        if not drift <= route_bound:
            where = routes.drift.where
            return (f"prompt {rid!r} position {where[1]}: the paged forward's router values differ from mlx-lm's by "
                    f"{drift:.2e} of their scale > {route_bound:.1e} (mlx-lm against itself: "
                    f"{routes.noise.ratio:.2e})")
        if not err <= max(tol, 4 * noise):
            return (f"prompt {rid!r} position {pos}: max relative logit difference {err:.2e} > {tol:.0e} "
                    f"(mlx-lm against itself: {noise:.2e})")
    return None


def _self_noise(model, tokens: list[int], positions: list[int], chunks: list[int], steps: list[list[tuple[str, int]]],
                routes: RoutingMatch, rid: str, want: dict[int, mx.array]) -> float:
    """mlx-lm against itself, the same experts taken (its router values' distance in `routes.noise`): in one chunk
    instead of these; and as a batch of copies with at least as many rows as the busiest paged step, its quantized
    products over all rows at once as on pages (layers/quantized_linear.py), so that they run MLX's kernels a product
    of that many rows runs (a backend picks them by row count, and one row's kernel and a tiled one round
    differently); never pagedmlx's own kernels, which the check judges. The largest relative logit difference: how
    far this model moves with that alone in this dtype."""
    follow = functools.partial(routes.follow, noise=True)
    noise, _ = _max_error(_mlx_lm_logits(model, tokens, positions, [sum(chunks)], follow, rid), want)
    copies = cdiv(max(sum(n for _, n in s) for s in steps), len(tokens))
    try:
        with flat_rows(kernels=False):  # MLX's products: a wrong kernel of ours must not widen its own bound
            again = _mlx_lm_logits(model, tokens, positions, [sum(chunks)], follow, rid, copies)
    except Exception:  # noqa: BLE001 - a model mlx-lm runs one sequence at a time: the first measure alone
        return noise
    return max(noise, _max_error(again, want)[0])


def _max_error(got: dict[int, mx.array], want: dict[int, mx.array]) -> tuple[float, int]:
    """The largest difference of a row, relative to the reference row's largest logit, and where."""
    worst = (0.0, -1)
    for pos, row in got.items():
        scale = mx.abs(want[pos]).max().item() or 1.0
        worst = max(worst, (mx.abs(row - want[pos]).max().item() / scale, pos))
    return worst


def _row_tokens(so) -> list[tuple[str, int]]:
    """(request, position) of each of the step's rows."""
    out = []
    for i, rid in enumerate(so.req_ids):
        start, end = int(so.query_start_loc[i]), int(so.query_start_loc[i + 1])
        out += [(rid, int(so.seq_lens[i]) - (end - start) + r) for r in range(end - start)]
    return out


def _compared_rows(so) -> dict[int, tuple[str, int]]:
    """Row -> (request, position): each scheduled chunk's first and last two rows."""
    rows = {}
    for i, rid in enumerate(so.req_ids):
        start, end = int(so.query_start_loc[i]), int(so.query_start_loc[i + 1])
        first_pos = int(so.seq_lens[i]) - (end - start)
        for r in {start, max(start, end - 2), end - 1}:
            rows[r] = (rid, first_pos + r - start)
    return rows


def _mlx_lm_logits(model, tokens: list[int], positions: list[int], chunks: list[int], follow: Callable,
                   rid: str, copies: int = 1) -> dict[int, mx.array]:
    """mlx-lm's own logits at `positions`, running `tokens` through its caches in the same chunks (as a batch of
    `copies` equal sequences), each chunk inside `follow(rows)` (RoutingMatch.follow: request `rid`'s routing on
    pages)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache, out, start = make_prompt_cache(model), {}, 0
    for n in chunks:
        with follow([(rid, p) for _ in range(copies) for p in range(start, start + n)]):
            logits = model(mx.array([tokens[start:start + n]] * copies), cache=cache)[0].astype(mx.float32)
        for pos in positions:
            if start <= pos < start + n:
                out[pos] = logits[pos - start]
        mx.eval(list(out.values()))
        start += n
    return out


def relative_error(got: mx.array, want: mx.array) -> float:
    """max |got - want| over the largest finite |want|: one host sync. Equal entries count 0, infinities
    included (a vocabulary masked with -inf on both sides); NaN where either holds one."""
    got, want = got.astype(mx.float32), want.astype(mx.float32)
    diff = mx.where(got == want, 0.0, mx.abs(got - want))
    scale = mx.where(mx.isinf(want), 0.0, mx.abs(want)).max()
    return (diff.max() / mx.maximum(scale, 1e-30)).item()
