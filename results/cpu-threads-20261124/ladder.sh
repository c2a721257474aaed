#!/usr/bin/env bash
# The CPU thread/core ladder of 2026-11-24 (issue 26): smollm2-bf16 under vLLM's CPU engine with each setting, then the
# llama.cpp peer with one and with two threads; one server per row, rows one after another, same prompts and lengths.
# Run from the repository root of a clean checkout: bash results/cpu-threads-20261124/ladder.sh
set -euo pipefail
source results/cpu-threads-20261124/row.sh
row vllm-default smollm2-bf16
row vllm-reserved0 smollm2-bf16 --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=0
row vllm-uni smollm2-bf16 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni
row vllm-uni-omp2 smollm2-bf16 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni --set ENV_OMP_NUM_THREADS=2
row vllm-reserved0-uni smollm2-bf16 --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=0 --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni
row vllm-reserved0-uni-async smollm2-bf16 --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=0 \
  --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=uni --set SERVE_ASYNC_SCHEDULING=1
row vllm-reserved0-nobind smollm2-bf16 --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=0 --set ENV_VLLM_CPU_OMP_THREADS_BIND=nobind
row llamacpp-t1 smollm2-gguf-bf16 --set LLAMACPP_N_THREADS=1 --set LLAMACPP_N_THREADS_BATCH=1
row llamacpp-t2 smollm2-gguf-bf16
