#!/usr/bin/env bash
# Steps of a measurement session on the lent GPU machine (torch 2.11 + transformers 5.17, no vLLM, no network).
# Run from the repo root there, one step per `device run` call, calls back to back (the machine's /root survives only
# while it stays warm). Results go to $OUT (at most 8 files come back).
#
#   bash scripts/gpu/device.sh stage            # copy the carried .gpu/part* (and .gpu/*.gguf.part*) to /root/stage
#   bash scripts/gpu/device.sh setup            # unpack vLLM 0.26 to /root/site, extra wheels to /root/extra
#   bash scripts/gpu/device.sh bench V [V ...]  # build weights if needed, serve and measure each variant (c=1,8)
#
# Build the bundle here first: shared/tools/gpu-bundle.sh .gpu/bundle (see scripts/gpu/README.md).
set -uo pipefail
step=${1:?step}; shift
export PYTHONUNBUFFERED=1 VLLM_TARGET=cuda TRITON_CACHE_AUTOTUNING=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=/root/site EXTRA=/root/extra QUANT=/root/quant STAGE=/root/stage
case $step in
  stage)
    mkdir -p $STAGE && cp -rv .gpu/part* .gpu/quant .gpu/whl .gpu/gguf $STAGE/ 2>/dev/null; ls -la $STAGE; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    python3 -c "import datasets; print('datasets', datasets.__version__)" 2>&1 | tail -1 ;;
  setup)
    t0=$(date +%s)
    mkdir -p $SITE && cat $STAGE/part? | xz -dc -T16 | (cd $SITE && tar xf -) || exit 1
    mkdir -p $EXTRA && python3 -m pip install -q --no-index --no-deps --no-compile --target $EXTRA $STAGE/whl/*.whl || exit 1
    # llm-compressor pins compressed-tensors 0.19, vLLM 0.17: its own folder, never on vLLM's path
    mkdir -p $QUANT && python3 -m pip install -q --no-index --no-deps --no-compile --target $QUANT $STAGE/quant/*.whl || exit 1
    PYTHONPATH=$SITE:$EXTRA python3 -c "import vllm; print('vllm', vllm.__version__)"
    echo "setup $(( $(date +%s) - t0 )) s" ;;
  bench)
    export PYTHONPATH=$SITE:$EXTRA PYTHONFAULTHANDLER=1
    if ls $STAGE/gguf/smollm2.gguf.part* >/dev/null 2>&1 && [ ! -f $STAGE/smollm2.gguf ]; then
      cat $STAGE/gguf/smollm2.gguf.part* > $STAGE/smollm2.gguf
    fi
    export LAB_EMBEDDED_GGUF=$STAGE/smollm2.gguf
    for v in "$@"; do
      echo "== $v $(date +%T)"
      if grep -q "^SOURCE=lever" "experiments/$v/config.env" && [ ! -d "$(sed -n 's/^MODEL=//p' experiments/$v/config.env)" ]; then
        PYTHONPATH=$QUANT:$EXTRA timeout 400 python3 -m scripts.llmcompressor_calibrate --variant "$v" 2>&1 | tail -5
      fi
      timeout 300 python3 -m scripts.download_weights --for-variant "$v" || { echo "weights for $v failed"; continue; }
      mkdir -p "$OUT/$v"
      timeout 420 python3 -m scripts.bench_latency "$v" --concurrency 1,8 --modes fixed --out-dir "$OUT/$v"
      rc=$?
      if [ $rc = 124 ]; then  # hung: make every vLLM process dump its Python stacks (faulthandler) into the log
        echo "bench $v timed out: stack dump in server.log"; pkill -ABRT -f "vllm.entrypoints" ; sleep 5
      elif [ $rc != 0 ]; then echo "bench $v failed ($rc)"; fi
      { grep -hiE "marlin|machete|cutlass|kernel|quantiz|took|compil" .cache/bench-"$v".log | grep -v Route | tail -30
        echo "--- tail"; tail -30 .cache/bench-"$v".log; } > "$OUT/$v/server.log"
    done ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
