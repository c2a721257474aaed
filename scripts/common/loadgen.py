"""Load generation shared by measure.latency and monitor: the versioned prompt set and streamed greedy requests."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import json
import threading
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.engines import fixed_length_body
from scripts.common.metrics import RequestSample
from scripts.common.server import ServerError, http_post_json

DEFAULT_PROMPTS = paths.EVAL / "prompts" / "latency-v1.jsonl"


class PromptSetError(ValueError):
    pass


def openai_client(base_url: str, timeout: float = 600):
    """OpenAI client for an OpenAI-compatible server at base_url (no retries: every failure is counted)."""
    from openai import OpenAI

    return OpenAI(base_url=f"{base_url.rstrip('/')}/v1", api_key="unused", max_retries=0, timeout=timeout)


def parse_levels(text: str) -> list[int]:
    """--concurrency "1,8,32" -> [1, 8, 32]; a one-line ValueError otherwise."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--concurrency {text!r}: expected comma-separated integers") from None
    if not levels or min(levels) < 1:
        raise ValueError(f"--concurrency {text!r}: levels must be >= 1")
    return levels


def load_prompts(path: Path, limit: int | None = None) -> tuple[list[dict], dict]:
    if not path.exists():
        raise PromptSetError(f"prompt set {path} does not exist")
    raw = path.read_bytes()
    rows = [json.loads(line) for line in raw.decode().splitlines() if line.strip()]
    if limit:
        rows = rows[:limit]
    if not rows:
        raise PromptSetError(f"prompt set {path} is empty")
    for r in rows:
        if not r.get("messages") or not isinstance(r.get("max_tokens"), int):
            raise PromptSetError(f"{path}: row {r.get('id')!r} needs messages and an integer max_tokens")
    info = {"prompt_set": path.name, "prompt_set_sha256": hashlib.sha256(raw).hexdigest(), "num_prompts": len(rows)}
    return rows, info


SESSION_HEADER = "X-Session-ID"  # the first key vllm-router's consistent_hash policy hashes on


def with_sessions(rows: list[dict]) -> list[dict]:
    """Every row tagged with a session: its prompt group where the set has groups (the requests sharing a prefix),
    else its own id."""
    return [{**r, "session": str(r.get("group") or r["id"])} for r in rows]


def stream_one(client, model: str, row: dict, mode: str, t0: float, max_tokens_cap: int | None,
               fixed_body: dict | None = None) -> RequestSample:
    """One streamed greedy chat request; `fixed` mode adds fixed_body (the engine's way to ignore end-of-sequence)."""
    max_tokens = min(row["max_tokens"], max_tokens_cap) if max_tokens_cap else row["max_tokens"]
    start = time.perf_counter()
    sample = RequestSample(prompt_id=row["id"], ok=False, start_s=start - t0, end_s=start - t0)
    last = None
    text_chunks = 0
    try:
        stream = client.chat.completions.create(
            model=model, messages=row["messages"], max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
            extra_body=(fixed_body or fixed_length_body("vllm")) if mode == "fixed" else {},
            # a row tagged with a session (latency --session-header) names it as routers read one: consistent_hash
            extra_headers={SESSION_HEADER: row["session"]} if row.get("session") else None,
        )
        for chunk in stream:
            now = time.perf_counter()
            if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].finish_reason is None):
                if sample.ttft_s is None:
                    sample.ttft_s = now - start
                elif last is not None:
                    sample.itl_s.append(now - last)
                last = now
            if chunk.choices and chunk.choices[0].delta.content:
                text_chunks += 1
            if chunk.usage:
                sample.prompt_tokens = chunk.usage.prompt_tokens
                sample.output_tokens = chunk.usage.completion_tokens
        if sample.output_tokens == 0 and text_chunks:
            sample.output_tokens, sample.tokens_from = text_chunks, "stream chunks"
        sample.ok = sample.output_tokens > 0
        if not sample.ok:
            sample.error = "no output tokens"
    except Exception as e:  # noqa: BLE001 - every failure is recorded, never dropped
        sample.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
    sample.end_s = time.perf_counter() - t0
    return sample


def run_level(client, model: str | list[str], rows: list[dict], mode: str, concurrency: int,
              cap: int | None, fixed_body: dict | None = None) -> tuple[list, float]:
    """Every row at `concurrency` in flight; a list of models is taken round-robin (adapters of one server)."""
    models = [model] if isinstance(model, str) else model
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        samples = list(ex.map(lambda ir: stream_one(client, models[ir[0] % len(models)], ir[1], mode, t0, cap,
                                                       fixed_body),
                              enumerate(rows)))
    return samples, time.perf_counter() - t0


def repeat_rows(rows: list[dict], times: int) -> list[dict]:
    """Each row `times` times in a row order that cycles through the set (ids suffixed #1, #2, ...): enough requests
    to keep high concurrency levels full."""
    if times <= 1:
        return rows
    return [{**r, "id": f"{r['id']}#{k}"} for k in range(times) for r in rows]


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    """Arrival times (s) of n requests of a Poisson process of `rate` requests per second, seeded."""
    import random

    if rate <= 0:
        raise ValueError(f"request rate {rate}: must be > 0")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def run_rate(client, model: str | list[str], rows: list[dict], mode: str, rate: float, cap: int | None,
             fixed_body: dict | None = None, seed: int = 0) -> tuple[list, float]:
    """Every row sent at its Poisson arrival time (open loop: nothing waits for earlier answers). An exception in the
    caller (SIGTERM of the bench) releases the requests still waiting for their arrival: none is sent after it."""
    models = [model] if isinstance(model, str) else model
    arrivals = poisson_arrivals(len(rows), rate, seed)
    stop = threading.Event()
    t0 = time.perf_counter()

    def at(i: int) -> RequestSample:
        if stop.wait(max(0.0, arrivals[i] - (time.perf_counter() - t0))):
            now = time.perf_counter() - t0
            return RequestSample(prompt_id=rows[i]["id"], ok=False, start_s=now, end_s=now, error="not sent: stopped")
        return stream_one(client, models[i % len(models)], rows[i], mode, t0, cap, fixed_body)

    ex = cf.ThreadPoolExecutor(len(rows))
    try:
        samples = list(ex.map(at, range(len(rows))))
    finally:
        stop.set()
        ex.shutdown(wait=True, cancel_futures=True)
    return samples, time.perf_counter() - t0


def greedy_ids(base_url: str, model: str, rows: list[dict], max_tokens: int, concurrency: int,
               samples: int = 0, temperature: float = 1.0, seed: int = 0, engine: str = "vllm") -> list[dict]:
    """Prompt and output token ids of every row, answered greedily with at most `concurrency` in flight; with
    samples > 0, also that many answers sampled at `temperature` (request seeds seed+1 .. seed+samples), each as its own
    entry; a row's own `samples` replaces `samples` for that row. vLLM returns the ids with the chat answer (return_token_ids); llama-server through its own routes
    (llamaserver_answer)."""
    client = openai_client(base_url)

    def one(row: dict) -> list[dict]:
        out = []
        for i in range(1 + row.get("samples", samples)):
            sampled = {"temperature": temperature, "seed": seed + i} if i else {"temperature": 0}
            limit = min(max_tokens, row["max_tokens"])
            if engine == "llamaserver":
                out.append({"id": row["id"], "sample": i, **llamaserver_answer(base_url, row["messages"], limit, sampled)})
                continue
            r = client.chat.completions.create(model=model, messages=row["messages"], **sampled, max_tokens=limit,
                                               extra_body={"return_token_ids": True}).model_dump()
            choice = r["choices"][0]
            out.append({"id": row["id"], "sample": i, "prompt_ids": r["prompt_token_ids"], "ids": choice["token_ids"],
                        "text": choice["message"]["content"] or "", "finish_reason": choice["finish_reason"]})
        return out

    with cf.ThreadPoolExecutor(concurrency) as ex:
        return [s for group in ex.map(one, rows) for s in group]


def llama_server_call(base_url: str, route: str, body: dict) -> dict:
    """POST one of llama-server's own routes; ServerError with its message unless it answers 200 with JSON."""
    status, answer = http_post_json(f"{base_url}{route}", body, timeout=600)
    if status != 200 or not isinstance(answer, dict):
        raise ServerError(f"llama-server {route} answered {status}: {str(answer)[:200]}")
    return answer


def llamaserver_answer(base_url: str, messages: list[dict], max_tokens: int, sampled: dict) -> dict:
    """One chat answered by llama-server with its token ids: the chat template applied by the server
    (/apply-template), the prompt tokenized as its completions do (/tokenize, special tokens added and parsed), then
    /completion on those ids with return_tokens."""
    prompt = llama_server_call(base_url, "/apply-template", {"messages": messages})["prompt"]
    prompt_ids = llama_server_call(base_url, "/tokenize", {"content": prompt, "add_special": True,
                                                            "parse_special": True})["tokens"]
    r = llama_server_call(base_url, "/completion", {"prompt": prompt_ids, "n_predict": max_tokens, "return_tokens": True,
                                                   "cache_prompt": True, **sampled})
    return {"prompt_ids": prompt_ids, "ids": r["tokens"], "text": r["content"],
            "finish_reason": "length" if r.get("stop_type") == "limit" else "stop", "timings": r.get("timings")}
