"""Load-time check that a model gives on pages the logits it gives with mlx-lm's own KVCache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import mlx.core as mx
import numpy as np

from pagedmlx.request import Request
from pagedmlx.runner.attention import KVPool
from pagedmlx.sampling_params import SamplingParams
from pagedmlx.scheduler_output import build_scheduler_output

if TYPE_CHECKING:
    from pagedmlx.runner.model import ModelRunner

# float32: 5e-3, not less: on tensor-core GPUs MLX multiplies float32 in TF32 by default
# (MLX_ENABLE_TF32), and the paged and mlx-lm passes round differently (1.06e-3 seen on an H200).
# A wrong page or position shows up as an O(1) difference.
_TOLERANCE = {mx.float32: 5e-3, mx.float16: 3e-2, mx.bfloat16: 6e-2}


def check_paged_forward(runner: "ModelRunner") -> Optional[str]:
    """Two steps on a scratch pool: a chunked prefill continued over its cached prefix, next to a
    fresh one-token prompt and a decode. Returns None if every logit row matches mlx-lm within the
    dtype's tolerance (relative to the logits' scale), else a description of the mismatch."""
    from mlx_lm.models.cache import make_prompt_cache

    bs = runner.block_size
    prompts = {"a": [1, 2, 3, 4, 5, 6, 7], "b": [5], "c": [3, 1, 4]}
    reqs = {k: Request(k, p, SamplingParams(max_tokens=1)) for k, p in prompts.items()}
    block_ids, next_block = {}, 0
    for k, p in prompts.items():
        n = -(-len(p) // bs)
        block_ids[k] = list(range(next_block, next_block + n))
        next_block += n
    saved_pool = getattr(runner, "kv_pool", None)
    runner.kv_pool = KVPool(next_block, bs, runner.layer_specs)
    try:
        got = {k: [] for k in prompts}
        for step in ([("a", 4), ("c", 2)], [("a", 3), ("b", 1), ("c", 1)]):
            sched = [(reqs[k], n) for k, n in step]
            so = build_scheduler_output(sched, block_ids, bs, [], set())
            so.logits_indices = np.arange(so.total_num_scheduled_tokens, dtype=np.int32)
            logits = runner.forward(so).astype(mx.float32)
            for i, rid in enumerate(so.req_ids):
                start = so.query_start_loc[i]
                got[rid].append(logits[start:start + so.num_scheduled_tokens[i]])
                reqs[rid].num_computed_tokens += so.num_scheduled_tokens[i]
    finally:
        runner.kv_pool = saved_pool
    for k, p in prompts.items():
        want = runner.model(mx.array([p]), cache=make_prompt_cache(runner.model))[0].astype(mx.float32)
        have = mx.concatenate(got[k], axis=0)
        scale = mx.abs(want).max().item() or 1.0
        err = mx.abs(have - want).max().item() / scale
        tol = _TOLERANCE.get(runner.layer_specs[0][3], 6e-2)
        if not err <= tol:
            return f"prompt {k!r}: max relative logit difference {err:.2e} > {tol:.0e}"
    return None
