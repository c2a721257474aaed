"""The real vLLM server on the embedded model, started through scripts/serve/__main__.py (session fixture), no mocks."""

from __future__ import annotations

import concurrent.futures as cf
import json
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings

from scripts.common.metrics import near_tie
from scripts.common.server import http_get
from scripts.measure import fuzz
from tests.conftest import EMBEDDED_VARIANT, teacher_forced_gaps

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three prime numbers.",
    "Explain what a CPU does in one sentence.",
]
MAX_TOKENS = 24
# BF16 near-tie: at every generated token, transformers (fed vLLM's own prefix) must rate vLLM's pick within
# TIE_NATS of its own argmax (scripts/common/metrics.py says why).


def client(server):
    from scripts.common.loadgen import openai_client

    return openai_client(server.base_url, timeout=120)


def chat_ids(server, prompt: str) -> tuple[list[int], list[int], str]:
    r = client(server).chat.completions.create(
        model=server.variant, messages=[{"role": "user", "content": prompt}], max_tokens=MAX_TOKENS, temperature=0,
        extra_body={"return_token_ids": True},
    )
    d = r.model_dump()
    return d["prompt_token_ids"], d["choices"][0]["token_ids"], d["choices"][0]["message"]["content"]


def test_greedy_parity_batched(embedded_server, hf_reference):
    """Four concurrent greedy chats: same prompt tokens as transformers' chat template, and every generated token
    transformers' greedy choice up to a BF16 near-tie (teacher-forced on vLLM's own text)."""
    model, tok = hf_reference
    with cf.ThreadPoolExecutor(len(PROMPTS)) as ex:
        results = list(ex.map(lambda p: chat_ids(embedded_server, p), PROMPTS))
    report = []
    for prompt, (prompt_ids, got, text) in zip(PROMPTS, results, strict=True):
        expected_prompt = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"]
        assert prompt_ids == list(expected_prompt), "vLLM rendered the chat template differently from transformers"
        assert text.strip(), f"empty answer to {prompt!r}"
        gaps = teacher_forced_gaps(model, prompt_ids, got)
        worst = max(range(len(gaps)), key=gaps.__getitem__)
        report.append((prompt, round(gaps[worst], 3), worst, sum(g > 0 for g in gaps), text[:40]))
        assert near_tie(gaps[worst]), f"token {worst} is not transformers' greedy choice up to a near-tie: {report[-1]}"
    print("parity (prompt, worst gap nats, at token, non-argmax tokens, text):", *report, sep="\n  ")


def test_completion_and_models(embedded_server):
    c = client(embedded_server)
    assert [m.id for m in c.models.list().data] == [embedded_server.variant]
    r = c.completions.create(model=embedded_server.variant, prompt="The three primary colors are", max_tokens=16,
                             temperature=0)
    assert r.choices[0].text.strip()
    assert r.usage.completion_tokens > 0


def test_streaming_matches_non_streaming(embedded_server):
    c = client(embedded_server)
    messages = [{"role": "user", "content": PROMPTS[0]}]
    whole = c.chat.completions.create(model=embedded_server.variant, messages=messages, max_tokens=MAX_TOKENS,
                                      temperature=0).choices[0].message.content
    chunks = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(
        model=embedded_server.variant, messages=messages, max_tokens=MAX_TOKENS, temperature=0, stream=True)
        if ch.choices]
    assert len([c for c in chunks if c]) > 1, "no incremental chunks"
    assert "".join(chunks) == whole


def post_raw(server, path: str, body: bytes) -> tuple[int, dict]:
    req = urllib.request.Request(f"{server.base_url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def error_message(payload: dict) -> str:
    err = payload.get("error", payload)
    return err.get("message", "") if isinstance(err, dict) else str(err)


@pytest.mark.parametrize(
    "body, status",
    [
        (b'{"model": "smollm2-bf16", "messages": [', 400),  # bad JSON
        (json.dumps({"model": "smollm2-bf16", "messages": [{"role": "user", "content": "hi"}],
                     "max_tokens": 100_000}).encode(), 400),  # beyond the 8192-token context
        (json.dumps({"model": "no-such-model", "messages": [{"role": "user", "content": "hi"}]}).encode(), 404),
    ],
    ids=["bad-json", "max-tokens-beyond-context", "unknown-model"],
)
def test_malformed_requests_get_4xx_and_server_survives(embedded_server, body, status):
    got, payload = post_raw(embedded_server, "/v1/chat/completions", body)
    assert got == status, payload
    assert error_message(payload), f"no error message in {payload}"
    assert http_get(f"{embedded_server.base_url}/health")[0] == 200
    ok, _ = post_raw(embedded_server, "/v1/chat/completions", json.dumps(
        {"model": embedded_server.variant, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}).encode())
    assert ok == 200


def test_thinking_budget_without_a_reasoning_configuration_gets_vllms_400(embedded_server):
    """smollm2-bf16 has no reasoning configuration: vLLM refuses thinking_token_budget with its own message (400, not
    a 500), and the server stays healthy."""
    got, payload = post_raw(embedded_server, "/v1/chat/completions", json.dumps(
        {"model": embedded_server.variant, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4,
         "thinking_token_budget": 16}).encode())
    assert got == 400, payload
    assert "reasoning_config is not configured" in error_message(payload)
    assert http_get(f"{embedded_server.base_url}/health")[0] == 200


def test_metrics_exposed(embedded_server):
    status, body = http_get(f"{embedded_server.base_url}/metrics")
    assert status == 200 and b"vllm:" in body


# A vLLM server started with a key (its argv, every route behind it): tests/serve/test_replicas.py checks it on a
# replica, a server `make serve API_KEY=…` would start, rather than starting one more server here.


# ------------------------------------------------------------------------------- fuzzing the OpenAI endpoints
# Bodies drawn by hypothesis around a valid request of each endpoint: fields replaced by arbitrary JSON or edge
# values, unknown fields added, or raw bytes. Every answer must be 2xx or 4xx (never 5xx, never an error event with a
# 5xx code inside a stream, never a hang) and the server stays healthy. Lengths are clamped so a valid draw stays short.
FUZZ_CASES = 250


@settings(max_examples=FUZZ_CASES, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fuzz.fuzz_case(EMBEDDED_VARIANT))
def test_fuzzed_openai_bodies_get_2xx_or_4xx_and_the_server_stays_healthy(embedded_server, case):
    """scripts.measure.fuzz's bodies, one hypothesis example each (a failure shrinks to the smallest body)."""
    out = fuzz.send(embedded_server.base_url, *case, "/health")
    assert out["outcome"] == "ok", out
