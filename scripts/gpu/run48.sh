#!/usr/bin/env bash
# Run 48 (2026-12-04): sibling projections (q/k/v, gate/up) in one LoRA launch (lora/layers.py,
# kernels/lora.py add_lora_siblings), after run 47 found each launch costs ~9 us of device time whatever
# it computes. One call after staging (../shared/gpu/README.md); logs under $OUT:
#   the op study compiled (its 'siblings' row against 'kernel'), the mixed-adapter batch at 64 against the
#   base (issue 29's 0.8x; run 47: 0.63x, 0.71x), then tests/test_lora.py on the GPU (its busy engines'
#   rows on the real kernel) and the compiled-decode tests run 47's call had no time left for
source "$(dirname "$0")/lib.sh"
SUITE="env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider"
TAIL=13 run lora_ops_compiled 150 python3 scripts/bench/study_lora_ops.py --compile
TAIL=6 run lora_64 200 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
  --repeats 3 --json "$OUT/lora_64.json"
TAIL=4 run pytest_lora 120 $SUITE tests/test_lora.py tests/test_compiled_decode.py
