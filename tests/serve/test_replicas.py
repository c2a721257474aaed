"""make serve-replicas: placement and router command (pure logic), and two real SmolLM2 replicas behind the real
vllm-router on this CPU, one core each: requests balanced, keys checked by the replicas, one replica killed mid-run
and drained by the router (requests retried, or ended with an error the client sees; none hanging)."""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time

import pytest
from prometheus_client.parser import text_string_to_metric_families

from scripts.common import paths
from scripts.common.server import free_port, group_pids, http_get
from scripts.common.variants import load_variant
from scripts.measure.prom import parse
from scripts.serve.replicas import ReplicaError, parallel_size, placements, router_argv
from tests.conftest import assert_every_route_guarded, assert_key_guarded, server_args, wait_for_line


def test_cpu_cores_split_between_replicas():
    v = load_variant("smollm2-bf16")
    assert placements(v, 2, gpus=0, cpus=2) == [
        {"ENV_VLLM_CPU_OMP_THREADS_BIND": "0", "ENV_OMP_NUM_THREADS": "1", "ENV_VLLM_CPU_NUM_OF_RESERVED_CPU": "0"},
        {"ENV_VLLM_CPU_OMP_THREADS_BIND": "1", "ENV_OMP_NUM_THREADS": "1", "ENV_VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}]
    assert [p["ENV_VLLM_CPU_OMP_THREADS_BIND"] for p in placements(v, 2, gpus=0, cpus=16)] == ["0-7", "8-15"]
    with pytest.raises(ReplicaError, match="3 replicas need at least 3 CPU cores; this machine has 2"):
        placements(v, 3, gpus=0, cpus=2)


def test_gpu_placement_gives_each_replica_its_own_devices():
    tp2 = load_variant("qwen35-4b-proxy-tp2", target="cuda")
    assert parallel_size(tp2) == 2
    assert placements(tp2, 2, gpus=4, cpus=16) == [{"ENV_CUDA_VISIBLE_DEVICES": "0,1"}, {"ENV_CUDA_VISIBLE_DEVICES": "2,3"}]
    with pytest.raises(ReplicaError, match=r"2 replicas of qwen35-4b-proxy-tp2 need 4 GPUs \(2 each\); this machine has 2"):
        placements(tp2, 2, gpus=2, cpus=16)
    with pytest.raises(ReplicaError, match="spans 2 GPUs per server"):
        placements(tp2, 2, gpus=1, cpus=16, share_gpu=True)
    one = load_variant("qwen35-4b-proxy-bf16", target="cuda")
    shared = placements(one, 2, gpus=1, cpus=16, share_gpu=True)
    assert shared[0] == shared[1] == {"ENV_CUDA_VISIBLE_DEVICES": "0", "SERVE_GPU_MEMORY_UTILIZATION": "0.450"}


def test_router_command_defaults_and_overrides():
    argv = router_argv(["http://a:1", "http://b:2"], policy="round_robin", host="127.0.0.1", port=9000,
                       metrics_port=9003, extra=["--health-check-interval-secs", "5"])
    assert argv[argv.index("--worker-urls") + 1:argv.index("--policy")] == ["http://a:1", "http://b:2"]
    assert argv.count("--health-check-interval-secs") == 1 and argv[-1] == "5"
    with pytest.raises(ReplicaError, match="--policy 'fastest'"):
        router_argv(["http://a:1"], policy="fastest", host="h", port=1, metrics_port=2)


def test_the_front_wraps_the_router_on_the_public_port(tmp_path):
    from scripts.common.server import free_port
    from scripts.serve.replicas import make_replicas

    port = free_port(4)
    group = make_replicas("smollm2-bf16", 2, policy="round_robin", port=port, log_dir=tmp_path,
                          topology_path=tmp_path / "t.json", front=True)
    argv = group.router.argv
    front, router = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    assert front[1:3] == ["-m", "scripts.serve.front"] and "--relay-only" in front
    assert front[front.index("--port") + 1] == str(port) and group.base_url.endswith(f":{port}")
    inner = front[front.index("--engine-port") + 1]
    assert router[router.index("--port") + 1] == inner != str(port)
    # route() rewrites what lies between --worker-urls and --policy: the router's own arguments, after the front's
    assert argv.index("--") < argv.index("--worker-urls") < argv.index("--policy")


def _stream(base_url: str, key: str, i: int, max_tokens: int = 32) -> dict:
    """One streamed fixed-length chat: 'complete' (a finish_reason arrived), 'error' (the client got an error) or
    'truncated' (the stream ended without a finish_reason and without an error)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{base_url}/v1", api_key=key, max_retries=0, timeout=120)
    t0, tokens, finish = time.monotonic(), 0, None
    try:
        stream = client.chat.completions.create(
            model="smollm2-bf16", messages=[{"role": "user", "content": f"Count from {i} to {i + 40}."}],
            max_tokens=max_tokens, temperature=0, stream=True, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices:
                finish = chunk.choices[0].finish_reason or finish
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        outcome = "complete" if finish else "truncated"
    except Exception as e:  # noqa: BLE001 - the outcome is what the test counts
        outcome, finish = "error", f"{type(e).__name__}: {e}"[:120]
    return {"i": i, "outcome": outcome, "tokens": tokens, "finish": finish, "s": time.monotonic() - t0}


def _batch(base_url: str, key: str, n: int, concurrency: int, start: int = 0, during=None) -> list[dict]:
    with cf.ThreadPoolExecutor(concurrency) as ex:
        futures = [ex.submit(_stream, base_url, key, start + i) for i in range(n)]
        if during:
            during()
        return [f.result(timeout=300) for f in futures]


def _served(url: str, key: str) -> float:
    status, body = http_get(f"{url}/metrics", timeout=10, api_key=key)
    assert status == 200
    return parse(body.decode())[0]["vllm:request_success_total"]


@pytest.mark.slow
def test_two_cpu_replicas_behind_vllm_router(embedded_weights, tmp_path):
    key = "replica-key-" + os.urandom(8).hex()
    port = free_port(4)  # the router, two replicas, the router's Prometheus port
    log, topology = tmp_path / "replicas.log", tmp_path / "topology.json"
    argv = [sys.executable, "-m", "scripts.serve.replicas", "smollm2-bf16", "--replicas", "2", "--policy",
            "round_robin", "--port", str(port), "--topology", str(topology), "--log-dir", str(tmp_path),
            "--set", "SERVE_MAX_MODEL_LEN=2048",
            "--set", "SERVE_ENFORCE_EAGER=1", "--restarts", "0", *server_args()]  # restarts: tests/serve/test_failover.py
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "API_KEY": key, "PYTHONUNBUFFERED": "1"})
    pids: list[int] = []
    try:
        wait_for_line(log, r"ready: (\S+)/v1 routes", proc, timeout_s=900)
        topo = json.loads(topology.read_text())
        base, replicas = topo["base_url"], topo["replicas"]
        pids = [r["pid"] for r in replicas] + [topo["router_pid"]]
        assert [r["placement"]["ENV_VLLM_CPU_OMP_THREADS_BIND"] for r in replicas] == ["0", "1"]
        # each replica is a keyed server as `make serve API_KEY=…` starts one (scripts.serve.launch.make_server): the key
        # is in no process's argv, and every route it lists but /health answers 401 without it (scripts.serve.guard)
        assert_key_guarded(replicas[0]["url"], key)
        checked = assert_every_route_guarded(replicas[0]["url"], key)
        assert {"/tokenize", "/detokenize", "/metrics", "/v1/chat/completions"} <= set(checked), checked
        # the router forwards the client's key: a wrong one is refused by the replica, never served
        assert {r["outcome"] for r in _batch(base, "wrong-key", 2, 2)} == {"error"}

        # balanced: round-robin gives each replica half of 16 requests
        before = [_served(r["url"], key) for r in replicas]
        first = _batch(base, key, 16, 4)
        assert all(r["outcome"] == "complete" and r["tokens"] == 32 for r in first), first
        per_replica = [_served(r["url"], key) - b for r, b in zip(replicas, before, strict=True)]
        assert per_replica == [8, 8], per_replica

        # replica 1 killed (SIGKILL, its whole process group) while 24 streams run at c=8
        killed_at = []

        def kill():
            time.sleep(2.0)
            os.killpg(replicas[1]["pid"], signal.SIGKILL)
            killed_at.append(time.monotonic())

        during = _batch(base, key, 24, 8, start=100, during=kill)
        outcomes = {o: sum(r["outcome"] == o for r in during) for o in ("complete", "error", "truncated")}
        print(f"\nkill mid-run: {outcomes}; slowest {max(r['s'] for r in during):.1f} s", flush=True)
        assert max(r["s"] for r in during) < 120, "a request hung after its replica died"
        assert outcomes["complete"] >= 12, during  # replica 0's share, and what the router retried onto it
        wait_for_line(log, r"warning: replica 1 \(pid \d+, \S+\) exited with code -9", proc, timeout_s=30)

        # drained: once the router's health checks (2 s apart, 2 failures) drop it, every request completes
        time.sleep(max(0.0, 6.0 - (time.monotonic() - killed_at[0])))
        after = _batch(base, key, 12, 4, start=200)
        assert all(r["outcome"] == "complete" and r["tokens"] == 32 for r in after), after
        status, body = http_get(topo["router_metrics_url"], timeout=10)
        health = {s.labels["worker"]: s.value for f in text_string_to_metric_families(body.decode())
                  for s in f.samples if s.name == "vllm_router_worker_health"}
        assert health == {replicas[0]["url"]: 1.0, replicas[1]["url"]: 0.0}, health
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=120)
    assert proc.returncode == 0, log.read_text()[-2000:]
    assert not any(group_pids(p) for p in pids), "processes left after serve-replicas stopped"
    assert not topology.exists()
