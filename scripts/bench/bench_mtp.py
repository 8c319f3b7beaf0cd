"""Speculative decoding with the checkpoint's MTP module (`speculative_config` method mtp): pagedmlx with it
against pagedmlx without speculation and mlx-lm's `generate_step` (mlx-lm has no MTP decoding: it drops the
weights), prompts one after another (or `--batch` at a time in pagedmlx); the runs interleave `--rounds`
times and the table gives each one's median output tok/s, the ratios, and the acceptance.

The target: a Qwen3.5 / Qwen3.6 / Qwen3-Next checkpoint folder holding its `mtp.*` weights (the original
Hugging Face one: mlx-lm's conversions drop them), or `--mtp-weights PATH` for another folder. A `preset:` or
`random:` target gets a module of random weights: its drafts are almost all rejected (the table then shows what a
round costs when nothing is accepted, with the adaptive pause off), so it measures the machinery's cost,
not MTP's speed.

    python scripts/bench/bench_mtp.py path/to/Qwen3.5-checkpoint --k 2          # a real module
    python scripts/bench/bench_mtp.py preset:qwen3.5-27b-16l --dtype bfloat16    # H200: the cost of a round
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from bench_draft import engine_run, interleaved, mlx_lm_run, print_table, warm_up  # noqa: E402
from bench_spec import QUESTIONS  # noqa: E402

from pagedmlx.llm import LLM  # noqa: E402
from pagedmlx.loader import PRESET_PREFIX, RANDOM_PREFIX, load_model  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="the target: a checkpoint folder with mtp.* weights, or preset: / random:")
    ap.add_argument("--mtp-weights", default=None, help="the folder holding the mtp.* weights (default: the target's)")
    ap.add_argument("--k", type=int, default=2, help="num_speculative_tokens")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: as loaded)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=1, help="pagedmlx runs this many prompts at once")
    ap.add_argument("--kv-cache-gb", type=float, default=2.0)
    args = ap.parse_args()
    target, tok = load_model(args.model, dtype=args.dtype)
    if args.dtype:
        target.set_dtype(getattr(mx, args.dtype))
    synthetic = args.model.startswith((PRESET_PREFIX, RANDOM_PREFIX)) and args.mtp_weights is None
    weights = args.mtp_weights or (None if synthetic else args.model)
    if synthetic:  # a random module of the target's shape (make_mtp_proposer gives one to a random: target)
        from pagedmlx.spec_decode.mtp import make_mtp_model
        from mlx.utils import tree_flatten

        module = make_mtp_model(target, dtype=args.dtype)
        weights = {k: v for k, v in tree_flatten(module.model.parameters()) if not k.startswith("embed_tokens.")}
        weights = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in weights.items()}  # as a checkpoint's
    prompts = [tok.encode(QUESTIONS[i % len(QUESTIONS)]) for i in range(args.prompts)]
    eos = set(tok.eos_token_ids)
    spec = {"method": "mtp", "model": weights, "num_speculative_tokens": args.k, "disable_by_batch_size": args.batch,
            "min_acceptance_rate": 0.0 if synthetic else 0.15}
    seqs = max(4, args.batch)
    on = LLM(target, tok, speculative_config=spec, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=seqs)
    off = LLM(target, tok, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=seqs)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    stats = on.engine.scheduler.spec_decoding_stats
    runs = {
        "pagedmlx + MTP": lambda: engine_run(on, prompts, params, args.batch),
        "pagedmlx, no speculation": lambda: engine_run(off, prompts, params, args.batch),
        "mlx-lm generate_step": lambda: mlx_lm_run(target, None, prompts, args.max_tokens, args.k, eos)[:2],
    }
    warm_up(runs)
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    tps: dict[str, list[float]] = {name: [] for name in runs}
    ids: dict[str, list] = {}
    for _, name, (t, ids[name]) in interleaved(runs, args.rounds):
        tps[name].append(t)
    drafts, drafted, accepted = (a - b for a, b in zip(
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
    med = {name: statistics.median(v) for name, v in tps.items()}
    print(f"target {args.model} ({args.dtype or 'as loaded'}), MTP weights "
          f"{'random (drafts almost all rejected: the cost of a round)' if synthetic else weights}, k {args.k}, "
          f"{len(prompts)} prompts ({args.batch} at a time in pagedmlx), {args.max_tokens} max new tokens, median of "
          f"{args.rounds} interleaved rounds; {mx.default_device()}")
    print(f"acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted} draft tokens, mean acceptance length "
          f"{1 + accepted / max(drafts, 1):.2f})")
    print_table(med, ids, "pagedmlx, no speculation", "no speculation")


if __name__ == "__main__":
    main()
