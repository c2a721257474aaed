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

A draft vocabulary (FR-Spec, SGLang's `--speculative-token-map`): SGLang keeps only the listed rows of the draft's
output layer and maps the draft's picks back to full ids (speculative/eagle_worker_v2.py: init_lm_head), so a draft
step reads 65,536 rows instead of 248,320; the target still verifies over the whole vocabulary, so answers do not
change. Two things the lab adds here:
- the value may be one of the lab's keep lists (results/vocab/<base>/keep-N.json, scripts.levers.vocab): checked
  against the served model's tokenizer and vocabulary, then written as the torch file of ids SGLang loads
  (spec_utils.load_token_map) for the server's lifetime;
- a tied draft keeps its whole embedding. Qwen3.5-4B ties its output layer to its embedding, and so does its MTP
  layer (Qwen3_5ForCausalLMMTP: lm_head *is* model.embed_tokens): SGLang's set_embed_and_head then gives the
  embedding the kept rows too, and the draft gathers full ids (the verified token) from a 65,536-row table past
  its end (VocabParallelEmbedding's bound check reads num_embeddings, still 248,320). With a token map the launcher
  sets DRAFT_HEAD_ENV, and every process SGLang spawns (it imports this script as its main module again) replaces
  that method with one that gives the draft its own head module holding the kept rows (separate_draft_head).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

# Run as a script, Python puts only scripts/gpu on the path: the repository goes first, so the middleware named in
# LAB_SGLANG_MIDDLEWARE (scripts.serve.guard) imports wherever the engine's Python runs, with or without PYTHONPATH
ROOT = str(Path(__file__).resolve().parents[2])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from scripts.serve.guard import SGLANG_MIDDLEWARE_ENV as MIDDLEWARE_ENV  # noqa: E402  (the one name, set by the plan)

TOKEN_MAP_FLAG = "--speculative-token-map"
DRAFT_HEAD_ENV = "LAB_SGLANG_DRAFT_HEAD_ROWS"  # set by main() with a token map; read again in every spawned process


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


def flag_value(argv: list[str], flag: str) -> str | None:
    """The value of `flag V` or `flag=V` in argv (the last one given), None where it is absent."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def keep_list_ids(path: Path, model: Path) -> list[int]:
    """A keep list's kept ids, checked against the served model: its vocabulary size (config.json) and, where the
    keep list names one, its tokenizer's fingerprint; SystemExit with one line naming the file otherwise."""
    try:
        keep = json.loads(path.read_text())
        ids = keep["kept_ids"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise SystemExit(f"{TOKEN_MAP_FLAG} {path}: not a keep list with kept_ids ({e.__class__.__name__}: {e}); "
                         f"make one with python -m scripts.levers.vocab.analyze") from None
    try:
        config = json.loads((model / "config.json").read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"{model}/config.json: unreadable ({e}): the token map cannot be checked") from None
    vocab = (config.get("text_config") or config).get("vocab_size") or config.get("vocab_size")
    if (not isinstance(ids, list) or not ids or not all(isinstance(i, int) for i in ids)
            or len(set(ids)) != len(ids) or min(ids) < 0 or (vocab and max(ids) >= vocab)):
        raise SystemExit(f"{TOKEN_MAP_FLAG} {path}: kept_ids is not a list of distinct ids below the model's "
                         f"vocabulary ({vocab})")
    if keep.get("tokenizer_sha256"):
        from transformers import AutoTokenizer

        from scripts.common.checkpoint import tokenizer_fingerprint

        if tokenizer_fingerprint(AutoTokenizer.from_pretrained(model)) != keep["tokenizer_sha256"]:
            raise SystemExit(f"{TOKEN_MAP_FLAG} {path} was made for another tokenizer than {model}'s")
    return ids


def token_map_argv(argv: list[str], workdir: Path) -> list[str]:
    """argv with a keep list (.json) given to --speculative-token-map replaced by the torch file of its ids that
    SGLang loads (written into workdir); other argv unchanged."""
    value = flag_value(argv, TOKEN_MAP_FLAG)
    if value is None or not value.endswith(".json"):
        return argv
    path = Path(value)  # a variant's, made absolute by the serve plan (scripts/serve/command.py: flags)
    if not path.is_file():
        raise SystemExit(f"{TOKEN_MAP_FLAG} {value}: no such keep list; make it with python -m "
                         f"scripts.levers.vocab.analyze (the vocabulary lever's analysis)")
    ids = keep_list_ids(path, Path(flag_value(argv, "--model-path") or flag_value(argv, "--model") or "."))
    import torch

    out = workdir / (path.stem + ".pt")
    torch.save(ids, out)
    return [str(out) if a == value else f"{TOKEN_MAP_FLAG}={out}" if a == f"{TOKEN_MAP_FLAG}={value}" else a
            for a in argv]


def separate_draft_head(model_cls) -> None:
    """Replace model_cls.set_embed_and_head so that a tied draft given fewer head rows than embedding rows (a token
    map) keeps its whole embedding and gets its own head module with those rows; every other call is SGLang's own."""
    import torch

    original = model_cls.set_embed_and_head
    if getattr(original, "separates_head", False):
        return

    def set_embed_and_head(self, embed, head):
        if not (getattr(self.config, "tie_word_embeddings", False) and head.shape[0] != embed.shape[0]):
            return original(self, embed, head)
        del self.model.embed_tokens.weight
        self.model.embed_tokens.weight = embed
        rows = torch.nn.Module()
        rows.weight = head  # what the logits processor reads of an unquantized head
        self.lm_head = rows
        if torch.cuda.is_available():  # as SGLang's own method ends
            torch.cuda.empty_cache()
            torch.cuda.synchronize()
        print(f"lab: the tied draft's head keeps {head.shape[0]} of {embed.shape[0]} rows, its embedding all of them",
              file=sys.stderr, flush=True)

    set_embed_and_head.separates_head = True
    model_cls.set_embed_and_head = set_embed_and_head


def main(argv: list[str] | None = None) -> int:
    """argv: launch_server's flags (sys.argv[1:] when None); SGLang's own parser checks them."""
    text_only_default()
    from sglang.launch_server import run_server
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import prepare_server_args
    from sglang.srt.utils import kill_process_tree

    load_plugins()
    argv = sys.argv[1:] if argv is None else argv
    with tempfile.TemporaryDirectory(prefix="lab-token-map-") as workdir:  # the token map lives as long as the server
        argv = token_map_argv(argv, Path(workdir))
        if flag_value(argv, TOKEN_MAP_FLAG) is not None:
            os.environ[DRAFT_HEAD_ENV] = "1"
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


if os.environ.get(DRAFT_HEAD_ENV) and __name__ != "__main__":  # a process SGLang spawned (this file as __mp_main__)
    from sglang.srt.models.qwen3_5_mtp import Qwen3_5ForCausalLMMTP

    separate_draft_head(Qwen3_5ForCausalLMMTP)

if __name__ == "__main__":
    sys.exit(main())
