"""Capacity plan from committed latency records: which topology, and how many GPUs (or CPU cores), serve a request rate
within a latency target. What `make plan VARIANT=… SLO_TPOT_MS=… QPS=…` runs.

    python -m scripts.report.plan qwen35-4b-proxy-c128 --slo-tpot-ms 40 --qps 20
    python -m scripts.report.plan smollm2-bf16 --slo-tpot-ms 150 --slo-ttft-ms 3000 --qps 2 --prompts latency-v1.jsonl

Topologies: the variant's own records (one server, or replicas behind a router: `make serve-replicas` +
`make eval-latency TOPOLOGY=…`) and those of its children that differ from it only in vLLM's parallelism
(SERVE_TENSOR_PARALLEL_SIZE, SERVE_DATA_PARALLEL_SIZE, e.g. qwen35-4b-proxy-tp2 of qwen35-4b-proxy-c128). Only records
with status ok, of one prompt set and one kind of machine (the GPU's name, or the CPU model, cores and flags) are used;
the newest per topology with the most load levels (a later round of a scale ladder measures only its saturation level),
on the machine of the newest record unless --machine names another.

THE PLAN IS A MODEL FITTED TO THE RECORDS, not a measurement of the plan itself:
- an instance's capacity is the highest request rate it served at a measured load level whose p99 TPOT and p99 TTFT
  meet the target, read from the open-loop Poisson levels where the record has them (a request rate arrives in
  bursts; a closed loop at the same throughput queues less), else from the closed-loop concurrency levels (their
  achieved request rate). Open-loop levels count at their
  offered rate — n requests over the last arrival of their seeded Poisson draw — when every request completed and the
  last one ended early enough that the served rate is at least 90 % of the offered one); between the last level that
  meets the TPOT target and the first that misses it, the rate is interpolated linearly in p99 TPOT ("interpolated");
- instances needed = ceil(QPS / capacity), units (GPUs, or CPU cores on a CPU) = instances x the instance's units;
  instances are assumed independent (no effect of one on another beyond what each record measured).
Writes results/plan_<variant>_<YYYYMMDD>.md and .png (units needed against request rate, one line per topology), both
naming every record used.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.records import all_records, now_utc
from scripts.common.variants import VariantError, list_variants, load_variant
from scripts.serve.plan import PARALLEL_SETTINGS

MODE = "fixed"
PARALLEL_KEYS = {*PARALLEL_SETTINGS.values(), "ENV_NCCL_NVLS_ENABLE", "PARENT"}  # what a TP/DP child may change
SERVED_FRACTION = 0.9  # an open-loop level counts when this share of its offered rate was served


class PlanError(ValueError):
    pass


# compilation passes that exist only across GPUs (they fuse the all-reduce of tensor parallelism): a child that sets
# one changes its parallel topology, not the model's serving settings
COMM_PASSES = {"fuse_allreduce_rms"}


def beyond_parallelism(settings: dict[str, str]) -> dict[str, str]:
    """The settings other than vLLM's parallelism (its sizes, NCCL's environment, the all-reduce passes)."""
    out = {k: v for k, v in settings.items() if k not in PARALLEL_KEYS}
    if "SERVE_COMPILATION_CONFIG" in out:
        cfg = json.loads(out["SERVE_COMPILATION_CONFIG"])
        passes = {k: v for k, v in (cfg.get("pass_config") or {}).items() if k not in COMM_PASSES}
        cfg = {**{k: v for k, v in cfg.items() if k != "pass_config"}, **({"pass_config": passes} if passes else {})}
        out.pop("SERVE_COMPILATION_CONFIG")
        if cfg:
            out["SERVE_COMPILATION_CONFIG"] = json.dumps(cfg, sort_keys=True)
    return out


def family(name: str) -> list[str]:
    """The variant and its children that change only vLLM's parallelism."""
    mine = beyond_parallelism(load_variant(name).settings)
    out = [name]
    for other in list_variants():
        s = load_variant(other).settings
        if s.get("PARENT") == name and beyond_parallelism(s) == mine:
            out.append(other)
    return out


def machine(rec: dict) -> str:
    hw = rec["hardware"]
    if hw.get("gpu"):
        return hw["gpu"]["name"]
    return f"{hw['cpu']} ({hw['cores']} cores, {' '.join(hw.get('cpu_flags') or [])})"


def topology_of(rec: dict) -> dict:
    """The record's topology; records from before topologies were written are one server."""
    return rec.get("topology") or {"router": None, "policy": None, "replicas": 1, "tensor_parallel": 1,
                                   "data_parallel": 1, "gpus": 1 if rec["hardware"].get("gpu") else 0}


def label(variant: str, topo: dict) -> str:
    parts = [variant]
    if topo.get("tensor_parallel", 1) > 1:
        parts.append(f"TP{topo['tensor_parallel']}")
    if topo.get("data_parallel", 1) > 1:
        parts.append(f"DP{topo['data_parallel']}")
    if topo.get("replicas", 1) > 1:
        parts.append(f"{topo['replicas']} replicas, {topo['router']} {topo['policy']}"
                     + (" (one GPU shared)" if topo.get("shared_gpu") else ""))
    return " · ".join(parts)


def units(rec: dict) -> tuple[int, str]:
    """What one instance occupies: its GPUs, or on a CPU machine the cores it was given (the whole machine)."""
    topo = topology_of(rec)
    if rec["hardware"].get("gpu"):
        return max(1, topo.get("gpus") or 1), "GPU"
    return rec["hardware"]["cores"], "CPU core"


def load_points(rec: dict) -> list[dict]:
    """(kind, load, served rate, p99 TPOT, p99 TTFT) of every level of a record, lightest first."""
    pts = []
    for c, s in sorted(rec["summary"].get(MODE, {}).items(), key=lambda kv: int(kv[0])):
        pts.append({"load": f"c={c}", "rate": s["request_throughput"], "tpot": s["p99_tpot_ms"], "ttft": s["p99_ttft_ms"],
                    "ok": s["failed"] == 0, "open": False})
    sent = {smp["request_rate"]: smp["requests"] for smp in rec["samples"] if "request_rate" in smp}
    for lvl in rec.get("rate_sweep") or []:
        s, reqs = lvl["summary"], sent.get(lvl["request_rate"], [])
        if not reqs:
            continue
        # the arrivals this level really offered (a seeded Poisson draw of n requests) and how fast they were served:
        # a server that keeps up ends its last request about one request's time after the last arrival
        offered = len(reqs) / max(r["start_s"] for r in reqs)
        served = s["completed"] / max(r["end_s"] for r in reqs)
        pts.append({"load": f"{lvl['request_rate']:g}/s", "rate": offered, "tpot": s["p99_tpot_ms"],
                    "ttft": s["p99_ttft_ms"], "ok": s["failed"] == 0 and served >= SERVED_FRACTION * offered,
                    "open": True})
    return [p for p in pts if p["rate"] is not None and p["tpot"] is not None]


def capacity(points: list[dict], slo_tpot: float, slo_ttft: float | None) -> tuple[float, str]:
    """Highest rate meeting the targets (see the module's doc), and how it was found. Open-loop (Poisson) levels decide
    when the record has them: a request rate is an open-loop load, and closed-loop levels at the same throughput
    queue less (no bursts); closed-loop levels are used only for records without open-loop levels."""
    def meets(p):
        return p["ok"] and p["tpot"] <= slo_tpot and (slo_ttft is None or p["ttft"] <= slo_ttft)

    kind = [p for p in points if p["open"]] or points
    loop = "open-loop" if kind[0]["open"] else "closed-loop"
    best, how = 0.0, f"no measured {loop} level meets the target"
    for p in kind:
        if meets(p) and p["rate"] > best:
            best, how = p["rate"], f"measured at {p['load']} ({loop})"
    ordered = sorted(kind, key=lambda p: p["rate"])
    for lo, hi in zip(ordered, ordered[1:], strict=False):
        if meets(lo) and hi["tpot"] > slo_tpot and hi["rate"] > lo["rate"] and hi["tpot"] > lo["tpot"]:
            rate = lo["rate"] + (hi["rate"] - lo["rate"]) * (slo_tpot - lo["tpot"]) / (hi["tpot"] - lo["tpot"])
            if rate > best and (slo_ttft is None or max(lo["ttft"], hi["ttft"]) <= slo_ttft):
                best, how = rate, f"interpolated between {lo['load']} and {hi['load']} ({loop})"
    return best, how


def plan_rows(variant: str, prompts: str, slo_tpot: float, slo_ttft: float | None, qps: float,
              on: str | None = None) -> tuple[list[dict], str]:
    newest: dict[tuple, tuple[Path, dict, str]] = {}
    for member in family(variant):
        for path, rec in all_records("latency", paths.EXPERIMENTS):
            if path.parent.name != member or rec.get("status") != "ok" or rec["inputs"]["prompt_set"] != prompts:
                continue
            if MODE not in rec["summary"]:
                continue
            topo = topology_of(rec)
            key = (machine(rec), member, topo.get("tensor_parallel", 1), topo.get("data_parallel", 1),
                   topo.get("replicas", 1), topo.get("router"), topo.get("policy"), topo.get("shared_gpu", False))
            # all_records lists oldest first; a record with fewer levels than an older one of its topology (a later
            # round of a scale ladder: only the levels paired for a ratio) does not replace it
            if key not in newest or len(load_points(rec)) >= len(load_points(newest[key][1])):
                newest[key] = (path, rec, member)
    machines = sorted({k[0] for k in newest})
    if not machines:
        raise PlanError(f"no latency record of {variant} (or its TP/DP children) on prompt set {prompts} with "
                        f"status ok; measure one: make eval-latency VARIANT={variant} BENCH_ARGS='--prompts eval/prompts/{prompts}'")
    if on is None:  # the machine of the newest record (file names sort by time)
        on = max(newest.items(), key=lambda kv: kv[1][0].name)[0][0]
    elif on not in machines:
        raise PlanError(f"--machine {on!r}: records exist for {', '.join(machines)}")
    rows = []
    for key, (path, rec, member) in sorted(newest.items()):
        if key[0] != on:
            continue
        n_units, unit = units(rec)
        cap, how = capacity(load_points(rec), slo_tpot, slo_ttft)
        inst = math.ceil(qps / cap) if cap > 0 else None
        rows.append({"topology": label(member, topology_of(rec)), "record": paths.shown(path), "units": n_units,
                     "unit": unit, "capacity": cap, "how": how, "instances": inst,
                     "needed": inst * n_units if inst else None, "points": load_points(rec)})
    return rows, on


def hosts_needed(instances: int, units: int, host_gpus: int) -> tuple[int, int] | None:
    """(instances one host holds, hosts needed) for `instances` of `units` GPUs each on hosts of `host_gpus` GPUs,
    replicas per host behind one router: per_host = floor(host_gpus / units), hosts = ceil(instances / per_host);
    None when one instance does not fit a host."""
    per_host = host_gpus // units
    return (per_host, math.ceil(instances / per_host)) if per_host else None


def projection_lines(rows: list[dict], hosts: list[int]) -> list[str]:
    """The plan extended on paper to hosts of each size: a projection, its formula first."""
    if not hosts or rows[0]["unit"] != "GPU":
        return []
    lines = ["", f"## Projection to hosts of {' or '.join(map(str, hosts))} GPUs (on paper, not measured)", "",
             "**A projection:** each instance keeps the capacity its record measured on this machine, wherever it "
             "runs; instances of one topology fill each host (per host = floor(GPUs per host / GPUs per instance)) "
             "and every host's replicas sit behind one router, whose own cost and any loss of prefix locality across "
             "hosts are not modelled; hosts = ceil(instances / per host), GPUs bought = hosts x GPUs per host.", "",
             "| topology | GPUs per instance | instances | " + " | ".join(
                 f"hosts of {h} (per host) | GPUs bought" for h in hosts) + " |",
             "| --- | --- | --- | " + " | ".join("--- | ---" for _ in hosts) + " |"]
    for r in rows:
        if not r["instances"]:
            continue
        cells = []
        for h in hosts:
            got = hosts_needed(r["instances"], r["units"], h)
            cells.append(f"{got[1]} ({got[0]}) | {got[1] * h}" if got else "does not fit | —")
        lines.append(f"| {r['topology']} | {r['units']} | {r['instances']} | {' | '.join(cells)} |")
    return lines


def render(variant: str, rows: list[dict], on: str, args, out_png: Path) -> str:
    unit = rows[0]["unit"]
    ttft = f", p99 TTFT ≤ {args.slo_ttft_ms:g} ms" if args.slo_ttft_ms else ""
    best = min((r for r in rows if r["needed"]), key=lambda r: (r["needed"], -r["capacity"]), default=None)
    lines = [f"# Capacity plan: {variant} at {args.qps:g} requests/s, p99 TPOT ≤ {args.slo_tpot_ms:g} ms{ttft}", "",
             f"Machine: {on}. Prompt set: {args.prompts} (mode {MODE}). Generated {now_utc():%Y-%m-%d %H:%M} UTC by "
             f"`python -m scripts.report.plan {' '.join(sys.argv[1:])}`.", "",
             "**A model fitted to the records below, not a measurement of the plan:** an instance's capacity is the "
             "highest request rate it served at a measured level whose p99 TPOT and TTFT met the target, open-loop "
             "(Poisson) levels first (linear interpolation in p99 TPOT between the last level that met it and the "
             "first that did not); "
             f"instances = ceil(QPS / capacity); {unit}s = instances x {unit}s per instance; instances assumed "
             "independent.", "",
             f"| topology | {unit}s per instance | capacity at the target (req/s) | how | instances | {unit}s at "
             f"{args.qps:g} req/s | record |", "| --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['topology']} | {r['units']} | {r['capacity']:.2f} | {r['how']} | {r['instances'] or '—'} | "
                     f"{r['needed'] or 'not reachable'} | `{r['record']}` |")
    lines += ["", "Levels each capacity was read from (load: served req/s, p99 TPOT ms, p99 TTFT ms):", ""]
    for r in rows:
        pts = "; ".join(f"{p['load']}: {p['rate']:.2f}, {p['tpot']:.1f}, {p['ttft']:.0f}{'' if p['ok'] else ' (failed or under-served)'}"
                        for p in r["points"])
        lines.append(f"- {r['topology']}: {pts}")
    lines += ["", (f"Plan: **{best['topology']}**, {best['instances']} instance(s), {best['needed']} {unit}(s)."
                   if best else "Plan: no topology meets the target at any measured level.")]
    lines += projection_lines(rows, args.hosts)
    lines += ["", f"![{unit}s needed against request rate]({out_png.name})", ""]
    return "\n".join(lines)


def plot(rows: list[dict], args, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    top = max(2 * args.qps, 1.0)
    xs = [top * i / 200 for i in range(1, 201)]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for r in rows:
        if r["capacity"] > 0:
            ax.step(xs, [math.ceil(x / r["capacity"]) * r["units"] for x in xs], where="post", label=r["topology"])
    ax.axvline(args.qps, color="gray", linestyle=":", label=f"{args.qps:g} req/s asked")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(f"{rows[0]['unit']}s needed")
    ttft = f", p99 TTFT ≤ {args.slo_ttft_ms:g} ms" if args.slo_ttft_ms else ""
    ax.set_title(f"{args.variant}: p99 TPOT ≤ {args.slo_tpot_ms:g} ms{ttft} (model fitted to records)", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    tmp = out.with_name(f".{out.stem}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--slo-tpot-ms", type=float, required=True, help="p99 time per output token target")
    p.add_argument("--slo-ttft-ms", type=float, help="p99 time to first token target (none: not constrained)")
    p.add_argument("--qps", type=float, required=True, help="request rate to plan for (requests/s)")
    p.add_argument("--prompts", default="shared-prefix-v1.jsonl", help="prompt set of the records (default %(default)s)")
    p.add_argument("--machine", help="plan for this machine (default: the newest record's)")
    p.add_argument("--hosts", default="2,8", help="GPUs per host of the on-paper projection (comma-separated; "
                   "empty: none; default %(default)s)")
    p.add_argument("--out-dir", type=Path, default=paths.ROOT / "results")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.slo_tpot_ms <= 0 or args.qps <= 0 or (args.slo_ttft_ms is not None and args.slo_ttft_ms <= 0):
            raise PlanError("--slo-tpot-ms, --slo-ttft-ms and --qps must be > 0")
        try:
            args.hosts = [int(h) for h in args.hosts.split(",") if h.strip()]
        except ValueError:
            raise PlanError(f"--hosts {args.hosts!r}: comma-separated GPU counts, e.g. 2,8") from None
        if any(h < 1 for h in args.hosts):
            raise PlanError(f"--hosts {args.hosts}: every host has at least one GPU")
        rows, on = plan_rows(args.variant, args.prompts, args.slo_tpot_ms, args.slo_ttft_ms, args.qps, args.machine)
    except (PlanError, VariantError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    stem = f"plan_{args.variant}_{now_utc():%Y%m%d}"
    args.out_dir.mkdir(parents=True, exist_ok=True)
    png, md = args.out_dir / f"{stem}.png", args.out_dir / f"{stem}.md"
    plot(rows, args, png)
    text = render(args.variant, rows, on, args, png)
    tmp = md.with_name(f".{md.name}.tmp")
    tmp.write_text(text)
    tmp.replace(md)
    print(text)
    print(f"wrote {paths.shown(md)} and {paths.shown(png)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
