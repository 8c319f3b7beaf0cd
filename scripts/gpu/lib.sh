# Sourced by the GPU run scripts: $OUT (default gpu-out) and `run NAME SECONDS COMMAND...`, which runs the
# command under a time limit, keeps its output (less MLX's warnings) in $OUT/NAME.txt and prints its exit
# status, seconds and last $TAIL (default 14) lines.
set -u
OUT=${OUT:-gpu-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
run() {  # name, seconds, command...
  local name=$1 secs=$2; shift 2
  local t=$SECONDS
  timeout "$secs" "$@" 2>&1 | grep -v Warning > "$OUT/$name.txt"
  echo "== $name (rc ${PIPESTATUS[0]}, $((SECONDS - t)) s)"; tail -${TAIL:-14} "$OUT/$name.txt"
}
