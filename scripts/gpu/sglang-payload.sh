#!/usr/bin/env bash
# SGLang 0.5.17 for the lent GPU machine (Python 3.12, torch 2.11 + CUDA 13, no network): the wheels `device.sh setup`
# installs into /root/sgl (its own folder: SGLang pins transformers 5.12.1, the machine has 5.17), ~66 MiB.
#
#   bash scripts/gpu/sglang-payload.sh .gpu/sglang      # here, once; then add `sglang` to the payload tar
#
# Only what SGLang's server imports and neither the machine's image nor the vLLM bundle holds (found by reading its
# module-level imports from launch_server down to the Qwen3.5 model and checked there by importing them, 2026-11-27):
#   sglang 0.5.17            the newest SGLang whose pins fit torch 2.11 (sglang-kernel 0.4.5; 0.5.23 pins torch 2.14.1)
#   transformers 5.12.1      SGLang's pin; tokenizers 0.22.2 because transformers 5.12.1 wants tokenizers <= 0.23.0
#   apache-tvm-ffi 0.1.11    SGLang's pin (its JIT kernels; the vLLM bundle carries 0.1.10 for FlashInfer 0.6.14)
#   ipython + its needs      `import sglang` reaches sglang/utils.py, which imports IPython.display at module level
#   orjson, zstandard        imported by the HTTP server (entrypoints/http_server.py, http_request_decompression.py)
#   soundfile 0.13.1         imported through the server's transcription route (openai/realtime/session.py)
#   sgl-deep-gemm 0.1.5.post1  SGLang's pin: its speculative (MTP/EAGLE) worker imports the sparse-attention backend
#                            (layers/attention/dsa_backend.py: `import deep_gemm` on CUDA) while capturing its draft
#                            graphs; without it every MTP rung died there (2026-12-06, results/gpu-sglang-20261206/)
# sglang-kernel 0.4.5 (383 MB) is slimmed to 15 MB: FlashAttention-3 (flash_ops, 1.1 GB unpacked), FlashMLA, InfLLM and
# the sm100 build are left out, so SGLang runs Triton attention there (SGLANG_ATTENTION_BACKEND=triton in the variants).
set -euo pipefail
out=${1:?usage: sglang-payload.sh OUTDIR}
plat=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_34_x86_64
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
      --platform manylinux1_x86_64)
pkgs=(sglang==0.5.17 transformers==5.12.1 tokenizers==0.22.2 apache-tvm-ffi==0.1.11 orjson==3.13.0 zstandard==0.25.0
  soundfile==0.13.1 ipython==9.18.1 ipython-pygments-lexers==1.1.1 jedi==0.20.1 parso==0.8.7 matplotlib-inline==0.2.2
  pexpect==4.9.0 ptyprocess==0.7.0 prompt-toolkit==3.0.53 wcwidth==0.9.4 stack-data==0.6.3 executing==2.3.0
  asttokens==3.0.2 pure-eval==0.2.4 traitlets==5.16.1 decorator==5.3.1 sgl-deep-gemm==0.1.5.post1)
mkdir -p "$out/kernel-slim"
python3 -m pip download -q "${plat[@]}" -d "$out" "${pkgs[@]}"
work=$(mktemp -d)
python3 -m pip download -q "${plat[@]}" -d "$work" sglang-kernel==0.4.5
python3 - "$work"/sglang_kernel-0.4.5-*.whl "$out/kernel-slim" <<'PY'
import sys, zipfile
from pathlib import Path
src, dst = Path(sys.argv[1]), Path(sys.argv[2]) / Path(sys.argv[1]).name
drop = ("sgl_kernel/flash_ops.abi3.so", "sgl_kernel/flashmla_ops.abi3.so", "sgl_kernel/infllm_ops", "sgl_kernel/sm100/")
with zipfile.ZipFile(src) as zi, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zo:
    for info in zi.infolist():
        if info.filename.startswith(drop):
            continue
        data = zi.read(info)
        if info.filename.endswith(".dist-info/RECORD"):  # the dropped files leave the wheel's file list too
            data = "".join(l for l in data.decode().splitlines(True) if not l.startswith(drop)).encode()
        zo.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
print(f"{dst}: {dst.stat().st_size / 2**20:.1f} MiB")
PY
rm -rf "$work"
du -sh "$out"
