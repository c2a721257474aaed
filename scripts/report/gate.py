"""Print the parity gate's verdict for a variant: each criterion with its estimate, interval and verdict.

    python -m scripts.report.gate smollm2-int8sq          # `make gate VARIANT=smollm2-int8sq`

Tolerances are the variant's GATE_* keys; evidence is its newest quality records (scripts/common/gate.py explains the
intervals: one-sided 95% bounds, paired item by item for lm-eval tasks); `--on gpu` (`make gate GATE_ON=gpu`) reads
only those made on GPUs, `--on cpu` only those made on CPUs, as `make optimize` and `make compare` judge. Exit 0 when
every criterion passes, 1 when any fails, is inconclusive or has no record to judge it, 2 on records the gate refuses
to compare or unknown keys.
"""

from __future__ import annotations

import argparse
import sys

from scripts.common.gate import DEVICES, GateError, RecordsOn, gate_for, verdict
from scripts.common.variants import VariantError, load_variant


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--on", choices=DEVICES, help="judge on the records of this kind of machine only")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant)
        reference, criteria = gate_for(variant.name, variant.resolved, None, RecordsOn(args.on) if args.on else None)
    except (VariantError, GateError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if reference is None:
        print(f"{variant.name} is a reference variant (no PARENT / GATE_REFERENCE): nothing to gate")
        return 0
    if variant.is_shape_proxy:
        print(f"{variant.name} is a shape proxy (random weights): speed only, never certified")
        return 1
    print(f"{variant.name} vs {reference} (value [one-sided 95% bounds]):")
    for c in criteria:
        print(f"  {c.line()}")
        for line in c.beside:
            print(f"      {line}")
    result = verdict(criteria)
    print(f"gate: {result.upper()}")
    return 0 if result == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
