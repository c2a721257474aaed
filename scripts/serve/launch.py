"""Start a variant's server (its serve plan, scripts/serve/plan.py), or use one already running: what the
measurements and the levers that need answers share."""

from __future__ import annotations

import hashlib
import json
import os
import sys
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scripts.common import paths
from scripts.common.engines import engine_of
from scripts.common.server import Server, ServerError, free_port, group_pids, is_healthy, listeners
from scripts.common.variants import Variant
from scripts.serve.plan import serve_plan

POOL_ENV = "LAB_SERVER_POOL"  # a pool's file (scripts/serve/pool.py): its servers are measured instead of new ones


def make_server(variant: Variant, *, host: str, port: int, api_key: str | None, log_path: Path | None = None) -> Server:
    """The variant's server from its serve plan (scripts/serve/plan.py), not started; the plan's notes are printed."""
    plan = serve_plan(variant, host=host, port=port, api_key=api_key)
    for note in plan.notes:
        print(note, file=sys.stderr)
    return plan.server(log_path)


def settings_digest(variant: Variant) -> str:
    """What a pooled server was started with, as one hash: a script that resolves other settings starts its own."""
    return hashlib.sha256(json.dumps(variant.resolved, sort_keys=True).encode()).hexdigest()[:16]


def pooled_server(variant: Variant) -> Server | None:
    """The running server of this variant that the pool named in LAB_SERVER_POOL lists, started with the settings this
    variant resolves to and still healthy; None otherwise (the caller starts its own)."""
    file = os.environ.get(POOL_ENV)
    if not file or not Path(file).is_file():
        return None
    entry = json.loads(Path(file).read_text()).get("servers", {}).get(variant.name)
    if not entry or entry["settings_digest"] != settings_digest(variant):
        return None
    group = set(group_pids(entry["pid"]))
    port = urllib.parse.urlsplit(entry["base_url"]).port
    # its process group alive and the only listener on its port (a port taken over by another server is not it)
    if not group or not port or not listeners(port) <= group or not is_healthy(entry["base_url"], path=entry["health_path"]):
        return None
    return Server.attached(entry["argv"], entry["base_url"], entry["pid"], env=entry["env"],
                           log_path=Path(entry["log"]) if entry.get("log") else None, health_path=entry["health_path"])


@contextmanager
def variant_server(variant: Variant, *, base_url: str | None, port: int | None, purpose: str) -> Iterator[tuple[str, Server | None]]:
    """Yield (base_url, server): a healthy running server at base_url, the variant's server of the pool that
    LAB_SERVER_POOL names (scripts/serve/pool.py) when it runs with the same settings, or one started on 127.0.0.1:port (a free port
    when None; log in .cache/<purpose>-<variant>.log) and stopped, whole process group, when the block exits. A
    started server must be the only listener on its port (vLLM may bind with SO_REUSEPORT: a second server on the
    same port once took half a quality run's requests), checked once it is healthy."""
    if base_url:
        base_url = base_url.rstrip("/")
        health = engine_of(variant).health_path
        if not is_healthy(base_url, path=health):
            raise ServerError(f"no healthy server at {base_url} (GET {health} failed)")
        yield base_url, None
        return
    if pooled := pooled_server(variant):  # started once with the others (make optimize on a GPU), stopped by its pool
        print(f"measuring {variant.name}'s running server of the pool at {pooled.base_url}; its log {pooled.log_path}",
              flush=True)
        yield pooled.base_url, pooled
        return
    log = paths.CACHE / f"{purpose}-{variant.name}.log"
    log.parent.mkdir(exist_ok=True)
    server = make_server(variant, host="127.0.0.1", port=port or free_port(), api_key=None, log_path=log)
    print(f"starting {variant.name}; server log {log}", flush=True)
    # SIGTERM of the measuring script stops the server too (by default it would die alone, leaving the server running)
    with paths.terminate_raises():
        server.start()
        try:
            server.wait_healthy()
            server.check_own_port()
            print(f"healthy after {server.startup_s:.1f} s", flush=True)
            yield server.base_url, server
        finally:
            server.stop()
