"""The speculative-decoding projection (scripts/report/mtp_projection.py): the formula against hand-computed numbers,
its refusals, and the page written from the committed H200 step costs."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.common.variants import load_variant
from scripts.report import mtp_projection as mp
from scripts.report.projection import ProjectionError


def test_cost_ratio_break_even_and_speedup_by_hand():
    # a 2 ms plain step, a 5 ms step with its drafts: 2.5x the cost; a head emitting 3.5 tokens a step gives 3.5 / 2.5
    out = mp.project_mtp(2.0, 5.0, [3.5, 2.0])
    assert out["cost_ratio"] == pytest.approx(2.5) and out["break_even_tokens"] == pytest.approx(2.5)
    assert out["speedup"] == {3.5: pytest.approx(1.4), 2.0: pytest.approx(0.8)}


@pytest.mark.parametrize("items,message", [(["4"], "give K=tau"), (["x=2"], "give K=tau"), (["3=4.5"], "1 <= tau <= K"),
                                           (["2=0.5"], "1 <= tau <= K")])
def test_tokens_per_step_out_of_range_are_refused(items, message):
    with pytest.raises(ProjectionError, match=message):
        mp.parse_taus(items)


def test_engine_and_k_from_the_config():
    assert mp.speculation("v", {"SERVE_SPECULATIVE_CONFIG": '{"method": "mtp", "num_speculative_tokens": 3}'}) == ("vLLM", 3)
    assert mp.speculation("v", {"SGLANG_SPECULATIVE_NUM_STEPS": "2"}) == ("SGLang", 2)
    assert mp.speculation("v", {}) is None
    with pytest.raises(ProjectionError, match="a tree"):
        mp.speculation("v", {"SGLANG_SPECULATIVE_NUM_STEPS": "2", "SGLANG_SPECULATIVE_EAGLE_TOPK": "4"})
    with pytest.raises(ProjectionError, match="do not parse"):
        mp.speculation("v", {"SERVE_SPECULATIVE_CONFIG": "{not json"})


def fake(v, tpot, config, accepted=None, gpu="G"):
    return (Path(f"experiments/{v}/latency_20261128-010000.json"),
            {"variant": v, "summary": {"fixed": {"1": {"p50_tpot_ms": tpot}}}, "config": config,
             "hardware": {"gpu": {"name": gpu}}, "server_metrics": {"spec_decode_mean_acceptance_length": accepted}})


K2 = {"SERVE_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2}'}


@pytest.mark.parametrize("records,argv,message", [
    ([fake("p", 2.0, {}), fake("s", 4.0, K2, accepted=2.4)], [], "accepted drafts"),
    ([fake("p", 2.0, {}), fake("s", 4.0, K2, gpu="H")], [], "a step's cost compares on one GPU"),
    ([fake("p", 2.0, K2), fake("s", 4.0, K2)], [], "--plain p speculates"),
    ([fake("p", 2.0, {}), fake("s", 4.0, {})], [], "s: its records name no speculation"),
    ([fake("p", 2.0, {}), fake("s", 4.0, K2)], ["--tokens-per-step", "4=3"], "K = 4: no --spec rung"),
])
def test_rounds_that_cannot_give_a_step_cost_are_refused(records, argv, message):
    args = mp.build_parser().parse_args(["--plain", "p", "--spec", "s", "--stamp", "20261128", *argv])
    with pytest.raises(ProjectionError, match=message):
        mp.rows_for(records, args, mp.parse_taus(args.tokens_per_step))


def test_the_page_from_the_committed_records(tmp_path):
    out = tmp_path / "p.md"
    base = ["--plain", "qwen35-4b-proxy-fp8-static", "--spec", "qwen35-4b-proxy-fp8-static-mtp3", "--out", str(out)]
    assert mp.main([*base, "--stamp", "20261128-01", "--tokens-per-step", "3=3", "--source", "a test"]) == 0
    text = out.read_text()
    assert text.startswith("# PROJECTION (not a measurement)") and "| qwen35-4b-proxy-fp8-static-mtp3 | vLLM | 3 |" in text
    assert "experiments/qwen35-4b-proxy-fp8-static-mtp3/latency_20261128-013211.json" in text
    assert mp.main([*base, "--stamp", "19990101"]) == 2
    assert mp.main([*base, "--stamp", "20261128-01", "--tokens-per-step", "3=3"]) == 2  # a figure without its source


def test_target_projection_by_hand():
    # on the measured GPU: 8 GB at 4 TB/s x 0.8 = 2.5 ms of a 3 ms plain step (fixed 0.5); K=2 adds 1 ms a draft, of
    # which its 1.6 GB take 0.5 ms; on a 600 GB/s target (fit: fixed 1 ms, 4-bit step 10 ms, BF16 20 ms) a draft reads
    # 1.6 GB in 3.333 ms plus 0.5 ms x 1 / 0.5 of the rest: TPOT' 10 + 2 x 4.333
    out = mp.project_target(3.0, 5.0, 2, 8e9, 1.6e9, 4e12, 0.8, {"fixed_ms": 1.0, "tpot_cand_ms": 10.0,
                                                                  "tpot_bf16_ms": 20.0}, 600, [2.5])
    assert out["fixed_ms"] == pytest.approx(0.5) and out["rest_ms"] == pytest.approx(0.5)
    assert out["per_draft_target_ms"] == pytest.approx(1.6e9 / 480e9 * 1e3 + 1.0)
    assert out["tpot_spec_target_ms"] == pytest.approx(10 + 2 * (10 / 3 + 1))
    assert out["over_bf16"][2.5] == pytest.approx(20 * 2.5 / (10 + 2 * (10 / 3 + 1)))
    assert out["over_cand"][2.5] == pytest.approx(10 * 2.5 / (10 + 2 * (10 / 3 + 1)))
    assert out["break_even_target"] == pytest.approx((10 + 2 * (10 / 3 + 1)) / 10)
    # the rest kept as measured (0.5 ms, not 1 ms) in the second column
    assert out["tpot_spec_target_rest_as_measured_ms"] == pytest.approx(10 + 2 * (10 / 3 + 0.5))
    # a draft cheaper than its bytes at e leaves no rest to scale; a plain step inside its weights' time is refused
    assert mp.project_target(3.0, 3.2, 2, 8e9, 1.6e9, 4e12, 0.8, {"fixed_ms": 1.0, "tpot_cand_ms": 10.0,
                                                                   "tpot_bf16_ms": 20.0}, 600, [])["rest_ms"] == 0
    with pytest.raises(ProjectionError, match="no fixed cost"):
        mp.project_target(2.0, 3.0, 2, 8e9, 1.6e9, 4e12, 0.8, {"fixed_ms": 1.0, "tpot_cand_ms": 10.0,
                                                                "tpot_bf16_ms": 20.0}, 600, [])


def test_output_layer_shape_from_the_shape_config():
    assert mp.output_layer_shape("v", {"SOURCE": "config-only:qwen35-4b"}) == (248320, 2560)
    assert mp.output_layer_shape("v", {"SOURCE": "config-only:qwen35-27b:w4a16"}) == (248320, 5120)
    with pytest.raises(ProjectionError, match="output layer's size is unknown"):
        mp.output_layer_shape("v", {"SOURCE": "hf:Qwen/Qwen3.5-4B"})


def test_output_layer_shape_of_a_lever_rung_from_its_parent():
    # qwen35-4b-proxy-fp8-static is SOURCE=lever, PARENT=qwen35-4b-proxy-bf16 (shape-proxy:qwen35-4b)
    assert mp.output_layer_shape("v", {"SOURCE": "lever", "PARENT": "qwen35-4b-proxy-bf16"}) == (248320, 2560)


def test_output_layer_shape_of_a_pruned_head():
    assert mp.output_layer_shape("v", {"SOURCE": "lever", "PARENT": "qwen35-4b-proxy-bf16", "PRUNE_KEEP": "65536"}) \
        == (65536, 2560)


def test_a_draft_vocabulary_is_its_keep_lists_rows(tmp_path):
    # the committed rung's token map: the vocabulary lever's 65,536-id keep list
    assert mp.draft_vocabulary("v", load_variant("qwen35-4b-dummy-sglang-mtp3-hot64k").settings) == 65536
    assert mp.draft_vocabulary("v", {"SGLANG_SPECULATIVE_NUM_STEPS": "3"}) is None
    bad = tmp_path / "keep.json"
    bad.write_text("{}")
    with pytest.raises(ProjectionError, match="its token map .* is not a readable keep list"):
        mp.draft_vocabulary("v", {"SGLANG_SPECULATIVE_TOKEN_MAP": str(bad)})
    with pytest.raises(ProjectionError, match="not one of the lab's keep lists"):  # SGLang's own torch file
        mp.draft_vocabulary("v", {"SGLANG_SPECULATIVE_TOKEN_MAP": "maps/hot.pt"})
