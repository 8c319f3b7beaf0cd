#!/usr/bin/env bash
# vLLM beside pagedmlx on the same card, shapes and workload (offline throughput, random weights, random prompts),
# each run its own process, one after the other; a table with the ratio last. On the GPU machine after MLX's staging
# (scripts/gpu/env.sh) and vLLM's three calls (../shared/gpu/vllm.md: vLLM installed in /tmp/vsite):
#   bash scripts/gpu/vllm_yardstick.sh     PRESETS (default "llama-8b llama-8b-4bit"), BATCHES ("64 256"),
#                                          INPUT_LEN (128), OUTPUT_LEN (256)
# vLLM runs a 4-bit preset as AWQ at the same group size (scripts/export_mlx_model.py --vllm-config: its Marlin
# kernels; embeddings and head stay 16-bit there, 4-bit here). Both tools are `bench throughput` with vLLM's flags
# and JSON, and both time the requests only (vLLM's torch.compile and CUDA graphs, and our load and checks, come
# before). Each run may take up to 280 s with its start: give one call (600 s) one preset and one batch size, e.g.
# PRESETS=llama-8b BATCHES=64, and run the script again for the others (the table reads every result in $OUT).
set -u
OUT=${OUT:-/tmp/yardstick}; mkdir -p "$OUT"
PRESETS=${PRESETS:-llama-8b llama-8b-4bit}; BATCHES=${BATCHES:-64 256}
INPUT_LEN=${INPUT_LEN:-128}; OUTPUT_LEN=${OUTPUT_LEN:-256}
export PYTHONUNBUFFERED=1 PAGEDMLX_CACHE_DIR=${PAGEDMLX_CACHE_DIR:-/tmp/pcache} HF_HUB_OFFLINE=1 VLLM_NO_USAGE_STATS=1
export VLLM_USE_DEEP_GEMM=0
MLX_PATH=/tmp/site:$PWD
TORCH_LIB=$(PYTHONPATH=/tmp/vsite python3 -c "import os, torch; print(os.path.join(os.path.dirname(torch.__file__), \
  '..', 'nvidia', 'cu13', 'lib'))" 2>/dev/null)
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
stop_gpu() { for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do kill -9 "$p" 2>/dev/null; done; }
flags() {  # batch: the workload both tools run
  echo --dataset-name random --random-input-len "$INPUT_LEN" --random-output-len "$OUTPUT_LEN" \
    --num-prompts $(($1 * 2)) --max-num-seqs "$1"
}
for preset in $PRESETS; do
  PYTHONPATH=$MLX_PATH python3 scripts/export_mlx_model.py --vllm-config "preset:$preset" "$OUT/$preset" \
    > /dev/null || exit 1
  for b in $BATCHES; do
    rm -f "$OUT/pagedmlx-$preset-$b.json" "$OUT/vllm-$preset-$b.json"  # a failed run leaves no older figure
    PYTHONPATH=$MLX_PATH timeout 280 python3 -m pagedmlx.cli bench throughput --model "preset:$preset" \
      --dtype bfloat16 $(flags "$b") --disable-tqdm --output-json "$OUT/pagedmlx-$preset-$b.json" \
      > "$OUT/pagedmlx-$preset-$b.log" 2>&1 || echo "pagedmlx $preset $b: exit $? ($OUT/pagedmlx-$preset-$b.log)"
    stop_gpu
    PYTHONPATH=/tmp/vsite LD_LIBRARY_PATH=$TORCH_LIB:${LD_LIBRARY_PATH:-} timeout 280 \
      python3 -m vllm.entrypoints.cli.main bench throughput --model "$OUT/$preset" --load-format dummy $(flags "$b") \
      --gpu-memory-utilization 0.85 --max-model-len $((INPUT_LEN + OUTPUT_LEN + 64)) \
      --output-json "$OUT/vllm-$preset-$b.json" > "$OUT/vllm-$preset-$b.log" 2>&1 \
      || echo "vllm $preset $b: exit $? ($OUT/vllm-$preset-$b.log)"
    stop_gpu; date -u
  done
done
python3 - "$OUT" "$OUTPUT_LEN" <<'PY'
import json, re, sys
from pathlib import Path
out, output_len = Path(sys.argv[1]), int(sys.argv[2])
def tok_s(path):  # output tokens a second from vLLM's throughput JSON
    return json.loads(path.read_text())["requests_per_second"] * output_len if path.exists() else None
runs = sorted((m[1], int(m[2])) for p in out.glob("pagedmlx-*.json") if (m := re.fullmatch(r"pagedmlx-(.+)-(\d+)", p.stem)))
print(f"{'preset':>16} {'batch':>6} {'pagedmlx out tok/s':>19} {'vLLM out tok/s':>15} {'pagedmlx / vLLM':>16}")
for preset, b in runs:
    ours, theirs = tok_s(out / f"pagedmlx-{preset}-{b}.json"), tok_s(out / f"vllm-{preset}-{b}.json")
    ratio = f"{ours / theirs:.2f}x" if ours and theirs else "-"
    print(f"{preset:>16} {b:>6} {ours or float('nan'):>19.0f} {theirs or float('nan'):>15.0f} {ratio:>16}")
PY
