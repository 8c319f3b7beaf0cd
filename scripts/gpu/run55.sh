#!/usr/bin/env bash
# Run 55's last call (2026-12-05, nineteenth session), after staging and the SmolLM2 GGUF put together in
# $PAGEDMLX_CACHE_DIR (its 98 MB travel in three pieces: .gpu/s1-s3, made by hand from the local cache):
#   the draft model + lookup on the real SmolLM2 (kept 4-bit on the GPU) rewriting given passages, with its
#   later layers x 0.02 (a good draft) and as it is (a poor one); the prefill kernel over int8 pages
#   (bench_prefill_attention, which failed before the fix in runner/attention.py); end to end at 64 on
#   int8 and 16-bit pages (the fix under a real schedule: any failed step stops bench_offline)
source "$(dirname "$0")/lib.sh"
Q="python3 scripts/bench/bench_draft.py --dtype bfloat16 --workload quote --draft layers:10 --lookup 3 --k 3 --rounds 3 --max-tokens 96 --prompts 4"
OFF="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 512 --gen-len 64 --batch-sizes 64 --skip-peer"
TAIL=11 run lookup_smollm_quote 170 $Q --target-tail-scale 0.02
TAIL=12 run kv_prefill 80 python3 scripts/bench/bench_prefill_attention.py --kv-cache-dtype int8 \
  --cases "mixed: 256 at 16k" "mixed: 256 at 2k" "32x4k: 32 x 256 at 2k"
TAIL=6 run offline_int8 100 $OFF --kv-cache-dtype int8
TAIL=6 run offline_auto 100 $OFF
TAIL=11 run lookup_smollm_real 120 $Q
