"""The request guard as a thin streaming front, for an engine with no hook in front of its handlers (llama-server).

    python -m scripts.serve.front --host 127.0.0.1 --port 8000 --engine-port 8001 -- llama-server --port 8001 …

vLLM takes the lab's RequestGuard as middleware (scripts/serve/guard.py); llama-server has no such hook, so the serve
plan (scripts/serve/plan.py) puts this front before it: one process that starts the engine as its child, in the same
process group (stopping the server by PID stops both), listens on the public port and passes every request through
unchanged, its answer streamed back byte for byte, except the bodies llama-server (build 11434) mishandles:

  - max_tokens (or max_completion_tokens, n_predict) beyond the context less the prompt: llama-server accepts it and
    generates until its slot's context is full, holding the slot for minutes on a CPU (eight such requests took a
    whole server in the lab's storm); its --n-predict is only a default a request overrides ("the per-request limit
    takes priority over the global one", tools/server/server-context.cpp). Answered 400 as vLLM answers it. The
    prompt is counted by llama-server itself (/v1/chat/completions/input_tokens, /tokenize) only when the request
    could be near the limit (max_tokens above the context less the body's byte length less TEMPLATE_SLACK);
  - a token id outside [0, n_vocab) sent to /detokenize (C++'s vector::_M_range_check escapes as a 500);
  - a `tools` field that is not an array ("Failed to parse tools", a 500);
  - what RequestGuard refuses for every engine (scripts/serve/guard.py bad_request: JSON nested too deeply, a lone
    surrogate).

A stream the engine breaks before its end (its process killed mid-answer) ends as vLLM ends a stream that fails: an
error event (`data: {"error": {..., "code": 502}}`) and `data: [DONE]`, instead of a cut connection.

With --relay-only the front keeps none of the limits above, for servers that answer for themselves: `make
serve-replicas FRONT=1` puts it before vllm-router, which cuts a client's stream when the replica under it dies
(docs/scale.md); the front turns that into the error event.

    python -m scripts.serve.front --port 8000 --engine-port 8100 --relay-only -- vllm-router --port 8100 …

While the engine starts, every request but none hangs: 503 with {"engine": "starting"}; once its process has exited,
503 with {"engine": "gone", "exit_code": N} for LINGER_S seconds, then the front exits with the engine's code (so
`make serve` and the replica supervisor see the server end). An engine that states no context size (llama-server's
/props n_ctx) and a variant that sets none (--context) stop the front at start with one line naming the setting.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import aiohttp
from aiohttp import web

from scripts.common.engines import ENGINES, props_context
from scripts.serve.guard import bad_request, error_json

# tokens a chat template adds around the messages, above the body's byte length (which bounds the text's tokens:
# a byte-level BPE token covers at least one byte): a request whose max_tokens stays below the context less both is
# passed without counting its prompt
TEMPLATE_SLACK = 256
LINGER_S = 3.0  # how long a gone engine's front answers 503 before it exits
START_POLL_S = 0.5
CONNECT_S = 5.0
MAX_HEAD = 1 << 16  # bytes of an answer's head from the engine
HIGH_WATER = 1 << 18  # bytes unsent to a client above which the engine's answer waits
DRAIN_POLL_S = 0.01
HOP_HEADERS = {"connection", "keep-alive", "transfer-encoding", "te", "trailer", "upgrade", "proxy-authenticate",
               "proxy-authorization", "content-length", "host", "expect"}
GENERATION_PATHS = ("/v1/chat/completions", "/chat/completions", "/v1/completions", "/completions", "/completion")
CHAT_PATHS = ("/v1/chat/completions", "/chat/completions")
LENGTH_FIELDS = ("n_predict", "max_completion_tokens", "max_tokens")  # llama-server's order: n_predict wins


ENGINE = ENGINES["llamaserver"]  # the engine it fronts: its health path and key variable


class FrontError(RuntimeError):
    pass


class BadAnswer(ConnectionError):
    """The engine answered something that is not HTTP/1.x (a 502, not a 503: it is up but wrong)."""


@dataclass(frozen=True)
class Limits:
    context: int  # tokens one request may use (llama-server: one slot's n_ctx)
    vocab: int | None = None  # token ids /detokenize accepts: [0, vocab)


def requested_tokens(data: dict) -> int | None:
    """The answer length a request asks for, as llama-server reads it (n_predict over its aliases); None if unset."""
    for name in LENGTH_FIELDS:
        value = data.get(name)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def length_field(data: dict) -> str:
    return next((n for n in LENGTH_FIELDS if requested_tokens({n: data.get(n)})), "max_tokens")


def too_long(data: dict, context: int, prompt_tokens: int | None) -> str | None:
    """vLLM's 400 for an answer that cannot fit: max_tokens above the context less the prompt (or above the context
    itself, before the prompt is counted)."""
    want = requested_tokens(data)
    if want is None:
        return None
    name = length_field(data)
    if prompt_tokens is None:
        if want > context:
            return (f"'{name}' is too large: {want}. This model's maximum context length is {context} tokens per "
                    f"request")
        return None
    if want + prompt_tokens > context:
        return (f"'{name}' is too large: {want}. This model's maximum context length is {context} tokens and your "
                f"request has {prompt_tokens} input tokens ({want} > {context} - {prompt_tokens})")
    return None


def needs_count(data: dict, context: int, body_bytes: int) -> bool:
    """Whether the prompt must be counted to decide: the answer asked for fits the context but might not fit beside
    a prompt of up to body_bytes tokens plus the template's."""
    want = requested_tokens(data)
    return want is not None and want <= context and want > context - body_bytes - TEMPLATE_SLACK


def refusal(path: str, body: bytes, limits: Limits) -> tuple[str | None, dict | None]:
    """(why the body must be answered 400 without asking the engine, or None; the parsed body when it is a JSON
    object on a path the front reads)."""
    if why := bad_request(body, path):
        return why, None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None, None  # the engine answers malformed JSON with its own 400
    if not isinstance(data, dict):
        return None, None
    if path == "/detokenize":
        tokens = data.get("tokens")
        if isinstance(tokens, list) and limits.vocab:
            for t in tokens:
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < limits.vocab:
                    return f"tokens holds {json.dumps(t)[:40]}: token ids are integers in [0, {limits.vocab})", data
        return None, data
    if path in CHAT_PATHS and "tools" in data and data["tools"] is not None and not isinstance(data["tools"], list):
        return f"tools must be an array, got {type(data['tools']).__name__}", data
    if path in GENERATION_PATHS:
        return too_long(data, limits.context, None), data
    return None, data


class Front:
    """The engine's child process, its state, its limits and the aiohttp app in front of it."""

    def __init__(self, engine_argv: list[str], engine_url: str, context: int | None, api_key: str | None,
                 relay_only: bool = False) -> None:
        self.engine_argv, self.engine_url, self.context_setting = engine_argv, engine_url.rstrip("/"), context
        self.relay_only = relay_only  # no limits of its own: the servers behind (a router's vLLM replicas) answer
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.proc: subprocess.Popen | None = None
        self.limits: Limits | None = None
        self.exit_code: int | None = None
        self.session = None

    # ------------------------------------------------------------------------------------------ the engine's life
    def start_engine(self) -> None:
        self.proc = subprocess.Popen(self.engine_argv)  # inherits the front's process group, stdout and stderr

    async def watch(self, stop: asyncio.Event) -> None:
        """Wait for the engine's health, read its limits, then follow its process until it exits."""
        while self.proc.poll() is None and self.limits is None:
            try:
                async with self.session.get(self.engine_url + ENGINE.health_path, headers=self.headers) as r:
                    if r.status == 200 and self.relay_only:
                        self.limits = Limits(0, None)
                        print("front: engine ready; requests relayed as they are", flush=True)
                    elif r.status == 200:
                        self.limits = await self.read_limits()
                        print(f"front: engine ready; context {self.limits.context} tokens per request, vocabulary "
                              f"{self.limits.vocab}", flush=True)
            except aiohttp.ClientError:
                pass
            except FrontError as e:
                print(f"error: {e}", file=sys.stderr, flush=True)
                self.proc.terminate()
                self.exit_code = 2
                stop.set()
                return
            await asyncio.sleep(START_POLL_S)
        while self.proc.poll() is None:
            await asyncio.sleep(START_POLL_S)
        if self.exit_code is None:
            self.exit_code = self.proc.returncode
        print(f"front: the engine exited with code {self.exit_code}; answering 503 for {LINGER_S:.0f} s, then exiting",
              file=sys.stderr, flush=True)
        await asyncio.sleep(LINGER_S)
        stop.set()

    async def read_limits(self) -> Limits:
        """One request's context from llama-server's /props (default_generation_settings.n_ctx), else --context;
        the vocabulary from /v1/models (meta.n_vocab)."""
        context = self.context_setting
        async with self.session.get(self.engine_url + "/props", headers=self.headers) as r:
            if r.status == 200:
                context = props_context(await r.json(content_type=None)) or context
        if not context:
            raise FrontError("the engine states no context size (GET /props: default_generation_settings.n_ctx) and "
                             "the variant sets none: set LLAMASERVER_CTX_SIZE in its config.env")
        vocab = None
        async with self.session.get(self.engine_url + "/v1/models", headers=self.headers) as r:
            if r.status == 200:
                for m in (await r.json(content_type=None)).get("data") or []:
                    n = (m.get("meta") or {}).get("n_vocab")
                    vocab = n if isinstance(n, int) and n > 0 else vocab
        return Limits(context, vocab)

    def state(self) -> dict | None:
        """None when requests may pass; else the engine's state for a 503."""
        if self.proc.poll() is not None or self.exit_code is not None:
            return {"engine": "gone", "exit_code": self.exit_code if self.exit_code is not None else self.proc.returncode}
        if self.limits is None:
            return {"engine": "starting"}
        return None

    # ------------------------------------------------------------------------------------------------ requests
    async def prompt_tokens(self, path: str, data: dict, headers: dict) -> int | None:
        """The prompt's length in tokens as the engine counts it; None where it cannot say (its own answer decides)."""
        if path in CHAT_PATHS:
            url, body = self.engine_url + "/v1/chat/completions/input_tokens", data
        else:
            prompt = data.get("prompt")
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return len(prompt)
            if not isinstance(prompt, str):
                return None
            url, body = self.engine_url + "/tokenize", {"content": prompt, "add_special": True}
        try:
            async with self.session.post(url, json=body, headers=headers) as r:
                if r.status != 200:
                    return None
                got = await r.json(content_type=None)
        except (aiohttp.ClientError, ValueError):
            return None
        if isinstance(got.get("input_tokens"), int):
            return got["input_tokens"]
        return len(got["tokens"]) if isinstance(got.get("tokens"), list) else None

    async def handle(self, request):
        if (state := self.state()) is not None:
            message = ("the engine is starting" if state["engine"] == "starting"
                       else f"the engine has exited (code {state['exit_code']})")
            return web.Response(status=503, body=error_json(503, message, **state), content_type="application/json")
        body = await request.read()
        path = request.path.rstrip("/") or "/"
        up_headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        if request.method == "POST" and not self.relay_only:
            why, data = refusal(path, body, self.limits)
            if why is None and data is not None and path in GENERATION_PATHS and \
                    needs_count(data, self.limits.context, len(body)):
                auth = {k: v for k, v in up_headers.items() if k.lower() in ("authorization", "x-api-key")}
                if (n := await self.prompt_tokens(path, data, auth)) is not None:
                    why = too_long(data, self.limits.context, n)
            if why:
                return web.Response(status=400, body=error_json(400, why), content_type="application/json")
        return await self.relay(request, body, up_headers)

    async def relay(self, request, body: bytes, headers: dict):
        """The engine's answer to the same request, status, headers and body bytes as it sends them (the body
        streamed piece by piece); the engine unreachable: 503 with its state."""
        loop = asyncio.get_running_loop()
        up = Upstream(request.method == "HEAD")
        host, _, port = self.engine_url.removeprefix("http://").partition(":")
        try:
            transport, _ = await asyncio.wait_for(loop.create_connection(lambda: up, host, int(port)), CONNECT_S)
        except OSError as e:  # TimeoutError among them
            state = self.state() or {"engine": "not answering"}
            return web.Response(status=503, body=error_json(503, f"the engine did not answer: {type(e).__name__}",
                                                            **state), content_type="application/json")
        done = False
        try:
            transport.write(request_bytes(request.method, request.path_qs, f"{host}:{port}", headers, body))
            try:
                status, reason, up_headers = await up.head
            except BadAnswer as e:
                return web.Response(status=502, body=error_json(502, f"the engine's answer is not HTTP: {e}"),
                                    content_type="application/json")
            except ConnectionError as e:  # the engine closed before its answer's head
                state = self.state() or {"engine": "not answering"}
                return web.Response(status=503, body=error_json(503, f"the engine did not answer: {e}", **state),
                                    content_type="application/json")
            resp = web.StreamResponse(status=status, reason=reason, headers=[
                (k, v) for k, v in up_headers if k.lower() not in HOP_HEADERS])
            if up.length is not None:
                resp.content_length = up.length
            elif request.version >= (1, 1) and not up.empty:
                resp.enable_chunked_encoding()
            elif not up.empty:
                resp.force_close()  # an HTTP/1.0 client: the body's end is the connection's
            await resp.prepare(request)
            up.attach(request.transport, chunked=resp.chunked)
            if (broken := await up.done) is not None:
                if up.length is not None or not any(k.lower() == "content-type" and v.lower().startswith(
                        "text/event-stream") for k, v in up_headers):
                    raise ConnectionResetError(broken)  # a body with a length: nothing well-formed can follow
                # end the stream as vLLM ends one that fails: an error event, then [DONE] (an event the cut left
                # half-written is closed first: the client's parser drops or refuses it)
                print(f"front: the engine's stream broke ({broken}); the client gets an error event",
                      file=sys.stderr, flush=True)
                up.write((b"" if up.tail == b"\n\n" else b"\n\n") + b"data: " + error_json(
                    502, f"the engine's stream broke before its end: {broken}") + b"\n\ndata: [DONE]\n\n")
            await resp.write_eof()
            done = True
            return resp
        finally:
            if not done:
                transport.close()  # a client gone mid-stream: the engine sees its connection close and frees the slot
            if up.head.done() and not up.head.cancelled():
                up.head.exception()  # read: an answer given up on before its head is no "never retrieved" warning


def request_bytes(method: str, path_qs: str, host: str, headers: dict, body: bytes) -> bytes:
    """The request as HTTP/1.1 on a connection of its own (closed after the answer, which ends a body of no stated
    length)."""
    lines = [f"{method} {path_qs} HTTP/1.1", f"Host: {host}", *(f"{k}: {v}" for k, v in headers.items())]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join([*lines, "Connection: close", "", ""])).encode("utf-8", "surrogateescape") + body


class Upstream(asyncio.Protocol):
    """One answer from the engine, read on its own connection: the head parsed, the body decoded as it arrives
    (Content-Length, chunked, or up to the connection's end) and written to the client's socket from the same
    callback, framed again for the client (chunked where the client's response is); no task switch a token.

    `head` resolves to (status, reason, [(name, value), ...]); `done` to None when the body ended whole, else why it
    did not. Bytes that come before `attach` are kept and written then. The engine's reading pauses while the client's
    socket holds more than HIGH_WATER bytes unsent."""

    def __init__(self, head_only: bool = False) -> None:
        loop = asyncio.get_running_loop()
        self.head, self.done = loop.create_future(), loop.create_future()
        self.head_only = head_only  # a HEAD request: the answer has no body whatever its headers say
        self.buf = b""
        self.state = "head"  # head, length, size, data, crlf, trailer, eof (to the connection's end), end
        self.left = 0  # bytes left of the body (length) or of the current chunk (data)
        self.length: int | None = None
        self.empty = False
        self.transport = None
        self.client = None
        self.chunked = False
        self.kept: list[bytes] = []
        self.tail = b"\n\n"  # the body's last two bytes written so far

    # --- the engine's side
    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        if self.state == "head":
            self.buf += data
            while self.state == "head":  # an interim answer (100 Continue, 103 Early Hints) precedes the final one
                at = self.buf.find(b"\r\n\r\n")
                if at < 0:
                    if len(self.buf) > MAX_HEAD:
                        self.fail("the engine's answer head is over 64 KiB", bad=True)
                    return
                head, self.buf = self.buf[:at], self.buf[at + 4:]
                if not self.read_head(head):
                    return
            data, self.buf = self.buf, b""
        piece = self.decode(data)
        if piece:
            self.write(piece)
        if self.state == "end":
            self.finish(None)

    def connection_lost(self, exc) -> None:
        if self.state == "eof" or (self.state == "trailer" and not self.buf):  # the last chunk, its final CRLF cut
            self.state = "end"
        if self.state == "end":
            self.finish(None)
        elif self.state == "head":
            self.fail(f"{type(exc).__name__}: {exc}" if exc else "the engine closed the connection before answering")
        else:
            self.finish(f"{type(exc).__name__}: {exc}" if exc else "the engine closed the connection mid-answer")

    def fail(self, why: str, bad: bool = False) -> None:
        if not self.head.done():
            self.head.set_exception((BadAnswer if bad else ConnectionError)(why))
        self.finish(why)
        if self.transport is not None:
            self.transport.close()

    def finish(self, why: str | None) -> None:
        if not self.done.done():
            self.done.set_result(why)
        if self.state == "end" and self.transport is not None:
            self.transport.close()

    def read_head(self, raw: bytes) -> bool:
        lines = raw.decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or not code.isdigit():
            self.fail(f"the engine answered no HTTP/1.x head: {lines[0][:60]!r}", bad=True)
            return False
        status = int(code)
        if 100 <= status < 200 and status != 101:
            return True  # interim: the final head follows
        headers = [(k.strip(), v.strip()) for k, _, v in (line.partition(":") for line in lines[1:] if line)]
        names = {k.lower(): v for k, v in headers}
        if self.head_only or status in (204, 304) or status < 200:
            self.state, self.empty = "end", True
            if self.head_only and (n := names.get("content-length", "")).isdigit():
                self.length = int(n)  # what a GET would carry, said again to the client
        elif "chunked" in names.get("transfer-encoding", "").lower():
            self.state = "size"
        elif (n := names.get("content-length", "")).isdigit():
            self.length = self.left = int(n)
            self.state = "length" if self.left else "end"
        else:
            self.state = "eof"
        self.head.set_result((status, reason, headers))
        return True

    def decode(self, data: bytes) -> bytes:
        """The body bytes in `data`, framing removed; advances the state."""
        if self.state == "eof":
            return data
        if self.state == "length":
            piece, self.left = data[:self.left], self.left - min(len(data), self.left)
            if not self.left:
                self.state = "end"
            return piece
        out = []
        buf = self.buf + data if self.buf else data
        i = 0
        while i < len(buf) and self.state not in ("end",):
            if self.state == "data":
                piece = buf[i:i + self.left]
                out.append(piece)
                i += len(piece)
                self.left -= len(piece)
                if not self.left:
                    self.state = "crlf"
            elif self.state == "crlf":
                if len(buf) - i < 2:
                    break
                i += 2
                self.state = "size"
            else:  # a size line or a trailer line
                at = buf.find(b"\r\n", i)
                if at < 0:
                    break
                line, i = buf[i:at], at + 2
                if self.state == "trailer":
                    if not line:
                        self.state = "end"
                    continue
                size = line.split(b";", 1)[0].strip()
                if not size or size.strip(b"0123456789abcdefABCDEF"):  # int() would take -1, +5, 0x5, 5_0
                    self.fail(f"the engine sent a bad chunk size: {line[:20]!r}", bad=True)
                    return b""
                self.left = int(size, 16)
                self.state = "data" if self.left else "trailer"
        self.buf = buf[i:] if self.state != "end" else b""
        return b"".join(out)

    # --- the client's side
    def attach(self, client, chunked: bool) -> None:
        self.client, self.chunked = client, chunked
        kept, self.kept = b"".join(self.kept), []
        if kept:
            self.write(kept)

    def write(self, piece: bytes) -> None:
        if self.client is None:
            self.kept.append(piece)
            return
        if self.client.is_closing():  # the client has gone: stop reading the engine (the handler closes it)
            self.transport.pause_reading()
            return
        self.client.write(b"%x\r\n%b\r\n" % (len(piece), piece) if self.chunked else piece)
        self.tail = (self.tail + piece)[-2:]
        if self.client.get_write_buffer_size() > HIGH_WATER and not self.transport.is_closing():
            self.transport.pause_reading()
            asyncio.get_running_loop().call_later(DRAIN_POLL_S, self.resume)

    def resume(self) -> None:
        if self.transport.is_closing() or self.client.is_closing():
            return
        if self.client.get_write_buffer_size() > HIGH_WATER // 2:
            asyncio.get_running_loop().call_later(DRAIN_POLL_S, self.resume)
        else:
            self.transport.resume_reading()


async def serve(front: Front, host: str, port: int) -> int:
    # one connection per request: pooled connections that llama-server had already closed failed 5 of 360 soak
    # requests (ServerDisconnectedError before any answer, 2026-11-28)
    front.session = aiohttp.ClientSession(auto_decompress=False, timeout=aiohttp.ClientTimeout(total=None, connect=5),
                                          connector=aiohttp.TCPConnector(limit=0, force_close=True))
    app = web.Application(client_max_size=1 << 30)
    app.router.add_route("*", "/{tail:.*}", front.handle)
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    front.start_engine()
    print(f"front: listening on {host}:{port}, engine {front.engine_url} (pid {front.proc.pid})", flush=True)
    watcher = asyncio.create_task(front.watch(stop))
    await stop.wait()
    watcher.cancel()
    if front.proc.poll() is None:
        front.proc.terminate()
        deadline = time.monotonic() + 20
        while front.proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.2)
        if front.proc.poll() is None:
            front.proc.kill()
    await runner.cleanup()
    await front.session.close()
    code = front.exit_code if front.exit_code is not None else front.proc.wait()
    return code if code >= 0 else 128 - code  # killed by a signal: 128 + its number, as a shell says


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True, help="the public port")
    p.add_argument("--engine-port", type=int, required=True, help="the port the engine listens on (loopback)")
    p.add_argument("--context", type=int, help="tokens per request where the engine states none (the variant's own)")
    p.add_argument("--relay-only", action="store_true", help="no request limits of the front's own (a router of vLLM "
                   "replicas behind it answers for itself): the engine's state while it starts or after it exits, "
                   "and an error event ending a stream the engine breaks")
    p.add_argument("engine", nargs=argparse.REMAINDER, help="-- then the engine's command")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    engine = args.engine[1:] if args.engine[:1] == ["--"] else args.engine
    if not engine:
        print("error: no engine command: give it after `--`", file=sys.stderr)
        return 2
    key = os.environ.get(ENGINE.key_env) or None
    front = Front(engine, f"http://127.0.0.1:{args.engine_port}", args.context, key, relay_only=args.relay_only)
    try:
        try:
            import uvloop  # vLLM's own event loop: fewer cycles a relayed chunk, which a two-core engine feels
        except ImportError:
            return asyncio.run(serve(front, args.host, args.port))
        return uvloop.run(serve(front, args.host, args.port))
    except OSError as e:
        print(f"error: front on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        if front.proc is not None and front.proc.poll() is None:
            front.proc.terminate()
        return 1


if __name__ == "__main__":
    sys.exit(main())
