#!/usr/bin/env bash
# `pagedmlx serve MODEL` as a new user starts it, on the GPU machine (after scripts/gpu/env.sh): the time to a
# healthy server on a cold kernel cache and again on a warm one, then out tok/s and TTFT at CLIENTS concurrent
# clients with the default KV pool (sized by --gpu-memory-utilization) against --kv-cache-gb KV_GB; a table last.
# The model is written once as an mlx-lm folder (scripts/export_mlx_model.py) so that mlx_lm.server's start is
# timed on the very same files; "ready" is the first answered one-token completion, for both servers.
#   bash scripts/gpu/out_of_the_box.sh            MODEL (default preset:llama-8b), CLIENTS (256), KV_GB (30),
#                                                 STARTS_ONLY=1: no load, the start times only; MLX_STARTS:
#                                                 mlx_lm.server's starts (2); PREBUILD=1: a second first start
#                                                 (empty cache) with PAGEDMLX_PREBUILD=1
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/ootb}; mkdir -p "$OUT"
MODEL=${MODEL:-preset:llama-8b}; CLIENTS=${CLIENTS:-256}; KV_GB=${KV_GB:-30}; PORT=8011
export PAGEDMLX_CACHE_DIR=${PAGEDMLX_CACHE_DIR:-$OUT/cache}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader; date -u
DIR=${MODEL_DIR:-$OUT/model}  # MODEL_DIR: a folder kept between calls
[ -f "$DIR/config.json" ] || python3 scripts/export_mlx_model.py "$MODEL" "$DIR" --dtype bfloat16 > "$OUT/export.log" 2>&1 \
  || { tail -5 "$OUT/export.log"; exit 1; }
answered() {  # one-token completion answered by the server on $PORT
  python3 -c "import httpx,sys; r = httpx.post('http://127.0.0.1:$PORT/v1/completions', timeout=5,
    json={'model': '$DIR', 'prompt': 'Hi', 'max_tokens': 1}); sys.exit(r.status_code != 200)" 2>/dev/null
}
serve() {  # name, extra flags...: start on a port of its own, wait for an answer, record seconds
  local name=$1; shift
  PORT=$((PORT + 1))
  local t0=$(date +%s.%N)
  if [ "$name" = mlx-lm ]; then
    python3 -m mlx_lm server --model "$DIR" --port $PORT > "$OUT/$name.log" 2>&1 &
  else
    python3 -m pagedmlx.cli serve "$DIR" --served-model-name "$DIR" --port $PORT "$@" > "$OUT/$name.log" 2>&1 &
  fi
  SERVER=$!
  until answered; do
    kill -0 $SERVER 2>/dev/null || { echo "$name: server exited"; grep -v Warn "$OUT/$name.log" | tail -30; return 1; }
    sleep 0.5
  done
  echo "$name ready $(python3 -c "print(round($(date +%s.%N) - $t0, 1))") s" | tee -a "$OUT/ready.txt"
  grep -e "KV pool" -e "prebuil" -e "start-up:" "$OUT/$name.log" | cut -c1-240
  echo "$name: GPU memory by process: $(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tr '\n' ' ')"
}
stop() {  # the server and its engine-core process, then until the GPU has their memory back
  pkill -9 -P $SERVER 2>/dev/null; kill -9 $SERVER 2>/dev/null; wait $SERVER 2>/dev/null
  while [ -n "$(nvidia-smi --query-compute-apps=pid --format=csv,noheader)" ]; do sleep 0.5; done
}
load() {  # name
  timeout 240 python3 -m pagedmlx.cli bench serve --port $PORT --dataset-name random --random-input-len 100 \
    --random-output-len 64 --ignore-eos --num-prompts $((CLIENTS * 2)) --max-concurrency $CLIENTS --num-processes 4 \
    --disable-tqdm --save-result --result-dir "$OUT" --result-filename "$1.json" 2>&1 | tail -4
}
for _ in $(seq "${MLX_STARTS:-2}"); do serve mlx-lm && stop; done
serve cold && stop
if [ -n "${PREBUILD:-}" ]; then  # PREBUILD=1: a first start again, its builds beside the weights' read
  PAGEDMLX_PREBUILD=1 PAGEDMLX_CACHE_DIR=$PAGEDMLX_CACHE_DIR-prebuild serve cold-prebuild && stop
fi
if [ -n "${STARTS_ONLY:-}" ]; then serve warm && stop; else  # STARTS_ONLY=1: the start times only
  serve warm && load default && stop
  serve pool --kv-cache-gb "$KV_GB" && load pool && stop
fi
python3 - "$OUT" "$KV_GB" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
print(open(out / "ready.txt").read())
print(f"{'pool':>22} {'out tok/s':>10} {'TTFT p90 ms':>12} {'failed':>7}")
rows = {}
for name, label in (("default", "default (memory-sized)"), ("pool", f"--kv-cache-gb {sys.argv[2]}")):
    p = out / f"{name}.json"
    if p.exists():
        r = json.loads(p.read_text())
        rows[name] = r["output_throughput"]
        print(f"{label:>22} {r['output_throughput']:>10.0f} {r.get('p90_ttft_ms', float('nan')):>12.0f} "
              f"{r.get('failed', 0):>7}")
if len(rows) == 2:
    print(f"default / --kv-cache-gb: {rows['default'] / rows['pool']:.3f}")
PY
