"""make plan: the capacity model worked by hand, and the command on the committed records (plot and table)."""

from __future__ import annotations

import pytest

from scripts.report.plan import PlanError, capacity, family, hosts_needed, main, plan_rows, projection_lines


def pt(load, rate, tpot, ttft=100.0, ok=True, open_=False):
    return {"load": load, "rate": rate, "tpot": tpot, "ttft": ttft, "ok": ok, "open": open_}


def test_capacity_measured_interpolated_and_unreachable():
    pts = [pt("c=1", 1.0, 10.0), pt("c=8", 6.0, 30.0), pt("c=32", 14.0, 70.0)]
    assert capacity(pts, 30.0, None) == (6.0, "measured at c=8 (closed-loop)")
    # 50 ms lies halfway between c=8 (30 ms) and c=32 (70 ms): 6 + (14 - 6) / 2
    assert capacity(pts, 50.0, None) == (10.0, "interpolated between c=8 and c=32 (closed-loop)")
    assert capacity(pts, 5.0, None) == (0.0, "no measured closed-loop level meets the target")
    # a TTFT target removes the levels that miss it, and the interpolation that would need them
    pts[2]["ttft"] = 5000.0
    assert capacity(pts, 50.0, 1000.0) == (6.0, "measured at c=8 (closed-loop)")
    # open-loop levels decide when present (the closed-loop c=32 would claim 14 req/s); a failed one never counts
    both = pts + [pt("2/s", 2.0, 20.0, open_=True), pt("4/s", 4.0, 20.0, ok=False, open_=True)]
    assert capacity(both, 100.0, None) == (2.0, "measured at 2/s (open-loop)")


def test_family_takes_children_that_change_only_parallelism():
    assert set(family("qwen35-4b-proxy-c128")) == {"qwen35-4b-proxy-c128", "qwen35-4b-proxy-tp2", "qwen35-4b-proxy-dp2"}
    assert family("smollm2-int8sq") == ["smollm2-int8sq"]  # its LoRA/EAGLE/pruned children change more than that


def test_plan_refuses_what_it_cannot_fit(tmp_path, capsys):
    with pytest.raises(PlanError, match="no latency record of smollm2-bf16 .* on prompt set nothing.jsonl"):
        plan_rows("smollm2-bf16", "nothing.jsonl", 50.0, None, 1.0)
    assert main(["smollm2-bf16", "--slo-tpot-ms", "0", "--qps", "1", "--out-dir", str(tmp_path)]) == 2
    assert "must be > 0" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


def test_plan_renders_from_committed_records(tmp_path, capsys):
    """The committed CPU scale ladder of smollm2-bf16 (one server, two replicas behind vllm-router)."""
    assert main(["smollm2-bf16", "--slo-tpot-ms", "200", "--qps", "2", "--out-dir", str(tmp_path)]) == 0
    md = next(tmp_path.glob("plan_smollm2-bf16_*.md")).read_text()
    png = next(tmp_path.glob("plan_smollm2-bf16_*.png"))
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    assert "A model fitted to the records" in md and "vllm-router" in md and "experiments/smollm2-bf16/latency_" in md
    assert "Plan: **" in md


def test_an_all_reduce_pass_is_parallelism_other_compilation_settings_are_not():
    from scripts.report.plan import beyond_parallelism

    base = {"MODEL": "m", "SERVE_MAX_NUM_SEQS": "128"}
    tp2 = {**base, "SERVE_TENSOR_PARALLEL_SIZE": "2",
           "SERVE_COMPILATION_CONFIG": '{"pass_config": {"fuse_allreduce_rms": false}}'}
    assert beyond_parallelism(tp2) == base
    graphs = {**tp2, "SERVE_COMPILATION_CONFIG": '{"cudagraph_capture_sizes": [1, 2], "pass_config": {"fuse_allreduce_rms": false}}'}
    assert beyond_parallelism(graphs) == {**base, "SERVE_COMPILATION_CONFIG": '{"cudagraph_capture_sizes": [1, 2]}'}


def test_the_projection_to_hosts_fills_each_host_and_says_it_is_one():
    assert hosts_needed(3, 1, 2) == (2, 2) and hosts_needed(3, 1, 8) == (8, 1)
    assert hosts_needed(5, 2, 8) == (4, 2) and hosts_needed(1, 4, 2) is None  # a TP4 instance fits no 2-GPU host
    rows = [{"topology": "one GPU", "units": 1, "instances": 3, "unit": "GPU"},
            {"topology": "TP4", "units": 4, "instances": 1, "unit": "GPU"},
            {"topology": "nothing", "units": 1, "instances": None, "unit": "GPU"}]
    text = "\n".join(projection_lines(rows, [2, 8]))
    assert "(on paper, not measured)" in text and "**A projection:**" in text and "hosts = ceil(instances / per host)" in text
    assert "| one GPU | 1 | 3 | 2 (2) | 4 | 1 (8) | 8 |" in text and "| TP4 | 4 | 1 | does not fit | — | 1 (2) | 8 |" in text
    assert "nothing" not in text
    assert projection_lines([{**rows[0], "unit": "CPU core"}], [2, 8]) == []  # cores are not hosts of GPUs


def test_bad_host_sizes_are_one_line(capsys):
    assert main(["qwen35-4b-proxy-c128", "--slo-tpot-ms", "40", "--qps", "20", "--hosts", "2,x"]) == 2
    assert "error: --hosts '2,x': comma-separated GPU counts" in capsys.readouterr().err


def test_a_later_round_with_fewer_levels_does_not_replace_the_full_ladder():
    """The committed two-H200 scale ladder of 2026-11-28: rounds 2 and 3 measured c=128 only; the plan reads round 1's
    full ladder (three concurrency levels, four Poisson levels) of every topology."""
    rows, on = plan_rows("qwen35-4b-proxy-c128", "shared-prefix-v1.jsonl", 40.0, 1000.0, 20.0)
    assert on.startswith("NVIDIA H200")
    ca = next(r for r in rows if "cache_aware" in r["topology"])
    assert ca["record"].endswith("latency_20261128-213800.json") and len(ca["points"]) == 7
    one = next(r for r in rows if r["topology"] == "qwen35-4b-proxy-c128")
    assert len(one["points"]) == 7
