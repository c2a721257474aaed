"""Drift probe: a fixed probe batch every N seconds against a running server, exposed as Prometheus gauges.

    python -m scripts.measure.monitor smollm2-bf16 --base-url http://127.0.0.1:8000 --every 60 --port 9400
    curl -s 127.0.0.1:9400/metrics | grep variant_lab_

Each probe sends the first `--batch` prompts of the latency prompt set at once (fixed length, greedy) and exports
tokens/s, median TTFT/TPOT and the server's speculative acceptance rate. Thresholds come from the variant's newest ok
latency record (same mode, concurrency = batch): a warning is printed when throughput falls below
(1 - tolerance) x recorded or median TPOT rises above (1 + tolerance) x recorded. --probes bounds the run.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

from scripts.common import paths
from scripts.common.metrics import summarize
from scripts.common.records import of_record
from scripts.common.server import is_healthy
from scripts.measure.prom import scrape, server_counters

BASELINE_MODE = "fixed"


def baseline(variant: str, batch: int) -> dict | None:
    """The newest ok latency record's summary at concurrency == batch, or None."""
    for path in sorted((paths.EXPERIMENTS / variant).glob("latency_*.json"), reverse=True):
        rec = json.loads(path.read_text())
        level = rec.get("summary", {}).get(BASELINE_MODE, {}).get(str(batch))
        if rec.get("status") == "ok" and level and of_record(rec):
            return {"record": path.name, **level}
    return None


def drift_warnings(now: dict, ref: dict | None, tolerance: float) -> list[str]:
    """Pure: compare one probe summary with the reference summary."""
    if ref is None:
        return []
    out = []
    if now.get("output_throughput") and ref.get("output_throughput") and \
            now["output_throughput"] < (1 - tolerance) * ref["output_throughput"]:
        out.append(f"throughput {now['output_throughput']:.1f} tok/s < {(1 - tolerance):.0%} of recorded "
                   f"{ref['output_throughput']:.1f} ({ref['record']})")
    if now.get("median_tpot_ms") and ref.get("median_tpot_ms") and \
            now["median_tpot_ms"] > (1 + tolerance) * ref["median_tpot_ms"]:
        out.append(f"median TPOT {now['median_tpot_ms']:.1f} ms > {(1 + tolerance):.0%} of recorded "
                   f"{ref['median_tpot_ms']:.1f} ms ({ref['record']})")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--every", type=float, default=60.0, help="seconds between probes")
    p.add_argument("--batch", type=int, default=4, help="requests per probe, sent at once")
    p.add_argument("--port", type=int, default=9400, help="port of this probe's own /metrics")
    p.add_argument("--tolerance", type=float, default=0.2)
    p.add_argument("--probes", type=int, default=0, help="stop after this many probes (0: run until Ctrl-C)")
    return p


def main(argv: list[str] | None = None) -> int:
    from prometheus_client import Gauge, start_http_server

    from scripts.common.loadgen import DEFAULT_PROMPTS, load_prompts, openai_client, run_level

    args = build_parser().parse_args(argv)
    if not is_healthy(args.base_url):
        print(f"error: no healthy server at {args.base_url}", file=sys.stderr)
        return 1
    rows, _ = load_prompts(DEFAULT_PROMPTS, args.batch)
    ref = baseline(args.variant, args.batch)
    print(f"reference: {ref['record'] if ref else 'none (no latency record at this batch): no drift warnings'}")
    gauges = {k: Gauge(f"variant_lab_{k}", d, ["variant"]) for k, d in (
        ("output_throughput", "probe output tokens/s"), ("median_ttft_ms", "probe median TTFT (ms)"),
        ("median_tpot_ms", "probe median TPOT (ms)"), ("failed_requests", "failed probe requests"),
        ("spec_decode_acceptance_rate", "accepted / draft tokens during the probe"))}
    start_http_server(args.port, addr="127.0.0.1")
    client = openai_client(args.base_url)
    n = 0
    while not args.probes or n < args.probes:
        before = scrape(args.base_url)
        samples, duration = run_level(client, args.variant, rows, BASELINE_MODE, args.batch, None)
        s = summarize(samples, duration)
        s["spec_decode_acceptance_rate"] = server_counters(before, scrape(args.base_url)).get("spec_decode_acceptance_rate")
        s["failed_requests"] = s["failed"]
        for key, gauge in gauges.items():
            if s.get(key) is not None:
                gauge.labels(args.variant).set(s[key])
        print(f"probe {n + 1}: {s['output_throughput'] or 0:.1f} tok/s, tpot p50 {s['median_tpot_ms'] or 0:.1f} ms, "
              f"failed {s['failed']}", flush=True)
        for w in drift_warnings(s, ref, args.tolerance):
            print(f"WARNING: {w}", flush=True)
        n += 1
        if not args.probes or n < args.probes:
            time.sleep(args.every)
    return 0


if __name__ == "__main__":
    sys.exit(main())
