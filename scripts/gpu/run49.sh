#!/usr/bin/env bash
# Run 49 (2026-12-04): the mixed-adapter batch at 64 three ways on one machine (run 48's H200 ran the base
# 1.6x slower than run 47's, so ratios are compared within a call only): sibling launches (default), one
# launch a projection, and mlx_lm.lora's default adapters (rank 8 on the last 16 layers); logs under $OUT
source "$(dirname "$0")/lib.sh"
B="python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 --repeats 3"
TAIL=6 run lora_64_siblings 150 $B --json "$OUT/lora_64_siblings.json"
TAIL=6 run lora_64_separate 150 $B --separate-launches --json "$OUT/lora_64_separate.json"
TAIL=6 run lora_64_r8_l16 150 $B --rank 8 --num-layers 16 --json "$OUT/lora_64_r8_l16.json"
