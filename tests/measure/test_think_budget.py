"""scripts.measure.think_budget: the span counting and summary math by hand; then (slow) the thinking budget on the
real vLLM CPU server with the reasoning-shaped fixture (qwen35-tiny-shortcot: random weights, the real Qwen3.5
tokenizer and thinking template), one server for the module."""

from __future__ import annotations

import json

import pytest

from scripts.measure import think_budget as tb

S, E = [7], [8]  # stand-ins for <think> and </think>


@pytest.mark.parametrize(("prompt", "output", "end", "want"), [
    # the template opens the span in the prompt ("<think>", "\n"): one span token is the prompt's
    ([1, 7, 5], [4, 4, 8, 6, 6, 6], E, dict(opened=True, prompt_think=1, think=2, end_at=2, content=3, tokens=3,
                                             content_start=3)),
    ([1, 7, 5], [8, 6], E, dict(opened=True, prompt_think=1, think=0, end_at=0, content=1, tokens=1, content_start=1)),
    ([1, 7, 5], [4, 4, 4], E, dict(opened=True, prompt_think=1, think=3, end_at=None, content=0, tokens=4,
                                   content_start=None)),
    # the model opens the span itself: tokens before its <think> are not thinking
    ([1, 2], [3, 7, 4, 8, 6], E, dict(opened=True, prompt_think=0, think=1, end_at=3, content=1, tokens=1,
                                      content_start=4)),
    # a two-token end string
    ([7], [4, 8, 9, 6], [8, 9], dict(opened=True, prompt_think=0, think=1, end_at=1, content=1, content_start=3)),
    # a closed span in the prompt and no new one: nothing to count
    ([7, 5, 8, 1], [4, 8, 6], E, dict(opened=False, prompt_think=0, think=0, end_at=1, content=1)),
    ([1], [], E, dict(opened=False, think=0, end_at=None, content=0, content_start=None)),
])
def test_think_span_by_hand(prompt, output, end, want):
    span = tb.think_span(prompt, output, S, end)
    assert {k: getattr(span, k) for k in want} == want


@pytest.mark.parametrize(("output", "budget", "want"), [
    ([4, 4, 8, 6], 3, True),  # 1 prompt + 2 generated = 3 = the budget: forced there
    ([4, 4, 8, 6], 5, False),  # closed before the budget: on its own
    ([4, 4, 8, 6], None, False),  # no budget, nothing forced
    ([8, 6], 0, True),  # budget 0 with one span token in the prompt: ended at once
    ([8, 6], 1, True),
    ([4, 4, 4], 3, False),  # never closed: the cap did not hold
])
def test_forced_is_the_end_exactly_where_the_budget_puts_it(output, budget, want):
    assert tb.forced(tb.think_span([1, 7, 5], output, S, E), budget) is want


def test_timings_to_first_content_token_and_to_the_answer_length():
    times = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]
    span = tb.think_span([1, 7, 5], [4, 4, 8, 6, 6, 6], S, E)  # content starts at output index 3
    assert tb.timings(times, span, 2) == (0.4, 0.5)
    assert tb.timings(times, span, 10) == (0.4, 0.6)  # fewer content tokens than asked: the last one
    assert tb.timings(times, tb.think_span([1, 7], [4] * 6, S, E), 2) == (None, 0.6)
    assert tb.timings([], span, 2) == (None, None)


def sample(think: int, forced: bool, ttft: float | None, e2e: float, ok: bool = True) -> dict:
    return {"ok": ok, "think_tokens": think, "span_tokens": think + 1, "closed": forced, "forced": forced,
            "content_tokens": 2 if forced else 0, "ttft_content_s": ttft, "e2e_s": e2e}


def test_budget_summary_by_hand():
    rows = [sample(3, True, 0.1, 0.2), sample(5, False, 0.3, 0.4), sample(99, False, None, 9.0, ok=False)]
    got = tb.budget_summary(rows, 4)
    assert got["requests"] == 3 and got["ok"] == 2
    assert got["think_tokens_max"] == 5 and got["think_tokens_mean"] == 4.0 and got["span_tokens_max"] == 6
    assert got["forced"] == 1 and got["forced_end"] == "1 of 2" and got["content_followed"] == 1
    assert got["cap_held"] is False  # 5 > 4
    assert got["median_ttft_content_ms"] == pytest.approx(200.0) and got["median_e2e_ms"] == pytest.approx(300.0)
    assert tb.budget_summary(rows, 5)["cap_held"] is True
    assert tb.budget_summary(rows, None)["cap_held"] is None
    assert tb.budget_summary([sample(3, True, 0.1, 0.2)], 3)["forced_end"] == "yes"
    assert tb.budget_summary([sample(3, False, None, 0.2)], None)["forced_end"] == "no"


@pytest.mark.parametrize(("text", "want"), [("none,1024,256,64,0", [None, 1024, 256, 64, 0]), ("8", [8])])
def test_parse_budgets(text, want):
    assert tb.parse_budgets(text) == want


@pytest.mark.parametrize("text", ["-1", "2.5", "none,x", "", " , "])
def test_parse_budgets_refuses_what_is_no_budget(text):
    with pytest.raises(ValueError, match="--budgets"):
        tb.parse_budgets(text)


@pytest.mark.parametrize(("argv", "message"), [
    (["qwen35-tiny-shortcot", "--budgets", "-5"], "error: --budgets '-5'"),
    (["smollm2-bf16"], "error: smollm2-bf16 has no reasoning configuration"),  # before any server starts
    (["qwen35-tiny-shortcot", "--requests", "999"], "error: --requests 999: eval/prompts/latency-v1.jsonl holds 16"),
])
def test_bad_input_exits_2_with_one_line_before_any_server(capsys, argv, message):
    assert tb.main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(message) and "\n" not in err


# --- the real vLLM CPU server with the fixture ---------------------------------------------------------------------
FIXTURE = "qwen35-tiny-shortcot"
THINK, END_THINK = 248068, 248069  # the real Qwen3.5 tokenizer's <think> and </think>
MESSAGES = [[{"role": "user", "content": q}] for q in ("What is 7 times 8?", "Name a primary color.")]


@pytest.fixture(scope="module")
def fixture_server(tmp_path_factory):
    """The fixture variant served once for this module (eager, 2 layers, 2048-token context)."""
    from scripts.weights.download import for_variant
    from tests.conftest import serve

    for_variant(FIXTURE)
    with serve(FIXTURE, tmp_path_factory.mktemp("think"), []) as s:
        yield s


def chat(server, messages: list[dict], max_tokens: int, **extra) -> dict:
    from scripts.common.server import http_post_json

    status, answer = http_post_json(f"{server.base_url}/v1/chat/completions", {
        "model": FIXTURE, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True, **extra}, timeout=120)
    assert status == 200, answer
    return answer


def variant_budget() -> int:
    from scripts.common.variants import load_variant

    return int(load_variant(FIXTURE).resolved["THINK_BUDGET"])


@pytest.mark.slow
def test_the_variant_budget_caps_every_answer_and_content_follows(fixture_server):
    budget = variant_budget()  # the request sets none: the guard adds the variant's
    max_tokens = budget + 1 + 4
    for messages in MESSAGES:
        r = chat(fixture_server, messages, max_tokens)
        prompt, out = r["prompt_token_ids"], r["choices"][0]["token_ids"]
        assert prompt[-2] == THINK, "the template opens the think span in the prompt"
        span = tb.think_span(prompt, out, [THINK], [END_THINK])
        assert span.closed and span.think <= budget and tb.forced(span, budget), span
        assert span.content == max_tokens - span.think - 1 > 0, span
        assert r["choices"][0]["message"]["content"], "content follows </think>"
        assert r["choices"][0]["message"]["reasoning"], "the parser splits the reasoning off"


@pytest.mark.slow
def test_a_request_budget_wins_and_without_one_the_cap_is_absent(fixture_server):
    budget = variant_budget()
    r = chat(fixture_server, MESSAGES[0], 12, thinking_token_budget=4)
    span = tb.think_span(r["prompt_token_ids"], r["choices"][0]["token_ids"], [THINK], [END_THINK])
    assert span.closed and span.think == 3 and span.content == 12 - 3 - 1  # 1 prompt + 3 generated = 4
    r = chat(fixture_server, MESSAGES[0], budget + 40, thinking_token_budget=-1)  # -1: no budget
    span = tb.think_span(r["prompt_token_ids"], r["choices"][0]["token_ids"], [THINK], [END_THINK])
    assert not span.closed and span.think == budget + 40 and not r["choices"][0]["message"]["content"]


@pytest.mark.slow
def test_measuring_script_writes_a_valid_record(fixture_server, tmp_path):
    from scripts.report.schemas import check_file

    assert tb.main([FIXTURE, "--base-url", fixture_server.base_url, "--budgets", "none,16,0", "--requests", "2",
                    "--answer-tokens", "4", "--out-dir", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("think_*.json")
    assert check_file(path) == []
    summary = json.loads(path.read_text())["summary"]
    assert summary["16"]["cap_held"] and summary["16"]["forced_end"] == "yes" and summary["16"]["think_tokens_max"] == 15
    assert summary["0"]["think_tokens_max"] == 0 and summary["0"]["content_followed"] == 2
    assert summary["none"]["closed"] == 0 and summary["none"]["think_tokens_max"] == 16 + 1 + 4
    assert summary["none"]["median_ttft_content_ms"] is None
