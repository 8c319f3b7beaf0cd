"""Multi-turn time to first token on a model with recurrent state: pagedmlx with state checkpoints
(each turn resumes from the last checkpoint of the conversation's history) against the same engine
without them (every turn recomputes its whole history: a state model has no other prefix hit).

C conversations run at once for T turns; each turn's prompt is the history so far (the previous
prompts and answers) plus a new user message, so the history grows by about --growth tokens a turn.
Reported per turn: the mean time to first token over the conversations, and the prompt tokens served
from checkpoints.

  python scripts/bench/bench_multiturn.py --arch qwen3.5-27b-16l --dtype bfloat16        # 8 x 6 turns, +1k a turn
  python scripts/bench/bench_multiturn.py --arch qwen3.5-tiny --growth 96 --gen-len 8     # on the CPU, a check
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from scripts.bench.bench_offline import PRESETS, random_model  # noqa: E402


def run(engine, conversations: int, turns: int, growth: int, gen_len: int, vocab: int, seed: int) -> list[dict]:
    from pagedmlx.sampling_params import SamplingParams

    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)
    history = [[rng.randrange(vocab) for _ in range(growth - gen_len)] for _ in range(conversations)]
    rows = []
    for turn in range(turns):
        start, first, done = {}, {}, {}
        for c in range(conversations):
            rid = f"s{seed}c{c}t{turn}"
            engine.add_request(rid, history[c], params)
            start[rid] = time.perf_counter()
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if out.new_token_ids and out.request_id not in first:
                    first[out.request_id] = now
                if out.finished:
                    done[out.request_id] = out
        ttft = [first[rid] - start[rid] for rid in start]
        rows.append(dict(turn=turn + 1, prompt_tokens=statistics.mean(len(h) for h in history),
                         ttft_mean=statistics.mean(ttft), ttft_max=max(ttft),
                         cached_tokens=statistics.mean(done[rid].num_cached_tokens for rid in start)))
        for c, rid in enumerate(start):
            history[c] = history[c] + done[rid].token_ids + [rng.randrange(vocab) for _ in range(growth - gen_len)]
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--arch", default="qwen3.5-27b-16l", choices=PRESETS)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--growth", type=int, default=1024, help="history tokens added per turn (answer + user message)")
    ap.add_argument("--gen-len", type=int, default=64, help="tokens of each answer")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--checkpoint-interval", type=int, default=1024)
    ap.add_argument("--max-state-checkpoints", type=int, default=None, help="(default: 4 per conversation)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine

    model = random_model(args.arch, getattr(mx, args.dtype))
    vocab = getattr(model.args, "vocab_size", None) or model.args.text_config["vocab_size"]
    longest = args.turns * args.growth + args.gen_len
    num_blocks = args.conversations * (-(-longest // args.block_size) + 1) * 2 + 8  # room for the cached history

    def engine(interval: int) -> LLMEngine:
        return LLMEngine(model, None, EngineConfig(
            block_size=args.block_size, num_blocks=num_blocks, max_num_seqs=args.conversations,
            max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=longest + 1,
            state_checkpoint_interval=interval,
            max_state_checkpoints=args.max_state_checkpoints or 4 * args.conversations))

    console = Console()
    console.print(f"[bold]bench_multiturn[/] random {args.arch} ({args.dtype}) on {mx.default_device()}, "
                  f"{args.conversations} conversations x {args.turns} turns, +{args.growth} tokens a turn, "
                  f"answers of {args.gen_len}, {time.strftime('%Y-%m-%d')}")
    results = {}
    for label, interval in (("checkpoints", args.checkpoint_interval), ("none", 0)):
        eng = engine(interval)
        run(eng, 2, 2, 64, 4, vocab, seed=99)  # warm-up
        results[label] = run(eng, args.conversations, args.turns, args.growth, args.gen_len, vocab, seed=1)
        del eng
    table = Table(title="time to first token per turn (mean over conversations)")
    for col in ("turn", "prompt tokens", "TTFT, checkpoints (s)", "served from checkpoints", "TTFT, none (s)",
                "speedup"):
        table.add_column(col, justify="right")
    for a, b in zip(results["checkpoints"], results["none"]):
        table.add_row(str(a["turn"]), f"{a['prompt_tokens']:.0f}", f"{a['ttft_mean']:.3f}", f"{a['cached_tokens']:.0f}",
                      f"{b['ttft_mean']:.3f}", f"{b['ttft_mean'] / a['ttft_mean']:.2f}")
    console.print(table)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(arch=args.arch, dtype=args.dtype, device=str(mx.default_device()),
                                                   args=vars(args), results=results), indent=1))


if __name__ == "__main__":
    main()
