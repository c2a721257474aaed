"""Several variants' servers started once, side by side, and measured one at a time: what `make optimize` does on a GPU,
where one start of a variant takes minutes and a ladder of ten rungs in three rounds would start thirty servers.

    python -m scripts.serve.pool smollm2-bf16 smollm2-fp8kv --set SERVE_KV_CACHE_MEMORY_BYTES=2147483648
        # starts both at once, writes .cache/pool/pool.json, waits for Ctrl-C, stops both

Every server is the variant's own (scripts/serve/launch.make_server: the same flags and guards as `make serve`) on a
free loopback port, in its own process group, its log under the pool's folder. The pool's file lists each healthy one:
its URL, process group, command, log and a digest of the variant's resolved settings. A measuring script run with
LAB_SERVER_POOL=<that file> in its environment (scripts/serve/launch.variant_server) measures the listed server of its
variant instead of starting one, when the settings it resolved are the same (the digest) and the server still
answers; otherwise it starts its own as always. A server that fails to start is listed with the last error of its log
(vLLM's "out of memory" and the like), and the others go on.

Servers that share one GPU need a memory budget each: LAB_SERVE_SET (scripts/common/variants.py) gives every vLLM
variant the same fixed KV size, so no start profiles memory that the other starts are taking at the same time, and
every SGLang variant its share of the memory free at its start, which it takes first and alone.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import engine_of
from scripts.common.server import Server, ServerError, free_port, last_error, stop_on_signals
from scripts.common.variants import Variant, VariantError, load_variant, parse_overrides
from scripts.serve.launch import POOL_ENV, make_server, settings_digest

START_TIMEOUT_S = 900.0


@dataclass
class Pool:
    folder: Path
    servers: dict[str, Server] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # variant -> why its server is not running
    variants: dict[str, Variant] = field(default_factory=dict)  # every variant asked for, over all starts

    @property
    def file(self) -> Path:
        return self.folder / "pool.json"

    def start(self, variants: list[Variant], timeout_s: float = START_TIMEOUT_S) -> Pool:
        """Start every variant's server at once and wait until each is healthy or gone; write the pool file (with the
        servers of earlier starts, which keep running). Interrupted (Ctrl-C, SIGTERM), it stops the whole pool: each
        server runs in a session of its own, out of the signal's reach."""
        try:
            return self._start(variants, timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, variants: list[Variant], timeout_s: float) -> Pool:
        """SGLang's servers first, one at a time, each once the one before is healthy: SGLang sizes its memory as a
        share of what is free at its start, less what others take while it loads (two 4B servers started side by
        side left one of them -1 GB: results/gpu-mtp-20261129/README.md); then every other server at once."""
        self.folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        alone = [v for v in variants if v.engine == "sglang"]
        for batch in [*([v] for v in alone), [v for v in variants if v not in alone]]:
            if batch:
                self._launch(batch, timeout_s)
        self.variants.update({v.name: v for v in variants})
        self.write()
        healthy = sum(v.name in self.servers for v in variants)
        failed = sorted(v.name for v in variants if v.name in self.failed)
        print(f"[pool] {healthy} of {len(variants)} servers healthy after {time.monotonic() - t0:.0f} s"
              + (f"; failed: {', '.join(failed)}" if failed else ""), flush=True)
        return self

    def _launch(self, variants: list[Variant], timeout_s: float) -> None:
        """Start the variants' servers at once and wait until each is healthy or gone."""
        first = free_port(len(variants))
        ports = iter(range(first, first + len(variants)))
        for v in variants:
            log = self.folder / f"{v.name}.log"
            log.unlink(missing_ok=True)
            try:
                self.servers[v.name] = make_server(v, host="127.0.0.1", port=next(ports), api_key=None,
                                                   log_path=log).start()
            except (ServerError, VariantError, CheckpointError, OSError) as e:  # a missing head, a busy port
                self.failed[v.name] = str(e)
        errors: dict[str, str] = {}

        def wait(name: str, server: Server) -> None:
            try:
                server.wait_healthy(timeout_s)
                server.check_own_port()
            except ServerError:
                errors[name] = f"server did not start: {last_error(server.log_path)}"
                server.stop()

        started = [(v.name, self.servers[v.name]) for v in variants if v.name in self.servers]
        threads = [threading.Thread(target=wait, args=item, daemon=True) for item in started]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():  # joined in steps: a signal reaches this thread between them
                t.join(0.5)
        for name, why in errors.items():
            self.failed[name] = why
            self.servers.pop(name, None)

    def write(self) -> None:
        entries = {name: {"base_url": s.base_url, "pid": s.pid, "argv": s.argv, "env": s.env,
                          "log": str(s.log_path), "health_path": s.health_path,
                          "settings_digest": settings_digest(self.variants[name]), "startup_s": s.startup_s}
                   for name, s in self.servers.items()}
        paths.write_text_atomic(self.file, json.dumps({"servers": entries, "failed": self.failed}, indent=1) + "\n")

    def stop(self) -> None:
        for s in list(self.servers.values()):
            s.stop()
        self.servers.clear()
        self.file.unlink(missing_ok=True)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variants", nargs="+")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key of each")
    p.add_argument("--folder", type=Path, default=paths.CACHE / "pool", help="logs and pool.json (default %(default)s)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        overrides = parse_overrides(args.set)
        variants = [load_variant(v, overrides=overrides) for v in args.variants]
        for v in variants:
            engine_of(v)
    except (VariantError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    pool = Pool(args.folder)
    came = stop_on_signals(pool.stop, lambda: f"{len(pool.servers)} servers")
    pool.start(variants)
    for name, why in pool.failed.items():
        print(f"{name}: {why}", file=sys.stderr)
    print(f"{POOL_ENV}={paths.shown(pool.file)}", flush=True)
    while pool.servers and not came():
        time.sleep(1)
    pool.stop()
    return 0 if not pool.failed else 1


if __name__ == "__main__":
    sys.exit(main())
