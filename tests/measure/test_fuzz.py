"""The fuzz of the OpenAI bodies (scripts/measure/fuzz.py): its draws, clamping and verdict. The real servers:
tests/serve/test_serve_integration.py (vLLM, the session server) and tests/serve/test_engines.py (llama-server)."""

from __future__ import annotations

import json

import pytest

from scripts.measure import fuzz


def test_valid_lengths_are_clamped_and_a_missing_max_tokens_is_set():
    body = fuzz.clamped({"prompt": "x", "n": 20, "min_tokens": 10**7, "max_tokens": None})
    assert body == {"prompt": "x", "n": 8, "min_tokens": 10**7, "max_tokens": 8, "max_completion_tokens": 8}
    assert fuzz.clamped({"tokens": [1], "n": -3}) == {"tokens": [1], "n": -3}


def test_the_draws_repeat_in_one_process_and_name_the_served_model(monkeypatch):
    """Derandomized: the same bodies again in one process (hypothesis also draws from constants of the loaded modules,
    so another process with other modules loaded draws others; the script's own runs load the same)."""
    sent = []
    monkeypatch.setattr(fuzz, "send", lambda url, path, raw, health: sent.append((path, raw)) or {"outcome": "ok"})
    fuzz.run_cases("http://h", "my-model", 40, "/health")
    first, sent[:] = list(sent), []
    fuzz.run_cases("http://h", "my-model", 40, "/health")
    assert sent == first and len(first) == 40 and {p for p, _ in first} <= set(fuzz.BASE)
    def parsed(raw: bytes):
        try:
            return json.loads(raw)
        except (ValueError, RecursionError):  # the raw-bytes draws and the deeply nested ones
            return None

    bodies = [b for _, raw in first if isinstance(b := parsed(raw), dict)]
    models = {b.get("model") for b in bodies if isinstance(b.get("model"), str)}
    assert len(bodies) > 20 and "my-model" in models and "smollm2-bf16" not in models


@pytest.mark.parametrize("outcome", fuzz.FAILING)
def test_each_failing_outcome_fails_the_run(outcome):
    outs = [{"path": "/tokenize", "status": 200, "outcome": "ok"}, {"path": "/tokenize", "status": 500, "outcome": outcome}]
    s = fuzz.summarize(outs)
    assert not s["pass"] and s["criteria"][outcome]["value"] == 1
    assert s["by_path"] == {"/tokenize": {"200": 1, "500": 1}}
    assert fuzz.summarize(outs[:1])["pass"]
