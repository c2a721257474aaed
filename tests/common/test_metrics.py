"""Metric math on hand-made samples with hand-computed answers."""

from __future__ import annotations

import math

import pytest

from scripts.common.metrics import TIE_NATS, RequestSample, goodput, near_tie, percentile, ratio, summarize
from scripts.measure.prom import parse, server_counters


def test_percentile_matches_numpy_linear():
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([10], 99) == 10
    assert percentile([0, 10], 90) == pytest.approx(9.0)
    assert math.isnan(percentile([], 50))


def test_summary_by_hand():
    # request a: starts 0 s, first chunk at 0.1 s, 5 tokens, ends 0.5 s -> tpot (0.5-0.1)/4 = 0.1 s
    a = RequestSample("a", ok=True, start_s=0.0, end_s=0.5, prompt_tokens=10, output_tokens=5, ttft_s=0.1,
                      itl_s=[0.1, 0.1, 0.1, 0.1])
    # request b: starts 0.5 s, first chunk at 0.8 s, 3 tokens, ends 1.0 s -> tpot (0.5-0.3)/2 = 0.1 s
    b = RequestSample("b", ok=True, start_s=0.5, end_s=1.0, prompt_tokens=20, output_tokens=3, ttft_s=0.3,
                      itl_s=[0.05, 0.15])
    failed = RequestSample("c", ok=False, start_s=0.2, end_s=0.3, error="HTTP 500")
    s = summarize([a, b, failed])
    assert s["completed"] == 2 and s["failed"] == 1
    assert s["duration_s"] == pytest.approx(1.0)
    assert s["request_throughput"] == pytest.approx(2.0)
    assert s["output_throughput"] == pytest.approx(8.0)
    assert s["total_token_throughput"] == pytest.approx(38.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p99_ttft_ms"] == pytest.approx(100 + 200 * 0.99)
    assert s["mean_tpot_ms"] == pytest.approx(100.0)
    assert s["mean_itl_ms"] == pytest.approx(100.0) and s["median_itl_ms"] == pytest.approx(100.0)
    assert s["mean_e2el_ms"] == pytest.approx(500.0)


def test_single_token_request_has_no_tpot_and_empty_run_has_none():
    one = RequestSample("x", ok=True, start_s=0, end_s=0.2, output_tokens=1, ttft_s=0.2)
    assert one.tpot_s is None
    assert summarize([one])["mean_tpot_ms"] is None
    s = summarize([])
    assert s["completed"] == 0 and s["request_throughput"] is None


def test_ratio():
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, 0) is None


METRICS_BEFORE = """# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="16",num_gpu_blocks="100"} 1.0
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0"} 100.0
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0"} 10.0
# TYPE vllm:spec_decode_num_drafts counter
vllm:spec_decode_num_drafts_total{engine="0"} 0.0
# TYPE vllm:spec_decode_num_draft_tokens counter
vllm:spec_decode_num_draft_tokens_total{engine="0"} 0.0
# TYPE vllm:spec_decode_num_accepted_tokens counter
vllm:spec_decode_num_accepted_tokens_total{engine="0"} 0.0
"""


def test_server_counters_deltas_and_rates():
    after = (METRICS_BEFORE.replace("queries_total{engine=\"0\"} 100.0", "queries_total{engine=\"0\"} 300.0")
             .replace("hits_total{engine=\"0\"} 10.0", "hits_total{engine=\"0\"} 110.0")
             .replace("num_drafts_total{engine=\"0\"} 0.0", "num_drafts_total{engine=\"0\"} 10.0")
             .replace("draft_tokens_total{engine=\"0\"} 0.0", "draft_tokens_total{engine=\"0\"} 40.0")
             .replace("accepted_tokens_total{engine=\"0\"} 0.0", "accepted_tokens_total{engine=\"0\"} 20.0"))
    c = server_counters(parse(METRICS_BEFORE), parse(after))
    assert c["kv_cache_blocks"] == 100 and c["kv_cache_tokens"] == 1600
    assert c["prefix_cache_hit_rate"] == pytest.approx(0.5)
    assert c["spec_decode_acceptance_rate"] == pytest.approx(0.5)
    assert c["spec_decode_mean_acceptance_length"] == pytest.approx(3.0)
    assert c["spec_decode_acceptance_per_position"] is None  # no per-position series in this scrape
    assert server_counters(None, parse(after)) == {"available": False}
    per_pos = "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos counter\n" + "".join(
        f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",position="{i}"}} {n}\n'
        for i, n in enumerate((8.0, 6.0, 4.0, 2.0)))
    c = server_counters(parse(METRICS_BEFORE), parse(after + per_pos))
    assert c["spec_decode_acceptance_per_position"] == pytest.approx([0.8, 0.6, 0.4, 0.2])  # of 10 drafts


def phases(ttft_sum: float, prefill_sum: float, n: int) -> str:
    """Two of vLLM's request phase histograms after n requests (a bucket, the sum, the count)."""
    out = ""
    for name, total in (("vllm:time_to_first_token_seconds", ttft_sum), ("vllm:request_prefill_time_seconds",
                                                                          prefill_sum)):
        out += (f"# TYPE {name} histogram\n" + f'{name}_bucket{{engine="0",le="+Inf"}} {n}.0\n'
                + f'{name}_count{{engine="0"}} {n}.0\n' + f'{name}_sum{{engine="0"}} {total}\n')
    return out


def test_server_counters_give_each_request_phase_mean_between_scrapes():
    c = server_counters(parse(METRICS_BEFORE + phases(0.5, 0.2, 4)), parse(METRICS_BEFORE + phases(1.3, 0.5, 8)))
    # 4 requests in between: TTFT (1.3 - 0.5) / 4 s, prefill (0.5 - 0.2) / 4 s; no queue or decode histogram kept
    assert c["phase_ms"] == {"ttft": 200.0, "prefill": 75.0, "queue": None, "decode": None}
    assert c["phase_requests"] == {"ttft": 4.0, "prefill": 4.0, "queue": None, "decode": None}
    assert server_counters(parse(METRICS_BEFORE), parse(METRICS_BEFORE))["phase_ms"]["ttft"] is None


def test_drift_warnings():
    from scripts.measure.monitor import drift_warnings

    ref = {"record": "latency_x.json", "output_throughput": 100.0, "median_tpot_ms": 10.0}
    assert drift_warnings({"output_throughput": 85.0, "median_tpot_ms": 11.0}, ref, 0.2) == []
    w = drift_warnings({"output_throughput": 70.0, "median_tpot_ms": 13.0}, ref, 0.2)
    assert len(w) == 2 and "throughput 70.0" in w[0] and "TPOT 13.0" in w[1]
    assert drift_warnings({"output_throughput": 1.0}, None, 0.2) == []


def test_near_tie_is_inclusive_up_to_float32_rounding():
    import torch

    # a gap of exactly TIE_NATS as float32 log-softmax arithmetic delivers it (seen: 0.5000000596)
    gap = float(torch.tensor(100.5, dtype=torch.float32) - torch.tensor(100.0, dtype=torch.float32).nextafter(
        torch.tensor(0.0)))
    assert gap > TIE_NATS and near_tie(gap)
    assert near_tie(0.25) and not near_tie(0.625) and not near_tie(TIE_NATS + 1e-3)


# ------------------------------------------------------------------------------------------- speed over alternating rounds
def test_t_quantiles_match_the_tables():
    from scripts.common.metrics import t_quantile

    # two-sided 95% critical values of Student's t (any statistics table)
    for df, t in ((1, 12.7062), (2, 4.3027), (3, 3.1824), (4, 2.7764), (30, 2.0423)):
        assert t_quantile(0.975, df) == pytest.approx(t, abs=1e-4)


def test_speed_ratio_two_rounds_by_hand():
    from scripts.common.metrics import speed_ratio

    # log 1.60 = 0.470004, log 1.62 = 0.482426: mean 0.476215, sd 0.012422 / sqrt 2 = 0.0087837,
    # half width 12.7062 x 0.0087837 / sqrt 2 = 0.078918 -> exp(0.476215 -+ 0.078918) = 1.48778 .. 1.74216
    r = speed_ratio([(160.0, 100.0), (162.0, 100.0)])
    assert r.ratio == pytest.approx(1.60997, abs=1e-5)
    assert (r.lo, r.hi) == pytest.approx((1.48779, 1.74218), abs=1e-4)
    assert r.rounds == 2 and r.verdict == "faster" and r.faster
    assert r.text() == "1.61 [1.49, 1.74]"


def test_speed_ratio_tie_when_the_rounds_disagree():
    from scripts.common.metrics import speed_ratio

    # the same GPU pair measured 1.12x and 1.34x: log ratios 0.113329, 0.292670; sd 0.126813; half width
    # 12.7062 x 0.126813 / sqrt 2 = 1.139388 -> [exp(-0.936389), exp(1.342388)] = [0.392, 3.828]: holds 1.00
    r = speed_ratio([(1.12, 1.0), (1.34, 1.0)])
    assert r.ratio == pytest.approx(1.22507, abs=1e-5)
    assert r.lo == pytest.approx(0.39205, abs=1e-4) and r.hi == pytest.approx(3.8281, abs=1e-3)
    assert r.verdict == "tie" and not r.faster


def test_speed_ratio_three_rounds_slower_and_one_round():
    from scripts.common.metrics import speed_ratio

    # log 0.90, 0.91, 0.89 = -0.105361, -0.094311, -0.116534: mean -0.105402, sd 0.011112, t(0.975, 2) = 4.302653,
    # half 0.027603 -> [0.87546, 0.92515]
    r = speed_ratio([(90, 100), (91, 100), (89, 100)])
    assert (r.lo, r.hi) == pytest.approx((0.87546, 0.92515), abs=1e-5)
    assert r.verdict == "slower"
    one = speed_ratio([(50, 40)])
    assert one.ratio == 1.25 and one.lo is None and one.verdict == "one round" and not one.faster
    assert one.text() == "1.25 (1 round)"
    assert speed_ratio([(None, 40), (50, 0)]) is None


def test_an_end_rounding_to_one_shows_its_side():
    from scripts.common.metrics import SpeedRatio

    assert SpeedRatio(1.01, 1.004, 1.02, 3).text() == "1.01 [1.004, 1.02]"  # faster: the lower end is above 1.00
    assert SpeedRatio(0.97, 0.95, 0.9981, 3).text() == "0.97 [0.95, 0.998]"  # slower
    assert SpeedRatio(1.01, 0.996, 1.02, 3).text() == "1.01 [1.00, 1.02]"  # a tie holds 1.00 as it reads
    assert SpeedRatio(1.0, 1.0000000001, 1.0000000002, 2).text().startswith("1.00 [1.0000000001, ")


def test_goodput_counts_requests_within_both_targets():
    # a: TTFT 100 ms, TPOT (0.5-0.1)/4 = 100 ms; b: TTFT 300 ms, TPOT (0.5-0.3)/2 = 100 ms; one: a one-token answer
    # (no TPOT: its TTFT decides); failed: never counts
    a = RequestSample("a", ok=True, start_s=0.0, end_s=0.5, output_tokens=5, ttft_s=0.1)
    b = RequestSample("b", ok=True, start_s=0.5, end_s=1.0, output_tokens=3, ttft_s=0.3)
    one = RequestSample("one", ok=True, start_s=0.0, end_s=0.2, output_tokens=1, ttft_s=0.2)
    failed = RequestSample("c", ok=False, start_s=0.2, end_s=0.3, error="HTTP 500")
    g = goodput([a, b, one, failed], 2.0, ttft_ms=250, tpot_ms=101)
    assert g["requests"] == 2 and g["fraction"] == 0.5  # a and one; b's TTFT is over
    assert g["request_throughput"] == pytest.approx(1.0) and g["output_throughput"] == pytest.approx(3.0)
    assert goodput([a, b], 2.0, ttft_ms=1000, tpot_ms=99)["requests"] == 0  # both TPOTs are 100 ms
    assert goodput([a], 0.0, ttft_ms=1000, tpot_ms=1000)["output_throughput"] is None
