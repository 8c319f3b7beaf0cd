#!/usr/bin/env bash
# Run 51 (2026-12-04, fifteenth session), one PART a call after staging (../shared/gpu/README.md); logs under $OUT:
#   PART=lora    study_lora_ops.py --compile with its 'empty' case (a custom kernel that does nothing: is the
#                ~9 us a launch MLX's dispatch?), then bench_lora at 64 with paired ratios (each mixed run against
#                the base run before it) for mlx_lm.lora's default adapters (rank 8, last 16 layers) and for
#                rank 16 on every layer, 128 tokens and 5 repeats each (run 49's 64 tokens x 3 drifted)
#   PART=draft   the exact draft pair of run 50 (Llama-8B, tail 0, 4-layer draft) with a profile of one more pass
#                of each speculative engine (where a round's host time goes)
#   PART=ops     study_step_ops.py: a batch-1 decode step's primitives, ours against mlx-lm's, by kind
#   PART=tests   the GPU tests no call had time for yet
source "$(dirname "$0")/lib.sh"
SUITE=(env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider -k "not smollm")
B="python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 --repeats 5 --gen-len 128"
D="python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 --k 4 --rounds 3 --prompts 2 --max-tokens 96 --kv-cache-gb 4"
case "${PART:-lora}" in
  lora)
    TAIL=15 run lora_ops_compiled 120 python3 scripts/bench/study_lora_ops.py --compile
    TAIL=6 run lora_64_r8_l16 170 $B --rank 8 --num-layers 16 --json "$OUT/lora_64_r8_l16.json"
    TAIL=6 run lora_64_r16_all 170 $B --json "$OUT/lora_64_r16_all.json";;
  draft)
    TAIL=75 run draft_exact_profile 300 $D --target-tail-scale 0 --profile 30;;
  ops)
    TAIL=40 run step_ops 200 python3 scripts/bench/study_step_ops.py --preset llama-8b --dtype bfloat16;;
  tests)
    TAIL=4 run pytest_lora 250 "${SUITE[@]}" tests/test_lora.py
    TAIL=4 run pytest_draft 250 "${SUITE[@]}" tests/test_spec_draft_model.py;;
esac
