#!/usr/bin/env bash
# Profile several running servers one after another (scripts.measure.profile: GPU time per decode step by category).
#
#   bash scripts/measure/profile_matrix.sh [VARIANT[@PORT] ...]     # default: the three proxy rungs below; PORT defaults to
#                                                           # 8200, 8201, ... in the order given: the ports
#                                                           # `scripts/gpu/device.sh start` hands out in start order
#   SERVERS=/root/run/servers bash scripts/measure/profile_matrix.sh   # the servers `device.sh start` wrote, one per line:
#                                                           # tag variant port pid extra (extra: K=V+K=V or -)
#
# Environment: SET="K=V ..." reaches every run as --set (the same SET `start` got, so each record's config names it
# and measure.profile finds the profiler folder in SERVE_PROFILER_CONFIG); CONCURRENCY (default 1,8); PROFILE_ARGS
# (more measure.profile flags, e.g. "--output-tokens 256 --bandwidth-gbs 2900"); OUT_DIR (records under
# OUT_DIR/<tag>/ instead of experiments/<variant>/); LIMIT seconds per server (default 300); PYTHON (default
# python3). The servers must have been started with the profiler on (SERVE_PROFILER_CONFIG, scripts/gpu/README.md).
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_VARIANTS="qwen35-4b-proxy-bf16 qwen35-4b-proxy-fp8 qwen35-4b-proxy-awq-mlp"
PY=${PYTHON:-python3}
sets=(); for kv in ${SET:-}; do sets+=(--set "$kv"); done

# one line per server: tag variant port extra
if [ -n "${SERVERS:-}" ]; then
  plan=$(awk '{print $1, $2, $3, ($5 == "" ? "-" : $5)}' "$SERVERS") || exit 1
else
  plan=""; i=0
  for spec in ${@:-$DEFAULT_VARIANTS}; do
    v=${spec%@*}; port=$((8200 + i)); [ "$spec" != "$v" ] && port=${spec##*@}
    plan+="$v $v $port -"$'\n'; i=$((i + 1))
  done
fi

failed=0
while read -r tag v port extra; do
  [ -z "$tag" ] && continue
  xs=(); [ "$extra" != "-" ] && for kv in ${extra//+/ }; do xs+=(--set "$kv"); done
  out=(); [ -n "${OUT_DIR:-}" ] && out=(--out-dir "$OUT_DIR/$tag")
  echo "== profile $tag ($v) on :$port $(date +%T)"
  timeout "${LIMIT:-300}" "$PY" -m scripts.measure.profile "$v" --base-url "http://127.0.0.1:$port" \
    --concurrency "${CONCURRENCY:-1,8}" ${PROFILE_ARGS:-} "${sets[@]}" "${xs[@]}" "${out[@]}" < /dev/null \
    || { echo "profile $tag failed ($?)"; failed=1; }
done <<< "$plan"
exit $failed
