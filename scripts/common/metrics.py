"""Latency metric math: raw request samples in, summary out. Pure functions (no I/O), unit-tested by hand.

Key names follow `vllm bench serve`: ttft/tpot/itl/e2el in milliseconds with mean/median/pNN, request_throughput
(req/s), output_throughput and total_token_throughput (tok/s).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)


@dataclass
class RequestSample:
    prompt_id: str
    ok: bool
    start_s: float  # wall-clock offsets from the start of the run
    end_s: float
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float | None = None
    itl_s: list[float] = field(default_factory=list)  # gaps between streamed chunks after the first
    error: str | None = None

    @property
    def e2el_s(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first: (e2el - ttft) / (n - 1)."""
        if not self.ok or self.ttft_s is None or self.output_tokens < 2:
            return None
        return (self.e2el_s - self.ttft_s) / (self.output_tokens - 1)

    def to_json(self) -> dict:
        d = asdict(self)
        d["e2el_s"] = self.e2el_s
        d["tpot_s"] = self.tpot_s
        return d


def percentile(values: list[float], p: float) -> float:
    """Linear interpolation between closest ranks (numpy's default, as vllm bench uses)."""
    if not values:
        return math.nan
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def describe(name: str, values_s: list[float]) -> dict[str, float | None]:
    """mean/median/pNN of a list of seconds, reported in milliseconds; None where there is no value."""
    if not values_s:
        return {f"mean_{name}_ms": None, f"median_{name}_ms": None, **{f"p{p}_{name}_ms": None for p in PERCENTILES}}
    ms = [v * 1000 for v in values_s]
    out = {f"mean_{name}_ms": sum(ms) / len(ms), f"median_{name}_ms": percentile(ms, 50)}
    out.update({f"p{p}_{name}_ms": percentile(ms, p) for p in PERCENTILES})
    return out


def summarize(samples: list[RequestSample], duration_s: float | None = None) -> dict[str, float | int | None]:
    """Summary of one run at one concurrency. duration defaults to first start → last end."""
    ok = [s for s in samples if s.ok]
    if duration_s is None:
        duration_s = (max(s.end_s for s in samples) - min(s.start_s for s in samples)) if samples else 0.0
    out_tokens = sum(s.output_tokens for s in ok)
    in_tokens = sum(s.prompt_tokens for s in ok)
    summary: dict[str, float | int | None] = {
        "completed": len(ok),
        "failed": len(samples) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration_s if duration_s > 0 else None,
        "output_throughput": out_tokens / duration_s if duration_s > 0 else None,
        "total_token_throughput": (in_tokens + out_tokens) / duration_s if duration_s > 0 else None,
    }
    summary.update(describe("ttft", [s.ttft_s for s in ok if s.ttft_s is not None]))
    summary.update(describe("tpot", [t for s in ok if (t := s.tpot_s) is not None]))
    summary.update(describe("itl", [g for s in ok for g in s.itl_s]))
    summary.update(describe("e2el", [s.e2el_s for s in ok]))
    return summary


def ratio(new: float | None, old: float | None) -> float | None:
    """new/old, None when either is missing or old is zero."""
    if new is None or old in (None, 0):
        return None
    return new / old
