"""Every route of a keyed vLLM server behind its key, /health alone open (and /metrics where METRICS_PUBLIC=1).

vLLM's own check (vllm/entrypoints/serve/middleware/authenticate.py) guards /v1, /v2, /inference and /cohere only:
/tokenize, /detokenize, /metrics, /version, /openapi.json and the rest answer anyone. `scripts.serve` starts a keyed
vLLM server with `--middleware scripts.serve.guard.KeyGuard`, vLLM's own hook for extra ASGI middleware: this class
reads the same key vLLM reads (VLLM_API_KEY, in the server's environment, never its argv) and answers 401 to any other
path without `Authorization: Bearer <key>`; the key is compared as vLLM compares it (SHA-256 digests,
secrets.compare_digest). Without a key it passes everything through. OPTIONS (CORS preflight) stays open, as in vLLM.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets

MIDDLEWARE = "scripts.serve.guard.KeyGuard"  # the value of vLLM's --middleware
KEY_ENV = "VLLM_API_KEY"
PUBLIC_METRICS_ENV = "LAB_METRICS_PUBLIC"  # "1": /metrics answers without the key (the variant's METRICS_PUBLIC=1)
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
        body = json.dumps({"error": "Unauthorized"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
