#!/usr/bin/env bash
# Stage MLX's CUDA build for the GPU machine (../shared/gpu/stage.sh), then add the wheels of this project's own
# dependencies that the shared stage does not carry (msgspec and pyzmq for the engine-core process, rich, uvloop,
# httptools, llguidance; mlx-vlm and Pillow for images): without them `import pagedmlx.engine.llm_engine` fails there.
# They travel in .gpu/a (.gpu/b is near a call's 64 MiB). Run from the project's root: bash scripts/gpu/stage.sh; then,
# back to back (the machine goes back after ~30 s idle):
#   1. carry [".gpu/a"]: bash .gpu/a/recv.sh && bash scripts/gpu/park_extra.sh
#   2. carry [".gpu/b"]: source scripts/gpu/env.sh && ...   (../shared/gpu/env.sh, then the parked wheels)
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/stage.sh
extra=/tmp/gpu-stage/extra
if [ ! -f "$extra/done" ]; then
  rm -rf "$extra" && mkdir -p "$extra"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_35_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d "$extra" msgspec pyzmq rich markdown-it-py mdurl pygments uvloop httptools \
    llguidance "mlx-vlm==0.7.10" pillow
  touch "$extra/done"
fi
mkdir -p .gpu/a/extra && cp "$extra"/*.whl .gpu/a/extra/
du -sh .gpu/a .gpu/b
