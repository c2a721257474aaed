"""The request front before llama-server (scripts/serve/front.py): its refusals, its life beside the engine process,
and llama-server behind it for real."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from scripts.common import paths
from scripts.common.server import free_port, http_get
from scripts.serve.front import Limits, Upstream, needs_count, refusal, request_bytes, requested_tokens, too_long

LIMITS = Limits(context=8192, vocab=49152)


def body(**kw) -> bytes:
    return json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}).encode()


def test_answer_length_is_read_as_llama_server_reads_it():
    assert requested_tokens({"max_tokens": 10}) == 10 and requested_tokens({}) is None
    assert requested_tokens({"max_tokens": 10, "n_predict": 99}) == 99  # n_predict wins, as in llama-server
    assert requested_tokens({"max_completion_tokens": 7}) == 7
    assert requested_tokens({"max_tokens": True}) is None and requested_tokens({"max_tokens": -1}) is None


def test_max_tokens_beyond_the_context_is_refused_before_the_engine_sees_it():
    why, _ = refusal("/v1/chat/completions", body(max_tokens=81920), LIMITS)
    assert why and "'max_tokens' is too large: 81920" in why and "8192 tokens" in why
    assert refusal("/v1/chat/completions", body(max_tokens=64), LIMITS)[0] is None
    assert refusal("/v1/completions", json.dumps({"prompt": "x", "n_predict": 9000}).encode(), LIMITS)[0]
    # within the context: decided only with the prompt counted
    assert too_long({"max_tokens": 8000}, 8192, 193) is not None and too_long({"max_tokens": 8000}, 8192, 192) is None
    assert "(8000 > 8192 - 300)" in too_long({"max_tokens": 8000}, 8192, 300)


def test_the_prompt_is_counted_only_near_the_limit():
    assert not needs_count({"max_tokens": 64}, 8192, body_bytes=200)
    assert needs_count({"max_tokens": 8000}, 8192, body_bytes=200)
    assert not needs_count({"max_tokens": 9000}, 8192, body_bytes=200)  # already refused without counting
    assert not needs_count({}, 8192, body_bytes=10**6)


def test_bodies_llama_server_answers_with_500_get_a_400():
    why, _ = refusal("/detokenize", json.dumps({"tokens": [1, -5]}).encode(), LIMITS)
    assert why and "-5" in why and "[0, 49152)" in why
    assert refusal("/detokenize", json.dumps({"tokens": [1, 49152]}).encode(), LIMITS)[0]
    assert refusal("/detokenize", json.dumps({"tokens": [1, 2]}).encode(), LIMITS)[0] is None
    assert "tools must be an array" in refusal("/v1/chat/completions", body(tools={"a": 1}), LIMITS)[0]
    assert refusal("/v1/chat/completions", body(tools=[]), LIMITS)[0] is None
    assert "lone UTF-16 surrogate" in refusal("/v1/chat/completions", b'{"stop": ["\\ud800"]}', LIMITS)[0]
    assert refusal("/v1/chat/completions", b"{not json", LIMITS) == (None, None)  # the engine's own 400


def test_an_answers_body_is_decoded_whatever_pieces_it_arrives_in():
    """The engine's chunked body cut at every byte, and in one piece: the same payload, the state at its end; a
    Content-Length body stops at its length; a bad chunk size ends the answer with the reason."""
    import asyncio

    payload = [b"data: {\"a\": 1}\n\n", b"data: {\"b\": \"\\r\\n0\\r\\n\"}\n\n", b"data: [DONE]\n\n"]
    wire = b"".join(b"%X;ext=1\r\n%b\r\n" % (len(p), p) for p in payload) + b"0\r\nX-Trailer: t\r\n\r\n"
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"

    async def feed(pieces: list[bytes]) -> tuple[bytes, Upstream]:
        up, got = Upstream(), []
        up.write = got.append
        for piece in pieces:
            up.data_received(piece)
        return b"".join(got), up

    def run(pieces):
        return asyncio.run(feed(pieces))

    whole = head + wire
    for cut in range(1, len(whole)):
        got, up = run([whole[:cut], whole[cut:]])
        assert got == b"".join(payload) and up.state == "end" and up.done.result() is None, cut
    got, up = run([bytes([b]) for b in whole])
    assert got == b"".join(payload) and up.head.result()[:2] == (200, "OK")
    got, up = run([b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhel", b"lo"])
    assert got == b"hello" and up.length == 5 and up.state == "end"
    for size in (b"zz", b"-1", b"+5", b"0x5", b""):  # int() takes some of these; -1 would spin the decoder forever
        got, up = run([head + size + b"\r\nhello\r\n"])
        assert got == b"" and "bad chunk size" in up.done.result(), size
    # an interim answer (a 100 Continue the engine sends) is not the answer: the final head and body follow it
    got, up = run([b"HTTP/1.1 100 Continue\r\n\r\n" + whole[:40], whole[40:]])
    assert got == b"".join(payload) and up.head.result()[0] == 200
    # a HEAD answer has no body but says the length a GET would carry; the last chunk's final CRLF cut is an end
    got, up = asyncio.run(head_answer())
    assert got == b"" and up.state == "end" and up.length == 15
    got, up = run([head + b"5\r\nhello\r\n0\r\n"])
    up.connection_lost(None)
    assert got == b"hello" and up.done.result() is None
    assert request_bytes("POST", "/v1/x", "h:1", {"X-Name": "日本"}, b"{}").split(b"\r\n")[2] == "X-Name: 日本".encode()


async def head_answer() -> tuple[bytes, Upstream]:
    up, got = Upstream(head_only=True), []
    up.write = got.append
    up.data_received(b"HTTP/1.1 200 OK\r\nContent-Length: 15\r\n\r\n")
    return b"".join(got), up


BROKEN_ENGINE = r"""
import json, socket, sys
srv = socket.create_server(("127.0.0.1", int(sys.argv[1])))
while True:
    c, _ = srv.accept()
    req = b""
    while b"\r\n\r\n" not in req:
        req += c.recv(65536)
    path = req.split(b" ")[1]
    if path in (b"/health", b"/props", b"/v1/models"):
        body = json.dumps({"default_generation_settings": {"n_ctx": 4096}} if path == b"/props" else {}).encode()
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%b" % (len(body), body))
    else:  # one whole event, half of the next, then the connection cut
        c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
                  b"10\r\ndata: {\"a\": 1}\n\n\r\n20\r\ndata: {\"b\"")
    c.close()
"""


def test_a_stream_the_engine_cuts_ends_in_an_error_event_and_a_whole_answer(tmp_path):
    """An engine process that cuts its event stream midway: the client's answer is still well framed (it reads to its
    end) and ends as vLLM ends a stream that fails: the half event closed, an error event with code 502, [DONE]."""
    (tmp_path / "engine.py").write_text(BROKEN_ENGINE)
    port, inner = free_port(), free_port()
    p = subprocess.Popen(front_cmd(port, inner, sys.executable, str(tmp_path / "engine.py"), str(inner)),
                         cwd=paths.ROOT, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True)
    try:
        wait_for(lambda: get_json(f"http://127.0.0.1:{port}/health")[0] == 200)
        status, raw = post(f"http://127.0.0.1:{port}/v1/chat/completions", {"stream": True, "max_tokens": 4})
        assert status == 200
        events = raw.decode().split("\n\n")
        assert events[0] == 'data: {"a": 1}' and events[1] == 'data: {"b"' and events[-3:] == [
            events[-3], "data: [DONE]", ""]
        err = json.loads(events[-3].removeprefix("data: "))["error"]
        assert err["code"] == 502 and "broke before its end" in err["message"]
    finally:
        os.killpg(p.pid, signal.SIGKILL)  # the front and its engine (one process group)
    assert "the engine's stream broke" in p.stdout.read()


def front_cmd(port: int, engine_port: int, *engine: str, context: list[str] = ()) -> list[str]:
    return [sys.executable, "-m", "scripts.serve.front", "--port", str(port), "--engine-port", str(engine_port),
            *context, "--", *engine]


def get_json(url: str) -> tuple[int, dict]:
    """(status, body); (0, {}) while nothing listens yet."""
    try:
        status, raw = http_get(url, timeout=5)
    except urllib.error.URLError:
        return 0, {}
    return status, json.loads(raw or b"{}")


def wait_for(cond, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if got := cond():
            return got
        time.sleep(0.1)
    raise AssertionError("condition not met in time")


def test_an_engine_starting_or_gone_is_a_503_with_its_state_never_a_hang(tmp_path):
    """A real engine process that never becomes healthy (sleep): every request is answered 503 "starting" at once;
    once the process has exited, 503 "gone" with its exit code, then the front exits with that code."""
    port, inner = free_port(), free_port()
    p = subprocess.Popen(front_cmd(port, inner, "sleep", "5"), cwd=paths.ROOT, start_new_session=True,
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        status, got = wait_for(lambda: (r := get_json(f"http://127.0.0.1:{port}/v1/models"))[0] and r)
        assert status == 503 and got["engine"] == "starting" and got["error"]["code"] == 503
        t0 = time.monotonic()
        status, got = wait_for(lambda: (r := get_json(f"http://127.0.0.1:{port}/health"))[1].get("engine") == "gone"
                               and r, timeout=15)
        assert status == 503 and got["exit_code"] == 0 and time.monotonic() - t0 < 10
        assert p.wait(timeout=15) == 0 and "the engine exited with code 0" in p.stdout.read()
    finally:
        p.kill()


def test_an_engine_that_states_no_context_stops_the_front_naming_the_setting(tmp_path):
    """An engine that answers /health but has no /props (a static file server) and no --context: the front exits 2
    with one line naming LLAMASERVER_CTX_SIZE, and stops the engine."""
    (tmp_path / "health").write_text("ok")
    port, inner = free_port(), free_port()
    engine = [sys.executable, "-m", "http.server", str(inner), "--bind", "127.0.0.1", "--directory", str(tmp_path)]
    p = subprocess.run(front_cmd(port, inner, *engine), cwd=paths.ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 2
    assert "error: the engine states no context size" in p.stderr and "set LLAMASERVER_CTX_SIZE" in p.stderr
    assert "Traceback" not in p.stderr + p.stdout


# --- llama-server behind the front, for real ------------------------------------------------------------------------


def sse_events(raw: bytes) -> list:
    """The stream's events with the fields that differ between any two answers (id, created, timings) removed."""
    out = []
    for line in raw.decode().split("\n"):
        if line.startswith("data: ") and line != "data: [DONE]":
            ev = json.loads(line[6:])
            for k in ("id", "created", "timings", "system_fingerprint"):
                ev.pop(k, None)
            out.append(ev)
        elif line:
            out.append(line)
    return out


def post(url: str, data: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(data).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def guarded(bf16_export):
    """smollm2-gguf-bf16-server (the BF16 GGUF, built by test_engines' export when missing) started as `make serve`
    starts it: the front on the public port, llama-server behind it."""
    from scripts.common.variants import load_variant
    from scripts.serve.launch import make_server

    v = load_variant("smollm2-gguf-bf16-server")
    paths.CACHE.mkdir(exist_ok=True)
    server = make_server(v, host="127.0.0.1", port=free_port(), api_key=None,
                         log_path=paths.CACHE / "test-front-llama-server.log")
    server.start()
    try:
        server.wait_healthy(300)
        yield server
    finally:
        server.stop()


@pytest.mark.slow
def test_llama_server_behind_the_front_refuses_what_cannot_fit_and_streams_unchanged(guarded):
    argv = guarded.argv
    assert argv[1:3] == ["-m", "scripts.serve.front"] and "--n-predict" in argv
    inner = int(argv[argv.index("--engine-port") + 1])
    url, direct = guarded.base_url, f"http://127.0.0.1:{inner}"
    chat = {"model": "smollm2-gguf-bf16-server", "messages": [{"role": "user", "content": "Name three colours."}],
            "max_tokens": 24, "temperature": 0, "stream": True}
    # the same greedy stream through the front and from llama-server itself: the same events, the same framing
    s1, a = post(f"{url}/v1/chat/completions", chat)
    s2, b = post(f"{direct}/v1/chat/completions", chat)
    assert s1 == s2 == 200 and sse_events(a) == sse_events(b) and a.endswith(b"data: [DONE]\n\n")
    # a client that asks for 100 Continue gets it from the front; the engine, asked without it, answers the request
    req = urllib.request.Request(f"{url}/v1/chat/completions", data=json.dumps({**chat, "stream": False}).encode(),
                                 headers={"Content-Type": "application/json", "Expect": "100-continue"})
    with urllib.request.urlopen(req, timeout=60) as r:
        assert r.status == 200 and json.loads(r.read())["choices"][0]["message"]["content"]
    # ten times the context: refused at once, as vLLM refuses it; llama-server alone accepts it
    t0 = time.monotonic()
    status, raw = post(f"{url}/v1/chat/completions", {**chat, "max_tokens": 81920})
    assert status == 400 and "'max_tokens' is too large: 81920" in raw.decode() and time.monotonic() - t0 < 5
    # inside the context but not beside a long prompt: llama-server counts the prompt, the front refuses
    ctx = json.loads(http_get(f"{url}/props")[1])["default_generation_settings"]["n_ctx"]
    long_chat = {**chat, "messages": [{"role": "user", "content": "hello " * 400}], "max_tokens": ctx - 100}
    status, raw = post(f"{url}/v1/chat/completions", long_chat)
    assert status == 400 and "input tokens" in raw.decode()
    # the bodies llama-server answers with 500 by itself
    status, raw = post(f"{direct}/detokenize", {"tokens": [-3]})
    assert status == 500
    assert post(f"{url}/detokenize", {"tokens": [-3]})[0] == 400
    assert post(f"{url}/detokenize", {"tokens": [1, 2]})[0] == 200


@pytest.mark.slow
def test_the_storm_against_llama_server_as_the_lab_serves_it(guarded, tmp_path):
    """scripts.measure.soak's storm mix against the real llama-server behind its front (the module's server): the
    context comes from llama-server's /props, the idle state from its own gauges, and every request ends as its kind
    allows: max_tokens of ten million and of ten times the context refused, no hang, no 5xx, no broken stream."""
    from scripts.measure import soak
    from scripts.report import schemas as check_schemas

    rc = soak.main(["smollm2-gguf-bf16-server", "--base-url", guarded.base_url, "--server-pid", str(guarded.pid),
                    "--mix", "storm", "--concurrency", "8", "--requests", "24", "--timeout", "60",
                    "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("soak_*.json")
    rec = json.loads(path.read_text())
    assert check_schemas.check_file(path) == [] and rc == 0 and rec["status"] == "ok", rec.get("failure")
    ctx = json.loads(http_get(f"{guarded.base_url}/props")[1])["default_generation_settings"]["n_ctx"]
    assert rec["inputs"]["context_tokens"] == ctx and rec["inputs"]["mix"] == "storm"
    assert rec["summary"]["idle"]["method"] == "metrics" and rec["summary"]["idle"]["idle"] is True
    refused = rec["summary"]["rejected_by_cause"]
    assert refused["max_tokens_huge"] == {"400": 1} and refused["max_tokens_over_context"] == {"400": 1}
    assert rec["summary"]["by_outcome"].get("cancelled", 0) >= 1


@pytest.mark.slow
def test_the_fronts_cost_is_paired_on_one_engine(guarded, tmp_path):
    """scripts.measure.guard_cost against the module's real llama-server: each round's requests half through the front
    and half straight to the engine, taking turns (the first path alternating over the rounds), every request
    answered; ratios with intervals per level; the target judged at c=1. A variant without the front is refused."""
    from scripts.measure import guard_cost
    from scripts.report import schemas as check_schemas

    inner = guarded.argv[guarded.argv.index("--engine-port") + 1]
    rc = guard_cost.main(["smollm2-gguf-bf16-server", "--base-url", guarded.base_url, "--engine-url",
                          f"http://127.0.0.1:{inner}", "--rounds", "3", "--requests", "2", "--max-tokens", "8", "--concurrency", "1,2",
                          "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("guard_*.json")
    rec = json.loads(path.read_text())
    assert check_schemas.check_file(path) == []
    assert rc == (0 if rec["summary"]["pass"] else 1) and rec["status"] == ("ok" if rec["summary"]["pass"] else "failed")
    for level in ("1", "2"):
        rounds = rec["levels"][level]["rounds"]
        assert [r["first"] for r in rounds] == ["front", "direct", "front"]
        assert all(r[p]["e2el_ms"] > 0 and r[p]["tpot_ms"] > 0 and r[p]["requests"] == int(level)
                   for r in rounds for p in ("front", "direct"))
        tpot = rec["levels"][level]["front_over_direct"]["tpot_ms"]
        assert tpot["rounds"] == 3 and tpot["lo"] <= tpot["ratio"] <= tpot["hi"]
        assert tpot["verdict"] == ("costlier" if tpot["lo"] > 1 else "cheaper" if tpot["hi"] < 1 else "tie")
    crit = rec["summary"]["criteria"]["tpot_c1_upper"]
    assert crit["value"] == rec["levels"]["1"]["front_over_direct"]["tpot_ms"]["hi"] and crit["target"] == 1.02
    assert guard_cost.main(["smollm2-bf16", "--out-dir", str(tmp_path)]) == 1  # vLLM: no front to measure
    assert guard_cost.main(["smollm2-gguf-bf16-server", "--max-tokens", "1"]) == 2  # no TPOT in one token
