"""A PROJECTION, not a measurement: speculative decoding's speedup at a published acceptance, from step costs measured
with random weights.

    python -m scripts.report.mtp_projection --plain qwen35-4b-proxy-bf16 --spec qwen35-4b-proxy-mtp3 \\
        --spec qwen35-4b-proxy-mtp4 --stamp 20261122-02 --stamp 20261122-03 \\
        --tokens-per-step 4=3.4 --tokens-per-step 4=3.75 --source "the reference project's results/RESULTS.md"

Random weights accept no draft, so a speculative rung's TPOT is the cost of one speculative step with its K drafts
(each record's mean acceptance length is checked where the engine reports it, vLLM by its /metrics and SGLang in
its log since 2026-12-07: a rung that accepted drafts is refused; the page says where it went unchecked). For a head that emits tau
tokens a step (1 + its accepted drafts, 1 <= tau <= K + 1):

    cost ratio   r_K = TPOT_K / TPOT_plain     (c=1, TPOT p50, the median over the rounds of each)
    speedup      S   = tau / r_K
    break-even   tau* = r_K                    (a head pays only while it emits more than r_K tokens a step)

It assumes a speculative step costs the same whether its drafts are accepted or not (chain drafts: the verify pass
scores all K either way) and nothing about batching.

--target-gbs GBS adds a second PROJECTION: the speculative 4-bit rung on a weight-bound GPU of GBS (the A10G: 600),
stacked on scripts/report/projection.py's fit from the 27B shape's ladder (its defaults; --fit-args changes them).
Each draft reads the MTP layer and the whole output layer; on the measured GPU (BW its copy bandwidth in the same
records, e the BF16 GEMMs' share of it at M = 1 from the fit's GEMM record):
    fixed        = TPOT_plain - W_plain / (BW x e)              the plain step's cost beyond its weights
    per draft    d_K  = (TPOT_K - TPOT_plain) / K               what each draft adds (its pass and its share of the
                                                                verify pass's extra tokens)
    its bytes    b    = W_draft / (BW x e)                      W_draft: the MTP layer + the output layer (BF16)
    the rest     x_K  = max(d_K - b, 0)                         scaled on the target as the fixed cost is
    on the target, with fixed', TPOT'_bf16 and TPOT'_cand from the fit:
    d'_K         = W_draft / (GBS x e) + x_K x fixed' / fixed
    TPOT'_K      = TPOT'_cand + K x d'_K
    speedup      = TPOT'_bf16 x tau / TPOT'_K                   (and over the 4-bit rung alone: TPOT'_cand x tau / TPOT'_K;
                                                                it pays over that rung above tau* = TPOT'_K / TPOT'_cand)
It assumes the draft's non-byte cost scales with the target's fixed cost (as projection.py scales the fixed cost); a
second column keeps it as measured (x_K in place of x_K x fixed' / fixed: a host-bound cost that a slower GPU does not
shrink). e is the fit's (the BF16 GEMMs' share at M = 1 on the fit's GEMM shape, the 27B's by default), applied to the
plain rung's weights whatever their dtype and shape; the draft's bytes are the MTP layer as the plain rung's checkpoint
stores it plus a BF16 output layer (PRUNE_KEEP rows where pruned; a rung with a draft vocabulary, SGLang's token map,
reads only its rows in its drafts), as the lab's W4A16 rungs leave both. --plain is
meant to be the fit's target shape (the 4B): nothing checks it. The rounds are one ladder (--ladder) or the records whose file
stamp begins with a --stamp (rounds measured before ladder ids), all on one GPU. Writes
results/projection_mtp_<plain>_<time written>.md.
"""

from __future__ import annotations

import argparse
import json
import shlex
import statistics
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.records import all_records, git_state, now_utc, tokens_a_step
from scripts.report.projection import ProjectionError

ACCEPTED_AT_MOST = 1.05  # mean tokens a step above which a rung accepted drafts: not a step-cost measurement


def speculation(variant: str, config: dict) -> tuple[str, int] | None:
    """(engine, K drafts a step) of a speculative rung from its record's config; None for a plain one. A chain of
    drafts only: SGLang's tree drafts (top-k above 1) verify more tokens than K."""
    try:
        if config.get("SGLANG_SPECULATIVE_NUM_STEPS"):
            if int(config.get("SGLANG_SPECULATIVE_EAGLE_TOPK") or 1) != 1:
                raise ProjectionError(f"{variant}: SGLANG_SPECULATIVE_EAGLE_TOPK above 1 drafts a tree, not a chain of K")
            return "SGLang", int(config["SGLANG_SPECULATIVE_NUM_STEPS"])
        k = json.loads(config.get("SERVE_SPECULATIVE_CONFIG") or "{}").get("num_speculative_tokens")
        return ("vLLM", int(k)) if k else None
    except (ValueError, TypeError, AttributeError) as e:
        raise ProjectionError(f"{variant}: its records' speculation settings do not parse ({e})") from None


def step_point(records, variant: str, ladder: str | None, stamps: list[str] | None) -> dict:
    """A rung's c=1 step: the median TPOT p50 over its rounds, the records, its config and the mean tokens a step."""
    rows = [(p, r) for p, r in records if r["variant"] == variant and (
        (r.get("inputs") or {}).get("ladder_id") == ladder if ladder else p.stem.split("_", 1)[1].startswith(tuple(stamps)))]
    rows = [(p, r) for p, r in rows if (r["summary"].get("fixed", {}).get("1") or {}).get("p50_tpot_ms")]
    if not rows:
        where = f"ladder {ladder}" if ladder else "stamps " + ", ".join(f"{s}*" for s in stamps)
        raise ProjectionError(f"no latency record of {variant} at c=1 in {where}")
    lengths = [m for _, r in rows if (m := tokens_a_step(r))]
    roofs = [r.get("roofline") or {} for _, r in rows]
    bws = [bw for x in roofs if (bw := (x.get("bandwidth") or {}).get("bytes_per_s"))]
    skipped = next((w["skipped"] for x in roofs if (w := (x.get("bytes") or {}).get("weights"))), {})
    return {"tpot_ms": statistics.median(r["summary"]["fixed"]["1"]["p50_tpot_ms"] for _, r in rows),
            "records": [paths.shown(p) for p, _ in rows], "config": rows[-1][1].get("config") or {},
            "gpus": {((r.get("hardware") or {}).get("gpu") or {}).get("name") or "a CPU" for _, r in rows},
            "tokens_per_step": max(lengths) if lengths else None,
            # the roofline of the same runs, where the records carry one: weight bytes a step, copy bandwidth, MTP bytes
            "weight_bytes": next((w for _, r in rows if (w := (r["summary"]["fixed"]["1"].get("roofline") or {})
                                                          .get("weight_bytes"))), None),
            "bandwidth": statistics.median(bws) if bws else None,
            "mtp_bytes": next((b for why, b in skipped.items() if why.startswith("MTP head")), None)}


def project_mtp(tpot_plain_ms: float, tpot_spec_ms: float, taus: list[float]) -> dict:
    """The cost ratio, its break-even and the speedup at each tau. Pure: numbers in, numbers out."""
    if tpot_plain_ms <= 0 or tpot_spec_ms <= 0:
        raise ProjectionError(f"a step of {tpot_plain_ms} / {tpot_spec_ms} ms: not a measurement")
    r = tpot_spec_ms / tpot_plain_ms
    return {"cost_ratio": r, "break_even_tokens": r, "speedup": {tau: tau / r for tau in taus}}


def project_target(plain_ms: float, spec_ms: float, k: int, w_plain: float, w_draft: float, bw: float, e: float,
                   fit: dict, target_gbs: float, taus: list[float]) -> dict:
    """The speculative 4-bit rung on the target GPU (the docstring's second formula): bytes in bytes, bw in bytes/s,
    target_gbs in GB/s, times in ms; `fit` is projection.project()'s "target" part. Pure: numbers in, numbers out."""
    fixed = plain_ms - w_plain / (bw * e) * 1e3
    if fixed <= 0:
        raise ProjectionError(f"the plain step ({plain_ms:.3f} ms) is not longer than its weights' time at e {e:.3f}: "
                              f"no fixed cost to scale")
    if k < 1:
        raise ProjectionError(f"K = {k}: a speculative rung drafts at least one token a step")
    per_draft = (spec_ms - plain_ms) / k
    draft_bytes_ms = w_draft / (bw * e) * 1e3
    rest = max(per_draft - draft_bytes_ms, 0.0)
    bytes_target = w_draft / (target_gbs * 1e9 * e) * 1e3
    per_draft_target = bytes_target + rest * fit["fixed_ms"] / fixed
    spec_target = fit["tpot_cand_ms"] + k * per_draft_target
    spec_as_measured = fit["tpot_cand_ms"] + k * (bytes_target + rest)  # the rest not scaled: a host-bound cost
    return {"fixed_ms": fixed, "per_draft_ms": per_draft, "draft_bytes_ms": draft_bytes_ms, "rest_ms": rest,
            "per_draft_target_ms": per_draft_target, "tpot_spec_target_ms": spec_target,
            "tpot_spec_target_rest_as_measured_ms": spec_as_measured,
            "break_even_target": spec_target / fit["tpot_cand_ms"],
            "over_bf16": {tau: fit["tpot_bf16_ms"] * tau / spec_target for tau in taus},
            "over_bf16_rest_as_measured": {tau: fit["tpot_bf16_ms"] * tau / spec_as_measured for tau in taus},
            "over_cand": {tau: fit["tpot_cand_ms"] * tau / spec_target for tau in taus}}


def output_layer_shape(variant: str, config: dict) -> tuple[int, int]:
    """(rows, hidden) of the BF16 output layer of a shape-proxy or config-only rung, from its SOURCE's config
    (scripts/weights/shape_proxy.py); a lever-built rung's from its PARENT's; PRUNE_KEEP rows where pruned."""
    from scripts.common.variants import VariantError, load_variant
    from scripts.weights.shape_proxy import CONFIGS

    source, parent = config.get("SOURCE") or "", config.get("PARENT")
    keep = [int(k) for k in [config.get("PRUNE_KEEP")] if k and k.isdigit()]
    for _ in range(8):
        if source != "lever" or not parent:
            break
        try:
            settings = load_variant(parent).settings
        except VariantError:
            break
        source, parent = settings.get("SOURCE") or "", settings.get("PARENT")
        keep += [int(k) for k in [settings.get("PRUNE_KEEP")] if k and k.isdigit()]
    kind, _, name = source.partition(":")
    text = (CONFIGS.get(name.split(":")[0]) or {}).get("text") if kind in ("shape-proxy", "config-only") else None
    if not text:
        raise ProjectionError(f"{variant}: SOURCE {config.get('SOURCE')!r} is not a shape proxy or config-only shape of "
                              f"scripts/weights/shape_proxy.py, so its output layer's size is unknown here")
    return min([text["vocab_size"], *keep]), text["hidden_size"]


def draft_vocabulary(variant: str, config: dict) -> int | None:
    """The rows a draft's output layer keeps under a draft vocabulary (SGLang's token map given as one of the lab's
    keep lists, scripts/gpu/sglang_text_only.py); None without one."""
    value = config.get("SGLANG_SPECULATIVE_TOKEN_MAP")
    if not value:
        return None
    if not value.endswith(".json"):
        raise ProjectionError(f"{variant}: its token map {value} is not one of the lab's keep lists (.json), so its "
                              f"rows are unknown here")
    path = Path(value) if Path(value).is_absolute() else paths.ROOT / value
    try:
        return len(json.loads(path.read_text())["kept_ids"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ProjectionError(f"{variant}: its token map {value} is not a readable keep list ({e})") from None


def target_rows(plain: dict, rows: list[dict], args, taus: dict[int, list[float]]) -> tuple[dict, list[dict]]:
    """--target-gbs: the fit of scripts.report.projection (its defaults, or --fit-args) and each rung on the target."""
    from scripts.report import projection

    if args.target_gbs <= 0:
        raise ProjectionError(f"--target-gbs {args.target_gbs:g}: a bandwidth in GB/s above 0")
    parser = projection.build_parser()
    parser.exit_on_error = False
    try:
        fargs = parser.parse_args([*shlex.split(args.fit_args), "--target-gbs", str(args.target_gbs)])
    except (ValueError, argparse.ArgumentError) as e:
        raise ProjectionError(f"--fit-args {args.fit_args!r}: {e} (python -m scripts.report.projection --help)") from None
    _, e, fit = projection.fit(fargs)
    missing = [what for what, v in (("weight bytes", plain["weight_bytes"]), ("copy bandwidth", plain["bandwidth"]),
                                    ("MTP layer bytes", plain["mtp_bytes"])) if not v]
    if missing:
        raise ProjectionError(f"--target-gbs: the plain rung's records carry no {', '.join(missing)} (a roofline "
                              f"measured in the same runs)")
    head_rows, hidden = output_layer_shape(args.plain, plain["config"])
    out = []
    for r in rows:  # a draft vocabulary shrinks that rung's draft head only
        w_draft = plain["mtp_bytes"] + min(head_rows, draft_vocabulary(r["variant"], r["config"]) or head_rows) * hidden * 2
        out.append({**r, "w_draft": w_draft, "target": project_target(
            plain["tpot_ms"], r["tpot_ms"], r["k"], plain["weight_bytes"], w_draft, plain["bandwidth"], e,
            fit["target"], fargs.target_gbs, taus.get(r["k"], []))})
    return {"args": fargs, "fit": fit, "e": e, "w_draft": plain["mtp_bytes"] + head_rows * hidden * 2}, out


def parse_taus(items: list[str]) -> dict[int, list[float]]:
    """--tokens-per-step K=tau entries: tau per K, 1 <= tau <= K + 1."""
    out: dict[int, list[float]] = {}
    for item in items:
        k, sep, tau = item.partition("=")
        try:
            k_, tau_ = int(k), float(tau)
        except ValueError:
            raise ProjectionError(f"--tokens-per-step {item!r}: give K=tau, e.g. 4=3.4") from None
        if not sep or k_ < 1 or not 1 <= tau_ <= k_ + 1:
            raise ProjectionError(f"--tokens-per-step {item!r}: tau is 1 + the accepted drafts, 1 <= tau <= K + 1")
        out.setdefault(k_, []).append(tau_)
    return out


def rows_for(records, args, taus: dict[int, list[float]]) -> tuple[dict, list[dict]]:
    plain = step_point(records, args.plain, args.ladder, args.stamp)
    if args.plain in args.spec:
        raise ProjectionError(f"--plain {args.plain} is a --spec too: the plain rung is the one without speculation")
    if speculation(args.plain, plain["config"]):
        raise ProjectionError(f"--plain {args.plain} speculates: give the rung without speculation")
    rows = []
    for variant in args.spec:
        point = step_point(records, variant, args.ladder, args.stamp)
        if point["tokens_per_step"] is not None and point["tokens_per_step"] > ACCEPTED_AT_MOST:
            raise ProjectionError(f"{variant} accepted drafts ({point['tokens_per_step']:.2f} tokens a step): its TPOT "
                                  f"is not the cost of a step (random weights accept none)")
        if (spec := speculation(variant, point["config"])) is None:
            raise ProjectionError(f"{variant}: its records name no speculation (SERVE_SPECULATIVE_CONFIG or "
                                  f"SGLANG_SPECULATIVE_NUM_STEPS)")
        engine, k = spec
        rows.append({"variant": variant, "engine": engine, "k": k, **point,
                     **project_mtp(plain["tpot_ms"], point["tpot_ms"], taus.get(k, []))})
    gpus = set().union(plain["gpus"], *(r["gpus"] for r in rows))
    if len(gpus) > 1:
        raise ProjectionError(f"the rounds ran on {' and '.join(sorted(gpus))}: a step's cost compares on one GPU only "
                              f"(narrow --stamp, or give --ladder)")
    if unused := sorted(set(taus) - {r["k"] for r in rows}):
        raise ProjectionError(f"--tokens-per-step for K = {', '.join(map(str, unused))}: no --spec rung drafts so many")
    plain["gpu"] = gpus.pop()
    return plain, sorted(rows, key=lambda r: (r["engine"], r["k"]))


def markdown(args, plain: dict, rows: list[dict], target: dict | None = None) -> str:
    lines = [f"# PROJECTION (not a measurement): speculative decoding over {args.plain} at a published acceptance", "",
             f"Written by `python -m scripts.report.mtp_projection` on {now_utc():%Y-%m-%d}, git "
             f"{git_state()['commit'][:12]}. The formula is the module's docstring (scripts/report/mtp_projection.py). "
             f"Tokens a step (tau) from: {args.source}.", "",
             f"Measured on {plain['gpu']}. Plain step: {args.plain}, TPOT p50 c=1 {plain['tpot_ms']:.3f} ms (median of {len(plain['records'])}): "
             f"{', '.join(plain['records'])}", "",
             "| rung | engine | K | TPOT c=1 (ms) | step cost × plain (r_K, measured) | tokens a step to break even | "
             "projected speedup at tau | records |", "| --- | --- | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        at = ", ".join(f"{s:.2f}× at tau {tau:g}" for tau, s in r["speedup"].items()) or "no published tau for this K"
        checked = "" if r["tokens_per_step"] is not None else " (acceptance not reported by the engine: unchecked)"
        lines.append(f"| {r['variant']}{checked} | {r['engine']} | {r['k']} | {r['tpot_ms']:.3f} | {r['cost_ratio']:.2f} | "
                     f"{r['break_even_tokens']:.2f} | {at} | {', '.join(r['records'])} |")
    lines += ["", "Measured with random weights (`--load-format dummy` or a shape proxy): the drafts are never accepted, "
              "so each rung's TPOT is its step's cost; the speedups are projections.", ""]
    if target:
        lines += target_markdown(args, plain, rows, target)
    return "\n".join(lines)


def target_markdown(args, plain: dict, rows: list[dict], target: dict) -> list[str]:
    fa, t, f = target["args"], target["fit"]["target"], target["fit"]["fit"]
    lines = [f"## PROJECTION on a {args.target_gbs:g} GB/s GPU: {fa.target_candidate} with these drafts", "",
             f"The second formula of the docstring. The fit (scripts/report/projection.py, ladder {fa.ladder}: "
             f"{fa.reference} against {fa.candidate}) gives on the target {fa.target_reference} {t['tpot_bf16_ms']:.2f} "
             f"ms and {fa.target_candidate} {t['tpot_cand_ms']:.2f} ms a step (e_cand {f['e_cand']:.3f}), fixed "
             f"{t['fixed_ms']:.3f} ms; e {target['e']:.3f} (BF16 GEMMs at M = 1, `{paths.shown(fa.gemm)}`).", "",
             f"On {plain['gpu']}: the plain step {plain['tpot_ms']:.3f} ms reads {plain['weight_bytes'] / 1e9:.2f} GB at "
             f"{plain['bandwidth'] / 1e12:.2f} TB/s (its records' copy bandwidth); a draft reads "
             f"{target['w_draft'] / 1e9:.2f} GB (the MTP layer {plain['mtp_bytes'] / 1e9:.2f} GB + the BF16 output layer; "
             f"less under a draft vocabulary, its rung's column).",
             "", "| rung | K | draft reads (GB) | per draft, measured (ms) | its bytes (ms) | the rest (ms) | per draft on the target (ms) | "
             "TPOT' (ms) | tokens a step to beat the 4-bit rung alone | × BF16 at tau | × the 4-bit rung alone at tau | "
             "TPOT' and × BF16, the rest not scaled |", "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- | --- |"]
    def at(d: dict) -> str:
        return ", ".join(f"{s:.2f}× at tau {tau:g}" for tau, s in d.items()) or "no published tau"

    for r in rows:
        x = r["target"]
        lines.append(f"| {r['variant']} | {r['k']} | {r['w_draft'] / 1e9:.2f} | {x['per_draft_ms']:.3f} | {x['draft_bytes_ms']:.3f} | "
                     f"{x['rest_ms']:.3f} | {x['per_draft_target_ms']:.3f} | {x['tpot_spec_target_ms']:.2f} | "
                     f"{x['break_even_target']:.2f} | "
                     f"{at(x['over_bf16'])} | {at(x['over_cand'])} | {x['tpot_spec_target_rest_as_measured_ms']:.2f} ms: "
                     f"{at(x['over_bf16_rest_as_measured'])} |")
    return lines + ["", f"Beside it: the reference project's 3.45× on an A10G (AWQ-4bit on Marlin, an MTP head at K=4, "
                        f"batching) and the 4-bit rung alone, {t['speedup']:.2f}× BF16 on the target.", ""]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--plain", required=True, help="the rung without speculation (the same weights and settings)")
    p.add_argument("--spec", action="append", required=True, help="a speculative rung (repeat)")
    rounds = p.add_mutually_exclusive_group(required=True)
    rounds.add_argument("--ladder", help="the ladder id of the rounds")
    rounds.add_argument("--stamp", action="append", help="the records whose file stamp begins so (e.g. 20261128-01; "
                        "repeat for more)")
    p.add_argument("--tokens-per-step", action="append", default=[], metavar="K=TAU",
                   help="a published tokens-a-step at K drafts (repeat)")
    p.add_argument("--source", default="none given", help="where the tokens-a-step figures are published")
    p.add_argument("--out", type=Path, help="the markdown (default results/projection_mtp_<plain>_<time written>.md)")
    p.add_argument("--target-gbs", type=float, help="also project the 4-bit rung with these drafts onto a weight-bound "
                   "GPU of this bandwidth (600: the A10G), from scripts.report.projection's fit")
    p.add_argument("--fit-args", default="", help="arguments of scripts.report.projection for that fit (default: its own)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens_per_step and args.source == "none given":
        print("error: --tokens-per-step needs --source: where the figure is published", file=sys.stderr)
        return 2
    try:
        taus = parse_taus(args.tokens_per_step)
        records = [(p, r) for p, r in all_records("latency") if r["variant"] in {args.plain, *args.spec}]
        plain, rows = rows_for(records, args, taus)
        target, rows = target_rows(plain, rows, args, taus) if args.target_gbs else (None, rows)
    except ProjectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = args.out or paths.RESULTS / f"projection_mtp_{args.plain}_{now_utc():%Y%m%d-%H%M%S}.md"
    paths.write_text_atomic(path, markdown(args, plain, rows, target))
    for r in rows:
        print(f"{r['variant']} ({r['engine']}, K={r['k']}): step {r['cost_ratio']:.2f}× plain; " + (", ".join(
            f"PROJECTION {s:.2f}× at tau {tau:g}" for tau, s in r["speedup"].items()) or "no tau given"))
        if target:
            print(f"  at {args.target_gbs:g} GB/s with the 4-bit rung: " + (", ".join(
                f"PROJECTION {s:.2f}× BF16 at tau {tau:g}" for tau, s in r["target"]["over_bf16"].items()) or "no tau"))
    print(f"wrote {paths.shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
