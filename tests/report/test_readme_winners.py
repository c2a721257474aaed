"""The README's winners table: generated from the committed records by `make compare`, never typed."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scripts.common import paths
from scripts.report import compare


def test_readme_table_is_written_between_the_markers_only(tmp_path):
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\nabove\n{compare.README_BEGIN}\nold row\n{compare.README_END}\nbelow\n")
    assert compare.write_readme_table(readme, ["| a |", "| b |"])
    assert readme.read_text() == f"# x\nabove\n{compare.README_BEGIN}\n| a |\n| b |\n{compare.README_END}\nbelow\n"
    assert not compare.write_readme_table(readme, ["| a |", "| b |"]), "an unchanged table rewrites nothing"
    readme.write_text("# no markers\n")
    with pytest.raises(ValueError, match="markers"):
        compare.write_readme_table(readme, ["| a |"])


def test_winner_is_the_fastest_certified_and_the_reference_when_none_is_faster():
    from scripts.common.metrics import speed_ratio

    def row(v, c1, c8):  # per level, the (variant, reference) tok/s of each round
        ci = {"1": speed_ratio(c1), "8": speed_ratio(c8)}
        return {"group": ("cpu x", "p"), "prompt_set": "latency-v1.jsonl", "variant": v, "engine": "vLLM",
                "base": "m-bf16", "vs_base": {k: sr.ratio for k, sr in ci.items()}, "vs_base_ci": ci}

    judged = {"fast-uncertified": compare.Judged("inconclusive"), "ok": compare.Judged("pass"),
              "tie": compare.Judged("pass"), "slow": compare.Judged("pass"), "once": compare.Judged("pass")}
    rows = [row("fast-uncertified", [(30, 10), (30, 10)], [(30, 10), (31, 10)]),
            row("tie", [(20, 10), (11, 10)], [(20, 10), (9, 10)]),  # 1.48x by its point estimate, [0.03, 64]: a tie
            # log 1.50, 1.53: mean 0.415367, sd 0.014003, half 12.706 x 0.014003 / sqrt 2 = 0.12582 -> [1.34, 1.72]
            row("ok", [(15, 10), (15.3, 10)], [(9, 10), (9.1, 10)]),
            row("once", [(12, 10)], [(12, 10)]),  # one round: no interval
            row("slow", [(9, 10), (9.1, 10)], [(8, 10), (8.1, 10)])]
    table = compare.winners_table(rows, judged, {"ok": {"PARENT": "m-bf16", "CALIBRATE_RECIPE": "x"}})
    assert table[2].startswith("| cpu x | latency-v1.jsonl | c=1 | ok | quantize | vLLM | 1.51 [1.34, 1.72] | 0.90 [")
    assert table[3].startswith("| cpu x | latency-v1.jsonl | c=8 | the BF16 reference |")
    assert "no certified variant is faster with 95% confidence (fastest certified above 1.00 at c=8: tie, " in table[3]
    assert table[3].endswith("a tie) |")
    assert len(table) == 4
    rows = [r for r in rows if r["variant"] in ("once", "slow")]
    table = compare.winners_table(rows, judged, {})
    assert "c=1, c=8 | the BF16 reference" in table[2] and "once, 1.20 (1 round), one round: no interval)" in table[2]
    table = compare.winners_table([{**r, "shape_proxy": True} for r in rows], judged, {})
    assert "(shape proxies only: random weights, speed only, nothing can be certified)" in table[2]
    # a proxy faster with 95% confidence is named by speed alone, beside the real models' verdict
    proxy = {**row("p-fast", [(15, 10), (15.3, 10)], [(9, 10), (9.1, 10)]), "shape_proxy": True}
    judged["p-fast"] = compare.Judged("speed only")
    table = compare.winners_table([*rows, proxy], judged, {})
    assert table[2].endswith("one round: no interval; shape proxy, speed only: p-fast 1.51 [1.34, 1.72] at c=1) |")
    table = compare.winners_table([{**r, "shape_proxy": True} for r in rows] + [proxy], judged, {})
    assert table[2].endswith("nothing can be certified; shape proxy, speed only: p-fast 1.51 [1.34, 1.72] at c=1) |")


@pytest.mark.slow
def test_readme_winners_table_matches_the_committed_records():
    r = subprocess.run([sys.executable, "-m", "scripts.report.compare", "--check-readme"], cwd=paths.ROOT,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr.strip() or r.stdout[-500:]


def test_a_gate_cell_names_evidence_judged_on_other_hardware():
    from scripts.common.gate import Criterion

    on = {"cpu": Criterion("GATE_GREEDY_IDENTITY", 1.0, "min", status="pass", hardware="AMD EPYC (2 cores, avx2)"),
          "gpu": Criterion("GATE_GREEDY_IDENTITY", 1.0, "min", status="pass", hardware="NVIDIA H100 80GB HBM3 x1")}
    cpu_judged = compare.Judged("pass", [on["cpu"]])
    assert cpu_judged.short("NVIDIA H100 80GB HBM3 x1") == "pass (evidence from AMD EPYC (2 cores, avx2))"
    assert cpu_judged.short("AMD EPYC (2 cores, avx2)") == "pass"  # its own table
    assert compare.Judged("pass", [on["gpu"]]).short("NVIDIA H100 80GB HBM3 x1") == "pass"
    missing = compare.Judged("missing", [Criterion("GATE_MAX_MEAN_KLD", 0.05, "max")])  # no record: no hardware
    assert missing.short("NVIDIA H100 80GB HBM3 x1") == "missing: GATE_MAX_MEAN_KLD"
    # a failed variant names what failed apart from what has no record yet
    failed = compare.Judged("fail", [Criterion("GATE_MAX_SUITE_DROP", 1.0, "max"),
                                     Criterion("GATE_MAX_MEAN_KLD", 0.05, "max", value=0.16, status="fail")])
    assert failed.short() == "fail: GATE_MAX_MEAN_KLD; missing: GATE_MAX_SUITE_DROP"


def test_a_chained_pass_names_its_references_hardware_and_a_non_pass_names_none():
    from scripts.common.gate import Criterion

    def crit(hw, status="pass"):
        return Criterion("GATE_GREEDY_IDENTITY", 1.0, "min", status=status, hardware=hw)

    judged = {"m-bf16": compare.Judged("reference"), "m-q8": compare.Judged("pass", [crit("cpu A")]),
              "m-q8-ngram": compare.Judged("pass", [crit("cpu B")]),
              "m-x": compare.Judged("missing", [crit("cpu A"), Criterion("GATE_MAX_MEAN_KLD", 0.05, "max")])}
    configs = {"m-bf16": {}, "m-q8": {"PARENT": "m-bf16"}, "m-q8-ngram": {"PARENT": "m-q8", "GATE_REFERENCE": "m-q8"},
               "m-x": {"PARENT": "m-bf16"}}
    out = compare.chain(judged, configs)
    assert out["m-q8-ngram"].short("cpu B") == "pass (evidence from cpu A)"  # its reference was certified on A
    assert out["m-q8"].short("cpu A") == "pass"
    assert out["m-x"].short("gpu") == "missing: GATE_MAX_MEAN_KLD"  # a non-pass names no hardware
