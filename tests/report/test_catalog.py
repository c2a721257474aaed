"""The variant catalog (`make list`): levers, the status rules and their order, ratios to BF16 (no server)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from scripts.common import paths
from scripts.common.variants import list_variants
from scripts.report import catalog

CPU = {"cpu": "AMD EPYC", "cores": 2, "cpu_flags": ["avx2"]}
GPU = {"cpu": "Intel(R) Xeon(R) Processor", "cores": 16, "gpu": {"name": "NVIDIA H100 80GB HBM3", "count": 1}}


def variant(root: Path, name: str, *lines: str, parent: str | None = "x-bf16") -> None:
    d = root / name
    d.mkdir(parents=True)
    head = ["MODEL=weights/x", "BASE=x"] + ([f"PARENT={parent}"] if parent else [])
    (d / "config.env").write_text("\n".join(head + list(lines)) + "\n")


def latency(root: Path, name: str, stamp: str, c1: float, c8: float, hardware: dict = CPU, parent: str | None = None,
            status: str = "ok", ladder: str | None = None) -> None:
    rec = {"variant": name, "status": status, "hardware": hardware, "config": {"PARENT": parent} if parent else {},
           "inputs": {"prompt_set_sha256": "a" * 64, **({"ladder_id": ladder} if ladder else {})},
           "summary": {"fixed": {"1": {"output_throughput": c1}, "8": {"output_throughput": c8}}}}
    (root / name / f"latency_{stamp}.json").write_text(json.dumps(rec))


def identity(root: Path, name: str, stamp: str, beyond: int, hardware: dict = CPU, reference: str = "x-bf16") -> None:
    rec = {"variant": name, "status": "ok", "hardware": hardware, "config": {},
           "inputs": {"kind": "greedy-identity", "reference": reference},
           "summary": {"identity": {"sequences": 8, "identical": 8 - beyond, "near_tie_divergences": 0,
                                    "divergences_beyond_tie": beyond}}}
    (root / name / f"quality_{stamp}.json").write_text(json.dumps(rec))


@pytest.fixture()
def tree(tmp_path) -> Path:
    """One variant per status rule, and the cases where two rules apply (the first one wins)."""
    root = tmp_path / "experiments"
    spec = 'SERVE_SPECULATIVE_CONFIG={"method": "eagle3", "model": "weights/x-head", "num_speculative_tokens": 2}'
    variant(root, "x-bf16", parent=None)
    variant(root, "x-int8", "CALIBRATE_RECIPE=int8", "GATE_GREEDY_IDENTITY=1")  # certified
    variant(root, "x-int8-eagle2", spec, "GATE_GREEDY_IDENTITY=1", parent="x-int8")  # certified through x-int8
    variant(root, "x-bad", "PRUNE_KEEP=16384", "GATE_GREEDY_IDENTITY=1")  # fails
    variant(root, "x-new", "GATE_MAX_MEAN_KLD=0.05")  # unmeasured: no parity record
    variant(root, "x-old", spec, "# the newer head accepts more", "SUPERSEDED_BY=x-int8-eagle2",
            "GATE_GREEDY_IDENTITY=1")  # superseded, though its gate passes
    variant(root, "x-proxy", "SHAPE_PROXY=1", "SERVE_KV_CACHE_DTYPE=fp8")
    variant(root, "x-proxy-old", "SHAPE_PROXY=1", "SUPERSEDED_BY=x-proxy")  # superseded beats needs a GPU
    variant(root, "x-sglang", "ENGINE=sglang")
    variant(root, "x-scale", spec, "REDISTILL_PROMPT_SHA256=" + "b" * 64, "GATE_GREEDY_IDENTITY=1")
    variant(root, "x-scale-git", spec, "REDISTILL_PROMPT_SHA256=" + "b" * 64, "HEAD_SOURCE=results/h",
            "GATE_GREEDY_IDENTITY=1")  # the same head, committed: no GPU needed
    variant(root, "x-gpu", "SERVE_ENFORCE_EAGER=1", "GATE_GREEDY_IDENTITY=1")  # every record from a GPU
    variant(root, "x-lora", "LORA_RANK=16")
    latency(root, "x-bf16", "20261101-000000", 10.0, 40.0)
    latency(root, "x-bf16", "20261102-000000", 100.0, 400.0, hardware=GPU)
    latency(root, "x-int8", "20261101-000100", 15.0, 60.0, parent="x-bf16")
    latency(root, "x-int8-eagle2", "20261101-000200", 20.0, 30.0, parent="x-int8")
    latency(root, "x-int8-eagle2", "20261103-000000", 1.0, 1.0, hardware=GPU, parent="x-int8", status="failed")
    latency(root, "x-gpu", "20261102-000100", 90.0, 500.0, hardware=GPU, parent="x-bf16")
    for name in ("x-int8", "x-old", "x-scale", "x-scale-git"):
        identity(root, name, "20261101-010000", 0)
    identity(root, "x-int8-eagle2", "20261101-010000", 0, reference="x-int8")
    identity(root, "x-bad", "20261101-010000", 3)
    identity(root, "x-gpu", "20261102-010000", 0, hardware=GPU)
    return root


def by_name(root: Path) -> dict[str, catalog.Entry]:
    return {e.variant: e for e in catalog.build_catalog(root)}


def test_status_rules_in_order(tree):
    e = by_name(tree)
    assert {v: x.status for v, x in e.items()} == {
        "x-bf16": "reference",
        "x-int8": "certified on AMD EPYC 2c AVX2",
        "x-int8-eagle2": "certified on AMD EPYC 2c AVX2",
        "x-bad": "fails GATE_GREEDY_IDENTITY",
        "x-new": "unmeasured GATE_MAX_MEAN_KLD",
        "x-old": "superseded by x-int8-eagle2",
        "x-proxy": "needs a GPU (shape proxy)",
        "x-proxy-old": "superseded by x-proxy",
        "x-sglang": "needs a GPU (ENGINE=sglang)",
        "x-scale": "needs a GPU (head distilled on a GPU lease, not in git)",
        "x-scale-git": "certified on AMD EPYC 2c AVX2",
        "x-gpu": "needs a GPU (records only from GPUs)",
        "x-lora": "ungated (no GATE_* tolerance)",
    }
    assert e["x-int8"].certified_on == ["AMD EPYC (2 cores, avx2)"] and e["x-old"].superseded_by == "x-int8-eagle2"


def test_a_pass_counts_only_through_a_certified_reference(tree):
    identity(tree, "x-int8", "20261101-020000", 2)  # the INT8 parent now fails: its speculative child cannot certify
    e = by_name(tree)
    assert e["x-int8"].kind == "fail"
    assert e["x-int8-eagle2"].status == "fails (its own gate passes; its reference x-int8 is fail)"


def test_levers_are_variants_lever_of(tree):
    e = by_name(tree)
    assert {v: x.lever for v, x in e.items()} == {
        "x-bf16": "base", "x-int8": "quantize", "x-int8-eagle2": "speculate", "x-bad": "vocab", "x-new": "other",
        "x-old": "speculate", "x-proxy": "serving", "x-proxy-old": "other", "x-sglang": "engine", "x-scale": "speculate",
        "x-scale-git": "speculate", "x-gpu": "serving", "x-lora": "lora"}


def test_ratio_to_bf16_from_the_newest_comparable_record_on_the_same_hardware(tree):
    e = by_name(tree)
    # x-int8-eagle2's newest record (GPU) failed: its newest comparable one (CPU) is used, with BF16 through x-int8
    assert e["x-int8-eagle2"].vs_bf16 == {"1": 2.0, "8": 0.75} and e["x-int8-eagle2"].measured_on_label == "AMD EPYC 2c AVX2"
    assert e["x-int8"].vs_bf16 == {"1": 1.5, "8": 1.5}
    assert e["x-gpu"].vs_bf16 == {"1": 0.9, "8": 1.25} and e["x-gpu"].measured_on_label == "H100 80GB HBM3"
    assert e["x-bf16"].vs_bf16 == {"1": None, "8": None} and e["x-new"].measured_on is None
    # as in `make compare`, a failed newest record on a machine makes the variant not comparable there
    latency(tree, "x-int8-eagle2", "20261104-000000", 1.0, 1.0, parent="x-int8", status="failed")
    assert by_name(tree)["x-int8-eagle2"].vs_bf16 == {"1": None, "8": None}


def test_a_ratio_reads_the_reference_of_the_variants_own_ladder(tree):
    """As `make compare`: BF16 measured again in a later ladder without x-int8 leaves x-int8's ratio on its own ladder."""
    latency(tree, "x-bf16", "20261105-000000", 12.0, 48.0, ladder="L1")
    latency(tree, "x-int8", "20261105-000100", 18.0, 96.0, parent="x-bf16", ladder="L1")
    latency(tree, "x-bf16", "20261106-000000", 36.0, 36.0, ladder="L2")
    assert by_name(tree)["x-int8"].vs_bf16 == {"1": 1.5, "8": 2.0}


def test_table_is_aligned_sorted_and_counted(tree, capsys):
    assert catalog.main(["--experiments", str(tree)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows, at = lines[1:lines.index("")], lines[0].index("status")
    entries = by_name(tree)
    assert [r.split()[0] for r in rows] == sorted(entries)
    assert all(r[at:] == entries[r.split()[0]].status and r[at - 2:at] == "  " for r in rows)
    assert lines[-1] == ("13 variants: superseded 2, needs a GPU 4, reference 1, certified 3, fails 1, unmeasured 1, "
                         "ungated 1")
    assert catalog.main(["--experiments", str(tree), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["variant"]: r["kind"] for r in rows}["x-old"] == "superseded"


def test_superseded_by_a_missing_variant_is_a_one_line_error(tree, capsys):
    (tree / "x-old" / "config.env").write_text("MODEL=weights/x\nBASE=x\n# why\nSUPERSEDED_BY=x-gone\n")
    assert catalog.main(["--experiments", str(tree)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "x-old/config.env:4: SUPERSEDED_BY='x-gone' is not a variant; closest:" in err


def test_every_committed_variant_is_listed_reading_each_record_once(monkeypatch, capsys):
    reads: dict[Path, int] = {}
    read_text = Path.read_text

    def counted(self, *a, **k):
        if self.suffix == ".json":
            reads[self] = reads.get(self, 0) + 1
        return read_text(self, *a, **k)

    monkeypatch.setattr(Path, "read_text", counted)
    assert catalog.main(["--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [(r["base"], r["variant"]) for r in rows] == sorted((r["base"], r["variant"]) for r in rows)
    assert {r["variant"] for r in rows} == set(list_variants()) and all(r["status"] for r in rows)
    records = {p for p in paths.EXPERIMENTS.glob("*/*.json") if p.name.startswith(("latency_", "quality_"))}
    assert set(reads) == records and max(reads.values()) == 1
    # every SUPERSEDED_BY has its reason on the line above it
    for v in (r["variant"] for r in rows if r["superseded_by"]):
        lines = (paths.EXPERIMENTS / v / "config.env").read_text().splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("SUPERSEDED_BY="))
        assert lines[at - 1].startswith("# "), v
