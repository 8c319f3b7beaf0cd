#!/usr/bin/env bash
# The quantized checkpoints' figures of docs/benchmarks.md on the GPU machine (after scripts/gpu/env.sh), in parts
# that each fit one call (600 s) of one warm machine; a table at the end of each. Logs and files under $OUT.
#   PART=tune bash scripts/gpu/quantized.sh    the quantized GEMM's launch sweep (BITS, default "4 8"): its tuned
#                                              config written to $PAGEDMLX_TUNED_CONFIG_FOLDER (default /tmp/tuned),
#                                              which the other parts read, and to $OUT/configs (copy it into
#                                              pagedmlx/kernels/configs/ and commit it)
#   PART=bench bash scripts/gpu/quantized.sh   4-bit Llama-8B with the tuned config (if any) at 64 and 1, beside
#                                              BatchGenerator and generate_step
#   PART=b1 bash scripts/gpu/quantized.sh      4-bit Llama-8B at batch 1 with its one-row products left to MLX
#   PART=bench256 bash scripts/gpu/quantized.sh  the same at 256 (BatchGenerator too), then bf16 at 64 and 256
#   PART=shapes bash scripts/gpu/quantized.sh  8-bit against bf16 at 64, 4-bit Gemma-4-E4B at 128
#   PART=moe bash scripts/gpu/quantized.sh     the fused MoE kernel against gather_qmm (bench_fused_moe.py), the 4-bit
#                                              Qwen3.6-35B-A3B shape at 1 and 64 with the kernel and without
#   PART=profile bash scripts/gpu/quantized.sh the steps split into kernels (profile_step --kernels): the 4-bit
#                                              Qwen3.6-35B-A3B shape at 64 and 1, bf16 Llama-8B at 64
# A first call on a fresh machine also pays for its kernels' builds (the start-up lines say how long).
set -u
OUT=${OUT:-/tmp/quantized}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PAGEDMLX_CACHE_DIR=${PAGEDMLX_CACHE_DIR:-/tmp/pcache}
export PAGEDMLX_TUNED_CONFIG_FOLDER=${PAGEDMLX_TUNED_CONFIG_FOLDER:-/tmp/tuned}
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
stop_gpu() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 "$p" 2>/dev/null; done; }
offline() {  # name, timeout, bench_offline.py's flags...: its decode rows and start-up line, from a process of its own
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -u scripts/bench/bench_offline.py --dtype bfloat16 --prompt-len 128 "$@" \
    > "$OUT/$name.log" 2>&1 || echo "$name: exit $? (log: $OUT/$name.log)"
  stop_gpu
  grep -o "engine start-up [0-9.]* s" "$OUT/$name.log" | head -1 | sed "s/^/$name: /"
  grep "B=[0-9]*: decode" "$OUT/$name.log" | sed "s/^ */$name: /"
  grep -A1 "^batch 1:" "$OUT/$name.log" | tr '\n' ' ' | sed "s/^./$name: &/"; echo
}
profile() {  # name, timeout, profile_step.py's flags...: its tables, the kernels by time last
  local name=$1 limit=$2; shift 2
  timeout "$limit" python3 -u scripts/bench/profile_step.py --dtype bfloat16 --kernels "$@" > "$OUT/profile-$name.log" \
    2>&1 || echo "$name: exit $? (log: $OUT/profile-$name.log)"
  stop_gpu
  grep -v Warn "$OUT/profile-$name.log" | tail -32
}
for part in ${PART:-bench}; do  # PART may name several: PART="tune bench"
case "$part" in
  tune)
    timeout "${LIMIT:-560}" python3 -u scripts/bench/bench_quantized_gemm.py --bits ${BITS:-4 8} --rows 1 16 64 256 \
      --repeats 1 --sweep --skip-mlx --write-config "$PAGEDMLX_TUNED_CONFIG_FOLDER" 2>&1 | tee "$OUT/sweep.log" \
      | grep -v Warn | cut -c1-220
    mkdir -p "$OUT/configs" && cp "$PAGEDMLX_TUNED_CONFIG_FOLDER"/*.json "$OUT/configs/" && ls "$OUT/configs" ;;
  bench)
    offline q4-tuned 250 --preset llama-8b --quantization 4bit --gen-len 256 --batch-sizes 64 1 --peer-max-batch 64 ;;
  b1)  # batch 1's one-row products on MLX's quantized matmul instead of ours
    PAGEDMLX_QUANTIZED_GEMM_MIN_ROWS=2 offline q4-b1-mlx 120 --preset llama-8b --quantization 4bit --gen-len 256 \
      --batch-sizes 1 --skip-peer ;;
  bench256)
    # BatchGenerator at 256 rows takes ~0.9 s a step (its (B, 1, D) products): 64 new tokens, a run of its own
    offline q4-256 150 --preset llama-8b --quantization 4bit --gen-len 64 --batch-sizes 256 --peer-max-batch 256
    offline bf16 80 --preset llama-8b --gen-len 256 --batch-sizes 64 256 --skip-peer ;;
  shapes)
    offline q8 100 --preset llama-8b --quantization 8bit --gen-len 256 --batch-sizes 64 --skip-peer
    offline bf16-64 60 --preset llama-8b --gen-len 256 --batch-sizes 64 --skip-peer
    offline gemma4 140 --preset gemma4-e4b --quantization 4bit --gen-len 128 --batch-sizes 128 --peer-max-batch 128 ;;
  moe)
    # a MoE layer's experts through the fused MoE kernel against gather_qmm, then the 4-bit MoE shape with the kernel
    # (and mlx-lm beside it), then with MLX's gather_qmm
    timeout 150 python3 -u scripts/bench/bench_fused_moe.py --tokens 1 8 64 256 2>&1 | grep -v Warn | tee "$OUT/fused_moe.log"
    stop_gpu
    offline moe-fused 300 --preset qwen3.6-35b-a3b-16l --quantization 4bit --gen-len 128 \
      --batch-sizes 64 1 --peer-max-batch 64
    grep -m1 -o "MoE experts: fused MoE kernel in [0-9]* layers\|MoE experts left to MLX's gather_qmm.*" \
      "$OUT/moe-fused.log" || echo "moe-fused: the log does not say whether the fused MoE kernel ran"
    PAGEDMLX_FUSED_MOE=0 offline moe-gather 120 --preset qwen3.6-35b-a3b-16l --quantization 4bit --gen-len 128 --batch-sizes 64 1 \
      --skip-peer ;;
  profile)
    profile moe-64 150 --preset qwen3.6-35b-a3b-16l --quantization 4bit --batch 64
    profile bf16-64 110 --preset llama-8b --batch 64
    profile moe-1 120 --preset qwen3.6-35b-a3b-16l --quantization 4bit --batch 1 ;;
  *) echo "PART is tune, bench, b1, bench256, shapes, moe or profile"; exit 2 ;;
esac
done
date -u
