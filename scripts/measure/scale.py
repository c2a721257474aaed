"""The scale ladder of one variant: one server, replicas behind vllm-router per policy, other topologies of the same
model (vLLM's data or tensor parallel variants), then the router's own cost.

    python -m scripts.measure.scale smollm2-bf16 --replicas 2 --max-tokens-cap 32          # CPU: cores split per replica
    python -m scripts.measure.scale qwen35-4b-proxy-c128 --replicas 2                        # GPU: a GPU per replica
    python -m scripts.measure.scale qwen35-4b-proxy-c128 --single replica --with qwen35-4b-proxy-dp2 \
        --policies round_robin,cache_aware,consistent_hash --rounds 3 --round-levels 128 --max-tokens-cap 32 \
        --set SERVE_GPU_MEMORY_UTILIZATION=0.30 --set SERVE_KV_CACHE_MEMORY_BYTES=25769803776   # two GPUs, one start
    python -m scripts.measure.scale smollm2-bf16 --replicas 2 --share-gpu                   # one GPU: plumbing, not scale

Each step is a latency record (scripts.measure.latency, the same prompt set and levels, every request carrying its
prompt group as X-Session-ID, every server's prefix cache emptied before each level: the servers run with
VLLM_SERVER_DEV_MODE=1 for /reset_prefix_cache):
- one server of the variant: its own (`--single own`, started and stopped before the replicas), or replica 0 measured
  directly while the others sit idle (`--single replica`: on a GPU machine that is one GPU's server, and no start is
  spent on it), or none (`--single skip`);
- REPLICAS replicas (started once) behind vllm-router for each --policies entry (the router restarted per policy;
  make serve-replicas' topology, every replica's prefix-cache hits and requests per level);
- every `--with` variant (another topology of the same model, e.g. vLLM data parallel 2), its server started beside
  the replicas at the same time and measured through its own API.
With `--rounds N` the steps run again N-1 times at `--round-levels` only, in the reverse order every other round, so
each topology's ratio to the one server at those levels carries a 95% interval over the rounds (round 1 counts too;
scripts.common.metrics.speed_ratio). With `--slo-ttft-ms` / `--slo-tpot-ms` every level also records its goodput.
Then the router's overhead: the router over replica 0 alone, that replica measured at c=1 directly and through the
router, alternating (ABBA) for --overhead-rounds rounds (same server, same prompts), so the difference is the router
alone (those records go to --overhead-dir, not experiments/). The last lines compare the steps (markdown, also written
to --summary-out): output tok/s (per GPU on a GPU machine), goodput, TTFT and TPOT p50/p99 per level, prefix-cache hit
rate per server and over all, each topology's ratio with its interval, and the router's TTFT p50 ratio.
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.metrics import fmt, round_orders, speed_ratio
from scripts.common.records import now_utc
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.measure import latency
from scripts.serve.pool import Pool
from scripts.serve.replicas import POLICIES, ReplicaError, make_replicas

SINGLE = ("own", "replica", "skip")


@dataclass
class Step:
    """One topology of the ladder: its label, the variant its records belong to, the latency arguments that reach it,
    and what makes it ready (the router restarted with its policy)."""
    label: str
    variant: str
    args: list[str]
    ready: Callable[[], None] = lambda: None
    again: bool = True  # measured again in later rounds (the own one-server step is not: the replicas hold the GPUs)
    records: dict[int, Path] = field(default_factory=dict)  # round -> its record


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


def start_beside(names: list[str], args, out: dict) -> None:
    """The --with variants' servers, started at once into out["pool"] (a thread beside the replicas' start)."""
    pool = out["pool"] = Pool(paths.CACHE / "scale-pool")
    try:
        pool.start([load_variant(n, overrides=parse_overrides(args.set)) for n in names])
    except (VariantError, ServerError, CheckpointError) as e:
        out["error"] = e


def topology_name(rec: dict) -> str:
    topo = rec.get("topology", {})
    if topo.get("router"):
        return f"{topo.get('replicas')} x {rec['variant']} behind {topo.get('router')} ({topo.get('policy')})"
    return f"{rec['variant']} (TP{topo.get('tensor_parallel', 1)} DP{topo.get('data_parallel', 1)})"


def levels_of(rec: dict) -> list[tuple[str, dict]]:
    levels = [(f"c={c}", s) for c, s in rec["summary"].get("fixed", {}).items()]
    return levels + [(f"{r['request_rate']:g}/s", r["summary"]) for r in rec.get("rate_sweep") or []]


def hit_rate(level: dict) -> float | None:
    """The prefix-cache hit rate over every server of a level (hits / queries summed)."""
    servers = [x for x in level.get("servers", []) if x.get("prefix_cache_queries")]
    queries = sum(x["prefix_cache_queries"] for x in servers)
    return sum(x.get("prefix_cache_hits") or 0 for x in servers) / queries if queries else None


def summary_lines(paths_: list[Path]) -> list[str]:
    lines = ["| topology | level | out tok/s | per GPU | goodput tok/s | TTFT p50 / p99 ms | TPOT p50 / p99 ms | "
             "prefix hit rate (per server) | requests per server | record |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for p in paths_:
        rec = json.loads(p.read_text())
        for lvl, s in levels_of(rec):
            hits = ", ".join(fmt(x.get("prefix_cache_hit_rate"), ".3f") for x in s.get("servers", []))
            served = ", ".join(fmt(x.get("requests"), ".0f") for x in s.get("servers", []))
            good = (s.get("goodput") or {}).get("output_throughput")
            lines.append(f"| {topology_name(rec)} | {lvl} | {s['output_throughput']:.1f} | "
                         f"{fmt(s.get('output_throughput_per_gpu'), '.1f')} | {fmt(good, '.1f')} | "
                         f"{s['median_ttft_ms']:.1f} / {s['p99_ttft_ms']:.1f} | {s['median_tpot_ms']:.1f} / {s['p99_tpot_ms']:.1f} | "
                         f"{fmt(hit_rate(s), '.3f')} ({hits}) | {served} | `{paths.shown(p)}` |")
    return lines


def ratios(steps: list[Step], levels: list[int]) -> list[dict]:
    """Each topology's output tok/s over the first step's (the one server), paired round by round at each of `levels`:
    {label, variant, gpus, level, ratio (SpeedRatio), hit rates (this / the one server, means over the rounds), tok/s
    (mean over the rounds)}; a level with no round of both is left out."""
    if not steps or not steps[0].records or not levels:
        return []
    ref, out = steps[0], []
    read = functools.cache(lambda p: json.loads(p.read_text()))
    for step in steps[1:]:
        for c in levels:
            pairs, hits = [], []
            for k in sorted(set(step.records) & set(ref.records)):
                mine, theirs = (read(x)["summary"]["fixed"].get(str(c)) for x in (step.records[k], ref.records[k]))
                if mine and theirs:
                    pairs.append((mine["output_throughput"], theirs["output_throughput"]))
                    hits.append((hit_rate(mine), hit_rate(theirs)))
            if (sr := speed_ratio(pairs)) is None:
                continue
            mine_h, theirs_h = ([h[i] for h in hits if h[i] is not None] for i in (0, 1))
            out.append({"label": step.label, "variant": step.variant, "level": c, "ratio": sr,
                        "gpus": read(step.records[min(step.records)]).get("topology", {}).get("gpus"),
                        "tok_s": statistics.fmean(m for m, _ in pairs),
                        "hit_rate": statistics.fmean(mine_h) if mine_h else None,
                        "reference_hit_rate": statistics.fmean(theirs_h) if theirs_h else None})
    return out


def round_lines(rows: list[dict], reference: str) -> list[str]:
    """The ratios (above) over the `reference` step as a markdown table."""
    if not rows:
        return []
    return ["", f"Output tok/s over {reference}'s, paired by round (95% interval over the rounds: "
                "scripts.common.metrics.speed_ratio):", "",
            "| topology | level | rounds | × one server [95%] | verdict | hit rate (this / one server, mean) |",
            "| --- | --- | --- | --- | --- | --- |"] + [
        f"| {x['label']} | c={x['level']} | {x['ratio'].rounds} | {x['ratio'].text()} | {x['ratio'].verdict} | "
        f"{fmt(x['hit_rate'], '.3f')} / {fmt(x['reference_hit_rate'], '.3f')} |" for x in rows]


def summary_json(steps: list[Step], rows: list[dict], levels: list[int], ladder_id: str,
                 unstarted: dict[str, str] | None = None) -> dict:
    """What a caller reads back (make optimize's topology rung): every step's records by round, the ratios, and the
    `--with` topologies whose server never started, each with why."""
    return {"ladder_id": ladder_id, "levels": levels, "unstarted": unstarted or {},
            "steps": [{"label": s.label, "variant": s.variant, "records": {str(k): paths.shown(p)
                                                                           for k, p in sorted(s.records.items())}}
                      for s in steps],
            "ratios": [{**x, "ratio": x["ratio"].to_json()} for x in rows]}


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
    p.add_argument("--single", choices=SINGLE, default="own", help="the one-server step: its own server (default), "
                   "replica 0 measured directly, or none")
    p.add_argument("--skip-single", action="store_true", help="the same as --single skip")
    p.add_argument("--with", dest="beside", action="append", default=[], metavar="VARIANT",
                   help="another topology of the model (e.g. a data parallel variant), started beside the replicas")
    p.add_argument("--rounds", type=int, default=1, help="every step this many times, alternating the order; rounds "
                   "after the first at --round-levels only")
    p.add_argument("--round-levels", default="128", help="concurrency levels of rounds 2.. (default %(default)s)")
    p.add_argument("--prompts", default=str(paths.EVAL / "prompts" / "shared-prefix-v1.jsonl"))
    p.add_argument("--concurrency", default="1,8,32,128")
    p.add_argument("--request-rate", default="1,2,4", help="open-loop levels, req/s (none: closed loop only)")
    p.add_argument("--max-tokens-cap", type=int)
    p.add_argument("--limit", type=int, help="the first N prompts only (smoke runs)")
    p.add_argument("--slo-ttft-ms", type=float, help="with --slo-tpot-ms: goodput per level")
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--overhead-rounds", type=int, default=3, help="direct/router pairs at c=1 (0: skip)")
    p.add_argument("--overhead-prompts", default=str(paths.EVAL / "prompts" / "latency-v1.jsonl"))
    p.add_argument("--port", type=int, default=8600, help="the router's port; the replicas take the next ones")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="records here instead of experiments/<variant>/")
    p.add_argument("--summary-out", type=Path, help="write the comparison (markdown) here too")
    p.add_argument("--summary-json", type=Path, help="write the records per step and the ratios (JSON) here")
    p.add_argument("--overhead-dir", type=Path, help="the overhead pairs' records (default results/router-overhead-"
                   "<variant>/: c=1 diagnostics, kept out of experiments/ where compare reads the newest record)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    single = "skip" if args.skip_single else args.single
    args.set = [*args.set, "ENV_VLLM_SERVER_DEV_MODE=1"]  # /reset_prefix_cache: every level starts with empty caches
    ladder_id = f"scale-{args.variant}-{now_utc():%Y%m%d-%H%M%S}"
    shared = ["--modes", "fixed", "--reset-prefix-cache", "--session-header",
              "--prompts", args.prompts, "--ladder-id", ladder_id,
              *(["--max-tokens-cap", str(args.max_tokens_cap)] if args.max_tokens_cap else []),
              *(["--limit", str(args.limit)] if args.limit else []),
              *(["--slo-ttft-ms", str(args.slo_ttft_ms), "--slo-tpot-ms", str(args.slo_tpot_ms)]
                if args.slo_ttft_ms is not None and args.slo_tpot_ms is not None else []),
              *(["--out-dir", str(args.out_dir)] if args.out_dir else []),
              *[a for kv in args.set for a in ("--set", kv)]]
    rates = args.request_rate if args.request_rate not in ("", "none") else None
    full = ["--concurrency", args.concurrency, *(["--request-rate", rates] if rates else [])]
    written: list[Path] = []
    steps: list[Step] = []
    pairs: list[tuple[Path, Path]] = []
    group, beside, unstarted = None, {}, {}
    try:
        policies = [p for p in args.policies.split(",") if p]
        if bad := [p for p in policies if p not in POLICIES]:
            raise ReplicaError(f"--policies: unknown {bad}; valid: {', '.join(POLICIES)}")
        if args.rounds < 1:
            raise ReplicaError(f"--rounds {args.rounds}: at least 1")
        if args.rounds > 1 and single == "own":
            raise ReplicaError("--rounds > 1 alternates every step with the one server: --single replica keeps it "
                               "running beside the others (or --single skip)")
        round_levels = latency.parse_levels(args.round_levels)
        if single == "own":  # its own server, stopped before the replicas start
            one = Step("one server", args.variant, ["--port", str(args.port)], again=False)
            if rec := run_step(args.variant, [*shared, *full, *one.args, "--round", "1"], written):
                one.records[1] = rec
            steps.append(one)
        topo_file = paths.CACHE / "replicas" / f"{args.variant}.json"
        side = threading.Thread(target=start_beside, args=(args.beside, args, beside), daemon=True)
        if args.beside:
            side.start()
        try:
            group = start_replicas(args.variant, args.replicas, args)
        finally:
            while side.is_alive():
                side.join(0.5)
        if beside.get("error"):
            raise beside["error"]
        if single == "replica":
            r0 = group.servers[0]
            steps.append(Step("one server (replica 0 alone)", args.variant,
                              ["--base-url", r0.base_url, "--server-log", str(r0.log_path)]))
        for policy in policies:  # the replicas stay up; only the router is restarted per policy
            steps.append(Step(f"{args.replicas} replicas, {policy}", args.variant, ["--topology", str(topo_file)],
                              ready=functools.partial(group.route, policy)))
        pool = beside.get("pool")
        for name in args.beside:
            if name in pool.failed:  # the others are measured; the run still ends non-zero, naming it
                unstarted[name] = pool.failed[name]
                print(f"error: {name}: {pool.failed[name]}", file=sys.stderr)
                continue
            s = pool.servers[name]
            steps.append(Step(name, name, ["--base-url", s.base_url, "--server-log", str(s.log_path)]))
        for k in range(1, args.rounds + 1):
            levels = full if k == 1 else ["--concurrency", ",".join(map(str, round_levels))]
            # round 1 has run the own one-server step already; later rounds go backwards every other time
            todo = [s for s in steps if k not in s.records and (k == 1 or s.again)]
            for step in round_orders(todo, k)[-1]:  # the ladders' ABBA rule
                step.ready()
                if rec := run_step(step.variant, [*shared, *levels, *step.args, "--round", str(k)], written):
                    step.records[k] = rec
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
    except (VariantError, CheckpointError, ServerError, ReplicaError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        if group:
            group.stop()
        if beside.get("pool"):
            beside["pool"].stop()
    firsts = [s.records[1] for s in steps if 1 in s.records]
    rows = ratios(steps, round_levels)
    text = "\n".join(summary_lines(firsts) + round_lines(rows, steps[0].label if steps else "")
                     + overhead_lines(pairs)) + "\n"
    print(text)
    if args.summary_out:
        args.summary_out.write_text(text)
    if args.summary_json:
        paths.write_text_atomic(args.summary_json, json.dumps(summary_json(steps, rows, round_levels, ladder_id,
                                                                           unstarted), indent=1) + "\n")
    failed = sum(len([k for k in range(1, (args.rounds if s.again else 1) + 1) if k not in s.records])
                 for s in steps) + len(unstarted)
    print(f"{len(written)} record(s) written; {failed} step(s) failed"
          + (f" ({', '.join(unstarted)} never started)" if unstarted else ""),
          file=sys.stderr if failed else sys.stdout)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
