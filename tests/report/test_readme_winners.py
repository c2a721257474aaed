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
    def row(v, c1, c8):
        return {"group": ("cpu x", "p"), "prompt_set": "latency-v1.jsonl", "variant": v, "engine": "vLLM",
                "base": "m-bf16", "vs_base": {"1": c1, "8": c8}}

    judged = {"fast-uncertified": compare.Judged("inconclusive"), "ok": compare.Judged("pass"),
              "slow": compare.Judged("pass")}
    rows = [row("fast-uncertified", 3.0, 3.0), row("ok", 1.5, 0.9), row("slow", 1.2, 0.8)]
    table = compare.winners_table(rows, judged, {"ok": {"PARENT": "m-bf16", "CALIBRATE_RECIPE": "x"}})
    assert table[2].startswith("| cpu x | latency-v1.jsonl | c=1 | ok | quantize | vLLM | 1.50 | 0.90 |")
    assert table[3].startswith("| cpu x | latency-v1.jsonl | c=8 | the BF16 reference |")
    assert len(table) == 4


@pytest.mark.slow
def test_readme_winners_table_matches_the_committed_records():
    r = subprocess.run([sys.executable, "-m", "scripts.report.compare", "--check-readme"], cwd=paths.ROOT,
                       capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stderr.strip() or r.stdout[-500:]
