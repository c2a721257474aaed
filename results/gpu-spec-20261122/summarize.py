"""Table of this session's GPU speculative-decoding records (run from the repo root):

    python results/gpu-spec-20261122/summarize.py experiments/*/latency_2026112[23]-*.json

Per record: median TPOT and output tok/s at c=1 and c=8 (fixed length), vLLM's spec-decode counters over the measured
requests (both levels together; warm-up excluded), the mean tokens per verification step tau = 1 + accepted/drafts,
and the step time TPOT_step = TPOT x tau (the time of one draft + verify step; = TPOT when nothing is accepted).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def row(path: Path) -> dict:
    r = json.loads(path.read_text())
    m = r.get("server_metrics") or {}
    tau = m.get("spec_decode_mean_acceptance_length")
    out = {"variant": r["variant"], "record": str(path), "status": r["status"],
           "gpu": (r.get("hardware", {}).get("gpu") or {}).get("name"),
           "spec": (r.get("config") or {}).get("SERVE_SPECULATIVE_CONFIG"),
           "drafts": m.get("spec_decode_drafts"), "draft_tokens": m.get("spec_decode_draft_tokens"),
           "accepted": m.get("spec_decode_accepted_tokens"), "acceptance_rate": m.get("spec_decode_acceptance_rate"),
           "tau": tau, "per_position": m.get("spec_decode_acceptance_per_position")}
    for c, s in (r.get("summary", {}).get("fixed") or {}).items():
        out[f"tpot_p50_c{c}"] = s["median_tpot_ms"]
        out[f"itl_p50_c{c}"] = s["median_itl_ms"]
        out[f"out_tok_s_c{c}"] = s["output_throughput"]
        out[f"tpot_step_c{c}"] = s["median_tpot_ms"] * (tau or 1.0)
    return out


def main(paths: list[str]) -> None:
    rows = [row(Path(p)) for p in paths]
    print(json.dumps(rows, indent=1))
    print("\n| variant | TPOT p50 c=1 (ms) | tok/s c=1 | TPOT p50 c=8 (ms) | tok/s c=8 | drafts | draft tok | accepted | tau |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        f = lambda k, d=2: "—" if r.get(k) is None else f"{r[k]:.{d}f}"  # noqa: E731
        print(f"| {r['variant']} | {f('tpot_p50_c1', 3)} | {f('out_tok_s_c1', 1)} | {f('tpot_p50_c8', 3)} | "
              f"{f('out_tok_s_c8', 1)} | {f('drafts', 0)} | {f('draft_tokens', 0)} | {f('accepted', 0)} | {f('tau', 3)} |")


if __name__ == "__main__":
    main(sys.argv[1:])
