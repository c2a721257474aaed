"""The variant catalog: every variant with its lever, parent, status and newest speed over BF16.

    python -m scripts.report.catalog            # `make list`: one aligned table, sorted by base then name
    python -m scripts.report.catalog --json     # the same rows for machines

Generated from each variant's config.env and its records, each record read once; nothing in it is typed by hand.

Lever: variants.lever_of, the one rule `make compare`'s winners table uses too (the last lever applied, for a stack:
CALIBRATE_* -> quantize, PRUNE_KEEP -> vocab, a speculative config -> speculate, GGUF_TYPE -> gguf, LORA_* -> lora,
ENGINE other than vLLM -> engine, only SERVE_* / ENV_* -> serving, no PARENT -> base).

Status, the first rule that applies:
  superseded by <variant>   SUPERSEDED_BY in config.env: a dead end kept as research history (the `#` line above the
                            key says why); `make compare` leaves it out of its tables.
  needs a GPU (<why>)       what it serves exists or runs only on a GPU machine, so a CPU clone can neither build nor
                            measure it: SHAPE_PROXY=1 (random weights with the shapes of a model vLLM's CPU build does
                            not serve; speed only); ENGINE=sglang (only the GPU machine carries SGLang); a draft head
                            under weights/ that no HEAD_SOURCE provides, distilled on a pinned at-scale prompt set
                            (REDISTILL_PROMPT_SHA256: its answers are generated and the head trained on a GPU lease,
                            results/spec-scale-*); or, from the records, every latency and quality record it has was
                            made on a GPU.
  reference                 no PARENT / GATE_REFERENCE: the baseline its children are judged against.
  certified on <hardware>   every GATE_* criterion passes (`make gate`: one-sided 95% bounds), and so does its
                            reference's gate, up to BF16 (compare.chain); <hardware>: the machine(s) of the records
                            judged.
  fails <criteria>          otherwise the gate's own verdict and its precedence: a criterion's bound is beyond its
  unmeasured <criteria>     limit; else a criterion has no record to judge it; else a criterion is inconclusive
  inconclusive <criteria>   (never a pass). A verdict its reference decides says so in parentheses.
  ungated                   it sets no GATE_* tolerance: nothing to certify (a LoRA adapter, a build step).
  error (<why>)             the gate refuses to pair its records (GateError).

× BF16 c=1 / c=8: output tok/s of the variant's newest comparable latency record (fixed length, status ok, not behind
a router) over that of its BF16 reference on the same hardware and prompt set, exactly as `make compare` computes it
(compare.comparable_groups: a failed newest record on a machine leaves the variant uncompared there; the reference's
record of the variant's own ladder where it was measured there, else the ladder's BF16 server of another engine
nearest it, else the reference's newest record);
"measured on" names that hardware. "—" where there is no such pair (never measured, or no BF16 root measured there).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.common.gate import NO_GATE
from scripts.common.hardware import hardware_key
from scripts.common.records import all_records
from scripts.common.variants import (
    Variant,
    VariantError,
    head_dir,
    lever_of,
    list_variants,
    load_variant,
    shorten,
)
from scripts.report.compare import (
    LEVELS,
    Judged,
    by_variant,
    chain,
    comparable_groups,
    group_key,
    judge,
    ladder_baseline,
    ladder_records,
    newest_configs,
    reference_record,
    speedups,
)

GPU_ENGINES = ("sglang",)
# status kind -> how the summary line counts it, in the order of the rules (module docstring)
STATUS_KINDS = {"superseded": "superseded", "needs-gpu": "needs a GPU", "reference": "reference",
                "certified": "certified", "fail": "fails", "missing": "unmeasured", "inconclusive": "inconclusive",
                "ungated": "ungated", "error": "error"}
VERDICT_WORDS = {"fail": "fails", "missing": "unmeasured", "inconclusive": "inconclusive"}
FLAG_LABELS = (("amx_bf16", "AMX"), ("avx512_bf16", "AVX512-BF16"), ("avx512f", "AVX512"), ("avx2", "AVX2"))


@dataclass
class Entry:
    variant: str
    base: str
    lever: str
    parent: str | None
    kind: str  # one of STATUS_KINDS
    status: str  # the words shown
    superseded_by: str | None = None
    certified_on: list[str] = field(default_factory=list)  # hardware keys of the records a certified gate judged
    vs_bf16: dict[str, float | None] = field(default_factory=dict)  # concurrency -> ratio
    measured_on: str | None = None  # hardware key of the ratio's records
    measured_on_label: str = "—"  # its short name (short_hardware)


def gpu_only(variant: Variant, records: list[dict]) -> str | None:
    """Why the variant needs a GPU machine (module docstring), or None."""
    s = variant.settings
    if s.get("SHAPE_PROXY") == "1":
        return "shape proxy"
    if s.get("ENGINE") in GPU_ENGINES:
        return f"ENGINE={s['ENGINE']}"
    if head_dir(variant) is not None and "HEAD_SOURCE" not in s and "REDISTILL_PROMPT_SHA256" in s:
        return "head distilled on a GPU lease, not in git"
    if records and all(r["hardware"].get("gpu") for r in records):
        return "records only from GPUs"
    return None


def gate_status(j: Judged, labels: dict[str, str]) -> tuple[str, str, list[str]]:
    """(kind, words, certified-on hardware keys) of a gate verdict; labels: hardware key -> its short name."""
    if j.verdict == "reference":
        return "reference", "reference", []
    if j.verdict == "pass":
        hw = sorted({c.hardware for c in j.criteria if c.hardware})
        return "certified", "certified on " + " + ".join(labels.get(h, h) for h in hw), hw
    if j.verdict not in VERDICT_WORDS:
        return "error", f"error ({shorten(j.note, 120)})", []
    if [c.name for c in j.criteria] == [NO_GATE]:
        return "ungated", "ungated (no GATE_* tolerance)", []
    word = VERDICT_WORDS[j.verdict]
    if j.note:  # its reference decides (compare.chain)
        return j.verdict, f"{word} ({j.note})", []
    return j.verdict, f"{word} {', '.join(c.name for c in j.criteria if c.status == j.verdict)}", []


def short_hardware(hw: dict) -> str:
    """`H100 80GB HBM3`, `AMD EPYC 2c AVX512-BF16`: a table's name for a record's hardware."""
    if gpu := hw.get("gpu"):
        count = gpu.get("count", 1)
        return gpu["name"].removeprefix("NVIDIA ") + (f" x{count}" if count != 1 else "")
    flags = set(hw.get("cpu_flags") or [])
    best = next((label for flag, label in FLAG_LABELS if flag in flags), None)
    cpu = " ".join(re.sub(r"\((R|TM)\)|\bProcessor\b|\bCPU\b", " ", hw["cpu"]).split())
    return f"{cpu} {hw['cores']}c" + (f" {best}" if best else "")


def speed(latency: list[tuple[Path, dict]]) -> dict[str, tuple[str, dict[str, float | None]]]:
    """{variant: (hardware key, {c: × BF16})} from each variant's newest comparable record (module docstring)."""
    groups, _ = comparable_groups(latency)
    newest: dict[str, tuple[tuple[str, str], dict]] = {}
    for _, r in latency:  # oldest first per variant: the last one that is its group's newest comparable wins
        g = group_key(r)
        if groups.get(g, {}).get(r["variant"]) is r:
            newest[r["variant"]] = (g, r)
    in_ladder, configs = ladder_records(latency), newest_configs(latency)
    out = {}
    for v, (g, r) in newest.items():
        ladder = r["inputs"].get("ladder_id")
        base = ladder_baseline(v, g, ladder, groups[g], in_ladder, configs)
        ratios = speedups(r, reference_record(base, g, ladder, groups[g], in_ladder)) if base else {}
        out[v] = (g[0], {c: ratios.get(c) for c in LEVELS})
    return out


def build_catalog(root: Path | None = None) -> list[Entry]:
    """Every variant under root with its lever, status and newest ratio to BF16 (module docstring)."""
    root = root or paths.EXPERIMENTS
    names = list_variants(root)
    variants = {v: load_variant(v, root=root, target="cpu") for v in names}  # the variant check, each
    settings = {v: variants[v].settings for v in names}
    latency, quality = all_records("latency", root), all_records("quality", root)
    labels = {hardware_key(r["hardware"]): short_hardware(r["hardware"]) for _, r in latency + quality}
    measured = by_variant(latency + quality)
    per_variant = by_variant(quality)
    judged = chain({v: judge(v, settings[v], root, per_variant) for v in names}, settings)
    speeds = speed(latency)
    entries = []
    for v in names:
        s = settings[v]
        if by := s.get("SUPERSEDED_BY"):
            kind, words, certified = "superseded", f"superseded by {by}", []
        elif why := gpu_only(variants[v], measured.get(v, [])):
            kind, words, certified = "needs-gpu", f"needs a GPU ({why})", []
        else:
            kind, words, certified = gate_status(judged[v], labels)
        hw, ratios = speeds.get(v, (None, dict.fromkeys(LEVELS)))
        entries.append(Entry(v, s["BASE"], lever_of(s), s.get("PARENT"), kind, words, by, certified, ratios, hw,
                             labels[hw] if hw else "—"))
    return sorted(entries, key=lambda e: (e.base, e.variant))


def table(entries: list[Entry]) -> str:
    """An aligned text table (status last: it is the long column), then the count of each status."""
    header = ["variant", "lever", "parent", *(f"× BF16 c={c}" for c in LEVELS), "measured on", "status"]
    rows = [[e.variant, e.lever, e.parent or "—",
             *("—" if e.vs_bf16.get(c) is None else f"{e.vs_bf16[c]:.2f}" for c in LEVELS),
             e.measured_on_label, e.status] for e in entries]
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header) - 1)]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths, strict=False)) + "  " + r[-1]
             for r in [header, *rows]]
    counts = Counter(e.kind for e in entries)
    lines += ["", f"{len(entries)} variants: " + ", ".join(f"{w} {counts[k]}" for k, w in STATUS_KINDS.items() if counts[k])]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", type=Path, default=paths.EXPERIMENTS)
    p.add_argument("--json", action="store_true", help="one JSON list of the rows instead of the table")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        entries = build_catalog(args.experiments)
    except VariantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([asdict(e) for e in entries], indent=1))
    else:
        print(table(entries))
    return 0


if __name__ == "__main__":
    sys.exit(main())
