# Sourced by ladder.sh, repeat.sh and blocktime.sh: one latency row of the thread ladder into results/cpu-threads-20261124/<dir>.
OUT=results/cpu-threads-20261124
ARGS=(--concurrency 1,8 --modes fixed)
row() {  # row <dir> <variant> [--set KEY=VALUE ...]
  local dir=$1 variant=$2; shift 2
  .venv/bin/python -m scripts.measure.latency "$variant" "${ARGS[@]}" --out-dir "$OUT/$dir" "$@"
}
