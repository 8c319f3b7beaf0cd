"""Batched multi-LoRA: decode throughput of a batch whose requests use --num-adapters different adapters
(round robin) against the same batch on the base model, same run.

For each batch size B, three runs of B prompts (--prompt-len random tokens, --gen-len tokens each,
greedy, EOS ignored), each cell the median of --repeats:
  base       an engine without LoRA (its own copy of the model)
  base+lora  the LoRA engine, every request on the base model (what serving adapters costs the rest)
  mixed      the LoRA engine, request i on adapter i % num_adapters: every step's rows mix them all
Reported: decode tok/s (decode steps only) and end-to-end tok/s, each the median of the repeats, and
mixed / base as the median over the repeats of each mixed run against the base run just before it.

The adapters are random (A and B ~ N(0, 0.01)), of rank --rank on the --keys (default: every linear layer,
as mlx_lm.lora) of the last --num-layers layers (default: all; mlx_lm.lora's defaults are rank 8 on the last
16), written in mlx-lm's format to a temporary folder; the engine's max_lora_rank is --rank.

  python scripts/bench/bench_lora.py                                   # random 8-layer 512-wide llama, float32
  python scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 8 32 64 256
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.presets import PRESETS, random_model  # noqa: E402
from scripts.bench.bench_offline import run_pagedmlx  # noqa: E402


def write_adapters(model, folder: str, n: int, rank: int, keys, dtype, num_layers: int = -1) -> list:
    """n random adapters for `model`'s targets (the last num_layers layers; -1: all), saved as mlx_lm.lora
    saves them."""
    from pagedmlx.lora.models import linear_dims, target_modules
    from pagedmlx.lora.request import LoRARequest

    targets = target_modules(model, num_layers, keys)
    out = []
    for i in range(n):
        mx.random.seed(100 + i)
        weights = {}
        for path, module in targets.items():
            d_in, d_out = linear_dims(module)
            weights[f"{path}.lora_a"] = (0.01 * mx.random.normal((d_in, rank))).astype(dtype)
            weights[f"{path}.lora_b"] = (0.01 * mx.random.normal((rank, d_out))).astype(dtype)
        path = os.path.join(folder, f"adapter{i}")
        os.makedirs(path)
        mx.save_safetensors(os.path.join(path, "adapters.safetensors"), weights)
        params = {"rank": rank, "scale": 2.0, "dropout": 0.0, **({"keys": keys} if keys else {})}
        with open(os.path.join(path, "adapter_config.json"), "w") as f:
            json.dump({"fine_tune_type": "lora", "num_layers": num_layers, "lora_parameters": params}, f)
        out.append(LoRARequest(f"adapter{i}", i + 1, path))
    return out


def run(engine, prompts, gen_len: int, loras) -> tuple[float, float]:
    """(decode tok/s, end-to-end tok/s) of one batch; loras[i]: request i's adapter (None: base)."""
    return run_pagedmlx(engine, prompts, gen_len, loras)[:2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="small", choices=PRESETS)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
    ap.add_argument("--batch-sizes", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--gen-len", type=int, default=64)
    ap.add_argument("--num-adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--keys", nargs="+", default=None, help="targeted modules of each layer (default: every linear)")
    ap.add_argument("--num-layers", type=int, default=-1,
                    help="adapters on the last N layers (-1: all; mlx_lm.lora's default is 16, with --rank 8)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--separate-launches", action="store_true",
                    help="one LoRA kernel launch a projection (no sibling sharing: what it saves)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--merge-projections", action=argparse.BooleanOptionalAction, default=None,
                    help="EngineConfig.merge_projections for both engines (default: merged on GPU backends)")
    ap.add_argument("--json", help="also write the rows to this file")
    args = ap.parse_args()

    from pagedmlx.config import EngineConfig
    from pagedmlx.engine.llm_engine import LLMEngine

    dtype = getattr(mx, args.dtype)
    largest = max(args.batch_sizes)
    per_seq = -(-(args.prompt_len + args.gen_len) // args.block_size) + 1
    common = dict(block_size=args.block_size, num_blocks=largest * per_seq + 16, max_num_seqs=largest,
                  max_model_len=args.prompt_len + args.gen_len + args.block_size,
                  merge_projections=args.merge_projections)
    base_engine = LLMEngine(random_model(args.preset, dtype), None, EngineConfig(**common))
    lora_model = random_model(args.preset, dtype)
    folder = tempfile.mkdtemp(prefix="bench_lora_")  # adapters made on the model's separate modules
    adapters = write_adapters(lora_model, folder, args.num_adapters, args.rank, args.keys, dtype, args.num_layers)
    lora_engine = LLMEngine(lora_model, None, EngineConfig(**common, enable_lora=True, max_loras=args.num_adapters,
                                                           max_lora_rank=args.rank))
    lora_engine.runner.lora_manager.punica.share_launches = not args.separate_launches
    vocab = lora_engine.runner.vocab_size
    name = f"random {PRESETS[args.preset]['model_type']} '{args.preset}' ({args.dtype})"
    print(f"{name} on {mx.default_device()}; {args.num_adapters} adapters of rank {args.rank} on "
          f"{'keys ' + ' '.join(args.keys) if args.keys else 'every linear layer'} of "
          f"{'every layer' if args.num_layers < 0 else f'the last {args.num_layers} layers'}; "
          f"prompt {args.prompt_len}, "
          f"gen {args.gen_len}, median of {args.repeats}; projections merged: base engine "
          f"{bool(base_engine.runner.merged_groups)}, LoRA engine {bool(lora_engine.runner.merged_groups)}")
    import random

    rows = []
    print(f"{'batch':>5} | {'base dec':>9} {'base+lora':>9} {'mixed':>9} tok/s | {'mixed/base':>10} | "
          f"{'e2e base':>9} {'e2e mixed':>9} {'ratio':>6}")
    for batch in args.batch_sizes:
        rng = random.Random(batch)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(batch)]
        mixed_loras = [adapters[i % len(adapters)] for i in range(batch)]
        # warm-up at the measured batch: adapters into their slots, kernels JIT-compiled and each case's decode
        # step hot enough to be compiled (its trace would otherwise land in the first measured run)
        for engine, loras in ((base_engine, [None] * batch), (lora_engine, [None] * batch), (lora_engine, mixed_loras)):
            run(engine, prompts, 8, loras)
        cells = {"base": [], "base+lora": [], "mixed": []}
        for _ in range(args.repeats):  # interleaved, so that drift hits all three alike
            cells["base"].append(run(base_engine, prompts, args.gen_len, [None] * batch))
            cells["base+lora"].append(run(lora_engine, prompts, args.gen_len, [None] * batch))
            cells["mixed"].append(run(lora_engine, prompts, args.gen_len, mixed_loras))
        med = {k: (statistics.median(d for d, _ in v), statistics.median(e for _, e in v)) for k, v in cells.items()}
        # each repeat's mixed run against the base run just before it, then the median of those ratios: drift
        # between repeats (these machines wander by 2x within a call) cancels out of each pair
        paired = [statistics.median(m[i] / b[i] for (m, b) in zip(cells["mixed"], cells["base"])) for i in (0, 1)]
        row = dict(batch=batch, **{f"{k}_decode_tok_s": v[0] for k, v in med.items()},
                   **{f"{k}_e2e_tok_s": v[1] for k, v in med.items()},
                   ratio_decode=paired[0], ratio_e2e=paired[1],
                   ratios_decode=[m[0] / b[0] for m, b in zip(cells["mixed"], cells["base"])])
        rows.append(row)
        print(f"{batch:>5} | {med['base'][0]:>9.1f} {med['base+lora'][0]:>9.1f} {med['mixed'][0]:>9.1f}       | "
              f"{row['ratio_decode']:>9.2f}x | {med['base'][1]:>9.1f} {med['mixed'][1]:>9.1f} "
              f"{row['ratio_e2e']:>5.2f}x")
        print(f"      each repeat's mixed / base: {' '.join(f'{r:.2f}x' for r in row['ratios_decode'])}")
    punica = lora_engine.runner.lora_manager.punica
    print(f"LoRA rows: {'kernels/lora.py on ' + punica.kernel_backend if punica.kernel_backend else 'MLX products'}"
          f"{', sibling projections in one launch' if punica.kernel_backend and punica.share_launches else ''}")
    for label, engine in (("base", base_engine), ("lora", lora_engine)):  # replayed steps skip the Python
        compiled = engine.runner.compiled_decode
        keys = list(compiled.fns) if compiled is not None else []
        print(f"{label} engine: {len(keys)} compiled decode traces kept"
              f"{'' if compiled is not None else ' (compiled decode steps off)'}, "
              f"{sum(k[-1] is not None for k in keys)} of them with adapter rows")
    if args.json:
        meta = dict(model=name, device=str(mx.default_device()), machine=platform.machine(), rank=args.rank,
                    num_adapters=args.num_adapters, keys=args.keys, num_layers=args.num_layers,
                    prompt_len=args.prompt_len, gen_len=args.gen_len,
                    repeats=args.repeats)
        Path(args.json).write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
