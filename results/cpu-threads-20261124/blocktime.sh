#!/usr/bin/env bash
# Third pass (2026-11-24, after the CPU defaults changed to the uniprocess executor on both cores): Intel OpenMP's spin
# after a parallel region. vLLM sets KMP_BLOCKTIME=5 and KMP_TPAUSE=0 for its worker process (multiproc executor); the
# uniprocess executor has no worker, so the model's threads keep libiomp5's default (200 ms of spinning) and spin on
# the core the API server needs. The default once more beside it (this machine's speed drifts between passes).
set -euo pipefail
source results/cpu-threads-20261124/row.sh
row uniproc-default smollm2-bf16
row uniproc-blocktime5 smollm2-bf16 --set ENV_KMP_BLOCKTIME=5 --set ENV_KMP_TPAUSE=0
row uniproc-blocktime0 smollm2-bf16 --set ENV_KMP_BLOCKTIME=0
