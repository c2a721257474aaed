"""Validate every JSON record under experiments/ and results/ against the JSON Schemas in schemas/.

    python -m scripts.report.schemas                 # all records (what `make check` runs)
    python -m scripts.report.schemas path/to/record.json

A record's kind comes from its file name (latency_*.json, quality_*.json, profile_*.json); the validator is jsonschema's
Draft 2020-12 with format checking. Exit 1 naming the file and the field of the first error of each bad record.
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import cache
from pathlib import Path

from scripts.common import paths
from scripts.common.records import SCHEMA_VERSIONS

KINDS = tuple(SCHEMA_VERSIONS)
_NUMBER = {"number": lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
           "integer": lambda x: isinstance(x, int) and not isinstance(x, bool)}


def _numbers_passing(items: object, instance: object) -> bool:
    """True where `items` is a bare number schema ({"type": "number"|"integer"}, an optional "minimum") and every element
    of the array passes it: one loop instead of one jsonschema descent per element (the per-request inter-token arrays
    are most of the records' elements)."""
    if not (isinstance(items, dict) and items.keys() <= {"type", "minimum"} and items.get("type") in _NUMBER
            and isinstance(instance, list)):
        return False
    ok, low = _NUMBER[items["type"]], items.get("minimum", float("-inf"))
    return all(ok(x) and x >= low for x in instance)


@cache
def validator(kind: str):
    from jsonschema import Draft202012Validator, validators
    from referencing import Registry, Resource

    items = Draft202012Validator.VALIDATORS["items"]

    def fast_items(v, sub, instance, schema):
        if "prefixItems" in schema or not _numbers_passing(sub, instance):  # failures: jsonschema's own messages
            yield from items(v, sub, instance, schema)

    checker = validators.extend(Draft202012Validator, {"items": fast_items})

    schemas = {p.name: json.loads(p.read_text()) for p in paths.SCHEMAS.glob("*.schema.json")}
    registry = Registry().with_resources((name, Resource.from_contents(s)) for name, s in schemas.items())
    schema = schemas[f"{kind}.schema.json"]
    Draft202012Validator.check_schema(schema)
    return checker(schema, registry=registry, format_checker=Draft202012Validator.FORMAT_CHECKER)


def kind_of(path: Path) -> str | None:
    prefix = path.name.split("_", 1)[0]
    return prefix if prefix in KINDS and "_" in path.name else None


def record_files(roots: list[Path]) -> list[Path]:
    files = []
    for root in roots:
        files += [root] if root.is_file() else sorted(p for p in root.rglob("*.json") if kind_of(p))
    return files


def check_file(path: Path) -> list[str]:
    kind = kind_of(path)
    if kind is None:
        return [f"{path}: not a record file name (expected {'|'.join(KINDS)}_<YYYYMMDD-HHMMSS>.json)"]
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        return [f"{path}: not valid JSON ({e.msg}, line {e.lineno})"]
    errors = sorted(validator(kind).iter_errors(record), key=lambda e: list(e.absolute_path))
    out = [f"{path}: {'/'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message[:200]}" for e in errors[:5]]
    if isinstance(record, dict) and record.get("variant") and path.parent.parent == paths.EXPERIMENTS \
            and record["variant"] != path.parent.name:
        out.append(f"{path}: variant: {record['variant']!r} is stored under experiments/{path.parent.name}/")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", type=Path, help="files or folders (default: experiments/ and results/)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    files = record_files(args.paths or [paths.EXPERIMENTS, paths.RESULTS])
    problems = [msg for f in files for msg in check_file(f)]
    for msg in problems:
        print(f"error: {msg}", file=sys.stderr)
    print(f"checked {len(files)} record(s): {len(files) - len({m.split(':', 1)[0] for m in problems})} valid")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
