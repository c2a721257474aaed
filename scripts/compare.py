"""Compare variants from their newest latency records: speedup vs parent and vs the base model's BF16 variant.

    python -m scripts.compare                      # writes results/compare_<YYYYMMDD>.md and .png

The newest record of each variant on each hardware and prompt set is used (a variant measured on a CPU and on a GPU
appears in both tables). Only records with status ok are compared; a failed newest record is listed as not
comparable. A ratio is marked back-to-back only when both records come from one ladder run
(`make eval-latency-ladder`, same inputs.ladder_id); anything else is labelled as measured in separate runs.
The quality column is the parity gate's verdict (scripts/common/gate.py): a variant that fails it or lacks the
records to judge it is marked and never ranked as a winner.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.gate import gate_for, verdict
from scripts.common.metrics import ratio
from scripts.common.records import all_records, hardware_key, now_utc

MODE = "fixed"  # speed is compared at fixed output length (ignore_eos)


def group_key(rec: dict) -> tuple[str, str]:
    return hardware_key(rec["hardware"]), rec["inputs"]["prompt_set_sha256"][:12]


def baseline_of(variant: str, members: dict[str, dict]) -> str | None:
    """The BF16 root of the variant's PARENT chain within this comparable group (its reference variant)."""
    seen, current = {variant}, members[variant]["config"].get("PARENT")
    root = None
    while current and current in members and current not in seen:
        seen.add(current)
        root = current
        current = members[current]["config"].get("PARENT")
    return root


def speedups(rec: dict, ref: dict | None) -> dict[str, float | None]:
    if ref is None:
        return {}
    out = {}
    for c, level in rec["summary"].get(MODE, {}).items():
        ref_level = ref["summary"].get(MODE, {}).get(c)
        out[c] = ratio(level["output_throughput"], ref_level["output_throughput"]) if ref_level else None
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "—" if x is None else format(x, spec)


def quality_status(variant: str, config: dict[str, str], root: Path | None = None) -> str:
    """reference | pass | fail (…) | missing (…): the parity gate's verdict, for the quality column."""
    reference, criteria = gate_for(variant, config, root)
    if reference is None:
        return "reference"
    if config.get("SHAPE_PROXY") == "1":
        return "n/a: shape proxy, speed only"
    v = verdict(criteria)
    bad = [c.name for c in criteria if c.status != "pass"]
    return v if v == "pass" else f"{v}: {', '.join(bad)}"


def build_report(records: list[tuple[Path, dict]], quality: dict[str, str]) -> tuple[str, list[dict]]:
    newest: dict[tuple[str, str], dict[str, dict]] = {}  # group -> variant -> newest record there
    for _, r in records:  # oldest first per variant: later ones replace earlier ones
        newest.setdefault(group_key(r), {})[r["variant"]] = r
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    excluded = []
    for g, members in newest.items():
        for v, r in members.items():
            if r["status"] == "ok" and MODE in r["summary"]:
                groups.setdefault(g, {})[v] = r
            else:
                excluded.append((f"{v} ({g[0]})", r.get("failure") or f"no {MODE}-mode results"))
    lines = [f"# Variant comparison ({now_utc():%Y-%m-%d})", "",
             f"Newest latency record per variant; mode `{MODE}` (every request generates exactly its max_tokens).",
             "Speedup = output tokens/s of the variant ÷ that of the reference, per concurrency.", ""]
    rows = []
    for (hw, prompts), members in sorted(groups.items()):
        levels = sorted({int(c) for r in members.values() for c in r["summary"][MODE]})
        winners: list[tuple[float, str]] = []
        lines += [f"## {hw} — prompt set {prompts}", "",
                  "| variant | parent | weights MiB | KV tokens | " + " | ".join(f"tok/s c={c}" for c in levels)
                  + " | " + " | ".join(f"× parent c={c}" for c in levels) + " | × BF16 c=1 | back-to-back | quality |",
                  "|" + " --- |" * (4 + 2 * len(levels) + 3)]
        for v, r in sorted(members.items()):
            parent = r["config"].get("PARENT")
            pref = members.get(parent) if parent else None
            base = baseline_of(v, members)
            vs_parent, vs_base = speedups(r, pref), speedups(r, members.get(base) if base else None)
            ladder = r["inputs"].get("ladder_id")
            refs = [x for x in (pref, members.get(base) if base else None) if x]
            b2b = "yes" if refs and ladder and all(x["inputs"].get("ladder_id") == ladder for x in refs) else (
                "—" if not refs else "no (separate runs)")
            q = quality.get(v, "missing")
            q = q if q in ("pass", "reference") else f"{q} (not rankable)"
            tput = [r["summary"][MODE].get(str(c), {}).get("output_throughput") for c in levels]
            wb = (r.get("model") or {}).get("weight_bytes")
            kv = r.get("server_metrics", {}).get("kv_cache_tokens")
            lines.append(f"| {v}{' (shape proxy)' if r.get('shape_proxy') else ''} | {parent or '—'} | "
                         f"{fmt(wb / 2**20 if wb else None, '.0f')} | {kv or '—'} | "
                         + " | ".join(fmt(t, '.1f') for t in tput) + " | "
                         + " | ".join(fmt(vs_parent.get(str(c))) for c in levels)
                         + f" | {fmt(vs_base.get('1'))} | {b2b} | {q} |")
            rows.append({"group": (hw, prompts), "variant": v, "levels": levels, "throughput": tput})
            if q == "pass" and vs_base.get("1") is not None:
                winners.append((vs_base["1"], v))
        best = max(winners, default=None)
        lines += ["", f"Fastest at parity (c=1, vs BF16): **{best[1]}** ({best[0]:.2f}×)" if best else
                  "Fastest at parity: none yet (no variant passes its gate with a BF16 reference in this group)", ""]
    if excluded:
        lines += ["## Not comparable", ""] + [f"- {v}: {why}" for v, why in excluded] + [""]
    return "\n".join(lines), rows


def plot(rows: list[dict], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = sorted({r["group"] for r in rows})
    fig, axes = plt.subplots(len(groups), 1, figsize=(8, 3.5 * len(groups)), squeeze=False)
    for ax, g in zip(axes[:, 0], groups, strict=True):
        for r in (r for r in rows if r["group"] == g):
            ax.plot(r["levels"], [t or 0 for t in r["throughput"]], marker="o", label=r["variant"])
        ax.set(title=f"{g[0]} — prompt set {g[1]}", xlabel="concurrency", ylabel=f"output tok/s ({MODE})")
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", type=Path, default=paths.EXPERIMENTS)
    p.add_argument("--out-dir", type=Path, default=paths.RESULTS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records = all_records("latency", args.experiments)
    if not records:
        print(f"error: no latency records under {args.experiments}; run `make eval-latency` first", file=sys.stderr)
        return 1
    quality = {r["variant"]: quality_status(r["variant"], r["config"], args.experiments) for _, r in records}
    text, rows = build_report(records, quality)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"compare_{now_utc():%Y%m%d}"
    stem.with_suffix(".md").write_text(text + "\n")
    if rows:
        plot(rows, stem.with_suffix(".png"))
    print(text)
    print(f"wrote {stem}.md" + (f" and {stem}.png" if rows else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
