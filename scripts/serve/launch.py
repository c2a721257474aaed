"""Start a variant's server (its engine's command from scripts/serve/command.py), or use one already running: what
`make serve`, the measurements and the levers that need answers share."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.common.engines import engine_of, vllm_version
from scripts.common.server import Server, ServerError, is_healthy, local_base_url
from scripts.common.variants import Variant, build_target, check_think_budget, cpu_preload, head_dir
from scripts.serve import guard
from scripts.serve.command import serve_argv, serve_env


def check_model_present(variant: Variant) -> None:
    model = variant.resolved["MODEL"]
    if not model.startswith("weights/"):
        return
    path = paths.ROOT / model
    if not path.exists():
        raise CheckpointError(f"{model} does not exist: run `make weights VARIANT={variant.name}` "
                              f"(or `make {build_target(variant.resolved)} VARIANT={variant.name}` for a lever-built variant)")
    if path.is_file():  # a GGUF file (llama.cpp): its engine reads and checks it
        return
    read_checkpoint(path)  # files present, config parses, shards whole; full checks: scripts.weights.verify
    check_head(variant)


def check_head(variant: Variant) -> None:
    """A draft head under weights/ exists, was built for this target's shapes and vocabulary, and (when the variant
    pins REDISTILL_PROMPT_SHA256) was trained on that prompt set."""
    head = head_dir(variant)
    if head is None:
        return
    if not (head / "config.json").exists():
        method = json.loads(variant.resolved["SERVE_SPECULATIVE_CONFIG"])["method"]  # a committed head: copied into place
        make = "weights" if variant.resolved.get("HEAD_SOURCE") else "draft" if method == "draft_model" else "redistill"
        raise CheckpointError(f"{paths.shown(head)} does not exist: run `make {make} VARIANT={variant.name}`")
    cfg = json.loads((head / "config.json").read_text())
    layer = cfg.get("transformer_layer_config", cfg)  # an EAGLE head's layer config, else a draft model's own
    target = json.loads((Path(variant.model) / "config.json").read_text())
    prov = json.loads((head / "PROVENANCE.json").read_text()) if (head / "PROVENANCE.json").exists() else {}
    built = prov.get("target", "?")
    pinned, trained = variant.resolved.get("REDISTILL_PROMPT_SHA256"), prov.get("prompts", {}).get("prompt_set_sha256")
    if pinned and pinned != trained:
        raise CheckpointError(f"{paths.shown(head)} was trained on prompt set {str(trained)[:16]}; {variant.name}'s "
                              f"REDISTILL_PROMPT_SHA256 says {pinned[:16]}: redistill it or change the pin")
    for what, mine, theirs in (("hidden size", layer.get("hidden_size"), target.get("hidden_size")),
                               ("vocabulary", layer.get("vocab_size"), target.get("vocab_size"))):
        if mine != theirs:
            raise CheckpointError(f"{paths.shown(head)} was built for {built} ({what} {mine}); {variant.name} serves "
                                  f"{variant.resolved['MODEL']} ({what} {theirs})")


def make_server(variant: Variant, *, host: str, port: int, api_key: str | None, log_path: Path | None = None) -> Server:
    """The variant's server, not started: its engine and flags checked first (vLLM's against vLLM), then the weights.
    vLLM gets scripts.serve.guard's RequestGuard (400, not 500, for bodies fuzzing found vLLM crash on) and, with a key,
    its KeyGuard (every route but /health behind the key)."""
    engine = engine_of(variant)
    if engine.name == "vllm":  # a thinking budget this vLLM is known not to hold under speculation is refused
        check_think_budget(variant.resolved, variant.path / "config.env", vllm_version())
    check_model_present(variant)
    argv = serve_argv(variant, host=host, port=port)
    if engine.name == "vllm":  # bodies vLLM would answer with a 500 get a 400 (scripts/serve/guard.py)
        argv += ["--middleware", guard.REQUEST_MIDDLEWARE]
    if api_key and engine.name == "vllm":  # vLLM guards /v1 only: every other route behind the key too
        argv += ["--middleware", guard.MIDDLEWARE]
    if engine.name == "vllm" and variant.settings.get("ENV_LD_PRELOAD", "auto") == "auto" and variant.target == "cpu":
        for hint in cpu_preload()[1]:
            print(f"warning: not preloaded, {hint}: vLLM on CPU runs slower without it", file=sys.stderr)
    return Server(argv=argv, base_url=local_base_url(host, port), env=serve_env(variant, api_key), api_key=api_key,
                  log_path=log_path,
                  health_path=engine.health_path)


@contextmanager
def variant_server(variant: Variant, *, base_url: str | None, port: int, purpose: str) -> Iterator[tuple[str, Server | None]]:
    """Yield (base_url, server): a healthy running server at base_url, or one started on 127.0.0.1:port (log in
    .cache/<purpose>-<variant>.log) and stopped, whole process group, when the block exits."""
    if base_url:
        base_url = base_url.rstrip("/")
        health = engine_of(variant).health_path
        if not is_healthy(base_url, path=health):
            raise ServerError(f"no healthy server at {base_url} (GET {health} failed)")
        yield base_url, None
        return
    log = paths.CACHE / f"{purpose}-{variant.name}.log"
    log.parent.mkdir(exist_ok=True)
    server = make_server(variant, host="127.0.0.1", port=port, api_key=None, log_path=log)
    print(f"starting {variant.name}; server log {log}", flush=True)
    # SIGTERM of the measuring script stops the server too (by default it would die alone, leaving the server running)
    with paths.terminate_raises():
        server.start()
        try:
            server.wait_healthy()
            print(f"healthy after {server.startup_s:.1f} s", flush=True)
            yield server.base_url, server
        finally:
            server.stop()
