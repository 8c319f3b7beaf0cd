"""Speculative decoding with a draft model: pagedmlx with the draft (`speculative_config` method
draft_model) against mlx-lm's own `speculative_generate_step` on the same (target, draft) pair, and both
against plain decoding (pagedmlx without speculation, mlx-lm's `generate_step`). Prompts run one after
another (batch 1), or in pagedmlx `--batch` at a time (mlx-lm's speculative generation takes one request:
its server turns batching off when given a draft model); the four runs interleave `--rounds` times (order
rotated each round); the table gives each one's median output tok/s and the ratios. Greedy: every run's
tokens are compared with mlx-lm's generate_step (exact on the CPU in float32; on a GPU they may part after
a near tie).

The draft (`--draft`):
  layers:N   the target's first N layers with its embeddings, final norm and head (weights shared)
  q4, q8     the target's linear layers quantized to 4 / 8 bits (nn.quantize, group size 64), embeddings kept
  PATH       any model the loader takes (same tokenizer)

--target-tail-scale S (with --draft layers:N) scales the output projections (o_proj, down_proj) of the
target's layers past the first N by S. At 0 those layers add exactly nothing to the residual stream while
the target still reads all their weights, so the N-layer draft agrees with the target on (nearly) every
token: a pair with random weights whose acceptance is high and whose draft is cheap, which measures the
speculation machinery itself (a q8 copy of a random model is rejected too often to pay). A small S
lowers the acceptance.

--lookup N adds a run of pagedmlx with the draft and prompt lookup (`prompt_lookup_max` N, min 2): where
the context repeats, the n-gram's draft instead of the draft model's, where it promises more (the
`quote` workload is where it applies).

--phases times one more pass of each speculative run of pagedmlx by phase of the engine's round, wall
time (spec_phases.py): what the host does between the round's sync and the next round's first dispatch,
which the device waits through at batch 1.

--profile N profiles one more pass of each speculative run after the rounds and prints its N costliest
functions by own time (where a round's host time goes).

    python scripts/bench/bench_draft.py --draft layers:10 --k 3 --rounds 3                 # SmolLM2, CPU
    python scripts/bench/bench_draft.py preset:llama-8b --draft q4 --dtype bfloat16 --k 4    # H200
    python scripts/bench/bench_draft.py --workload quote --lookup 3 --k 3                   # SmolLM2, draft + lookup
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
import mlx.nn as nn  # noqa: E402
from bench_spec import QUESTIONS, prompts_for  # noqa: E402

from pagedmlx.llm import LLM  # noqa: E402
from pagedmlx.loaders.loader import load_model  # noqa: E402
from pagedmlx.sampling_params import SamplingParams  # noqa: E402


def make_draft(target: nn.Module, how: str, dtype) -> nn.Module:
    """A draft from the target: its first layers (`layers:N`) or a quantized copy (`q4`, `q8`); else a path."""
    if not (how.startswith("layers:") or how in ("q4", "q8")):
        return load_model(how, dtype=dtype)[0]
    args = target.args
    params = target.parameters()
    if how.startswith("layers:"):
        n = int(how.split(":")[1])
        cut = {"num_hidden_layers": n}
        if getattr(args, "layer_types", None):  # mlx-lm fills it from num_hidden_layers: cut it too
            cut["layer_types"] = list(args.layer_types[:n])
        args = type(args).from_dict({**vars(args), **cut})
        params["model"]["layers"] = params["model"]["layers"][:n]
        params["model"].pop("layer_types", None)  # a list attribute that parameters() reports too
    draft = type(target)(args)
    quantized = {path: m for path, m in target.named_modules() if hasattr(m, "bits")}  # a GGUF kept packed on a GPU
    nn.quantize(draft, class_predicate=lambda path, _: path in quantized and {"group_size": quantized[path].group_size,
                                                                              "bits": quantized[path].bits})
    draft.update(params)  # the target's arrays, not copies
    if how in ("q4", "q8"):
        # the projections only: a quantized (tied) embedding as the LM head costs most of the agreement
        nn.quantize(draft, group_size=64, bits=int(how[1]), class_predicate=lambda _, m: isinstance(m, nn.Linear))
    mx.eval(draft.parameters())
    return draft


def scale_tail(target: nn.Module, first: int, scale: float) -> None:
    """Multiply the output projections (o_proj, down_proj) of the target's layers from `first` on by scale."""
    layers = target.layers
    found = 0
    for layer in layers[first:]:
        for path, module in layer.named_modules():
            if path.split(".")[-1] in ("o_proj", "down_proj") and "weight" in module:
                if "scales" in module:  # packed: the affine dequantization w * scale + bias scales with both
                    module.scales, module.biases = module.scales * scale, module.biases * scale
                else:
                    module.weight = module.weight * scale
                found += 1
    if found < 2 * (len(layers) - first):
        raise SystemExit(f"--target-tail-scale: found {found} o_proj / down_proj weights in "
                         f"{len(layers) - first} layers")
    mx.eval(target.parameters())


def mlx_lm_run(target, draft, prompts, max_tokens: int, k: int, eos: set[int]) -> tuple[float, list, int]:
    """tok/s over the prompts one after another, the tokens, and (with a draft) how many came from it."""
    from mlx_lm.generate import generate_step, speculative_generate_step

    out, accepted, elapsed = [], 0, 0.0
    for p in prompts:
        t = time.perf_counter()
        ids = []
        if draft is None:
            steps = ((tok, False) for tok, _ in generate_step(mx.array(p), target, max_tokens=max_tokens))
        else:
            steps = ((tok, fd) for tok, _, fd in speculative_generate_step(
                mx.array(p), target, draft, num_draft_tokens=k, max_tokens=max_tokens))
        for (tok, from_draft), _ in zip(steps, range(max_tokens)):
            ids.append(int(tok))
            accepted += bool(from_draft)
            if ids[-1] in eos:
                break
        elapsed += time.perf_counter() - t
        out.append(ids)
    return sum(map(len, out)) / elapsed, out, accepted


def engine_run(llm: LLM, prompts, params, batch: int = 1) -> tuple[float, list]:
    """tok/s over the prompts, `batch` of them at a time, and their tokens."""
    out, elapsed = [], 0.0
    for i in range(0, len(prompts), batch):
        t = time.perf_counter()
        o = llm.generate([{"prompt_token_ids": p} for p in prompts[i:i + batch]], params, use_tqdm=False)
        elapsed += time.perf_counter() - t
        out += [r.outputs[0].token_ids for r in o]
    return sum(map(len, out)) / elapsed, out


def warm_up(runs: dict) -> None:
    """Each run once (kernels built, shapes seen), timed to stderr."""
    for name, fn in runs.items():
        t0 = time.perf_counter()
        fn()
        print(f"warm-up {name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)


def interleaved(runs: dict, rounds: int):
    """(round, name, result) of every run in every round, the order rotated each round (a noisy machine's
    drift falls on every run alike); each tok/s (a result's first item) printed to stderr."""
    names = list(runs)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            result = runs[name]()
            print(f"round {r + 1}/{rounds} {name}: {result[0]:.1f} tok/s", file=sys.stderr, flush=True)
            yield r, name, result


def print_table(med: dict[str, float], ids: dict[str, list], base: str, label: str) -> None:
    """Each run's median tok/s against `base`'s (column `label`) and mlx-lm generate_step's, and how many of
    its prompts' tokens equal generate_step's."""
    ref = ids["mlx-lm generate_step"]
    print(f"| run | tok/s | vs {label} | vs mlx-lm generate_step | tokens == generate_step |")
    print("|---|---:|---:|---:|---|")
    for name, tps in med.items():
        same = sum(a == b for a, b in zip(ids[name], ref))
        print(f"| {name} | {tps:.1f} | {tps / med[base]:.2f}x | {tps / med['mlx-lm generate_step']:.2f}x | "
              f"{same}/{len(ref)} prompts |")


def profile_runs(runs: dict, top: int) -> None:
    """One more pass of each run under cProfile: its `top` functions by own time (host time per call: what
    each engine's Python and MLX's dispatch cost a token, and how long each waits for the device)."""
    import cProfile
    import io
    import pstats

    for name, fn in runs.items():
        prof = cProfile.Profile()
        prof.enable()
        _, out, _ = fn()
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(top)
        lines = [ln for ln in buf.getvalue().splitlines() if ln.strip()][3:]
        print(f"\nprofile of {name} ({sum(map(len, out))} tokens), by own time:")
        print("\n".join(lines))


def phase_runs(name: str, llm: LLM, run, drained: bool = False) -> None:
    """One more pass of a speculative run of ours, its host time by phase (spec_phases.PhaseClock); drained:
    the device drained before each forward's dispatch."""
    from spec_phases import PhaseClock

    stats = llm.engine.scheduler.spec_decoding_stats
    before = stats.num_drafts
    with PhaseClock(llm.engine, drained=drained) as clock:
        tps, out, _ = run()
    clock.print(stats.num_drafts - before, f"{name}{', drained' if drained else ''}, {sum(map(len, out))} tokens at "
                                           f"{tps:.1f} tok/s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=None, help="the target (default: the default model, SmolLM2-135M)")
    ap.add_argument("--draft", default="layers:10")
    ap.add_argument("--k", type=int, default=3, help="num_speculative_tokens (mlx-lm's num_draft_tokens)")
    ap.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16 (default: as loaded)")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--workload", choices=["chat", "quote"], default="chat")
    ap.add_argument("--kv-cache-gb", type=float, default=1.0)
    ap.add_argument("--dequantize", action="store_true",
                    help="unpack a quantized target (a GGUF is kept 4-bit on a GPU) before anything else, as on "
                         "the CPU")
    ap.add_argument("--target-tail-scale", type=float, default=None,
                    help="with --draft layers:N: scale the target's later layers' output projections (0: draft exact)")
    ap.add_argument("--batch", type=int, default=1,
                    help="pagedmlx runs this many prompts at once (mlx-lm's speculative and generate_step run one "
                         "at a time: they do not batch, and mlx_lm.server turns batching off with a draft model)")
    ap.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.merge_projections (default: on GPU backends); mlx-lm's runs keep the "
                         "separate modules either way")
    ap.add_argument("--fuse-norms", action=argparse.BooleanOptionalAction, default=False,
                    help="EngineConfig.fuse_norms (default off)")
    ap.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.skinny_gemm (default: on CUDA): the verifying step's products as pagedmlx's "
                         "kernel")
    ap.add_argument("--lookup", type=int, default=0, metavar="N",
                    help="add a run with the draft and prompt lookup (prompt_lookup_max N) to the table")
    ap.add_argument("--phases", action="store_true", help="time one more pass of our speculative runs by phase")
    ap.add_argument("--phases-drained", action="store_true",
                    help="with --phases: and a pass with the device drained before each forward's dispatch")
    ap.add_argument("--profile", type=int, default=0, metavar="N",
                    help="after the rounds, profile one more pass of each speculative run: its N costliest functions")
    args = ap.parse_args()
    target, tok = load_model(args.model, dtype=args.dtype)
    if args.dequantize:
        from mlx_lm.utils import dequantize_model

        target = dequantize_model(target)
    if args.dtype:
        target.set_dtype(getattr(mx, args.dtype))
    if args.target_tail_scale is not None:
        if not args.draft.startswith("layers:"):
            ap.error("--target-tail-scale needs --draft layers:N")
        scale_tail(target, int(args.draft.split(":")[1]), args.target_tail_scale)
    draft = make_draft(target, args.draft, args.dtype)
    try:
        prompts = prompts_for(tok, args.prompts, args.workload)[:args.prompts]
    except Exception:  # noqa: BLE001 - a tokenizer without a chat template (random presets): the plain text
        prompts = [tok.encode(QUESTIONS[i % len(QUESTIONS)]) for i in range(args.prompts)]
    eos = set(tok.eos_token_ids)
    spec = {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k,
            "disable_by_batch_size": args.batch}
    seqs = max(4, args.batch)
    on = LLM(target, tok, speculative_config=spec, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=seqs,
             merge_projections=args.merge_projections, fuse_norms=args.fuse_norms,
             skinny_gemm=args.skinny_gemm)
    off = LLM(target, tok, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=seqs,
              merge_projections=args.merge_projections, fuse_norms=args.fuse_norms,
             skinny_gemm=args.skinny_gemm)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    stats = on.engine.scheduler.spec_decoding_stats

    def ours_with_draft():
        before = stats.num_accepted_tokens
        t, out = engine_run(on, prompts, params, args.batch)
        return t, out, stats.num_accepted_tokens - before

    runs = {  # each: (tok/s, tokens, how many tokens came from the draft or None)
        "pagedmlx + draft": ours_with_draft,
        "mlx-lm speculative_generate_step": lambda: mlx_lm_run(target, draft, prompts, args.max_tokens, args.k, eos),
        "pagedmlx, no speculation": lambda: (*engine_run(off, prompts, params, args.batch), None),
        "mlx-lm generate_step": lambda: (*mlx_lm_run(target, None, prompts, args.max_tokens, args.k, eos)[:2], None),
    }
    if args.lookup:
        looks = LLM(target, tok, kv_cache_memory_gb=args.kv_cache_gb, max_num_seqs=seqs,
                    merge_projections=args.merge_projections,
                    speculative_config={**spec, "prompt_lookup_max": args.lookup,
                                        "prompt_lookup_min": min(2, args.lookup)})
        look_stats, drafter = looks.engine.scheduler.spec_decoding_stats, looks.engine.drafter

        def ours_with_lookup():
            before = look_stats.num_accepted_tokens
            t, out = engine_run(looks, prompts, params, args.batch)
            return t, out, look_stats.num_accepted_tokens - before

        runs = {"pagedmlx + draft + lookup": ours_with_lookup, **runs}
    warm_up(runs)
    before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    tps: dict[str, list[float]] = {name: [] for name in runs}
    ids: dict[str, list] = {}
    from_draft = {name: [0, 0] for name in runs}  # tokens from the draft, tokens
    names = list(runs)
    for _, name, (t, ids[name], n) in interleaved(runs, args.rounds):
        tps[name].append(t)
        from_draft[name][0] += n or 0
        from_draft[name][1] += sum(map(len, ids[name]))
    drafts, drafted, accepted = (a - b for a, b in zip(
        (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens), before))
    med = {name: statistics.median(v) for name, v in tps.items()}
    tail = "" if args.target_tail_scale is None else f" (later layers' output projections x {args.target_tail_scale:g})"
    print(f"target {args.model or 'default (SmolLM2-135M-Instruct)'}{tail} ({args.dtype or 'as loaded'}), "
          f"draft {args.draft}, k {args.k}, {args.workload} workload, {len(prompts)} prompts "
          f"({args.batch} at a time in pagedmlx, one at a time in mlx-lm), {args.max_tokens} max new "
          f"tokens, median of {args.rounds} interleaved rounds; {mx.default_device()}")
    share = {name: a / max(n, 1) for name, (a, n) in from_draft.items()}
    print(f"pagedmlx acceptance {accepted / max(drafted, 1):.2f} ({accepted}/{drafted} draft tokens, mean acceptance "
          f"length {1 + accepted / max(drafts, 1):.2f}); tokens from the draft: "
          f"pagedmlx {share['pagedmlx + draft']:.2f}, "
          f"mlx-lm {share['mlx-lm speculative_generate_step']:.2f} (a different text gives a different share)")
    if args.lookup:
        print(f"pagedmlx + draft + lookup: acceptance {look_stats.acceptance_rate:.2f}, {drafter.num_lookup_drafts} of "
              f"{look_stats.num_drafts} drafts from the lookup; tokens from drafts "
              f"{share['pagedmlx + draft + lookup']:.2f}")
    print_table(med, ids, "mlx-lm speculative_generate_step", "mlx-lm speculative")
    if args.phases:
        engines = {"pagedmlx + draft": on, **({"pagedmlx + draft + lookup": looks} if args.lookup else {})}
        for name, llm in engines.items():
            phase_runs(name, llm, runs[name])
            if args.phases_drained:
                phase_runs(name, llm, runs[name], drained=True)
    if args.profile:
        profile_runs({name: runs[name] for name in names if "draft" in name or "speculative" in name}, args.profile)


if __name__ == "__main__":
    main()
