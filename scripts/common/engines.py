"""Serving engines behind one HTTP interface: vLLM (the default), llama.cpp and SGLang.

    ENGINE=llamacpp            # in a variant's config.env, or `--set ENGINE=sglang` / `make serve ENGINE=sglang`

Every engine serves the OpenAI API the bench and the evals already speak; what differs is how it is started, where it
is installed, how it says it is ready and how a request asks for a fixed-length answer. Each engine's own flags come
from one key family of config.env (SERVE_* for vLLM, LLAMACPP_* for llama-cpp-python's server, SGLANG_* for SGLang),
so a flag never leaks into an engine that does not have it. Records name the engine and its version (`describe`).

    llamacpp   llama-cpp-python's server (`python -m llama_cpp.server`) in .venv-llamacpp (`make install-llamacpp`);
               MODEL is a .gguf file (`make export-gguf` writes one from a safetensors checkpoint). It runs one request
               at a time: concurrent requests queue (its server has no batching across requests).
    sglang     `python -m sglang.launch_server` from the Python that holds sglang: LAB_SGLANG_PYTHON, else this one
               (the GPU machine carries it on PYTHONPATH); MODEL is a safetensors checkpoint.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from scripts.common import paths
from scripts.common.server import ServerError
from scripts.common.variants import Variant, VariantError
from scripts.common.vllm_cli import build_serve_argv, vllm_flag_table, vllm_version

DEFAULT = "vllm"


class EngineError(ServerError):
    """An engine that is not installed or cannot load a variant's weights (no server can start); one line."""


@dataclass(frozen=True)
class Engine:
    name: str
    key_prefix: str  # the config.env key family holding this engine's own flags
    package: str  # the distribution whose version records carry
    module: str  # what `python -c "import …"` must find
    install: str  # what installs it: the make target, or where it runs
    health_path: str  # GET answers 200 once the model is loaded
    weights: str  # the format MODEL must be in
    label: str  # how reports name it


ENGINES: dict[str, Engine] = {
    "vllm": Engine("vllm", "SERVE_", "vllm", "vllm", "run `make install`", "/health", "safetensors checkpoint directory",
                   "vLLM"),
    "llamacpp": Engine("llamacpp", "LLAMACPP_", "llama-cpp-python", "llama_cpp.server", "run `make install-llamacpp`",
                       "/v1/models", "GGUF file (.gguf)", "llama.cpp"),
    "sglang": Engine("sglang", "SGLANG_", "sglang", "sglang.launch_server",
                     "it runs on the GPU machine, where `scripts/gpu/device.sh setup` installs .gpu/sglang and sets "
                     "LAB_SGLANG_PYTHON (scripts/gpu/README.md)",
                     "/health", "safetensors checkpoint directory", "SGLang"),
}
LLAMACPP_VENV = paths.ROOT / ".venv-llamacpp"


def engine_of(variant: Variant) -> Engine:
    name = variant.resolved.get("ENGINE", DEFAULT)
    if name not in ENGINES:
        raise VariantError(f"{variant.path}/config.env: ENGINE={name!r}; valid engines: {', '.join(ENGINES)}")
    engine = ENGINES[name]
    # a variant's own flags of another engine: written for vLLM, they would silently do nothing here
    foreign = sorted(k for k in variant.settings if any(k.startswith(e.key_prefix) for e in ENGINES.values())
                     and not k.startswith(engine.key_prefix))
    if foreign:
        raise VariantError(f"{variant.path}/config.env: ENGINE={name} reads {engine.key_prefix}* flags, not "
                           f"{', '.join(foreign)}")
    return engine


def python_of(engine: Engine) -> str:
    if engine.name == "llamacpp":
        return str(LLAMACPP_VENV / "bin" / "python")
    if engine.name == "sglang":
        return os.environ.get("LAB_SGLANG_PYTHON") or sys.executable
    return sys.executable


@functools.cache
def version(name: str) -> str:
    """The engine's version as its own Python reports it; EngineError naming the install target when it is missing."""
    engine = ENGINES[name]
    if name == "vllm":
        return vllm_version()
    py = python_of(engine)
    probe = (f"import importlib.metadata as m, {engine.module}; print(m.version({engine.package!r}))")
    try:
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    except OSError:
        r = None
    if r is None or r.returncode != 0:
        raise EngineError(f"ENGINE={name}: {engine.package} is not installed for {py}: {engine.install}")
    return r.stdout.strip().splitlines()[-1]


def describe(variant: Variant) -> dict[str, str]:
    """{"name", "version"} of the engine that serves the variant, for records ("unknown" where it cannot be asked)."""
    engine = engine_of(variant)
    try:
        return {"name": engine.name, "version": version(engine.name)}
    except EngineError:
        return {"name": engine.name, "version": "unknown"}


def check_weights(variant: Variant, engine: Engine) -> None:
    """The engine can load MODEL's format (a GGUF file for llama.cpp, a checkpoint directory for the others)."""
    model = Path(variant.model)
    is_gguf = model.suffix == ".gguf"
    if engine.name == "llamacpp" and not is_gguf:
        raise EngineError(f"ENGINE=llamacpp serves a {engine.weights}; {variant.resolved['MODEL']} is a safetensors "
                          f"checkpoint: serve a GGUF export of it (make export-gguf VARIANT=<a GGUF variant>)")
    if engine.name != "llamacpp" and is_gguf:
        raise EngineError(f"ENGINE={engine.name} serves a {engine.weights} here; {variant.resolved['MODEL']} is a "
                          f"GGUF file: serve it with ENGINE=llamacpp")


def flags(variant: Variant, engine: Engine) -> list[str]:
    """LLAMACPP_N_CTX=4096 -> --n_ctx 4096 (llama-cpp-python's flags keep underscores); SGLANG_MEM_FRACTION_STATIC=0.2
    -> --mem-fraction-static 0.2; 1/0 on an SGLang switch adds or leaves it out."""
    argv: list[str] = []
    for key, value in variant.resolved.items():
        if not key.startswith(engine.key_prefix):
            continue
        name = key[len(engine.key_prefix):].lower()
        if engine.name == "sglang":
            name = name.replace("_", "-")
            if value in ("0", "1") and name.startswith(("enable-", "disable-")):
                argv += [f"--{name}"] if value == "1" else []
                continue
        argv += [f"--{name}", value]
    return argv


def llamacpp_defaults() -> dict[str, str]:
    """llama-cpp-python server flags the lab sets unless a variant's LLAMACPP_* key does: every core for decode and
    prefill, as vLLM's CPU backend uses them (the server's default is half the logical CPUs, 1 on two cores), and
    concurrent requests queue instead of cancelling the one running (its default interrupts it: at c=8 seven of
    eight requests would end empty)."""
    cores = str(os.cpu_count() or 1)
    return {"n_threads": cores, "n_threads_batch": cores, "interrupt_requests": "False"}


def serve_argv(variant: Variant, *, host: str, port: int, api_key: str | None) -> list[str]:
    """The exact command that serves the variant with its engine (vLLM's flags checked against vLLM itself)."""
    engine = engine_of(variant)
    check_weights(variant, engine)
    if engine.name == "vllm":
        return build_serve_argv(variant, vllm_flag_table(), host=host, port=port, api_key=api_key)
    version(engine.name)  # installed, else the install target
    py = python_of(engine)
    if engine.name == "llamacpp":
        defaults = [a for k, v in llamacpp_defaults().items() if f"LLAMACPP_{k.upper()}" not in variant.resolved
                    for a in (f"--{k}", v)]
        argv = [py, "-m", "llama_cpp.server", "--model", variant.model, "--model_alias", variant.served_name,
                "--host", host, "--port", str(port), *defaults, *flags(variant, engine)]
        return argv + (["--api_key", api_key] if api_key else [])
    argv = [py, str(paths.ROOT / "scripts" / "gpu" / "sglang_text_only.py"), "--model-path", variant.model, "--served-model-name",
            variant.served_name, "--host", host, "--port", str(port), *flags(variant, engine)]
    return argv + (["--api-key", api_key] if api_key else [])


def run_llamacpp_logits(args: list[str]) -> None:
    """`python -m scripts.llamacpp_logits ARGS` in llama.cpp's environment (parity's logits, lm-eval's
    log-likelihoods of a GGUF); EngineError with its last output line when it fails."""
    version("llamacpp")  # installed, else the target that installs it
    r = subprocess.run([python_of(ENGINES["llamacpp"]), "-m", "scripts.llamacpp_logits", *args], cwd=paths.ROOT,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise EngineError(f"llama.cpp failed: {tail[0]}")


def fixed_length_body(engine_name: str, eos_ids: list[int] | None = None) -> dict:
    """Request fields that make a chat completion run to exactly max_tokens (the bench's `fixed` mode): vLLM and
    SGLang take ignore_eos; llama-cpp-python's server has no such field, so every end-of-sequence id gets a logit bias
    of -100 (its sampler adds the bias to the logit: the id is never the greedy choice)."""
    if engine_name == "llamacpp":
        return {"logit_bias": {str(i): -100 for i in (eos_ids or [])}}
    return {"ignore_eos": True}


def fixed_body_for(variant: Variant) -> dict:
    """fixed_length_body for the engine that serves the variant (llama.cpp: the EOS ids its GGUF names)."""
    engine = engine_of(variant)
    return fixed_length_body(engine.name, eos_ids_of(variant) if engine.name == "llamacpp" else None)


def eos_ids_of(variant: Variant) -> list[int]:
    """End-of-sequence ids of a GGUF file (its tokenizer.ggml.eos_token_id and the chat template's end-of-turn id)."""
    from gguf import GGUFReader

    reader = GGUFReader(variant.model)
    ids = set()
    for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id"):
        if key in reader.fields:
            ids.add(int(reader.fields[key].contents()))
    return sorted(ids)
