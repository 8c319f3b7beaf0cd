#!/usr/bin/env bash
# Issue 26 on the GPU machine, one call: which kernels each family's load-time check accepts (every test
# family, and the real-width presets), the GPU-only model-check test, then the family presets against
# mlx-lm (batch 64 / 256 end to end; Gemma's 8 x 8k prefill). Logs under $OUT (default gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
MLX_ENABLE_TF32=0 python3 scripts/gpu/check_families.py --presets gemma4-e2b-16l gemma3-27b-16l qwen3.5-27b-16l \
  2>&1 | grep -v Warning | tee "$OUT/check_families.txt" | grep -A5 "disagreed\|^[a-z].*\[" | tail -80
MLX_ENABLE_TF32=0 timeout 300 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_model_check.py \
  tests/test_split_head.py > "$OUT/pytest_model_check.txt" 2>&1; tail -5 "$OUT/pytest_model_check.txt"
if [ -n "${BENCH:-}" ]; then
  python3 scripts/bench/bench_prefill.py --preset gemma3-27b-16l --dtype bfloat16 --cases 8x8k \
    --json "$OUT/prefill_gemma3.json" 2>&1 | tee "$OUT/prefill_gemma3.txt" | tail -12
  python3 scripts/bench/bench_offline.py --preset gemma3-27b-16l --dtype bfloat16 --batch-sizes 64 256 --repeats 1 \
    --json "$OUT/offline_gemma3.json" 2>&1 | tee "$OUT/offline_gemma3.txt" | tail -8
  python3 scripts/bench/bench_offline.py --preset qwen3.5-27b-16l --dtype bfloat16 --batch-sizes 64 256 --repeats 1 \
    --json "$OUT/offline_qwen35.json" 2>&1 | tee "$OUT/offline_qwen35.txt" | tail -8
  python3 scripts/bench/bench_offline.py --preset qwen3.6-35b-a3b-16l --dtype bfloat16 --batch-sizes 64 --repeats 1 \
    --json "$OUT/offline_qwen36.json" 2>&1 | tee "$OUT/offline_qwen36.txt" | tail -8
  python3 scripts/bench/bench_offline.py --preset gemma4-e2b-16l --dtype bfloat16 --batch-sizes 64 256 --repeats 1 \
    --json "$OUT/offline_gemma4.json" 2>&1 | tee "$OUT/offline_gemma4.txt" | tail -8
fi
