"""The scale ladder of one variant: one server, then replicas behind vllm-router per policy, then the router's own cost.

    python -m scripts.measure.scale smollm2-bf16 --replicas 2 --max-tokens-cap 32          # CPU: cores split per replica
    python -m scripts.measure.scale qwen35-4b-proxy-c128 --replicas 2                        # GPU: a GPU per replica
    python -m scripts.measure.scale smollm2-bf16 --replicas 2 --share-gpu                   # one GPU: plumbing, not scale

Each step is a latency record (scripts.measure.latency, the same prompt set and levels, every server's prefix cache
emptied before each level: the servers run with VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache): one server of the variant;
REPLICAS replicas (started once) behind vllm-router for each --policies entry (the router restarted per policy;
make serve-replicas' topology, every replica's prefix-cache hits per level); then the router's overhead: the router
over replica 0 alone, that replica measured at c=1 directly and through the router, alternating (ABBA) for --overhead-rounds rounds (same server, same prompts), so the difference is the
router alone (those records go to --overhead-dir, not experiments/). The last lines compare the steps (markdown, also written to --summary-out): output tok/s (per GPU on a
GPU machine), TTFT and TPOT p50/p99 per level, prefix-cache hit rate per replica, and the router's TTFT p50 ratio.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, parse_overrides
from scripts.measure import latency
from scripts.serve.replicas import POLICIES, ReplicaError, make_replicas


def latency_args(variant: str, extra: list[str]) -> argparse.Namespace:
    return latency.build_parser().parse_args([variant, *extra])


def run_step(variant: str, extra: list[str], written: list[Path]) -> Path | None:
    """One latency record; its path (None when the run failed)."""
    args = latency_args(variant, extra)
    before = set(Path(args.out_dir or paths.EXPERIMENTS / variant).glob("latency_*.json"))
    rc = latency.run_variant(variant, args)
    new = sorted(set(Path(args.out_dir or paths.EXPERIMENTS / variant).glob("latency_*.json")) - before)
    written += new
    return new[-1] if rc == 0 and new else None


def start_replicas(variant: str, n: int, args):
    group = make_replicas(variant, n, policy="round_robin", port=args.port, overrides=parse_overrides(args.set),
                          share_gpu=args.share_gpu, log_dir=paths.CACHE / "replicas")
    took, down = group.start()
    if down:  # a scale ladder compares whole topologies: one replica short is not the topology named
        group.stop()
        raise ServerError(f"{len(down)} of {n} replicas did not start: {next(iter(down.values()))}")
    print(f"{n} replica(s) healthy after {took:.1f} s", flush=True)
    return group


def summary_lines(paths_: list[Path]) -> list[str]:
    lines = ["| topology | level | out tok/s | per GPU | TTFT p50 / p99 ms | TPOT p50 / p99 ms | prefix hit rate per server | record |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in paths_:
        rec = json.loads(p.read_text())
        topo = rec.get("topology", {})
        name = (f"{topo.get('replicas')} x {rec['variant']} behind {topo.get('router')} ({topo.get('policy')})"
                if topo.get("router") else f"{rec['variant']} (TP{topo.get('tensor_parallel', 1)} DP{topo.get('data_parallel', 1)})")
        levels = [(f"c={c}", s) for c, s in rec["summary"].get("fixed", {}).items()]
        levels += [(f"{r['request_rate']:g}/s", r["summary"]) for r in rec.get("rate_sweep") or []]
        for lvl, s in levels:
            hits = ", ".join("—" if x.get("prefix_cache_hit_rate") is None else f"{x['prefix_cache_hit_rate']:.3f}"
                             for x in s.get("servers", []))
            per_gpu = s.get("output_throughput_per_gpu")
            lines.append(f"| {name} | {lvl} | {s['output_throughput']:.1f} | {'—' if per_gpu is None else f'{per_gpu:.1f}'} | "
                         f"{s['median_ttft_ms']:.1f} / {s['p99_ttft_ms']:.1f} | {s['median_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} | "
                         f"{hits} | `{paths.shown(p)}` |")
    return lines


def overhead_lines(pairs: list[tuple[Path, Path]]) -> list[str]:
    if not pairs:
        return []
    ratios, lines = [], ["", "| round | TTFT p50 direct ms | TTFT p50 via router ms | ratio | records |", "| --- | --- | --- | --- | --- |"]
    for i, (direct, routed) in enumerate(pairs, 1):
        d = json.loads(direct.read_text())["summary"]["fixed"]["1"]["median_ttft_ms"]
        r = json.loads(routed.read_text())["summary"]["fixed"]["1"]["median_ttft_ms"]
        ratios.append(r / d)
        lines.append(f"| {i} | {d:.2f} | {r:.2f} | {r / d:.4f} | `{paths.shown(direct)}`, `{paths.shown(routed)}` |")
    lines.append(f"\nRouter TTFT p50 ratio at c=1 over {len(ratios)} round(s): median {statistics.median(ratios):.4f} "
                 f"(min {min(ratios):.4f}, max {max(ratios):.4f}).")
    return lines


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--replicas", type=int, default=2)
    p.add_argument("--policies", default="round_robin,cache_aware", help=f"comma-separated, of {', '.join(POLICIES)}")
    p.add_argument("--share-gpu", action="store_true", help="every replica on GPU 0 (one GPU: plumbing, not scale)")
    p.add_argument("--prompts", default=str(paths.EVAL / "prompts" / "shared-prefix-v1.jsonl"))
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--request-rate", default="1,2,4")
    p.add_argument("--max-tokens-cap", type=int)
    p.add_argument("--limit", type=int, help="the first N prompts only (smoke runs)")
    p.add_argument("--overhead-rounds", type=int, default=3, help="direct/router pairs at c=1 (0: skip)")
    p.add_argument("--overhead-prompts", default=str(paths.EVAL / "prompts" / "latency-v1.jsonl"))
    p.add_argument("--skip-single", action="store_true", help="no one-server step (already measured)")
    p.add_argument("--port", type=int, default=8600, help="the router's port; the replicas take the next ones")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="records here instead of experiments/<variant>/")
    p.add_argument("--summary-out", type=Path, help="write the comparison (markdown) here too")
    p.add_argument("--overhead-dir", type=Path, help="the overhead pairs' records (default results/router-overhead-"
                   "<variant>/: c=1 diagnostics, kept out of experiments/ where compare reads the newest record)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.set = [*args.set, "ENV_VLLM_SERVER_DEV_MODE=1"]  # /reset_prefix_cache: every level starts with empty caches
    common = ["--prompts", args.prompts, "--concurrency", args.concurrency, "--modes", "fixed", "--reset-prefix-cache",
              *(["--request-rate", args.request_rate] if args.request_rate else []),
              *(["--max-tokens-cap", str(args.max_tokens_cap)] if args.max_tokens_cap else []),
              *(["--limit", str(args.limit)] if args.limit else []),
              *(["--out-dir", str(args.out_dir)] if args.out_dir else []),
              *[a for kv in args.set for a in ("--set", kv)]]
    written: list[Path] = []
    steps: list[Path] = []
    pairs: list[tuple[Path, Path]] = []
    try:
        policies = [p for p in args.policies.split(",") if p]
        if bad := [p for p in policies if p not in POLICIES]:
            raise ReplicaError(f"--policies: unknown {bad}; valid: {', '.join(POLICIES)}")
        if not args.skip_single:
            steps.append(run_step(args.variant, [*common, "--port", str(args.port)], written))
        topo_file = paths.CACHE / "replicas" / f"{args.variant}.json"
        group = start_replicas(args.variant, args.replicas, args)
        try:
            for policy in policies:  # the replicas stay up; only the router is restarted per policy
                group.route(policy)
                steps.append(run_step(args.variant, [*common, "--topology", str(topo_file)], written))
            if args.overhead_rounds:  # one replica behind the router, the same replica directly
                group.route(policies[0] if policies else "round_robin", workers=[0])
                one = ["--prompts", args.overhead_prompts, "--concurrency", "1", "--modes", "fixed",
                       *(["--max-tokens-cap", str(args.max_tokens_cap)] if args.max_tokens_cap else []),
                       "--out-dir", str(args.overhead_dir or paths.RESULTS / f"router-overhead-{args.variant}")]
                direct = [*one, "--base-url", group.servers[0].base_url]
                routed = [*one, "--topology", str(topo_file)]
                for k in range(args.overhead_rounds):  # ABBA: neither side always goes first
                    first, second = (direct, routed) if k % 2 == 0 else (routed, direct)
                    a, b = run_step(args.variant, first, written), run_step(args.variant, second, written)
                    if a and b:
                        pairs.append((a, b) if k % 2 == 0 else (b, a))
        finally:
            group.stop()
    except (VariantError, CheckpointError, ServerError, ReplicaError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    text = "\n".join(summary_lines([s for s in steps if s]) + overhead_lines(pairs)) + "\n"
    print(text)
    if args.summary_out:
        args.summary_out.write_text(text)
    failed = len(steps) - len([s for s in steps if s])
    print(f"{len(written)} record(s) written; {failed} step(s) failed", file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
