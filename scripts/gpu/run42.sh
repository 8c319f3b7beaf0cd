#!/usr/bin/env bash
# Run 42 (2026-12-04): what issues 26, 28 and 29 still need from the H200, one PART a call (staging:
# ../shared/gpu/README.md). Each command has its own limit; logs under $OUT, a summary line each.
#   PART=quant  the quantized kernels' GPU tests (tensor-core decode, in-place write) and decode speed
#   PART=host   batch 1 on the Gemma-3 / Qwen3.5 presets (compiled steps: the default), the MoE dispatch
#               study, the LoRA products op by op, the mixed-adapter LoRA batch at 64
#   PART=suite  busy == solo on the GPU (every family, kernels on, compiled small steps), TF32 off
#   PART=spec   n-gram at Llama-8B shape with drafts from the plain answer at SmolLM2's measured acceptance
#               (batch 1 against generate_step; batch 64 at the default off-switch), a q8 draft model
#               against mlx-lm's speculative_generate_step on the same pair
source "$(dirname "$0")/lib.sh"
case "${PART:-quant}" in
  quant)
    TAIL=6 run pytest_kv_quant 150 python3 -m pytest -q -rf -x -p no:cacheprovider tests/test_gpu_kv_quant.py \
      -k "default or page_write"
    run kv_quant_speed 300 python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --batch 64 256 \
      --context 2048 --steps 12;;
  host)
    for p in gemma3-27b-16l qwen3.5-27b-16l; do
      TAIL=3 run "batch1-$p" 150 python3 scripts/bench/bench_offline.py --preset "$p" --dtype bfloat16 --batch-sizes 1 \
        --repeats 5 --json "$OUT/batch1-$p.json"
    done
    TAIL=4 run moe_host 90 python3 scripts/bench/study_moe_host.py --runs 20
    TAIL=8 run lora_ops 90 python3 scripts/bench/study_lora_ops.py
    TAIL=3 run lora_64 170 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
      --repeats 1 --json "$OUT/lora_64.json";;
  suite)
    TAIL=6 run pytest_suite ${SUITE_S:-240} env MLX_ENABLE_TF32=0 python3 -m pytest -q -rf -p no:cacheprovider \
      tests/test_batched_equals_solo.py tests/test_state_layers.py tests/test_hybrid_attention.py \
      tests/test_compiled_decode.py $(ls tests/test_spec_decode_state.py 2>/dev/null) -k "not llama_tied";;
  spec)
    TAIL=4 run spec_oracle_llama8b 200 python3 scripts/bench/bench_spec.py preset:llama-8b --dtype bfloat16 --oracle 0.07 --batch 1 64 \
      --rounds 3 --max-tokens 96 --mlx-lm \
      --spec '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}'
    TAIL=8 run spec_draft 220 python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft q8 --k 4 \
      --rounds 3 --prompts 2 --max-tokens 96 --kv-cache-gb 4;;
esac
