#!/usr/bin/env bash
# Run 43 (2026-12-04): compiled large decode steps (hot keys), the batched LoRA kernel (kernels/lora.py) and
# speculation on recurrent targets on the H200, then quantized pages at 256. One call after staging
# (../shared/gpu/README.md); logs under $OUT.
#   offline_*  batch 256 end to end with the default compiled steps against BatchGenerator, and pagedmlx
#              with --no-compile-decode (Qwen3.5-27B shape and Llama-8B)
#   lora_ops   the LoRA products op by op, the kernel beside them (Llama-8B projections, 64 rows)
#   lora_64    4 mixed adapters at batch 64 against the base model (bench_lora.py)
#   pytest_*   test_lora (the kernel's engine against mlx-lm, float32) and test_spec_decode_state on CUDA
#   kv_256     quantized pages at batch 256 and the batch that fits in bf16's memory
source "$(dirname "$0")/lib.sh"
for p in qwen3.5-27b-16l llama-8b; do
  peer=$([ "$p" = llama-8b ] && echo --skip-peer)
  TAIL=3 run "offline_$p" 150 python3 scripts/bench/bench_offline.py --preset "$p" --dtype bfloat16 --batch-sizes 256 \
    --repeats 1 $peer --json "$OUT/offline_$p.json"
  TAIL=3 run "offline_${p}_built" 100 python3 scripts/bench/bench_offline.py --preset "$p" --dtype bfloat16 \
    --batch-sizes 256 --repeats 1 --skip-peer --no-compile-decode --json "$OUT/offline_${p}_built.json"
done
TAIL=9 run lora_ops 60 python3 scripts/bench/study_lora_ops.py
TAIL=3 run lora_64 120 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
  --repeats 1 --json "$OUT/lora_64.json"
TAIL=4 run pytest_lora 120 env MLX_ENABLE_TF32=0 python3 -m pytest -q -rf -x -p no:cacheprovider tests/test_lora.py -k busy
TAIL=4 run pytest_spec_state 150 env MLX_ENABLE_TF32=0 python3 -m pytest -q -rf -p no:cacheprovider \
  $(ls tests/test_spec_decode_state.py 2>/dev/null)
TAIL=12 run kv_256 150 python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --batch 256 --context 2048 \
  --steps 6
