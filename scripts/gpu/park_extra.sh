#!/usr/bin/env bash
# First GPU call, after .gpu/a/recv.sh: park the project's extra wheels (scripts/gpu/stage.sh) on the machine.
set -e
mkdir -p /root/gpu-extra && cp .gpu/a/extra/*.whl /root/gpu-extra/ && echo "extra wheels parked: $(ls /root/gpu-extra | wc -l)"
