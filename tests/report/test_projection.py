"""The A10G projection from a weights-dominated shape (scripts/report/projection.py): the fit and the projection against
hand-computed numbers, its refusal, and the page written from the committed 27B and 4B records."""

from __future__ import annotations

import pytest

from scripts.report import projection


def test_fit_and_projection_by_hand():
    # the shape: 8 GB of BF16 at 1 TB/s x 0.8 = 10 ms of weights in an 11 ms step (fixed 1 ms); the candidate's 2 GB
    # in 5 ms - 1 ms = 4 ms: e = 2e9 / (1e12 x 4e-3) = 0.5
    out = projection.project(11.0, 5.0, 8e9, 2e9, 1e12, 0.8, 4e9, 1e9, 500.0)
    assert out["fit"]["fixed_ms"] == pytest.approx(1.0) and out["fit"]["e_cand"] == pytest.approx(0.5)
    # the target: 4 GB at 500 GB/s x 0.8 = 10 ms, fixed kept at 1/10 of it = 1 ms; the candidate 1 + 1e9/(5e11 x 0.5) = 5 ms
    t = out["target"]
    assert t["tpot_bf16_ms"] == pytest.approx(11.0) and t["tpot_cand_ms"] == pytest.approx(5.0)
    assert t["speedup"] == pytest.approx(2.2) and t["speedup_at_e_bf16"] == pytest.approx(11.0 / 3.5)


def test_a_fit_without_room_for_fixed_cost_is_refused():
    with pytest.raises(projection.ProjectionError, match="the fit has no room"):
        projection.project(10.0, 5.0, 8e9, 2e9, 1e12, 0.8, 4e9, 1e9, 500.0)


def test_the_page_from_the_committed_records(tmp_path):
    out = tmp_path / "p.md"
    assert projection.main(["--out", str(out)]) == 0
    text = out.read_text()
    assert text.startswith("# PROJECTION (not a measurement)") and "| qwen35-4b-proxy-w4a16-marlin (e_cand" in text
    assert "experiments/qwen35-27b-dummy-bf16/latency_20261128-131823.json" in text
    assert projection.main(["--ladder", "no-such-ladder", "--out", str(out)]) == 2


def test_per_kernel_projection_by_hand():
    # the fit's fixed time is 1/10 of its BF16 weight time; the target: 4 GB at 500 GB/s x 0.8 = 10 ms, fixed 1 ms; the
    # candidate: 1 GB packed at e 0.5 (4 ms) and 0.5 GB of the rest at e 0.8 (1.25 ms)
    r = projection.project_kernel(0.1, 4e9, 1e9, 0.5e9, 0.8, 0.5, 500.0)
    assert r["fixed_ms"] == pytest.approx(1.0) and r["tpot_bf16_ms"] == pytest.approx(11.0)
    assert r["tpot_cand_ms"] == pytest.approx(1.0 + 4.0 + 1.25) and r["speedup"] == pytest.approx(11.0 / 6.25)


def test_the_per_kernel_page_from_the_committed_records(tmp_path):
    out, gemm = tmp_path / "p.md", "results/gpu-kernels-20261207b/gemm_20261207-102219.json"
    assert projection.main(["--out", str(out), "--kernels-from", gemm]) == 0
    text = out.read_text()
    assert "## Per kernel" in text and "| lab-gemv-stream | 0.681 |" in text and "| vllm-marlin | 0.506 |" in text
    assert projection.main(["--out", str(out), "--kernels-from", gemm, "--kernels", "no-such-kernel"]) == 2


@pytest.mark.parametrize("content", ["{not json", '["a list"]', '{"summary": {}}', b"\xff\xfe\x00"])
def test_a_bad_kernels_record_is_one_line(tmp_path, capsys, content):
    bad, out = tmp_path / "gemm.json", tmp_path / "p.md"
    (bad.write_bytes if isinstance(content, bytes) else bad.write_text)(content)
    assert projection.main(["--out", str(out), "--kernels-from", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: ") and "gemm.json" in err and "\n" not in err and not out.exists()
    assert projection.main(["--out", str(out), "--kernels-from", str(tmp_path / "missing.json")]) == 2
    with pytest.raises(SystemExit) as e:
        projection.main(["--kernels", ","])
    assert e.value.code == 2
