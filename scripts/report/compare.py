"""Compare variants: speed from their newest latency records, quality from the parity gate; name the fastest certified.

    python -m scripts.report.compare          # writes results/compare_<YYYYMMDD>.md, .png (throughput) and _pareto.png

The newest record of each variant on each hardware and prompt set is used (a variant measured on a CPU and on a GPU
appears in both tables). Records of replicas behind a router are left to `make plan`. Only records with status ok are compared; a failed newest record is listed as not
comparable. A ratio is marked back-to-back only when both records come from one ladder run
(`make eval-latency-ladder`, same inputs.ladder_id); anything else is labelled as measured in separate runs.
A ratio to the BF16 reference is the geometric mean of its per-round ratios where the ladder ran in several rounds
(`make eval-latency-ladder ROUNDS=2`, `make optimize`: records paired by inputs.round, else by their order in the
ladder) with its 95% interval (scripts/common/metrics.py: speed_ratio); a variant is named faster only when the lower
end is above 1.00. One round has no interval and certifies no speedup; an interval holding 1.00 is a tie. GPU tables
also give TPOT × BF16 (BF16's TPOT p50 over the variant's, paired the same way): the decode step's speed, which output
tok/s mixes with the first token's time.
The gate column is the parity gate's verdict (scripts/common/gate.py) from the variant's quality records: only a
variant whose every criterion passes is certified. A GPU table's gate reads the records made on GPUs and a CPU table's
those made on CPUs (a GPU server's parity is judged against BF16 on a GPU, not on the CPU); a pass judged on another
machine of the same kind names it (evidence from …). The fastest certified variant is named per group at c=1 and at
c=8 with the evidence line of each criterion, and inconclusive variants are listed with what would decide them.
The Pareto plot puts each gated variant's speed over BF16 (x; c=1 and c=8 panels) against its mean KL divergence
(y, log scale), marker by verdict, with the frontier (no other variant both faster and closer) drawn; lossless
variants (judged by greedy identity, no KL divergence) and shape proxies have no y value and are not drawn.
The quality section lists every variant's newest record of the suite of record (BIG-bench Lite, zero-shot) per
hardware: the pooled score, its paired drop against the variant's gate reference with the one-sided 95% bounds, and
each task's score (the reference's absolute score beside each variant's drop in points).
Superseded variants (SUPERSEDED_BY in their config.env: dead ends kept as research history) get no row in the speed
and quality tables; a line names them, and their records still serve as the parent or BF16 speed of a row that names
them. `make list` shows every variant with its status.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from scripts.common import paths
from scripts.common.engines import ENGINES
from scripts.common.gate import (
    DEVICES,
    IDENTITY_KEY,
    SUITE_KEY,
    Criterion,
    GateError,
    RecordsOn,
    device_of,
    gate_for,
    scored,
    verdict,
)
from scripts.common.hardware import hardware_key
from scripts.common.metrics import SpeedRatio, fmt, ratio, speed_ratio
from scripts.common.records import all_records, now_utc
from scripts.common.variants import VariantError, lever_of, list_variants, load_variant, reference_name

MODE = "fixed"  # speed is compared at fixed output length (ignore_eos)
LEVELS = ("1", "8")  # the concurrencies a winner is named at
MARKERS = {"pass": ("o", "tab:green"), "inconclusive": ("s", "tab:orange"), "missing": ("D", "tab:gray"),
           "fail": ("x", "tab:red")}


@dataclass
class Judged:
    """A variant's gate verdict: reference | pass | inconclusive | missing | fail | n/a (shape proxy) | error."""
    verdict: str
    criteria: list[Criterion] = field(default_factory=list)
    note: str = ""
    upstream: frozenset[str] = frozenset()  # the hardware its references' passes were judged on (chain())

    @property
    def certified(self) -> bool:
        return self.verdict == "pass"

    @property
    def kld(self) -> float | None:
        return next((c.value for c in self.criteria if c.name == "GATE_MAX_MEAN_KLD"), None)

    def hardware(self) -> set[str]:
        """Where the evidence of a pass was judged: its own criteria's records and its references' (chain())."""
        return {c.hardware for c in self.criteria if c.hardware} | self.upstream

    def short(self, hardware: str | None = None) -> str:
        """The verdict in a table cell; in the table of `hardware`, a pass judged on other hardware says where (a GPU
        row certified by a CPU run's identity record, or by a reference certified there)."""
        if self.verdict not in ("pass", "reference") and not self.note:  # "fail: A, B; missing: C", the verdict's first
            groups: dict[str, list[str]] = {}
            for c in self.criteria:
                if c.status != "pass":
                    groups.setdefault(c.status, []).append(c.name)
            order = sorted(groups, key=lambda s: s != self.verdict)
            return "; ".join(f"{s}: {', '.join(groups[s])}" for s in order) or self.verdict
        elsewhere = sorted(h for h in self.hardware() if h != hardware) if self.certified and hardware else []
        return (self.verdict + (f": {self.note}" if self.note else "")
                + (f" (evidence from {'; '.join(elsewhere)})" if elsewhere else ""))

    def blocking(self) -> list[Criterion]:
        return [c for c in self.criteria if c.status != "pass"]


class PerDevice(dict):
    """Verdicts per kind of machine, {"cpu": {variant: Judged}, "gpu": {...}}, each judged on that kind's records."""


def on(judged: dict, device: str) -> dict[str, Judged]:
    """The verdicts that judge rows of `device` (cpu | gpu): one kind's of a PerDevice, else `judged` itself."""
    return judged[device] if isinstance(judged, PerDevice) else judged


def judge(variant: str, config: dict[str, str], root: Path | None = None,
          quality: dict[str, list[dict]] | None = None) -> Judged:
    """The gate on the variant's current config.env (its tolerances today), else on the config its record carries
    (`quality`: every variant's quality records, newest first, when the caller has read them: by_variant)."""
    with contextlib.suppress(VariantError):
        config = load_variant(variant, root=root).resolved
    if config.get("SHAPE_PROXY") == "1":
        return Judged("n/a", note="shape proxy, speed only")
    try:
        reference, criteria = gate_for(variant, config, root, quality)
    except GateError as e:
        return Judged("error", note=str(e))
    return Judged("reference") if reference is None else Judged(verdict(criteria), criteria)


def chain(judged: dict[str, Judged], configs: dict[str, dict[str, str]]) -> dict[str, Judged]:
    """A pass counts only if the variant's reference is certified too, up to the BF16 reference: lossless speculation
    on an INT8 model that is inconclusive against BF16 is itself inconclusive against BF16."""
    out = dict(judged)

    def settle(v: str, seen: tuple[str, ...] = ()) -> Judged:
        j = out[v]
        ref = reference_name(configs.get(v, {}))
        if j.verdict != "pass" or ref is None or ref in seen or ref not in out:
            return j
        up = settle(ref, (*seen, v))
        if up.verdict not in ("pass", "reference"):
            out[v] = Judged(up.verdict, j.criteria, note=f"its own gate passes; its reference {ref} is {up.verdict}")
        elif up.certified:
            out[v] = replace(j, upstream=j.upstream | up.hardware())
        return out[v]

    for v in judged:
        settle(v)
    return out


def group_key(rec: dict) -> tuple[str, str]:
    return hardware_key(rec["hardware"]), rec["inputs"]["prompt_set_sha256"][:12]


def by_variant(records: list[tuple[Path, dict]]) -> dict[str, list[dict]]:
    """{variant: its records, newest first} from all_records (oldest first per variant)."""
    out: dict[str, list[dict]] = {}
    for _, r in reversed(records):
        out.setdefault(r["variant"], []).append(r)
    return out


def superseded(root: Path | None = None) -> dict[str, str]:
    """{variant: the variant that replaced it} from the SUPERSEDED_BY keys of the config.env files under root."""
    configs = {v: load_variant(v, root=root, target="cpu").settings for v in list_variants(root)}  # checked
    return {v: c["SUPERSEDED_BY"] for v, c in configs.items() if "SUPERSEDED_BY" in c}


def comparable_groups(records: list[tuple[Path, dict]]) -> tuple[dict[tuple[str, str], dict[str, dict]],
                                                                   list[tuple[str, str, str]]]:
    """({group (hardware, prompt set): {variant: its newest latency record there}}, [(variant, hardware, why) where
    that newest record cannot be compared]). Only records with status ok and fixed-length results compare; replicas
    behind a router are a deployment (make plan), not the variant, and are left out, and so are shortened runs
    (max_tokens capped: make optimize BUDGET=tiny, smoke runs), whose tok/s is not a ladder's."""
    newest: dict[tuple[str, str], dict[str, dict]] = {}
    excluded = []
    for _, r in records:  # oldest first per variant: later ones replace earlier ones
        if r["inputs"].get("max_tokens_cap"):  # a shortened run (make optimize BUDGET=tiny, smoke runs): not a ladder's
            excluded.append((r["variant"], group_key(r)[0], f"max_tokens capped at {r['inputs']['max_tokens_cap']} "
                             f"({r['inputs'].get('num_prompts')} prompts): a shortened run"))
        elif not (r.get("topology") or {}).get("router"):
            newest.setdefault(group_key(r), {})[r["variant"]] = r
    groups: dict[tuple[str, str], dict[str, dict]] = {}
    for g, members in newest.items():
        for v, r in members.items():
            if r["status"] == "ok" and MODE in r["summary"]:
                groups.setdefault(g, {})[v] = r
            else:
                excluded.append((v, g[0], r.get("failure") or f"no {MODE}-mode results"))
    return groups, excluded


def ladder_records(records: list[tuple[Path, dict]]) -> dict[tuple[tuple[str, str], str, str], dict]:
    """{(group, variant, ladder id): its newest comparable record of that ladder}: a variant's ratio is read against its
    parent's and reference's records of the variant's own ladder where they were measured in it (one machine, one
    run), since a newer reference record may come from another machine of the same kind."""
    return {(group_key(r), r["variant"], r["inputs"]["ladder_id"]): r for _, r in records if in_a_ladder(r)}


def in_a_ladder(r: dict) -> bool:
    """A record a ladder's ratios read: of a ladder, ok, fixed-length, not shortened, not replicas behind a router."""
    return bool(r["inputs"].get("ladder_id")) and r["status"] == "ok" and MODE in r["summary"] \
        and not r["inputs"].get("max_tokens_cap") and not (r.get("topology") or {}).get("router")


def ladder_rounds(records: list[tuple[Path, dict]]) -> dict[tuple[tuple[str, str], str, str], dict[int, dict]]:
    """{(group, variant, ladder id): {round: record}} of the comparable records of every ladder: a record's round is its
    inputs.round, else its place among the variant's records of that ladder (oldest first); a round measured twice
    keeps its newest record."""
    out: dict[tuple[tuple[str, str], str, str], dict[int, dict]] = {}
    for _, r in records:  # oldest first per variant
        if in_a_ladder(r):
            rounds = out.setdefault((group_key(r), r["variant"], r["inputs"]["ladder_id"]), {})
            rounds[r["inputs"].get("round") or len(rounds) + 1] = r
    return out


def speed_interval(rec: dict, ref: dict | None, level: str, rounds: dict, metric=None) -> SpeedRatio | None:
    """`rec`'s output tok/s (or another speed: metric(record, level), higher is faster) over `ref`'s at one level:
    paired round by round where both ran in rec's ladder, else the one pair of these two records (one round: no
    interval)."""
    metric = metric or throughput
    if ref is None:
        return None
    ladder = rec["inputs"].get("ladder_id")
    mine = rounds.get((group_key(rec), rec["variant"], ladder), {})
    theirs = rounds.get((group_key(ref), ref["variant"], ladder), {}) if ref["inputs"].get("ladder_id") == ladder else {}
    shared = sorted(set(mine) & set(theirs))
    if len(shared) > 1:
        return speed_ratio([(metric(mine[k], level), metric(theirs[k], level)) for k in shared])
    return speed_ratio([(metric(rec, level), metric(ref, level))])


def faster(row: dict, level: str) -> bool:
    """The row's interval against its BF16 reference lies above 1.00 at this level (more than one round)."""
    sr = row.get("vs_base_ci", {}).get(level)
    return bool(sr and sr.faster)


def by_speed(rows, level: str) -> list[dict]:
    """Rows fastest first by their ratio to BF16 at this level (ties by name: a deterministic table)."""
    return sorted(rows, key=lambda r: (-r["vs_base"][level], r["variant"]))


def ci_text(row: dict, level: str) -> str:
    sr = row.get("vs_base_ci", {}).get(level)
    return sr.text() if sr else "—"


def reference_record(name: str | None, group, ladder: str | None, members: dict[str, dict],
                     in_ladder: dict) -> dict | None:
    """The record of `name` (a parent or reference) in the given ladder where it was measured there, else its newest."""
    if not name:
        return None
    return in_ladder.get((group, name, ladder)) or members.get(name)


def engine_label(rec: dict | None) -> str:
    """The engine a record was served by, with its version (records from before engines were named: vLLM)."""
    engine = (rec or {}).get("engine") or {"name": "vllm", "version": None}
    name = ENGINES[engine["name"]].label if engine["name"] in ENGINES else engine["name"]
    return f"{name} {engine['version']}" if engine.get("version") else name


@functools.cache
def configured_parent(name: str) -> str | None:
    """PARENT as the variant's config.env names it (None for an unknown variant)."""
    try:
        return load_variant(name, target="cpu").settings.get("PARENT")
    except VariantError:
        return None


def baseline_of(variant: str, members: dict[str, dict]) -> str | None:
    """The BF16 root of the variant's PARENT chain within this comparable group (its reference variant); a link of
    the chain not measured in the group (a llama-server rung's llama-cpp-python parent, say) is passed through by its
    config.env."""
    seen, current = {variant}, members[variant]["config"].get("PARENT")
    root = None
    while current and current not in seen:
        seen.add(current)
        if current in members:
            root = current
            current = members[current]["config"].get("PARENT")
        else:
            current = configured_parent(current)
    return root


def ladder_baseline(variant: str, group, ladder: str | None, members: dict[str, dict], in_ladder: dict,
                    configs: dict[str, dict[str, str]]) -> str | None:
    """The BF16 reference a variant's ratios read: its root `base` (baseline_of) where it was measured in the variant's
    ladder (or the variant is of no ladder), else the nearest link of its PARENT chain that serves the unchanged BF16
    weights and was measured there (another engine's BF16 server, say), so that a later lease's record of `base` never
    replaces a reference of the variant's own ladder (of several, the one nearest `base`); else `base` (its newest
    record: separate runs)."""
    base = baseline_of(variant, members)
    if not ladder or base is None or (group, base, ladder) in in_ladder:
        return base
    seen, current, found = {variant}, members[variant]["config"].get("PARENT"), None
    while current and current not in seen and current != base:  # the match nearest `base` wins
        seen.add(current)
        if (group, current, ladder) in in_ladder and bf16_server(current, configs):
            found = current
        current = members[current]["config"].get("PARENT") if current in members else configured_parent(current)
    return found or base


def level_of(rec: dict | None, level) -> dict:
    """A record's fixed-length summary at one concurrency ({} where it was not measured)."""
    return ((rec or {}).get("summary", {}).get(MODE, {}).get(str(level))) or {}


def throughput(rec: dict | None, level) -> float | None:
    """Output tok/s of a record at one concurrency (None where it was not measured)."""
    return level_of(rec, level).get("output_throughput")


def step_rate(rec: dict | None, level) -> float | None:
    """Decode steps a second of one request at one concurrency, 1000 / TPOT p50 in ms (None where not measured): a
    ratio of two is the inverse ratio of their TPOTs, the step's speed without the prefill that output tok/s holds."""
    tpot = level_of(rec, level).get("p50_tpot_ms")
    return 1000.0 / tpot if tpot else None


def speedups(rec: dict, ref: dict | None) -> dict[str, float | None]:
    if ref is None:
        return {}
    return {c: ratio(throughput(rec, c), throughput(ref, c)) for c in rec["summary"].get(MODE, {})}


def roofline_pct(rec: dict, level) -> float | None:
    """The step's roofline time as a % of its TPOT p50 (100 %: every step as fast as its bytes at the copy bandwidth
    measured in the same run); None where the record has no bandwidth measurement (never an assumed one)."""
    lv = level_of(rec, level).get("roofline") or {}
    x = lv.get("tpot_over_roofline")
    return 100 / x if x else None


# The levers that leave a model's BF16 weights as they are: the reference itself, another engine serving it, and a GGUF
# export of unquantized weights. Every other lever (quantization, pruning, speculation, adapters, serving settings
# such as an FP8 KV cache or FP32) makes a variant, not a BF16 server.
BF16_SERVER_LEVERS = ("base", "engine")
UNQUANTIZED_GGUF = ("BF16", "F16", "F32")


def bf16_server(variant: str, configs: dict[str, dict[str, str]]) -> bool:
    """Whether `variant` serves its base's unchanged BF16 weights: its PARENT chain down to the reference holds only
    BF16_SERVER_LEVERS and unquantized GGUF exports (a config missing from `configs` answers no)."""
    seen: set[str] = set()
    while variant:
        config = configs.get(variant)
        if config is None or variant in seen:
            return False
        seen.add(variant)
        lever = lever_of(config)
        if lever == "gguf" and config.get("GGUF_TYPE", "").upper() not in UNQUANTIZED_GGUF:
            return False
        if lever not in (*BF16_SERVER_LEVERS, "gguf"):
            return False
        variant = config.get("PARENT", "")
    return True


def fastest_bf16_servers(rows: list[dict], judged: dict[str, Judged],
                         configs: dict[str, dict[str, str]]) -> dict[str, dict]:
    """Per level, the fastest BF16 server among `rows` (one model's, on one machine and prompt set) that is deployable:
    the reference, or a BF16 server whose gate certifies it."""
    servers = [r for r in rows if bf16_server(r["variant"], configs)
               and (judged[r["variant"]].verdict == "reference" or judged[r["variant"]].certified)]
    best = {}
    for level in LEVELS:
        timed = [r for r in servers if r["tput"].get(level)]
        if timed:
            best[level] = max(timed, key=lambda r: (r["tput"][level], r["variant"]))
    return best


def vs_fastest_bf16(row: dict, level: str) -> float | None:
    """The row's throughput at `level` ÷ that of the fastest BF16 server of its machine (build_report sets it)."""
    server = row.get("bf16_server", {}).get(level)
    return ratio(row["tput"].get(level), server["tput"][level]) if server else None


def winner_lines(group_rows: list[dict], judged: dict[str, Judged], undecided: bool = True) -> list[str]:
    """The fastest certified variant at each level with its evidence, or why none is certified (and, with
    `undecided`, the variants not yet decided with what would decide them)."""
    lines = []
    for level in LEVELS:
        ranked = sorted((r for r in group_rows if r["vs_base"].get(level) is not None),
                        key=lambda r: -r["vs_base"][level])
        certified = next((r for r in ranked if judged[r["variant"]].certified), None)
        best = next((r for r in ranked if judged[r["variant"]].certified and faster(r, level)), None)
        if certified and best is None:
            sr = certified["vs_base_ci"].get(level)
            why = ("" if sr is None or sr.ratio <= 1.0 else
                   ": one round, no interval (`make eval-latency-ladder ROUNDS=2` measures one)" if sr.lo is None else
                   ": a tie, its 95% interval holds 1.00")
            lines.append(f"**Fastest at certified parity, c={level}: the BF16 reference** — no certified variant is "
                         f"faster with 95% confidence (the fastest certified, {certified['variant']}, runs at "
                         f"{ci_text(certified, level)}× {certified['base']}{why})")
        elif best is None:
            lines.append(f"**Fastest at certified parity, c={level}: none certified** "
                         f"({len(ranked)} variant(s) with a BF16 reference measured here; why, fastest first:)")
            for r in ranked:
                j = judged[r["variant"]]
                why = j.note or "; ".join(f"{c.status} {c.name}" for c in j.blocking())
                lines.append(f"- {r['variant']} ({r['vs_base'][level]:.2f}×): {why}")
        else:
            server = best.get("bf16_server", {}).get(level)
            beside = (f"; {vs_fastest_bf16(best, level):.2f}× the fastest BF16 server here, {server['variant']} "
                      f"({server['engine']}, {server['tput'][level]:.1f} tok/s)"
                      if server and server["variant"] != best["base"] else "")
            lines.append(f"**Fastest at certified parity, c={level}: {best['variant']}** — "
                         f"{ci_text(best, level)}× {best['base']} ({best['tput'][level]:.1f} vs "
                         f"{best['base_tput'][level]:.1f} output tok/s, back-to-back: {best['b2b']}){beside}. Evidence:")
            lines += [f"- {c.line()}" for c in judged[best["variant"]].criteria]
        lines.append("")
    pending = [r for r in group_rows if judged[r["variant"]].verdict in ("inconclusive", "missing")] if undecided else []
    if pending:
        lines += ["Not yet decided (never counted as a pass), and what would decide them:", ""]
        for r in pending:
            for c in judged[r["variant"]].blocking():
                lines.append(f"- {r['variant']}: {c.status} {c.name}"
                             + (f" = {c.value:.4g} [{c.lo:.4g}, {c.hi:.4g}]" if c.lo is not None else "")
                             + f" — {c.decide or c.detail}")
        lines.append("")
    return lines


README_BEGIN = "<!-- winners:begin (generated by make compare; do not edit) -->"
README_END = "<!-- winners:end -->"


EVIDENCE_LABELS = {"GATE_MAX_MEAN_KLD": "KLD", "GATE_MIN_TOP1": "top-1", "GATE_MAX_PPL_RATIO": "PPL ratio",
                   SUITE_KEY: "BIG-bench Lite drop (points)", "GATE_MAX_TASK_DROP": "task drop (points)"}


def evidence(j: Judged) -> str:
    """A certified variant's gate in one phrase: each criterion's one-sided 95% bound and its limit; greedy identity
    as its count of sequences."""
    parts = []
    for c in j.criteria:
        if c.name == IDENTITY_KEY:
            parts.append(f"greedy identity: {c.detail}")
            continue
        bound = c.hi if c.kind == "max" else c.lo
        label = EVIDENCE_LABELS.get(c.name.split("[")[0], c.name.removeprefix("GATE_").lower())
        parts.append(f"{label} {fmt(c.value if bound is None else bound, '.3g')} (limit {c.limit:g})")
    return "; ".join(parts) or j.verdict


def winners_table(rows: list[dict], judged: dict[str, Judged], configs: dict[str, dict[str, str]]) -> list[str]:
    """The README's table: per hardware (and prompt set where a machine has several) and concurrency, the fastest
    certified variant across engines against its BF16 reference of the same group, or the reference itself when no
    certified variant is faster. Deterministic (no dates), so a test can tell when the README is stale."""
    by_group: dict[tuple[str, str], list[dict]] = {}
    for r in rows:
        if r["base"]:
            by_group.setdefault(r["group"], []).append(r)
    lines = ["| hardware | prompts | at | fastest certified | lever | engine | × BF16 c=1 [95%] | × BF16 c=8 [95%] | "
             "× fastest BF16 server c=1 / c=8 | evidence (one-sided 95% bound, limit) |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    verdicts = judged
    for (hw, _), group in sorted(by_group.items()):
        judged = on(verdicts, group[0].get("device", "cpu"))
        where = f"{hw.replace('(R)', '').replace(' Processor', '')} | {group[0]['prompt_set']}"
        picks: dict[str, list[str]] = {}
        for level in LEVELS:
            ranked = by_speed((r for r in group if faster(r, level) and judged[r["variant"]].certified), level)
            picks.setdefault(ranked[0]["variant"] if ranked else "", []).append(f"c={level}")
        for variant, levels in picks.items():
            at = ", ".join(levels)
            if not variant:
                lines.append(f"| {where} | {at} | the BF16 reference | — | — | 1.00 | 1.00 | — | no certified variant "
                             f"is faster with 95% confidence{unproven(group, judged, levels)} |")
                continue
            r = next(x for x in group if x["variant"] == variant)
            servers = r.get("bf16_server", {})
            beside = " / ".join(f"{fmt(vs_fastest_bf16(r, c))} ({servers[c]['variant']})" if c in servers else "—"
                                for c in LEVELS)
            lines.append(f"| {where} | {at} | {variant} | {lever_of(configs.get(variant, {}))} | {r['engine']} | "
                         + " | ".join(ci_text(r, c) for c in LEVELS)
                         + f" | {beside} | {evidence(judged[variant])} |")
    return lines


def unproven(group: list[dict], judged: dict[str, Judged], levels: list[str]) -> str:
    """Why the fastest certified variant above 1.00 at these levels is not named: one round, or a tie; or that every
    variant of the group is a shape proxy (random weights: nothing can be certified). Where shape proxies were laddered,
    the fastest of them by speed alone (its interval above 1.00) follows, named as such."""
    speed = proxy_speed(group, levels)
    if group and all(r.get("shape_proxy") for r in group):
        return f" (shape proxies only: random weights, speed only, nothing can be certified{speed})"
    for at in levels:
        level = at.removeprefix("c=")
        above = by_speed((r for r in group if (r["vs_base"].get(level) or 0) > 1.0
                          and judged[r["variant"]].certified), level)
        if above:
            r = above[0]
            sr = r["vs_base_ci"].get(level)
            return (f" (fastest certified above 1.00 at {at}: {r['variant']}, {ci_text(r, level)}, "
                    + ("one round: no interval" if sr is None or sr.lo is None else "a tie") + f"{speed})")
    return f" ({speed.removeprefix('; ')})" if speed else ""


def proxy_speed(group: list[dict], levels: list[str]) -> str:
    """'; shape proxy, speed only: <variant> <ratio [interval]> at c=…' for the fastest shape-proxy variant whose
    interval over its BF16 reference lies above 1.00 at the first such level, else ''."""
    for at in levels:
        level = at.removeprefix("c=")
        ranked = by_speed((r for r in group if r.get("shape_proxy") and faster(r, level)), level)
        if ranked:
            return f"; shape proxy, speed only: {ranked[0]['variant']} {ci_text(ranked[0], level)} at {at}"
    return ""


def write_readme_table(readme: Path, table: list[str]) -> bool:
    """Put the table between the README's markers (written whole or not at all); True when the README changed.
    ValueError, one line, when the README lacks the markers."""
    text = readme.read_text()
    if README_BEGIN not in text or README_END not in text:
        raise ValueError(f"{paths.shown(readme)} has no {README_BEGIN} … {README_END} markers")
    head, rest = text.split(README_BEGIN, 1)
    _, tail = rest.split(README_END, 1)
    new = head + README_BEGIN + "\n" + "\n".join(table) + "\n" + README_END + tail
    if new == text:
        return False
    tmp = readme.with_suffix(".md.tmp")
    tmp.write_text(new)
    tmp.replace(readme)
    return True


def newest_configs(records: list[tuple[Path, dict]]) -> dict[str, dict[str, str]]:
    """Each variant's config.env as its newest record holds it (records run oldest first)."""
    return {r["variant"]: r["config"] for _, r in records}


def build_report(records: list[tuple[Path, dict]], judged: dict[str, Judged],
                 leave_out: dict[str, str] | None = None) -> tuple[str, list[dict]]:
    """The speed tables. `leave_out` ({variant: its successor}, the superseded): no row of their own, still a parent's or
    BF16's speed for the rows that name them."""
    leave_out = leave_out or {}
    configs = newest_configs(records)
    groups, not_comparable = comparable_groups(records)
    in_ladder = ladder_records(records)
    rounds = ladder_rounds(records)
    excluded = [(f"{v} ({hw})", why) for v, hw, why in not_comparable if v not in leave_out]
    lines = [f"# Variant comparison ({now_utc():%Y-%m-%d})", "",
             f"Newest latency record per variant, its ratios against its parent's and reference's records of the same "
             f"ladder where they were measured in it; mode `{MODE}` (every request generates exactly its max_tokens).",
             "Speedup = output tokens/s of the variant ÷ that of the reference, per concurrency; × BF16 over several",
             "rounds of one ladder: the geometric mean of the per-round ratios [its 95% interval]; one round has no",
             "interval, and only a lower end above 1.00 names a variant faster. TPOT × BF16 (GPU tables) = BF16's TPOT",
             "p50 ÷ the variant's, paired and bounded the same way: the decode step's speed, without the prefill that",
             "output tokens/s also holds. Gate = the parity",
             "gate's verdict from the variant's quality records made on the table's kind of machine, a GPU or a CPU",
             "(`make gate VARIANT=…`: one-sided 95% bounds; only",
             "`pass` is certified, `inconclusive` and `missing` never count as a pass). % of roofline (GPU tables) =",
             "the time a decode step's bytes take at the copy bandwidth measured in the same run ÷ TPOT p50; — where",
             "the record has no bandwidth measurement.", ""]
    rows = []
    for (hw, prompts), members in sorted(groups.items()):
        levels = sorted({int(c) for r in members.values() for c in r["summary"][MODE]})
        gpu = any(r["hardware"].get("gpu") for r in members.values())
        device = "gpu" if gpu else "cpu"
        verdicts = on(judged, device)
        roof = LEVELS if gpu else ()  # GPU tables: TPOT against the bytes-over-bandwidth bound of the same run
        lines += [f"## {hw} — prompt set {prompts}", "",
                  "| variant | engine | parent | weights MiB | KV tokens | " + " | ".join(f"tok/s c={c}" for c in levels)
                  + " | " + " | ".join(f"× parent c={c}" for c in levels)
                  + " | " + " | ".join(f"× BF16 c={c}" for c in LEVELS)
                  + "".join(f" | TPOT × BF16 c={c}" for c in roof)
                  + "".join(f" | % of roofline c={c}" for c in roof) + " | back-to-back | gate |",
                  "|" + " --- |" * (5 + 2 * len(levels) + len(LEVELS) + 2 * len(roof) + 2)]
        group_rows = []
        # vLLM's variants first, then each peer engine's in their own rows
        for v, r in sorted(members.items(), key=lambda kv: (not engine_label(kv[1]).startswith("vLLM"),
                                                          engine_label(kv[1]), kv[0])):
            if v in leave_out:
                continue
            parent = r["config"].get("PARENT")
            ladder = r["inputs"].get("ladder_id")
            base = ladder_baseline(v, (hw, prompts), ladder, members, in_ladder, configs)
            pref, bref = (reference_record(x, (hw, prompts), ladder, members, in_ladder) for x in (parent, base))
            vs_parent, vs_base = speedups(r, pref), speedups(r, bref)
            vs_parent = {**vs_parent, **{c: sr.ratio for c in vs_parent if (sr := speed_interval(r, pref, c, rounds))}}
            vs_base_ci = {c: speed_interval(r, bref, c, rounds) for c in LEVELS}
            vs_base_step = {c: speed_interval(r, bref, c, rounds, step_rate) for c in roof}
            vs_base = {**vs_base, **{c: sr.ratio for c, sr in vs_base_ci.items() if sr}}
            refs = [x for x in (pref, bref) if x]
            b2b = "yes" if refs and ladder and all(x["inputs"].get("ladder_id") == ladder for x in refs) else (
                "—" if not refs else "no (separate runs)")
            tput = [throughput(r, c) for c in levels]
            wb = (r.get("model") or {}).get("weight_bytes")
            kv = r.get("server_metrics", {}).get("kv_cache_tokens")
            lines.append(f"| {v}{' (shape proxy)' if r.get('shape_proxy') else ''} | {engine_label(r)} | {parent or '—'} | "
                         f"{fmt(wb / 2**20 if wb else None, '.0f')} | {kv or '—'} | "
                         + " | ".join(fmt(t, '.1f') for t in tput) + " | "
                         + " | ".join(fmt(vs_parent.get(str(c))) for c in levels) + " | "
                         + " | ".join(vs_base_ci[c].text() if vs_base_ci.get(c) else "—" for c in LEVELS)
                         + "".join(f" | {vs_base_step[c].text() if vs_base_step[c] else '—'}" for c in roof)
                         + "".join(f" | {fmt(roofline_pct(r, c), '.0f')}" for c in roof)
                         + f" | {b2b} | {verdicts[v].short(hw)} |")
            row = {"group": (hw, prompts), "device": device, "prompt_set": r["inputs"].get("prompt_set", prompts),
                   "variant": v, "engine": engine_label(r), "levels": levels, "throughput": tput, "vs_base": vs_base,
                   "vs_base_ci": vs_base_ci, "shape_proxy": bool(r.get("shape_proxy")),
                   "base": base, "b2b": b2b, "ladder": ladder,
                   "tput": {c: throughput(r, c) for c in LEVELS}, "base_tput": {c: throughput(bref, c) for c in LEVELS}}
            rows.append(row)
            if base:
                group_rows.append(row)
        by_reference: dict[str, list[dict]] = {}  # one model's rows: its BF16 reference and the variants measured against it
        for r in rows:
            if r["group"] == (hw, prompts):
                by_reference.setdefault(r["base"] or r["variant"], []).append(r)
        for same_model in by_reference.values():
            for r in same_model:  # each BF16 server at its record of this row's ladder where it has one
                local = [x if not (rec := in_ladder.get(((hw, prompts), x["variant"], r["ladder"]))) else
                         {**x, "tput": {c: throughput(rec, c) for c in LEVELS}} for x in same_model]
                r["bf16_server"] = fastest_bf16_servers(local, verdicts, configs)
        engines = sorted({r["engine"] for r in group_rows}, key=lambda e: (not e.startswith("vLLM"), e))
        for engine in engines:  # one verdict per engine: a peer never takes the vLLM variants' place, nor they its
            lines += [""] + ([f"### {engine}", ""] if len(engines) > 1 else [])
            lines += winner_lines([r for r in group_rows if r["engine"] == engine], verdicts)
        if len(engines) > 1:  # and one for the machine: whichever engine serves it, each against the same BF16 reference
            lines += ["### Across engines (each × the same BF16 reference)", ""]
            lines += winner_lines(group_rows, verdicts, undecided=False)
    if excluded:
        lines += ["## Not comparable", ""] + [f"- {v}: {why}" for v, why in excluded] + [""]
    if leave_out:
        lines += [f"{len(leave_out)} superseded variant(s) left out of these tables (SUPERSEDED_BY in their config.env; "
                  f"`make list` shows them): " + ", ".join(f"{v} (by {by})" for v, by in sorted(leave_out.items())), ""]
    return "\n".join(lines), rows


def suite_lines(quality: list[tuple[Path, dict]], judged: dict[str, Judged]) -> list[str]:
    """The suite-of-record section: pooled score and paired drop per variant, then per-task scores, per hardware."""
    newest: dict[str, dict[str, dict]] = {}  # hardware -> variant -> newest suite record
    for _, r in quality:
        if r.get("status") == "ok" and "suite" in r["inputs"] and r.get("samples"):
            newest.setdefault(hardware_key(r["hardware"]), {})[r["variant"]] = r
    lines = []
    verdicts = judged
    for hw, members in sorted(newest.items()):
        any_rec = next(iter(members.values()))
        judged = on(verdicts, device_of(any_rec))
        suite = any_rec["inputs"]["suite"]
        lines += [f"## Quality: {suite['name']} — {hw}", "",
                  f"BIG-bench Lite, zero-shot in BIG-bench's own prompt format, {suite['items']} items drawn from "
                  f"{suite['sdist']} (sdist SHA-256 {suite['sdist_sha256'][:12]}…, suite {suite['sha256'][:12]}…); "
                  "multiple choice by log-likelihood (`multiple_choice_grade`), generative by `exact_str_match`. "
                  "Drop = the reference's pooled score minus the variant's, paired item by item, in points, with its "
                  "one-sided 95% bounds (`make gate`).", "",
                  "| variant | engine | reference | items | pooled score % | drop [bounds] | suite criterion | gate |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- |"]
        for v, r in sorted(members.items()):
            items = scored(r)
            crit = next((c for c in judged.get(v, Judged("—")).criteria if c.name.startswith(SUITE_KEY)), None)
            drop = "—" if crit is None or crit.value is None else (
                f"{crit.value:+.2f}" + ("" if crit.lo is None else f" [{crit.lo:+.2f}, {crit.hi:+.2f}]"))
            ref = reference_name(r["config"]) or "—"
            lines.append(f"| {v} | {engine_label(r)} | {ref} | {len(items)} | "
                         f"{100 * sum(items.values()) / len(items):.2f} | {drop} | {crit.status if crit else '—'} | "
                         f"{judged[v].short(hw) if v in judged else '—'} |")
        refs = sorted(v for v, r in members.items() if not reference_name(r["config"]))
        for ref in refs:
            children = sorted(v for v, r in members.items() if reference_name(r["config"]) == ref)
            if not children:
                continue
            tasks = members[ref]["inputs"]["tasks"]
            lines += ["", f"Per task: {ref}'s score (%) and each variant's drop in points (paired items):", "",
                      f"| task | items | {ref} | " + " | ".join(children) + " |",
                      "| --- | --- | --- |" + " --- |" * len(children)]
            for task in tasks:
                base = scored(members[ref], task)
                cells = []
                for v in children:
                    mine = scored(members[v], task)
                    shared = set(base) & set(mine)
                    cells.append("—" if not shared else
                                 f"{100 * sum(base[i] - mine[i] for i in shared) / len(shared):+.1f}")
                lines.append(f"| {task} | {len(base)} | {100 * sum(base.values()) / max(len(base), 1):.1f} | "
                             + " | ".join(cells) + " |")
        lines.append("")
    return lines


def pareto_front(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Points no other point beats on both axes (higher speed, lower KLD), sorted by speed."""
    return sorted(p for p in points if not any(q != p and q[0] >= p[0] and q[1] <= p[1] for q in points))


def plot_throughput(rows: list[dict], out: Path) -> None:
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


def plot_pareto(rows: list[dict], judged: dict[str, Judged], out: Path) -> bool:
    """Speed over BF16 vs mean KLD per hardware group (rows) and concurrency (columns). False if nothing to draw."""
    import matplotlib.pyplot as plt

    def of(r: dict) -> Judged:
        return on(judged, r.get("device", "cpu"))[r["variant"]]

    usable = [r for r in rows if of(r).kld and r["vs_base"]]
    groups = sorted({r["group"] for r in usable})
    if not groups:
        return False
    fig, axes = plt.subplots(len(groups), len(LEVELS), figsize=(6 * len(LEVELS), 4.5 * len(groups)), squeeze=False)
    for gi, g in enumerate(groups):
        for li, level in enumerate(LEVELS):
            ax = axes[gi, li]
            pts = [(r["vs_base"][level], of(r).kld, of(r).verdict, r["variant"]) for r in usable
                   if r["group"] == g and r["vs_base"].get(level)]
            if not pts:
                ax.set_title(f"{g[0][:48]} — c={level}: not measured")
                ax.axis("off")
                continue
            for x, y, mark, v in pts:
                marker, color = MARKERS.get(mark, ("^", "black"))
                ax.scatter(x, y, marker=marker, color=color, s=50,
                           label=mark if mark not in ax.get_legend_handles_labels()[1] else None)
                ax.annotate(v, (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points")
            front = pareto_front([(x, y) for x, y, _, _ in pts])
            if front:
                ax.plot([p[0] for p in front], [p[1] for p in front], "--o", mfc="none", ms=12, color="tab:blue", alpha=0.5,
                        label="frontier")
            ax.axvline(1.0, color="gray", lw=0.8, ls="--")
            ax.set_yscale("log")
            ax.set(title=f"{g[0][:48]} — c={level}", xlabel="output tok/s × BF16",
                   ylabel="mean KL divergence vs reference (nats, log)")
            ax.grid(alpha=0.3, which="both")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return True


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--experiments", type=Path, default=paths.EXPERIMENTS)
    p.add_argument("--out-dir", type=Path, default=paths.RESULTS)
    p.add_argument("--readme", type=Path, default=paths.ROOT / "README.md",
                   help="the README whose winners table (between its markers) is rewritten; --readme '' leaves it")
    p.add_argument("--check-readme", action="store_true",
                   help="write nothing; exit 1 when the README's winners table differs from the records'")
    return p


def judge_all(records: list[tuple[Path, dict]], experiments: Path,
              quality: dict[str, list[dict]] | None = None) -> tuple[PerDevice, dict[str, dict]]:
    """Every variant with a latency record judged by its gate (chained up to BF16) once on the CPUs' quality records
    and once on the GPUs', and its newest config (`quality`: every variant's quality records, newest first, when the
    caller has read them: by_variant)."""
    configs = newest_configs(records)
    if quality is None:
        quality = by_variant(all_records("quality", experiments))
    soaked = {r["variant"]: r["status"] == "ok" for _, r in all_records("soak", experiments)}  # the newest wins
    out = PerDevice()
    for device in DEVICES:
        mine = RecordsOn(device, experiments, quality)
        judged = chain({v: judge(v, config, experiments, mine) for v, config in configs.items()}, configs)
        out[device] = deployable(judged, configs, soaked)
    return out, configs


def deployable(judged: dict[str, Judged], configs: dict[str, dict[str, str]],
               soaked: dict[str, bool]) -> dict[str, Judged]:
    """A variant served by llama-cpp-python's server (ENGINE=llamacpp: one request at a time; it failed the soak) is
    not named a winner unless its newest soak passed. Its file's quality stays certified for the variants that take
    it as their reference (the llama-server rung of the same file): applied after chain(), to the variant alone."""
    out = dict(judged)
    for v, j in judged.items():
        if j.certified and configs.get(v, {}).get("ENGINE") == "llamacpp" and not soaked.get(v):
            why = "a failed soak" if v in soaked else "no soak record"
            out[v] = Judged("missing", j.criteria, note=f"its gate passes; llama-cpp-python's server has {why} "
                                                        f"(make soak VARIANT={v}): not offered as a deployable winner")
    return out


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    records = all_records("latency", args.experiments)
    if not records:
        print(f"error: no latency records under {args.experiments}; run `make eval-latency` first", file=sys.stderr)
        return 1
    try:
        gone = superseded(args.experiments)
    except VariantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    quality = all_records("quality", args.experiments)
    per_variant = by_variant(quality)
    judged, configs = judge_all(records, args.experiments, per_variant)
    text, rows = build_report(records, judged, gone)
    table = winners_table(rows, judged, configs)
    readme = args.readme if str(args.readme) not in ("", ".") else None
    if args.check_readme:
        if readme is None:
            print("error: --check-readme needs --readme", file=sys.stderr)
            return 2
        current = readme.read_text().split(README_BEGIN, 1)[-1].split(README_END, 1)[0].strip("\n").splitlines()
        if current != table:
            print(f"{paths.shown(readme)}: the winners table is stale: run `make compare`", file=sys.stderr)
            return 1
        print(f"{paths.shown(readme)}: the winners table matches the records")
        return 0
    quality = [(p, r) for p, r in quality if r["variant"] not in gone]
    suite_judged = PerDevice({d: {} for d in DEVICES})  # the suite's own rows: variants with no latency record too
    on_device = {d: RecordsOn(d, args.experiments, per_variant) for d in DEVICES}
    for _, r in quality:
        if "suite" in r.get("inputs", {}):
            d, v = device_of(r), r["variant"]
            suite_judged[d][v] = judged[d].get(v) or judge(v, r["config"], args.experiments, on_device[d])
    text += "\n" + "\n".join(suite_lines(quality, suite_judged))
    import matplotlib

    matplotlib.use("Agg")
    args.out_dir.mkdir(parents=True, exist_ok=True)
    stem = args.out_dir / f"compare_{now_utc():%Y%m%d}"
    written = [stem.with_suffix(".md")]
    if rows:
        plot_throughput(rows, stem.with_suffix(".png"))
        written.append(stem.with_suffix(".png"))
        pareto = stem.with_name(stem.name + "_pareto.png")
        if plot_pareto(rows, judged, pareto):
            written.append(pareto)
    stem.with_suffix(".md").write_text(text + "\n")
    if readme is not None:
        try:
            if write_readme_table(readme, table):
                written.append(readme)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    print(text)
    print("wrote " + ", ".join(paths.shown(p) for p in written))
    return 0


if __name__ == "__main__":
    sys.exit(main())
