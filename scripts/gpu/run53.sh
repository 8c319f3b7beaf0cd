#!/usr/bin/env bash
# Run 53 (planned for the next session; not run): what the fifteenth session built after its GPU time was
# spent, one PART a call after staging (../shared/gpu/README.md); logs under $OUT:
#   PART=draft   the adaptive k (spec_decode/drafter.py) on run 52's pairs, batch 1 (tail 0: k stays 4; tail
#                0.02: k falls to 1-2), then 4 prompts at a time against mlx-lm's one at a time
#   PART=tests   tests/test_compiled_decode.py and tests/test_spec_decode.py on the GPU
source "$(dirname "$0")/lib.sh"
SUITE=(env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider -k "not smollm")
D="python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 --k 4 --rounds 3 --max-tokens 96 --kv-cache-gb 4"
case "${PART:-draft}" in
  draft)
    TAIL=9 run draft_exact 170 $D --prompts 2 --target-tail-scale 0
    TAIL=9 run draft_tail002 150 $D --prompts 2 --target-tail-scale 0.02
    TAIL=9 run draft_exact_b4 220 $D --prompts 4 --batch 4 --target-tail-scale 0;;
  tests)
    TAIL=4 run pytest_compiled 250 "${SUITE[@]}" tests/test_compiled_decode.py
    TAIL=4 run pytest_spec 250 "${SUITE[@]}" tests/test_spec_decode.py;;
esac
