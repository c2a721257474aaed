"""The parity gate: tolerances live in each variant's config.env (GATE_*), results in its newest quality records.

    GATE_REFERENCE=smollm2-bf16      # default: PARENT
    GATE_MAX_MEAN_KLD=0.05           # nats per token, from eval_parity
    GATE_MIN_TOP1=0.90               # top-1 agreement with the reference
    GATE_MAX_PPL_RATIO=1.05          # perplexity of variant / reference
    GATE_MAX_TASK_DROP=2.0           # points (0-100 scale) lost on any task's main metric vs the reference's record

A criterion without a record to judge it is `missing`, which fails the gate like a violated one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from scripts.common import paths

# Parity criteria: config key -> (summary field, "max" | "min")
PARITY_CRITERIA = {
    "GATE_MAX_MEAN_KLD": ("mean_kld", "max"),
    "GATE_MIN_TOP1": ("top1_agreement", "min"),
    "GATE_MAX_PPL_RATIO": ("ppl_ratio", "max"),
}
MAIN_METRICS = ("acc", "exact_match", "prompt_level_strict_acc", "acc_norm")


@dataclass
class Criterion:
    name: str
    limit: float
    value: float | None
    status: str  # pass | fail | missing
    detail: str = ""

    def line(self) -> str:
        value = "—" if self.value is None else f"{self.value:.4g}"
        return f"{self.status.upper():7s} {self.name} = {value} (limit {self.limit:g}){' — ' + self.detail if self.detail else ''}"


def main_metric(task_scores: dict) -> tuple[str, float] | None:
    for m in MAIN_METRICS:
        if isinstance(task_scores.get(m), (int, float)):
            return m, float(task_scores[m])
    return None


def evaluate_gate(settings: dict[str, str], parity: dict | None, var_tasks: dict | None,
                  ref_tasks: dict | None) -> list[Criterion]:
    """Pure: the gate's verdict per criterion from already-selected record summaries."""
    out = []
    for key, (field, kind) in PARITY_CRITERIA.items():
        if key not in settings:
            continue
        limit = float(settings[key])
        value = parity.get(field) if parity else None
        if value is None:
            out.append(Criterion(key, limit, None, "missing", "no parity record against the reference"))
            continue
        ok = value <= limit if kind == "max" else value >= limit
        out.append(Criterion(key, limit, value, "pass" if ok else "fail"))
    if "GATE_MAX_TASK_DROP" in settings:
        limit = float(settings["GATE_MAX_TASK_DROP"])
        if not var_tasks or not ref_tasks:
            out.append(Criterion("GATE_MAX_TASK_DROP", limit, None, "missing",
                                 "needs lm-eval records of the variant and the reference on the same tasks"))
        else:
            for task, scores in sorted(var_tasks.items()):
                mv, mr = main_metric(scores), main_metric(ref_tasks.get(task, {}))
                if mv is None or mr is None:
                    out.append(Criterion(f"GATE_MAX_TASK_DROP[{task}]", limit, None, "missing", "no comparable metric"))
                    continue
                drop = (mr[1] - mv[1]) * 100
                out.append(Criterion(f"GATE_MAX_TASK_DROP[{task}]", limit, drop, "pass" if drop <= limit else "fail",
                                     f"{mv[0]} {mv[1]:.3f} vs reference {mr[1]:.3f}"))
    return out


def quality_records(variant: str, root: Path | None = None) -> list[dict]:
    """All quality records of a variant, newest first."""
    d = (root or paths.EXPERIMENTS) / variant
    return [json.loads(p.read_text()) for p in sorted(d.glob("quality_*.json"), reverse=True)]


def newest(records: list[dict], **inputs) -> dict | None:
    for r in records:
        if r.get("status") == "ok" and all(r["inputs"].get(k) == v for k, v in inputs.items()):
            return r
    return None


def gate_for(variant: str, settings: dict[str, str], root: Path | None = None) -> tuple[str | None, list[Criterion]]:
    """(reference, criteria) from the newest records; reference None means the variant is itself a reference."""
    reference = settings.get("GATE_REFERENCE") or settings.get("PARENT")
    if not reference:
        return None, []
    mine = quality_records(variant, root)
    parity = newest(mine, kind="parity", reference=reference)
    tasks = newest(mine, kind="lm-eval")
    ref_tasks = None
    if tasks:
        ref_tasks = newest(quality_records(reference, root), kind="lm-eval", tasks=tasks["inputs"]["tasks"],
                           limit=tasks["inputs"]["limit"])
    criteria = evaluate_gate(settings, parity["summary"]["parity"] if parity else None,
                             tasks["summary"]["tasks"] if tasks else None,
                             ref_tasks["summary"]["tasks"] if ref_tasks else None)
    if not criteria:
        criteria = [Criterion("GATE_*", 0, None, "missing", f"{variant} sets no GATE_* tolerance")]
    return reference, criteria


def verdict(criteria: list[Criterion]) -> str:
    if any(c.status == "fail" for c in criteria):
        return "fail"
    return "missing" if any(c.status == "missing" for c in criteria) else "pass"
