"""llama.cpp's logits, in-process; runs in .venv-llamacpp (scripts.measure.parity and scripts.measure.quality call it).

    .venv-llamacpp/bin/python -m scripts.levers.gguf.logits model.gguf chunks.json OUT_DIR [THREADS]
    .venv-llamacpp/bin/python -m scripts.levers.gguf.logits score model.gguf requests.json OUT.json [THREADS]

chunks.json is a list of token-id lists of one length (ctx). For chunk i it writes OUT_DIR/<i:04d>.npy: float32
[ctx/2, vocab], the logits that predict the second half of the chunk (positions ctx/2-1 … ctx-2), the positions
measure.parity scores.

`score` is lm-eval's log-likelihood request: requests.json is a list of [context ids, continuation ids]; OUT.json gets
[sum of the continuation's log-probabilities, whether every continuation token is the argmax] per request. Requests
are evaluated in the order of their ids so that choices sharing a context reuse its KV cache (the shared prefix is not
evaluated again, but for its last token where only one would be left). llama-cpp-python's server answers the same
question (echo + logprobs) by sorting the whole vocabulary in Python for every prompt token (the suite's 6 longest
requests took 4 min 22 s there), so lm-eval's log-likelihoods of a GGUF come from this path.

The ids go in as they are (no BOS added), as the reference sees them. Imports only llama_cpp and numpy; `run` (the
caller's side, in .venv) starts it in .venv-llamacpp.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def load(model: str, ctx: int, threads: int, batch: int | None = None):
    from llama_cpp import Llama

    return Llama(model_path=model, n_ctx=ctx, n_batch=batch or ctx, n_ubatch=batch or ctx, logits_all=True,
                 n_threads=threads, n_threads_batch=threads, verbose=False)


def chunk_logits(model: str, chunks_path: Path, out: Path, threads: int) -> None:
    import numpy as np

    chunks = json.loads(chunks_path.read_text())
    ctx = len(chunks[0])
    llm = load(model, ctx, threads)
    for i, chunk in enumerate(chunks):
        llm.reset()
        llm.eval(chunk)
        half = len(chunk) // 2
        logits = np.asarray(llm.scores[half - 1:len(chunk) - 1], dtype=np.float32)
        tmp = out / f".{i:04d}.npy"
        np.save(tmp, logits)
        tmp.replace(out / f"{i:04d}.npy")


def score(model: str, requests_path: Path, out: Path, threads: int) -> None:
    import numpy as np

    requests = json.loads(requests_path.read_text())
    longest = max(len(c) + len(x) for c, x in requests)
    llm = load(model, longest, threads, batch=min(longest, 512))
    results: list[list] = [[]] * len(requests)
    previous: list[int] = []
    for i in sorted(range(len(requests)), key=lambda k: requests[k][0] + requests[k][1]):
        context, continuation = requests[i]
        seq = context + continuation
        shared = next((k for k, (a, b) in enumerate(zip(previous, seq, strict=False)) if a != b), min(len(previous), len(seq)))
        if shared < len(seq):
            # never a one-token step after a reused prefix: on a two-core AVX2 EPYC (llama-cpp-python 0.3.36, Q4_1) a
            # one-token decode reading a position another one-token decode wrote moved log-probabilities by up to
            # 0.84 nats against one batch; steps of two or more tokens equal the one batch there
            shared = max(0, min(shared, len(seq) - 2))
            llm.n_tokens = shared  # eval() drops the KV cache past it
            llm.eval(seq[shared:])
        logits = np.asarray(llm.scores[len(context) - 1:len(seq) - 1], dtype=np.float64)
        top = logits.max(axis=1, keepdims=True)
        logprobs = logits - top - np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
        picked = logprobs[np.arange(len(continuation)), continuation]
        results[i] = [float(picked.sum()), bool((logits.argmax(axis=1) == continuation).all())]
        previous = seq
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(results))
    tmp.replace(out)


def run(args: list[str]) -> None:
    """This module with ARGS in llama.cpp's environment (the caller's side); EngineError when it fails."""
    from scripts.common.engines import run_module  # here, not above: the llama.cpp side imports nothing of the project

    run_module("llamacpp", "scripts.levers.gguf.logits", args)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    scoring = bool(args) and args[0] == "score"
    rest = args[1:] if scoring else args
    if len(rest) not in (3, 4):
        print("usage: python -m scripts.levers.gguf.logits [score] MODEL.gguf IN.json OUT [THREADS]", file=sys.stderr)
        return 2
    threads = int(rest[3]) if len(rest) == 4 else (os.cpu_count() or 1)
    (score if scoring else chunk_logits)(rest[0], Path(rest[1]), Path(rest[2]), threads)
    return 0


if __name__ == "__main__":
    sys.exit(main())
