#!/usr/bin/env bash
# Run 46: the LoRA kernel reading 16 bytes a load (run 45 found it bound by L2 latency at 2 bytes a load):
# its load-time check in each dtype, the products op by op at each tiling, mixed adapters at 64 against
# the base (issue 29's 0.8x).
source "$(dirname "$0")/lib.sh"
TAIL=3 run lora_check 60 python3 -c "import mlx.core as mx; from pagedmlx.kernels import lora
print({str(dt): lora.check_add_lora('cuda', dt) for dt in (mx.float32, mx.bfloat16, mx.float16)})"
TAIL=12 run lora_ops 120 python3 scripts/bench/study_lora_ops.py
TAIL=3 run lora_64 200 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
  --repeats 3 --json "$OUT/lora_64.json"
