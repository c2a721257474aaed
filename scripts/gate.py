"""Print the parity gate's verdict for a variant from its newest quality records.

    python -m scripts.gate smollm2-int8          # `make gate VARIANT=smollm2-int8`

Tolerances are the variant's GATE_* keys (scripts/common/gate.py). Exit 0 when every criterion passes, 1 when any
fails or has no record to judge it.
"""

from __future__ import annotations

import argparse
import sys

from scripts.common.gate import gate_for, verdict
from scripts.common.variants import VariantError, load_variant


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant)
    except VariantError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    reference, criteria = gate_for(variant.name, variant.resolved)
    if reference is None:
        print(f"{variant.name} is a reference variant (no PARENT / GATE_REFERENCE): nothing to gate")
        return 0
    print(f"{variant.name} vs {reference}:")
    for c in criteria:
        print(f"  {c.line()}")
    result = verdict(criteria)
    print(f"gate: {result.upper()}")
    return 0 if result == "pass" else 1


if __name__ == "__main__":
    sys.exit(main())
