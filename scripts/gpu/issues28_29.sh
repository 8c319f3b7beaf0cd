#!/usr/bin/env bash
# Issues 28 and 29 on the GPU machine (see ../shared/gpu/README.md for staging; the default model's GGUF
# must be in ~/.cache/pagedmlx for PART=spec). PART=kv: the quantized-page kernel tests, decode speed of
# int8 / int4 pages against bf16 at 64 and 256 and the batch that fits, and the mixed-adapter LoRA batch
# at 64. PART=spec: n-gram speculation on the default model (a real model: SmolLM2) against
# generate_step, and a draft model against mlx-lm's speculative_generate_step on the same pair.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  timeout "$secs" "$@" 2>&1 | grep -v Warning > "$OUT/$name.txt"; echo "== $name (rc ${PIPESTATUS[0]})"; tail -16 "$OUT/$name.txt"
}
case "${PART:-kv}" in
  kv)
    run pytest_kv_quant 120 python3 -m pytest -q -rf -p no:cacheprovider tests/test_gpu_kv_quant.py
    run kv_quant_speed 300 python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --batch 64 256 --context 2048
    run lora_64 150 python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 --repeats 1 \
      --json "$OUT/lora_64.json";;
  spec)
    run spec_ngram 240 python3 scripts/bench/bench_spec.py --batch 1 4 64 --rounds 3 --mlx-lm
    run spec_draft 300 python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft q8 --k 4 --rounds 3 \
      --prompts 4 --max-tokens 128 --kv-cache-gb 4;;
esac
