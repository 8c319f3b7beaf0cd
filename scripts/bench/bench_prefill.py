"""Long prompts: time to first token and prompt tokens/s, pagedmlx against mlx-lm in the same run.

Cases (N prompts of L tokens, + G new tokens):
  1x32k        one 32,000-token prompt, 1 new token        peer: mlx-lm generate_step
  8x8k         8 prompts of 8,192 tokens, 1 new token      peer: mlx-lm BatchGenerator
  32x4k+128    32 prompts of 3,968 tokens, 128 new tokens  peer: BatchGenerator (end to end too)
  mixed        64 decoding requests, then a 16k prompt arrives: the decodes' inter-token latency
               while it prefills, against the same decodes alone (and BatchGenerator doing the same);
               then a second 16k prompt: the first meets attention shapes new to the process (on
               CUDA a cuDNN graph each), the second finds them built
Prompt tokens/s: all prompt tokens over the time until the last request has its first token.
`--chunks T:B ...` runs pagedmlx with each prefill chunk cap T (long_prefill_token_threshold) and
token budget B (max_num_batched_tokens): how the defaults were chosen. `--sdpa-quantum Q ...` runs
it with each attention shape padding (0: none; CUDA's default pads to 256: bench_sdpa_shapes.py says why);

  python scripts/bench/bench_prefill.py --preset llama-8b --dtype bfloat16            # the GPU machine
  python scripts/bench/bench_prefill.py --model default --cases 1x32k --scale 0.0625    # a CPU: SmolLM2, 2k tokens
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from bench_offline import PRESETS, make_prompts, measure_machine, random_model  # noqa: E402
from profile_step import Clock  # noqa: E402

CASES = {"1x32k": (1, 32000, 1), "8x8k": (8, 8192, 1), "32x4k+128": (32, 3968, 128)}


def engine_for(model, args, threshold: int, budget: int, max_len: int, num_seqs: int, blocks: int = 0,
               quantum: Optional[int] = None, warm_up: Optional[bool] = None, kernel: Optional[bool] = None):
    """blocks: the pool's size (default: every request at max_len); quantum: the attention shapes'
    padding (attention_metadata.sdpa_shape_quantum; None: the backend's default); warm_up:
    EngineConfig.warm_up_attention (None: the backend's default); kernel: EngineConfig.prefill_kernel."""
    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine

    free_memory()
    blocks = blocks or num_seqs * (-(-max_len // args.block_size) + 1) + 8
    engine = LLMEngine(model, None, EngineConfig(
        block_size=args.block_size, num_blocks=blocks, max_num_seqs=num_seqs, max_num_batched_tokens=budget,
        long_prefill_token_threshold=threshold, max_model_len=max_len + 1, enable_prefix_caching=False,
        sdpa_quantum=quantum, warm_up_attention=warm_up, prefill_kernel=kernel))
    return engine


def free_memory() -> None:
    """The previous case's engine and its KV pool (an H200 holds one Llama-8B pool at a time)."""
    gc.collect()
    mx.clear_cache()


def run_pagedmlx(engine, prompts: list[list[int]], gen: int) -> dict:
    """Seconds until every request has its first token, and until all are done."""
    from pagedmlx.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=gen, ignore_eos=True)
    engine.stats = type(engine.stats)()  # this run's steps only
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"p{time.monotonic_ns()}-{i}", p, params)
    first, generated = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            generated += len(out.new_token_ids)
            first.setdefault(out.request_id, time.perf_counter() - start)
    total = time.perf_counter() - start
    st = engine.stats
    return dict(ttft=max(first.values()), ttft_first=min(first.values()), total=total, generated=generated,
                steps=st.num_steps, host_build_s=st.build_s, device_wait_s=st.wait_s,
                host_other_s=st.schedule_s + st.update_s)


def run_generate_step(model, prompt: list[int]) -> dict:
    from mlx_lm.generate import generate_step

    start = time.perf_counter()
    for (tok, _), _ in zip(generate_step(mx.array(prompt), model, max_tokens=1), range(1)):
        mx.eval(tok)
    t = time.perf_counter() - start
    return dict(ttft=t, ttft_first=t, total=t, generated=1)


def run_batch_generator(model, prompts: list[list[int]], gen: int) -> dict:
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=gen, completion_batch_size=len(prompts),
                        prefill_batch_size=min(len(prompts), 8))
    start = time.perf_counter()
    bg.insert(prompts, max_tokens=[gen] * len(prompts))
    first, done, generated = {}, 0, 0
    while done < len(prompts):
        responses = bg.next_generated()
        if not responses:
            break
        for r in responses:
            first.setdefault(r.uid, time.perf_counter() - start)
            generated += 1
            done += r.finish_reason is not None
    total = time.perf_counter() - start
    bg.close()
    return dict(ttft=max(first.values()), ttft_first=min(first.values()), total=total, generated=generated)


def attention_flops(model, lengths: list[int]) -> float:
    """Matmul FLOPs of a prefill: 2 x parameters x tokens, plus causal attention (QK and PV)."""
    from mlx.utils import tree_flatten

    a = model.args
    params = sum(v.size for k, v in tree_flatten(model.parameters()) if "embed_tokens" not in k)
    head_dim = getattr(a, "head_dim", None) or a.hidden_size // a.num_attention_heads
    attn = sum(2 * n * n * a.num_attention_heads * head_dim for n in lengths) * a.num_hidden_layers
    return 2 * params * sum(lengths) + attn


def mixed(model, args, vocab: int, threshold: int, budget: int, quantum: Optional[int], warm_up: Optional[bool],
          kernel: Optional[bool]) -> dict:
    """64 decoding requests; then a 16k prompt arrives, and when it is done another. The decodes'
    step times before and during each."""
    from pagedmlx.sampling_params import SamplingParams

    n_dec, long_len = 64, int(16384 * args.scale)
    bs = args.block_size
    engine = engine_for(model, args, threshold, budget, long_len + 512, n_dec + 1,
                        blocks=n_dec * -(-1200 // bs) + -(-long_len // bs) + 16,  # decodes grow < 1100 tokens
                        quantum=quantum, warm_up=warm_up, kernel=kernel)
    dec = SamplingParams(temperature=0.0, max_tokens=100_000, ignore_eos=True)
    for i, p in enumerate(make_prompts(n_dec, 128, vocab, 3)):
        engine.add_request(f"d{i}", p, dec)
    while len(engine.scheduler.waiting) or any(r.num_computed_tokens < r.num_prompt_tokens
                                               for r in engine.scheduler.running):
        engine.step()  # until all 64 are decoding
    _step_times(engine, 8)  # the first decode steps (and their shapes) behind
    with Clock() as clock:
        alone = _step_times(engine, 32)
    q = lambda xs, p: statistics.quantiles(xs, n=10)[p] if len(xs) > 2 else max(xs)  # noqa: E731
    out = dict(itl_p50_alone=statistics.median(alone), itl_p90_alone=q(alone, 8), dispatch_alone=clock.dispatch / 32)
    for name, seed in (("", 4), ("_warm", 5)):
        rid = f"long{seed}"
        engine.add_request(rid, make_prompts(1, long_len, vocab, seed)[0],
                           SamplingParams(max_tokens=1, temperature=0.0))
        during, dispatch, t0, ttft = [], [], time.perf_counter(), None
        while ttft is None:
            with Clock() as clock:  # time inside mx.async_eval: encoding the step (and any cuDNN graph build)
                t = time.perf_counter()
                outs = engine.step()
                during.append(time.perf_counter() - t)
            dispatch.append(clock.dispatch)
            if any(o.request_id == rid and o.new_token_ids for o in outs):
                ttft = time.perf_counter() - t0
        out.update({f"itl_p50_during{name}": statistics.median(during), f"itl_p90_during{name}": q(during, 8),
                    f"dispatch_p50{name}": statistics.median(dispatch), f"dispatch_p90{name}": q(dispatch, 8),
                    f"ttft{name}": ttft, f"steps{name}": len(during)})
    # The decodes alone again, after: the p50 alone moved 2x between processes on one host,
    # so the ratio's denominator is the median of both sets, and both are reported.
    after = _step_times(engine, 32)
    out.update(itl_p50_alone_before=out["itl_p50_alone"], itl_p50_alone_after=statistics.median(after),
               itl_p50_alone=statistics.median(alone + after))
    engine.abort_request([f"d{i}" for i in range(n_dec)])
    while engine.has_unfinished_requests():
        engine.step()
    return out


def _step_times(engine, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t)
    return times


def mixed_batch_generator(model, args, vocab: int) -> dict:
    """The same with mlx-lm's BatchGenerator: its decode steps while it prefills the long prompt."""
    from mlx_lm.generate import BatchGenerator

    bg = BatchGenerator(model, max_tokens=100_000, completion_batch_size=65, prefill_batch_size=8)
    bg.insert(make_prompts(64, 128, vocab, 3), max_tokens=[100_000] * 64)
    for _ in range(8):
        bg.next_generated()
    alone = []
    for _ in range(16):
        t = time.perf_counter()
        bg.next_generated()
        alone.append(time.perf_counter() - t)
    bg.insert(make_prompts(1, int(16384 * args.scale), vocab, 4), max_tokens=[1])
    t0, during, ttft = time.perf_counter(), [], None
    while ttft is None and len(during) < 10_000:
        t = time.perf_counter()
        responses = bg.next_generated()
        during.append(time.perf_counter() - t)
        if len(responses) > 64:
            ttft = time.perf_counter() - t0
    bg.close()
    return dict(itl_p50_alone=statistics.median(alone), itl_max_during=max(during), ttft=ttft)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="a model pagedmlx loads (default model: 'default'); else a random --preset")
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--cases", nargs="+", default=[*CASES, "mixed"], choices=[*CASES, "mixed"])
    ap.add_argument("--scale", type=float, default=1.0, help="multiply every prompt length (CPU: 1/16)")
    ap.add_argument("--chunks", nargs="+", default=None, metavar="T:B",
                    help="pagedmlx prefill chunk caps and token budgets to run (default: the engine's defaults)")
    ap.add_argument("--sdpa-quantum", type=int, nargs="+", default=None, metavar="Q",
                    help="attention shape paddings to run pagedmlx with (0: none; default: the backend's)")
    ap.add_argument("--warm-up", nargs="+", default=["default"], choices=["default", "on", "off"],
                    help="EngineConfig.warm_up_attention for each variant (the first long prompt's cost)")
    ap.add_argument("--prefill-kernel", nargs="+", default=["default"], choices=["default", "on", "off"],
                    help="EngineConfig.prefill_kernel for each variant (CUDA's paged prefill kernel)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--no-peer", action="store_true")
    ap.add_argument("--json")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from pagedmlx.config import EngineConfig

    logging.basicConfig(level=logging.INFO, format="  %(name)s: %(message)s")  # the engine's warm-up line
    console = Console()
    if args.model:
        from pagedmlx.loaders.loader import load_model

        model = load_model(None if args.model == "default" else args.model)[0]
        model.set_dtype(getattr(mx, args.dtype))
        args.preset = args.model
    else:
        model = random_model(args.preset, getattr(mx, args.dtype))
    vocab = model.args.vocab_size
    defaults = EngineConfig()
    chunks = [tuple(int(x) for x in c.split(":")) for c in args.chunks] if args.chunks else \
        [(defaults.long_prefill_token_threshold, defaults.max_num_batched_tokens)]
    warm = {"default": None, "on": True, "off": False}
    variants = [(t, b, q, warm[w], warm[k]) for t, b in chunks for q in (args.sdpa_quantum or [None])
                for w in args.warm_up for k in args.prefill_kernel]
    label = lambda t, b, q, w, k: (f"pagedmlx {t}:{b}" + ("" if q is None else f" q{q}")  # noqa: E731
                                   + ("" if w is None else " warm-up" if w else " no warm-up")
                                   + ("" if k is None else " kernel" if k else " no kernel"))
    console.print(f"[bold]bench_prefill[/] {args.preset} ({args.dtype}) on {mx.default_device()}, "
                  f"{time.strftime('%Y-%m-%d')}, scale {args.scale}, chunk cap:budget {chunks}")
    _, peak = measure_machine()
    console.print(f"  measured matmul peak {peak / 1e12:.1f} TFLOP/s")
    rows = []
    for case in args.cases:
        free_memory()
        if case == "mixed":
            for v in variants:
                m = mixed(model, args, vocab, *v)
                rows.append(dict(case="mixed", engine=label(*v), **m))
                console.print(f"  mixed {rows[-1]['engine']}: decode step p90 during / p50 alone "
                              f"{m['itl_p90_during'] / m['itl_p50_alone']:.2f} (second prompt "
                              f"{m['itl_p90_during_warm'] / m['itl_p50_alone']:.2f}), 16k TTFT {m['ttft']:.2f} s; "
                              f"ms in async_eval p50/p90 {1e3 * m['dispatch_p50']:.1f}/{1e3 * m['dispatch_p90']:.1f} "
                              f"(alone: mean {1e3 * m['dispatch_alone']:.1f}) "
                              f"(second {1e3 * m['dispatch_p50_warm']:.1f}/{1e3 * m['dispatch_p90_warm']:.1f})")
            if not args.no_peer:
                free_memory()
                try:
                    rows.append(dict(case="mixed", engine="BatchGenerator",
                                     **mixed_batch_generator(model, args, vocab)))
                except RuntimeError as e:  # its batch cache pads every sequence to the longest
                    console.print(f"  mixed BatchGenerator failed: {str(e)[:120]}")
                    rows.append(dict(case="mixed", engine="BatchGenerator (failed: out of memory)",
                                     itl_p50_alone=float("nan"), itl_max_during=float("nan"), ttft=None))
            continue
        n, length, gen = CASES[case]
        length = int(length * args.scale)
        prompts = make_prompts(n, length, vocab, 7)
        flops = attention_flops(model, [length] * n)
        peer = None
        if not args.no_peer:
            peer = run_generate_step(model, prompts[0]) if n == 1 else run_batch_generator(model, prompts, gen)
            rows.append(dict(case=case, engine="generate_step" if n == 1 else "BatchGenerator", **peer,
                             prompt_tps=n * length / peer["ttft"], roofline=flops / peer["ttft"] / peak))
        for v in variants:
            threshold, budget, quantum, warm_up, kernel = v
            engine = engine_for(model, args, threshold, budget, length + gen, n, quantum=quantum, warm_up=warm_up,
                                kernel=kernel)
            run_pagedmlx(engine, make_prompts(1, min(length, 256), vocab, 1), 1)  # warm up
            ours = run_pagedmlx(engine, prompts, gen)
            del engine
            row = dict(case=case, engine=label(*v), **ours, prompt_tps=n * length / ours["ttft"],
                       roofline=flops / ours["ttft"] / peak)
            if peer:
                row.update(ratio=peer["ttft"] / ours["ttft"], e2e_ratio=peer["total"] / ours["total"])
            rows.append(row)
            console.print(f"  {case} {row['engine']}: {ours['steps']} steps: building {ours['host_build_s']:.2f} s, "
                          f"waiting {ours['device_wait_s']:.2f} s, scheduling and outputs {ours['host_other_s']:.2f} s")
            console.print(f"  {case} {row['engine']}: TTFT {ours['ttft']:.2f} s, end to end {ours['total']:.2f} s"
                          + (f" ({row['ratio']:.2f}x and {row['e2e_ratio']:.2f}x the peer's "
                             f"{peer['ttft']:.2f} s and {peer['total']:.2f} s)" if peer else ""))

    table = Table(title="prefill: time to first token (all requests), prompt tokens/s, share of the matmul peak")
    for col in ("case", "engine", "TTFT s", "prompt tok/s", "of peak", "vs peer", "e2e s", "e2e vs peer"):
        table.add_column(col, justify="right")
    for r in rows:
        if r["case"] == "mixed":
            continue
        table.add_row(r["case"], r["engine"], f"{r['ttft']:.2f}", f"{r['prompt_tps']:.0f}",
                      f"{100 * r['roofline']:.0f}%",
                      f"{r['ratio']:.2f}x" if "ratio" in r else "", f"{r['total']:.2f}",
                      f"{r['e2e_ratio']:.2f}x" if "e2e_ratio" in r else "")
    console.print(table)
    mixed_rows = [r for r in rows if r["case"] == "mixed"]
    if mixed_rows:
        t = Table(title="mixed: 64 decodes while a 16k prompt prefills (decode step time, ms)")
        for col in ("engine", "alone p50", "alone p90", "during p50", "during p90 (max for BatchGenerator)",
                    "p90 during / p50 alone", "16k TTFT s", "2nd prompt: p90 / p50 alone", "2nd TTFT s"):
            t.add_column(col, justify="right")
        nan = float("nan")
        for r in mixed_rows:
            during90 = r.get("itl_p90_during", r.get("itl_max_during"))
            t.add_row(r["engine"], f"{1e3 * r['itl_p50_alone']:.1f}", f"{1e3 * r.get('itl_p90_alone', nan):.1f}",
                      f"{1e3 * r.get('itl_p50_during', nan):.1f}", f"{1e3 * during90:.1f}",
                      f"{during90 / r['itl_p50_alone']:.2f}", f"{r['ttft']:.2f}" if r["ttft"] else "-",
                      f"{r.get('itl_p90_during_warm', nan) / r['itl_p50_alone']:.2f}",
                      f"{r.get('ttft_warm', nan):.2f}")
        console.print(t)
    if args.json:
        Path(args.json).write_text(json.dumps(dict(preset=args.preset, dtype=args.dtype,
                                                   device=str(mx.default_device()), peak=peak, rows=rows), indent=1))


if __name__ == "__main__":
    main()
