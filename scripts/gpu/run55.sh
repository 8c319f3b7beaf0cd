#!/usr/bin/env bash
# Run 55's last call (2026-12-05, nineteenth session), after staging and the SmolLM2 GGUF put together in
# $PAGEDMLX_CACHE_DIR (its 98 MB travel in three pieces, .gpu/s1-s3, cut by hand from the local cache), in
# order of what it closes:
#   the draft model + lookup on the real SmolLM2 (unpacked to bf16: kept 4-bit, its first call printed
#   nothing in 170 s, most likely MLX compiling quantized kernels per shape) rewriting given passages, its later
#   layers x 0.02 (a good draft); int8 pages' decode at 64 and 256 after bf16 int8's cheaper dequantization;
#   an int8 engine end to end at 64 (the prefill fix under a real schedule: a failed step stops
#   bench_offline); the prefill kernel over int8 pages; SmolLM2 as it is (a poor draft); bf16 pages end to end
source "$(dirname "$0")/lib.sh"
Q="python3 scripts/bench/bench_draft.py --dtype bfloat16 --dequantize --workload quote --draft layers:10 --lookup 3 --k 3 --rounds 3 --max-tokens 96 --prompts 4"
KV="python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --context 2048"
OFF="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 512 --gen-len 64 --batch-sizes 64 --skip-peer"
TAIL=11 run lookup_smollm_quote 170 $Q --target-tail-scale 0.02
TAIL=14 run kv_64_256 130 $KV --batch 64 256 --steps 8
TAIL=6 run offline_int8 100 $OFF --kv-cache-dtype int8
TAIL=12 run kv_prefill 80 python3 scripts/bench/bench_prefill_attention.py --kv-cache-dtype int8 \
  --cases "mixed: 256 at 16k" "mixed: 256 at 2k" "32x4k: 32 x 256 at 2k"
TAIL=11 run lookup_smollm_real 120 $Q
TAIL=6 run offline_auto 100 $OFF
