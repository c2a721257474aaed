"""Parity math, the gate (fixtures that pass and fail), corpus and plumbing data (no server)."""

from __future__ import annotations

import math

import pytest

from scripts import eval_parity, gate, make_plumbing_tasks
from scripts.common import gate as gate_lib
from scripts.common import records
from scripts.common.corpus import cpython_docs
from scripts.common.metrics import parity_stats
from scripts.common.variants import load_variant


def test_parity_stats_by_hand():
    s = parity_stats([0.0, 0.2, 0.1, 0.1], [True, False, True, True], [1.0, 1.0, 1.0, 1.0], [1.0, 2.0, 1.0, 0.0])
    assert s["tokens"] == 4 and s["mean_kld"] == pytest.approx(0.1)
    assert s["top1_agreement"] == 0.75 and s["top1_agreement_se"] == pytest.approx(math.sqrt(0.75 * 0.25 / 4))
    assert s["ppl_ref"] == pytest.approx(math.e) and s["ppl_var"] == pytest.approx(math.e)
    assert s["ppl_ratio"] == pytest.approx(1.0) and s["max_kld"] == 0.2
    with pytest.raises(ValueError):
        parity_stats([], [], [], [])


def test_topk_kl_is_zero_for_identical_and_positive_otherwise():
    ref = {1: math.log(0.5), 2: math.log(0.3), 3: math.log(0.1)}
    assert eval_parity.topk_kl(ref, dict(ref)) == pytest.approx(0.0, abs=1e-9)
    assert eval_parity.topk_kl(ref, {1: math.log(0.1), 2: math.log(0.6), 3: math.log(0.2)}) > 0.3


def test_chunks_refuse_a_short_corpus():
    with pytest.raises(eval_parity.ParityError, match="shorter than one context of 512"):
        eval_parity.make_chunks(list(range(100)), 64, 512)
    with pytest.raises(eval_parity.ParityError, match="need 4 to score"):
        eval_parity.make_chunks(list(range(1000)), 1024, 512)
    assert [len(c) for c in eval_parity.make_chunks(list(range(1100)), 500, 512)] == [512, 512]


def test_cpython_corpus_is_deterministic_and_big_enough():
    a, b = cpython_docs(), cpython_docs()
    assert a.sha256 == b.sha256 and a.name.startswith("cpython-") and len(a.text) > 100_000


def test_plumbing_data_is_generated_by_the_committed_script():
    for name, text in make_plumbing_tasks.render().items():
        assert (make_plumbing_tasks.DATA / name).read_text() == text, f"{name}: run python -m scripts.make_plumbing_tasks"


PASS_PARITY = {"mean_kld": 0.01, "top1_agreement": 0.95, "ppl_ratio": 1.01}
SETTINGS = {"PARENT": "x-bf16", "GATE_MAX_MEAN_KLD": "0.05", "GATE_MIN_TOP1": "0.9", "GATE_MAX_PPL_RATIO": "1.05",
            "GATE_MAX_TASK_DROP": "2"}


def test_gate_passes():
    crit = gate_lib.evaluate_gate(SETTINGS, PASS_PARITY, {"t": {"acc": 0.50, "n": 10}}, {"t": {"acc": 0.51, "n": 10}})
    assert gate_lib.verdict(crit) == "pass" and len(crit) == 4


@pytest.mark.parametrize("parity, var_acc, failing", [
    ({**PASS_PARITY, "mean_kld": 0.151}, 0.50, "GATE_MAX_MEAN_KLD"),
    ({**PASS_PARITY, "top1_agreement": 0.81}, 0.50, "GATE_MIN_TOP1"),
    ({**PASS_PARITY, "ppl_ratio": 1.17}, 0.50, "GATE_MAX_PPL_RATIO"),
    (PASS_PARITY, 0.40, "GATE_MAX_TASK_DROP[t]"),
])
def test_gate_fails(parity, var_acc, failing):
    crit = gate_lib.evaluate_gate(SETTINGS, parity, {"t": {"acc": var_acc, "n": 10}}, {"t": {"acc": 0.51, "n": 10}})
    assert gate_lib.verdict(crit) == "fail"
    assert [c.name for c in crit if c.status == "fail"] == [failing]


def test_gate_missing_records_is_not_a_pass():
    crit = gate_lib.evaluate_gate(SETTINGS, None, None, None)
    assert gate_lib.verdict(crit) == "missing" and all(c.status == "missing" for c in crit)


def quality_record(variant: str, summary: dict, inputs: dict) -> dict:
    rec = records.envelope("quality", load_variant("smollm2-bf16", target="cpu"), command=["x"], server_command=None)
    rec.update(variant=variant, summary=summary, inputs=inputs, samples=[{"chunk": 0, "tokens": 1, "mean_kld": 0.0}])
    return rec


def test_gate_from_record_files(tmp_path):
    for name, cfg in (("x-bf16", "MODEL=weights/x\nBASE=x\n"),
                      ("x-int8", "MODEL=weights/y\nBASE=x\nPARENT=x-bf16\nGATE_MAX_MEAN_KLD=0.05\nGATE_MIN_TOP1=0.9\n")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.env").write_text(cfg)
    settings = load_variant("x-int8", root=tmp_path, target="cpu").resolved
    assert gate_lib.gate_for("x-int8", settings, tmp_path)[1][0].status == "missing"
    records.write_record(quality_record("x-int8", {"parity": {**PASS_PARITY, "mean_kld": 0.2}},
                                        {"kind": "parity", "reference": "x-bf16"}), tmp_path / "x-int8", "quality")
    ref, crit = gate_lib.gate_for("x-int8", settings, tmp_path)
    assert ref == "x-bf16" and gate_lib.verdict(crit) == "fail"
    assert gate_lib.gate_for("x-bf16", {"MODEL": "m"}, tmp_path) == (None, [])


def test_gate_cli_on_a_reference_variant(capsys):
    assert gate.main(["smollm2-bf16"]) == 0
    assert "reference variant" in capsys.readouterr().out


def test_parity_refuses_different_tokenizers(monkeypatch):
    from pathlib import Path

    from scripts.common.variants import Variant

    monkeypatch.setattr(eval_parity, "tokenizer_fingerprint", lambda d: d)  # a tokenizer per directory name
    a = Variant("a-x", Path("/a"), {}, {"MODEL": "m", "BASE": "a", "TOKENIZER": "tok-pruned"})
    b = Variant("a-bf16", Path("/b"), {}, {"MODEL": "m", "BASE": "a", "TOKENIZER": "tok-full"})
    with pytest.raises(eval_parity.ParityError, match="different tokenizers"):
        eval_parity.check_same_tokenizer(a, b)
    eval_parity.check_same_tokenizer(a, a)


def test_calibration_samples_never_contain_the_evaluated_text(embedded_weights):
    from transformers import AutoTokenizer

    from scripts.common.corpus import EVAL_FRACTION, build_samples, passages

    corpus = cpython_docs()
    evaluated = passages(corpus.text[:int(len(corpus.text) * EVAL_FRACTION)], min_chars=200)
    ds, info = build_samples(AutoTokenizer.from_pretrained(embedded_weights), 64, 256)
    joined = "\n".join(ds["text"])
    assert "held out for evaluation" in info["corpus"]
    assert not any(p[:200] in joined for p in evaluated[1:-1])  # the boundary passage may straddle the cut


def test_parity_refuses_to_read_past_the_held_out_text(embedded_weights, capsys):
    assert eval_parity.main(["smollm2-bf16", "--reference", "smollm2-bf16", "--corpus", "cpython-docs",
                             "--tokens", "16384"]) == 1
    assert "held out from calibration" in capsys.readouterr().err
