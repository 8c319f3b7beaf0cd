#!/usr/bin/env bash
# Run 50 (planned for the next session): what runs 47-49 left unmeasured, one PART a call after staging
# (../shared/gpu/README.md); logs under $OUT:
#   PART=draft   issue 28's draft pair against mlx-lm's speculative_generate_step (1.3x), on a pair that can
#                pay: Llama-8B whose layers past the 4th add nothing (bench_draft.py --target-tail-scale 0)
#                with its first 4 layers as the draft (acceptance ~1, a draft 1/8 of the target), then a
#                tail of 0.02 (acceptance below 1); run 47's q8 copy was rejected too often for either engine
#   PART=lora    study_lora_ops.py --compile with its 'empty' case (a custom kernel that does nothing): if it
#                costs the ~9 us of 'kernel 0', MLX's dispatch of a custom kernel is the LoRA floor
#   PART=tests   the GPU tests run 47-48's calls had no time left for: draft-model speculation, compiled
#                steps (verifying steps as decode rows), and tests/test_lora.py (sibling launches on the real kernel)
source "$(dirname "$0")/lib.sh"
SUITE=(env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider -k "not smollm")
D="python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 --k 4 --rounds 3 --prompts 2 --max-tokens 96 --kv-cache-gb 4"
case "${PART:-draft}" in
  draft)
    TAIL=9 run draft_exact 260 $D --target-tail-scale 0
    TAIL=9 run draft_tail002 260 $D --target-tail-scale 0.02;;
  lora)
    TAIL=15 run lora_ops_compiled 150 python3 scripts/bench/study_lora_ops.py --compile;;
  tests)
    TAIL=4 run pytest_draft 200 "${SUITE[@]}" tests/test_spec_draft_model.py
    TAIL=4 run pytest_compiled 150 "${SUITE[@]}" tests/test_compiled_decode.py
    TAIL=4 run pytest_lora 220 "${SUITE[@]}" tests/test_lora.py;;
esac
