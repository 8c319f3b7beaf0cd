#!/usr/bin/env bash
# Run 54 (2026-12-04, sixteenth session), one PART a call after staging (../shared/gpu/README.md); logs under $OUT:
#   PART=kv      nvcc compiles the sources; the GPU kv-quant tests: the quantized tensor-core decode with its
#                cheaper dequantization (int4 and fp16 int8 from magic bit patterns, two channels an
#                instruction; bf16 int8 by byte permute), and (seventeenth session) the page write that
#                quantizes the rows itself (against mx.quantize, bit for bit) and the prefill kernel over
#                quantized pages
#   PART=kvspeed decode steps at 64 (each format also with mx.quantize + the copying write) and 256 against
#                bf16 pages (run 42/43's command); the prefill kernel over int8 pages against SDPA and 16 bits
#   PART=kvrotate (eighteenth session) kv_cache_rotate's cost: decode steps at 64 and 256, each quantized
#                format plain and rotated (4 more products a layer: keys, values, queries, output)
#   PART=merge   merged q/k/v and gate/up projections (runner/merged_linear.py, on by default on the GPU): a
#                step's ops, batch 1 and 64 against mlx-lm merged and not
#   PART=mergetests  the merged tests, busy == solo and compiled steps on the GPU (merged by default there),
#                and the MTP tests (seventeenth session)
#   PART=draft   run 53's draft pairs (now merged) against mlx-lm's speculative; the adaptive k at tail 0.02
#   PART=lookup  (eighteenth session) a draft model that looks the context up too (prompt_lookup): SmolLM2
#                bf16 rewriting given passages with its 10-layer draft (tail 0.02), and the Llama-8B pair at
#                tail 0.02 on chat prompts (where little repeats: never slower than the draft alone)
#   PART=mtp     what an MTP round costs on the Qwen3.5 shape (a random module: drafts rejected)
#   PART=lora    bench_lora at 64, mlx_lm.lora's default adapters (rank 8, last 16 layers): both engines merged
#                (the default; the LoRA kernel reads merged parts in place), neither (as run 52), the rank-16
#                adapters on every layer merged; then tests/test_lora.py on the GPU
source "$(dirname "$0")/lib.sh"
SUITE=(env MLX_ENABLE_TF32=0 python3 -m pytest -o addopts= -q -rf -p no:cacheprovider -k "not smollm")
KV="python3 scripts/bench/bench_kv_quant.py --speed --preset llama-8b --context 2048"
OFF="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 128 --gen-len 128"
B="python3 scripts/bench/bench_lora.py --preset llama-8b --dtype bfloat16 --batch-sizes 64 --repeats 3 --gen-len 128 --rank 8 --num-layers 16"
D="python3 scripts/bench/bench_draft.py preset:llama-8b --dtype bfloat16 --draft layers:4 --k 4 --rounds 3 --max-tokens 96 --kv-cache-gb 4 --prompts 2"
case "${PART:-kv}" in
  kv)
    TAIL=4 run cuda_sources 150 "${SUITE[@]}" tests/test_cuda_sources.py
    TAIL=4 run pytest_kv_quant 200 "${SUITE[@]}" -x tests/test_gpu_kv_quant.py -k "default or page_write"
    TAIL=4 run pytest_kv_prefill 200 "${SUITE[@]}" -x tests/test_gpu_kv_quant.py -k prefill;;
  kvspeed)
    TAIL=10 run kv_64 200 $KV --batch 64 --steps 12 --compare-write
    TAIL=8 run kv_256 150 $KV --batch 256 --steps 6
    TAIL=12 run kv_prefill 150 python3 scripts/bench/bench_prefill_attention.py --kv-cache-dtype int8 \
      --cases "mixed: 256 at 16k" "mixed: 256 at 2k" "32x4k: 32 x 256 at 2k";;
  kvrotate)
    TAIL=12 run kv_rotate_64 250 $KV --batch 64 --steps 12 --rotate
    TAIL=10 run kv_rotate_256 250 $KV --batch 256 --steps 6 --rotate;;
  merge)
    TAIL=12 run ops_merged 100 python3 scripts/bench/study_step_ops.py --preset llama-8b --dtype bfloat16
    TAIL=10 run offline_merged 200 $OFF --batch-sizes 1 64 --repeats 3 --json "$OUT/offline_merged.json"
    TAIL=10 run offline_separate 200 $OFF --batch-sizes 1 64 --repeats 3 --no-merge-projections --json "$OUT/offline_separate.json";;
  mergetests)
    TAIL=4 run pytest_merged 450 "${SUITE[@]}" tests/test_merged_linear.py tests/test_batched_equals_solo.py tests/test_compiled_decode.py tests/test_spec_mtp.py;;
  draft)
    TAIL=9 run draft_exact 170 $D --target-tail-scale 0
    TAIL=9 run draft_tail002 150 $D --target-tail-scale 0.02
    TAIL=9 run draft_exact_separate 170 $D --target-tail-scale 0 --no-merge-projections;;
  lookup)
    TAIL=11 run lookup_smollm_quote 200 python3 scripts/bench/bench_draft.py --dtype bfloat16 --workload quote \
      --draft layers:10 --target-tail-scale 0.02 --lookup 3 --k 3 --rounds 3 --max-tokens 96 --prompts 4
    TAIL=11 run lookup_llama8b_chat 250 $D --target-tail-scale 0.02 --lookup 3;;
  mtp)
    TAIL=9 run mtp_cost 300 python3 scripts/bench/bench_mtp.py preset:qwen3.5-27b-16l --dtype bfloat16 --k 2 \
      --rounds 3 --max-tokens 96 --prompts 2;;
  lora)
    TAIL=5 run lora_64_merged 150 $B --json "$OUT/lora_64_merged.json"
    TAIL=5 run lora_64_separate 150 $B --no-merge-projections --json "$OUT/lora_64_separate.json"
    TAIL=5 run lora_64_r16_all_merged 150 $B --rank 16 --num-layers -1 --json "$OUT/lora_64_r16_all_merged.json"
    TAIL=4 run pytest_lora 120 "${SUITE[@]}" tests/test_lora.py;;
esac
