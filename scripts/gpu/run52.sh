#!/usr/bin/env bash
# Run 52 (2026-12-04, fifteenth session): a draft model's drafts stay on the device (DeviceDrafts: the
# verifying step takes them as placeholder rows, one host sync a round), one PART a call after staging
# (../shared/gpu/README.md); logs under $OUT:
#   PART=draft   run 50's pairs again (Llama-8B, 4-layer draft, tail 0 and 0.02) against mlx-lm's speculative
#   PART=tests   tests/test_spec_draft_model.py (device drafts on the compiled CUDA path)
source "$(dirname "$0")/lib.sh"
SUITE=(env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider -k "not smollm")
D="python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 --k 4 --rounds 3 --prompts 2 --max-tokens 96 --kv-cache-gb 4"
case "${PART:-draft}" in
  draft)
    TAIL=9 run draft_exact 200 $D --target-tail-scale 0
    TAIL=9 run draft_tail002 150 $D --target-tail-scale 0.02;;
  tests)
    TAIL=6 run pytest_draft 330 "${SUITE[@]}" tests/test_spec_draft_model.py;;
esac
