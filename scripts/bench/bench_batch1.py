"""Batch 1, end to end: pagedmlx with compiled decode steps, pagedmlx with its steps built every time
(--no-compile-decode), where residual adds fuse with their norms (GPU backends) the compiled steps with that
(--fuse-norms), and mlx-lm's generate_step, on the same prompts one after another, greedy, each
to --max-tokens (ignore_eos). The runs interleave --rounds times; the table gives each one's median
output tok/s and the ratios. Where a small model's step is bound by the host (the CPU at tiny widths,
a small model on Metal), compiled steps are what brings pagedmlx past generate_step.

    python scripts/bench/bench_batch1.py                       # the default model (SmolLM2-135M)
    python scripts/bench/bench_batch1.py random:llama-small --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_draft import engine_run, interleaved, mlx_lm_run  # noqa: E402

from pagedmlx.llm import LLM  # noqa: E402
from pagedmlx.loader import load_model  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402

PROMPTS = ["Tell me about the sea.", "What is a page table?", "Write a haiku about rain.",
           "How do bees make honey?"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="default: the default model, SmolLM2-135M")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default=None)
    args = ap.parse_args()
    model, tok = load_model(args.model, dtype=args.dtype)
    prompts = [tok.encode(t) for t in (PROMPTS * args.prompts)[:args.prompts]]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    compiled = LLM(model, tok, kv_cache_memory_gb=0.5, max_num_seqs=4)
    built = LLM(model, tok, kv_cache_memory_gb=0.5, max_num_seqs=4, compile_decode=False)
    runs = {"pagedmlx, compiled steps": lambda: engine_run(compiled, prompts, params),
            "pagedmlx, built steps": lambda: engine_run(built, prompts, params)}
    fused = LLM(model, tok, kv_cache_memory_gb=0.5, max_num_seqs=4, fuse_norms=True)
    if fused.engine.runner.fused_norms:  # where the residual adds fuse (GPU backends): compiled steps with them
        runs["pagedmlx, compiled, fused norms"] = lambda: engine_run(fused, prompts, params)
    runs["mlx-lm generate_step"] = lambda: mlx_lm_run(model, None, prompts, args.max_tokens, 1, set())[:2]
    for fn in runs.values():
        fn()  # warm-up: traces, shapes
    tps: dict[str, list[float]] = {name: [] for name in runs}
    ids: dict[str, list] = {}
    for _, name, (t, out) in interleaved(runs, args.rounds):
        tps[name].append(t)
        ids[name] = out
    med = {name: statistics.median(v) for name, v in tps.items()}
    base = med["mlx-lm generate_step"]
    print(f"bench_batch1 {args.model or 'default (SmolLM2-135M-Instruct)'} on {mx.default_device()}, "
          f"{time.strftime('%Y-%m-%d %H:%M')}: {len(prompts)} prompts one after another, {args.max_tokens} tokens "
          f"each, greedy; median of {args.rounds} interleaved rounds")
    print("| run | tok/s | vs generate_step | tokens == generate_step |")
    print("|---|---:|---:|---|")
    for name, v in med.items():
        same = sum(a == b for a, b in zip(ids[name], ids["mlx-lm generate_step"]))
        print(f"| {name} | {v:.1f} | {v / base:.2f}x | {same}/{len(prompts)} prompts |")
    print(f"compiled / built: {med['pagedmlx, compiled steps'] / med['pagedmlx, built steps']:.2f}x")
    if "pagedmlx, compiled, fused norms" in med:
        print(f"fused / unfused residual norms: "
              f"{med['pagedmlx, compiled, fused norms'] / med['pagedmlx, compiled steps']:.2f}x")


if __name__ == "__main__":
    main()
