"""Which kernel makes a model's paged forward disagree with mlx-lm, per family (GPU machine).

For each model: the load-time check (runner/selfcheck.py) with the kernel plan the selector picks, and
again with one kernel at a time (decode, page write, prefill) and with none, each with its largest logit
difference, so that the table names the kernel at fault or shows that the portable path is as far off
(dtype noise, not a bug). A split head the portable path refutes is dropped first, as the runner does.

  python3 scripts/gpu/check_families.py                      # every test family, float32 and bfloat16
  python3 scripts/gpu/check_families.py --presets gemma4-e2b-16l gemma3-27b-16l --dtypes bfloat16
  PAGEDMLX_CHECK_REPORT=1 python3 scripts/gpu/check_families.py --families --presets qwen3.6-35b-a3b-16l-4bit \
      --dtypes bfloat16    # a quantization suffix; each prompt's logit and router-value differences logged
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.presets import random_model as preset_model, split_preset_name  # noqa: E402
from pagedmlx.config import EngineConfig  # noqa: E402
from pagedmlx.kernels.selector import KernelPlan  # noqa: E402
from pagedmlx.loaders.random_model import RANDOM_ARCHS, build_model  # noqa: E402
from pagedmlx.runner import verify  # noqa: E402
from pagedmlx.runner.model import ModelRunner  # noqa: E402
from pagedmlx.runner.selfcheck import check_paged_forward  # noqa: E402

FAMILIES = ["llama-tiny", "qwen3-tiny", "gemma3-tiny", "gemma4-e-tiny", "gemma4-moe-tiny", "gemma3n-tiny",
            "gpt-oss-tiny", "cohere2-tiny", "olmo3-tiny", "ministral3-tiny", "qwen3_5-tiny", "qwen3_5_moe-tiny",
            "qwen3_next-tiny", "lfm2-tiny", "nemotron_h-tiny", "granitemoehybrid-tiny", "falcon_h1-tiny",
            "mamba2-tiny"]
# Gemma 4 with per-layer head dims 24 / 48 (not multiples of 32), as the failing model had.
EXTRA = {"gemma4-e-24-48": dict(RANDOM_ARCHS["gemma4-e-tiny"], head_dim=24, global_head_dim=48)}


def variants(plan: KernelPlan) -> dict[str, KernelPlan]:
    """The selector's plan, each paged kernel alone, and none (state kernels as selected: they are
    installed into the model at load)."""
    alone = dict(decode=False, page_write=False, prefill=False)
    out = {"selected": plan}
    for name in ("decode", "page_write", "prefill"):
        if getattr(plan, name):
            out[f"{name} only"] = dataclasses.replace(plan, **dict(alone, **{name: True}))
    out["none"] = dataclasses.replace(plan, **alone)
    return out


def check_model(name: str, model, dtype: mx.Dtype, block_size: int) -> list[tuple[str, str, str]]:
    runner = ModelRunner(model, EngineConfig(block_size=block_size, num_blocks=64), verify=False)
    plan, rows = runner.kernels, []
    runner.kernels = variants(plan)["none"]
    if runner._head is not None and verify._check(runner) is not None:
        runner._body = runner._head = None
    summary = ",".join(k for k in ("decode", "page_write", "prefill", "state") if getattr(plan, k)) or \
        f"off ({plan.reason})"
    for label, variant in variants(plan).items():
        runner.kernels = variant
        t, errors = time.perf_counter(), {}
        try:
            err = check_paged_forward(runner, errors)
        except Exception as exc:  # noqa: BLE001 - a kernel that fails to build or run
            err = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
        worst = f"max rel diff {max(errors.values()):.2e}" if errors else ""
        rows.append((label, "ok" if err is None else err, f"{time.perf_counter() - t:.1f}s {worst}"))
    print(f"{name} {dtype} [{summary}]", flush=True)
    for label, result, took in rows:
        print(f"    {label:16s} {took:>28s}  {result}", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--families", nargs="*", default=FAMILIES + list(EXTRA))
    ap.add_argument("--presets", nargs="*", default=[])
    ap.add_argument("--dtypes", nargs="*", default=["float32", "bfloat16"])
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    failed = []
    for dtype in [getattr(mx, d) for d in args.dtypes]:
        for name in args.families:
            model = build_model(EXTRA.get(name) or RANDOM_ARCHS[name])
            model.set_dtype(dtype)
            rows = check_model(name, model, dtype, args.block_size)
            if rows[0][1] != "ok":
                failed.append((name, dtype))
        for name in args.presets:
            base, quantization = split_preset_name(name)
            rows = check_model(name, preset_model(base, dtype, quantization=quantization), dtype, args.block_size)
            if rows[0][1] != "ok":
                failed.append((name, dtype))
            mx.clear_cache()
    print(f"\n{len(failed)} disagreed with the selected kernels: {failed}")


if __name__ == "__main__":
    main()
