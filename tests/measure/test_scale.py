"""The scale ladder's comparison (scripts/measure/scale.py) on hand-made records: hit rates over servers, each
topology's ratio to the one server paired by round, and its bad input."""

from __future__ import annotations

import json
import math

import pytest

from scripts.measure.scale import Step, hit_rate, main, ratios, round_lines, summary_json


def level(tok_s: float, hits: list[tuple[int, int]]) -> dict:
    return {"output_throughput": tok_s, "servers": [{"prefix_cache_queries": q, "prefix_cache_hits": h} for q, h in hits]}


def test_hit_rate_sums_hits_and_queries_over_servers():
    assert hit_rate(level(1.0, [(100, 50), (300, 60)])) == pytest.approx(110 / 400)
    assert hit_rate(level(1.0, [(0, 0)])) is None  # an idle server adds nothing


def test_ratios_pair_rounds_and_carry_an_interval(tmp_path):
    def rec(name: str, tok_s: float, hits: list[tuple[int, int]]):
        p = tmp_path / f"{name}.json"
        p.write_text(json.dumps({"summary": {"fixed": {"128": level(tok_s, hits)}}}))
        return p

    one = Step("one server", "v", [], records={1: rec("o1", 100.0, [(10, 5)]), 2: rec("o2", 200.0, [(10, 5)]),
                                               3: rec("o3", 100.0, [(10, 5)])})
    # 1.5x in every round: a zero-width interval around 1.50; a second topology with a round missing pairs two
    two = Step("2 replicas", "v", [], records={k: rec(f"t{k}", 1.5 * v, [(10, 4), (10, 4)])
                                               for k, v in ((1, 100.0), (2, 200.0), (3, 100.0))})
    gap = Step("dp2", "v", [], records={1: rec("d1", 110.0, [(10, 2)]), 3: rec("d3", 90.0, [(10, 2)])})
    lines = round_lines(ratios([one, two, gap], [128]), one.label)
    row = next(x for x in lines if x.startswith("| 2 replicas"))
    assert "| 3 | 1.50 [1.50, 1.50] | faster | 0.400 / 0.500 |" in row
    row = next(x for x in lines if x.startswith("| dp2"))
    # log ratios ln 1.1 and ln 0.9 over 2 rounds: geometric mean sqrt(0.99), an interval holding 1.00
    assert f"| 2 | {math.sqrt(0.99):.2f} [" in row and "| tie |" in row
    got = summary_json([one, two], ratios([one, two], [128]), [128], "l", {"v-tp2": "out of memory"})
    assert got["unstarted"] == {"v-tp2": "out of memory"} and got["ratios"][0]["label"] == "2 replicas"


def test_bad_policy_and_rounds_without_the_one_server_beside(capsys):
    assert main(["smollm2-bf16", "--policies", "nearest"]) == 2
    assert "unknown ['nearest']" in capsys.readouterr().err
    assert main(["smollm2-bf16", "--rounds", "3"]) == 2
    assert "--single replica" in capsys.readouterr().err
