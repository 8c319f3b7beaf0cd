#!/usr/bin/env bash
# Run 47 (planned for the next session): what the thirteenth session built without a GPU left to measure,
# one PART a call after staging (../shared/gpu/README.md), each within a call's 600 s; logs under $OUT:
#   PART=spec    verifying steps as decode rows (attention_metadata.decode_token_rows), compiled: the draft
#                pair against mlx-lm's speculative_generate_step (issue 28's 1.3x; run 42: 1.03x), the
#                oracle n-gram case at batch 1 and 64 (run 42: 2.05x generate_step, 1.07x), then the tests
#                of speculation and compiled steps on the real kernels
#   PART=lora    mixed adapters at 64 against the base (issue 29's 0.8x; run 46: 0.69x; since then y's loads
#                issued with B's, prefill steps of > 512 rows on MLX's products) and the op study, whose
#                'kernel 0' (no adapter rows) tells launch and dispatch from the products: if it is near the
#                kernel's ~15 us, one launch for the projections that share an input (q/k/v, gate/up) is next
source "$(dirname "$0")/lib.sh"
SUITE="env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider"  # (addopts has -q too: -qq prints no summary)
case "${PART:-spec}" in
  spec)
    TAIL=8 run spec_draft 300 python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft q8 --k 4 \
      --rounds 3 --prompts 2 --max-tokens 96 --kv-cache-gb 4
    TAIL=4 run spec_oracle 160 python3 scripts/bench/bench_spec.py preset:llama-8b --dtype bfloat16 --oracle 0.07 \
      --batch 1 64 --rounds 3 --max-tokens 96 --mlx-lm \
      --spec '{"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 8}'
    TAIL=6 run pytest_spec 200 $SUITE -k "not smollm" tests/test_spec_decode.py tests/test_spec_draft_model.py \
      tests/test_compiled_decode.py;;
  lora)
    TAIL=3 run lora_64 200 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
      --repeats 3 --json "$OUT/lora_64.json"
    TAIL=12 run lora_ops 120 python3 scripts/bench/study_lora_ops.py;;
  lora_device)  # (run 47's lora part found 'kernel 0' = 'kernel', ~14 us an op: the host's Python or the device's?)
    TAIL=12 run lora_ops_compiled 150 python3 scripts/bench/study_lora_ops.py --compile
    TAIL=5 run lora_64 200 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 \
      --repeats 3 --json "$OUT/lora_64.json";;
esac
