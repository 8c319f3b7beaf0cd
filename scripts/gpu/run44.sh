#!/usr/bin/env bash
# Run 44 (planned for the next session): what runs 42-43 left unmeasured, one PART a call after staging
# (../shared/gpu/README.md), each within a call's 600 s; logs under $OUT. In this order:
#   PART=lora    the LoRA engine with compiled steps and the rewritten kernel shrink: mixed adapters at 64
#                against the base (issue 29's 0.8x), and the products op by op with the kernel beside them
#   PART=qwen    the Qwen3.5-27B shape at 256, compiled steps against built, no peer (compiled for state
#                models: --compile-decode; if it wins, CompiledDecode.larger can include them), then the MoE
#                host study
#   PART=suite1  busy == solo on the GPU, plain and hybrid attention, compiled steps, LoRA through its kernel
#   PART=suite2  state layers, and speculation on recurrent targets (rollback through spare slots)
#   PART=kv      quantized pages at 256 and the larger batch that fits in bf16's memory
source "$(dirname "$0")/lib.sh"
SUITE="env MLX_ENABLE_TF32=0 python3 -m pytest -q -rf -p no:cacheprovider"
case "${PART:-lora}" in
  lora)
    TAIL=3 run lora_64 200 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
      --repeats 1 --json "$OUT/lora_64.json"
    TAIL=9 run lora_ops 90 python3 scripts/bench/study_lora_ops.py;;
  qwen)
    for mode in --compile-decode --no-compile-decode; do
      TAIL=3 run "qwen_256$mode" 200 python3 scripts/bench/bench_offline.py --preset qwen3.5-27b-16l --dtype bfloat16 \
        --batch-sizes 256 --repeats 1 --skip-peer "$mode" --json "$OUT/qwen_256$mode.json"
    done
    TAIL=4 run moe_host 120 python3 scripts/bench/study_moe_host.py --runs 20;;
  suite1)
    TAIL=6 run pytest_suite1 560 $SUITE tests/test_batched_equals_solo.py tests/test_hybrid_attention.py \
      tests/test_compiled_decode.py tests/test_lora.py -k "not llama_tied";;
  suite2)
    TAIL=6 run pytest_suite2 560 $SUITE tests/test_state_layers.py tests/test_spec_decode_state.py;;
  kv)
    TAIL=12 run kv_256 500 python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --batch 256 \
      --context 2048 --steps 6;;
esac
