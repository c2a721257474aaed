"""A recipe sweep: build several quantized checkpoints of one parent and score each one's parity with it.

    python -m scripts.levers.quantize.sweep eval/sweeps/smollm2-w4.yaml          # `make sweep SWEEP=eval/sweeps/smollm2-w4.yaml`
    python -m scripts.levers.quantize.sweep eval/sweeps/smollm2-w4.yaml --only awq-mlp-g32-64x256

The sweep file names a variant (its PARENT is the source, its reference and GATE_* judge every attempt) and a list
of attempts: a recipe plus calibration size and `--set` overrides. Each attempt is built by
scripts.levers.quantize.calibrate in .venv-quant into weights/sweep/<sweep>/<attempt> (kept: a rerun skips the build),
then scored by scripts.measure.parity --model, whose record (with the checkpoint's PROVENANCE.json) lands in the sweep's
results folder. An attempt that fails to build or score is reported and the sweep goes on. The summary table
(summary_<YYYYMMDD-HHMMSS>.md) ranks every attempt with a record by mean KLD.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.common.gate import parity_criteria
from scripts.common.records import now_utc
from scripts.common.variants import VariantError, load_variant

QUANT_PYTHON = paths.ROOT / ".venv-quant" / "bin" / "python"
ATTEMPT_KEYS = {"name", "recipe", "samples", "seq_len", "set", "note"}


class SweepError(ValueError):
    pass


def load_sweep(path: Path) -> dict:
    import yaml

    if not path.exists():
        raise SweepError(f"{path}: no such sweep file")
    spec = yaml.safe_load(path.read_text()) or {}
    for key in ("name", "variant", "attempts"):
        if key not in spec:
            raise SweepError(f"{path}: missing {key!r}")
    names = set()
    for i, a in enumerate(spec["attempts"]):
        unknown = set(a) - ATTEMPT_KEYS
        if unknown or "name" not in a or "recipe" not in a:
            raise SweepError(f"{path}: attempt {i}: needs name and recipe; allowed keys {sorted(ATTEMPT_KEYS)}"
                             + (f", unknown {sorted(unknown)}" if unknown else ""))
        if a["name"] in names:
            raise SweepError(f"{path}: attempt name {a['name']!r} repeats")
        names.add(a["name"])
    return spec


def build_command(attempt: dict, source: str, out: Path) -> list[str]:
    cmd = [str(QUANT_PYTHON), "-m", "scripts.levers.quantize.calibrate", attempt["recipe"], "--model", source,
           "--out", paths.shown(out)]
    if attempt.get("samples"):
        cmd += ["--samples", str(attempt["samples"])]
    if attempt.get("seq_len"):
        cmd += ["--seq-len", str(attempt["seq_len"])]
    for item in attempt.get("set", []):
        cmd += ["--set", item]
    return cmd


def run_logged(cmd: list[str], log: Path) -> int:
    print("  $ " + " ".join(cmd), flush=True)
    with log.open("a") as f:
        f.write("$ " + " ".join(cmd) + "\n")
        f.flush()
        return subprocess.run(cmd, cwd=paths.ROOT, stdout=f, stderr=subprocess.STDOUT, check=False).returncode


def attempt_dir(spec: dict, attempt: dict) -> Path:
    return paths.WEIGHTS / "sweep" / spec["name"] / attempt["name"]


def scored_models(results: Path) -> dict[str, dict]:
    """Newest parity record per scored checkpoint (config MODEL) in the sweep's results folder."""
    out: dict[str, dict] = {}
    for f in sorted(results.glob("quality_*.json")):
        rec = json.loads(f.read_text())
        if rec.get("status") == "ok" and rec["summary"].get("parity"):
            out[rec["config"]["MODEL"]] = rec
    return out


def summary_table(spec: dict, source: str, reference: str, results: Path, settings: dict[str, str]) -> str:
    recs = scored_models(results)
    rows = []
    for a in spec["attempts"]:
        rec = recs.get(paths.shown(attempt_dir(spec, a)))
        if rec:
            rows.append((a, rec))
    rows.sort(key=lambda r: r[1]["summary"]["parity"]["mean_kld"])
    gates = {k: v for k, v in settings.items() if k.startswith("GATE_") and k != "GATE_MAX_TASK_DROP"}
    lines = [f"# Sweep {spec['name']}: parity of each attempt with {reference}", "",
             f"Variant {spec['variant']} (gate: {', '.join(f'{k}={v}' for k, v in gates.items())}); transformers path, "
             f"full distributions. Built and scored by `python -m scripts.levers.quantize.sweep {source}`; one record per "
             "attempt in this folder.", "",
             "| attempt | recipe | overrides | calibration | groups | weight MiB | mean KLD ± se | top-1 | PPL ratio | "
             "build s | gate |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for a, rec in rows:
        p = rec["summary"]["parity"]
        prov = rec["inputs"].get("model_provenance", {})
        cal = prov.get("calibration")
        calibration = f"{cal['samples']}×{cal['seq_len']}" if cal else "none (RTN)"
        groups = "/".join(map(str, prov.get("group_sizes", []))) or "—"
        fails = [f"{c.name.removeprefix('GATE_').lower()} ({c.status})" for c in parity_criteria(gates, rec)
                 if c.status != "pass"]
        try:
            mib = f"{read_checkpoint(paths.resolve_model(rec['config']['MODEL'])).total_bytes / 2**20:.0f}"
        except CheckpointError:  # weights/ is not in git: a fresh clone rewrites the table without sizes
            mib = "—"
        lines.append(f"| {a['name']} | {prov.get('recipe', a['recipe'])} | {' '.join(prov.get('overrides', [])) or '—'} "
                     f"| {calibration} | {groups} | {mib} | {p['mean_kld']:.4f} ± {p['mean_kld_se']:.4f} "
                     f"| {p['top1_agreement']:.2%} | {p['ppl_ratio']:.3f} | {prov.get('seconds', '—')} "
                     f"| {'fail: ' + ', '.join(fails) if fails else 'pass'} |")
    missing = [a["name"] for a in spec["attempts"] if a not in [r[0] for r in rows]]
    if missing:
        lines += ["", f"No parity record (failed or not run): {', '.join(missing)}."]
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path, help="sweep file (YAML)")
    p.add_argument("--only", help="comma-separated attempt names")
    p.add_argument("--summary-only", action="store_true", help="rewrite the summary from existing records")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        spec = load_sweep(args.sweep)
        variant = load_variant(spec["variant"])
        if "PARENT" not in variant.resolved:
            raise SweepError(f"{variant.name} has no PARENT to quantize")
        parent = load_variant(variant.resolved["PARENT"])
        reference = variant.resolved.get("GATE_REFERENCE", parent.name)
        only = set(args.only.split(",")) if args.only else None
        if only and (unknown := only - {a["name"] for a in spec["attempts"]}):
            raise SweepError(f"--only: unknown attempt(s) {', '.join(sorted(unknown))}")
        if not args.summary_only and not QUANT_PYTHON.exists():
            raise SweepError(f"{paths.shown(QUANT_PYTHON)} missing: run `make install-quant`")
    except (SweepError, VariantError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    results = paths.RESULTS / f"sweep-{spec['name']}"
    results.mkdir(parents=True, exist_ok=True)
    log = paths.CACHE / f"sweep-{spec['name']}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    failed = []
    scored = scored_models(results)
    for a in spec["attempts"]:
        if args.summary_only or (only and a["name"] not in only):
            continue
        out = attempt_dir(spec, a)
        t0 = time.monotonic()
        print(f"== {a['name']} ({a['recipe']} {' '.join(a.get('set', []))})", flush=True)
        if not out.exists():
            out.parent.mkdir(parents=True, exist_ok=True)
            if run_logged(build_command(a, parent.resolved["MODEL"], out), log) != 0:
                print(f"  build failed: see {paths.shown(log)}", flush=True)
                failed.append(a["name"])
                continue
        if paths.shown(out) in scored:
            print("  already scored", flush=True)
            continue
        cmd = [sys.executable, "-m", "scripts.measure.parity", variant.name, "--model", paths.shown(out),
               "--out-dir", paths.shown(results)]
        if run_logged(cmd, log) != 0:
            print(f"  parity failed: see {paths.shown(log)}", flush=True)
            failed.append(a["name"])
            continue
        scored = scored_models(results)  # with the record just written
        p = scored[paths.shown(out)]["summary"]["parity"]
        print(f"  KLD {p['mean_kld']:.4f}  top-1 {p['top1_agreement']:.1%}  PPL ratio {p['ppl_ratio']:.3f}  "
              f"({time.monotonic() - t0:.0f} s)", flush=True)
    summary = results / f"summary_{now_utc():%Y%m%d-%H%M%S}.md"
    tmp = summary.with_name(f".{summary.name}.tmp")
    tmp.write_text(summary_table(spec, paths.shown(args.sweep.resolve()), reference, results, variant.resolved))
    tmp.replace(summary)
    print(f"wrote {paths.shown(summary)}" + (f"; failed: {', '.join(failed)}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
