"""Where an engine's start-up goes: LLMEngine built on a random preset model under cProfile, the runner's start-up
lines timestamped, then the functions that took longest (cumulative, ours and MLX's calls).

    python scripts/bench/profile_startup.py --preset llama-8b --dtype bfloat16 [--quantization 4bit] [--no-skinny-gemm]
        [--top 30]
"""

from __future__ import annotations

import argparse
import cProfile
import logging
import pstats
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from pagedmlx.bench.presets import PRESETS, parse_quantization, random_model  # noqa: E402
from pagedmlx.config import EngineConfig  # noqa: E402
from pagedmlx.engine.llm_engine import LLMEngine  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="llama-8b", choices=sorted(PRESETS))
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--quantization", help="the preset's weights quantized as bench_offline.py's flag: 4bit, 8bit, ...")
    ap.add_argument("--skinny-gemm", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(relativeCreated)8.0f ms %(name)s: %(message)s")
    t = time.perf_counter()
    model = random_model(args.preset, getattr(mx, args.dtype), quantization=parse_quantization(args.quantization))
    mx.eval(model.parameters())
    print(f"model built and evaluated in {time.perf_counter() - t:.1f} s", flush=True)
    config = EngineConfig(num_blocks=256, max_num_seqs=args.max_num_seqs, max_num_batched_tokens=2048,
                          max_model_len=1024, enable_prefix_caching=False, skinny_gemm=args.skinny_gemm)
    profile = cProfile.Profile()
    t = time.perf_counter()
    profile.enable()
    LLMEngine(model, None, config)
    profile.disable()
    print(f"engine start-up {time.perf_counter() - t:.1f} s (skinny_gemm {args.skinny_gemm})")
    pstats.Stats(profile).sort_stats("cumulative").print_stats(args.top)


if __name__ == "__main__":
    main()
