#!/usr/bin/env bash
# GPU side of the 2026-11-25 lever session (results/gpu-levers-20261125/README.md), started on the lent H100 right
# after `device.sh setup`, in its own session so that it outlives the call:
#   (setsid bash results/gpu-levers-20261125/run.sh > /root/run/orch.out 2>&1 < /dev/null &)
# 1. the 4B shape proxy, then its four servers that need no calibration (bf16, fp8, fp8-kv8, kv8);
# 2. the W4A16-MLP checkpoint (llm-compressor round-to-nearest, `device.sh build`), then its two servers
#    (awq-mlp: vLLM's pick, Machete; awq-mlp-marlin: Machete disabled);
# 3. once payload B is unpacked (/root/stageB/READY: SmolLM2's GGUF, the three CPU-trained LoRA adapters, the CPU
#    base's config.json): SmolLM2 converted from the GGUF, adapter A merged (scripts.levers.lora.merge), four servers.
# Starts run one after another (device.sh counts ports from /root/run/servers) with WAIT=0: the servers come up in the
# background while the next group builds. 
set -uo pipefail
export OUT=${OUT:-/root/run/out}; mkdir -p "$OUT" /root/run
D="bash scripts/gpu/device.sh"
# One budget for every server (the same SET goes to `measure`, so every record's config names it): with a fixed KV size
# vLLM 0.26 uses gpu_memory_utilization only for its start-up check (free memory >= utilization x total).
SET=${SET:-"SERVE_GPU_MEMORY_UTILIZATION=0.05 SERVE_KV_CACHE_MEMORY_BYTES=1073741824"}; export SET
t0=$(date +%s); ts() { echo "[$(( $(date +%s) - t0 )) s, $(date +%T)] $*"; }
ts "build the proxy"; $D build qwen35-4b-proxy-bf16
ts "start 4 proxy servers"
WAIT=0 $D start qwen35-4b-proxy-bf16 qwen35-4b-proxy-fp8 qwen35-4b-proxy-fp8-kv8 qwen35-4b-proxy-kv8
ts "build W4A16-MLP"; $D build qwen35-4b-proxy-awq-mlp
ts "start 2 W4A16 servers"
WAIT=0 $D start qwen35-4b-proxy-awq-mlp qwen35-4b-proxy-awq-mlp-marlin
ts "wait for payload B"; while [ ! -f /root/stageB/READY ]; do sleep 2; done
cp -r /root/stage/weights/. weights/ && ls weights/lora
[ -f /root/stage/smollm2.gguf ] || cat /root/stage/gguf/smollm2.gguf.part* > /root/stage/smollm2.gguf
export LAB_EMBEDDED_GGUF=/root/stage/smollm2.gguf
ts "convert SmolLM2"; $D build smollm2-bf16
B=weights/SmolLM2-135M-Instruct
sha256sum $B/model.safetensors /root/stage/smollm2.gguf
# The adapters' cards name the CPU base by its config.json's SHA-256; the conversion here writes the same config but
# for "transformers_version" (5.17 here, 5.19 on the CPU): put the CPU's file in place when nothing else differs.
python3 - $B/config.json /root/stage/cpu-base/config.json <<'PY' && cp /root/stage/cpu-base/config.json $B/config.json
import json, sys
a, b = (json.load(open(p)) for p in sys.argv[1:])
diff = {k for k in a.keys() | b.keys() if a.get(k) != b.get(k)}
print("config.json differs from the CPU base in:", sorted(diff))
sys.exit(0 if diff <= {"transformers_version"} else 1)
PY
ts "merge adapter A (peft $(python3 -c 'import peft; print(peft.__version__)'))"
merge() { PYTHONPATH=$PWD python3 -m scripts.levers.lora.merge smollm2-lora-a 2>&1 | grep -v "it/s" | tail -4; [ -d weights/smollm2-lora-a ]; }
if ! merge; then  # an older PEFT than the CPU's 0.21.2 may refuse the newer adapter_config keys: drop those it lacks
  python3 - weights/lora/smollm2-docs-a/adapter_config.json <<'PY'
import dataclasses, json, sys
from pathlib import Path
from peft import LoraConfig
p = Path(sys.argv[1]); c = json.loads(p.read_text()); known = {f.name for f in dataclasses.fields(LoraConfig)}
drop = {k: c[k] for k in c if k not in known and k not in ("peft_type", "peft_version", "base_model_name_or_path",
                                                            "revision", "task_type", "inference_mode", "auto_mapping")}
print("dropping keys this PEFT lacks:", drop); p.with_name("adapter_config.cpu.json").write_text(p.read_text())
p.write_text(json.dumps({k: v for k, v in c.items() if k not in drop}, indent=2))
PY
  merge
fi
sha256sum weights/smollm2-lora-a/model.safetensors
cp "$(ls -t experiments/smollm2-lora-a/merge_lora_*.json | head -1)" /root/run/ 2>/dev/null
ts "start 4 SmolLM2 servers"
WAIT=0 $D start smollm2-bf16 smollm2-lora1 smollm2-lora3 smollm2-lora-a
ts "all started"; touch /root/run/ORCH_DONE
