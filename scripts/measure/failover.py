"""A replica lost under load: `make serve-replicas` as a user runs it, one replica killed mid-run, counted.

    python -m scripts.measure.failover smollm2-bf16 --concurrency 32 --requests 256    # `make failover`
    python -m scripts.measure.failover smollm2-gguf-bf16-server --concurrency 8 --requests 48 --kill-after 2

1. Starts the variant's replicas behind vllm-router (`python -m scripts.serve.replicas`, REPLICAS=2: its own GPUs or
   CPU cores each, the router's health checks 2 s apart, a replica that exits started again) and waits for it.
2. Streams `--requests` chats at `--concurrency` through the router; `--kill-after` seconds in, reads the victim's
   requests in flight from its /metrics and kills its whole process group (SIGKILL: a lost machine, not a shutdown).
3. Times serve-replicas' restart of the victim (a new PID answering /health), waits for the router's next health
   checks, reads the router's own view of it (vllm_router_worker_health), then streams `--rejoin-requests` more and
   reads the tokens the victim generated (cache_aware may keep a light load on the replica that holds the prefixes).

Judged (the record's summary.criteria, each with its value and target):
- lost beyond the killed replica's streams: requests that did not complete, less the streams in flight on the victim
  when it died, and any failed request that began after the router's health window (checks x interval + timeout)
  had passed: 0;
- hangs (no end within --timeout): 0;
- the victim back: restarted, healthy in the router's rotation, and every rejoin request completed.
How each lost stream ended (an error event, a stream cut without [DONE], a broken connection) is counted too.
Record: experiments/<variant>/failover_<stamp>.json (every request's outcome, start and end beside the kill).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

from scripts.common import paths
from scripts.common.engines import engine_of
from scripts.common.loadgen import DEFAULT_PROMPTS, PromptSetError, load_prompts
from scripts.common.records import envelope, mark_unmet, save_record
from scripts.common.server import ServerError, free_port, is_healthy
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.measure.prom import scrape
from scripts.measure.soak import Outcome, request_for, send
from scripts.serve.replicas import ROUTER_DEFAULTS

# per engine: (the gauges of requests running and queued, a counter of generated tokens) in its /metrics
GAUGES = {"vllm": (("vllm:num_requests_running", "vllm:num_requests_waiting"), "vllm:generation_tokens_total"),
          "llamaserver": (("llamacpp:requests_processing", "llamacpp:requests_deferred"), "llamacpp:tokens_predicted_total")}


class LossError(RuntimeError):
    pass


def health_window_s(router_args: dict[str, str] = ROUTER_DEFAULTS) -> float:
    """How long after a replica dies the router may still send it requests: its failure threshold x the interval
    between checks, plus one check's timeout."""
    return (float(router_args["--health-failure-threshold"]) * float(router_args["--health-check-interval-secs"])
            + float(router_args["--health-check-timeout-secs"]))


def judge(outs: list[dict], in_flight: int | None, kill_s: float, window_s: float, rejoin: dict,
          read_s: float | None = None) -> dict:
    """The criteria from the requests' outcomes (each with start_s / end_s from the run's start), the victim's streams
    in flight at the kill, and the rejoin phase. Pure: samples in, summary out.

    The victim's gauge is read from read_s until the kill at kill_s (a /metrics scrape of a GPU server takes a good
    part of a second): a request sent in that window may have reached the victim after the read, so a failed one that
    started then (before the kill: the survivor did not die) is counted as the victim's stream too."""
    failed = [o for o in outs if o["outcome"] != "complete"]
    hangs = sum(o["outcome"] == "hang" for o in outs)
    late = [o for o in failed if o["start_s"] > kill_s + window_s]  # sent after the router should have known
    unseen = [o for o in failed if read_s is not None and read_s <= o["start_s"] < kill_s]
    victims = None if in_flight is None else in_flight + len(unseen)
    lost = max(0, len(failed) - len(late) - victims) + len(late) if victims is not None else len(failed)
    by_outcome: dict[str, int] = {}
    for o in outs:
        by_outcome[o["outcome"]] = by_outcome.get(o["outcome"], 0) + 1
    ended = {k: sum(o["outcome"] == k for o in failed) for k in ("stream_error", "truncated", "broken", "server_error")}
    back = rejoin.get("healthy_after_s") is not None
    admitted = rejoin.get("router_health") == 1.0
    criteria = {
        "lost_beyond_killed_streams": {"value": lost, "target": "0", "pass": lost == 0},
        "hangs": {"value": hangs, "target": "0", "pass": hangs == 0},
        "victim_rejoined": {"value": {"restarted_after_s": rejoin.get("healthy_after_s"), "router_health": rejoin.get(
                                          "router_health"), "rejoin_complete": rejoin.get("complete"),
                                      "rejoin_requests": rejoin.get("requests"),
                                      "victim_generated_tokens": rejoin.get("victim_tokens")},
                            "target": "restarted, healthy in the router's rotation, every rejoin request complete",
                            "pass": back and admitted and rejoin.get("complete") == rejoin.get("requests")},
    }
    return {"requests": len(outs), "by_outcome": by_outcome, "failed": len(failed), "in_flight_on_victim": in_flight,
            "failed_sent_while_gauge_read": len(unseen),
            "failed_ended_by": ended, "failed_after_health_window": len(late),
            "last_failure_start_after_kill_s": round(max((o["start_s"] - kill_s for o in failed), default=0.0), 3),
            "health_window_s": window_s, "criteria": criteria, "pass": all(c["pass"] for c in criteria.values())}


def metric(url: str, name: str) -> float | None:
    got = scrape(url)
    return got[0].get(name) if got else None


def router_health(metrics_url: str, worker: str) -> float | None:
    """vllm-router's own view of a worker: its vllm_router_worker_health gauge (1 healthy, 0 out of rotation)."""
    from prometheus_client.parser import text_string_to_metric_families

    from scripts.common.server import http_get

    try:
        status, body = http_get(metrics_url, timeout=10)
    except OSError:
        return None
    if status != 200:
        return None
    return next((s.value for f in text_string_to_metric_families(body.decode()) for s in f.samples
                 if s.name == "vllm_router_worker_health" and s.labels.get("worker") == worker), None)


def run_load(base_url: str, rows, model: str, n: int, c: int, timeout_s: float, t0: float, start: int = 0,
             during=None) -> list[dict]:
    """n streamed chats at concurrency c; each sample with start_s / end_s from t0. `during` runs beside them."""
    import httpx

    def one(i: int, client) -> dict:
        path, body = request_for("chat", start + i, rows, model, 8192, 0)
        s = time.monotonic() - t0
        out = send(client, base_url, path, {**body, "max_tokens": 64, "temperature": 0}, Outcome("chat", path, c, i),
                   timeout_s)
        return {**asdict(out), "start_s": round(s, 3), "end_s": round(time.monotonic() - t0, 3)}

    with httpx.Client(limits=httpx.Limits(max_connections=c + 4)) as client, cf.ThreadPoolExecutor(c + 1) as pool:
        side = pool.submit(during) if during else None
        outs = list(pool.map(lambda i: one(i, client), range(n)))
        if side:
            side.result()
    return outs


def wait_ready(log: Path, topology: Path, proc: subprocess.Popen, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])
            raise LossError(f"serve-replicas exited with code {proc.returncode} before it was ready: {tail}")
        if "ready:" in log.read_text(errors="replace") and topology.is_file():
            return json.loads(topology.read_text())
        time.sleep(0.5)
    raise LossError(f"serve-replicas not ready after {timeout_s:.0f} s (log {log})")


def measure(args, variant) -> dict:
    rows, info = load_prompts(DEFAULT_PROMPTS)
    engine = engine_of(variant).name
    if engine not in GAUGES:
        raise LossError(f"{variant.name}: ENGINE={engine} has no requests-running gauge here ({', '.join(GAUGES)} do)")
    running, produced = GAUGES[engine]
    work = paths.CACHE / "failover" / variant.name
    work.mkdir(parents=True, exist_ok=True)
    topology, log = work / "topology.json", work / "serve-replicas.log"
    topology.unlink(missing_ok=True)
    port = free_port(args.replicas + 2)
    argv = [sys.executable, "-m", "scripts.serve.replicas", variant.name, "--replicas", str(args.replicas),
            "--policy", args.policy, "--port", str(port), "--topology", str(topology), "--log-dir", str(work),
            *(["--front"] if args.front else []),
            *[a for kv in args.set for a in ("--set", kv)]]
    record = envelope("failover", variant, command=[sys.executable, "-m", "scripts.measure.failover",
                                                        *sys.argv[1:]], server_command=argv)
    window = health_window_s()
    record["inputs"] = {**info, "replicas": args.replicas, "policy": args.policy, "concurrency": args.concurrency,
                        "requests": args.requests, "kill_after_s": args.kill_after, "victim": args.victim,
                        "rejoin_requests": args.rejoin_requests, "timeout_s": args.timeout, "max_tokens": 64,
                        "router_settings": dict(ROUTER_DEFAULTS), "health_window_s": window, "front": args.front}
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        topo = wait_ready(log, topology, proc, args.start_timeout)
        base, victim = topo["base_url"], topo["replicas"][args.victim]
        model = variant.request_models[0]
        record["topology"] = topo
        t0 = time.monotonic()
        kill: dict = {}

        def kill_victim() -> None:
            time.sleep(args.kill_after)
            kill["gauge_read_at_s"] = round(time.monotonic() - t0, 3)
            got = [metric(victim["url"], name) for name in running]  # running and queued: both die with it
            kill["in_flight"] = None if None in got else sum(got)
            try:
                os.killpg(victim["pid"], signal.SIGKILL)
            except ProcessLookupError:
                raise LossError(f"replica {args.victim} (pid {victim['pid']}) had already exited before the kill") from None
            kill["at_s"] = round(time.monotonic() - t0, 3)
            print(f"killed replica {args.victim} (pid {victim['pid']}) at {kill['at_s']} s with "
                  f"{kill['in_flight']} requests running or queued on it", flush=True)
            # serve-replicas starts it again: a new PID in the topology, answering /health
            deadline = time.monotonic() + args.start_timeout
            while time.monotonic() < deadline:
                new = json.loads(topology.read_text())["replicas"][args.victim] if topology.is_file() else {}
                if new.get("pid") not in (None, victim["pid"]) and is_healthy(victim["url"], path=health):
                    rejoin["healthy_after_s"] = round(time.monotonic() - t0 - kill["at_s"], 2)
                    rejoin["pid"] = new["pid"]
                    return
                time.sleep(0.25)

        health = engine_of(variant).health_path
        rejoin: dict = {"requests": args.rejoin_requests}
        outs = run_load(base, rows, model, args.requests, args.concurrency, args.timeout, t0, during=kill_victim)
        if kill["at_s"] >= max(o["end_s"] for o in outs):
            raise LossError(f"every request had ended before the kill at {kill['at_s']} s: raise --requests or lower "
                            f"--kill-after")
        if "healthy_after_s" in rejoin:
            # the router's next checks admit it (--health-success-threshold checks, --health-check-interval-secs apart)
            time.sleep(2 * float(ROUTER_DEFAULTS["--health-check-interval-secs"]) + 1)
            rejoin["router_health"] = router_health(topo["router_metrics_url"], victim["url"])
            before = metric(victim["url"], produced) or 0.0
            more = run_load(base, rows, model, args.rejoin_requests, args.concurrency, args.timeout, t0,
                            start=args.requests)
            rejoin["complete"] = sum(o["outcome"] == "complete" for o in more)
            rejoin["victim_tokens"] = (metric(victim["url"], produced) or 0.0) - before
            record["rejoin_samples"] = more
        record["kill"] = kill
        record["samples"] = outs
        record["rejoin"] = rejoin
        record["summary"] = judge(outs, None if kill.get("in_flight") is None else int(kill["in_flight"]),
                                  kill.get("at_s", 0.0), window, rejoin, kill.get("gauge_read_at_s"))
        record["duration_s"] = round(time.monotonic() - t0, 2)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=300)  # it stops the router and every replica (each in its own session) first
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
        record["serve_replicas_log_tail"] = log.read_text(errors="replace").strip().splitlines()[-12:]
    mark_unmet(record)
    s = record["summary"]
    print(f"{s['requests']} requests: {s['by_outcome']}; {s['in_flight_on_victim']} in flight on the victim; lost "
          f"beyond them {s['criteria']['lost_beyond_killed_streams']['value']}; hangs {s['criteria']['hangs']['value']}; "
          f"victim back after {rejoin.get('healthy_after_s')} s, served {rejoin.get('victim_tokens')} tokens of "
          f"{rejoin.get('requests')} rejoin requests", flush=True)
    return record


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policy", default="cache_aware")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--kill-after", type=float, default=10.0, help="seconds into the run (default %(default)s)")
    p.add_argument("--victim", type=int, default=1, help="the replica killed (index, default %(default)s)")
    p.add_argument("--rejoin-requests", type=int, default=32)
    p.add_argument("--timeout", type=float, default=120.0, help="a request with no end after this is a hang")
    p.add_argument("--start-timeout", type=float, default=900.0, help="seconds for the replicas (and the restart)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--front", action="store_true", help="serve-replicas --front: the lab's streaming front before the "
                   "router, so the victim's streams end with an error event")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        if args.requests < 1 or args.concurrency < 1 or args.rejoin_requests < 1:
            raise LossError("--requests, --concurrency and --rejoin-requests: at least 1 each")
        if not 0 <= args.victim < args.replicas or args.replicas < 2:
            raise LossError(f"--victim {args.victim} of --replicas {args.replicas}: two replicas or more, a victim "
                            f"among them")
        with paths.terminate_raises():  # SIGTERM runs measure's finally: serve-replicas is stopped, not left running
            record = measure(args, variant)
    except (VariantError, PromptSetError, ServerError, LossError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = save_record(record, args.out_dir or paths.variant_dir(variant.name), "failover")
    if path is None:
        return 1
    print(f"wrote {paths.shown(path)}")
    return 0 if record["summary"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
