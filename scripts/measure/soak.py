"""A bounded soak of a variant's server on loopback: streamed chat and completion requests at several concurrencies,
clients that disconnect mid-stream and requests built to be refused; afterwards the server must be idle again.

    python -m scripts.measure.soak smollm2-bf16                      # starts the server, soaks it, stops it
    python -m scripts.measure.soak smollm2-gguf-bf16-server          # the same for llama-server (ENGINE=llamaserver)
    python -m scripts.measure.soak smollm2-bf16 --requests 12 --concurrency 1,8 --out-dir /tmp/soak   # a short one
    python -m scripts.measure.soak smollm2-bf16 --base-url http://127.0.0.1:8000 --server-pid 4242

Each level (concurrency 1, 8, 32 by default) sends --requests requests, at most c in flight, drawn from a fixed,
seeded mix (KINDS): plain streamed chats and completions from the latency prompt set, streams the client drops after
two chunks, a prompt twice the model's context, max_tokens ten times the context, n > 1, logprobs at the engine's
maximum and one above it, stop strings, and unicode edge cases (emoji sequences, right-to-left and combining marks,
NUL, a lone surrogate). A request passes when it ends as its kind allows: a complete answer (a stream that ends with
[DONE] and a finish reason for every choice) or a 4xx with a message; never a 5xx, an error inside a stream, a
connection the server broke, a truncated stream or no answer within --timeout. An error event with a 4xx code inside
a 200 stream (vLLM checks some limits, e.g. top_logprobs, after the stream starts) counts as refused with a message,
and the record keeps it apart (rejected_in_stream).

After the last request the server must be idle again within --idle-timeout seconds: vLLM's /metrics shows no running
or waiting request and 0 KV-cache usage, llama-server's none processing or deferred; an engine without /metrics
(llama-cpp-python) must answer a one-token probe. The server's resident memory (its whole process group) is sampled
after every hundred requests and may grow by less than MAX_RSS_GROWTH between the second hundred and the end. Writes
experiments/<variant>/soak_<YYYYMMDD-HHMMSS>.json; a run that misses a criterion is recorded as failed, with every
criterion's value.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import math
import random
import sys
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import configured_context, engine_of, props_context
from scripts.common.loadgen import DEFAULT_PROMPTS, PromptSetError, load_prompts, parse_levels
from scripts.common.metrics import percentile
from scripts.common.records import envelope, exit_status, mark_unmet, save_record
from scripts.common.server import ServerError, group_rss_mib, http_get, is_healthy
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.measure.prom import scrape
from scripts.serve.launch import variant_server

DEFAULT_CONCURRENCY = "1,8,32"
DEFAULT_REQUESTS = 120  # per level: 360 in all at the default levels, so the RSS check has a second and a last hundred
MAX_RSS_GROWTH = 0.05  # server RSS after the last request vs after the second hundred
RSS_EVERY = 100
# vLLM's --max-logprobs default (vllm/config/model.py); a variant's SERVE_MAX_LOGPROBS replaces it
VLLM_MAX_LOGPROBS = 20
DISCONNECT_AFTER_CHUNKS = 2
# Unicode a tokenizer and a detokenizer must survive: ZWJ emoji sequences, RTL with marks, combining stacks, CJK,
# a BOM, NUL, a lone surrogate (JSON allows the escape; UTF-8 cannot encode it), a long run of one grapheme.
UNICODE_CASES = (
    "Describe 👩‍👩‍👧‍👦 and 🏳️‍🌈 in one word.",
    "ترجم: مرحبا بالعالم \u200f\u202e reversed \u202c",
    "Z\u0351\u0364\u036b\u0300a\u0302\u0335\u0327l\u0358g\u0489o\u0301 text?",
    "用一句话解释量子力学。日本語もどうぞ。",
    "\ufeffBOM first, then text.",
    "NUL here:\u0000 and after.",
    "lone surrogate: \ud800 end",
    "é" * 600,
)
STOP_STRINGS = ["\n", ".", " the"]


class SoakError(RuntimeError):
    pass


@dataclass(frozen=True)
class Kind:
    """One kind of request in the mix: its weight, and the outcomes that count as passing."""
    name: str
    weight: int
    allowed: tuple[str, ...]  # "complete" | "rejected" | "cancelled"


KINDS = (
    Kind("chat", 30, ("complete",)),
    Kind("completion", 20, ("complete",)),
    Kind("disconnect", 15, ("cancelled", "complete")),
    Kind("prompt_over_context", 5, ("rejected",)),
    Kind("max_tokens_over_context", 5, ("rejected", "complete")),
    Kind("n_choices", 5, ("complete", "rejected")),
    Kind("logprobs_max", 5, ("complete",)),
    Kind("logprobs_over_max", 3, ("rejected", "complete")),
    Kind("stop_strings", 5, ("complete",)),
    Kind("unicode", 7, ("complete", "rejected")),
    # the storm's own kinds (weight 0 in the soak): max_tokens of ten million, 50 top logprobs, a lone surrogate in a
    # stop string
    Kind("max_tokens_huge", 0, ("rejected", "complete")),
    Kind("top_logprobs_50", 0, ("rejected", "complete")),
    Kind("stop_surrogate", 0, ("rejected", "complete")),
)
BY_NAME = {k.name: k for k in KINDS}
# Request mixes by weight: the soak (every kind above at its weight) and the storm a user threw at a deployed server
# (issue 63: streamed chats at c=32, a third dropped by the client after DISCONNECT_AFTER_CHUNKS, the rest mostly
# built to be refused)
MIXES = {
    "soak": {k.name: k.weight for k in KINDS if k.weight},
    "storm": {"chat": 20, "disconnect": 33, "prompt_over_context": 8, "max_tokens_over_context": 8,
              "max_tokens_huge": 8, "top_logprobs_50": 8, "stop_surrogate": 8, "unicode": 7},
}


@dataclass
class Outcome:
    kind: str
    endpoint: str
    level: int
    index: int
    # complete | cancelled | rejected | rejected_in_stream | server_error | stream_error | broken | truncated | hang
    outcome: str = "unknown"
    status: int | None = None
    ttft_ms: float | None = None
    e2e_ms: float | None = None
    chunks: int = 0
    finish_reasons: list[str] = field(default_factory=list)
    message: str | None = None

    @property
    def passed(self) -> bool:
        """A 4xx error event inside a 200 stream (vLLM checks some limits after the stream starts) counts as refused."""
        allowed = BY_NAME[self.kind].allowed
        return self.outcome in allowed or (self.outcome == "rejected_in_stream" and "rejected" in allowed)


def plan(requests: int, seed: int, mix: str = "soak") -> list[str]:
    """The kinds of one level's requests: a seeded draw by the mix's weights, identical for every engine and run."""
    rng = random.Random(seed)
    names, weights = list(MIXES[mix]), list(MIXES[mix].values())
    return rng.choices(names, weights=weights, k=requests)


def request_for(kind: str, i: int, rows: list[dict], model: str, context: int, max_logprobs: int) -> tuple[str, dict]:
    """(endpoint path, JSON body) of request i of a kind; every body streams."""
    row = rows[i % len(rows)]
    user = row["messages"][-1]["content"]
    chat = {"model": model, "messages": row["messages"], "max_tokens": min(row["max_tokens"], 48), "temperature": 0,
            "stream": True}
    if kind == "chat":
        return "/v1/chat/completions", {**chat, "temperature": 0.7 if i % 2 else 0, "seed": i}
    if kind == "completion":
        return "/v1/completions", {"model": model, "prompt": user, "max_tokens": 32, "temperature": 0, "stream": True}
    if kind == "disconnect":
        return "/v1/chat/completions", {**chat, "max_tokens": 256}
    if kind == "prompt_over_context":  # "hello" is one token in every tokenizer here: twice the context in tokens
        return "/v1/completions", {"model": model, "prompt": " hello" * (2 * context), "max_tokens": 8, "stream": True}
    if kind == "max_tokens_over_context":
        return "/v1/chat/completions", {**chat, "max_tokens": 10 * context}
    if kind == "max_tokens_huge":
        return "/v1/chat/completions", {**chat, "max_tokens": 10_000_000}
    if kind == "top_logprobs_50":
        return "/v1/chat/completions", {**chat, "max_tokens": 8, "logprobs": True, "top_logprobs": 50}
    if kind == "stop_surrogate":
        return "/v1/chat/completions", {**chat, "max_tokens": 32, "stop": [".", "\ud800"]}
    if kind == "n_choices":
        return "/v1/chat/completions", {**chat, "n": 3, "temperature": 0.8, "seed": i, "max_tokens": 24}
    if kind == "logprobs_max":
        if i % 2:
            return "/v1/completions", {"model": model, "prompt": user, "max_tokens": 16, "logprobs": max_logprobs,
                                       "stream": True}
        return "/v1/chat/completions", {**chat, "max_tokens": 16, "logprobs": True, "top_logprobs": max_logprobs}
    if kind == "logprobs_over_max":
        return "/v1/chat/completions", {**chat, "max_tokens": 8, "logprobs": True, "top_logprobs": max_logprobs + 1}
    if kind == "stop_strings":
        return "/v1/chat/completions", {**chat, "max_tokens": 64, "stop": STOP_STRINGS}
    if kind == "unicode":
        return "/v1/chat/completions", {**chat, "max_tokens": 24,
                                        "messages": [{"role": "user", "content": UNICODE_CASES[i % len(UNICODE_CASES)]}]}
    raise SoakError(f"unknown request kind {kind!r}")


def error_message(raw: bytes) -> str | None:
    """The message of an OpenAI-style error body ({"error": {"message": …}} or {"message": …}); None without one."""
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    if isinstance(body, dict):
        err = body.get("error", body)
        msg = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
        if not msg and isinstance(body.get("detail"), (str, list)):  # FastAPI's validation errors
            msg = json.dumps(body["detail"])[:300]
        return str(msg)[:300] if msg else None
    return None


def read_stream(lines, out: Outcome, t0: float, disconnect: bool, n_expected: int, timeout_s: float = math.inf) -> None:
    """Consume an SSE stream into `out`: complete when [DONE] arrives after a finish reason for every choice; a hang
    when that takes longer than timeout_s, keep-alive comments or not (an SSE server may ping a queued request)."""
    finished: dict[int, str] = {}
    for line in lines:
        if time.perf_counter() - t0 > timeout_s:
            out.outcome, out.message = "hang", f"no complete answer within {timeout_s:.0f} s (the stream stayed open)"
            return
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            out.outcome = "complete" if len(finished) >= n_expected else "truncated"
            if out.outcome == "truncated":
                out.message = f"[DONE] after finish reasons for {len(finished)} of {n_expected} choices"
            return
        chunk = json.loads(data)
        if "error" in chunk:  # an error after the 200 header: vLLM sends it as an event, with the HTTP code it means
            err = chunk["error"] if isinstance(chunk["error"], dict) else {"message": str(chunk["error"])}
            code = err.get("code") if isinstance(err.get("code"), int) else None
            out.status, out.message = code or out.status, str(err.get("message"))[:300]
            out.outcome = "rejected_in_stream" if code and 400 <= code < 500 and err.get("message") else "stream_error"
            return
        out.chunks += 1
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if out.ttft_ms is None and (delta.get("content") or choice.get("text")):
                out.ttft_ms = (time.perf_counter() - t0) * 1000
            if choice.get("finish_reason"):
                finished[choice.get("index", 0)] = choice["finish_reason"]
                out.finish_reasons.append(choice["finish_reason"])
        if disconnect and out.chunks >= DISCONNECT_AFTER_CHUNKS:
            out.outcome = "cancelled"
            return
    out.outcome, out.message = "truncated", "the stream ended without [DONE]"


def send(client, base_url: str, endpoint: str, body: dict, out: Outcome, timeout_s: float) -> Outcome:
    """One request; no complete answer within timeout_s is a hang (the read timeout, and the stream's own deadline)."""
    import httpx

    t0 = time.perf_counter()
    try:
        # serialized here, ASCII-escaped: a lone surrogate travels as the JSON escape a client may legally send
        content = json.dumps(body).encode()
        with client.stream("POST", base_url + endpoint, content=content, headers={"Content-Type": "application/json"},
                           timeout=httpx.Timeout(timeout_s)) as resp:
            out.status = resp.status_code
            if resp.status_code >= 400:
                out.message = error_message(resp.read())
                out.outcome = ("server_error" if resp.status_code >= 500 else
                               "rejected" if out.message else "rejected_without_message")
            else:
                read_stream(resp.iter_lines(), out, t0, out.kind == "disconnect", body.get("n", 1), timeout_s)
    except httpx.TimeoutException:
        out.outcome, out.message = "hang", f"no answer within {timeout_s:.0f} s"
    except (httpx.TransportError, ValueError) as e:
        out.outcome, out.message = "broken", f"{type(e).__name__}: {str(e)[:200]}"
    out.e2e_ms = (time.perf_counter() - t0) * 1000
    return out


def served_context(base_url: str, variant) -> int:
    """The context one request can use, in tokens, as the engine states it: vLLM's /v1/models max_model_len, else
    llama-server's /props (default_generation_settings.n_ctx: one slot's context), else the variant's own setting
    (llama-cpp-python's LLAMACPP_N_CTX, llama-server's LLAMASERVER_CTX_SIZE shared by its LLAMASERVER_PARALLEL slots)."""
    status, raw = http_get(f"{base_url}/v1/models", timeout=10)
    if status == 200:
        for m in json.loads(raw).get("data", []):
            if isinstance(m.get("max_model_len"), int):
                return m["max_model_len"]
    status, raw = http_get(f"{base_url}/props", timeout=10)
    if status == 200 and (n_ctx := props_context(json.loads(raw))):
        return n_ctx
    if n_ctx := configured_context(variant.resolved):
        return n_ctx
    raise SoakError(f"{base_url} states no context (vLLM's /v1/models max_model_len, llama-server's /props n_ctx) and "
                    f"the variant sets none (LLAMACPP_N_CTX or LLAMASERVER_CTX_SIZE in its config.env)")


# The gauges that say a server is idle, per engine that exports Prometheus /metrics: all 0 when nothing runs.
IDLE_GAUGES = {
    "vllm": {"running": "vllm:num_requests_running", "waiting": "vllm:num_requests_waiting",
             "kv_cache_usage_perc": "vllm:kv_cache_usage_perc"},
    "llamaserver": {"running": "llamacpp:requests_processing", "waiting": "llamacpp:requests_deferred"},
    "sglang": {"running": "sglang_num_running_reqs", "waiting": "sglang_num_waiting_reqs"},
}
# Where each engine states them: /metrics (vLLM; llama-server with --metrics), else SGLang's /v1/loads, read from its
# scheduler when asked (its /metrics exists only with --enable-metrics, its gauges set by periodic stats)
LOAD_PAGES = ("/metrics", "/v1/loads?include=core&format=prometheus")


def idle_gauges(values: dict) -> dict | None:
    """The idle gauges of the engine whose metrics these are (by their names), or None for metrics of neither."""
    for gauges in IDLE_GAUGES.values():
        if gauges["running"] in values:
            return {k: values.get(name) for k, name in gauges.items()}
    return None


def load_gauges(base_url: str, pages: tuple[str, ...] = LOAD_PAGES) -> tuple[str, dict] | None:
    """(the page, its idle gauges) from the first of `pages` that has an engine's, or None."""
    for path in pages:
        got = scrape(base_url, path)
        if got is not None and (gauges := idle_gauges(got[0])) is not None:
            return path, gauges
    return None


def idle_state(base_url: str, model: str, timeout_s: float) -> dict:
    """How the server stands after the soak: its running and waiting requests (and vLLM's KV usage) polled from
    /metrics (SGLang: /v1/loads) until all are 0, or (neither: llama-cpp-python) a one-token probe's answer time."""
    t0 = time.monotonic()
    last = page = None
    while time.monotonic() - t0 < timeout_s:
        if (got := load_gauges(base_url, (page,) if page else LOAD_PAGES)) is None:  # the page found, once found
            break
        page, last = got
        if all(v == 0 for v in last.values()):
            return {"method": "metrics", "page": page, "idle": True, "seconds": round(time.monotonic() - t0, 2), **last}
        time.sleep(0.5)
    if last is not None:
        return {"method": "metrics", "page": page, "idle": False, "seconds": round(time.monotonic() - t0, 2), **last}
    import httpx

    probe = Outcome("chat", "/v1/chat/completions", 0, -1)
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    with httpx.Client() as client:
        send(client, base_url, probe.endpoint, body, probe, timeout_s)
    return {"method": "one-token probe (no /metrics)", "idle": probe.outcome == "complete",
            "seconds": round((probe.e2e_ms or 0) / 1000, 2), "probe_outcome": probe.outcome}


class RssSampler:
    """The server group's RSS after every RSS_EVERY finished requests (thread-safe)."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.done, self.samples, self.lock = pid, 0, {}, threading.Lock()

    def finished(self) -> None:
        with self.lock:
            self.done += 1
            if self.pid and self.done % RSS_EVERY == 0:
                self.samples[str(self.done)] = group_rss_mib(self.pid)


def rss_growth(samples: dict[str, float | None], total: int) -> float | None:
    """RSS after the last request relative to after the second hundred; None where that cannot be judged (fewer than
    three hundred requests, or no RSS)."""
    second, end = samples.get(str(2 * RSS_EVERY)), samples.get("end")
    if total < 3 * RSS_EVERY or not second or not end:
        return None
    return end / second - 1


def level_summary(outs: list[Outcome]) -> dict:
    ttft = [o.ttft_ms for o in outs if o.outcome == "complete" and o.ttft_ms is not None]
    return {"requests": len(outs), "complete": sum(o.outcome == "complete" for o in outs),
            "ttft_p50_ms": percentile(ttft, 50) if ttft else None, "ttft_p99_ms": percentile(ttft, 99) if ttft else None,
            "e2e_max_ms": max((o.e2e_ms or 0) for o in outs) if outs else None}


def summarize(outs: list[Outcome], rss: dict, idle: dict, healthy_after: bool, levels: list[int]) -> dict:
    """Counts by outcome and cause, per-level TTFT, and every pass criterion with its value."""
    by_outcome: dict[str, int] = {}
    for o in outs:
        by_outcome[o.outcome] = by_outcome.get(o.outcome, 0) + 1
    rejected: dict[str, dict[str, int]] = {}
    for o in outs:
        if o.outcome.startswith("rejected"):
            cause = rejected.setdefault(o.kind, {})
            cause[str(o.status)] = cause.get(str(o.status), 0) + 1
    growth = rss_growth(rss, len(outs))
    not_allowed = [o for o in outs if not o.passed]
    criteria = {
        "server_errors": {"value": by_outcome.get("server_error", 0) + by_outcome.get("stream_error", 0), "target": 0},
        "hangs": {"value": by_outcome.get("hang", 0), "target": 0},
        "broken_or_truncated": {"value": by_outcome.get("broken", 0) + by_outcome.get("truncated", 0), "target": 0},
        "outside_kind": {"value": len(not_allowed), "target": 0},
        "idle_after": {"value": idle["idle"], "target": True},
        "healthy_after": {"value": healthy_after, "target": True},
        "rss_growth": {"value": growth, "target": f"< {MAX_RSS_GROWTH}"},
    }
    for name, c in criteria.items():
        c["pass"] = (c["value"] is None or c["value"] < MAX_RSS_GROWTH) if name == "rss_growth" else c["value"] == c["target"]
    first_bad = {o.kind: f"{o.outcome} (HTTP {o.status}): {o.message}" for o in reversed(not_allowed)}
    return {"requests": len(outs), "by_outcome": by_outcome, "cancellations": by_outcome.get("cancelled", 0),
            "rejected_by_cause": rejected, "first_outside_kind": first_bad,
            "levels": {str(c): level_summary([o for o in outs if o.level == c]) for c in levels},
            "rss_mib": rss, "rss_growth": growth, "rss_judged": growth is not None, "idle": idle,
            "criteria": criteria, "pass": all(c["pass"] for c in criteria.values())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--base-url", help="soak a running server instead of starting one")
    p.add_argument("--server-pid", type=int, help="with --base-url: the server's process group, for its RSS")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels (default %(default)s)")
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per level (default %(default)s)")
    p.add_argument("--seed", type=int, default=0, help="seed of the request mix (default %(default)s)")
    p.add_argument("--mix", choices=sorted(MIXES), default="soak", help="request kinds by weight: the soak's, or the "
                   "storm's (--mix storm --concurrency 32 --requests 200: a third dropped by the client, the rest "
                   "mostly built to be refused)")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds without an answer that count as a hang")
    p.add_argument("--idle-timeout", type=float, default=10.0, help="seconds the server may take to be idle again")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def soak(args, variant, base_url: str, server) -> dict:
    import httpx

    levels = parse_levels(args.concurrency)
    if args.requests < 1:
        raise SoakError(f"--requests {args.requests}: must be >= 1")
    rows, info = load_prompts(DEFAULT_PROMPTS)
    model = variant.request_models[0]
    context = served_context(base_url, variant)
    max_logprobs = int(variant.resolved.get("SERVE_MAX_LOGPROBS", VLLM_MAX_LOGPROBS))
    record = envelope("soak", variant, command=[sys.executable, "-m", "scripts.measure.soak", *sys.argv[1:]],
                      server_command=server.argv if server else None)
    record["inputs"] = {**info, "concurrency": levels, "requests_per_level": args.requests, "seed": args.seed,
                        "mix": args.mix,
                        "kinds": {n: {"weight": w, "allowed": list(BY_NAME[n].allowed)} for n, w in MIXES[args.mix].items()},
                        "context_tokens": context, "max_logprobs": max_logprobs, "timeout_s": args.timeout,
                        "idle_timeout_s": args.idle_timeout, "disconnect_after_chunks": DISCONNECT_AFTER_CHUNKS,
                        "max_rss_growth": MAX_RSS_GROWTH, "base_url": base_url}
    pid = server.pid if server else args.server_pid
    sampler = RssSampler(pid)
    rss_start = group_rss_mib(pid) if pid else None
    outs: list[Outcome] = []
    t_run = time.monotonic()
    limits = httpx.Limits(max_connections=max(levels) + 4, max_keepalive_connections=max(levels) + 4)
    with httpx.Client(limits=limits) as client:
        for warm in range(2):  # compile and cache warm-up, not counted
            path, body = request_for("chat", warm, rows, model, context, max_logprobs)
            send(client, base_url, path, body, Outcome("chat", path, 0, -1), args.timeout)
        for c in levels:
            kinds = plan(args.requests, args.seed * 1000 + c, args.mix)

            def one(i: int, kind: str, c: int = c) -> Outcome:
                path, body = request_for(kind, i, rows, model, context, max_logprobs)
                out = send(client, base_url, path, body, Outcome(kind, path, c, i), args.timeout)
                sampler.finished()
                return out

            t0 = time.monotonic()
            with cf.ThreadPoolExecutor(max_workers=c) as pool:
                level = list(pool.map(one, range(len(kinds)), kinds))
            outs += level
            s = level_summary(level)
            bad = sum(not o.passed for o in level)
            print(f"c={c:<3d} {len(level)} requests in {time.monotonic() - t0:6.1f} s  complete {s['complete']}  "
                  f"outside their kind {bad}  ttft p50 {s['ttft_p50_ms'] or 0:7.1f} ms", flush=True)
    rss = {"start": rss_start, **sampler.samples, "end": group_rss_mib(pid) if pid else None}
    idle = idle_state(base_url, model, args.idle_timeout)
    healthy = is_healthy(base_url, path=engine_of(variant).health_path)
    record["samples"] = [asdict(o) for o in outs]
    record["summary"] = summarize(outs, rss, idle, healthy, levels)
    record["duration_s"] = round(time.monotonic() - t_run, 2)
    mark_unmet(record)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="soak") as (base_url, server):
            record = soak(args, variant, base_url, server)
    except (SoakError, PromptSetError, VariantError, ServerError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if (path := save_record(record, args.out_dir or variant.path, "soak")) is None:
        return 1
    s = record["summary"]
    print(f"{s['requests']} requests: {s['by_outcome']}; idle after: {s['idle']['idle']}; RSS growth: {s['rss_growth']}")
    return exit_status(record, path)


if __name__ == "__main__":
    sys.exit(main())
