"""Which running server a measuring script takes from a pool's file (scripts/serve/launch.pooled_server): only its own
variant's, started with the settings it resolves, still alive and healthy. The pool's real servers are exercised by
the optimize integration test (POOL=1)."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from scripts.common.server import free_port, is_healthy
from scripts.common.variants import load_variant
from scripts.serve.launch import POOL_ENV, pooled_server, settings_digest

HEALTHY = ("import http.server, sys\n"
           "class H(http.server.BaseHTTPRequestHandler):\n"
           "    def do_GET(self):\n"
           "        self.send_response(200); self.end_headers(); self.wfile.write(b'ok')\n"
           "    def log_message(self, *a): pass\n"
           "http.server.HTTPServer(('127.0.0.1', int(sys.argv[1])), H).serve_forever()\n")


@pytest.fixture
def listener():
    """Something that answers /health on a free port, in its own process group (a pool's server, as far as the
    lookup can tell: the lookup is what is tested, not a server)."""
    port = free_port()
    p = subprocess.Popen([sys.executable, "-c", HEALTHY, str(port)], start_new_session=True)
    for _ in range(100):
        if is_healthy(f"http://127.0.0.1:{port}"):
            break
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}", p.pid
    p.kill()
    p.wait()


def write_pool(tmp_path, monkeypatch, entry: dict) -> None:
    f = tmp_path / "pool.json"
    f.write_text(json.dumps({"servers": {"smollm2-bf16": entry}, "failed": {}}))
    monkeypatch.setenv(POOL_ENV, str(f))


def test_a_pool_server_is_taken_only_with_the_same_settings_alive_and_healthy(tmp_path, monkeypatch, listener):
    url, pid = listener
    v = load_variant("smollm2-bf16")
    entry = {"base_url": url, "pid": pid, "argv": ["vllm", "serve"], "env": {}, "log": None, "health_path": "/health",
             "settings_digest": settings_digest(v), "startup_s": 1.0}
    write_pool(tmp_path, monkeypatch, entry)
    s = pooled_server(v)
    assert s is not None and s.base_url == url and s.pid == pid and s.startup_s is None
    s.stop()  # never stops a server it did not start
    assert pooled_server(v) is not None
    assert pooled_server(load_variant("smollm2-bf16", overrides={"SERVE_MAX_NUM_SEQS": "3"})) is None  # other settings
    assert pooled_server(load_variant("smollm2-int8")) is None  # not in the pool
    write_pool(tmp_path, monkeypatch, {**entry, "pid": 2 ** 22 + 7})  # its process group is gone
    assert pooled_server(v) is None
    write_pool(tmp_path, monkeypatch, {**entry, "base_url": f"http://127.0.0.1:{free_port()}"})  # not answering
    assert pooled_server(v) is None
    monkeypatch.delenv(POOL_ENV)
    assert pooled_server(v) is None


def test_sglang_servers_start_first_and_alone(tmp_path, monkeypatch):
    """SGLang sizes its memory from what is free at its start: each SGLang server is healthy before the next server of
    the pool starts; the vLLM ones then start together (the servers are fakes: the order is what is tested)."""
    from scripts.serve import pool

    for name, engine in (("x-bf16", ""), ("x-fp8kv", ""), ("x-sglang", "ENGINE=sglang\n"), ("x-sglang2", "ENGINE=sglang\n")):
        (tmp_path / "v" / name).mkdir(parents=True)
        (tmp_path / "v" / name / "config.env").write_text(f"MODEL=weights/x\nBASE=x\n{engine}")
    events = []

    class FakeServer:
        def __init__(self, v, port, log_path, **_):
            self.name, self.base_url, self.log_path = v.name, f"http://127.0.0.1:{port}", log_path
            self.pid, self.argv, self.env, self.health_path, self.startup_s = 1, [], {}, "/health", 0.0

        def start(self):
            events.append(("start", self.name))
            return self

        def wait_healthy(self, timeout_s):
            events.append(("healthy", self.name))

        def check_own_port(self):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(pool, "make_server", lambda v, host, port, api_key, log_path: FakeServer(v, port, log_path))
    variants = [load_variant(n, root=tmp_path / "v", target="cuda") for n in ("x-bf16", "x-sglang", "x-fp8kv", "x-sglang2")]
    p = pool.Pool(tmp_path / "pool").start(variants)
    assert events[:4] == [("start", "x-sglang"), ("healthy", "x-sglang"), ("start", "x-sglang2"), ("healthy", "x-sglang2")]
    assert events[4:6] == [("start", "x-bf16"), ("start", "x-fp8kv")]
    assert sorted(p.servers) == ["x-bf16", "x-fp8kv", "x-sglang", "x-sglang2"]
