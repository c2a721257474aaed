"""SGLang's `python -m sglang.launch_server`, with multimodal off unless asked: a VLM checkpoint served text-only.

    python scripts/gpu/sglang_text_only.py --model-path weights/qwen35-4b-proxy --port 8300 \
        --attention-backend triton --sampling-backend pytorch --grammar-backend none

SGLang 0.5.17 decides multimodal from the architecture (Qwen3_5ForConditionalGeneration: on, srt/configs/
model_config.py) and has no flag to turn it off: `--enable-multimodal` is a store_true over a None default that means
"auto" (srt/server_args.py, srt/arg_groups/arg_utils.py), and `--language-only` belongs to encoder disaggregation. On,
its tokenizer process loads the Qwen3-VL image/video processor, which the shape proxy does not ship and text requests
never use. This launcher changes only that default to False before the arguments are parsed (ServerArgs.__post_init__
derives chunked prefill, CUDA graphs and the processor from it), so the choice travels in server_args to every
process; `--enable-multimodal` still turns it on. The vLLM variants' counterpart is SERVE_LANGUAGE_MODEL_ONLY=1.
SGLang's Qwen3.5 class still builds the vision tower (random, never run; ~0.6 GB of the weights budget).
Everything else is launch_server's own __main__ (plugins, run_server, child cleanup). LAB_SGLANG_API_KEY, if set,
becomes `--api-key` in-process (never in argv).

LAB_SGLANG_MIDDLEWARE (comma-separated "module.Class" paths, as vLLM's `--middleware` takes them) adds pure ASGI
middleware to SGLang's own FastAPI app before it serves: the serve plan puts the lab's RequestGuard there
(scripts/serve/guard.py; REQUEST_GUARD=0 in config.env leaves it out), in SGLang's process, with no second hop.
SGLang has no hook of its own for it. Added before launch_server adds its key check, the guard sits inside it: a
request without the key is refused before the guard reads its body. SGLang serves that app object itself only with
one tokenizer worker (with several, uvicorn, or Granian under --enable-http2, imports `http_server:app` by its module
path in each worker, without the middleware), so a guarded server with SGLANG_TOKENIZER_WORKER_NUM above 1 is refused
at start.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

# Run as a script, Python puts only scripts/gpu on the path: the repository goes first, so the middleware named in
# LAB_SGLANG_MIDDLEWARE (scripts.serve.guard) imports wherever the engine's Python runs, with or without PYTHONPATH
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.serve.guard import SGLANG_MIDDLEWARE_ENV as MIDDLEWARE_ENV  # noqa: E402  (the one name, set by the plan)


def text_only_default() -> None:
    """Make --enable-multimodal default to False (not None = auto) in every parser SGLang builds from ServerArgs."""
    from sglang.srt.server_args import ServerArgs

    add_cli_args = ServerArgs.add_cli_args

    def add_text_only(parser):
        add_cli_args(parser)
        parser.set_defaults(enable_multimodal=False)

    ServerArgs.add_cli_args = staticmethod(add_text_only)


def middleware_classes(spec: str) -> list:
    """The classes named by "module.Class,module.Class" (LAB_SGLANG_MIDDLEWARE), imported; empty for an empty spec."""
    import importlib

    out = []
    for path in filter(None, (p.strip() for p in spec.split(","))):
        module, _, name = path.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError, ValueError) as e:
            raise SystemExit(f"{MIDDLEWARE_ENV}: {path!r} is no importable module.Class ({e})") from None
    return out


def add_middleware(app, classes: list, tokenizer_workers: int) -> None:
    """Each class as ASGI middleware of SGLang's app (the last one outermost, as Starlette adds them); SystemExit
    with one line where SGLang would serve a fresh import of the app instead (several tokenizer workers)."""
    if classes and tokenizer_workers > 1:
        raise SystemExit(f"the request guard needs SGLang's single tokenizer worker (its app object); "
                         f"--tokenizer-worker-num is {tokenizer_workers}: set SGLANG_TOKENIZER_WORKER_NUM=1 or "
                         f"REQUEST_GUARD=0 in the variant's config.env")
    for cls in classes:
        app.add_middleware(cls)


def main(argv: list[str] | None = None) -> int:
    """argv: launch_server's flags (sys.argv[1:] when None); SGLang's own parser checks them."""
    text_only_default()
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    argv = sys.argv[1:] if argv is None else argv
    # the API key arrives in the environment (scripts/common/engines.py: key_env) and joins the flags here, inside
    # this process: SGLang has no variable of its own, and a key on the command line is readable by every local user
    key = os.environ.get("LAB_SGLANG_API_KEY")
    server_args = prepare_server_args([*argv, "--api-key", key] if key else argv)
    classes = middleware_classes(os.environ.get(MIDDLEWARE_ENV, ""))
    if classes:
        from sglang.srt.entrypoints.http_server import app

        add_middleware(app, classes, server_args.tokenizer_worker_num)
    try:
        run_server(server_args)
    finally:
        kill_process_tree(os.getpid(), include_parent=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
