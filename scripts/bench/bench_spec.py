"""Speculative decoding (n-gram) against none, in one process: `LLM.generate` over prompts that give the
model a passage and ask for it back lightly edited (the answer quotes its prompt, where prompt lookup
applies; four passages, so batch 1 runs four requests one after another), speculation on and off
interleaved `--rounds` times at each `--batch`; the median output tok/s
of each, their ratio, the acceptance rate and the mean acceptance length. Both engines share the model;
greedy, so their outputs must be identical (checked). `--mlx-lm` adds mlx-lm's `generate_step` at batch 1.

`--rejected` measures instead what verifying costs when it buys nothing: every request drafts k wrong
tokens each step (so each step computes 1 + k tokens a request and keeps 1), against no drafts, at each
batch: the ratio is the step's cost of k extra query tokens, which the adaptive rules weigh
(SpeculativeConfig.disable_by_batch_size, min_acceptance_rate; docs/benchmarks.md).

`--oracle P` is for random-weight models of a real model's widths (`preset:llama-8b`), whose answers
quote nothing: each step drafts the next k tokens of the same prompt's answer without speculation, each
draft token wrong with probability P (seeded). P = 0.07 gives the mean acceptance length that SmolLM2 (a
real model) reaches on the quote workload with k = 4 (4.29 on the H200), so the speed of a large
model at a real model's acceptance is measured without its weights. Unlike n-gram, the oracle drafts at
every step: an upper bound for a workload whose drafts apply everywhere.

    python scripts/bench/bench_spec.py --batch 1 4 --rounds 5          # the default model (SmolLM2)
    python scripts/bench/bench_spec.py --workload chat --batch 1 4          # answers that quote nothing
    python scripts/bench/bench_spec.py --rejected --batch 1 4 16 64
    python scripts/bench/bench_spec.py preset:llama-8b --oracle 0.07 --batch 1 64 --mlx-lm    # H200
    python scripts/bench/bench_spec.py preset:qwen3.5-small --dtype float32 --rejected   # recurrent state's rollback
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402

from pagedmlx.llm import LLM  # noqa: E402
from pagedmlx.loaders.loader import load_model  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402

PASSAGES = [
    "The river rises in the hills to the north and runs for about forty miles before it reaches the sea. "
    "Along the way it passes three small towns, each built around an old stone bridge. In spring the water "
    "is high and fast; by late summer a child can wade across it in most places.",
    "To reset the device, hold the power button for ten seconds until the light turns orange. Release the "
    "button and wait for the light to turn green. If the light stays orange, unplug the device, wait one "
    "minute, plug it back in and try again.",
    "Our meeting on Tuesday covered three topics: the budget for next year, the hiring plan for the support "
    "team, and the move to the new office. The budget was approved with small changes. The hiring plan will "
    "be discussed again next week.",
    "The recipe needs two cups of flour, one cup of sugar, half a cup of butter, two eggs and a teaspoon of "
    "vanilla. Mix the butter and sugar first, then add the eggs one at a time, then the vanilla, and fold in "
    "the flour last. Bake for thirty minutes.",
]
QUESTIONS = ["Write a short story about a lighthouse keeper.", "Explain how a bicycle gear works.",
             "Give me five ideas for a rainy weekend.", "Describe the water cycle to a child."]
TASK = "Rewrite the following text, changing only the word \"{a}\" to \"{b}\". Output the whole text.\n\n{text}"
EDITS = [("small", "little"), ("light", "lamp"), ("budget", "plan"), ("cups", "mugs")]


def prompts_for(tokenizer, n: int, workload: str = "quote") -> list[list[int]]:
    if getattr(tokenizer, "chat_template", None) is None:  # random presets: the plain text
        texts = (QUESTIONS if workload == "chat"
                 else [TASK.format(a=a, b=b, text=t) for t, (a, b) in zip(PASSAGES, EDITS)])
        return [tokenizer.encode(texts[i % len(texts)] + " " * (i // len(texts))) for i in range(n)]
    out = []
    if workload == "chat":  # answers that quote nothing: what the adaptive rules must not lose on
        return [tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]
                                                + " " * (i // len(QUESTIONS))}], add_generation_prompt=True)
                for i in range(n)]
    for i in range(n):  # 16 different (passage, edit) pairs, then again
        a, b = EDITS[(i + i // len(PASSAGES)) % len(EDITS)]
        msg = TASK.format(a=a, b=b, text=PASSAGES[i % len(PASSAGES)])
        out.append(tokenizer.apply_chat_template([{"role": "user", "content": msg}], add_generation_prompt=True))
    return out


def oracle_propose(references: dict[tuple, list[int]], k: int, p_wrong: float, vocab_size: int, seed: int = 0):
    """A proposer drafting the request's answer without speculation, each token wrong with probability p_wrong."""
    rng = random.Random(seed)

    def propose(req, room: int) -> list[int]:
        answer = references.get(tuple(req.prompt_token_ids), [])
        right = answer[req.num_output_tokens:req.num_output_tokens + min(k, room)]
        return [(t + 1) % vocab_size if rng.random() < p_wrong else t for t in right]
    return propose


def run(llm: LLM, prompts: list[list[int]], params: SamplingParams, batch: int) -> tuple[float, list[list[int]]]:
    """Output tok/s of generating every prompt, `batch` prompts a generate call."""
    ids, elapsed = [], 0.0
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params, use_tqdm=False)
        elapsed += time.perf_counter() - t
        ids += [o.outputs[0].token_ids for o in outs]
    return sum(map(len, ids)) / elapsed, ids


def mlx_lm_tok_s(model, prompt: list[int], max_tokens: int, eos: set[int]) -> float:
    import mlx.core as mx
    from mlx_lm.generate import generate_step

    t, n = time.perf_counter(), 0
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=max_tokens), range(max_tokens)):
        n += 1
        if int(tok) in eos:
            break
    return n / (time.perf_counter() - t)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="default: the default model (SmolLM2-135M-Instruct)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--max-tokens", type=int, default=160)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--spec", default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, '
                                      '"prompt_lookup_min": 2}', help="the speculative_config JSON")
    ap.add_argument("--workload", choices=["quote", "chat"], default="quote",
                    help="quote: rewrite a given passage (default); chat: questions whose answers quote nothing")
    ap.add_argument("--rejected", action="store_true", help="measure the cost of k rejected drafts a step instead")
    ap.add_argument("--oracle", type=float, default=None, metavar="P",
                    help="draft the plain answer, each token wrong with probability P (random-weight models)")
    ap.add_argument("--mlx-lm", action="store_true", help="also mlx-lm's generate_step at batch 1")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--dtype", default=None,
                    help="float32 / bfloat16 / float16 (default: as loaded; a preset: bfloat16)")
    args = ap.parse_args()
    t0 = time.perf_counter()
    model, tok = load_model(args.model, dtype=args.dtype)
    if args.dtype:
        model.set_dtype(getattr(mx, args.dtype))
    print(f"loaded {args.model or 'the default model'} in {time.perf_counter() - t0:.1f} s", file=sys.stderr,
          flush=True)
    spec = json.loads(args.spec)
    spec.setdefault("disable_by_batch_size", max(args.batch))
    if args.rejected:  # every step drafts, unless --spec gives min_acceptance_rate (then the pauses show)
        spec.setdefault("min_acceptance_rate", 0.0)
    on = LLM(model, tok, speculative_config=spec, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=max(args.batch))
    off = LLM(model, tok, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=max(args.batch))
    print(f"both engines ready at {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    if args.rejected:  # every draft wrong: k tokens that follow no n-gram (a token id past the text's)
        k = on.engine.drafter.config.num_speculative_tokens
        on.engine.drafter.proposer.propose = lambda req, room: [len(tok) - 1 - j for j in range(min(k, room))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                            ignore_eos=args.rejected or args.oracle is not None)
    stats = on.engine.scheduler.spec_decoding_stats
    workload = f"oracle drafts (P(wrong) {args.oracle})" if args.oracle is not None else f"{args.workload} workload"
    print(f"model {args.model or 'default (SmolLM2-135M-Instruct)'} ({args.dtype or 'as loaded'}), {workload}, "
          f"speculative_config {json.dumps(spec)}, "
          f"{args.max_tokens} max new tokens, median of {args.rounds} interleaved rounds")
    for batch in args.batch:
        prompts = prompts_for(tok, max(batch, len(PASSAGES)), args.workload)
        run(on, prompts[:batch], SamplingParams(temperature=0.0, max_tokens=16), batch)  # warm-up
        run(off, prompts[:batch], SamplingParams(temperature=0.0, max_tokens=16), batch)
        if args.oracle is not None:
            answers = run(off, prompts, params, batch)[1]
            on.engine.drafter.proposer.propose = oracle_propose(
                {tuple(p): a for p, a in zip(prompts, answers)}, on.engine.drafter.config.num_speculative_tokens,
                args.oracle, len(tok))
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        tps_on, tps_off = [], []
        for r in range(args.rounds):
            for llm, acc in ((on, tps_on), (off, tps_off)) if r % 2 == 0 else ((off, tps_off), (on, tps_on)):
                tps, ids = run(llm, prompts, params, batch)
                acc.append(tps)
                if llm is on:
                    ids_on = ids
                else:
                    ids_off = ids
            same = sum(a == b for a, b in zip(ids_on, ids_off))
            # On the CPU (float32) the outputs are equal; on a GPU a batch's shape changes how its products
            # round, so an output may part from the other after a near tie: counted, not failed.
            assert same == len(ids_on) or mx.default_device() == mx.gpu, "speculation changed a greedy output"
        drafts, drafted, accepted = (now - then for now, then in zip(
            (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
        a, b = statistics.median(tps_on), statistics.median(tps_off)
        line = (f"batch {batch:3d}: on {a:8.1f} tok/s  off {b:8.1f} tok/s  on/off {a / b:.2f}x  "
                f"{same}/{len(ids_on)} outputs identical, "
                f"acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted} draft tokens), "
                f"mean acceptance length {1 + accepted / max(drafts, 1):.2f}, "
                f"{sum(map(len, ids_on)) / len(prompts):.0f} tokens a request")
        if args.mlx_lm and batch == 1:
            eos = set(tok.eos_token_ids) if not args.rejected else set()
            m = statistics.median(statistics.mean(mlx_lm_tok_s(model, p, args.max_tokens, eos) for p in prompts)
                                  for _ in range(args.rounds))
            line += f"; mlx-lm generate_step {m:.1f} tok/s (on / it {a / m:.2f}x)"
        print(line, flush=True)


if __name__ == "__main__":
    main()
