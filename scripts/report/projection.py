"""A PROJECTION, not a measurement: a 4-bit rung's speedup on another GPU, from a shape where weights dominate the step.

    python -m scripts.report.projection                  # the defaults: the 27B shape's ladder on the H200 -> the 4B on an A10G

The Qwen3.5-27B shape on an H200 reads ~51 GB of BF16 weights a step, ~90 % of its step: the ratio of weight time to
fixed cost a 4B has on a 24 GB A10G (600 GB/s). So the 27B ladder measures what a 4-bit kernel achieves in that regime:

    fit, on the shape's ladder (c=1, TPOT p50 medians over its rounds, the copy bandwidth BW measured in the same runs):
        fixed      = TPOT_bf16 - W_bf16 / (BW x e_bf16)        e_bf16: the BF16 GEMMs' share of BW (the GEMM microbench)
        e_cand     = W_cand / (BW x (TPOT_cand - fixed))       the candidate step's weights' achieved share of BW
    projection, on the target GPU (target_gbs) for the target model's weight bytes (its own records):
        weights_bf16 = W'_bf16 / (target_gbs x e_bf16)
        fixed'       = fixed / (W_bf16 / (BW x e_bf16)) x weights_bf16     the same fixed-to-weight-time ratio
        TPOT'_bf16   = fixed' + weights_bf16
        TPOT'_cand   = fixed' + W'_cand / (target_gbs x e_cand)
        speedup      = TPOT'_bf16 / TPOT'_cand                  (and at e_cand = e_bf16: a 4-bit kernel as good as BF16's)

    per kernel (--kernels-from GEMM --kernels K,…: the kernels' own efficiencies, from one GEMM microbench record):
        e_bf16k, e_k = the BF16 GEMMs' and kernel K's share of that run's copy bandwidth at M = 1 over every layer of the
                       shape in its form (the record's model rows)
        weights_bf16 = W'_bf16 / (target_gbs x e_bf16k);  fixed' = fixed / (W_bf16 / (BW x e_bf16)) x weights_bf16
        TPOT'_K      = fixed' + W'_packed / (target_gbs x e_k) + W'_rest / (target_gbs x e_bf16k)
                       W'_packed: the candidate's packed 4-bit bytes (its record's I32), W'_rest: the rest (BF16:
                       the output layer, in_proj_ba, norms, the group scales) read at the BF16 GEMMs' efficiency

It assumes the kernels keep on the target GPU the efficiency they have where they were measured (Marlin was built for
Ampere and may do better there), and nothing about MTP or batching. Writes results/projection_<target>_<stamp>.md.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.hardware import A10G_GBS
from scripts.common.records import all_records, git_state, now_utc, read_json


class ProjectionError(ValueError):
    pass


def read_ms(nbytes: float, gbs: float, efficiency: float) -> float:
    """Time in ms to read nbytes at efficiency x gbs GB/s."""
    return nbytes / (gbs * 1e9 * efficiency) * 1e3


def target_bf16(fixed_ratio: float, w_target_ref: float, e_bf16: float, target_gbs: float) -> tuple[float, float]:
    """(fixed ms, weight ms) of the target's BF16 step: its weights at e_bf16 of target_gbs, its fixed time in the
    fit's ratio to them (fixed_ratio: the fit's fixed time over its BF16 weight time)."""
    weights = read_ms(w_target_ref, target_gbs, e_bf16)
    return fixed_ratio * weights, weights


def project(tpot_ref_ms: float, tpot_cand_ms: float, w_ref: float, w_cand: float, bw: float, e_ref: float,
            w_target_ref: float, w_target_cand: float, target_gbs: float) -> dict:
    """The fit on the measured shape and the projection to the target (bytes in bytes, bandwidths in bytes/s except
    target_gbs in GB/s, times in ms). Pure: numbers in, numbers out."""
    weights_ms = w_ref / (bw * e_ref) * 1e3
    fixed = tpot_ref_ms - weights_ms
    if fixed <= 0 or tpot_cand_ms <= fixed:
        raise ProjectionError(f"the fit has no room: fixed {fixed:.3f} ms from TPOT {tpot_ref_ms:.3f} ms and "
                              f"{weights_ms:.3f} ms of BF16 weights; candidate TPOT {tpot_cand_ms:.3f} ms")
    e_cand = w_cand / (bw * (tpot_cand_ms - fixed) / 1e3)
    fixed_target, weights_target = target_bf16(fixed / weights_ms, w_target_ref, e_ref, target_gbs)
    bf16 = fixed_target + weights_target
    cand = fixed_target + read_ms(w_target_cand, target_gbs, e_cand)
    ideal = fixed_target + read_ms(w_target_cand, target_gbs, e_ref)
    return {"fit": {"fixed_ms": fixed, "weights_ms": weights_ms, "fixed_share": fixed / tpot_ref_ms, "e_bf16": e_ref,
                    "e_cand": e_cand, "measured_speedup": tpot_ref_ms / tpot_cand_ms},
            "target": {"fixed_ms": fixed_target, "tpot_bf16_ms": bf16, "tpot_cand_ms": cand,
                       "tok_s_bf16": 1e3 / bf16, "tok_s_cand": 1e3 / cand, "speedup": bf16 / cand,
                       "tpot_cand_at_e_bf16_ms": ideal, "speedup_at_e_bf16": bf16 / ideal}}


def project_kernel(fixed_ratio: float, w_target_ref: float, packed: float, rest: float, e_bf16: float, e_kernel: float,
                   target_gbs: float) -> dict:
    """The target's BF16 and candidate steps (ms) with the candidate's packed 4-bit bytes at the kernel's efficiency
    and the rest at the BF16 GEMMs' (fixed_ratio: the fit's fixed time over its BF16 weight time). Pure."""
    fixed, weights = target_bf16(fixed_ratio, w_target_ref, e_bf16, target_gbs)
    cand = fixed + read_ms(packed, target_gbs, e_kernel) + read_ms(rest, target_gbs, e_bf16)
    return {"fixed_ms": fixed, "tpot_bf16_ms": fixed + weights, "tpot_cand_ms": cand,
            "speedup": (fixed + weights) / cand, "e_bf16": e_bf16, "e_kernel": e_kernel}


def ladder_point(records, variant: str, ladder: str) -> tuple[float, float, float, list[str]]:
    """(median TPOT p50 ms at c=1, weight bytes a step reads, median copy bandwidth bytes/s, record paths) of a variant's
    latency records in one ladder."""
    rows = [(p, r) for p, r in records if r["variant"] == variant
            and r.get("inputs", {}).get("ladder_id") == ladder]
    if not rows:
        raise ProjectionError(f"no latency record of {variant} in ladder {ladder} (make compare lists the ladders)")
    tpot = statistics.median(r["summary"]["fixed"]["1"]["p50_tpot_ms"] for _, r in rows)
    weights = rows[0][1]["summary"]["fixed"]["1"]["roofline"]["weight_bytes"]
    bw = statistics.median(r["roofline"]["bandwidth"]["bytes_per_s"] for _, r in rows)
    return tpot, weights, bw, [paths.shown(p) for p, _ in rows]


def weight_bytes(records, variant: str) -> tuple[float, str]:
    """The weight bytes a step of the variant reads, from its newest latency record that counted them."""
    rows = [(p, r) for p, r in records if r["variant"] == variant
            and ((r["summary"].get("fixed", {}).get("1") or {}).get("roofline") or {}).get("weight_bytes")]
    if not rows:
        raise ProjectionError(f"no latency record of {variant} with the weight bytes of its step")
    p, r = rows[-1]
    return r["summary"]["fixed"]["1"]["roofline"]["weight_bytes"], paths.shown(p)


def weight_split(records, variant: str) -> tuple[float, float, str]:
    """(packed 4-bit bytes, the other bytes) a step of the variant reads, from its newest latency record that counted
    them by dtype (packed: I32)."""
    rows = [(p, r) for p, r in records if r["variant"] == variant
            and ((r.get("roofline") or {}).get("bytes") or {}).get("weights", {}).get("by_dtype")]
    if not rows:
        raise ProjectionError(f"no latency record of {variant} with its weight bytes by dtype")
    p, r = rows[-1]
    by_dtype = r["roofline"]["bytes"]["weights"]["by_dtype"]
    packed = by_dtype.get("I32", 0)
    return packed, sum(by_dtype.values()) - packed, paths.shown(p)


def load_gemm(gemm: Path) -> dict:
    """A GEMM microbench record (its model rows checked), or ProjectionError naming the file."""
    rec = read_json(gemm, "a GEMM microbench record", ProjectionError)
    if not isinstance(rec, dict) or not isinstance((rec.get("summary") or {}).get("models"), list):
        raise ProjectionError(f"{gemm}: not a GEMM microbench record (no summary.models)")
    return rec


def kernel_efficiency(rec: dict, gemm: Path, shape: str, kernel: str = "bf16") -> float:
    """A kernel's share of the copy bandwidth at M = 1 over every layer of the shape, from the GEMM microbench's
    record `rec` (read from `gemm`; its model row)."""
    row = next((m for m in rec["summary"]["models"]
                if m["kernel"] == kernel and m["shape"] == shape and m["m"] == 1 and m.get("complete", True)), None)
    if row is None:
        raise ProjectionError(f"{gemm}: no complete row of kernel {kernel}, shape {shape} at M = 1")
    return row["pct_copy"] / 100


def gpu_of(rec: dict) -> str:
    """The GPU a GEMM microbench record ran on, as its bandwidth measurement names it."""
    bandwidth = rec.get("bandwidth")
    return (bandwidth.get("device") if isinstance(bandwidth, dict) else None) or "an unnamed GPU"


def fit(args) -> tuple[dict, float, dict]:
    """(inputs, e_bf16, project()'s result, with per_kernel()'s under "kernels" when --kernels-from is given) for
    parsed arguments of this module: the ladder's two points, the target rungs' weight bytes, the BF16 GEMMs'
    efficiency. Records that are not a roofline ladder's or a GEMM microbench's end in ProjectionError."""
    wanted = {args.reference, args.candidate, args.target_reference, args.target_candidate}
    records = [(p, r) for p, r in all_records("latency") if r["variant"] in wanted]
    try:
        inputs = {"ref": ladder_point(records, args.reference, args.ladder),
                  "cand": ladder_point(records, args.candidate, args.ladder),
                  "tref": weight_bytes(records, args.target_reference),
                  "tcand": weight_bytes(records, args.target_candidate)}
        e_ref = kernel_efficiency(load_gemm(args.gemm), args.gemm, args.shape)
        ref, cand = inputs["ref"], inputs["cand"]
        out = project(ref[0], cand[0], ref[1], cand[1], statistics.median([ref[2], cand[2]]), e_ref, inputs["tref"][0],
                      inputs["tcand"][0], args.target_gbs)
        if args.kernels_from:
            out["kernels"] = per_kernel(args, records, inputs, out)
    except (KeyError, TypeError, AttributeError) as err:
        raise ProjectionError(f"the fit's records ({args.ladder}, {paths.shown(args.gemm)}"
                              f"{', ' + paths.shown(args.kernels_from) if args.kernels_from else ''}) lack {err}: not "
                              f"records of a roofline ladder and a GEMM microbench") from None
    return inputs, e_ref, out


def per_kernel(args, records, inputs: dict, out: dict) -> dict:
    """project_kernel() for each of args.kernels from the record args.kernels_from (the split bytes and that record's
    GPU join inputs)."""
    packed, rest, inputs["split"] = weight_split(records, args.target_candidate)
    if not packed:
        raise ProjectionError(f"{args.target_candidate}: its record counts no packed 4-bit bytes (I32)")
    rec = load_gemm(args.kernels_from)
    inputs["split_bytes"], inputs["kernels_gpu"] = (packed, rest), gpu_of(rec)
    e_bf16 = kernel_efficiency(rec, args.kernels_from, args.shape)
    ratio = out["fit"]["fixed_ms"] / out["fit"]["weights_ms"]
    return {k: project_kernel(ratio, inputs["tref"][0], packed, rest, e_bf16,
                              kernel_efficiency(rec, args.kernels_from, args.shape, k), args.target_gbs)
            for k in args.kernels}


def markdown(args, out: dict, inputs: dict) -> str:
    f, t = out["fit"], out["target"]
    return "\n".join([
        f"# PROJECTION (not a measurement): {args.target_candidate} on a {args.target_gbs:g} GB/s GPU "
        f"({'A10G' if args.target_gbs == A10G_GBS else 'the target'}), from the {args.shape} shape's ladder", "",
        f"Written by `python -m scripts.report.projection` on {now_utc():%Y-%m-%d}, git {git_state()['commit'][:12]}. "
        "The formula is the module's docstring (scripts/report/projection.py).", "",
        "## Inputs (records)", "",
        f"- {args.reference}: TPOT p50 c=1 {inputs['ref'][0]:.3f} ms (median over {len(inputs['ref'][3])} rounds), "
        f"W {inputs['ref'][1] / 1e9:.2f} GB, BW {inputs['ref'][2] / 1e12:.2f} TB/s: {', '.join(inputs['ref'][3])}",
        f"- {args.candidate}: TPOT p50 c=1 {inputs['cand'][0]:.3f} ms, W {inputs['cand'][1] / 1e9:.2f} GB, BW "
        f"{inputs['cand'][2] / 1e12:.2f} TB/s: {', '.join(inputs['cand'][3])}",
        f"- e_bf16 {f['e_bf16']:.3f}: BF16 GEMMs at M = 1 on the {args.shape} shape, `{paths.shown(args.gemm)}`",
        f"- {args.target_reference}: W' {inputs['tref'][0] / 1e9:.2f} GB (`{inputs['tref'][1]}`); "
        f"{args.target_candidate}: W' {inputs['tcand'][0] / 1e9:.2f} GB (`{inputs['tcand'][1]}`)", "",
        "## Fit on the measured shape", "",
        f"fixed {f['fixed_ms']:.3f} ms ({f['fixed_share']:.1%} of the BF16 step), BF16 weights {f['weights_ms']:.3f} ms; "
        f"the candidate step's weights at e_cand = {f['e_cand']:.3f} of BW; the measured TPOT ratio there (c=1, p50) "
        f"{f['measured_speedup']:.2f}×.", "",
        "## Projection", "",
        "| | TPOT (ms) | tok/s at c=1 | × BF16 |", "| --- | ---: | ---: | ---: |",
        f"| {args.target_reference} | {t['tpot_bf16_ms']:.2f} | {t['tok_s_bf16']:.1f} | 1.00 |",
        f"| {args.target_candidate} (e_cand {f['e_cand']:.3f}) | {t['tpot_cand_ms']:.2f} | {t['tok_s_cand']:.1f} | "
        f"{t['speedup']:.2f} |",
        f"| {args.target_candidate}, a 4-bit kernel as good as BF16's (e {f['e_bf16']:.3f}) | "
        f"{t['tpot_cand_at_e_bf16_ms']:.2f} | {1e3 / t['tpot_cand_at_e_bf16_ms']:.1f} | {t['speedup_at_e_bf16']:.2f} |",
        *kernel_rows(args, out, inputs),
        "", "Beside it: the projection from the 4B's own profile on the H200 (results/gpu-stack-20261128/README.md, its "
        "small GEMMs at e 0.31) and the reference project's 3.45× on an A10G, which stacks AWQ-4bit on Marlin with an "
        "MTP head and batching (this projection has neither).", ""])


def kernel_rows(args, out: dict, inputs: dict) -> list[str]:
    """The per-kernel projection's section (--kernels-from), or nothing."""
    if "kernels" not in out:
        return []
    packed, rest = inputs["split_bytes"]
    first = next(iter(out["kernels"].values()))
    gpu = inputs["kernels_gpu"]
    lines = ["", f"## Per kernel: the kernels' own efficiencies ({gpu}, `{paths.shown(args.kernels_from)}`)", "",
             f"The same fixed-to-weight ratio; the BF16 step at e_bf16 {first['e_bf16']:.3f} (that run's BF16 GEMMs, so "
             f"its TPOT differs from the table above, which uses the fit's e_bf16); {args.target_candidate}'s "
             f"{packed / 1e9:.2f} GB of packed 4-bit weights at each kernel's e, its other {rest / 1e9:.2f} GB (the "
             f"output layer, in_proj_ba, norms, group scales) at e_bf16 (`{inputs['split']}`).", "",
             f"- The efficiencies are {gpu}'s; the projection assumes the kernels keep them on the target GPU.",
             f"- They are the {args.shape} shape's rows (every layer in 4 bits, M = 1), the regime a small model has on "
             "the target (weights ~90 % of the step), not the target model's own layer shapes.",
             "- A microbench efficiency leaves out what serving adds around a kernel"
             + (f": Marlin's {out['kernels']['vllm-marlin']['e_kernel']:.3f} here against the serving fit's e_cand "
                f"{out['fit']['e_cand']:.3f} above (all of the candidate's bytes, the ladder's GPU)"
                if "vllm-marlin" in out["kernels"] else "")
             + ". Read these rows as the kernels' ranking and an upper end.", "",
             "| kernel (every layer of the shape in 4 bits, M = 1) | e | target TPOT BF16 (ms) | target TPOT (ms) | "
             "× BF16 |", "| --- | ---: | ---: | ---: | ---: |"]
    lines += [f"| {k} | {r['e_kernel']:.3f} | {r['tpot_bf16_ms']:.2f} | {r['tpot_cand_ms']:.2f} | {r['speedup']:.2f} |"
              for k, r in out["kernels"].items()]
    return lines


def kernel_list(value: str) -> list[str]:
    kernels = [k for k in value.split(",") if k]
    if not kernels:
        raise argparse.ArgumentTypeError("name at least one kernel of the GEMM microbench")
    return kernels


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ladder", default="gpu-20261128-131804", help="the shape's ladder id (default %(default)s)")
    p.add_argument("--reference", default="qwen35-27b-dummy-bf16")
    p.add_argument("--candidate", default="qwen35-27b-dummy-w4a16-marlin")
    p.add_argument("--shape", default="qwen35-27b", help="the GEMM microbench's shape name (default %(default)s)")
    p.add_argument("--gemm", type=Path, default=paths.RESULTS / "gpu-kernels-20261128" / "gemm_20261128-125852.json")
    p.add_argument("--target-reference", default="qwen35-4b-proxy-bf16")
    p.add_argument("--target-candidate", default="qwen35-4b-proxy-w4a16-marlin")
    p.add_argument("--target-gbs", type=float, default=A10G_GBS, help="the target GPU's bandwidth (default: the A10G)")
    p.add_argument("--kernels-from", type=Path, help="a GEMM microbench record: project each of --kernels with its "
                   "own efficiency there (the formula's per-kernel part)")
    p.add_argument("--kernels", type=kernel_list, default=["vllm-marlin", "lab-gemv-stream"],
                   help="the microbench's kernel names (default %(default)s)")
    p.add_argument("--out", type=Path, help="the markdown (default results/projection_<target>_<stamp>.md)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        inputs, _, out = fit(args)
    except ProjectionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    path = args.out or paths.RESULTS / f"projection_{args.target_candidate}_{now_utc():%Y%m%d-%H%M%S}.md"
    paths.write_text_atomic(path, markdown(args, out, inputs))
    t = out["target"]
    kernels = "".join(f", {k} {r['speedup']:.2f}×" for k, r in out.get("kernels", {}).items())
    print(f"PROJECTION: {args.target_candidate} {t['speedup']:.2f}× {args.target_reference} at {args.target_gbs:g} GB/s "
          f"({t['speedup_at_e_bf16']:.2f}× with a 4-bit kernel as good as BF16's{kernels}); wrote {paths.shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
