"""The parity gate: tolerances live in each variant's config.env (GATE_*), evidence in its newest quality records.

    GATE_REFERENCE=smollm2-bf16      # default: PARENT
    GATE_MAX_MEAN_KLD=0.05           # nats per token (measure.parity): weight / activation quantization
    GATE_MIN_TOP1=0.90               # top-1 agreement with the reference (measure.parity)
    GATE_MAX_PPL_RATIO=1.05          # perplexity of variant / reference on the same tokens (measure.parity)
    GATE_MAX_SUITE_DROP=1.0          # points (0-100) lost over the suite of record (BIG-bench Lite), pooled over its
                                     # items and paired item by item; each task's own drop is reported beside it
    GATE_MAX_TASK_DROP=2.0           # points (0-100) lost on any lm-eval task's main metric, paired item by item
    GATE_GREEDY_IDENTITY=1           # lossless speculation: greedy token ids equal the reference's, up to near-ties
    GATE_MIN_TEXT_IDENTITY=0.90      # greedy answers (one per prompt, c=1) whose text agrees with the reference's (measure.identity)
    GATE_MIN_ARGMAX_COVERAGE=0.995   # pruned vocabulary (measure.parity): share of tokens whose reference argmax is kept
    GATE_MAX_DROPPED_MASS=0.005      # pruned vocabulary: mean reference probability on dropped ids

Each criterion is a one-sided test at 95% confidence, so every interval printed is the two-sided 90% interval whose
ends are the two one-sided 95% bounds. A "max" tolerance passes when the upper bound is within it, fails when the
lower bound is beyond it, and is inconclusive otherwise (mirrored for "min"); inconclusive never counts as a pass, and
the criterion says how much more evidence would decide it at the effect observed so far.

Intervals:
- Parity metrics (KLD, top-1, PPL ratio): tokens within one chunk share their context, so the standard error comes
  from the per-chunk values (a cluster / ratio-estimator SE), not from treating 8192 tokens as independent.
- Task drop (per task, or pooled over the suite): the items both records scored, paired. For 0/1 outcomes the adjusted Wald interval for matched
  proportions of Agresti & Min (2005): add 1/2 to each cell of the 2x2 table of (reference right?, variant right?)
  and use the Wald interval of the difference. Chosen over the exact conditional McNemar interval and the paired
  bootstrap because both of those collapse to zero width when the two models agree on every item (5 agreeing items
  would "prove" a drop of exactly 0), while this one stays honest with few discordant pairs, is closed-form (tests
  check it by hand) and needs no random numbers. Non-binary item scores use the paired Wald interval of the mean
  per-item difference.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.common.hardware import hardware_key
from scripts.common.records import of_record
from scripts.common.variants import VariantError, load_variant, reference_name

Z = 1.6448536269514722  # one-sided 95% normal quantile
# Parity criteria: config key -> (summary field, per-chunk sample field, "max" | "min")
PARITY_CRITERIA = {
    "GATE_MAX_MEAN_KLD": ("mean_kld", "mean_kld", "max"),
    "GATE_MIN_TOP1": ("top1_agreement", "top1_agreement", "min"),
    "GATE_MAX_PPL_RATIO": ("ppl_ratio", None, "max"),  # from the per-chunk NLL sums
    # a pruned output vocabulary (scripts.levers.vocab.prune): the reference's argmax is a kept id; its mass on dropped ids
    "GATE_MIN_ARGMAX_COVERAGE": ("argmax_coverage", "argmax_coverage", "min"),
    "GATE_MAX_DROPPED_MASS": ("dropped_mass", "dropped_mass", "max"),
}
TASK_KEY = "GATE_MAX_TASK_DROP"
SUITE_KEY = "GATE_MAX_SUITE_DROP"
IDENTITY_KEY = "GATE_GREEDY_IDENTITY"
TEXT_KEY = "GATE_MIN_TEXT_IDENTITY"
# GATE_QUALITY_OF=<variant>: judge on that variant's quality records, which score the same weights file (its MODEL)
# served by another engine (a GGUF's llama-server rung: llama.cpp scores the file in-process for every GGUF variant)
QUALITY_OF_KEY = "GATE_QUALITY_OF"
GATE_KEYS = (*PARITY_CRITERIA, SUITE_KEY, TASK_KEY, IDENTITY_KEY, TEXT_KEY, "GATE_REFERENCE", QUALITY_OF_KEY)
MAIN_METRICS = ("acc", "exact_match", "prompt_level_strict_acc", "acc_norm", "multiple_choice_grade", "exact_str_match")  # first one a task reports
ITEMS_COMMAND = "make eval-quality-full VARIANT={v}"  # with no TASKS: the suite of record
STATUSES = ("pass", "inconclusive", "missing", "fail")  # verdict precedence: the last present wins
NO_GATE = "GATE_*"  # the one criterion of a variant that sets no tolerance (always missing)


class GateError(ValueError):
    """Records that must not be compared, or a tolerance the gate does not know; one line, ready to print."""


@dataclass
class Criterion:
    name: str
    limit: float
    kind: str  # "max" | "min"
    value: float | None = None
    lo: float | None = None
    hi: float | None = None
    status: str = "missing"  # pass | fail | inconclusive | missing
    detail: str = ""
    decide: str = ""  # what would decide an inconclusive / missing criterion
    beside: list[str] = field(default_factory=list)  # reported with it, not judged (the suite's per-task drops)
    hardware: str | None = None  # hardware_key of the variant's record it was judged on (None: no record)

    def line(self) -> str:
        value = "—" if self.value is None else f"{self.value:.4g}"
        ci = "" if self.lo is None else f" [{self.lo:.4g}, {self.hi:.4g}]"
        op = "≤" if self.kind == "max" else "≥"
        tail = "; ".join(x for x in (self.detail, self.decide) if x)
        return f"{self.status.upper():12s} {self.name} = {value}{ci} (limit {op} {self.limit:g}){' — ' + tail if tail else ''}"


# ---------------------------------------------------------------------------------------------------------- statistics
def decide(lo: float, hi: float, limit: float, kind: str) -> str:
    """pass / fail / inconclusive of a one-sided test whose bounds are lo and hi."""
    if kind == "max":
        return "pass" if hi <= limit else "fail" if lo > limit else "inconclusive"
    return "pass" if lo >= limit else "fail" if hi < limit else "inconclusive"


def n_to_decide(sd: float, estimate: float, limit: float) -> float | None:
    """Samples for a one-sided 95% bound to clear `limit`, at per-sample standard deviation sd: (z sd / gap)^2."""
    gap = abs(limit - estimate)
    if gap <= 1e-9 * max(1.0, abs(limit)):
        return None  # the estimate sits on the limit: no sample size decides it
    return (Z * sd / gap) ** 2


def cluster_mean(values: list[float], weights: list[float]) -> tuple[float, float]:
    """Weighted mean of per-cluster means and its ratio-estimator standard error (clusters independent)."""
    n, total = len(values), sum(weights)
    mean = sum(v * w for v, w in zip(values, weights, strict=True)) / total
    if n < 2:
        return mean, math.nan
    var = n / (n - 1) * sum((w * (v - mean)) ** 2 for v, w in zip(values, weights, strict=True)) / total**2
    return mean, math.sqrt(var)


@dataclass
class PairedDrop:
    n: int
    drop: float  # observed: mean of reference minus variant, 0-1 scale
    lo: float
    hi: float
    center: float  # the interval's center (the adjusted estimate for binary outcomes)
    sd: float  # per-item standard deviation behind the interval
    extra: int  # pseudo-items the interval adds (2 for Agresti-Min)
    ref_only: int = 0  # items the reference got right and the variant wrong (binary outcomes)
    var_only: int = 0
    method: str = ""

    @property
    def disagreement(self) -> float:
        return (self.ref_only + self.var_only) / self.n

    def items_to_decide(self, limit: float) -> int | None:
        """Paired items at which the bound would clear `limit` if the disagreement and drop stayed as observed."""
        need = n_to_decide(self.sd, self.center, limit)
        return None if need is None else max(math.ceil(need - self.extra), 1)


def paired_drop(ref: list[float], var: list[float]) -> PairedDrop:
    """Drop of the variant vs the reference over paired items with one-sided 95% bounds (module docstring)."""
    n = len(ref)
    if n == 0 or n != len(var):
        raise ValueError("paired_drop needs two equal, non-empty lists of item scores")
    b = sum(1 for r, v in zip(ref, var, strict=True) if r > v)
    c = sum(1 for r, v in zip(ref, var, strict=True) if r < v)
    if all(x in (0, 1) for x in (*ref, *var)):
        pb, pc = (b + 0.5) / (n + 2), (c + 0.5) / (n + 2)  # Agresti-Min: 1/2 added to each of the 4 cells
        center = pb - pc
        sd = math.sqrt(pb + pc - center * center)
        half = Z * sd / math.sqrt(n + 2)
        return PairedDrop(n, (b - c) / n, center - half, center + half, center, sd, 2, b, c,
                          "Agresti-Min adjusted Wald, matched pairs")
    diffs = [r - v for r, v in zip(ref, var, strict=True)]
    mean = sum(diffs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in diffs) / (n - 1)) if n > 1 else math.inf
    half = Z * sd / math.sqrt(n)
    return PairedDrop(n, mean, mean - half, mean + half, mean, sd, 0, b, c, "paired Wald on item differences")


# ---------------------------------------------------------------------------------------------------------- criteria
def parity_criterion(key: str, limit: float, parity: dict | None, chunks: list[dict]) -> Criterion:
    field, sample_field, kind = PARITY_CRITERIA[key]
    c = Criterion(key, limit, kind)
    if parity is None:
        c.detail, c.decide = "no parity record against the reference", "make eval-parity VARIANT=…"
        return c
    c.value = parity[field]
    usable = [s for s in chunks if s.get("tokens")]
    if sample_field is None:  # PPL ratio: exp of the mean per-token NLL difference
        usable = [s for s in usable if "nll_ref_sum" in s and "nll_var_sum" in s]
        # nll_tokens: the positions both NLL sums cover (a pruned vocabulary leaves out those whose gold id is dropped)
        values = [(s["nll_var_sum"] - s["nll_ref_sum"]) / s.get("nll_tokens", s["tokens"]) for s in usable]
    else:
        usable = [s for s in usable if sample_field in s]
        values = [s[sample_field] for s in usable]
    if len(usable) < 2:
        c.status, c.detail = "inconclusive", "the parity record has no per-chunk samples to bound the estimate"
        return c
    weights = [s.get("nll_tokens", s["tokens"]) if sample_field is None else s["tokens"] for s in usable]
    mean, se = cluster_mean(values, weights)
    lo, hi = mean - Z * se, mean + Z * se
    lim = limit
    if sample_field is None:  # bounds of the log ratio, reported as ratios
        lo, hi, lim = math.exp(lo), math.exp(hi), math.log(limit)
    c.lo, c.hi = lo, hi
    c.status = decide(lo, hi, limit, kind)
    tokens = sum(weights)
    c.detail = f"{tokens} tokens in {len(usable)} chunks"
    if c.status == "inconclusive":
        per_chunk_sd = se * math.sqrt(len(usable))
        need = n_to_decide(per_chunk_sd, mean, lim)
        c.decide = ("the estimate sits on the limit: no sample size decides it" if need is None else
                    f"≈{math.ceil(need) * tokens // len(usable)} tokens would decide it at this effect "
                    f"(measure.parity --tokens)")
    return c


def task_criterion(task: str, limit_points: float, ref_items: dict[str, float], var_items: dict[str, float],
                   metric: str) -> Criterion:
    shared = sorted(set(ref_items) & set(var_items))
    c = Criterion(f"{TASK_KEY}[{task}]", limit_points, "max")
    if not shared:
        c.detail = "the two records share no item"
        return c
    p = paired_drop([ref_items[i] for i in shared], [var_items[i] for i in shared])
    c.value, c.lo, c.hi = p.drop * 100, p.lo * 100, p.hi * 100
    c.status = decide(c.lo, c.hi, limit_points, "max")
    c.detail = (f"{metric}, {p.n} paired items, reference-only right {p.ref_only}, variant-only right {p.var_only} "
                f"({p.disagreement:.1%} disagree; {p.method})")
    if c.status == "inconclusive":
        need = p.items_to_decide(limit_points / 100)
        c.decide = ("the drop sits on the limit: no item count decides it" if need is None else
                    f"≈{need} paired items would decide it at this disagreement rate ({max(need - p.n, 0)} more)")
    return c


def suite_criterion(limit_points: float, var_rec: dict | None, ref_recs: list[dict], variant: str,
                    reference: str) -> Criterion:
    """The pooled paired drop over every item of the suite of record both records scored, each task's drop beside."""
    if var_rec is None:
        return Criterion(SUITE_KEY, limit_points, "max", detail="no suite record with per-item outcomes",
                         decide=f"`{ITEMS_COMMAND.format(v=variant)}`")
    suite = var_rec["inputs"]["suite"]
    name = f"{SUITE_KEY}[{suite['name']}]"
    same_hw = [r for r in ref_recs if has_items(r) and r["inputs"].get("suite", {}).get("name") == suite["name"]
               and hardware_key(r["hardware"]) == hardware_key(var_rec["hardware"])]
    ref = newest(same_hw)
    if ref is None:
        return Criterion(name, limit_points, "max", detail=f"{reference} has no {suite['name']} record from the same "
                         f"hardware", decide=f"`{ITEMS_COMMAND.format(v=reference)}`")
    theirs = ref["inputs"]["suite"]
    for what in ("sha256", "sdist_sha256"):
        if suite.get(what) != theirs.get(what):
            raise GateError(f"refusing to pair {suite['name']}: {variant} has suite {what} {str(suite.get(what))[:12]}… "
                            f"({suite.get('items')} items), {reference} has {str(theirs.get(what))[:12]}… "
                            f"({theirs.get('items')} items); re-run the older one (`make datasets` draws the suite)")
    c = task_criterion(suite["name"], limit_points, scored(ref), scored(var_rec), "pooled item scores")
    c.name = name
    for rec in (var_rec, ref):
        if skipped := rec["inputs"].get("skipped"):
            c.beside.append(f"{rec['variant']}'s record skipped {len(skipped['tasks'])} task(s): {skipped['why']}")
    if c.status == "inconclusive" and c.decide:
        c.decide += f"; the suite draws {suite['items']} (TARGET_ITEMS in scripts/data/bigbench_tasks.py)"
    for task in var_rec["inputs"]["tasks"]:
        ref_items, var_items = scored(ref, task), scored(var_rec, task)
        shared = sorted(set(ref_items) & set(var_items))
        if not shared:
            c.beside.append(f"{task}: no item scored by both")
            continue
        p = paired_drop([ref_items[i] for i in shared], [var_items[i] for i in shared])
        c.beside.append(f"{task}: reference {100 * sum(ref_items[i] for i in shared) / len(shared):.1f}, drop "
                        f"{100 * p.drop:+.2f} [{100 * p.lo:+.2f}, {100 * p.hi:+.2f}] over {p.n} items")
    return c


def judged_on(record: dict | None, criteria: list[Criterion]) -> list[Criterion]:
    """The criteria, each marked with the hardware of the variant's record they were judged on."""
    for c in criteria:
        c.hardware = hardware_key(record["hardware"]) if record else None
    return criteria


def is_sample(record: dict) -> bool:
    """A record of a sample of the suite (`make eval-quality`), not every drawn item (`make eval-quality-full`)."""
    return "sample" in record["inputs"].get("suite", {})


def suite_evidence(limit_points: float, mine: list[dict], ref_recs: list[dict], variant: str,
                   reference: str) -> Criterion:
    """The suite criterion from the variant's newest record of every drawn item; a sample record counts only where
    its items decide the criterion (pass or fail), never as an inconclusive stand-in for the whole suite. The
    reference's whole-suite record is preferred to its sample (the pairs are the items both scored)."""
    suite_recs = [r for r in mine if has_items(r) and "suite" in r["inputs"]]
    full = newest([r for r in suite_recs if not is_sample(r)], kind="lm-eval")
    sample = newest([r for r in suite_recs if is_sample(r)], kind="lm-eval")
    refs = sorted(ref_recs, key=is_sample)  # stable: newest first within whole-suite records, then samples
    if full is not None or sample is None:
        return judged_on(full, [suite_criterion(limit_points, full, refs, variant, reference)])[0]
    c = judged_on(sample, [suite_criterion(limit_points, sample, refs, variant, reference)])[0]
    c.detail = f"a {sample['inputs']['suite']['sample']['limit']:.0%} sample of the suite; " + c.detail
    if c.status == "inconclusive":
        c.decide = f"the sample does not decide it: `{ITEMS_COMMAND.format(v=variant)}` scores every drawn item"
    return c


def identity_criterion(summary: dict | None) -> Criterion:
    """Lossless speculation: every divergence from the reference's greedy ids is a teacher-forced near-tie."""
    c = Criterion(IDENTITY_KEY, 0, "max")
    if summary is None:
        c.detail, c.decide = "no greedy-identity record against the reference", "the greedy-identity check of the variant"
        return c
    beyond = summary["divergences_beyond_tie"]
    c.value = float(beyond)
    c.status = "pass" if beyond == 0 and summary["sequences"] > 0 else "fail"
    c.detail = (f"{summary['identical']}/{summary['sequences']} sequences identical, "
                f"{summary['near_tie_divergences']} diverge at a near-tie, {beyond} beyond one")
    return c


def wilson(k: int, n: int) -> tuple[float, float]:
    """The Wilson score interval of a proportion k/n whose ends are one-sided 95% bounds."""
    p, z2 = k / n, Z * Z
    mid, half = (p + z2 / (2 * n)) / (1 + z2 / n), Z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, mid - half), min(1.0, mid + half)


def text_criterion(limit: float, summary: dict | None) -> Criterion:
    """The share of greedy answers whose text agrees with the reference's (a proportion over prompts: Wilson)."""
    c = Criterion(TEXT_KEY, limit, "min")
    if summary is None or not summary.get("sequences") or "text_agrees" not in summary:
        c.detail, c.decide = "no greedy-identity record with text against the reference", "make eval-identity"
        return c
    k, n = summary["text_agrees"], summary["sequences"]
    c.value, (c.lo, c.hi) = k / n, wilson(k, n)
    c.status = decide(c.lo, c.hi, limit, "min")
    c.detail = f"{k}/{n} answers' text agrees ({summary['spelled_out']} of them spelled out in other tokens)"
    if c.status == "inconclusive":
        c.decide = "more prompts in the greedy-identity check (make eval-identity ... --limit N)"
    return c


# ---------------------------------------------------------------------------------------------------------- records
def main_metric(task_scores: dict) -> str | None:
    return next((m for m in MAIN_METRICS if isinstance(task_scores.get(m), (int, float))), None)


def quality_records(variant: str, root: Path | None = None) -> list[dict]:
    """All quality records of a variant, newest first (a trial's only for that trial's reader: records.of_record)."""
    d = (root or paths.EXPERIMENTS) / variant
    return [r for r in (json.loads(p.read_text()) for p in sorted(d.glob("quality_*.json"), reverse=True))
            if of_record(r)]


DEVICES = ("cpu", "gpu")  # the kinds of machine a verdict is judged on (device_of)


def device_of(record: dict) -> str:
    """The kind of machine a record was made on: gpu where it names one, else cpu."""
    return "gpu" if (record.get("hardware") or {}).get("gpu") else "cpu"


class RecordsOn(dict):
    """Each variant's quality records made on one kind of machine (cpu | gpu), newest first: gate_for's `quality`
    where a verdict must rest on that kind's evidence alone (a GPU server's parity is judged against BF16 on a GPU,
    never by a CPU run's records). Taken from `records` ({variant: its records}, read once by a caller judging many)
    where given, else read from the variant's folder when first asked for."""

    def __init__(self, device: str, root: Path | None = None, records: dict[str, list[dict]] | None = None) -> None:
        super().__init__()
        self.device, self.root, self.records = device, root, records

    def get(self, variant: str, default: list[dict] | None = None) -> list[dict]:
        if variant not in self:
            mine = quality_records(variant, self.root) if self.records is None else self.records.get(variant, [])
            self[variant] = [r for r in mine if device_of(r) == self.device]
        return self[variant]


def newest(records: list[dict], **inputs) -> dict | None:
    for r in records:
        if r.get("status") == "ok" and all(r["inputs"].get(k) == v for k, v in inputs.items()):
            return r
    return None


def has_items(record: dict) -> bool:
    """Per-item outcomes keyed by a stable item id (scripts/measure/quality.py, schema v2 samples)."""
    return bool(record.get("samples")) and all("item_id" in s for s in record["samples"])


def item_scores(record: dict, task: str) -> tuple[str, dict[str, float]]:
    metric = record["inputs"]["task_meta"][task]["metric"]
    return metric, {s["item_id"]: s["score"] for s in record["samples"] if s["task"] == task}


def scored(record: dict, task: str | None = None) -> dict[str, float]:
    """{item id: score} of a record's scored items (of one task, or all)."""
    return {s["item_id"]: s["score"] for s in record["samples"]
            if s["score"] is not None and (task is None or s["task"] == task)}


def check_pairable(var: dict, ref: dict, task: str) -> None:
    """Same task version and item set, or refuse naming the difference."""
    a, b = var["inputs"]["task_meta"].get(task), ref["inputs"]["task_meta"].get(task)
    if b is None:
        raise GateError(f"{ref['variant']}'s record has no {task}: run `{ITEMS_COMMAND.format(v=ref['variant'])}"
                        f" TASKS={','.join(var['inputs']['tasks'])}`")
    for what in ("version", "items_sha256", "metric"):
        if a.get(what) != b.get(what):
            raise GateError(f"refusing to pair {task}: {var['variant']} has {what} {a.get(what)!r} ({a.get('n')} items), "
                            f"{ref['variant']} has {b.get(what)!r} ({b.get('n')} items); re-run the older one")


def task_criteria(limit: float, var_rec: dict | None, ref_recs: list[dict], variant: str,
                  reference: str) -> list[Criterion]:
    if var_rec is None:
        return [Criterion(TASK_KEY, limit, "max", detail="no lm-eval record with per-item outcomes",
                          decide=f"`{ITEMS_COMMAND.format(v=variant)}`")]
    tasks = var_rec["inputs"]["tasks"]
    ref = newest([r for r in ref_recs if has_items(r) and r["inputs"].get("kind") == "lm-eval"
                  and set(tasks) <= set(r["inputs"]["tasks"])
                  and hardware_key(r["hardware"]) == hardware_key(var_rec["hardware"])])
    if ref is None:
        return [Criterion(TASK_KEY, limit, "max", detail=f"{reference} has no lm-eval record with per-item outcomes on "
                          f"{', '.join(tasks)} from the same hardware",
                          decide=f"`{ITEMS_COMMAND.format(v=reference)}`")]
    out = []
    for task in tasks:
        check_pairable(var_rec, ref, task)
        metric, var_items = item_scores(var_rec, task)
        _, ref_items = item_scores(ref, task)
        out.append(task_criterion(task, limit, ref_items, var_items, metric))
    return out


# serving settings by which the engine computes differently from the same weights: a variant that differs from its
# reference only there is scored by the engine itself (scripts/measure/parity.py)
ENGINE_NUMERICS = ("SERVE_KV_CACHE_DTYPE", "SERVE_QUANTIZATION")


def engine_only(settings: dict[str, str], reference: dict[str, str]) -> list[str]:
    """The numerics settings a variant's engine applies that its reference's does not (FP8 KV cache, online
    quantization): what transformers, scoring the weights alone, cannot see."""
    return [f"{k}={settings[k]}" for k in ENGINE_NUMERICS if settings.get(k) and settings.get(k) != reference.get(k)]


def self_compared(record: dict, reference: dict[str, str]) -> bool:
    """A parity record that transformers scored on the reference's own weights for a variant whose engine applies a
    numerics setting its reference's does not (an FP8 KV cache): the checkpoint compared with itself (KL 0), not
    evidence. `reference`: the reference's settings."""
    config, inputs = record.get("config", {}), record["inputs"]
    return (inputs.get("backend") == "transformers" and config.get("MODEL") == inputs.get("reference_model")
            and bool(engine_only(config, reference)))


def parity_record(records: list[dict], reference: str) -> dict | None:
    """The newest parity record against the reference, full-distribution KL preferred over vLLM's top-K approximation;
    a record that compared a checkpoint with itself is passed over."""
    suspects = [r for r in records if r["inputs"].get("kind") == "parity" and self_compared(r, {})]
    if suspects:  # the reference's settings read only where a record may have compared a checkpoint with itself
        try:
            ref = load_variant(reference).resolved
        except VariantError:  # a reference since removed: its records are read as they are
            ref = {}
        drop = {id(r) for r in suspects if self_compared(r, ref)}
        records = [r for r in records if id(r) not in drop]
    return newest(records, kind="parity", reference=reference, backend="transformers") or newest(
        records, kind="parity", reference=reference)


def parity_criteria(settings: dict[str, str], record: dict | None) -> list[Criterion]:
    """The label-free criteria the settings name, judged on one parity record (None: missing)."""
    return [parity_criterion(key, float(settings[key]), record["summary"]["parity"] if record else None,
                             record["samples"] if record else []) for key in PARITY_CRITERIA if key in settings]


def check_keys(settings: dict[str, str]) -> None:
    unknown = sorted(k for k in settings if k.startswith("GATE_") and k not in GATE_KEYS)
    if unknown:
        raise GateError(f"unknown gate key(s) {', '.join(unknown)}; the gate knows {', '.join(GATE_KEYS)}")


def gate_for(variant: str, settings: dict[str, str], root: Path | None = None,
             quality: dict[str, list[dict]] | None = None) -> tuple[str | None, list[Criterion]]:
    """(reference, criteria) from the newest records; reference None means the variant is itself a reference.
    `quality`: every variant's quality records, newest first, read once by a caller that judges many variants
    (default: each variant's read here)."""
    check_keys(settings)
    reference = reference_name(settings)
    if not reference:
        return None, []

    def records_of(v: str) -> list[dict]:
        return quality.get(v, []) if quality is not None else quality_records(v, root)

    mine = records_of(quality_source(variant, settings, root))
    parity = parity_record(mine, reference)
    out = judged_on(parity, parity_criteria(settings, parity))
    if SUITE_KEY in settings:
        out.append(suite_evidence(float(settings[SUITE_KEY]), mine, records_of(reference), variant, reference))
    if TASK_KEY in settings:
        var_rec = newest([r for r in mine if has_items(r) and "suite" not in r["inputs"]], kind="lm-eval")
        out += judged_on(var_rec, task_criteria(float(settings[TASK_KEY]), var_rec, records_of(reference), variant,
                                                reference))
    ident = newest(mine, kind="greedy-identity", reference=reference)
    if settings.get(IDENTITY_KEY) == "1":
        out += judged_on(ident, [identity_criterion(ident["summary"]["identity"] if ident else None)])
    if TEXT_KEY in settings:
        # one answer per prompt: the same prompt's answers at other concurrencies are not independent evidence
        per_prompt = ident["summary"].get("per_concurrency", {}).get("1", ident["summary"]["identity"]) if ident else None
        out += judged_on(ident, [text_criterion(float(settings[TEXT_KEY]), per_prompt)])
    if not out:
        out = [Criterion(NO_GATE, 0, "max", detail=f"{variant} sets no GATE_* tolerance")]
    return reference, out


def quality_source(variant: str, settings: dict[str, str], root: Path | None = None) -> str:
    """Whose quality records judge `variant`: its own, or GATE_QUALITY_OF's when that variant serves the same MODEL
    file (GateError otherwise: another file's scores are no evidence)."""
    source = settings.get(QUALITY_OF_KEY)
    if not source:
        return variant
    try:
        theirs = load_variant(source, root=root).resolved.get("MODEL")
    except VariantError as e:
        raise GateError(f"{variant}: {QUALITY_OF_KEY}={source}: {e}") from None
    if theirs != settings.get("MODEL"):
        raise GateError(f"{variant}: {QUALITY_OF_KEY}={source} serves MODEL={theirs}, {variant} MODEL={settings.get('MODEL')}: "
                        f"only the same file's records stand for it")
    return source


def verdict(criteria: list[Criterion]) -> str:
    """fail if any criterion fails; else missing if one lacks its record; else inconclusive if one is; else pass."""
    return max((c.status for c in criteria), key=STATUSES.index, default="missing")
