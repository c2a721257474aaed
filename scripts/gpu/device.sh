#!/usr/bin/env bash
# Steps of a measurement session on the lent GPU machine (torch 2.11 + transformers 5.17, no vLLM, no network).
# Run from the repo root there, one step per `device run` call, calls back to back (the machine's /root survives only
# while it stays warm). Results go to $OUT (at most 8 files come back).
#
#   bash scripts/gpu/device.sh recv             # move the carried .gpu/xfer/c?? chunk to /root/stage (carried paths
#                                               # stay in the machine's tree between calls: moving avoids repeats)
#   bash scripts/gpu/device.sh setup            # check the payload (.gpu/xfer.sha256), unpack vLLM 0.26, wheels, weights
#   bash scripts/gpu/device.sh build V [V ...]  # build each variant's weights (and its PARENT's first) if missing:
#                                               # shape proxy, calibrate (CALIBRATE_RECIPE), prune (PRUNE_KEEP);
#                                               # prune records come back as $OUT/build.tar
#   bash scripts/gpu/device.sh bench V [V ...]  # build weights if needed, serve and measure each variant (c=1,8)
#                                               # (MEASURE=soak: the bounded soak instead, SOAK_ARGS passed on;
#                                               # MEASURE=think: scripts.measure.think_budget, THINK_ARGS passed on)
#   SET="K=V ..." bash scripts/gpu/device.sh start V[+K=V...] ...   # build weights, start every server AT ONCE (each in
#                                               # its own session: they outlive the call), wait until all are healthy
#                                               # (SGL_BUDGET_GB=N: each SGLang server alone, N GB of the GPU each;
#                                               # V+SGL_BUDGET_GB=M: M GB for that one)
#   [WAIT=540] bash scripts/gpu/device.sh wait  # until every started server is ready or gone (a start that outlasts its call)
#   SET="K=V ..." [BENCH_ARGS="--prompts …"] bash scripts/gpu/device.sh measure   # bench those servers one after another (c=1,8, --base-url),
#                                               # stop them; records + log excerpts come back as $OUT/${TAR:-results}.tar
#                                               # (each record: the bytes a step reads, this GPU's copy bandwidth measured
#                                               # by the bench, kernels per layer family from the server's log)
#                                               # (ROUNDS=2: every server benched twice, in start order, for a spread;
#                                               # KEEP=1: leave them running, e.g. for `profile`, then `stop`)
#   SET="…" [ONLY="tag …"] bash scripts/gpu/device.sh profile   # decode-step profiles of running servers (below)
#   [ONLY="tag …"] [CONCURRENCY=1] bash scripts/gpu/device.sh hostsample   # py-spy over the running servers'
#                                               # processes while they decode (scripts.measure.host_sample): each
#                                               # process's and thread's busy time per token, no profiler attached
#   bash scripts/gpu/device.sh stop             # stop every server `start` left running
#   [ROUNDS=2] [SGL_BUDGET_GB=N] [PROFILE_ROUNDS="1"] bash scripts/gpu/device.sh cycle V[+K=V] ...   # rounds of
#                                               # start, measure, stop with one server at a time (only one fits: the
#                                               # 27B shape on an H100); even rounds reversed, one ladder id (below);
#                                               # PROFILE_ROUNDS: `profile` each server of those rounds after its bench
#   [ONLY="tag …"] [RUNS="fuzz"] bash scripts/gpu/device.sh reliability   # soak, storm and fuzz of the servers `start` left running
#   [SCALE_ARGS=…] bash scripts/gpu/device.sh scale V   # scripts.measure.scale: one server, replicas behind
#                                               # vllm-router (its wheels in the payload's whl/), router overhead;
#                                               # $OUT/scale.tar
#   [HEADS="tag:tokens ..."] [STEPS=N] [DEADLINE=epoch-s] [ANSWERS=f.npz] bash scripts/gpu/device.sh redistill V
#                                               # in the background (setsid; it outlives the call, `poll` follows
#                                               # it): V's PARENT answers V's prompt set on vLLM (GEN_CONCURRENCY in
#                                               # flight, redistill --generate-only, compiled unless GEN_EAGER=1;
#                                               # answers.npz joins the heads) or ANSWERS unpacks an earlier one,
#                                               # then one head per HEADS entry "tag:tokens[:K=V,K=V]"
#                                               # (REDISTILL_MAX_TRAIN_TOKENS=tokens, empty: all; K=V: more settings)
#                                               # trained side by side on the GPU, into /root/heads/<tag>
#                                               # (HEADS=-: answers only; a later call reuses them)
#   [SETS="K=V,K=V …"] bash scripts/gpu/device.sh probe   # 60 training steps per SETS entry on the carried tiny
#                                               # answers: step times of the training settings
#   [PIECES="00 01 02 03"] bash scripts/gpu/device.sh poll   # the redistill log so far and the snapshots
#                                               # ($OUT/snapshots.tar.NN); when done, heads + logs as 15 MiB
#                                               # pieces $OUT/heads.tar.NN (at most four a call)
#   [BAKE_ARGS="--device-name 'NVIDIA H200'"] bash scripts/gpu/device.sh bake V [V ...]   # build weights, then
#                                               # scripts.levers.cache.bake V --measure-warm for each (cold start with empty
#                                               # caches, warm-up, pack, warm start from the tarball); tarballs in
#                                               # /root/bake/<V><BAKE_TAG>.tar.gz, records + logs as $OUT/bake.tar (and
#                                               # in /root/bake/results: run it under setsid to outlive the call)
#   [GEMM_ARGS="--quick …"] [NORUN=1] bash scripts/gpu/device.sh gemm   # the W4A16 GEMM microbench
#                                               # (scripts.measure.gemm_bench) on vLLM's kernels (the bundle `setup`
#                                               # unpacked) and the kernel wheels carried in .gpu/whl-kernels, installed
#                                               # into /root/kernels (NORUN=1: install only; wheels carried over several
#                                               # calls add up); $OUT/gemm_<stamp>.json + .md
#   bash scripts/gpu/device.sh optimize BASE [MAKE_ARGS…]   # `make optimize BASE=… MAKE_ARGS` as a user runs it, in
#                                               # the background (setsid: it outlives the call): the Makefile's
#                                               # environments stand in for by the bundle (shims), the BIG-bench suite
#                                               # from the payload's datasets/; returns after ~20 s
#   bash scripts/gpu/device.sh make TARGET [VAR=…]   # any make target there, in the foreground (e.g. make failover
#                                               # VARIANT=… REPLICAS=2); what it wrote comes back as $OUT/make.tar
#   [WAIT=500] bash scripts/gpu/device.sh follow BASE   # the run's output so far, until it ends or WAIT s pass; each call
#                                               # returns what it has written (report, plan, records, state, step
#                                               # logs) as $OUT/optimize.tar, so a machine taken back loses no step
#   bash scripts/gpu/device.sh detach TAG 'COMMAND'   # any command line (make targets, python -m scripts…) in the
#                                               # background (setsid) in /root/lab, e.g. a scale ladder and `make
#                                               # failover` back to back; returns after ~15 s
#   [WAIT=500] bash scripts/gpu/device.sh attach TAG [PATH…]   # its output so far, until it ends or WAIT s pass;
#                                               # what it wrote (records, server-log tails, output) and the PATHs as
#                                               # $OUT/TAG.tar after every call
#   [LAB_CACHE_SHIM=1] [FORCE=1] bash scripts/gpu/device.sh startc V TARBALL   # one timed start from a baked
#                                               # tarball as `scripts.serve --cache` imports it (FORCE=1: its caches
#                                               # used even where the manifest differs, to see what really hits); the
#                                               # record (phases, cache folders' sizes before/after) joins /root/bake
#
# start/measure exist because one start of the Qwen3.5 proxy takes ~285-345 s (records of 2026-11-21), so a ladder of
# five proxy variants started one by one does not fit a session's device time; started together they compile at once.
# Servers that share the GPU need a memory budget each: SET="SERVE_GPU_MEMORY_UTILIZATION=0.12
# SERVE_KV_CACHE_MEMORY_BYTES=2147483648" (a fixed KV size skips vLLM's memory profiling, which other processes'
# allocations would disturb); the same SET is passed to the bench so each record's config names it. Only one server
# runs requests at a time; the others sit idle (no GPU work) while one is measured. V+K=V adds an override for one
# server (e.g. smollm2-bf16+ENV_VLLM_USE_V2_MODEL_RUNNER=0); its records land under that tag (a tag past 96
# characters becomes V_x<8 hex of the extra>, printed by `start`).
#
# Build the payload here first (scripts/gpu/README.md): the vLLM bundle, wheels, the embedded GGUF and any CPU-built
# checkpoints, as one tar cut into 60 MiB chunks, one chunk per call.
set -uo pipefail
step=${1:?step}; shift
export PYTHONUNBUFFERED=1 VLLM_TARGET=cuda TRITON_CACHE_AUTOTUNING=1 HF_HUB_OFFLINE=1
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
[ -x /root/sgl-python ] && export LAB_SGLANG_PYTHON=/root/sgl-python  # written by `setup` when SGLang's wheels came
# RUN: the servers' pids, logs and states of the steps (LAB_RUN_DIR: another folder, e.g. a test's)
SITE=/root/site EXTRA=/root/extra FIRST=/root/first QUANT=/root/quant STAGE=/root/stage RUN=${LAB_RUN_DIR:-/root/run}
KERNELS=/root/kernels LAB=/root/lab
# every step's packages but calibration's: those replacing the image's or the bundle's first, the bundle, the payload's
PKGS=$FIRST:$SITE:$EXTRA
EXCERPT="marlin|machete|cutlass|kernel|backend|quantiz|took|compil|speculat|SpecDecoding|draft|mtp|runner|KV cache|memory|Asynchronous scheduling|CUDA graphs"
sets=(); for kv in ${SET:-}; do sets+=(--set "$kv"); done
# SET's keys are vLLM's (SERVE_*): a variant served by another engine (ENGINE=sglang) gets none of them
sets_for() { vs=(); [ -z "$(cfg "$1" ENGINE)" ] || [ "$(cfg "$1" ENGINE)" = vllm ] && vs=("${sets[@]}"); }
# one line of $RUN/servers in a step's loop (TAG V EXTRA): 1 where ONLY="tag …" leaves TAG out; else xs = the line's
# own settings (start's V+K=V) and vs = SET's (sets_for), each as --set pairs
server_sets() {
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $1 "* ]] && return 1
  xs=(); [ "$3" != "-" ] && for kv in ${3//+/ }; do xs+=(--set "$kv"); done; sets_for "$2"; return 0
}
ready() { grep -q "^ready:" "$RUN/$1.serve" 2>/dev/null; }
cfg() { sed -n "s/^$2=//p" "experiments/$1/config.env"; }
sgl_alone() { [ -n "${SGL_BUDGET_GB:-}" ] && [ "$(cfg "$1" ENGINE)" = sglang ]; }  # `start`'s SGL_BUDGET_GB (below)
# MODEL of variant $1 if missing, its PARENT's first: a lever variant is pruned (PRUNE_KEEP) or calibrated; any other
# is materialized by download_weights (shape proxy). The repo root is on PYTHONPATH: vLLM's processes import the
# project's model plugin (scripts.levers.vocab.plugin) through the entry point written by `setup`.
build() {
  local v=$1 parent
  # a committed head (HEAD_SOURCE) is copied into weights/ while the tree carries it (scripts.weights.download)
  [ -z "$(cfg $v HEAD_SOURCE)" ] || python3 -c "import sys; from scripts.common.variants import load_variant; \
from scripts.weights.download import install_head; print('head', install_head(load_variant(sys.argv[1])))" "$v" || return 1
  [ -d "$(cfg $v MODEL)" ] && return 0
  parent=$(cfg $v PARENT); [ -n "$parent" ] && { build "$parent" || return 1; }
  local t=$(date +%s)
  if [ -n "$(cfg $v PRUNE_KEEP)" ]; then
    timeout 600 python3 -m scripts.levers.vocab.prune "$v" --timing-repeat ${PRUNE_TIMING_REPEAT:-20} 2>&1 | tail -4
  elif [ "$(cfg $v SOURCE)" = lever ]; then  # llm-compressor's own pins first; pydantic & co. from the vLLM bundle
    PYTHONPATH=$QUANT:$EXTRA:$SITE timeout 400 python3 -m scripts.levers.quantize.calibrate --variant "$v" 2>&1 | tail -5
  else
    timeout 300 python3 -m scripts.weights.download --for-variant "$v"
  fi
  [ -d "$(cfg $v MODEL)" ] && echo "built $v in $(( $(date +%s) - t )) s" || { echo "weights for $v failed"; return 1; }
}
# SmolLM2's embedded GGUF, joined once from the payload's gguf/ pieces when it carries them (a payload without them, e.g.
# Gemma's, builds from its own packages), named to scripts.weights.download through LAB_EMBEDDED_GGUF
embedded_gguf() {
  if ls $STAGE/gguf/smollm2.gguf.part* >/dev/null 2>&1 && [ ! -f $STAGE/smollm2.gguf ]; then
    cat $STAGE/gguf/smollm2.gguf.part* > $STAGE/smollm2.gguf
  fi
  export LAB_EMBEDDED_GGUF=$STAGE/smollm2.gguf
}
gone() { ! kill -0 "$1" 2>/dev/null; }
# the Makefile's environments (.venv, .venv-quant) stood in for by the bundle: a python3 shim each and their stamps, so
# make targets take the same path here as on a user's machine
shims() {
  mkdir -p .venv/bin .venv-quant/bin $RUN
  printf '#!/bin/sh\nexec python3 "$@"\n' > .venv/bin/python
  printf '#!/bin/sh\n# llm-compressor: its pins before the bundle\nPYTHONPATH=%s:%s:%s:%s exec python3 "$@"\n' \
    $QUANT $EXTRA $SITE "$PWD" > .venv-quant/bin/python
  chmod +x .venv/bin/python .venv-quant/bin/python; touch .venv/.installed-cuda .venv-quant/.installed
  python3 -c "import vllm; print('vllm', vllm.__version__)" || return 1  # lm-eval and datasets where the payload has them
}
# The carried tree copied into its own folder (/root/lab) and entered, with the bundle's environment and the Makefile's
# shims: each call syncs the carried tree and would remove the variants and records a background run writes
# (2026-11-28: a plan's new variants vanished under a running `make optimize`)
into_lab() {
  mkdir -p $LAB && tar cf - --exclude=./.gpu . | (cd $LAB && tar xf -) && cd $LAB || return 1
  export PYTHONPATH=$PKGS:$LAB PYTHONFAULTHANDLER=1 PATH=$EXTRA/bin:$PATH; embedded_gguf; shims
}
running() { [ -s $RUN/$1.pid ] && kill -0 "$(cat $RUN/$1.pid)" 2>/dev/null; }
# the command line $2 under setsid (it outlives the call): its output, process group, start and end marks in
# $RUN/$1.{out,pid,start,done}
in_background() {
  rm -f $RUN/$1.done; touch $RUN/$1.start
  (setsid bash -c 'echo $$ > "$0.pid"; t0=$(date +%s); bash -c "$1"; rc=$?
    echo "== ended: rc=$rc after $(( $(date +%s) - t0 )) s"; touch "$0.done"' "$RUN/$1" "$2" > $RUN/$1.out 2>&1 < /dev/null &)
}
# a background run $1 followed until it ends or WAIT s pass: its output so far, and what it wrote since it started
# under experiments/, results/ and eval/optimize/, the tails of the servers' logs, its output and the paths after $1
# (those present) as $OUT/$1.tar
follow_run() {
  local tag=$1; shift
  for _ in $(seq ${WAIT:-500}); do [ -f $RUN/$tag.done ] && break; sleep 1; done
  tail -${LOG_TAIL:-40} $RUN/$tag.out
  nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
  rm -rf $RUN/$tag.logs && mkdir -p $RUN/$tag.logs
  find .cache -name '*.log' -newer $RUN/$tag.start -type f | while read -r f; do
    tail -c 400000 "$f" > $RUN/$tag.logs/$(echo "${f#.cache/}" | tr / _); done
  # eval/optimize/ too: a GPU plan file written by the run (2026-12-06: the one named after `follow` did not come back)
  { find experiments results eval/optimize -newer $RUN/$tag.start -type f; echo $RUN/$tag.out; echo $RUN/$tag.logs
    for f in "$@"; do [ -e "$f" ] && echo "$f"; done; } | sort -u > $RUN/$tag.list
  tar cf $OUT/$tag.tar -T $RUN/$tag.list 2>/dev/null; ls -la $OUT/$tag.tar
  [ -f $RUN/$tag.done ] && echo DONE
}
# until every server `start` left is ready or gone (at most WAIT s from $1), then each one's state: a server that
# is not ready shows its last lines and errors (a kernel that refuses a layer says so here)
wait_servers() {
  [ -s $RUN/servers ] || { echo "no server started"; return; }
  while :; do
    left=0; while read -r tag v port pid extra; do ready $tag || gone $pid || left=$((left + 1)); done < $RUN/servers
    [ $left = 0 ] && break
    [ $(( $(date +%s) - $1 )) -gt ${WAIT:-540} ] && { echo "still starting: $left"; break; }
    sleep 5
  done
  while read -r tag v port pid extra; do
    if ready $tag; then echo "$tag: $(grep '^ready:' $RUN/$tag.serve)"
    elif gone $pid; then echo "$tag: GONE"; tail -3 $RUN/$tag.serve; grep -E "Error|error" $RUN/$tag.log | tail -5
    else echo "$tag: still starting"; fi
  done < $RUN/servers
  nvidia-smi --query-gpu=memory.used,memory.total --format=csv,noheader
}
stop_servers() {  # every server `start` left running: TERM, wait up to 60 s, retire the list
  while read -r tag v port pid extra; do kill -TERM $pid 2>/dev/null; done < $RUN/servers
  for _ in $(seq 60); do alive=0; while read -r tag v port pid extra; do gone $pid || alive=1; done < $RUN/servers
    [ $alive = 0 ] && break; sleep 1; done
  mv $RUN/servers $RUN/servers.done-$(date +%H%M%S)
}
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
    # the BIG-bench suite and its manifest (make datasets here; the 1.7 GB of task JSON stay behind: calibration and
    # parity read the offline cpython-docs corpus where the task data is not cached)
    [ -d $STAGE/datasets ] && mkdir -p .cache/datasets && cp -r $STAGE/datasets/. .cache/datasets/
    # a payload without the vLLM bundle (training from carried answers) skips it
    mkdir -p $SITE && { ! ls $STAGE/part? >/dev/null 2>&1 || cat $STAGE/part? | xz -dc -T16 | (cd $SITE && tar xf -); } || exit 1
    mkdir -p $EXTRA && python3 -m pip install -q --no-index --no-deps --no-compile --target $EXTRA $STAGE/whl/*.whl || exit 1
    # packages that replace the image's or the bundle's, first on PYTHONPATH (transformers 5.24.0, requirements/cuda.txt's
    # pin beside vLLM 0.26.0, which the image's huggingface_hub 1.33.0 serves: the image's transformers 5.17.0 converts
    # Gemma 3's GGUF tokenizer wrongly, 2026-11-29)
    mkdir -p $FIRST && { ! ls $STAGE/first/*.whl >/dev/null 2>&1 || \
      python3 -m pip install -q --no-index --no-deps --no-compile --target $FIRST $STAGE/first/*.whl; } || exit 1
    if ls $STAGE/quant/*.whl >/dev/null 2>&1; then  # llm-compressor pins compressed-tensors 0.19, vLLM 0.17: own folder
      mkdir -p $QUANT && python3 -m pip install -q --no-index --no-deps --no-compile --target $QUANT $STAGE/quant/*.whl || exit 1
    fi
    if ls $STAGE/sglang/*.whl >/dev/null 2>&1; then  # SGLang 0.5.17 pins transformers 5.12.1: own folder, own python
      mkdir -p /root/sgl && python3 -m pip install -q --no-index --no-deps --no-compile --target /root/sgl \
        $STAGE/sglang/*.whl $STAGE/sglang/kernel-slim/*.whl || exit 1
      printf '#!/bin/sh\n# SGLang: its pins before the vLLM bundle\nPYTHONPATH=/root/sgl:%s:%s exec python3 "$@"\n' \
        $SITE "$PWD" > /root/sgl-python && chmod +x /root/sgl-python
      /root/sgl-python -c "import sglang, sgl_kernel, transformers as t; print('sglang', sglang.__version__, t.__version__)"
    fi
    # vLLM loads model plugins through installed entry points; the project is not installed here (no network, no
    # build): a dist-info holding pyproject.toml's entry points, on PYTHONPATH, stands in for `pip install -e .`
    python3 - "$EXTRA" <<'PY' || exit 1
import sys, tomllib
from pathlib import Path
proj = tomllib.loads(Path("pyproject.toml").read_text())["project"]
d = Path(sys.argv[1]) / f"{proj['name'].replace('-', '_')}-{proj['version']}.dist-info"
d.mkdir(parents=True, exist_ok=True)
(d / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {proj['name']}\nVersion: {proj['version']}\n")
(d / "entry_points.txt").write_text("".join(f"[{g}]\n" + "".join(f"{k} = {v}\n" for k, v in eps.items()) + "\n"
                                            for g, eps in proj.get("entry-points", {}).items()))
print("entry points:", (d / "entry_points.txt").read_text().strip().replace("\n", "; "))
PY
    [ -d $SITE/vllm ] && PYTHONPATH=$PKGS:$PWD python3 -c "import vllm, importlib.metadata as m; print('vllm', \
      vllm.__version__, [e.value for e in m.entry_points(group='vllm.general_plugins')])"
    echo "setup $(( $(date +%s) - t0 )) s" ;;
  build)
    export PYTHONPATH=$PKGS:$PWD; embedded_gguf; t0=$(date +%s); since=$RUN/build-$t0; mkdir -p $RUN && touch $since
    for v in "$@"; do build "$v"; done
    find experiments -name 'prune_*.json' -newer $since | tar cf $OUT/build.tar -T - && tar tf $OUT/build.tar
    df -h . | tail -1; echo "build $(( $(date +%s) - t0 )) s" ;;
  bench)
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    embedded_gguf
    for v in "$@"; do
      echo "== $v $(date +%T)"
      build "$v" || continue
      mkdir -p "$OUT/$v"
      # A start that hangs (seen once with a tiny Llama) gets its Python stacks dumped (faulthandler, SIGABRT) into the
      # server log before the bench is stopped; BENCH_LIMIT seconds per variant.
      # MEASURE=soak: the bounded soak (scripts.measure.soak, SOAK_ARGS) instead of the latency bench
      if [ "${MEASURE:-latency}" = soak ]; then log=.cache/soak-"$v".log
        python3 -m scripts.measure.soak "$v" ${SOAK_ARGS:-} --out-dir "$OUT/$v" & pid=$!
      elif [ "$MEASURE" = think ]; then log=.cache/think-"$v".log
        python3 -m scripts.measure.think_budget "$v" ${THINK_ARGS:-} --out-dir "$OUT/$v" & pid=$!
      else log=.cache/bench-"$v".log
        python3 -m scripts.measure.latency "$v" --concurrency 1,8 --modes fixed --out-dir "$OUT/$v" & pid=$!
      fi
      ( sleep "${BENCH_LIMIT:-420}"; kill -0 $pid 2>/dev/null || exit 0; echo "bench $v hung: dumping stacks"
        pkill -ABRT -f "vllm[.]entrypoints|VLLM::|vllm serve"; sleep 5; kill $pid ) & dog=$!
      wait $pid; rc=$?; pkill -P $dog 2>/dev/null; kill $dog 2>/dev/null
      [ $rc != 0 ] && echo "bench $v failed ($rc)"
      { grep -hiE "marlin|machete|cutlass|kernel|backend|quantiz|took|compil" $log | grep -v Route | tail -40
        echo "--- tail"; tail -${LOG_TAIL:-40} $log; } > "$OUT/$v/server.log"
    done ;;
  start)
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    embedded_gguf
    mkdir -p $RUN; t0=$(date +%s); touch $RUN/starting  # `measure` waits for this start to end
    for spec in "$@"; do build "${spec%%+*}"; done  # variants that share a checkpoint build it once
    echo "weights $(( $(date +%s) - t0 )) s"; n=$(cat $RUN/servers* 2>/dev/null | wc -l)
    for spec in "$@"; do
      v=${spec%%+*}; extra=""; [ "$spec" != "$v" ] && extra=${spec#*+}
      # V+SGL_BUDGET_GB=N: this SGLang server's own budget under SGL_BUDGET_GB (an MTP rung's draft and state cache
      # need more than a plain rung: K=3 was capped at 2 running requests at 13 GiB, 2026-12-06); not a config key
      gb=${SGL_BUDGET_GB:-}; rest=""
      for kv in ${extra//+/ }; do [[ "$kv" == SGL_BUDGET_GB=* ]] && gb=${kv#*=} || rest=${rest:+$rest+}$kv; done
      [ "$extra" != "$rest" ] && ! sgl_alone "$v" && echo "$spec: SGL_BUDGET_GB applies to SGLang rungs under a global SGL_BUDGET_GB: ignored"
      extra=$rest
      xs=(); for kv in ${extra//+/ }; do xs+=(--set "$kv"); done
      tag=$(printf %s "$v${extra:++$extra}" | tr -c 'A-Za-z0-9._-' _); port=$((8200 + n)); n=$((n + 1)); sets_for "$v"
      # a long extra (a JSON setting) would make file names past the file system's limit (2026-11-28): VARIANT_x<hash>
      [ ${#tag} -gt 96 ] && tag="${v}_x$(printf %s "$extra" | sha256sum | cut -c1-8)"
      # SGLang's static budget is its fraction of the memory free at its start, less what others take while it loads
      # (results/gpu-mtp-20261129/README.md): with SGL_BUDGET_GB each SGLang server starts once every server before it
      # is ready, with the fraction of the memory free then that makes SGL_BUDGET_GB GiB (unless its extra sets one);
      # the fraction joins its extra, so its records name it
      if sgl_alone "$v"; then
        (wait_servers $t0 >/dev/null 2>&1)  # in a subshell: its loop reads into this loop's variables
        if [[ "$extra" != *SGLANG_MEM_FRACTION_STATIC=* ]]; then
          free=$(nvidia-smi --query-gpu=memory.free --format=csv,noheader,nounits | head -1)
          frac=$(python3 -c "print(round($gb * 1024 / $free, 3))" 2>/dev/null) && [[ "$frac" =~ ^0\.[0-9]+$ ]] || {
            echo "SGL_BUDGET_GB=$gb GiB is not a share of the $free MiB free: $tag not started"; continue; }
          kv=SGLANG_MEM_FRACTION_STATIC=$frac; xs+=(--set "$kv"); extra=${extra:+$extra+}$kv
          echo "$tag: $kv ($free MiB free)"
        fi
      fi
      # the server's own session leader writes its pid (setsid forks when its caller leads a process group); files of an
      # earlier start of the same tag go first (a stale pid read as "gone" marked a starting server failed, 2026-11-23)
      # and its log moves aside: a record reads the whole log (kernels), which must be this server's alone (the
      # second round of a cycle read the first's lines too, 2026-12-07)
      rm -f $RUN/$tag.pid $RUN/$tag.serve; [ -f $RUN/$tag.log ] && mv -f $RUN/$tag.log $RUN/$tag.log.prev
      setsid bash -c 'echo $$ > "$0"; exec "$@"' $RUN/$tag.pid python3 -m scripts.serve "$v" --port $port \
        "${vs[@]}" "${xs[@]}" --log $RUN/$tag.log --timeout 900 > $RUN/$tag.serve 2>&1 < /dev/null &
      for _ in $(seq 50); do [ -s $RUN/$tag.pid ] && break; sleep 0.1; done
      echo "$tag $v $port $(cat $RUN/$tag.pid) ${extra:--}" >> $RUN/servers
      echo "started $tag on :$port (pid $(cat $RUN/$tag.pid)) at $(date +%T)"
      if sgl_alone "$v"; then  # the next server starts once this one is ready (or gone), within WAIT of the call
        (wait_servers $t0 >/dev/null 2>&1)
        # one that died freed its memory: the next starts; one still starting when WAIT ran out holds it: none does
        ready $tag || { pid=$(cat $RUN/$tag.pid 2>/dev/null); [ -n "$pid" ] && gone "$pid" && {
          echo "$tag: GONE after $(( $(date +%s) - t0 )) s"; continue; }
          echo "$tag: not ready after $(( $(date +%s) - t0 )) s; not started: the specs after it"; break; }
      fi
    done
    wait_servers $t0; rm -f $RUN/starting; echo "start $(( $(date +%s) - t0 )) s" ;;
  wait)
    t0=$(date +%s); wait_servers $t0; echo "waited $(( $(date +%s) - t0 )) s" ;;
  measure)
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    res=${RES:-$RUN/res-$(date +%H%M%S)}; mkdir -p $res; t0=$(date +%s)  # RES: `cycle`'s one folder for its rounds
    # one ladder id for every bench of this call and each record's round: make compare pairs them round by round for
    # each ratio's 95% interval (ROUNDS >= 2: start order in odd rounds, reversed in even ones)
    lid=${LADDER_ID:-gpu-$(date +%Y%m%d-%H%M%S)}; rargs=()
    # round 1 starts once every server is ready or gone: a rung still starting (a later SGLang rung under
    # SGL_BUDGET_GB) shares the GPU with the benches (round 1 of results/gpu-sglang-20261207c/ overlapped one)
    t1=$(date +%s); while [ -f $RUN/starting ] && [ $(( $(date +%s) - t1 )) -lt ${WAIT:-120} ]; do sleep 2; done
    (wait_servers $t1 >/dev/null 2>&1)
    for round in $(seq ${ROUNDS:-1}); do
    [ ${ROUNDS:-1} -gt 1 ] && rargs=(--ladder-id $lid --round $round)
    [ -n "${CYCLE_ROUND:-}" ] && rargs=(--ladder-id $lid --round $CYCLE_ROUND)  # `cycle`: one round of its ladder
    while read -r tag v port pid extra <&3; do
      server_sets "$tag" "$v" "$extra" || continue  # ONLY="tag …": bench just those
      for _ in $(seq ${WAIT:-120}); do ready $tag || gone $pid && break; sleep 1; done
      mkdir -p $res/$tag
      if ready $tag; then
        echo "== $tag (round ${CYCLE_ROUND:-$round}) $(date +%T)"
        # the bench warms up with 2 requests at c=1; the first c=8 batch of an MTP server stalled 1.8-3.2 s (one-time
        # compilation for the batched shapes, 2026-11-22): PREWARM=1 sends one c=8 round first (record discarded)
        [ -n "${PREWARM:-}" ] && timeout 120 python3 -m scripts.measure.latency "$v" --base-url http://127.0.0.1:$port \
          --concurrency 8 --modes fixed --limit 8 --max-tokens-cap 32 "${vs[@]}" "${xs[@]}" --out-dir $RUN/prewarm/$tag \
          < /dev/null | grep -E "^fixed|error"
        timeout ${BENCH_LIMIT:-240} python3 -m scripts.measure.latency "$v" --base-url http://127.0.0.1:$port \
          --concurrency 1,8 --modes fixed --server-log $RUN/$tag.log ${BENCH_ARGS:-} "${vs[@]}" "${xs[@]}" \
          "${rargs[@]}" --out-dir $res/$tag < /dev/null || echo "bench $tag failed ($?)"
      else
        echo "== $tag never became healthy"
      fi
      [ "$(cfg "$v" ENGINE)" = sglang ] || sleep 11  # let vLLM's periodic stats (SpecDecoding metrics) reach the log
      { grep -m1 "sglang\|vllm" $RUN/$tag.serve; echo "--- excerpt"; grep -hiE "$EXCERPT" $RUN/$tag.log | grep -v Route | tail -60
        echo "--- tail"; tail -${LOG_TAIL:-40} $RUN/$tag.log; } > $res/$tag/server${CYCLE_ROUND:+-r$CYCLE_ROUND}.log
    done 3< <(if [ $((round % 2)) = 0 ]; then tac $RUN/servers; else cat $RUN/servers; fi)  # ABBA: even rounds reversed
    done
    [ -z "${KEEP:-}" ] && stop_servers
    tar cf $OUT/${TAR:-results}.tar -C $res . && ls -lR $res | head -40
    nvidia-smi --query-gpu=memory.used --format=csv,noheader; echo "measure $(( $(date +%s) - t0 )) s" ;;
  cycle)
    # ROUNDS (default 2) rounds over the specs with one server on the GPU at a time, for a shape of which only one
    # server fits (the 27B shape in BF16 on an H100): each round starts each spec alone (`start`), benches it
    # (`measure`, every record with the cycle's ladder id and its round) and stops it; specs in their order in odd
    # rounds, reversed in even ones. Records gather in one folder, $OUT/${TAR:-results}.tar rewritten after each
    # bench; a spec that does not start is reported, the cycle goes on and exits 1 at the end. Longer than a call: run
    # it under setsid with OUT set to a folder that outlives the call.
    [ $# -gt 0 ] || { echo "cycle: name the specs to measure"; exit 2; }
    for spec in "$@"; do [ -f "experiments/${spec%%+*}/config.env" ] || {
      echo "cycle: no variant ${spec%%+*} (experiments/${spec%%+*}/config.env)"; exit 2; }; done
    [ -s $RUN/servers ] && { echo "cycle: servers of an earlier start are running (bash $0 stop first)"; exit 2; }
    [[ "${PROFILE_ROUNDS:-}" =~ ^[0-9\ ]*$ ]] || { echo "cycle: PROFILE_ROUNDS is round numbers apart by spaces (\"1 2\")"; exit 2; }
    [ -n "${PROFILE_ROUNDS// /}" ] && [[ "${SET:-}" != *SERVE_PROFILER_CONFIG=* ]] && {
      echo "cycle: PROFILE_ROUNDS needs SERVE_PROFILER_CONFIG in SET (scripts/gpu/README.md, \"Peers, profiles and several rounds\")"; exit 2; }
    export LADDER_ID=${LADDER_ID:-gpu-$(date +%Y%m%d-%H%M%S)} RES=${RES:-$RUN/res-$(date +%H%M%S)}; t0=$(date +%s)
    failed=0
    for round in $(seq ${ROUNDS:-2}); do
      order=("$@"); [ $((round % 2)) = 0 ] && mapfile -t order < <(printf '%s\n' "$@" | tac)
      for spec in "${order[@]}"; do
        echo "== cycle round $round: $spec $(date +%T)"
        bash "$0" start "$spec"
        # ONLY emptied: no other server is benched; measure stops it, unless this round profiles it (PROFILE_ROUNDS="1
        # …": with SERVE_PROFILER_CONFIG in SET, `profile` at CONCURRENCY (default 1) after the bench, then `stop`;
        # its records come back as $OUT/profile-r<round>-<spec's tag>.tar)
        prof=; [[ " ${PROFILE_ROUNDS:-} " == *" $round "* ]] && prof=1
        KEEP=$prof ONLY= CYCLE_ROUND=$round ROUNDS=1 bash "$0" measure | tee $RUN/cycle-measure.out
        benched=1; grep -qE "never became healthy|bench .* failed" $RUN/cycle-measure.out && { failed=$((failed + 1)); benched=; }
        if [ -n "$prof" ] && [ -s $RUN/servers ]; then  # a spec `start` did not start has no line: nothing to stop
          if [ -n "$benched" ]; then
            TAR=profile-r$round-$(awk '{print $1; exit}' $RUN/servers) CONCURRENCY=${CONCURRENCY:-1} bash "$0" profile \
              | tee $RUN/cycle-profile.out
            grep -q "profile: some failed" $RUN/cycle-profile.out && failed=$((failed + 1))
          fi
          bash "$0" stop
        fi
        # the next start sizes its budget from the memory free: wait (60 s at most) until the stopped one freed it
        for _ in $(seq 60); do [ "$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)" \
          -lt 1024 ] 2>/dev/null && break; sleep 1; done
      done
    done
    echo "cycle $(( $(date +%s) - t0 )) s, $failed bench(es) or profile(s) that did not run"; [ $failed = 0 ] ;;
  redistill)
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1; embedded_gguf
    v=$1; mkdir -p $RUN /root/heads .cache/prompts; rm -f /root/heads/DONE
    for f in $STAGE/prompts/*.jsonl.gz; do [ -f "$f" ] && gunzip -c "$f" > .cache/prompts/$(basename "$f" .gz); done
    build "$(cfg $v PARENT)" || exit 1
    (setsid bash -c '
      v=$0; t0=$(date +%s)
      if [ -n "${ANSWERS:-}" ]; then  # answers generated by an earlier lease (its answers.npz, carried)
        echo "== answers from $ANSWERS"
        python3 -m scripts.levers.speculate.redistill "$v" --answers "$ANSWERS" --generate-only \
          || { echo "unpacking the answers failed"; touch /root/heads/DONE; exit 1; }
      else
        echo "== generate $(date +%T)"
        python3 -m scripts.levers.speculate.redistill "$v" --generate-only --concurrency ${GEN_CONCURRENCY:-256} \
          --target-set SERVE_MAX_NUM_SEQS=${GEN_CONCURRENCY:-256} --target-set SERVE_GPU_MEMORY_UTILIZATION=0.6 \
          --target-set SERVE_ENFORCE_EAGER=${GEN_EAGER:-0} \
          || { echo "generation failed"; touch /root/heads/DONE; exit 1; }
        cp .cache/redistill-*.log /root/heads/ 2>/dev/null
        # the answers come back with the heads (~10x smaller than responses.json): a later lease trains from them
        # (ANSWERS=…) instead of generating again
        python3 -m scripts.levers.speculate.redistill "$v" --export-answers /root/heads/answers.npz
      fi
      # a later call may change the plan while the answers are generated: /root/run/heads holds HEADS, /root/run/deadline DEADLINE
      [ -f /root/run/heads ] && HEADS=$(cat /root/run/heads); [ -f /root/run/deadline ] && DEADLINE=$(cat /root/run/deadline)
      [ "${HEADS:-}" = "-" ] && { echo "== generated only"; touch /root/heads/DONE; exit 0; }
      # DEADLINE (epoch seconds): every head stops training 90 s before it (validation and writing follow)
      budget=(); [ -n "${DEADLINE:-}" ] && budget=(--set REDISTILL_MAX_SECONDS=$(( DEADLINE - $(date +%s) - 90 )))
      echo "== train $(date +%T): ${HEADS:-full:} ${budget[*]}"
      for h in ${HEADS:-full:}; do tag=${h%%:*}; rest=${h#*:}; n=${rest%%:*}; xs=()
        [ "$rest" != "$n" ] && { e=${rest#*:}; for kv in ${e//,/ }; do xs+=(--set "$kv"); done; }
        # a snapshot every SNAPSHOT_EVERY s (/root/heads/$tag.snapshot), which every `poll` returns: a lost machine
        # loses the training since the last poll, not the run (2026-11-25: a lease lost two heads 24 min in)
        # RANKS=N: each head trains data-parallel in N processes on the GPU (redistill.ranks)
        launch=(python3); [ "${RANKS:-1}" -gt 1 ] && launch=(python3 -m torch.distributed.run --standalone --nproc-per-node $RANKS)
        "${launch[@]}" -m scripts.levers.speculate.redistill "$v" ${STEPS:+--steps $STEPS} --out /root/heads/$tag \
          --set REDISTILL_MAX_TRAIN_TOKENS=$n --set REDISTILL_SNAPSHOT_EVERY=${SNAPSHOT_EVERY:-240} "${budget[@]}" \
          "${xs[@]}" > /root/heads/train-$tag.log 2>&1 &
      done; wait
      echo "== done $(date +%T) after $(( $(date +%s) - t0 )) s"; touch /root/heads/DONE
    ' "$v" > $RUN/redistill.out 2>&1 < /dev/null &)
    sleep 20; cat $RUN/redistill.out ;;
  probe)
    # [SETS="K=V …"] bash scripts/gpu/device.sh probe: training speed without generating: smollm2-bf16-eagle4's
    # head trained for 60 steps on the carried tiny answers ($STAGE/ans/tiny.npz), once per SETS entry
    # ("A=1,B=2 C=3": two runs), while a `redistill` generation may already run
    export PYTHONPATH=$PKGS:$PWD; embedded_gguf
    build smollm2-bf16 || exit 1
    for e in ${SETS:-REDISTILL_PACK_TOKENS=8192}; do xs=(); for kv in ${e//,/ }; do xs+=(--set "$kv"); done
      echo "== probe $e"; timeout 300 python3 -m scripts.levers.speculate.redistill smollm2-bf16-eagle4 --budget tiny \
        --answers $STAGE/ans/tiny.npz --steps 60 --out /root/probe "${xs[@]}" 2>&1 | tr '\r' '\n' | grep -v "it/s\]\|^\s*$" | tail -5
      python3 -c "import json; c=json.load(open('/root/probe/PROVENANCE.json'))['curve']; print([(p['step'], p.get('seconds')) for p in c])"
    done ;;
  poll)
    for _ in $(seq ${WAIT:-500}); do [ -f /root/heads/DONE ] && break; sleep 1; done
    tail -${LOG_TAIL:-30} $RUN/redistill.out; for f in /root/heads/train-*.log; do echo "--- $f"; tr '\r' '\n' < $f | grep -v "^\s*$" | tail -4; done
    nvidia-smi --query-gpu=memory.used,utilization.gpu --format=csv,noheader
    if [ ! -f /root/heads/DONE ]; then  # the heads' latest snapshots and logs, each call (REDISTILL_INIT= goes on)
      # tarred to a temp name and kept only whole: a snapshot may be replaced while tar reads it; 15 MiB pieces
      # $OUT/snapshots.tar.NN (a 20 MB snapshots.tar did not come back: "size", 2026-11-26); cat them to untar
      (cd /root/heads && ls -d *.snapshot >/dev/null 2>&1 && tar cf /root/snap.tmp *.snapshot train-*.log \
        && split -b 15M -d -a 2 /root/snap.tmp $OUT/snapshots.tar. && rm /root/snap.tmp && ls -la $OUT/snapshots.tar.* \
        && grep -H '^ "steps"' *.snapshot/PROVENANCE.json)
    else  # a call returns at most 64 MiB: PIECES="04 05 …" fetches the rest
      ls /root/hp.* >/dev/null 2>&1 || tar cf - -C /root heads | split -b 15M -d -a 2 - /root/hp.
      ls -la /root/hp.*; for p in ${PIECES:-00 01 02 03}; do [ -f /root/hp.$p ] && cp /root/hp.$p $OUT/heads.tar.$p; done
    fi ;;
  scale)
    # [SCALE_ARGS="--replicas 2 --share-gpu …"] bash scripts/gpu/device.sh scale V: scripts.measure.scale on V (one
    # server, replicas behind vllm-router per policy, the router's c=1 overhead); vllm-router, orjson and setproctitle
    # travel as wheels in the payload's whl/ (setup installs them; vllm-router's command lands in /root/extra/bin).
    # Records, summary and log tails: $OUT/scale.tar
    export PYTHONPATH=$PKGS:$PWD PATH=$EXTRA/bin:$PATH
    python3 -c "import vllm_router" || { echo "vllm-router missing: add its wheels to the payload's whl/"; exit 1; }
    build "$1" || exit 1
    d=$RUN/scale-$1; mkdir -p $d
    python3 -m scripts.measure.scale "$1" --out-dir $d --overhead-dir $d/overhead --summary-out $d/summary.md \
      ${SCALE_ARGS:-}; rc=$?
    for f in .cache/replicas/*.log .cache/bench-"$1".log; do [ -f "$f" ] && tail -${LOG_TAIL:-60} "$f" > $d/$(basename "$f").tail; done
    tar cf $OUT/scale.tar -C $RUN scale-$1 && tar tf $OUT/scale.tar | tail -30; exit $rc ;;
  stop)
    stop_servers; nvidia-smi --query-gpu=memory.used --format=csv,noheader ;;
  reliability)
    # [ONLY="tag …"] [SOAK_ARGS=…] [FUZZ_ARGS="--cases 60"] bash scripts/gpu/device.sh reliability   # the servers `start`
    # left running, each in turn: the bounded soak (SOAK_ARGS, default 40 requests a level), the storm (c=32 × 200) and
    # the body fuzz (250 bodies unless FUZZ_ARGS; ~1 s a body against SGLang, whose /health generates a token)
    # (scripts.measure.soak / fuzz with --base-url, its RSS from its process group, its start extras as --set so the
    # records name them); they keep running. Records come back as $OUT/${TAR:-reliability}.tar
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    res=$RUN/rel-$(date +%H%M%S); mkdir -p $res; t0=$(date +%s)
    while read -r tag v port pid extra <&3; do
      server_sets "$tag" "$v" "$extra" || continue
      ready $tag || { echo "== $tag is not ready"; continue; }
      url=http://127.0.0.1:$port; mkdir -p $res/$tag; echo "== $tag $(date +%T)"
      # the engine's own process group: scripts.serve starts it in a session of its own (its pid here is the wrapper's,
      # whose 27 MiB the first run sampled as the server's RSS, 2026-12-06)
      eng=$(pgrep -P $pid | head -1); eng=${eng:-$pid}
      sa=${SOAK_ARGS:---requests 40 --timeout 120}
      # RUNS="fuzz": some of them (the fuzz, one small body at a time, may run while other rungs start)
      runs=" ${RUNS:-soak storm fuzz} "
      [[ "$runs" == *" soak "* ]] && timeout 600 python3 -m scripts.measure.soak "$v" \
        --base-url $url --server-pid $eng $sa "${vs[@]}" "${xs[@]}" --out-dir $res/$tag < /dev/null 2>&1 | tail -4
      [[ "$runs" == *" storm "* ]] && timeout 600 python3 -m scripts.measure.soak "$v" \
        --base-url $url --server-pid $eng --mix storm --concurrency 32 --requests 200 --timeout 120 "${vs[@]}" \
        "${xs[@]}" --out-dir $res/$tag < /dev/null 2>&1 | tail -4
      [[ "$runs" == *" fuzz "* ]] && timeout 600 python3 -m scripts.measure.fuzz "$v" \
        --base-url $url ${FUZZ_ARGS:-} "${vs[@]}" "${xs[@]}" --out-dir $res/$tag < /dev/null 2>&1 | tail -4
      { grep -m1 "sglang\|vllm" $RUN/$tag.serve; echo "--- tail"; tail -${LOG_TAIL:-60} $RUN/$tag.log; } > $res/$tag/server.log
      # each server's records come back even if a later one outlasts the call (a cut call returns what $OUT holds;
      # a folder two deep there did not come back, 2026-12-06)
      mkdir -p $OUT/$tag && cp $res/$tag/* $OUT/$tag/
    done 3< $RUN/servers
    tar cf $OUT/${TAR:-reliability}.tar -C $res . && ls -lR $res | head -30; echo "reliability $(( $(date +%s) - t0 )) s" ;;
  profile)
    # SET="…the start SET, with SERVE_PROFILER_CONFIG…" [CONCURRENCY=1,8] [PROFILE_ARGS=…] bash scripts/gpu/device.sh profile
    # The servers `start` left running, profiled one after another (scripts/measure/profile_matrix.sh, scripts.measure.profile
    # at c=1,8); records + markdown tables come back as $OUT/${TAR:-profile}.tar, raw traces stay in the profiler's
    # folder here. The servers keep running: `measure` afterwards benches and stops them.
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    res=$RUN/prof-res-$(date +%H%M%S); mkdir -p $res; t0=$(date +%s)
    while read -r tag v port pid extra; do
      for _ in $(seq ${WAIT:-120}); do ready $tag || gone $pid && break; sleep 1; done
      ready $tag || echo "== $tag never became healthy"
    done < $RUN/servers
    # ONLY="tag …": profile just those servers (the others keep running for `measure`)
    awk -v only="${ONLY:-}" 'only == "" || index(" " only " ", " " $1 " ")' $RUN/servers > $RUN/servers.profile
    SERVERS=$RUN/servers.profile OUT_DIR=$res PYTHON=python3 bash scripts/measure/profile_matrix.sh || echo "profile: some failed"
    tar cf $OUT/${TAR:-profile}.tar -C $res . && ls -lR $res | head -40
    du -sh /root/run/prof* 2>/dev/null; echo "profile $(( $(date +%s) - t0 )) s" ;;
  hostsample)
    # [ONLY="tag …"] [CONCURRENCY=1] [HOST_ARGS=…] bash scripts/gpu/device.sh hostsample
    # scripts.measure.host_sample on each server `start` left running: py-spy (its wheel in the payload's whl/, its
    # command in $EXTRA/bin) over the API server, the engine core and a worker while c requests decode; the records
    # come back as $OUT/${TAR:-hostsample}.tar. The servers keep running.
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    [ -x $EXTRA/bin/py-spy ] || { echo "py-spy missing: add its wheel (requirements/cpu.txt's pin) to the payload's whl/"; exit 1; }
    res=$RUN/host-res-$(date +%H%M%S); mkdir -p $res; t0=$(date +%s)
    while read -r tag v port pid extra <&3; do
      server_sets "$tag" "$v" "$extra" || continue
      ready $tag || { echo "== $tag is not ready"; continue; }
      # $pid is the wrapper's (scripts.serve); its child, the API server, leads the server's process group
      api=$(pgrep -P $pid | head -1); [ -n "$api" ] || { echo "== $tag: no server process under pid $pid"; continue; }
      echo "== $tag $(date +%T)"; mkdir -p $res/$tag
      timeout 300 python3 -m scripts.measure.host_sample "$v" --base-url http://127.0.0.1:$port --server-pid $api \
        --py-spy $EXTRA/bin/py-spy --concurrency ${CONCURRENCY:-1} ${HOST_ARGS:-} "${vs[@]}" "${xs[@]}" \
        --out-dir $res/$tag < /dev/null > $res/$tag/host_sample.out 2>&1; echo "host_sample rc=$?"
      tail -12 $res/$tag/host_sample.out
      # each server's record comes back even if a later one outlasts the call
      mkdir -p $OUT/$tag && cp $res/$tag/* $OUT/$tag/
    done 3< $RUN/servers
    tar cf $OUT/${TAR:-hostsample}.tar -C $res . && ls -lR $res | head -20; echo "hostsample $(( $(date +%s) - t0 )) s" ;;
  bake)
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1
    embedded_gguf
    mkdir -p /root/bake/results; t0=$(date +%s)
    for v in "$@"; do
      echo "== $v $(date +%T)"; build "$v" || continue
      # BAKE_ARGS is split like a command line (eval): --device-name 'NVIDIA H200' keeps its quotes
      eval "timeout ${BAKE_LIMIT:-900} python3 -m scripts.levers.cache.bake $v --out /root/bake/$v${BAKE_TAG:-}.tar.gz ${BAKE_ARGS:---measure-warm}" \
        || echo "bake $v failed ($?)"
      cp -r results/cold-start-cuda-* /root/bake/results/ 2>/dev/null
    done
    ls -la /root/bake; tar cf $OUT/bake.tar -C /root/bake results 2>/dev/null; echo "bake $(( $(date +%s) - t0 )) s" ;;
  startc)
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1; embedded_gguf
    mkdir -p /root/bake/results; build "$1" || exit 1
    python3 - "$1" "$2" <<'PY'
import datetime as dt, json, os, subprocess, sys
from pathlib import Path
from scripts.levers.cache.bake import timed_start
from scripts.serve.compile_cache import IMPORTS, cache_env, import_cache, now_stamp, read_manifest
from scripts.common.records import git_state, hardware, versions
from scripts.common.variants import load_variant

v, tar = load_variant(sys.argv[1]), Path(sys.argv[2])
shim, force = os.environ.get("LAB_CACHE_SHIM") == "1", os.environ.get("FORCE") == "1"
env, msg = import_cache(tar, v, shim=shim)
print(msg, flush=True)
if force and not env:  # the tarball's caches without the shim: does the real name miss?
    import hashlib, tarfile
    root = IMPORTS / ("forced-" + hashlib.sha256(tar.read_bytes()).hexdigest()[:16])
    if not root.exists():
        with tarfile.open(tar, "r:gz") as t:
            t.extractall(root, filter="data")
    env = cache_env(root / "caches", v.target)
    msg += f"; FORCE=1: caches used anyway from {root}"
home = Path.home()
dirs = [Path(p) for k, p in env.items() if k.endswith(("_DIR", "_ROOT", "_PATH", "_BASE")) and k != "PYTHONPATH"] or [
    home / ".cache/vllm", home / ".triton/cache", Path("/tmp/torchinductor_root"), home / ".nv/ComputeCache",
    home / ".cache/flashinfer"]
def sizes():
    return {str(d): int(subprocess.run(["du", "-sb", str(d)], capture_output=True, text=True).stdout.split()[0])
            if d.exists() else 0 for d in dirs}
before = sizes()
tag = "-".join(["shim" if shim else "plain", *(["forced"] if force else [])])
log = Path(f"/root/bake/{v.name}-from-{tag}.log")
rec, _ = timed_start(v, env, log, 8127, warm=False)
record = {"kind": "startup", "variant": v.name, "start": f"from tarball, {tag}", "message": msg,
          "tarball": str(tar), "manifest": {k: x for k, x in read_manifest(tar).items() if k != "bake_start"},
          "config": dict(v.resolved), "git": git_state(), "versions": versions(), "hardware": hardware(),
          "cache_bytes_before": before, "cache_bytes_after": sizes(), **rec}
rdir = Path(f"/root/bake/results/cold-start-cuda-{dt.datetime.now(dt.UTC):%Y%m%d}"); rdir.mkdir(parents=True, exist_ok=True)
(rdir / f"startup_{v.name}_from-{tag}_{now_stamp()}.json").write_text(json.dumps(record, indent=1) + "\n")
(rdir / f"{v.name}-from-{tag}.log").write_text(log.read_text(errors="replace"))
print(f"healthy after {rec['ready_s']} s; reported {rec['reported_s']}; bytes {before} -> {record['cache_bytes_after']}")
PY
    ;;
  gemm)
    # The kernel wheels (gemlite, torchao, MSLK, FBGEMM GenAI, humming-kernels + pyelftools, conch-triton-kernels) go to
    # their own folder, on PYTHONPATH for this step only: gemlite's wheel declares a vllm.general_plugins entry point
    # that would load into every vLLM server of the lease from /root/extra. GEMM_LIMIT (s) stops the bench with SIGTERM
    # first; it then writes the rows measured so far.
    mkdir -p $KERNELS; new=()  # a wheel installed by an earlier call of the lease is not installed again
    for w in .gpu/whl-kernels/*.whl; do [ -f "$w" ] && [ ! -f "$KERNELS/.done-$(basename "$w")" ] && new+=("$w"); done
    if [ ${#new[@]} -gt 0 ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $KERNELS "${new[@]}" || exit 1
      for w in "${new[@]}"; do touch "$KERNELS/.done-$(basename "$w")"; done
    fi
    ls $KERNELS | grep dist-info | tr '\n' ' '; echo
    [ -n "${NORUN:-}" ] && exit 0
    [ -d $SITE/vllm ] || echo "no vLLM bundle in $SITE (recv + setup first): the vllm-* rows will say unavailable"
    export PYTHONPATH=$PKGS:$KERNELS:$PWD PYTHONFAULTHANDLER=1
    nvidia-smi --query-gpu=name,memory.used,memory.total,clocks.sm,clocks.mem --format=csv,noheader
    timeout -s TERM ${GEMM_LIMIT:-560} python3 -m scripts.measure.gemm_bench --out $OUT ${GEMM_ARGS:-}; rc=$?
    ls -la $OUT; exit $rc ;;
  make)
    # bash scripts/gpu/device.sh make TARGET [VAR=…]: any make target in the shimmed environment, in the foreground
    # (≤ 10 min a call), e.g. `make failover VARIANT=… REPLICAS=2`; its records land in experiments/ of this tree:
    # `find experiments -newer …` them into $OUT as the step's last line does
    export PYTHONPATH=$PKGS:$PWD PYTHONFAULTHANDLER=1 PATH=$EXTRA/bin:$PATH; embedded_gguf; shims || exit 1
    touch $RUN/make.start; make --no-print-directory "$@"; rc=$?
    find experiments results -newer $RUN/make.start -type f | tar cf $OUT/make.tar -T - && tar tf $OUT/make.tar; exit $rc ;;
  wheels)
    # bash scripts/gpu/device.sh wheels DIR: the carried wheels in DIR replace their packages in /root/extra (a version
    # the payload got wrong, without sending the payload again)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target $EXTRA "${1:?DIR}"/*.whl && ls $EXTRA | grep dist-info | tr '\n' ' ' ;;
  optimize)
    # The Makefile's environments (.venv, .venv-quant) are the bundle here: a python3 shim each and their stamps, so
    # `make optimize` and every make target it runs take the same path as on a user's machine.
    base=${1:?BASE}; shift
    # an earlier run still going is stopped first (SIGTERM: its step stops its servers, the pool is stopped; the state
    # keeps every finished step for this run)
    if running optimize; then
      # the whole group: make and the runner outlive the bash that leads it while they stop their servers
      kill -TERM -- -"$(cat $RUN/optimize.pid)"; for _ in $(seq 600); do kill -0 -- -"$(cat $RUN/optimize.pid)" 2>/dev/null || break; sleep 1; done
      echo "stopped the earlier run"; fi
    into_lab || exit 1
    in_background optimize "make --no-print-directory optimize BASE=$base $(printf '%q ' "$@")"
    sleep 20; cat $RUN/optimize.out ;;
  follow)
    # `attach optimize`, plus the run's plan, state and step logs
    base=${1:?BASE}; cd $LAB || exit 1
    follow_run optimize eval/optimize/$base.*yaml .cache/optimize/$base/state.json .cache/optimize/$base/logs ;;
  detach)
    # bash scripts/gpu/device.sh detach TAG 'COMMAND': a bash command line (make targets, python -m scripts...) in the
    # background under setsid, in its own copy of the tree (/root/lab, as `optimize`), with the bundle's environment and
    # the Makefile's shims; it outlives the call and the next ones (`attach TAG` follows it). Returns after ~15 s.
    tag=${1:?TAG}; shift
    if running "$tag"; then echo "$tag is still running"; exit 1; fi
    into_lab || exit 1
    in_background "$tag" "$*"
    sleep ${SETTLE:-15}; tail -20 $RUN/$tag.out ;;
  attach)
    # [WAIT=500] bash scripts/gpu/device.sh attach TAG [PATH…]: the detached command's output so far, until it ends or
    # WAIT s pass; what it wrote under experiments/, results/ and eval/optimize/, the tails of the servers' logs
    # (.cache/**/*.log), its output and the PATHs (a folder outside the tree, e.g. a cycle's OUT=/root/meas) come
    # back as $OUT/TAG.tar after every call, so a machine taken back loses no finished step
    tag=${1:?TAG}; shift; cd $LAB || exit 1
    follow_run "$tag" "$@" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
