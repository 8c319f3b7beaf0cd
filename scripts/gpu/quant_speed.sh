#!/usr/bin/env bash
# Quantized Llama-8B on the GPU: 
# bench_offline.py for 4-bit with the quantized layers left as they are (PAGEDMLX_FLAT_QUANTIZED=0) and for 4-bit,
# 8-bit and bf16 as served, against mlx-lm (BatchGenerator up to batch 64, generate_step at batch 1); a table last.
# From the project's root, after scripts/gpu/env.sh: bash scripts/gpu/quant_speed.sh   (GEN: tokens a request)
# A cold MLX kernel cache adds ~50-60 s to a quantized format's first engine start (its qmm kernels built by NVRTC).
set -u
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/quant_speed}
mkdir -p "$OUT"
GEN=${GEN:-64}
B="python3 scripts/bench/bench_offline.py --preset llama-8b --dtype bfloat16 --prompt-len 128 --gen-len $GEN"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
date -u
PAGEDMLX_FLAT_QUANTIZED=0 timeout 240 $B --quantization 4bit --batch-sizes 64 --skip-peer --json "$OUT/q4_unflat.json" \
  2>&1 | grep -v "^\s*$" | tail -25
for q in 4bit 8bit bf16; do
  flags=$([ $q = bf16 ] && echo "--no-skinny-gemm" || echo "--quantization $q")
  timeout 240 $B $flags --batch-sizes 1 64 256 --peer-max-batch 64 --json "$OUT/$q.json" 2>&1 | grep -v "^\s*$" | tail -30
done
python3 - "$OUT" <<'PY'
import json, sys
from pathlib import Path
print(f"{'weights':>10} {'batch':>5} {'ours decode':>11} {'mlx-lm BG':>9} {'ours e2e':>9} {'BG e2e':>7} {'gen_step':>8}")
for name in ("q4_unflat", "4bit", "8bit", "bf16"):
    p = Path(sys.argv[1]) / f"{name}.json"
    if not p.exists():
        print(f"{name:>10}  (no result)")
        continue
    for r in json.loads(p.read_text())["rows"]:
        print(f"{name:>10} {r['batch']:>5} {r['ours_decode']:>11.1f} {r['mlx_decode']:>9.1f} {r['ours_e2e']:>9.1f} "
              f"{r['mlx_e2e']:>7.1f} {r.get('generate_step', float('nan')):>8.1f}")
PY
