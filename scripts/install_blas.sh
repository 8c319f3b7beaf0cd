#!/bin/sh
# Best effort: install OpenBLAS on Debian/Ubuntu so that MLX's CPU backend multiplies fast.
# The Makefile preloads it when present; nothing fails without it, only slower.
for f in /usr/lib/x86_64-linux-gnu/libopenblas.so.0 /usr/lib/aarch64-linux-gnu/libopenblas.so.0; do
  [ -e "$f" ] && exit 0
done
[ "$(uname -s)" = Linux ] || exit 0
command -v apt-get >/dev/null 2>&1 || exit 0
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo -n"
echo "installing OpenBLAS (libopenblas0-pthread) for MLX's CPU backend"
$SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1 || \
  { $SUDO apt-get update -q >/dev/null 2>&1 && $SUDO apt-get install -y -q libopenblas0-pthread >/dev/null 2>&1; } || \
  echo "could not install OpenBLAS; continuing with MLX's reference BLAS (slower)"
