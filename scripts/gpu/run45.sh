#!/usr/bin/env bash
# Run 45: the LoRA kernel with a row's shrink done by fewer groups (kernels/lora.py tiles_for) and an
# expand four columns at a time: the products op by op at each tiling, then mixed adapters at 64 against
# the base (issue 29's 0.8x) at tiles_for's choice and at one group a row.
source "$(dirname "$0")/lib.sh"
LORA="scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 --repeats 3"
TAIL=12 run lora_ops 120 python3 scripts/bench/study_lora_ops.py
TAIL=3 run lora_64 200 python3 $LORA --json "$OUT/lora_64.json"
TAIL=3 run lora_64_t1 200 python3 -c "import runpy, sys; import pagedmlx.kernels.lora as k; k.tiles_for = lambda rows, out: 1
sys.argv = ['bench_lora.py'] + sys.argv[1:]; runpy.run_path('scripts/bench/bench_lora.py', run_name='__main__')" \
  ${LORA#scripts/bench/bench_lora.py } --json "$OUT/lora_64_t1.json"
