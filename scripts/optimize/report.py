"""make optimize's report: results/optimize_<base>_<YYYYMMDD-HHMMSS>.md and .png.

The certified winner per concurrency (and under SLO_TPOT_MS when given) with its evidence and its ratio to the BF16
reference and to the fastest BF16 server of the ladder, every candidate with its verdict and the criterion that
decided it, the levers left out of the plan and why, the wall time per phase, every record, and the commands that
serve the winner and build its image. The plot: speed over BF16 (x) against mean KL divergence (y) per concurrency,
lossless candidates on a row of their own.
"""

from __future__ import annotations

import os
from pathlib import Path

from scripts.common import paths
from scripts.common.metrics import SpeedRatio, fmt
from scripts.common.records import TRIAL_ENV, git_state, now_utc
from scripts.common.variants import SHARED_SET_ENV, load_variant
from scripts.optimize.plan import plan_path
from scripts.optimize.speeds import Speeds, read_record
from scripts.report.compare import MARKERS, bf16_server, engine_label, evidence, pareto_front

# the phase of a step a state written before steps named their own phase holds
PHASE_OF = {"export-gguf": "build", "calibrate": "build", "prune-vocab": "build", "merge-lora": "build",
            "eval-latency": "ladder", "eval-parity": "parity", "eval-identity": "identity", "soak": "reliability",
            "fuzz": "reliability"}


def kept_seconds(steps: dict[str, dict], phases) -> dict[str, float]:
    """Seconds per phase of every step a state holds (a step names its phase; an older state's, by its target)."""
    spent = dict.fromkeys(phases, 0.0)
    for sid, e in steps.items():
        spent[e.get("phase") or PHASE_OF.get(sid.split(":")[0], "suite")] += e.get("seconds") or 0
    return spent


def plot(r, speeds, outcomes, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = r.plan.concurrency
    fig, axes = plt.subplots(1, len(levels), figsize=(6 * len(levels), 4.5), squeeze=False)
    for ax, level in zip(axes[0], levels, strict=True):
        pts = []
        for v, o in outcomes.items():
            x = speeds.point(v, r.plan.reference, level)
            if x is None:
                continue
            kld = o.judged.kld if o.judged else None
            pts.append((x, kld, v, o.status))
        lossy = [p for p in pts if p[1]]
        floor = min((p[1] for p in lossy), default=1e-3) / 10
        for x, y, v, status in pts:
            verdict = {"certified": "pass", "tie": "pass", "rejected": "fail"}.get(status, "inconclusive")
            marker, color = MARKERS[verdict]
            ax.scatter(x, y or floor, marker=marker, color=color, s=50)
            ax.annotate(v.removeprefix(f"{r.plan.base}-") + ("" if y else " (lossless)"), (x, y or floor), fontsize=7,
                        xytext=(4, 3), textcoords="offset points")
        front = pareto_front([(x, y) for x, y, _, s in lossy if s == "certified"])
        if front:
            ax.plot([p[0] for p in front], [p[1] for p in front], "--", color="tab:blue", alpha=0.5)
        ax.axvline(1.0, color="gray", lw=0.8, ls="--")
        ax.axhline(floor * 1.6, color="gray", lw=0.5, ls=":")
        ax.set_yscale("log")
        ax.set_title(f"{r.plan.base}, c={level}: green certified, red rejected, orange undecided", fontsize=9)
        ax.set(xlabel=f"output tok/s × {r.plan.reference} (geometric mean over the rounds)", ylabel="mean KLD vs reference (nats; lossless: bottom row)")
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)


def evidence_line(o) -> str:
    """A candidate's gate in one phrase: the evidence of each criterion (compare's), or what keeps it undecided."""
    if not o.judged or not o.judged.criteria:
        return o.why
    if o.status == "certified":
        return evidence(o.judged)
    return "; ".join(criterion_text(c) for c in o.judged.blocking()) or o.judged.note


def criterion_text(c) -> str:
    value = "" if c.value is None else f" {c.value:.4g}" + (f" [{c.lo:.4g}, {c.hi:.4g}]" if c.lo is not None else "")
    tail = "; ".join(x for x in (c.detail, c.decide) if x)
    return f"{c.name} {c.status}{value} (limit {'≤' if c.kind == 'max' else '≥'} {c.limit:g}){': ' + tail if tail else ''}"


def ratio_cell(speeds: Speeds, variant: str, reference: str, level: int) -> str:
    """'1.61 [1.49, 1.74]' (95% interval over the rounds), '1.25 (1 round)', or — where not measured."""
    if variant == reference:
        return "1.00"
    sr = speeds.versus(variant, reference, level)
    return sr.text() if sr else "—"


def speed_alone_lines(plan, speeds: Speeds) -> list[str]:
    """A shape proxy's report: per level, its fastest candidate whose interval over the reference lies above 1.00."""
    lines = ["", "By speed alone (what a model of these shapes would gain if its quality held, which only real weights "
             "can show):"]
    for lv in plan.concurrency:
        fast = sorted(((sr.ratio, v) for v in (c.variant for c in plan.candidates)
                       if (sr := speeds.versus(v, plan.reference, lv)) and sr.faster), reverse=True)
        lines.append(f"- c={lv}: " + (f"{fast[0][1]}, {ratio_cell(speeds, fast[0][1], plan.reference, lv)} × "
                                      f"{plan.reference}" if fast else "no candidate's interval lies above 1.00"))
    return lines


def serve_line(t: dict, winner: str) -> str:
    """How to serve one topology of the topology rung."""
    if t["variant"] == winner:  # the replicas: the winner itself, one per GPU behind the router
        return f"make serve-replicas VARIANT={winner} REPLICAS={t['gpus']} POLICY=cache_aware"
    return f"make serve VARIANT={t['variant']}"


def topology_lines(topo: dict | None, levels: list[int]) -> list[str]:
    """The topology rung's section: each topology's ratio to one GPU per level, the best per level, how to serve it."""
    if topo is None:
        return []
    lines = [f"## On {topo['gpus']} GPUs: {topo['winner']}'s topologies", ""]
    if topo["ratios"]:
        lines += ["Output tok/s over one GPU's (replica 0 alone, the others idle), paired by round, on the scale "
                  "ladder's prompt set (`make scale`; the records are named in the step below):", "",
                  "| concurrency | topology | GPUs | tok/s | × one GPU [95% interval] | verdict | prefix hit rate (one GPU) |",
                  "| --- | --- | ---: | ---: | ---: | --- | --- |"]
        for x in sorted(topo["ratios"], key=lambda x: (x["level"], x["label"])):
            sr = SpeedRatio.from_json(x["ratio"])
            lines.append(f"| c={x['level']} | {x['label']} | {x.get('gpus') or '—'} | {x['tok_s']:.1f} | {sr.text()} | "
                         f"{sr.verdict} | {fmt(x.get('hit_rate'), '.3f')} ({fmt(x.get('reference_hit_rate'), '.3f')}) |")
        lines += [""]
        for lv in levels:
            b = topo["best"].get(lv)
            lines.append(f"- c={lv}: " + (f"**{b['label']}**, {SpeedRatio.from_json(b['ratio']).text()}"
                                          f" × one GPU: `{serve_line(b, topo['winner'])}`" if b else
                                          "one GPU: no topology's interval lies above 1.00 here"))
        lines += [""]
    elif topo.get("step"):
        lines += [f"The topology ladder failed: {topo['step'].get('error')}", ""]
    lines += [f"- left out: {x['lever']}: {x['why']}" for x in topo["left_out"]]
    return lines + ([""] if topo["left_out"] else [])


def write(r, speeds: Speeds, outcomes: dict, wall_s: float, topo: dict | None = None) -> Path:
    plan = r.plan
    stamp = f"{now_utc():%Y%m%d-%H%M%S}"
    md = paths.RESULTS / f"optimize_{plan.base}{'' if not r.gpu else '-gpu'}_{stamp}.md"  # a GPU's beside a CPU's
    png = md.with_suffix(".png")
    configs = {v: load_variant(v).resolved for v in (plan.reference, *outcomes)}
    for v in list(configs):  # the chain of each, for the BF16-server test
        p = configs[v].get("PARENT")
        while p and p not in configs:
            configs[p] = load_variant(p).resolved
            p = configs[p].get("PARENT")
    servers = [plan.reference] + [v for v, o in outcomes.items() if o.status == "certified" and bf16_server(v, configs)]
    fastest = {lv: max(servers, key=lambda v: speeds.tput(v, lv) or 0) for lv in plan.concurrency}
    ref_rec = read_record(speeds.record(plan.reference))
    rounds = len(speeds.records(plan.reference))
    git = git_state()
    lines = [f"# make optimize {plan.base}: the certified fastest variant on {plan.hardware}", "",
             f"`make optimize BASE={plan.base} BUDGET={plan.budget} CONCURRENCY={','.join(map(str, plan.concurrency))}"
             + (f" SLO_TPOT_MS={plan.slo_tpot_ms:g}" if plan.slo_tpot_ms else "") + (" SUITE=0" if r.no_suite else "")
             + "`, finished "
             f"{now_utc():%Y-%m-%d %H:%M} UTC; git {git['commit'][:12]}{' (dirty)' if git.get('dirty') else ''}; plan "
             f"`{paths.shown(plan_path(plan.base, 'cuda' if r.gpu else 'cpu'))}`; ladder `{r.state.ladder_id}` "
             f"({ref_rec['inputs']['prompt_set']}, {ref_rec['inputs']['num_prompts']} prompts, fixed output length"
             + (f", max_tokens capped at {ref_rec['inputs']['max_tokens_cap']}" if ref_rec['inputs'].get('max_tokens_cap') else "")
             + "). Speed is output tok/s on this machine, one server measured at a time"
             + (f" while the other rungs' servers sat idle beside it (the pool, each vLLM server with "
                f"{os.environ.get(SHARED_SET_ENV) or 'its own settings'})" if r.pool_rungs is not None else "")
             + f", over {rounds} round(s) of the ladder "
             "in alternating order; each ratio is the geometric mean of its per-round ratios with its 95% interval "
             "[lower, upper] (Student's t over the rounds): faster means the lower end is above 1.00, an interval "
             "holding 1.00 is a tie. Verdicts are the parity gate's (one-sided 95% bounds), as `make gate` prints them."
             + (f" A trial: its records carry `trial: {os.environ[TRIAL_ENV]}`, which `make compare` and "
                "`make gate` leave out (scripts/common/records.py)." if os.environ.get(TRIAL_ENV) else ""),
             "", "## The winner", "",
             "| concurrency | certified winner | engine | tok/s | × " + plan.reference + " | × fastest BF16 server | TPOT p50 ms | evidence |",
             "| --- | --- | --- | ---: | ---: | --- | ---: | --- |"]
    winners = {}
    proxy = configs[plan.reference].get("SHAPE_PROXY") == "1"
    for lv in plan.concurrency:
        w = next((v for v, o in outcomes.items() if lv in o.winner_at), None)
        winners[lv] = w or plan.reference
        v = winners[lv]
        rec = read_record(speeds.record(v))
        f = fastest[lv]
        none = (" (a shape proxy: random weights, nothing can be certified; the ladder below is speed only)"
                if proxy else " (no certified candidate is faster)")
        lines.append(f"| c={lv} | {v if w else plan.reference + none} | {engine_label(rec)} | "
                     f"{fmt(speeds.tput(v, lv), '.1f')} | {ratio_cell(speeds, v, plan.reference, lv)} | "
                     f"{ratio_cell(speeds, v, f, lv)} ({f}) | {fmt(speeds.tpot_p50(v, lv), '.1f')} | "
                     f"{evidence_line(outcomes[v]) if w else '; '.join(['the reference', *r.notes.get(v, [])])} |")
    if proxy:
        lines += speed_alone_lines(plan, speeds)
    if plan.slo_tpot_ms:
        lines += ["", f"Under SLO_TPOT_MS={plan.slo_tpot_ms:g} (TPOT p50):"]
        for lv in plan.concurrency:
            ok = [v for v in [plan.reference, *(v for v, o in outcomes.items() if o.status in ("certified", "tie"))]
                  if (speeds.tpot_p50(v, lv) or float("inf")) <= plan.slo_tpot_ms]
            best = max(ok, key=lambda v: speeds.tput(v, lv) or 0, default=None)
            lines.append(f"- c={lv}: " + (f"{best}, {fmt(speeds.tput(best, lv), '.1f')} tok/s at TPOT p50 "
                                          f"{fmt(speeds.tpot_p50(best, lv), '.1f')} ms" if best else
                                          "no certified variant meets it"))
    w1 = winners[plan.concurrency[0]]
    lines += ["", "## Serve it", "", "```bash"] + [f"make serve VARIANT={w}    # the winner at c={','.join(str(lv) for lv in plan.concurrency if winners[lv] == w)}"
                                                   for w in dict.fromkeys(winners.values())] + [
        f"make build VARIANT={w1}    # its serving image (buildah), then make verify-image VARIANT={w1}", "```", "",
        *topology_lines(topo, plan.concurrency),
        "## Every candidate", "",
        "| variant | lever | " + " | ".join(f"c={lv} tok/s | × BF16 [95% interval]" for lv in plan.concurrency)
        + " | verdict | why |",
        "| --- | --- | " + " | ".join("---: | ---:" for _ in plan.concurrency) + " | --- | --- |"]
    levers = {c.variant: c.lever for c in plan.candidates}
    for v in [plan.reference, *(c.variant for c in plan.candidates)]:
        o = outcomes.get(v)
        cells = " | ".join(f"{fmt(speeds.tput(v, lv), '.1f')} | {ratio_cell(speeds, v, plan.reference, lv)}"
                           for lv in plan.concurrency)
        if v == plan.reference:
            verdict, why = "reference", "; ".join(["BF16 weights served by vLLM", *r.notes.get(v, [])])
        elif o is None:
            verdict, why = "failed", "; ".join(r.notes.get(v, ["not measured"]))
        else:
            verdict = o.status + (f" (winner at c={','.join(map(str, o.winner_at))})" if o.winner_at else "")
            why = "; ".join(dict.fromkeys([evidence_line(o) if o.status in ("certified", "not certified") else o.why,
                                           *r.notes.get(v, [])])).replace("|", "/")
        lever = levers.get(v, "the reference") + (f" ({n:.2f} tokens a step)" if (n := speeds.tokens_a_step(v)) else "")
        lines.append(f"| {v} | {lever} | {cells} | {verdict} | {why} |")
    lines += ["", "## Left out of the plan", ""] + [f"- {x['lever']}: {x['why']}" for x in plan.left_out]
    total = sum(r.phase_s.values())
    spent = kept_seconds(r.state.steps, r.phase_s)
    lines += ["", "## Wall time per phase", "", "Steps of this run, and every step the state holds (the runs that made "
              "the reused records; a step that was stopped midway is not counted)", "",
              "| phase | this run, s | all steps kept, s |", "| --- | ---: | ---: |"]
    lines += [f"| {p} | {t:.0f} | {spent[p]:.0f} |" for p, t in r.phase_s.items()] + [
        f"| **total** | **{wall_s:.0f}** ({total:.0f} in steps; {r.ran} steps run, {r.reused} reused) | "
        f"**{sum(spent.values()):.0f}** |", "",
        "## Steps and records", "", "| step | status | seconds | record |", "| --- | --- | ---: | --- |"]
    lines += [f"| `{sid}` | {e['status']}{' (adopted)' if e.get('adopted') else ''} | {e.get('seconds', 0):.0f} | "
              f"{e.get('record') or '—'} |" for sid, e in r.state.steps.items()]
    lines += ["", f"![speed against KL divergence]({png.name})", ""]
    md.parent.mkdir(parents=True, exist_ok=True)
    plot(r, speeds, outcomes, png)
    return paths.write_text_atomic(md, "\n".join(lines))
