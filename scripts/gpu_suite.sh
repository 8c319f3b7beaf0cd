#!/usr/bin/env bash
# Everything measured on the GPU machine in one call (see ../shared/gpu/README.md for staging).
# Writes logs and JSON under $OUT (or ./gpu-out); prints the tables at the end.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
BATCHES=${BATCHES:-"1 8 32 64 128 256"}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
python3 scripts/gpu_check_decode.py 2>&1 | tee "$OUT/kernel_check.txt"
python3 scripts/bench_attention.py 2>&1 | tee "$OUT/attention.txt"
python3 scripts/bench_offline.py --preset llama-8b --dtype bfloat16 --batch-sizes $BATCHES --roofline --ab-async \
  --json "$OUT/offline.json" 2>&1 | tee "$OUT/offline.txt"
