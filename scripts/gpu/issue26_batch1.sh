#!/usr/bin/env bash
# Issue 26: batch-1 decode against mlx-lm's generate_step on the three presets (median of five runs, each
# interleaved with a generate_step run), steps built (--no-compile-decode) and compiled (the default at batch
# 1); first the compiled-step check with the real kernels. MODES="compiled": that one only. Writes under $OUT.
#   PRESETS="gemma3-27b-16l" bash scripts/gpu/issue26_batch1.sh     # one preset a call (each ~2-4 min)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
PRESETS=${PRESETS:-"llama-8b gemma3-27b-16l qwen3.5-27b-16l"}
MLX_ENABLE_TF32=0 timeout 300 python3 -m pytest -q -rf -p no:cacheprovider tests/test_compiled_decode.py \
  2>&1 | tee "$OUT/compiled_decode_test.txt" | tail -3
for p in $PRESETS; do
  for mode in ${MODES:-built compiled}; do
    flag=$([ "$mode" = built ] && echo --no-compile-decode)
    python3 scripts/bench/bench_offline.py --preset "$p" --dtype bfloat16 --batch-sizes 1 --repeats 5 $flag \
      --json "$OUT/batch1-$p-$mode.json" > "$OUT/batch1-$p-$mode.txt" 2>&1
    echo "$p $mode: $(grep -A2 '^batch 1:' "$OUT/batch1-$p-$mode.txt" | tr -s ' \n' ' ')"
  done
done
