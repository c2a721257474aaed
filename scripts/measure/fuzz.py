"""Fuzzed OpenAI request bodies against a variant's server: every answer is a 2xx or a 4xx (never a 5xx, never an error
event with a 5xx code inside a 200 stream, never no answer), and the server is healthy after every one.

    python -m scripts.measure.fuzz smollm2-gguf-bf16-server              # make fuzz VARIANT=… (FUZZ_ARGS): starts it
    python -m scripts.measure.fuzz smollm2-bf16 --cases 100 --base-url http://127.0.0.1:8000 --out-dir /tmp/fuzz

The bodies are hypothesis draws (derandomized, no shrinking: the same --cases bodies on every run of this script with
one hypothesis version, which also draws from constants of the modules a process has loaded): one of the four endpoints vLLM serves (chat and text completions, /tokenize, /detokenize; llama-server has
all four, with its own fields), its minimal valid body with up to four known fields set to edge values (negative, zero,
huge and fractional numbers, empty strings, NUL, a lone surrogate, long emoji runs, nested JSON, wrong types), up to two
unknown fields, one field sometimes removed; one body in twenty is raw bytes or JSON nested deeper than parsers recurse.
Lengths a body asks for that are valid but long (8 < n < 10^6 tokens) become 8, so the run measures the server's
input handling, not its decode speed. Writes experiments/<variant>/fuzz_<YYYYMMDD-HHMMSS>.json (status failed, naming
the criteria, when any answer is a 5xx, an error event of 5xx, a hang, or the server is left unhealthy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import engine_of
from scripts.common.records import envelope, exit_status, mark_unmet, save_record
from scripts.common.server import ServerError, http_get
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.serve.launch import variant_server

DEFAULT_CASES = 250
TIMEOUT_S = 60.0
BASE = {
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 4},
    "/v1/completions": {"prompt": "Hello", "max_tokens": 4},
    "/tokenize": {"prompt": "Hello"},
    "/detokenize": {"tokens": [1, 2, 3]},
}
FIELDS = {
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
                             "min_p", "n", "stop", "logprobs", "top_logprobs", "stream", "stream_options", "seed",
                             "logit_bias", "response_format", "tools", "tool_choice", "presence_penalty",
                             "frequency_penalty", "repetition_penalty", "min_tokens", "ignore_eos", "prompt_logprobs",
                             "echo", "add_generation_prompt", "continue_final_message", "structured_outputs",
                             "chat_template_kwargs"],
    "/v1/completions": ["model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "echo",
                        "stream", "suffix", "seed", "logit_bias", "prompt_logprobs", "min_tokens", "ignore_eos"],
    "/tokenize": ["model", "prompt", "messages", "add_special_tokens", "return_token_strs"],
    "/detokenize": ["model", "tokens"],
}
LENGTHS = ("max_tokens", "max_completion_tokens", "min_tokens", "n", "prompt_logprobs")
# the outcomes that fail the run (every other case is "ok": a 2xx, or a 4xx)
FAILING = ("server_error", "error_event_5xx", "hang", "broken", "unhealthy")


class FuzzError(RuntimeError):
    pass


def clamped(body: dict) -> dict:
    """A drawn body whose valid lengths stay short: 8 < length < 10^6 becomes 8; no max_tokens becomes 8."""
    for k in LENGTHS:
        v = body.get(k)
        if isinstance(v, int) and not isinstance(v, bool) and 8 < v < 10**6:
            body[k] = 8
    if "prompt" in body or "messages" in body:
        for k in ("max_tokens", "max_completion_tokens"):
            if body.get(k) is None:
                body[k] = 8
    return body


def fuzz_case(model: str):
    """The hypothesis strategy of one (endpoint path, raw body) for a server that serves `model`."""
    from hypothesis import strategies as st

    scalars = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False, allow_infinity=False)
               | st.text(max_size=24))
    json_values = st.recursive(scalars, lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=10), ch,
                                                                                                max_size=4),
                               max_leaves=10)
    edge = st.sampled_from([-1, 0, 1, 2, 20, 21, 8193, 2**31, 2**63, -2**63, 1e308, -1e-9, 0.5, "", "1", "\ud800",
                            "\x00", "😀" * 50, [], {}, None, True, [0], [-1], [2**40], [49151, 49152], ["a", 1]])
    messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"]),
                                               "content": st.one_of(st.text(max_size=40), json_values)}), max_size=3)

    @st.composite
    def case(draw) -> tuple[str, bytes]:
        path = draw(st.sampled_from(sorted(BASE)))
        if draw(st.integers(0, 19)) == 0:  # raw bytes (mostly not JSON) or JSON nested deeper than parsers recurse
            return path, draw(st.binary(max_size=200) | st.integers(100, 60_000).map(
                lambda n: b'{"model": ' + json.dumps(model).encode() + b', "prompt": ' + b"[" * n + b"]" * n + b"}"))
        body = {"model": model, **BASE[path]}
        for key in draw(st.lists(st.sampled_from(FIELDS[path]), max_size=4, unique=True)):
            body[key] = draw(st.one_of(edge, json_values, messages if key == "messages" else edge,
                                       st.lists(st.integers(-5, 60_000), max_size=6) if key in ("prompt", "tokens")
                                       else edge))
        body.update(draw(st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=2)))
        if draw(st.booleans()):
            body.pop(draw(st.sampled_from(sorted(body))), None)
        return path, json.dumps(clamped(body)).encode()

    return case()


def send(base_url: str, path: str, raw: bytes, health_path: str, timeout_s: float = TIMEOUT_S) -> dict:
    """POST one body and read the whole answer; then GET the health path. The case's outcome: ok (2xx or 4xx),
    server_error (5xx), error_event_5xx (an error event with a 5xx code inside a 200 stream), hang (no answer within
    timeout_s), broken (the connection broke), unhealthy (the answer was fine, the health check after it was not)."""
    import httpx

    out = {"path": path, "bytes": len(raw), "status": None, "outcome": "ok"}
    t0 = time.perf_counter()
    try:
        with httpx.Client(timeout=timeout_s) as c, c.stream("POST", base_url + path, content=raw,
                                                            headers={"Content-Type": "application/json"}) as r:
            text = r.read().decode(errors="replace")
        out["status"] = r.status_code
        if r.status_code >= 500:
            out["outcome"], out["answer"] = "server_error", text[:300]
        for line in text.splitlines():
            if line.startswith("data: {") and '"error"' in line:
                err = json.loads(line[6:]).get("error") or {}
                if isinstance(err, dict) and isinstance(err.get("code"), int) and err["code"] >= 500:
                    out["outcome"], out["answer"] = "error_event_5xx", line[:300]
    except httpx.TimeoutException:
        out["outcome"] = "hang"
    except (httpx.TransportError, ValueError) as e:
        out["outcome"], out["answer"] = "broken", f"{type(e).__name__}: {str(e)[:200]}"
    out["seconds"] = round(time.perf_counter() - t0, 3)
    if out["outcome"] == "ok" and http_get(base_url + health_path, timeout=30)[0] != 200:
        out["outcome"] = "unhealthy"
    if out["outcome"] != "ok":
        out["body"] = raw[:300].decode(errors="replace")
    return out


def run_cases(base_url: str, model: str, cases: int, health_path: str) -> list[dict]:
    """The --cases derandomized draws, each sent in turn (generation only: nothing is shrunk or replayed)."""
    from hypothesis import HealthCheck, Phase, given, settings

    outs: list[dict] = []

    @settings(max_examples=cases, deadline=None, derandomize=True, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(case=fuzz_case(model))
    def one(case):
        outs.append(send(base_url, *case, health_path))

    one()
    return outs


def summarize(outs: list[dict]) -> dict:
    by_outcome = Counter(o["outcome"] for o in outs)
    by_status = Counter(str(o["status"]) for o in outs if o["status"] is not None)
    criteria = {k: {"value": by_outcome.get(k, 0), "target": 0, "pass": by_outcome.get(k, 0) == 0} for k in FAILING}
    return {"cases": len(outs), "by_outcome": dict(by_outcome), "by_status": dict(sorted(by_status.items())),
            "by_path": {p: dict(Counter(str(o["status"]) for o in outs if o["path"] == p))
                        for p in sorted({o["path"] for o in outs})},
            "criteria": criteria, "pass": all(c["pass"] for c in criteria.values())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--cases", type=int, default=DEFAULT_CASES, help="bodies to send")
    p.add_argument("--base-url", help="a running server of the variant (default: start one)")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def fuzz(args, variant, base_url: str, server) -> dict:
    if args.cases < 1:
        raise FuzzError(f"--cases {args.cases}: must be >= 1")
    import hypothesis

    health = engine_of(variant).health_path
    record = envelope("fuzz", variant, command=[sys.executable, "-m", "scripts.measure.fuzz", *sys.argv[1:]],
                      server_command=server.argv if server else None)
    record["inputs"] = {"cases": args.cases, "endpoints": sorted(BASE), "timeout_s": TIMEOUT_S, "base_url": base_url,
                        "health_path": health, "hypothesis": hypothesis.__version__, "derandomized": True}
    t0 = time.monotonic()
    outs = run_cases(base_url, variant.request_models[0], args.cases, health)
    record["duration_s"] = round(time.monotonic() - t0, 2)
    record["samples"] = outs
    record["summary"] = summarize(outs)
    mark_unmet(record)
    return record


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="fuzz") as (base_url, server):
            record = fuzz(args, variant, base_url, server)
    except (FuzzError, VariantError, ServerError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if (path := save_record(record, args.out_dir or variant.path, "fuzz")) is None:
        return 1
    s = record["summary"]
    print(f"{s['cases']} bodies: {s['by_outcome']}; HTTP {s['by_status']}")
    return exit_status(record, path)


if __name__ == "__main__":
    sys.exit(main())
