"""make optimize's ladder speeds over alternating rounds: one latency record per rung and round, and a candidate's
ratio to its reference paired round by round with its 95% interval (scripts/common/metrics.py: speed_ratio).

    s = Speeds({"smollm2-bf16": [rec1, rec2], "smollm2-int8": [rec1, rec2]})
    s.versus("smollm2-int8", "smollm2-bf16", 8)   # SpeedRatio(ratio, lo, hi, rounds): faster | tie | slower

"Faster" in a certificate means the interval's lower end is above 1.00; an interval holding 1.00 is a tie.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field

from scripts.common import paths
from scripts.common.metrics import SpeedRatio, speed_ratio
from scripts.common.records import tokens_a_step
from scripts.report.compare import MODE


@functools.cache
def read_record(record: str) -> dict:
    """A record (a path under the repository), read once: records are written whole and never change."""
    return json.loads((paths.ROOT / record).read_text())


def level_stat(record: str | None, level: int, key: str) -> float | None:
    """One statistic of a latency record at one concurrency, fixed length."""
    if not record:
        return None
    return ((read_record(record).get("summary", {}).get(MODE, {}).get(str(level))) or {}).get(key)


def throughput(record: str | None, level: int) -> float | None:
    return level_stat(record, level, "output_throughput")


@dataclass
class Speeds:
    """{variant: its latency record per round of one ladder (None: that round's run failed)}."""
    rounds: dict[str, list[str | None]] = field(default_factory=dict)

    def measured(self, variant: str) -> bool:
        return any(self.rounds.get(variant) or [])

    def record(self, variant: str) -> str | None:
        """The variant's first record of the ladder (its configuration, engine and command)."""
        return next((r for r in self.rounds.get(variant) or [] if r), None)

    def records(self, variant: str) -> list[str]:
        return [r for r in self.rounds.get(variant) or [] if r]

    def stat(self, variant: str, level: int, key: str) -> float | None:
        """The mean over the variant's rounds of one statistic at one level (None where no round has it)."""
        vals = [x for r in self.records(variant) if (x := level_stat(r, level, key)) is not None]
        return sum(vals) / len(vals) if vals else None

    def tput(self, variant: str, level: int) -> float | None:
        return self.stat(variant, level, "output_throughput")

    def tpot_p50(self, variant: str, level: int) -> float | None:
        return self.stat(variant, level, "p50_tpot_ms")

    def tokens_a_step(self, variant: str) -> float | None:
        """A speculative rung's tokens a step (1 + accepted drafts), the mean over its rounds of the engine's own count
        (vLLM's mean acceptance length over each run); None where the engine reported none (no speculation)."""
        vals = [m for r in self.records(variant) if (m := tokens_a_step(read_record(r)))]
        return sum(vals) / len(vals) if vals else None

    def versus(self, variant: str, reference: str, level: int) -> SpeedRatio | None:
        """The variant's output tok/s over the reference's at one level, paired by round (rounds where both ran)."""
        mine, theirs = self.rounds.get(variant) or [], self.rounds.get(reference) or []
        return speed_ratio([(throughput(a, level), throughput(b, level)) for a, b in zip(mine, theirs, strict=False)
                            if a and b])

    def point(self, variant: str, reference: str, level: int) -> float | None:
        """The ratio's point estimate (geometric mean of the per-round ratios), None where not measured."""
        sr = self.versus(variant, reference, level)
        return sr.ratio if sr else None
