"""Study: how many primitives a batch-1 decode step hands MLX, ours against mlx-lm's, by kind. On MLX's CUDA
backend each primitive that launches a kernel costs the host ~8-10 us to dispatch (run 51: study_lora_ops.py
--compile, 'empty' and 'mask'), about the device time of a decode step's whole kernel at batch 1, so at
batch 1 a step's launches, not its weight bytes, can bound it.

For --preset (random weights) it builds one request's decode step both ways and counts the primitives of
each graph (mx.export_to_dot), split into views (no kernel: reshapes, slices, broadcasts, transposes...)
and the rest (kernels, copies):
  mlx-lm      the model's call on mlx-lm's own KV cache, then the argmax (generate_step's step, greedy)
  pagedmlx    the engine's decode step as dispatched (compiled where the device writes pages in place),
              the forward and the sampler

Run 51 (H200, Llama-8B, bf16): mlx-lm 548 ops that launch, pagedmlx 521 (docs/benchmarks.md, runs 50-52).

  python scripts/bench/study_step_ops.py --preset llama-8b --dtype bfloat16     # H200
  python scripts/bench/study_step_ops.py                                        # CPU: fast ops decompose
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.presets import PRESETS, random_model  # noqa: E402

VIEWS = {"Reshape", "Squeeze", "ExpandDims", "Broadcast", "Transpose", "Slice", "Flatten", "Unflatten",
         "AsStrided", "StopGradient", "Depends", "Split"}


def primitives(*arrays: mx.array) -> collections.Counter:
    fd, path = tempfile.mkstemp(suffix=".dot")
    os.close(fd)
    try:
        mx.export_to_dot(path, *arrays)
        return collections.Counter(re.findall(r'\[label ="([^"]+)", shape=rectangle', Path(path).read_text()))
    finally:
        os.unlink(path)


def mlx_lm_step(model) -> collections.Counter:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, 17))]), cache=cache))
    return primitives(mx.argmax(model(mx.array([[17]]), cache=cache)[:, -1], axis=-1))


def engine_step(model, steps: int, merge=None) -> collections.Counter:
    """The graph of the `steps`-th decode step of one request."""
    import pagedmlx.core.engine_core as engine_core
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine import LLMEngine
    from pagedmlx.sampling_params import SamplingParams

    engine = LLMEngine(model, None, EngineConfig(block_size=16, num_blocks=64, max_num_seqs=4, max_model_len=512,
                                                 merge_projections=merge))
    # Where pages are written in place the runner dispatches the forward itself (mx.async_eval) before the
    # engine dispatches the sampler: count each graph handed to MLX, and run it to the end (so that the next
    # count stops at its outputs), then file them under the step that _dispatch closes.
    graphs, current = [], collections.Counter()
    dispatch, async_eval = engine_core.EngineCore._dispatch, mx.async_eval

    def counting_eval(*arrays):
        current.update(primitives(*arrays))
        mx.eval(*arrays)

    def counting_dispatch(step):
        dispatch(step)
        graphs.append(collections.Counter(current))
        current.clear()

    engine_core.EngineCore._dispatch = staticmethod(counting_dispatch)
    mx.async_eval = counting_eval
    try:
        engine.add_request("r", list(range(1, 17)), SamplingParams(max_tokens=steps + 1, temperature=0.0))
        while engine.has_unfinished_requests():
            engine.step()
    finally:
        engine_core.EngineCore._dispatch = staticmethod(dispatch)
        mx.async_eval = async_eval
    compiled = engine.runner.compiled_decode
    print(f"pagedmlx: {len(graphs)} steps dispatched; compiled decode traces: "
          f"{len(compiled.fns) if compiled is not None else 'off'}")
    return graphs[-1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--steps", type=int, default=8, help="decode steps before the one counted (traces warm)")
    ap.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.merge_projections for pagedmlx (default: on GPU backends)")
    args = ap.parse_args()
    dtype = getattr(mx, args.dtype)
    model = random_model(args.preset, dtype)
    layers = len(model.layers)
    counts = {"mlx-lm": mlx_lm_step(model), "pagedmlx": engine_step(model, args.steps, args.merge_projections)}
    print(f"one decode step at batch 1, random '{args.preset}' ({args.dtype}, {layers} layers) on {mx.default_device()}")
    print(f"{'':>9} | {'primitives':>10} | {'views':>6} | {'others':>6} | {'others a layer':>14}")
    for name, c in counts.items():
        views = sum(n for k, n in c.items() if k in VIEWS)
        total = sum(c.values())
        print(f"{name:>9} | {total:>10} | {views:>6} | {total - views:>6} | {(total - views) / layers:>14.1f}")
    kinds = sorted(set().union(*counts.values()) - VIEWS, key=lambda k: -max(c[k] for c in counts.values()))
    print("\nnon-view primitives by kind (mlx-lm, pagedmlx):")
    for k in kinds:
        print(f"  {k[:70]:<70} {counts['mlx-lm'][k]:>5} {counts['pagedmlx'][k]:>5}")
    print("\nviews by kind (mlx-lm, pagedmlx):")
    for k in sorted(VIEWS & set().union(*counts.values()), key=lambda k: -max(c[k] for c in counts.values())):
        print(f"  {k:<70} {counts['mlx-lm'][k]:>5} {counts['pagedmlx'][k]:>5}")


if __name__ == "__main__":
    main()
