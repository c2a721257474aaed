"""Tables of the 2026-11-25 H100 lever session (run from the repo root):

    python results/gpu-levers-20261125/summarize.py

Reads the records named below (experiments/<variant>/latency_*.json, fixed length, c=1 and c=8); per variant the mean of
its rounds of output tok/s, and the median TPOT / TTFT (p50 of each round, then their mean); the ratio is the
variant's mean output tok/s over its reference's at the same concurrency. Per-round values follow each table.
"""

from __future__ import annotations

import json
from pathlib import Path
from statistics import mean

LEVERS = {
    "W4A16 kernel on Hopper (Qwen3.5-4B shape proxy)": ("qwen35-4b-proxy-bf16", [
        ("qwen35-4b-proxy-bf16", "005020 005247"), ("qwen35-4b-proxy-awq-mlp", "005158 005424"),
        ("qwen35-4b-proxy-awq-mlp-marlin", "005222 005446")]),
    "FP8 weights + FP8 KV (Qwen3.5-4B shape proxy)": ("qwen35-4b-proxy-bf16", [
        ("qwen35-4b-proxy-bf16", "005020 005247"), ("qwen35-4b-proxy-fp8", "005044 005311"),
        ("qwen35-4b-proxy-fp8-kv8", "005108 005334"), ("qwen35-4b-proxy-kv8", "005133 005400")]),
    "LoRA serving (SmolLM2-135M)": ("smollm2-bf16", [
        ("smollm2-bf16", "005747 005917"), ("smollm2-lora-a", "005807 005939"),
        ("smollm2-lora1", "005832 010001"), ("smollm2-lora3", "005857 010023")]),
}


def load(variant: str, stamps: str) -> list[dict]:
    return [json.loads(Path(f"experiments/{variant}/latency_20261125-{s}.json").read_text()) for s in stamps.split()]


def stats(records: list[dict], c: str) -> dict:
    s = [r["summary"]["fixed"][c] for r in records]
    return {"tok_s": mean(x["output_throughput"] for x in s), "tpot": mean(x["median_tpot_ms"] for x in s),
            "ttft": mean(x["median_ttft_ms"] for x in s), "rounds": [x["output_throughput"] for x in s],
            "tpots": [x["median_tpot_ms"] for x in s]}


def main() -> None:
    for title, (ref, rows) in LEVERS.items():
        refs = {c: stats(load(ref, dict(rows)[ref]), c) for c in ("1", "8")}
        print(f"\n### {title}\n")
        print("| variant | c=1 tok/s | c=1 TPOT p50 ms | c=1 TTFT p50 ms | c=8 tok/s | c=8 TPOT p50 ms | c=8 TTFT p50 ms "
              f"| × {ref} c=1 / c=8 | rounds |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        detail = []
        for v, stamps in rows:
            recs = load(v, stamps)
            a, b = stats(recs, "1"), stats(recs, "8")
            print(f"| {v} | {a['tok_s']:.1f} | {a['tpot']:.2f} | {a['ttft']:.0f} | {b['tok_s']:.1f} | {b['tpot']:.2f} | "
                  f"{b['ttft']:.0f} | {a['tok_s'] / refs['1']['tok_s']:.2f} / {b['tok_s'] / refs['8']['tok_s']:.2f} | "
                  f"{len(recs)} |")
            detail.append(f"{v}: c=1 " + ", ".join(f"{x:.1f}" for x in a["rounds"]) + " tok/s (TPOT "
                          + ", ".join(f"{x:.2f}" for x in a["tpots"]) + " ms); c=8 "
                          + ", ".join(f"{x:.1f}" for x in b["rounds"]) + " tok/s (TPOT "
                          + ", ".join(f"{x:.2f}" for x in b["tpots"]) + " ms)")
        print("\nPer round (round 1, round 2):\n")
        for d in detail:
            print(f"- {d}")


if __name__ == "__main__":
    main()
