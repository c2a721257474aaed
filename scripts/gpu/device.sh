#!/usr/bin/env bash
# Steps of a measurement session on the lent GPU machine (torch 2.11 + transformers 5.17, no vLLM, no network).
# Run from the repo root there, one step per `device run` call, calls back to back (the machine's /root survives only
# while it stays warm). Results go to $OUT (at most 8 files come back).
#
#   bash scripts/gpu/device.sh recv             # move the carried .gpu/xfer/c?? chunk to /root/stage (carried paths
#                                               # stay in the machine's tree between calls: moving avoids repeats)
#   bash scripts/gpu/device.sh setup            # check the payload (.gpu/xfer.sha256), unpack vLLM 0.26, wheels, weights
#   bash scripts/gpu/device.sh bench V [V ...]  # build weights if needed, serve and measure each variant (c=1,8)
#
# Build the payload here first (scripts/gpu/README.md): the vLLM bundle, wheels, the embedded GGUF and any CPU-built
# checkpoints, as one tar cut into 60 MiB chunks, one chunk per call.
set -uo pipefail
step=${1:?step}; shift
export PYTHONUNBUFFERED=1 VLLM_TARGET=cuda TRITON_CACHE_AUTOTUNING=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
SITE=/root/site EXTRA=/root/extra QUANT=/root/quant STAGE=/root/stage
case $step in
  recv)
    mkdir -p $STAGE && mv -v .gpu/xfer/c* $STAGE/ && rm -f $STAGE/payload.tar; ls $STAGE ;;
  setup)
    t0=$(date +%s)
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
    python3 -c "import torch, transformers; print(torch.__version__, transformers.__version__)"
    want=$(awk '{print $1}' .gpu/xfer.sha256 | tr -d '\n' | sha256sum | cut -c1-16)
    got=$(cd $STAGE && sha256sum c?? | awk '{print $1}' | tr -d '\n' | sha256sum | cut -c1-16)
    [ "$want" = "$got" ] || { echo "payload damaged or incomplete ($got != $want)"; ls $STAGE; exit 1; }
    (cd $STAGE && cat c?? | tar xf - && rm c??) || exit 1
    [ -d $STAGE/weights ] && cp -r $STAGE/weights/. weights/
    mkdir -p $SITE && cat $STAGE/part? | xz -dc -T16 | (cd $SITE && tar xf -) || exit 1
    mkdir -p $EXTRA && python3 -m pip install -q --no-index --no-deps --no-compile --target $EXTRA $STAGE/whl/*.whl || exit 1
    if ls $STAGE/quant/*.whl >/dev/null 2>&1; then  # llm-compressor pins compressed-tensors 0.19, vLLM 0.17: own folder
      mkdir -p $QUANT && python3 -m pip install -q --no-index --no-deps --no-compile --target $QUANT $STAGE/quant/*.whl || exit 1
    fi
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
      # A start that hangs (seen once with a tiny Llama) gets its Python stacks dumped (faulthandler, SIGABRT) into the
      # server log before the bench is stopped; BENCH_LIMIT seconds per variant.
      python3 -m scripts.bench_latency "$v" --concurrency 1,8 --modes fixed --out-dir "$OUT/$v" & pid=$!
      ( sleep "${BENCH_LIMIT:-420}"; kill -0 $pid 2>/dev/null || exit 0; echo "bench $v hung: dumping stacks"
        pkill -ABRT -f "vllm[.]entrypoints|VLLM::|vllm serve"; sleep 5; kill $pid ) & dog=$!
      wait $pid; rc=$?; pkill -P $dog 2>/dev/null; kill $dog 2>/dev/null
      [ $rc != 0 ] && echo "bench $v failed ($rc)"
      { grep -hiE "marlin|machete|cutlass|kernel|backend|quantiz|took|compil" .cache/bench-"$v".log | grep -v Route | tail -40
        echo "--- tail"; tail -${LOG_TAIL:-40} .cache/bench-"$v".log; } > "$OUT/$v/server.log"
    done ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
