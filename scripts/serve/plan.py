"""The serve plan: a variant resolved once into everything that decides how it is served.

    plan = serve_plan(load_variant("smollm2-bf16"), host="127.0.0.1", port=8000, api_key=None)
    plan.engine.name, plan.argv, plan.env, plan.health_path, plan.weights, plan.notes
    server = plan.server(log_path=Path(".cache/serve.log")).start()

One call checks the variant's engine and flags (vLLM's against vLLM itself), its weights (files, a draft head's shapes),
writes the exact command and environment, and says what a person should know before it starts (`notes`). `make serve`,
the measurements (through scripts.serve.launch) and the records (the server's argv) read this plan; nothing downstream
asks the variant or the engine registry again how it is served.
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.common.engines import Engine, configured_context, engine_of, vllm_version
from scripts.common.hardware import cpu_dtype_note, cpu_model_and_flags, visible_gpus
from scripts.common.server import Server, free_port, local_base_url
from scripts.common.variants import Variant, VariantError, check_think_budget, cpu_preload, head_dir, missing_model
from scripts.serve import guard
from scripts.serve.command import printable, serve_argv, serve_env


@dataclass(frozen=True)
class ServePlan:
    variant: Variant
    engine: Engine
    argv: list[str]
    env: dict[str, str]
    host: str
    port: int
    api_key: str | None = None
    notes: tuple[str, ...] = field(default=())  # lines to show before the server starts ("warning: …", "note: …")

    @property
    def health_path(self) -> str:
        return self.engine.health_path

    @property
    def weights(self) -> str:
        """What the engine loads: a checkpoint directory or a GGUF file (absolute), or a hub id."""
        return self.variant.model

    @property
    def base_url(self) -> str:
        return local_base_url(self.host, self.port)

    def printable(self) -> str:
        """The command as a shell line, with its environment in front and every key masked."""
        return printable(self.argv, self.env)

    def server(self, log_path: Path | None = None) -> Server:
        """A Server for this plan, not started (its own copies of argv and env: a caller may add to them)."""
        return Server(argv=list(self.argv), base_url=self.base_url, env=dict(self.env), api_key=self.api_key,
                      log_path=log_path, health_path=self.health_path)


def serve_plan(variant: Variant, *, host: str, port: int, api_key: str | None = None) -> ServePlan:
    """Resolve the variant's serving once: engine, flags, weights, command, environment, notes. Raises VariantError
    (config.env), EngineError (engine missing or weights in the wrong format) or CheckpointError (weights absent or
    broken), each one line naming the file or the command to run."""
    engine = engine_of(variant)  # a known engine, and no other engine's flags in config.env
    if engine.name == "vllm":  # a thinking budget this vLLM is known not to hold under speculation is refused
        check_think_budget(variant.resolved, variant.path / "config.env", vllm_version())
    serving = variant.serving()
    if engine.name == "vllm" and variant.target == "cuda":
        check_gpus(variant, visible_gpus(serving.env))
    check_model_present(variant)
    guarded = variant.resolved.get("REQUEST_GUARD", "1") == "1"
    if engine.name == "llamaserver" and guarded:  # no hook in front of its handlers: the lab's front (scripts/serve/front.py)
        argv = front_argv(variant, serve_argv(serving, engine, host="127.0.0.1", port=(inner := free_port())),
                          host=host, port=port, engine_port=inner)
    else:
        argv = serve_argv(serving, engine, host=host, port=port)
    if engine.name == "vllm":  # bodies vLLM would answer with a 500 get a 400 (scripts/serve/guard.py)
        argv += ["--middleware", guard.REQUEST_MIDDLEWARE]
    if api_key and engine.name == "vllm":  # vLLM guards /v1 only: every other route behind the key too
        argv += ["--middleware", guard.MIDDLEWARE]
    env = serve_env(serving, engine, api_key)
    if engine.name == "sglang" and guarded:  # the same guard inside SGLang's own app (scripts/gpu/sglang_text_only.py)
        env[guard.SGLANG_MIDDLEWARE_ENV] = guard.REQUEST_MIDDLEWARE
    return ServePlan(variant=variant, engine=engine, argv=argv, env=env, host=host, port=port, api_key=api_key,
                     notes=tuple(plan_notes(variant, engine)))


PARALLEL_SETTINGS = {"tensor_parallel": "SERVE_TENSOR_PARALLEL_SIZE", "pipeline_parallel": "SERVE_PIPELINE_PARALLEL_SIZE",
                     "data_parallel": "SERVE_DATA_PARALLEL_SIZE"}


def parallelism(variant: Variant) -> dict[str, int]:
    """vLLM's own parallelism of one server of the variant (1 where the variant sets none)."""
    out = {}
    for name, key in PARALLEL_SETTINGS.items():
        value = variant.resolved.get(key, "1")
        if not value.isdigit() or int(value) < 1:
            raise VariantError(f"{variant.name}: {key}={value!r} is not a positive integer")
        out[name] = int(value)
    return out


def parallel_size(variant: Variant) -> int:
    """Devices one server of the variant spans: tensor x pipeline x data parallel."""
    return math.prod(parallelism(variant).values())


def check_gpus(variant: Variant, visible: int | None) -> None:
    """A topology that asks for more GPUs than this machine shows the server fails here, naming both counts (vLLM
    itself would fail minutes later, deep in its start)."""
    need = parallel_size(variant)
    if visible is not None and need > visible:
        parts = " × ".join(f"{name} {n}" for name, n in parallelism(variant).items() if n > 1)
        raise VariantError(f"{variant.path / 'config.env'}: needs {need} GPUs ({parts}); {visible} visible here "
                           f"(nvidia-smi, CUDA_VISIBLE_DEVICES)")


def front_argv(variant: Variant, engine_argv: list[str], *, host: str, port: int, engine_port: int) -> list[str]:
    """The request front on the public port, the engine's own command (on a loopback port) after `--`; the context
    per request where the variant sets it (llama-server also states its own in /props, which the front reads first)."""
    context = ["--context", str(n)] if (n := configured_context(variant.resolved)) else []
    return [sys.executable, "-m", "scripts.serve.front", "--host", host, "--port", str(port), "--engine-port",
            str(engine_port), *context, "--", *engine_argv]


def plan_notes(variant: Variant, engine: Engine) -> list[str]:
    """What to know before the server starts: a CPU preload library missing, BF16 without native kernels, random
    weights."""
    notes = []
    if engine.name == "vllm" and variant.target == "cpu":
        if variant.settings.get("ENV_LD_PRELOAD", "auto") == "auto":
            notes += [f"warning: not preloaded, {hint}: vLLM on CPU runs slower without it" for hint in cpu_preload()[1]]
        if note := cpu_dtype_note(variant.resolved.get("SERVE_DTYPE", ""), cpu_model_and_flags()[1]):
            notes.append(note)
    if variant.is_shape_proxy:
        notes.append("note: shape proxy (random weights): its text is meaningless; measure speed only")
    return notes


def check_model_present(variant: Variant) -> None:
    model = variant.resolved["MODEL"]
    if not model.startswith("weights/"):
        return
    path = paths.ROOT / model
    if not path.exists():
        raise CheckpointError(missing_model(variant))
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
