"""Latency metric math: raw request samples in, summary out. Pure functions (no I/O), unit-tested by hand.

Key names follow `vllm bench serve`: ttft/tpot/itl/e2el in milliseconds with mean/median/pNN, request_throughput
(req/s), output_throughput and total_token_throughput (tok/s).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

PERCENTILES = (50, 90, 99)
# BF16 near-tie: a token the reference rates within this many nats of its own argmax, given the same prefix. Kernel
# order and batch shape change BF16 rounding (seen here: gaps of 0.125-0.25 nats, one or two BF16 steps of the
# logits); a wrong computation puts tokens several nats away. Used by the serving tests and scripts.measure.identity.
TIE_NATS = 0.5
# gaps are differences of float32 log-softmax values: a gap of exactly TIE_NATS arrives as 0.50000006 (seen on an AVX2
# CPU, 2026-11-25), so the bound is inclusive up to float32 rounding
TIE_SLACK = 1e-5


def near_tie(gap: float) -> bool:
    """Whether a gap in nats below the reference's argmax is a BF16 near-tie (at most TIE_NATS)."""
    return gap <= TIE_NATS + TIE_SLACK


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
    # where output_tokens comes from: the server's usage report, or (a server that streams no usage: llama-cpp-python)
    # the streamed chunks that carried text, one token each (an undercount where one chunk carries several)
    tokens_from: str = "usage"

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


def goodput(samples: list[RequestSample], duration_s: float, ttft_ms: float, tpot_ms: float) -> dict:
    """What a level served within a per-request SLO (DistServe's goodput, vLLM bench's --goodput): the requests that
    completed with TTFT <= ttft_ms and TPOT <= tpot_ms (a one-token answer has no TPOT: its TTFT decides), their rate
    and their output tokens per second over the level's duration."""
    good = [s for s in samples if s.ok and s.ttft_s is not None and s.ttft_s * 1e3 <= ttft_ms
            and (s.tpot_s is None or s.tpot_s * 1e3 <= tpot_ms)]
    per_s = duration_s if duration_s > 0 else None
    return {"slo": {"ttft_ms": ttft_ms, "tpot_ms": tpot_ms}, "requests": len(good),
            "fraction": len(good) / len(samples) if samples else None,
            "request_throughput": len(good) / per_s if per_s else None,
            "output_throughput": sum(s.output_tokens for s in good) / per_s if per_s else None}


def fmt(x: float | None, spec: str = ".2f") -> str:
    """A number for a table cell: formatted by spec, "—" where it is missing."""
    return "—" if x is None else format(x, spec)


def ratio(new: float | None, old: float | None) -> float | None:
    """new/old, None when either is missing or old is zero."""
    if new is None or old in (None, 0):
        return None
    return new / old


def mean_sem(values: list[float]) -> tuple[float, float]:
    """Mean and its standard error (sample standard deviation / sqrt(n))."""
    n = len(values)
    if n == 0:
        return math.nan, math.nan
    mu = sum(values) / n
    if n == 1:
        return mu, math.nan
    var = sum((v - mu) ** 2 for v in values) / (n - 1)
    return mu, math.sqrt(var / n)


def parity_stats(kld: list[float], top1_agree: list[bool], nll_ref: list[float], nll_var: list[float]) -> dict:
    """Parity of a variant against its reference over the same scored tokens (llama.cpp --kl-divergence style).

    kld: per-token KL(P_ref || P_var) in nats; top1_agree: argmax equal; nll_*: -log p(actual next token).
    PPL = exp(mean NLL); its standard error by the delta method (PPL x SEM of NLL).
    """
    n = len(kld)
    # nll_* may cover fewer positions than kld (a pruned vocabulary leaves out those whose gold id is dropped)
    if not (n == len(top1_agree)) or n == 0 or len(nll_ref) != len(nll_var) or not nll_ref:
        raise ValueError("parity_stats needs equal, non-empty per-token lists")
    k_mean, k_sem = mean_sem(kld)
    agree = sum(top1_agree) / n
    r_mean, r_sem = mean_sem(nll_ref)
    v_mean, v_sem = mean_sem(nll_var)
    ppl_ref, ppl_var = math.exp(r_mean), math.exp(v_mean)
    return {
        "tokens": n,
        "mean_kld": k_mean, "mean_kld_se": k_sem,
        "median_kld": percentile(kld, 50), "p99_kld": percentile(kld, 99), "max_kld": max(kld),
        "top1_agreement": agree, "top1_agreement_se": math.sqrt(agree * (1 - agree) / n),
        "ppl_ref": ppl_ref, "ppl_ref_se": ppl_ref * r_sem if n > 1 else None,
        "ppl_var": ppl_var, "ppl_var_se": ppl_var * v_sem if n > 1 else None,
        "ppl_ratio": ppl_var / ppl_ref,
        "nll_tokens": len(nll_ref),
    }


# ------------------------------------------------------------------------------------------- speed over alternating rounds
SPEED_CONFIDENCE = 0.95  # two-sided: "faster" when the interval's lower end is above 1.00, a tie when it holds 1.00


def round_orders(names: list[str], rounds: int) -> list[list[str]]:
    """A ladder's order in each round: as given in odd rounds, reversed in even ones (ABBA), so a drift of the machine
    over the ladder weighs on every rung alike and each candidate alternates with its reference (what lets
    speed_ratio treat the rounds as exchangeable)."""
    return [list(names) if k % 2 == 0 else list(reversed(names)) for k in range(rounds)]


def _betacf(a: float, b: float, x: float) -> float:
    """The continued fraction of the regularized incomplete beta function (modified Lentz)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        m2 = 2 * m
        for num in (m * (b - m) * x / ((qam + m2) * (a + m2)), -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))):
            d = 1.0 + num * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + num / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def betainc(a: float, b: float, x: float) -> float:
    """The regularized incomplete beta function I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function with `df` degrees of freedom."""
    tail = 0.5 * betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: int) -> float:
    """Student's t quantile (p in (0.5, 1)), by bisection on t_cdf: t_quantile(0.975, 1) = 12.706."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        hi *= 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2.0


@dataclass(frozen=True)
class SpeedRatio:
    """A candidate's speed over its reference's from rounds that alternate the two: the geometric mean of the per-round
    ratios and its two-sided `confidence` interval (Student's t on the log ratios, rounds - 1 degrees of freedom; None
    with fewer than two rounds). `verdict`: faster (lower end > 1), slower (upper end < 1), tie (the interval holds
    1.00), or one round (no interval: nothing certified)."""
    ratio: float
    lo: float | None
    hi: float | None
    rounds: int
    confidence: float = SPEED_CONFIDENCE

    @property
    def verdict(self) -> str:
        if self.lo is None:
            return "one round"
        return "faster" if self.lo > 1.0 else "slower" if self.hi < 1.0 else "tie"

    @property
    def faster(self) -> bool:
        return self.verdict == "faster"

    def text(self, spec: str = ".2f") -> str:
        """'1.61 [1.52, 1.70]', or '1.61 (1 round)' where there is no interval. An end that rounds to 1.00 while the
        verdict puts the interval off 1.00 gets the digits that show its side ('1.01 [1.004, 1.02]', faster)."""
        if self.lo is None:
            return f"{self.ratio:{spec}} ({self.rounds} round)"

        def end(x: float) -> str:
            text = f"{x:{spec}}"
            if self.verdict == "tie" or float(text) != 1.0:
                return text
            return next((t for k in range(3, 10) if float(t := f"{x:.{k}f}") != 1.0), repr(x))

        return f"{self.ratio:{spec}} [{end(self.lo)}, {end(self.hi)}]"

    def to_json(self) -> dict:
        return {**asdict(self), "verdict": self.verdict}

    @classmethod
    def from_json(cls, d: dict) -> SpeedRatio:
        return cls(d["ratio"], d["lo"], d["hi"], d["rounds"], d.get("confidence", SPEED_CONFIDENCE))


def speed_ratio(pairs: list[tuple[float, float]], confidence: float = SPEED_CONFIDENCE) -> SpeedRatio | None:
    """SpeedRatio of (candidate, reference) speeds, one pair a round (both measured in that round; higher is faster,
    e.g. output tok/s). None when no round has both. Rounds are exchangeable after alternation, so the log ratios are
    treated as independent: log r_i = log(cand_i / ref_i), mean m, sample sd s, n rounds;
    interval = exp(m ± t_{(1+confidence)/2, n-1} · s / sqrt(n))."""
    logs = [math.log(c / r) for c, r in pairs if c and r and c > 0 and r > 0]
    if not logs:
        return None
    n = len(logs)
    m = sum(logs) / n
    if n == 1:
        return SpeedRatio(math.exp(m), None, None, 1, confidence)
    sd = math.sqrt(sum((x - m) ** 2 for x in logs) / (n - 1))
    half = t_quantile((1.0 + confidence) / 2.0, n - 1) * sd / math.sqrt(n)
    return SpeedRatio(math.exp(m), math.exp(m - half), math.exp(m + half), n, confidence)
