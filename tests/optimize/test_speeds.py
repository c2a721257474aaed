"""make optimize's ladder speeds (scripts/optimize/speeds.py): a speculative rung's tokens a step, from the engine's own
count in its records."""

from __future__ import annotations

from scripts.optimize import speeds as sp

RECORDS = {"a1": {"server_metrics": {"spec_decode_mean_acceptance_length": 4.0}},
           "a2": {"server_metrics": {"spec_decode_mean_acceptance_length": 3.0}},
           "p1": {"server_metrics": {"spec_decode_mean_acceptance_length": None}}, "p2": {}}


def test_tokens_a_step_is_the_mean_over_the_rounds_that_report_it(monkeypatch):
    monkeypatch.setattr(sp, "read_record", RECORDS.__getitem__)
    s = sp.Speeds({"spec": ["a1", None, "a2"], "plain": ["p1", "p2"]})
    assert s.tokens_a_step("spec") == 3.5
    assert s.tokens_a_step("plain") is None and s.tokens_a_step("absent") is None
