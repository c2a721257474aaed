#!/usr/bin/env bash
# The CPU scale ladder of 2026-11-25, run from a clean worktree of the commit its records name, nothing else running.
# One smollm2-bf16 server on both cores, then two replicas (one core each) behind vllm-router, round-robin and
# cache-aware, on the shared-prefix set (c=1, 8, 32, 128 and Poisson 1, 2, 4 req/s, 32 output tokens), then the
# router's own cost: one replica on both cores, c=1 direct vs through the router, 4 ABBA rounds on latency-v1.
set -euo pipefail
out=results/scale-cpu-20261125
.venv/bin/python -m scripts.measure.scale smollm2-bf16 --replicas 2 --policies round_robin,cache_aware \
  --concurrency 1,8,32,128 --request-rate 1,2,4 --max-tokens-cap 32 --overhead-rounds 4 \
  --overhead-dir $out/overhead --summary-out $out/summary.md 2>&1 | tee $out/run.log
