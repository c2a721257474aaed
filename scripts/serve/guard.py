"""Every route of a keyed vLLM server behind its key, /health alone open (and /metrics where METRICS_PUBLIC=1).

vLLM's own check (vllm/entrypoints/serve/middleware/authenticate.py) guards /v1, /v2, /inference and /cohere only:
/tokenize, /detokenize, /metrics, /version, /openapi.json and the rest answer anyone. `scripts.serve` starts a keyed
vLLM server with `--middleware scripts.serve.guard.KeyGuard`, vLLM's own hook for extra ASGI middleware: this class
reads the same key vLLM reads (VLLM_API_KEY, in the server's environment, never its argv) and answers 401 to any other
path without `Authorization: Bearer <key>`; the key is compared as vLLM compares it (SHA-256 digests,
secrets.compare_digest). Without a key it passes everything through. OPTIONS (CORS preflight) stays open, as in vLLM.

RequestGuard (every vLLM server the project starts, `--middleware scripts.serve.guard.RequestGuard`, and every SGLang
server, added to its app by scripts/gpu/sglang_text_only.py from LAB_SGLANG_MIDDLEWARE): request bodies
that vLLM answers with HTTP 500 although the client is at fault, found by fuzzing the endpoints with hypothesis
(tests/serve/test_serve_integration.py), answered 400 with a message before they reach vLLM. Each rule names the vLLM
code that fails (OBJECT_FIELDS); everything else passes through untouched. It also carries the variant's default
thinking budget (THINK_BUDGET in config.env, handed over in the server's environment as LAB_THINK_BUDGET): a chat
request that sets no thinking_token_budget of its own (absent or null) gets it; a request's own value wins (-1: no
budget, vLLM's own spelling); other routes are left alone.

    with_budget(b'{"messages": []}', 256)    # b'{"messages": [], "thinking_token_budget": 256}'
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

MIDDLEWARE = "scripts.serve.guard.KeyGuard"  # the value of vLLM's --middleware
REQUEST_MIDDLEWARE = "scripts.serve.guard.RequestGuard"
SGLANG_MIDDLEWARE_ENV = "LAB_SGLANG_MIDDLEWARE"  # the same classes added to SGLang's app (scripts/gpu/sglang_text_only.py)
KEY_ENV = "VLLM_API_KEY"
PUBLIC_METRICS_ENV = "LAB_METRICS_PUBLIC"  # "1": /metrics answers without the key (the variant's METRICS_PUBLIC=1)
THINK_BUDGET_ENV = "LAB_THINK_BUDGET"  # the variant's THINK_BUDGET: RequestGuard adds it to chat requests
BUDGET_FIELD = "thinking_token_budget"  # vLLM's request field (ChatCompletionRequest)
BUDGET_PATHS = ("/v1/chat/completions",)
OPEN = ("/health",)


class KeyGuard:
    """Pure ASGI middleware (vLLM adds it with app.add_middleware(KeyGuard))."""

    def __init__(self, app, key: str | None = None, public_metrics: bool | None = None) -> None:
        self.app = app
        key = key if key is not None else os.environ.get(KEY_ENV, "")
        self.digest = hashlib.sha256(key.encode()).digest() if key else None
        if public_metrics is None:
            public_metrics = os.environ.get(PUBLIC_METRICS_ENV) == "1"
        self.open = OPEN + (("/metrics",) if public_metrics else ())

    def allowed(self, scope) -> bool:
        path = scope["path"].removeprefix(scope.get("root_path", "")).rstrip("/") or "/"
        if self.digest is None or scope.get("method") == "OPTIONS" or path in self.open:
            return True
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope.get("headers", [])}
        scheme, _, token = headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(hashlib.sha256(token.encode()).digest(),
                                                                     self.digest)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] not in ("http", "websocket") or self.allowed(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await answer(send, 401, {"error": "Unauthorized"}, [(b"www-authenticate", b"Bearer")])


# Fields whose value must be a JSON object where vLLM reads it before validating its type: vLLM 0.32's
# ChatCompletionRequest.check_structured_outputs_count and CompletionRequest's structural-tag check (model validators,
# mode="before", in vllm/entrypoints/openai/{chat_completion,completion}/protocol.py) call .get on it, so
# "structured_outputs": 1 raised AttributeError -> HTTP 500.
OBJECT_FIELDS = {"structured_outputs": ("/v1/chat/completions", "/v1/completions")}
# A body nested deeper than Python's recursion limit ({"prompt": [[[…]]]}) makes vLLM's JSON parse raise
# RecursionError -> HTTP 500: refused on the same paths.
# JSON may spell a lone UTF-16 surrogate ("\ud800"), which is no character: in a stop string vLLM 0.32 fails to
# encode it for the engine core (UnicodeEncodeError -> EngineGenerateError -> HTTP 500, or an error event with code
# 500 inside a stream). Refused in any string of a body to these paths.
TEXT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings", "/tokenize", "/detokenize")


def lone_surrogate(value) -> str | None:
    """Where the first string or key holding a lone surrogate sits in a parsed JSON value (e.g. "stop[1]"); None if
    none does. Iterative: a body nested as deep as json.loads allows is walked without recursion."""
    stack = [(value, "")]
    while stack:
        v, where = stack.pop()
        if isinstance(v, str):
            if not _encodable(v):
                return where or "body"
        elif isinstance(v, dict):
            for k, x in v.items():
                if not _encodable(k):
                    return f"{where or 'body'} (a key)"
                stack.append((x, f"{where}.{k}" if where else k))
        elif isinstance(v, list):
            stack.extend((x, f"{where}[{n}]") for n, x in enumerate(v))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad_request(body: bytes, path: str) -> str | None:
    """Why a JSON body to `path` must be refused here (a field of OBJECT_FIELDS that is not an object, a lone
    surrogate in a string); None to pass it to vLLM."""
    fields = [f for f, paths in OBJECT_FIELDS.items() if path in paths]
    if not fields and path not in TEXT_PATHS:
        return None
    try:
        data = json.loads(body)
    except ValueError:  # vLLM answers malformed JSON with 400 itself
        return None
    except RecursionError:  # vLLM's own parse fails the same way, answered with HTTP 500
        return "the JSON body is nested too deeply"
    if not isinstance(data, dict):
        return None
    for field in fields:
        if data.get(field) is not None and not isinstance(data[field], dict):
            return f"{field} must be a JSON object, got {type(data[field]).__name__}"
    if path in TEXT_PATHS and (where := lone_surrogate(data)):
        return f"{where} holds a lone UTF-16 surrogate, which is not a character"
    return None


def with_budget(body: bytes, budget: int) -> bytes:
    """The chat request body with thinking_token_budget set to `budget` where the request sets none (absent or
    null); the body unchanged otherwise, and where it is no JSON object (vLLM answers those itself)."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return body
    if not isinstance(data, dict) or data.get(BUDGET_FIELD) is not None:
        return body
    return json.dumps({**data, BUDGET_FIELD: budget}).encode()


def env_budget() -> int | None:
    """The server's default thinking budget (LAB_THINK_BUDGET, set from the variant's checked THINK_BUDGET)."""
    value = os.environ.get(THINK_BUDGET_ENV, "")
    return int(value) if value.isdigit() else None


def error_json(status: int, message: str, param: str | None = None, **extra) -> bytes:
    """An OpenAI-style error body, as vLLM writes its own (400: BadRequestError; 503: ServiceUnavailableError; 502:
    a stream the engine broke);
    `extra` keys sit beside "error" (the request front's engine state)."""
    kind = {400: "BadRequestError", 502: "BadGatewayError"}.get(status, "ServiceUnavailableError")
    err = {"message": message, "type": kind, **({"param": param} if param else {}), "code": status}
    return json.dumps({"error": err, **extra}).encode()


async def answer(send, status: int, body: dict | bytes, headers: list[tuple[bytes, bytes]] = ()) -> None:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": raw})


class RequestGuard:
    """Pure ASGI middleware: POST bodies to the guarded paths are read whole, checked by bad_request, and
    replayed to the engine (vLLM, SGLang) when they pass: unchanged, or with the default thinking budget added
    (with_budget)."""

    def __init__(self, app, budget: int | None = None) -> None:
        self.app = app
        self.budget = budget if budget is not None else env_budget()
        self.paths = {p for paths in OBJECT_FIELDS.values() for p in paths} | set(TEXT_PATHS)

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "").removeprefix(scope.get("root_path", "")).rstrip("/")
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in self.paths:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away while sending
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        if why := bad_request(body, path):
            await answer(send, 400, error_json(400, why, param=why.split()[0]))
            return
        if self.budget is not None and path in BUDGET_PATHS and (new := with_budget(body, self.budget)) is not body:
            body = new
            scope = {**scope, "headers": [(k, v) for k, v in scope.get("headers", []) if k.lower() != b"content-length"]
                     + [(b"content-length", str(len(body)).encode())]}
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # after the body: disconnect notices, as vLLM expects them

        await self.app(scope, replay, send)
