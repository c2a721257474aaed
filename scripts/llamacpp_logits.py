"""llama.cpp's next-token logits over token chunks; runs in .venv-llamacpp (scripts.eval_parity calls it).

    .venv-llamacpp/bin/python -m scripts.llamacpp_logits model.gguf chunks.json OUT_DIR [THREADS]

chunks.json is a list of token-id lists of one length (ctx). For chunk i it writes OUT_DIR/<i:04d>.npy: float32
[ctx/2, vocab], the logits that predict the second half of the chunk (positions ctx/2-1 … ctx-2), the positions
eval_parity scores. The ids go in as they are (no BOS added), as the reference sees them. Imports only llama_cpp and
numpy.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) not in (3, 4):
        print("usage: python -m scripts.llamacpp_logits MODEL.gguf CHUNKS.json OUT_DIR [THREADS]", file=sys.stderr)
        return 2
    model, chunks_path, out = args[0], Path(args[1]), Path(args[2])
    threads = int(args[3]) if len(args) == 4 else (os.cpu_count() or 1)
    import numpy as np
    from llama_cpp import Llama

    chunks = json.loads(chunks_path.read_text())
    ctx = len(chunks[0])
    llm = Llama(model_path=model, n_ctx=ctx, n_batch=ctx, n_ubatch=ctx, logits_all=True, n_threads=threads,
                n_threads_batch=threads, verbose=False)
    for i, chunk in enumerate(chunks):
        llm.reset()
        llm.eval(chunk)
        half = len(chunk) // 2
        logits = np.asarray(llm.scores[half - 1:len(chunk) - 1], dtype=np.float32)
        tmp = out / f".{i:04d}.npy"
        np.save(tmp, logits)
        tmp.replace(out / f"{i:04d}.npy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
