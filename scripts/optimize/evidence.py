"""make optimize's quality evidence, cheapest first, and the certified winner per concurrency.

Parity for every lossy candidate and greedy identity for every lossless one (minutes each); then, per concurrency,
candidates in order of speed (the geometric mean of their per-round ratios to the BF16 reference): one whose ratio is
not above 1.00 ends the search; one whose ratio's 95% interval over the ladder's rounds holds 1.00 (a tie) or has a
single round is not faster and buys no more evidence; one whose gate fails is rejected; one whose gate lacks only the
suite gets it (the 10% sample, then every item under BUDGET=full where the sample does not decide), for itself and for
any variant up its chain whose pass it needs (a lossless speculation's lossy parent). The first certified one whose
interval's lower end is above 1.00 is that concurrency's winner, once its server passes the bounded soak and the body
fuzz where the budget asks for them (BUDGET=normal|full): one that fails is "unreliable", with the criteria it
missed, and the next candidate is tried. Where the reference is named the winner, its server gets the same soak and
fuzz, and a failure is said beside it. Verdicts are the
gate's (scripts/common/gate.py through scripts/report/compare.py: judge, then chain), the same as `make compare`'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scripts.common import paths
from scripts.common.gate import SUITE_KEY, RecordsOn, quality_source
from scripts.common.variants import load_variant, reference_name, serving_target
from scripts.data.bigbench_tasks import SUITE_DIR
from scripts.optimize.plan import BUDGETS, Candidate
from scripts.optimize.report import criterion_text
from scripts.optimize.speeds import Speeds, read_record
from scripts.report.compare import Judged, chain, judge


@dataclass
class Outcome:
    """What the run concluded about one candidate: certified | tie (at parity, not faster with 95% confidence) |
    rejected | unreliable (certified, faster, but its server failed the soak or the fuzz) | not certified |
    not pursued | failed | speed only (a shape proxy's: no quality evidence exists)."""
    status: str
    why: str
    judged: Judged | None = None
    winner_at: list[int] = field(default_factory=list)


def judge_plan(variants: list[str]) -> dict[str, Judged]:
    """The gate's verdict of each variant and of every variant up its chain, chained (a pass needs its reference's),
    on the quality records of this kind of machine only (a GPU run's, a CPU run's: `make compare` judges so too)."""
    configs: dict[str, dict[str, str]] = {}
    todo = list(variants)
    while todo:
        v = todo.pop()
        if v in configs:
            continue
        configs[v] = load_variant(v).resolved
        if ref := reference_name(configs[v]):
            todo.append(ref)
    quality = RecordsOn("gpu" if serving_target() == "cuda" else "cpu")
    return chain({v: judge(v, cfg, None, quality) for v, cfg in configs.items()}, configs)


def suite_only(j: Judged) -> bool:
    """Every criterion passes but the suite's, which is missing or inconclusive."""
    return any(c.name.startswith(SUITE_KEY) for c in j.blocking()) and all(
        c.name.startswith(SUITE_KEY) or c.status == "pass" for c in j.criteria) and not any(
        c.status == "fail" for c in j.criteria)


def needs_suite(variant: str, judged: dict[str, Judged]) -> list[str]:
    """The variants up the chain from `variant` (itself first) whose own verdict waits on the suite alone."""
    out, v = [], variant
    while v in judged and judged[v].verdict != "reference":
        if judged[v].criteria and suite_only(judged[v]):
            out.append(v)
        v = reference_name(load_variant(v).resolved)
    return out


def run_suite(r, variant: str, reference: str, kind: str) -> bool:
    """The suite records the gate pairs: the reference's on this machine, then the variant's quality source's."""
    target = "eval-quality" if kind == "sample" else "eval-quality-full"
    if not (SUITE_DIR / "manifest.json").is_file():
        e = r.step("suite", "datasets", reference)
        if e["status"] != "ok":
            r.note(variant, f"make datasets failed: {e.get('error')}")
            return False
    src = quality_source(variant, load_variant(variant).resolved)
    for v in (reference, src):
        e = r.step("suite", target, v, records="quality")
        if e["status"] != "ok":
            r.note(variant, f"{target} on {v} failed: {e.get('error')}")
            return False
    return True


def above(speeds: Speeds, variant: str, reference: str, level: int) -> bool:
    """The variant's point ratio to the reference is above 1.00 at this level."""
    return (speeds.point(variant, reference, level) or 0) > 1.0


def contenders(plan, measured: list[Candidate], speeds: Speeds) -> set[str]:
    """The candidates worth evidence: faster than the reference at some level (point estimate over the rounds), and
    every candidate up the chain of one (a lossless speculation needs its lossy parent certified, however fast the
    parent is)."""
    names = {c.variant for c in measured}
    out = {c.variant for c in measured if any(above(speeds, c.variant, plan.reference, lv) for lv in plan.concurrency)}
    for v in list(out):
        while (v := reference_name(load_variant(v).resolved)) in names:
            out.add(v)
    return out


def ratios_text(speeds: Speeds, variant: str, plan) -> str:
    """'c=1 1.03 [0.03, 66.18] × x-bf16 (tie); c=8 …' over the plan's levels where the variant was measured."""
    return "; ".join(f"c={lv} {sr.text()} × {plan.reference} ({sr.verdict})" for lv in plan.concurrency
                     if (sr := speeds.versus(variant, plan.reference, lv)))


def reliability(r, variant: str) -> str | None:
    """The bounded soak and the body fuzz on the variant's server (each once: a step reused by its inputs); None when
    both pass, else what failed ("soak: criteria not met: hangs=8, outside_kind=8"). The passing counts go to the
    variant's notes."""
    budget = BUDGETS[r.plan.budget]
    failed, passed = [], []
    for target, args in (("soak", budget.soak), ("fuzz", budget.fuzz)):
        e = r.step("reliability", target, variant, args, records=target)
        rec = read_record(e["record"]) if e.get("record") else None
        if rec is None:
            failed.append(f"{target} run failed: {e.get('error')}")
        elif rec.get("status") != "ok":
            failed.append(f"{target}: {rec.get('failure') or 'failed'}")
        else:
            got = rec["summary"]
            passed.append(f"{target} passed ({got.get('requests') or got.get('cases')} "
                          f"{'requests' if target == 'soak' else 'bodies'}, {paths.shown(paths.ROOT / e['record'])})")
    if not failed:
        r.note(variant, "reliability: " + "; ".join(passed))
    return "; ".join(failed) or None


NOT_FASTER = "not faster than the BF16 reference at any level measured"


def certify(r, measured: list[Candidate], speeds: Speeds) -> dict[str, Outcome]:
    plan, budget = r.plan, BUDGETS[r.plan.budget]
    out: dict[str, Outcome] = {}
    if load_variant(plan.reference).resolved.get("SHAPE_PROXY") == "1":  # random weights: speed is all there is
        return {c.variant: Outcome("speed only", "a shape proxy (random weights): no quality evidence exists, so "
                                   "nothing is certified; " + ratios_text(speeds, c.variant, plan))
                for c in measured}
    worth = contenders(plan, measured, speeds)
    for c in measured:
        if c.variant not in worth:  # judged below on what exists (a sibling on the same weights may have bought it)
            continue
        if c.evidence == "parity":
            e = r.step("parity", "eval-parity", c.quality_of or c.variant, budget.parity, records="quality")
        else:
            e = r.step("identity", "eval-identity", c.variant, budget.identity, records="quality")
        if e["status"] != "ok":
            out[c.variant] = Outcome("failed", f"its {c.evidence} run failed: {e.get('error')}")
    judged = judge_plan([c.variant for c in measured])
    won: dict[int, float] = {}
    for level in plan.concurrency:
        for c in sorted(measured, key=lambda c: -(speeds.point(c.variant, plan.reference, level) or 0)):
            sr = speeds.versus(c.variant, plan.reference, level)
            if c.variant in out and out[c.variant].status in ("failed", "unreliable"):
                continue
            if sr is None or sr.ratio <= 1.0:
                break
            if any(x.status == "fail" for x in judged[c.variant].criteria):
                continue
            if not sr.faster:  # a tie with the reference (or one round): not faster, whatever its quality
                r.note(c.variant, f"c={level}: {sr.text()} × {plan.reference} over {sr.rounds} round(s) is "
                       f"{'a tie (its 95% interval holds 1.00)' if sr.verdict == 'tie' else 'one round: no interval'}")
                continue
            waiting = needs_suite(c.variant, judged)
            if waiting and (budget.suite is None or r.no_suite):
                why = "SUITE=0" if r.no_suite else f"BUDGET={plan.budget}"
                r.note(c.variant, f"the suite was cut by {why} ({', '.join(waiting)} waited on it)")
            elif waiting:
                for v in reversed(waiting):  # the chain's top first: a parent's verdict before its child's
                    ref = reference_name(load_variant(v).resolved)
                    if not run_suite(r, v, ref, "sample"):
                        break
                    again = judge_plan([v])[v]
                    if budget.suite == "full" and suite_only(again) and not run_suite(r, v, ref, "full"):
                        break
                judged = judge_plan([c.variant for c in measured])
            if judged[c.variant].certified and budget.soak is not None and \
                    (why := reliability(r, c.variant)) is not None:
                out[c.variant] = Outcome("unreliable", f"certified and faster, but its server failed: {why}",
                                         judged[c.variant])
                continue
            if judged[c.variant].certified:
                won[level] = sr.ratio
                out.setdefault(c.variant, Outcome("certified", "", judged[c.variant])).winner_at.append(level)
                break
    # the reference is named the winner where nothing beats it: what a user deploys gets the same soak and fuzz; it
    # stays the winner (nothing certified is faster) and a failure is said beside it
    if budget.soak is not None and any(lv not in won for lv in plan.concurrency) and \
            (why := reliability(r, plan.reference)):
        r.note(plan.reference, f"reliability: its server failed: {why}")
    for c in measured:
        j = judged[c.variant]
        if c.variant in out:
            out[c.variant].judged = out[c.variant].judged or j
            continue
        failed = [x for x in j.criteria if x.status == "fail"]
        faster = [lv for lv in plan.concurrency if above(speeds, c.variant, plan.reference, lv)]
        if failed:
            out[c.variant] = Outcome("rejected", "; ".join(criterion_text(x) for x in failed), j)
        elif c.variant not in worth:  # judged on a sibling's evidence at most: never a tie or a winner
            none = all(x.status == "missing" for x in j.criteria)
            out[c.variant] = Outcome("not pursued", NOT_FASTER + (": no quality evidence bought" if none else ""), j)
        elif j.certified and not any((sr := speeds.versus(c.variant, plan.reference, lv)) and sr.faster
                                     for lv in plan.concurrency):
            out[c.variant] = Outcome("tie", "at parity, but not faster with 95% confidence at any level: "
                                     + ratios_text(speeds, c.variant, plan), j)
        elif j.certified:
            out[c.variant] = Outcome("certified", "a faster certified variant won every level", j)
        elif not faster:
            out[c.variant] = Outcome("not pursued", NOT_FASTER, j)
        elif all(lv in won and (speeds.point(c.variant, plan.reference, lv) or 0) <= won[lv] for lv in faster):
            out[c.variant] = Outcome("not pursued", "slower than the certified winner wherever it beats BF16: its "
                                     "remaining evidence was not bought", j)
        else:
            out[c.variant] = Outcome("not certified", "", j)
    return out
