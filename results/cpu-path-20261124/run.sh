#!/usr/bin/env bash
# The CPU serving path of 2026-11-24 (issue 26), run from the repository root of a clean checkout, one job at a time:
# the step profiles, the GGUF k-quant rungs built and scored, one latency ladder across both engines, and llama.cpp's
# n-gram speculation checked for greedy identity and timed on the speculation prompts.
# `bash run.sh 2` starts at step 2 (the steps before it already recorded).
set -euo pipefail
FROM=${1:-1}
OUT=results/cpu-path-20261124
PY=.venv/bin/python
# 1. Where the step goes: the new CPU defaults (uniprocess executor, every core) and vLLM's own layout
[ "$FROM" -le 1 ] && $PY -m scripts.measure.cpu_profile smollm2-bf16 --concurrency 1,8 --out-dir "$OUT/profile-default"
[ "$FROM" -le 1 ] && $PY -m scripts.measure.cpu_profile smollm2-bf16 --concurrency 1,8 --out-dir "$OUT/profile-vllm-layout" \
  --set SERVE_DISTRIBUTED_EXECUTOR_BACKEND=mp --set ENV_VLLM_ENABLE_V1_MULTIPROCESSING=1 \
  --set ENV_VLLM_CPU_NUM_OF_RESERVED_CPU=1 --set ENV_OMP_NUM_THREADS=1
# 2. The k-quant rungs (Q8_0 and Q4_K_M exist): export, then parity against smollm2-bf16 (llama.cpp's logits)
for v in smollm2-gguf-q6-k smollm2-gguf-q5-k-m smollm2-gguf-iq4-nl; do
  [ "$FROM" -le 2 ] || break
  $PY -m scripts.levers.gguf.export $v   # make export-gguf without its install prerequisites
  $PY -m scripts.measure.parity $v
done
# 3. One ladder, both engines, latency-v1, fixed length, c=1 and c=8
[ "$FROM" -le 3 ] && $PY -m scripts.measure.latency smollm2 --ladder --concurrency 1,8 --modes fixed --only \
  smollm2-int8sq,smollm2-int8,smollm2-gguf-bf16,smollm2-gguf-bf16-server,smollm2-gguf-bf16-server-ngram4,smollm2-gguf-q8-0,smollm2-gguf-q6-k,smollm2-gguf-q5-k-m,smollm2-gguf-q4-k-m,smollm2-gguf-iq4-nl
# 4. llama.cpp's n-gram speculation: greedy identity against the same server without it, and speed on the
#    speculation prompts (spec-v1-eval, as the vLLM speculative ladders)
if [ "$FROM" -le 4 ]; then
$PY -m scripts.measure.identity smollm2-gguf-bf16-server-ngram4
$PY -m scripts.measure.latency smollm2-gguf-bf16-server --prompts eval/prompts/spec-v1-eval.jsonl --limit 24 \
  --concurrency 1,8 --modes fixed --out-dir "$OUT/spec-prompts/smollm2-gguf-bf16-server"
$PY -m scripts.measure.latency smollm2-gguf-bf16-server-ngram4 --prompts eval/prompts/spec-v1-eval.jsonl --limit 24 \
  --concurrency 1,8 --modes fixed --out-dir "$OUT/spec-prompts/smollm2-gguf-bf16-server-ngram4"
fi
# 5. llama.cpp's draft-model speculation: the layer-truncated draft built, exported to GGUF, checked and timed as step 4
if [ "$FROM" -le 5 ]; then
  $PY -m scripts.levers.speculate.draft smollm2-bf16-draft6
  $PY -m scripts.levers.gguf.export smollm2-gguf-draft6
  $PY -m scripts.measure.identity smollm2-gguf-bf16-server-draft6
  $PY -m scripts.measure.latency smollm2-gguf-bf16-server-draft6 --prompts eval/prompts/spec-v1-eval.jsonl --limit 24 \
    --concurrency 1,8 --modes fixed --out-dir "$OUT/spec-prompts/smollm2-gguf-bf16-server-draft6"
fi
