"""A replica lost under load (scripts/measure/failover.py): the judging as pure math, and one real run of two
llama-server replicas behind vllm-router on this CPU, one killed mid-run, restarted by serve-replicas, rejoining."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from scripts.common import paths
from scripts.measure.failover import health_window_s, judge
from scripts.report import schemas


def sample(outcome: str, start_s: float) -> dict:
    return {"outcome": outcome, "start_s": start_s, "end_s": start_s + 1.0, "e2e_ms": 1000.0}


REJOINED = {"requests": 4, "healthy_after_s": 3.0, "router_health": 1.0, "complete": 4, "victim_tokens": 100.0}


def test_failures_beyond_the_victims_streams_are_lost_and_late_ones_always_count():
    assert health_window_s() == 6.0  # 2 failed checks 2 s apart, plus one 2 s timeout
    outs = [sample("complete", 0.0)] * 10 + [sample("broken", 1.0)] * 3 + [sample("truncated", 1.5)]
    s = judge(outs, in_flight=4, kill_s=2.0, window_s=6.0, rejoin=REJOINED)
    assert s["criteria"]["lost_beyond_killed_streams"]["value"] == 0 and s["pass"]
    assert s["failed_ended_by"] == {"stream_error": 0, "truncated": 1, "broken": 3, "server_error": 0}
    s = judge([*outs, sample("server_error", 2.1)], in_flight=4, kill_s=2.0, window_s=6.0, rejoin=REJOINED)
    assert s["criteria"]["lost_beyond_killed_streams"]["value"] == 1 and not s["pass"]
    # a failure sent after the router's health window is lost even when the count of failures would hide it
    s = judge([*outs[:-1], sample("broken", 9.0)], in_flight=4, kill_s=2.0, window_s=6.0, rejoin=REJOINED)
    assert s["failed_after_health_window"] == 1 and s["criteria"]["lost_beyond_killed_streams"]["value"] == 1
    s = judge([*outs, sample("hang", 3.0)], in_flight=None, kill_s=2.0, window_s=6.0, rejoin=REJOINED)
    assert s["criteria"]["hangs"]["value"] == 1 and s["criteria"]["lost_beyond_killed_streams"]["value"] == 5
    # a failure sent while the victim's gauge was being read (1.9 s, before the kill at 2.0 s) was on the victim
    # unseen by the gauge; one sent before the read began is not excused
    s = judge([*outs, sample("broken", 1.95)], in_flight=4, kill_s=2.0, window_s=6.0, rejoin=REJOINED, read_s=1.9)
    assert s["failed_sent_while_gauge_read"] == 1 and s["criteria"]["lost_beyond_killed_streams"]["value"] == 0
    s = judge([*outs, sample("broken", 1.85)], in_flight=4, kill_s=2.0, window_s=6.0, rejoin=REJOINED, read_s=1.9)
    assert s["failed_sent_while_gauge_read"] == 0 and s["criteria"]["lost_beyond_killed_streams"]["value"] == 1
    not_back = judge(outs, 4, 2.0, 6.0, {"requests": 4})
    assert not not_back["criteria"]["victim_rejoined"]["pass"] and not not_back["pass"]


@pytest.mark.slow
def test_a_replica_killed_mid_run_is_restarted_and_rejoins(bf16_export, tmp_path):
    """With the lab's front before the router (serve-replicas --front), the victim's streams end with an error event
    (vllm-router alone cuts them)."""
    r = subprocess.run([sys.executable, "-m", "scripts.measure.failover", "smollm2-gguf-bf16-server", "--concurrency",
                        "8", "--requests", "48", "--kill-after", "2", "--rejoin-requests", "16", "--policy",
                        "round_robin", "--timeout", "60", "--front", "--out-dir", str(tmp_path)],
                       cwd=paths.ROOT, capture_output=True, text=True, timeout=600, check=False)
    (path,) = tmp_path.glob("failover_*.json")  # written whether the criteria pass or not
    assert schemas.check_file(path) == [], r.stdout + r.stderr
    rec = json.loads(path.read_text())
    s = rec["summary"]
    assert rec["kill"]["in_flight"] >= 1, rec["kill"]  # the kill landed on streams in flight
    assert s["criteria"]["hangs"]["value"] == 0, s
    assert s["failed"] >= rec["kill"]["in_flight"] - 1, s  # the victim's streams ended (one may have just finished)
    assert s["failed_ended_by"]["stream_error"] == s["failed"] >= 1 and rec["inputs"]["front"], s  # each by an event
    rejoined = s["criteria"]["victim_rejoined"]
    assert rejoined["pass"] and rejoined["value"]["victim_generated_tokens"] > 0, rejoined  # round robin: it serves
    assert any("is back (pid" in line for line in rec["serve_replicas_log_tail"]), rec["serve_replicas_log_tail"]
    assert r.returncode == (0 if s["pass"] else 1), r.stdout + r.stderr


@pytest.mark.slow
def test_a_replica_that_never_answers_leaves_the_router_serving_the_others(bf16_export, tmp_path):
    from dataclasses import replace

    from scripts.common.server import free_port, http_get, http_post_json
    from scripts.serve.replicas import make_replicas

    group = make_replicas("smollm2-gguf-bf16-server", 2, policy="round_robin", port=free_port(4), log_dir=tmp_path,
                          topology_path=tmp_path / "topology.json")
    dead = group.servers[1]  # a process that never answers on its port: the bad input
    group.servers[1] = replace(dead, argv=[sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        took, down = group.start(timeout_s=10)
        assert list(down) == [1] and "not healthy after" in down[1], down
        deadline = time.monotonic() + 3 * health_window_s()  # its health checks find it within their window
        while dead.base_url not in (said := http_get(f"{group.base_url}/health")[1].decode()) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert dead.base_url in said, said  # the router says which one is down
        for _ in range(4):  # and keeps serving on the other
            code, answer = http_post_json(f"{group.base_url}/v1/chat/completions", {
                "model": "smollm2-gguf-bf16-server", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
            assert code == 200 and answer["choices"][0]["message"]["content"], (code, answer)
    finally:
        group.stop()
