#!/usr/bin/env bash
# What run 55 (2026-12-05) left, one PART a call; logs under $OUT. Staging: ../shared/gpu/README.md, and for
# PART=lookup SmolLM2's GGUF too (scripts/gpu/stage_smollm.sh says which calls put it together).
#   PART=lookup  issue 28's draft-model figure: the draft model + lookup on SmolLM2 (unpacked to bf16), rewriting
#                given passages, its later layers x 0.02 (a good draft), then as it is (a poor one)
#   PART=int8    an int8 engine end to end at 64 (prefill through the quantized prefill kernel, which the
#                attention path skipped until the nineteenth session: any failed step stops bench_offline),
#                bf16 pages the same way, then the prefill kernel over int8 pages against SDPA and 16 bits
#   PART=kv      int8 / int4 decode at 64 and 256 against bf16 pages again (run 55's spread: int8 1.10-1.24x)
#   PART=lora    bench_lora at 64, mlx_lm.lora's default adapters and rank 16 on every layer
source "$(dirname "$0")/lib.sh"
Q="python3 scripts/bench/bench_draft.py --dtype bfloat16 --dequantize --workload quote --draft layers:10 --lookup 3 --k 3 --rounds 3 --max-tokens 96 --prompts 4"
OFF="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 512 --gen-len 64 --batch-sizes 64 --skip-peer"
B="python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 --repeats 3 --gen-len 128 --rank 8 --num-layers 16"
case "${PART:-lookup}" in
  lookup)
    TAIL=11 run lookup_smollm_quote 250 $Q --target-tail-scale 0.02
    TAIL=11 run lookup_smollm_real 200 $Q;;
  int8)
    TAIL=6 run offline_int8 150 $OFF --kv-cache-dtype int8
    TAIL=6 run offline_auto 150 $OFF
    TAIL=12 run kv_prefill 100 python3 scripts/bench/bench_prefill_attention.py --kv-cache-dtype int8 \
      --cases "mixed: 256 at 16k" "mixed: 256 at 2k" "32x4k: 32 x 256 at 2k";;
  kv)
    TAIL=14 run kv_64_256 200 python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --context 2048 \
      --batch 64 256 --steps 12;;
  lora)
    TAIL=5 run lora_64 200 $B --json "$OUT/lora_64.json"
    TAIL=5 run lora_64_r16_all 200 $B --rank 16 --num-layers -1 --json "$OUT/lora_64_r16_all.json";;
esac
