"""The soak (scripts/measure/soak.py): outcome rules on hand-made streams, and a short real soak of the session's vLLM
server whose record passes its schema."""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from scripts.measure import soak


def out(kind="chat"):
    return soak.Outcome(kind, "/v1/chat/completions", 1, 0)


def sse(*chunks) -> list[str]:
    return [f"data: {c if isinstance(c, str) else json.dumps(c)}" for c in chunks]


def test_a_stream_is_complete_only_with_done_after_every_choices_finish_reason():
    o = out()
    soak.read_stream(sse({"choices": [{"index": 0, "delta": {"content": "hi"}}]},
                         {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}, "[DONE]"), o, 0.0, False, 1)
    assert o.outcome == "complete" and o.chunks == 2 and o.ttft_ms is not None and o.passed
    o = out("n_choices")
    soak.read_stream(sse({"choices": [{"index": 1, "text": "a", "finish_reason": "stop"}]}, "[DONE]"), o, 0.0, False, 3)
    assert o.outcome == "truncated" and "1 of 3 choices" in o.message and not o.passed
    o = out()
    soak.read_stream(sse({"choices": [{"index": 0, "delta": {"content": "x"}}]}), o, 0.0, False, 1)
    assert o.outcome == "truncated" and "without [DONE]" in o.message


def test_a_stream_kept_open_past_the_timeout_is_a_hang():
    o = out()
    soak.read_stream([": ping"] * 3 + sse("[DONE]"), o, time.perf_counter() - 10, False, 1, timeout_s=5)
    assert o.outcome == "hang" and "stayed open" in o.message and not o.passed


def test_an_error_event_in_a_stream_and_a_dropped_client():
    o = out()
    soak.read_stream(sse({"error": {"message": "boom", "code": 500}}), o, 0.0, False, 1)
    assert (o.outcome, o.status, o.message) == ("stream_error", 500, "boom") and not o.passed
    o = out("logprobs_over_max")
    soak.read_stream(sse({"error": {"message": "logprobs of 21 > 20", "code": 400}}), o, 0.0, False, 1)
    assert (o.outcome, o.status) == ("rejected_in_stream", 400) and o.passed and not out().passed
    o = out("disconnect")
    soak.read_stream(sse(*[{"choices": [{"index": 0, "delta": {"content": "x"}}]}] * 5), o, 0.0, True, 1)
    assert o.outcome == "cancelled" and o.chunks == soak.DISCONNECT_AFTER_CHUNKS and o.passed


@pytest.mark.parametrize(("raw", "message"), [
    (b'{"error": {"message": "too long", "code": 400}}', "too long"),
    (b'{"message": "bad"}', "bad"),
    (b'{"detail": [{"loc": ["body"], "msg": "field required"}]}', '[{"loc": ["body"], "msg": "field required"}]'),
    (b"not json", None),
    (b"{}", None),
])
def test_error_messages_of_4xx_bodies(raw, message):
    assert soak.error_message(raw) == message


def test_the_request_mix_is_seeded_and_every_kind_builds_a_streamed_body():
    assert soak.plan(50, 7) == soak.plan(50, 7) != soak.plan(50, 8)
    rows = [{"messages": [{"role": "user", "content": "q"}], "max_tokens": 64}]
    for kind in soak.BY_NAME:
        path, body = soak.request_for(kind, 3, rows, "m", 100, 20)
        assert path.startswith("/v1/") and body["stream"] is True and body["model"] == "m"
    assert soak.request_for("prompt_over_context", 0, rows, "m", 100, 20)[1]["prompt"].count("hello") == 200
    assert soak.request_for("logprobs_over_max", 0, rows, "m", 100, 20)[1]["top_logprobs"] == 21
    assert soak.request_for("max_tokens_huge", 0, rows, "m", 100, 20)[1]["max_tokens"] == 10_000_000
    assert soak.request_for("stop_surrogate", 0, rows, "m", 100, 20)[1]["stop"][1] == "\ud800"


def test_the_soak_draws_as_before_and_the_storm_drops_a_third():
    """The soak's mix is the kinds of weight > 0 in their order (the draw of every committed soak record); the storm
    draws its own kinds, about a third of them dropped by the client."""
    import random

    old = random.Random(1008).choices([k.name for k in soak.KINDS if k.weight], [k.weight for k in soak.KINDS if k.weight],
                                      k=120)
    assert soak.plan(120, 1008) == old and not {"max_tokens_huge", "stop_surrogate"} & set(old)
    storm = soak.plan(200, 32, "storm")
    assert {"max_tokens_huge", "top_logprobs_50", "stop_surrogate", "disconnect"} <= set(storm)
    assert 0.25 < storm.count("disconnect") / 200 < 0.42


def test_rss_growth_is_judged_from_the_second_hundred_to_the_end():
    assert soak.rss_growth({"200": 1000.0, "end": 1049.0}, 300) == pytest.approx(0.049)
    assert soak.rss_growth({"200": 1000.0, "end": 1049.0}, 299) is None  # too few requests to judge
    assert soak.rss_growth({"end": 1.0}, 400) is None


def test_criteria_fail_on_a_5xx_a_hang_or_a_server_left_busy():
    ok = [out() for _ in range(3)]
    for o in ok:
        o.outcome = "complete"
    idle = {"method": "metrics", "idle": True, "seconds": 0.1}
    assert soak.summarize(ok, {}, idle, True, [1])["pass"]
    bad = out()
    bad.outcome, bad.status = "server_error", 500
    s = soak.summarize([*ok, bad], {}, idle, True, [1])
    assert not s["pass"] and s["criteria"]["server_errors"]["value"] == 1 and "HTTP 500" in s["first_outside_kind"]["chat"]
    hang = out()
    hang.outcome = "hang"
    assert not soak.summarize([*ok, hang], {}, idle, True, [1])["criteria"]["hangs"]["pass"]
    assert not soak.summarize(ok, {}, {**idle, "idle": False}, True, [1])["pass"]


@pytest.mark.slow
def test_a_short_soak_of_the_real_server_passes_and_its_record_validates(embedded_server, tmp_path):
    from scripts.report import schemas as check_schemas

    rc = soak.main(["smollm2-bf16", "--base-url", embedded_server.base_url, "--server-pid", str(embedded_server.engine_pid),
                    "--requests", "16", "--concurrency", "1,8", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("soak_*.json")
    rec = json.loads(path.read_text())
    assert rc == 0, rec["failure"]
    s = rec["summary"]
    assert s["requests"] == 32 and s["idle"]["method"] == "metrics" and s["idle"]["idle"]
    assert s["by_outcome"].get("rejected", 0) >= 1 and s["rss_mib"]["start"] and not s["rss_judged"]
    assert check_schemas.check_file(path) == []


def test_the_context_comes_from_the_engine_else_the_variant(monkeypatch):
    """vLLM states max_model_len in /v1/models; llama-server states a slot's n_ctx in /props; else the variant's key."""
    answers = {"models": (200, json.dumps({"data": [{"id": "x", "max_model_len": 8192}]}))}
    monkeypatch.setattr(soak, "http_get", lambda url, **_: answers.get(url.rsplit("/", 1)[-1], (404, "")))
    variant = SimpleNamespace(resolved={})
    assert soak.served_context("http://h", variant) == 8192
    answers["models"] = (200, json.dumps({"data": [{"id": "x", "meta": {"n_ctx_train": 8192}}]}))  # llama-server's
    answers["props"] = (200, json.dumps({"default_generation_settings": {"n_ctx": 4096}, "total_slots": 8}))
    assert soak.served_context("http://h", variant) == 4096
    del answers["props"]
    variant.resolved.update(LLAMASERVER_CTX_SIZE="65536", LLAMASERVER_PARALLEL="8")
    assert soak.served_context("http://h", variant) == 8192
    variant.resolved = {}
    with pytest.raises(soak.SoakError, match="states no context .* LLAMASERVER_CTX_SIZE in its config.env"):
        soak.served_context("http://h", variant)


def test_idle_is_read_from_each_engines_gauges():
    """vLLM's and llama-server's /metrics name their running and waiting requests differently; metrics of neither
    (or none) fall back to the one-token probe."""
    assert soak.idle_gauges({"vllm:num_requests_running": 0.0, "vllm:num_requests_waiting": 1.0,
                             "vllm:kv_cache_usage_perc": 0.0}) == {"running": 0.0, "waiting": 1.0, "kv_cache_usage_perc": 0.0}
    assert soak.idle_gauges({"llamacpp:requests_processing": 0.0, "llamacpp:requests_deferred": 0.0,
                             "llamacpp:n_decode_total": 9.0}) == {"running": 0.0, "waiting": 0.0}
    assert soak.idle_gauges({"process_cpu_seconds_total": 1.0}) is None


def test_sglang_idle_is_read_from_its_loads_page_when_it_has_no_metrics(monkeypatch):
    """SGLang serves /metrics only with --enable-metrics; its /v1/loads states the running and waiting requests in
    Prometheus text (the text below is the shape of SGLang 0.5.17's _format_loads_prometheus)."""
    loads = ('# TYPE sglang_num_running_reqs gauge\nsglang_num_running_reqs{dp_rank="0"} 0\n'
             '# TYPE sglang_num_waiting_reqs gauge\nsglang_num_waiting_reqs{dp_rank="0"} 2\n'
             '# TYPE sglang_num_used_tokens gauge\nsglang_num_used_tokens{dp_rank="0"} 512\n')
    pages = {"/v1/loads?include=core&format=prometheus": (200, loads.encode())}
    asked = []

    def get(url, **_):
        asked.append(url.removeprefix("http://h"))
        return pages.get(url.removeprefix("http://h"), (404, b""))

    from scripts.measure import prom

    monkeypatch.setattr(prom, "http_get", get)
    loads_page = "/v1/loads?include=core&format=prometheus"
    assert soak.load_gauges("http://h") == (loads_page, {"running": 0.0, "waiting": 2.0})
    assert asked == ["/metrics", loads_page]
    pages[loads_page] = (200, loads.replace('waiting_reqs{dp_rank="0"} 2', 'waiting_reqs{dp_rank="0"} 0').encode())
    idle = soak.idle_state("http://h", "m", timeout_s=5)
    assert idle["idle"] is True and idle["page"] == loads_page and idle["running"] == idle["waiting"] == 0
    pages["/metrics"] = (200, b"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:kv_cache_usage_perc 0\n")
    assert soak.load_gauges("http://h") == ("/metrics", {"running": 0.0, "waiting": 0.0, "kv_cache_usage_perc": 0.0})
    pages.clear()
    assert soak.load_gauges("http://h") is None  # neither: the one-token probe decides
