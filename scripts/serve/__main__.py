"""Serve a variant with its engine's OpenAI-compatible server (vLLM unless the variant's ENGINE says otherwise).

    python -m scripts.serve smollm2-bf16                       # what `make serve` runs
    python -m scripts.serve smollm2-bf16 --dry-run             # print the exact command only
    HOST=0.0.0.0 PORT=8001 API_KEY=secret python -m scripts.serve smollm2-bf16
    python -m scripts.serve smollm2-bf16 --api-key-file ~/.config/lab/key   # a file only its owner can read (0600)
    python -m scripts.serve smollm2-bf16 --set SERVE_MAX_NUM_SEQS=4
    python -m scripts.serve smollm2-gguf-q8-0                  # ENGINE=llamacpp: llama-cpp-python's server

The key reaches the engine through its environment (VLLM_API_KEY for vLLM, API_KEY for llama-cpp-python's server),
never its command line, which `ps` shows to every local user; the printed command shows it as ***.
Prints the exact server command, starts it in its own process group, waits for /health, and on SIGINT/SIGTERM
stops the whole group (engine core and workers included) by PID. Binds 127.0.0.1 unless HOST says otherwise.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.server import ServerError, stop_on_signals
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.serve.command import DEFAULT_HOST, DEFAULT_PORT, printable
from scripts.serve.compile_cache import CacheError, import_cache
from scripts.serve.plan import serve_plan


def build_parser() -> argparse.ArgumentParser:
    # no abbreviations: `--api-key` must not pass for --api-key-file (a key on the command line is refused)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False)
    p.add_argument("variant", nargs="?", default=paths.DEFAULT_VARIANT, help="experiments/<variant>/config.env")
    p.add_argument("--host", default=os.environ.get("HOST", DEFAULT_HOST))
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", DEFAULT_PORT)))
    p.add_argument("--api-key-file", type=Path, help="require the bearer token this file holds (mode 0600; else the "
                   "environment's API_KEY). There is no --api-key: a key in argv is visible to every local user")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--log", type=Path, help="write the server's output here instead of the terminal")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds to wait for /health")
    p.add_argument("--dry-run", action="store_true", help="print the command and exit")
    p.add_argument("--cache", type=Path, default=os.environ.get("CACHE") or None,
                   help="a cache_import.tar.gz (make bake-cache): used when its manifest matches this machine and "
                        "variant, else one line says which factor differs (env CACHE)")
    return p


def read_api_key(path: Path) -> str:
    """The key a file holds (first line, stripped); ServerError unless only its owner can read it."""
    try:
        mode = path.stat().st_mode
        key = path.read_text().strip().splitlines()[0].strip() if path.read_text().strip() else ""
    except OSError as e:
        raise ServerError(f"--api-key-file {path}: {e.strerror}") from None
    if mode & 0o077:
        raise ServerError(f"--api-key-file {path} is readable by others (mode {mode & 0o777:o}): chmod 600 it")
    if not key:
        raise ServerError(f"--api-key-file {path} is empty")
    return key


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        api_key = read_api_key(args.api_key_file) if args.api_key_file else os.environ.get("API_KEY") or None
        plan = serve_plan(variant, host=args.host, port=args.port, api_key=api_key)
        server = plan.server(args.log)
        if args.cache:
            env, message = import_cache(args.cache, variant, shim=os.environ.get("LAB_CACHE_SHIM") == "1")
            print(message, flush=True)
            server.env.update(env)
    except (VariantError, CheckpointError, CacheError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(printable(server.argv, server.env), flush=True)
    for note in plan.notes:
        print(note, file=sys.stderr if note.startswith("warning:") else sys.stdout, flush=True)
    if args.dry_run:
        return 0

    stopping = stop_on_signals(server.stop, lambda: f"server (pid {server.pid})")
    try:
        server.start()
    except ServerError as e:  # its port already answers: another server
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        startup = server.wait_healthy(args.timeout)
        server.check_own_port()
    except ServerError as e:
        server.stop()
        if stopping():
            return 130
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"ready: {server.base_url}/v1 serving {variant.name!r} (pid {server.pid}, startup {startup:.1f} s); "
          "Ctrl-C stops it", flush=True)
    while server.proc.poll() is None:
        time.sleep(0.5)
    server.stop()
    if stopping():
        return 0
    print(f"error: server exited with code {server.proc.returncode}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
