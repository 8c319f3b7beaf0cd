#!/usr/bin/env bash
# Served against offline on the GPU machine (issue 25): a random Llama-8B-shaped bf16 model with
# SmolLM2's tokenizer, 128-token prompts, 256 new tokens, greedy, ignore_eos.
#   STAGE=offline: build the model folder, then `pagedmlx bench throughput` at batch 64 and 256;
#   STAGE=serve:   `pagedmlx serve` (engine core in its own process, then in a thread) under
#                  `pagedmlx bench serve` at 64 and 256 clients, then mlx_lm.server at 64.
# Staging: scripts/gpu/stage.sh (then source scripts/gpu/env.sh in call two); call one also parks SmolLM2's tokenizer:
#   bash .gpu/a/recv.sh && bash scripts/gpu/park_extra.sh && cp -r .gpu/a/tok /root/gpu-parts/    (after export_mlx_model.py --tokenizer-only default .gpu/a/tok)
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
M=${M:-/tmp/llama8b}
PM="python3 -m pagedmlx.cli"
LENS="--random-input-len 128 --random-output-len 256"
N64=${N64:-256}; N256=${N256:-512}

wait_up() {  # port, pid
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/health" >/dev/null 2>&1 && return 0
    kill -0 "$2" 2>/dev/null || return 1
    sleep 0.5
  done
  return 1
}

if [ "${STAGE:-offline}" = offline ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/machine.txt"
  [ -f "$M/config.json" ] || python3 scripts/export_mlx_model.py "preset:${PRESET:-llama-8b}" "$M" --dtype bfloat16 \
    --tokenizer "${TOK:-/root/gpu-parts/tok}" 2>&1 | tail -1
  for b in 64 256; do
    n=$([ $b = 64 ] && echo $N64 || echo $N256)
    $PM bench throughput "$M" --input-len 128 --output-len 256 --num-prompts "$n" --max-num-seqs $b \
      --kv-cache-gb ${KVGB:-24} --temperature 0 --disable-tqdm --output-json "$OUT/offline$b.json" 2>&1 | tail -2 | tee "$OUT/offline$b.txt"
  done
  exit 0
fi

serve_run() {  # name, extra serve args...
  local name=$1; shift
  $PM serve "$M" --port 8000 --max-num-seqs 256 --kv-cache-gb ${KVGB:-24} "$@" > "$OUT/serve-$name.log" 2>&1 &
  local pid=$!
  wait_up 8000 $pid || { echo "$name: the server did not start"; tail -20 "$OUT/serve-$name.log"; return 1; }
  for b in ${CLIENTS:-64 256}; do
    n=$([ $b = 64 ] && echo $N64 || echo $N256)
    $PM bench serve --port 8000 $LENS --num-prompts "$n" --max-concurrency $b --ignore-eos --num-warmups 2 \
      --num-processes ${PROCS:-4} --disable-tqdm --save-result --result-dir "$OUT" \
      --result-filename "serve-$name-$b.json" > "$OUT/serve-$name-$b.txt" 2>&1
    grep -E "Successful|Failed|Output token|Median TTFT|P90 TTFT|Median ITL|P90 ITL|Client busy" "$OUT/serve-$name-$b.txt" \
      | sed "s/^/$name $b: /"
  done
  kill -TERM $pid; wait $pid; echo "$name: server exit $?"
}

serve_run process
[ -n "${SKIP_THREAD:-}" ] || CLIENTS=256 serve_run thread --no-engine-process
if [ -z "${SKIP_PEER:-}" ]; then
  python3 -m mlx_lm server --model "$M" --port 8001 --decode-concurrency 64 > "$OUT/mlx_lm_server.log" 2>&1 &
  pid=$!
  for _ in $(seq 600); do curl -sf http://127.0.0.1:8001/v1/models >/dev/null 2>&1 && break; sleep 0.5; done
  $PM bench serve --port 8001 --model "$M" --tokenizer "$M" --text-prompts $LENS --num-prompts ${NPEER:-64} \
    --max-concurrency 64 --num-processes 2 --disable-tqdm --save-result --result-dir "$OUT" \
    --result-filename mlx_lm_server-64.json > "$OUT/mlx_lm_server-64.txt" 2>&1
  grep -E "Successful|Failed|Output token|Median TTFT|Median ITL" "$OUT/mlx_lm_server-64.txt" | sed "s/^/mlx_lm.server 64: /"
  kill $pid
fi
