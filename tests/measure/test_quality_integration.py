"""The real lm-evaluation-harness and the parity metrics against the real embedded server (shared fixture)."""

from __future__ import annotations

import json

import pytest

from scripts.common import gate, paths
from scripts.measure import identity as eval_identity
from scripts.measure import parity as eval_parity
from scripts.measure import quality as eval_quality
from scripts.report import schemas as check_schemas

pytestmark = pytest.mark.slow


def newest_quality(tmp_dir):
    (path,) = sorted(tmp_dir.glob("quality_*.json"))[-1:]
    return path, json.loads(path.read_text())


def test_lm_eval_smoke_on_plumbing_tasks(embedded_server, tmp_path, monkeypatch):
    """Real lm-eval, both model types (log-likelihood via completions, generation via chat), record validated."""
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path)
    (tmp_path / "smollm2-bf16").mkdir()
    (tmp_path / "smollm2-bf16" / "config.env").write_text(
        (paths.ROOT / "experiments" / "smollm2-bf16" / "config.env").read_text())
    code = eval_quality.main(["smollm2-bf16", "--profile", "smoke", "--base-url", embedded_server.base_url])
    assert code == 0
    path, rec = newest_quality(tmp_path / "smollm2-bf16")
    assert check_schemas.check_file(path) == []
    tasks = rec["summary"]["tasks"]
    assert set(tasks) == {"lab_arith_mc", "lab_arith_gen", "lab_ifeval"}
    assert tasks["lab_arith_mc"]["n"] == 5 and 0 <= tasks["lab_arith_mc"]["acc"] <= 1
    assert "acc_stderr" in tasks["lab_arith_mc"]
    assert rec["inputs"]["plumbing"] is True
    assert len([s for s in rec["samples"] if s["task"] == "lab_ifeval"]) == 5
    assert all(isinstance(s["item_id"], str) and s["score"] in (0.0, 1.0) for s in rec["samples"])
    assert rec["inputs"]["task_meta"]["lab_arith_mc"]["version"] == "2.0"
    # The same record as a variant of itself: five agreeing items never certify parity (inconclusive, never pass)
    (tmp_path / "smollm2-self").mkdir()
    (tmp_path / "smollm2-self" / "config.env").write_text(
        "MODEL=weights/SmolLM2-135M-Instruct\nBASE=smollm2\nPARENT=smollm2-bf16\nGATE_MAX_TASK_DROP=2.0\n")
    (tmp_path / "smollm2-self" / path.name).write_text(json.dumps({**rec, "variant": "smollm2-self"}))
    crit = gate.gate_for("smollm2-self", {"PARENT": "smollm2-bf16", "GATE_MAX_TASK_DROP": "2.0"}, tmp_path)[1]
    assert [c.status for c in crit] == ["inconclusive"] * 3 and all(c.value == 0 for c in crit)
    assert all("paired items would decide it" in c.decide for c in crit)


def test_greedy_identity_of_a_server_with_itself(embedded_server, tmp_path):
    """eval_identity end to end on the shared server as both variant and reference: batch 1 and batch 4 outputs
    equal the batch-1 reference up to teacher-forced near-ties, and the record is valid."""
    code = eval_identity.main(["smollm2-bf16", "--reference", "smollm2-bf16", "--limit", "4", "--max-tokens", "24",
                               "--concurrency", "1,4", "--var-url", embedded_server.base_url,
                               "--ref-url", embedded_server.base_url, "--out-dir", str(tmp_path)])
    path, rec = newest_quality(tmp_path)
    assert code == 0 and check_schemas.check_file(path) == []
    s = rec["summary"]["per_concurrency"]
    assert s["1"]["identical"] == 4 and s["4"]["divergences_beyond_tie"] == 0


def test_quality_eval_refuses_missing_datasets(capsys):
    assert eval_quality.main(["smollm2-bf16", "--tasks", "mmlu_pro", "--base-url", "http://127.0.0.1:9"]) == 1
    err = capsys.readouterr().err
    assert "task data not cached: mmlu_pro needs TIGER-Lab/MMLU-Pro" in err and "make datasets" in err


def test_parity_vllm_path_of_a_server_against_itself_is_zero(embedded_server, tmp_path):
    """Same server as reference and variant: KLD must be ~0 and top-1 agreement 100% (a test that can fail)."""
    code = eval_parity.main(["smollm2-bf16", "--reference", "smollm2-bf16", "--backend", "vllm", "--corpus",
                             "cpython-docs", "--tokens", "256", "--ctx", "256", "--ref-url", embedded_server.base_url,
                             "--var-url", embedded_server.base_url, "--out-dir", str(tmp_path)])
    assert code == 0
    path, rec = newest_quality(tmp_path)
    assert check_schemas.check_file(path) == []
    p = rec["summary"]["parity"]
    assert p["tokens"] == 256 and p["mean_kld"] < 1e-3 and p["top1_agreement"] == 1.0
    assert p["ppl_ref"] == pytest.approx(p["ppl_var"])


def test_parity_transformers_path_against_vllm(embedded_weights, tmp_path):
    """transformers' BF16 distributions vs themselves: exactly zero."""
    code = eval_parity.main(["smollm2-bf16", "--reference", "smollm2-bf16", "--corpus", "cpython-docs",
                             "--tokens", "128", "--ctx", "256", "--out-dir", str(tmp_path)])
    assert code == 0
    _, rec = newest_quality(tmp_path)
    assert rec["summary"]["parity"]["mean_kld"] == pytest.approx(0.0, abs=1e-6)
