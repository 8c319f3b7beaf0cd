#!/usr/bin/env bash
# Issue 26 on the GPU machine. PART=check: which kernels each family's load-time check accepts (every test
# family in float32 and bfloat16, the real-width presets in bfloat16) and the GPU-only model-check test.
# PART=gemma / PART=qwen: the family presets against mlx-lm (batch 64 / 256 end to end; Gemma 3's 8 x 8k
# prefill; Gemma 4's shape). Each part fits one call. Logs under $OUT (default gpu-out).
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
offline() {  # preset, batch sizes...
  local p=$1; shift
  python3 scripts/bench/bench_offline.py --preset "$p" --dtype bfloat16 --batch-sizes "$@" --repeats 1 \
    --json "$OUT/offline_$p.json" 2>&1 | grep -v Warning | tee "$OUT/offline_$p.txt" | tail -9
}
case "${PART:-check}" in
  check)
    MLX_ENABLE_TF32=0 python3 scripts/gpu/check_families.py 2>&1 | grep -v Warning > "$OUT/check_families.txt"
    python3 scripts/gpu/check_families.py --dtypes bfloat16 --families \
      --presets gemma4-e2b-16l gemma3-27b-16l qwen3.5-27b-16l 2>&1 | grep -v Warning >> "$OUT/check_families.txt"
    grep -B1 -A5 "selected .*[^k]$" "$OUT/check_families.txt" | head -60; grep "disagreed" "$OUT/check_families.txt"
    MLX_ENABLE_TF32=0 timeout 240 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_model_check.py \
      tests/test_split_head.py > "$OUT/pytest_model_check.txt" 2>&1; tail -5 "$OUT/pytest_model_check.txt";;
  gemma)
    python3 scripts/bench/bench_prefill.py --preset gemma3-27b-16l --dtype bfloat16 --cases 8x8k \
      --json "$OUT/prefill_gemma3.json" 2>&1 | grep -v Warning | tee "$OUT/prefill_gemma3.txt" | tail -8
    offline gemma3-27b-16l 64 256
    offline gemma4-e2b-16l 64 256;;
  qwen)
    offline qwen3.5-27b-16l 64 256
    offline qwen3.6-35b-a3b-16l 64;;
esac
