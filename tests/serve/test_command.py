"""The variant → `vllm serve` command builder, with a hand-made flag table (no vLLM import)."""

from __future__ import annotations

import json

import pytest

from scripts.common.variants import Variant, VariantError
from scripts.serve.command import build_serve_argv, printable, serve_flags

TABLE = {
    "--max-num-seqs": "value", "--enforce-eager": "switch", "--no-enforce-eager": "switch",
    "--enable-prefix-caching": "switch", "--no-enable-prefix-caching": "switch", "--trust-remote-code": "switch",
    "--cudagraph-capture-sizes": "multi", "--speculative-config": "value", "--served-model-name": "multi",
    "--linear-backend": "choice:auto,cutlass,marlin,triton,machete",
}


def variant(**resolved) -> Variant:
    return Variant(name="v-x", path=__import__("pathlib").Path("/x/v-x"), settings={},
                   resolved={"MODEL": "org/model", "BASE": "v", **resolved})


def test_flags_values_switches_multi_and_json():
    v = variant(SERVE_MAX_NUM_SEQS="8", SERVE_ENFORCE_EAGER="1", SERVE_ENABLE_PREFIX_CACHING="0",
                SERVE_TRUST_REMOTE_CODE="0", SERVE_CUDAGRAPH_CAPTURE_SIZES="1 2 4 8",
                SERVE_SPECULATIVE_CONFIG='{"method": "mtp", "num_speculative_tokens": 4}')
    assert serve_flags(v.serving(), TABLE) == [
        "--max-num-seqs", "8", "--enforce-eager", "--no-enable-prefix-caching",
        "--cudagraph-capture-sizes", "1", "2", "4", "8",
        "--speculative-config", '{"method": "mtp", "num_speculative_tokens": 4}',
    ]


def test_unknown_flag_is_refused_with_similar_flags():
    with pytest.raises(VariantError, match=r"SERVE_MAX_NUM_SEQ: vLLM has no flag --max-num-seq; similar: --max-num-seqs"):
        serve_flags(variant(SERVE_MAX_NUM_SEQ="8").serving(), TABLE)


def test_switch_needs_0_or_1():
    with pytest.raises(VariantError, match="SERVE_ENFORCE_EAGER is a switch: use 1 or 0"):
        serve_flags(variant(SERVE_ENFORCE_EAGER="true").serving(), TABLE)


def test_a_choice_flag_takes_only_vllms_choices():
    assert serve_flags(variant(SERVE_LINEAR_BACKEND="marlin").serving(), TABLE) == ["--linear-backend", "marlin"]
    assert serve_flags(variant(SERVE_LINEAR_BACKEND="Machete").serving(), TABLE) == ["--linear-backend", "Machete"]  # vLLM lowers it
    with pytest.raises(VariantError, match=r"SERVE_LINEAR_BACKEND=marlinn: vLLM's --linear-backend takes one of "
                                           r"auto, cutlass, marlin, triton, machete$"):
        serve_flags(variant(SERVE_LINEAR_BACKEND="marlinn").serving(), TABLE)


def test_full_command_binds_localhost_names_model_and_keeps_the_key_out_of_argv():
    argv = build_serve_argv(variant().serving(), TABLE)
    assert argv[argv.index("--host") + 1] == "127.0.0.1"
    assert argv[argv.index("--served-model-name") + 1] == "v-x"
    assert "org/model" in argv and "--api-key" not in argv
    line = printable(argv, {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_API_KEY": "s3cret"})
    assert line.startswith("VLLM_API_KEY=*** VLLM_CPU_KVCACHE_SPACE=4 ") and "s3cret" not in line
    assert "s3cret" not in printable(["x", "--api-key", "s3cret"]), "a key flag's value is masked too"


def test_real_vllm_flag_table_knows_every_committed_variant():
    """Every SERVE_* key of every committed variant is a flag of the installed vLLM (the table is cached)."""
    pytest.importorskip("vllm")
    from scripts.common.variants import PLATFORM_DEFAULTS, list_variants, load_variant
    from scripts.serve.command import vllm_flag_table

    table = vllm_flag_table()
    assert table["--max-num-seqs"] == "value" and table["--enforce-eager"] == "switch"
    for name in list_variants():
        for target in PLATFORM_DEFAULTS:
            v = load_variant(name, target=target)
            if v.engine == "vllm":
                serve_flags(v.serving(), table)


def test_key_guard_closes_every_route_but_health():
    import asyncio

    from scripts.serve.guard import KeyGuard

    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def status(guard, path, auth=None, method="GET"):
        sent = []

        async def send(msg):
            sent.append(msg)

        headers = [(b"authorization", auth.encode())] if auth else []
        asyncio.run(guard({"type": "http", "path": path, "method": method, "headers": headers}, None, send))
        return sent[0]["status"]

    g = KeyGuard(app, key="k3y", public_metrics=False)
    for path in ("/tokenize", "/detokenize", "/metrics", "/version", "/openapi.json", "/v1/models", "/", "/health/x"):
        assert status(g, path) == 401 and status(g, path, "Bearer wrong") == 401 and status(g, path, "k3y") == 401
        assert status(g, path, "Bearer k3y") == 200 and status(g, path, "bearer k3y") == 200
    assert status(g, "/health") == 200 and status(g, "/tokenize", method="OPTIONS") == 200
    assert status(KeyGuard(app, key="k3y", public_metrics=True), "/metrics") == 200
    assert status(KeyGuard(app, key=""), "/tokenize") == 200  # no key: nothing to guard


@pytest.mark.parametrize(("body", "path", "why"), [
    (b'{"structured_outputs": 1}', "/v1/chat/completions", "structured_outputs must be a JSON object, got int"),
    (b'{"structured_outputs": "x"}', "/v1/completions", "structured_outputs must be a JSON object, got str"),
    (b'{"structured_outputs": [1]}', "/v1/completions", "structured_outputs must be a JSON object, got list"),
    (b'{"structured_outputs": {"json": {}}}', "/v1/completions", None),
    (b'{"structured_outputs": null}', "/v1/completions", None),
    (b'{"structured_outputs": 1}', "/tokenize", None),
    (b'{"structured_outputs": ', "/v1/completions", None),  # malformed JSON: vLLM's own 400
    (b"[1]", "/v1/completions", None),
    (b'{"prompt": "x", "stop": ["a", "\\ud800"]}', "/v1/completions", "stop[1] holds a lone UTF-16 surrogate, which is not a character"),
    (b'{"messages": [{"content": "\\udfff"}]}', "/v1/chat/completions", "messages[0].content holds a lone UTF-16 surrogate, which is not a character"),
    (b'{"a\\ud800": 1}', "/tokenize", "body (a key) holds a lone UTF-16 surrogate, which is not a character"),
    (b'{"prompt": "\\ud83d\\ude00"}', "/tokenize", None),  # a surrogate pair is a character (an emoji)
    (b'{"prompt": "\\ud800"}', "/v1/models", None),
    (b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "/tokenize", "the JSON body is nested too deeply"),
])
def test_request_guard_refuses_bodies_vllm_would_answer_with_500(body, path, why):
    from scripts.serve.guard import bad_request

    assert bad_request(body, path) == why


def test_request_guard_replays_a_passing_body_whole_and_answers_400_itself():
    import asyncio

    from scripts.serve.guard import RequestGuard

    seen = []

    async def app(scope, receive, send):
        seen.append((await receive())["body"])
        seen.append((await receive())["type"])  # after the body: the client's own messages
        await send({"type": "http.response.start", "status": 200, "headers": []})

    def run(chunks: list[bytes], path="/v1/completions"):
        queue = [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]
        queue.append({"type": "http.disconnect"})
        sent = []

        async def receive():
            return queue.pop(0)

        async def send(msg):
            sent.append(msg)

        asyncio.run(RequestGuard(app)({"type": "http", "path": path, "method": "POST"}, receive, send))
        return sent

    sent = run([b'{"prompt": "hi", ', b'"max_tokens": 2}'])
    assert sent[0]["status"] == 200 and seen == [b'{"prompt": "hi", "max_tokens": 2}', "http.disconnect"]
    seen.clear()
    sent = run([b'{"structured_outputs": 7}'])
    assert sent[0]["status"] == 400 and seen == []
    assert json.loads(sent[1]["body"])["error"]["param"] == "structured_outputs"


@pytest.mark.parametrize(("body", "added"), [
    (b'{"messages": []}', 256),
    (b'{"messages": [], "thinking_token_budget": null}', 256),  # null is vLLM's "not set"
    (b'{"messages": [], "thinking_token_budget": 8}', None),  # a request's own value wins
    (b'{"messages": [], "thinking_token_budget": -1}', None),  # -1: the request asks for no budget
    (b'{"messages": [], "thinking_token_budget": 2.5}', None),  # vLLM's own 400 answers it
    (b"[1]", None), (b'{"messages": ', None),
])
def test_default_budget_added_only_where_a_chat_request_sets_none(body, added):
    from scripts.serve.guard import with_budget

    got = with_budget(body, 256)
    if added is None:
        assert got is body
    else:
        assert json.loads(got) == {**json.loads(body), "thinking_token_budget": added}


def guard_forward(path: str, body: bytes, budget: int | None = None) -> tuple[bytes, dict]:
    """What vLLM behind a RequestGuard receives for one POST: the body and the headers."""
    import asyncio

    from scripts.serve.guard import RequestGuard

    got = {}

    async def app(scope, receive, send):
        got["body"] = (await receive())["body"]
        got["headers"] = dict(scope["headers"])
        await send({"type": "http.response.start", "status": 200, "headers": []})

    async def receive():
        return {"type": "http.request", "body": body, "more_body": False}

    async def send(msg):
        pass

    scope = {"type": "http", "path": path, "method": "POST", "headers": [(b"content-length", str(len(body)).encode())]}
    asyncio.run(RequestGuard(app, budget=budget)(scope, receive, send))
    return got["body"], got["headers"]


def test_request_guard_adds_the_variant_budget_to_chat_requests_only(monkeypatch):
    from scripts.serve.guard import THINK_BUDGET_ENV

    chat = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}'
    body, headers = guard_forward("/v1/chat/completions", chat, budget=64)
    assert json.loads(body)["thinking_token_budget"] == 64 and headers[b"content-length"] == str(len(body)).encode()
    own = b'{"model": "m", "messages": [], "thinking_token_budget": 1024}'
    assert guard_forward("/v1/chat/completions", own, budget=64)[0] == own
    for path in ("/v1/completions", "/tokenize", "/v1/responses"):  # not chat: untouched
        assert guard_forward(path, chat, budget=64)[0] == chat
    assert guard_forward("/v1/chat/completions", chat)[0] == chat  # no THINK_BUDGET: untouched
    monkeypatch.setenv(THINK_BUDGET_ENV, "0")  # the server's environment carries the variant's budget
    assert json.loads(guard_forward("/v1/chat/completions", chat)[0])["thinking_token_budget"] == 0


def test_serve_env_hands_the_variant_budget_to_the_guard():
    from scripts.common.engines import ENGINES
    from scripts.serve.command import serve_env
    from scripts.serve.guard import THINK_BUDGET_ENV

    v = variant(THINK_BUDGET="256", SERVE_REASONING_PARSER="qwen3")
    assert serve_env(v.serving(), ENGINES["vllm"], None)[THINK_BUDGET_ENV] == "256"
    assert THINK_BUDGET_ENV not in serve_env(variant().serving(), ENGINES["vllm"], None)


def test_a_topology_asking_for_more_gpus_than_are_visible_fails_naming_both(monkeypatch):
    """Only the GPU query is faked: two H200s seen by nvidia-smi, narrowed by CUDA_VISIBLE_DEVICES."""
    from scripts.common import hardware
    from scripts.common.variants import VariantError, load_variant
    from scripts.serve.plan import check_gpus

    tp2 = load_variant("qwen35-27b-dummy-bf16-tp2")
    with pytest.raises(VariantError, match=r"qwen35-27b-dummy-bf16-tp2/config.env: needs 2 GPUs "
                                           r"\(tensor_parallel 2\); 1 visible here"):
        check_gpus(tp2, 1)
    check_gpus(tp2, 2)
    check_gpus(tp2, None)  # no GPU machine: nothing to count (the CUDA target fails on its own)
    check_gpus(load_variant("qwen35-27b-dummy-bf16"), 1)
    monkeypatch.setattr(hardware, "hardware", lambda: {"gpu": {"name": "NVIDIA H200", "count": 2}})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert hardware.visible_gpus() == 2 and hardware.visible_gpus({"CUDA_VISIBLE_DEVICES": "1"}) == 1
    assert hardware.visible_gpus({"CUDA_VISIBLE_DEVICES": ""}) == 0
    monkeypatch.setattr(hardware, "hardware", lambda: {"gpu": None})
    assert hardware.visible_gpus() is None


def test_sglang_gets_the_request_guard_inside_its_app_unless_the_variant_opts_out(monkeypatch, embedded_weights):
    """The serve plan names the guard in the SGLang server's environment; the launcher adds it to SGLang's app (a
    stand-in app object records the calls: SGLang itself needs a GPU) and refuses several tokenizer workers."""
    from scripts.common import engines
    from scripts.common.variants import load_variant
    from scripts.gpu import sglang_text_only as launcher
    from scripts.serve.guard import REQUEST_MIDDLEWARE, SGLANG_MIDDLEWARE_ENV, RequestGuard
    from scripts.serve.plan import serve_plan

    monkeypatch.setattr(engines, "version", lambda name: "0.5.17")
    assert SGLANG_MIDDLEWARE_ENV == launcher.MIDDLEWARE_ENV
    guarded = serve_plan(load_variant("smollm2-sglang"), host="127.0.0.1", port=9)
    assert guarded.env[SGLANG_MIDDLEWARE_ENV] == REQUEST_MIDDLEWARE
    assert "--middleware" not in guarded.argv and REQUEST_MIDDLEWARE not in guarded.argv  # SGLang has no such flag
    bare = serve_plan(load_variant("smollm2-sglang", overrides={"REQUEST_GUARD": "0"}), host="127.0.0.1", port=9)
    assert SGLANG_MIDDLEWARE_ENV not in bare.env
    vllm = serve_plan(load_variant("smollm2-bf16"), host="127.0.0.1", port=9)
    assert SGLANG_MIDDLEWARE_ENV not in vllm.env and REQUEST_MIDDLEWARE in vllm.argv

    classes = launcher.middleware_classes(guarded.env[SGLANG_MIDDLEWARE_ENV])
    assert classes == [RequestGuard] and launcher.middleware_classes("") == []

    class App:
        added: list = []

        def add_middleware(self, cls):
            self.added.append(cls)

    app = App()
    launcher.add_middleware(app, classes, tokenizer_workers=1)
    assert app.added == [RequestGuard]
    with pytest.raises(SystemExit, match="single tokenizer worker .* is 2: set SGLANG_TOKENIZER_WORKER_NUM=1 or "
                                         "REQUEST_GUARD=0"):
        launcher.add_middleware(App(), classes, tokenizer_workers=2)
    for bad in ("scripts.serve.guard.NoSuchGuard", "no_such_module.Guard", "Guard"):  # one line, no traceback
        with pytest.raises(SystemExit, match=f"LAB_SGLANG_MIDDLEWARE: '{bad}' is no importable module.Class"):
            launcher.middleware_classes(bad)
    launcher.add_middleware(app, [], tokenizer_workers=4)  # nothing to add: SGLang's own choice stands
