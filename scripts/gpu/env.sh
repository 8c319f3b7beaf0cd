# Second GPU call: `source scripts/gpu/env.sh` sets up MLX's CUDA build (../shared/gpu/env.sh, from .gpu/b) and
# installs the wheels that scripts/gpu/park_extra.sh parked (msgspec, pyzmq, rich, ...) into the same /tmp/site.
source .gpu/b/env.sh
if [ -d /root/gpu-extra ] && [ ! -f /tmp/site/.extra ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site /root/gpu-extra/*.whl \
    && touch /tmp/site/.extra
fi
python3 -c "import msgspec, zmq, rich" || echo "scripts/gpu/env.sh: the project's extra wheels are missing (park_extra.sh)"
