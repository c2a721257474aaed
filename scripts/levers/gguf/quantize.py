"""llama.cpp's quantizer on one GGUF file; runs in .venv-llamacpp (scripts.levers.gguf.export calls it).

    .venv-llamacpp/bin/python -m scripts.levers.gguf.quantize in-bf16.gguf out-q8_0.gguf Q8_0

TYPE is a llama.cpp file type as `llama-quantize` names it (Q8_0, Q4_K_M, Q4_0, …): llama_cpp's
LLAMA_FTYPE_MOSTLY_<TYPE>. Imports nothing but llama_cpp (the only package of that environment it needs).
"""

from __future__ import annotations

import ctypes
import os
import sys


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: python -m scripts.levers.gguf.quantize SRC.gguf DEST.gguf TYPE", file=sys.stderr)
        return 2
    src, dest, kind = args
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{kind.upper()}", None)
    if ftype is None:
        known = sorted(k[len("LLAMA_FTYPE_MOSTLY_"):] for k in dir(llama_cpp) if k.startswith("LLAMA_FTYPE_MOSTLY_"))
        print(f"error: llama.cpp has no file type {kind!r}; known: {', '.join(known)}", file=sys.stderr)
        return 2
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    rc = llama_cpp.llama_model_quantize(src.encode(), dest.encode(), ctypes.byref(params))
    if rc != 0:
        print(f"error: llama_model_quantize returned {rc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
