"""Thinking budget of a reasoning variant: think tokens per answer, forced end of thinking, TTFT to content, E2E.

    python -m scripts.measure.think_budget qwen35-tiny-shortcot              # starts the server, measures, stops it
    python -m scripts.measure.think_budget qwen35-4b-proxy-shortcot --budgets none,512,32 --requests 8
    python -m scripts.measure.think_budget qwen35-tiny-shortcot --base-url http://127.0.0.1:8000 --budgets none,8

For each budget, N streamed greedy chat requests (the first N prompts of eval/prompts/latency-v1.jsonl, one at a time)
with `thinking_token_budget` set on every request: the budget, or -1 for `none` (vLLM's "no budget", which also keeps a
variant's THINK_BUDGET default out). Each request may generate budget + len(end string) + ANSWER tokens (`none`: the
largest budget measured in its place, so an uncapped span runs past every cap) and ignores end-of-sequence; the client
stops reading after ANSWER content tokens, so every budget is timed at the same answer length. Budgets take turns
per prompt (prompt 1 at every budget, then prompt 2, …); the machine's load average at start and end is recorded.

The server returns the token ids of the prompt and of every streamed delta (return_token_ids): the think span is
counted on ids, with the reasoning strings of the variant's configuration turned into ids by the served tokenizer
(the server's /tokenize). The span starts after the last <think> (the Qwen3.5 template opens it in the prompt: "<think>\\n", so one span token is the
prompt's) and ends at the first </think>; `think_tokens` are the span tokens the model generated, what the budget
bounds. `forced`: </think> came exactly where the budget put it (a model closing on its own at that very token would
read the same; random weights never close on their own). TTFT to content: from sending to the first token after
</think>; E2E: to the ANSWER-th content token (or the last token when none came). Writes
experiments/<variant>/think_<YYYYMMDD-HHMMSS>.json (schemas/think.schema.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import fixed_body_for
from scripts.common.loadgen import DEFAULT_PROMPTS, PromptSetError, load_prompts
from scripts.common.metrics import describe
from scripts.common.records import envelope, finish_record
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.serve.launch import variant_server

DEFAULT_BUDGETS = "none,1024,256,64,0"
DEFAULT_REQUESTS = 4
ANSWER_TOKENS = 32  # the fixed answer length every budget is timed at
NO_BUDGET = -1  # vLLM's spelling of "no thinking budget" (sampling_params.validate_thinking_token_budget)
# vLLM's Qwen3 reasoning parser's strings (vllm/parser/qwen3.py), used where the variant's reasoning config names none
DEFAULT_START, DEFAULT_END = "<think>", "</think>"


class ThinkError(RuntimeError):
    pass


def parse_budgets(text: str) -> list[int | None]:
    """"none,1024,0" -> [None, 1024, 0]; a one-line ValueError for anything else."""
    out: list[int | None] = []
    for item in (x.strip() for x in text.split(",") if x.strip()):
        if item == "none":
            out.append(None)
        elif item.isdigit():
            out.append(int(item))
        else:
            raise ValueError(f"--budgets {text!r}: {item!r} is neither 'none' nor a non-negative integer")
    if not out:
        raise ValueError(f"--budgets {text!r}: name at least one budget")
    return out


def label(budget: int | None) -> str:
    return "none" if budget is None else str(budget)


def find_last(seq: list[int], sub: list[int]) -> int:
    """Index of the last occurrence of `sub` in seq; -1 if none (or sub empty)."""
    for i in range(len(seq) - len(sub), -1, -1):
        if sub and seq[i:i + len(sub)] == sub:
            return i
    return -1


def find_first(seq: list[int], sub: list[int]) -> int:
    """Index of the first occurrence of `sub` in seq; -1 if none (or sub empty)."""
    for i in range(len(seq) - len(sub) + 1):
        if sub and seq[i:i + len(sub)] == sub:
            return i
    return -1


@dataclass
class Span:
    opened: bool  # a start string precedes the output's first end string (in the prompt or the output)
    prompt_think: int  # span tokens already in the prompt (after its last start string)
    think: int  # span tokens the model generated: what the budget bounds
    end_at: int | None  # index in the output of the first end string (None: the span never closed)
    content: int  # output tokens after that end string
    end_len: int  # tokens of the end string

    @property
    def closed(self) -> bool:
        return self.end_at is not None

    @property
    def tokens(self) -> int:
        """The span as vLLM counts it against the budget: prompt tokens after the start string included."""
        return self.prompt_think + self.think

    @property
    def content_start(self) -> int | None:
        """Index in the output of the first content token (None when none came)."""
        return self.end_at + self.end_len if self.end_at is not None and self.content else None


def think_span(prompt: list[int], output: list[int], start: list[int], end: list[int]) -> Span:
    """The think span of one answer, on token ids: after the last start string before the output's first end string,
    up to that end string."""
    end_at = find_first(output, end)
    stop = end_at if end_at >= 0 else len(output)
    at = find_last(prompt + output[:stop], start)
    if at < find_last(prompt, end):  # the prompt closed its last span: none is open
        at = -1
    first = at + len(start)  # the span's first token, in prompt + output coordinates
    prompt_think = max(0, len(prompt) - first) if at >= 0 else 0
    think = stop - max(0, first - len(prompt)) if at >= 0 else 0
    content = len(output) - stop - len(end) if end_at >= 0 else 0
    return Span(opened=at >= 0, prompt_think=prompt_think, think=think, end_at=end_at if end_at >= 0 else None,
                content=content, end_len=len(end))


def forced(span: Span, budget: int | None) -> bool:
    """The end string came exactly where vLLM's budget forces it: when the span (prompt tokens included, as vLLM
    counts them) reaches the budget, or at once when the prompt's span tokens alone reach it."""
    return budget is not None and span.opened and span.closed and span.tokens == max(budget, span.prompt_think)


def timings(token_times: list[float], span: Span, answer_tokens: int) -> tuple[float | None, float | None]:
    """(seconds to the first content token, seconds to the answer_tokens-th content token or the last token), from
    each output token's arrival time (seconds after sending)."""
    if not token_times:
        return None, None
    start = span.content_start
    if start is None:
        return None, token_times[-1]
    last = min(start + answer_tokens, len(token_times)) - 1
    return token_times[start], token_times[last]


def budget_summary(samples: list[dict], budget: int | None) -> dict:
    """One budget's row: think tokens max/mean, spans closed and forced, TTFT to content and E2E (ms)."""
    ok = [s for s in samples if s["ok"]]
    think = [s["think_tokens"] for s in ok]
    n_forced = sum(s["forced"] for s in ok)
    out = {
        "budget": budget, "requests": len(samples), "ok": len(ok),
        "think_tokens_max": max(think) if think else None,
        "think_tokens_mean": sum(think) / len(think) if think else None,
        "span_tokens_max": max((s["span_tokens"] for s in ok), default=None),
        "closed": sum(s["closed"] for s in ok), "forced": n_forced,
        "forced_end": "yes" if ok and n_forced == len(ok) else "no" if n_forced == 0 else f"{n_forced} of {len(ok)}",
        "content_followed": sum(s["content_tokens"] > 0 for s in ok),
        # what the budget promises: no answer generated more think tokens than the budget (None: no budget)
        "cap_held": None if budget is None else bool(ok) and all(t <= budget for t in think),
    }
    out.update(describe("ttft_content", [s["ttft_content_s"] for s in ok if s["ttft_content_s"] is not None]))
    out.update(describe("e2e", [s["e2e_s"] for s in ok if s["e2e_s"] is not None]))
    return out


def request_body(model: str, row: dict, budget: int | None, max_tokens: int, fixed: dict) -> dict:
    return {"model": model, "messages": row["messages"], "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True, "stream_options": {"include_usage": True},
            "thinking_token_budget": NO_BUDGET if budget is None else budget, **fixed}


def stream_answer(base_url: str, body: dict, end: list[int], answer_tokens: int, timeout: float) -> dict:
    """One streamed request: prompt ids, output ids with each one's arrival time (s after sending), the usage
    report; stops reading after answer_tokens tokens past the first end string."""
    import httpx

    prompt: list[int] = []
    output: list[int] = []
    times: list[float] = []
    usage, finish = None, None
    t0 = time.perf_counter()
    with httpx.Client(timeout=timeout) as client, client.stream("POST", f"{base_url}/v1/chat/completions",
                                                                json=body) as r:
        if r.status_code != 200:
            raise ThinkError(f"HTTP {r.status_code}: {r.read().decode(errors='replace')[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: "):])
            now = time.perf_counter() - t0
            prompt = chunk.get("prompt_token_ids") or prompt
            usage = chunk.get("usage") or usage
            for choice in chunk.get("choices") or []:
                ids = choice.get("token_ids") or []
                output += ids
                times += [now] * len(ids)
                finish = choice.get("finish_reason") or finish
            if (at := find_first(output, end)) >= 0 and len(output) - at - len(end) >= answer_tokens:
                finish = finish or "client_stop"  # the answer is complete: stop reading (the server aborts the rest)
                break
    return {"prompt": prompt, "output": output, "times": times, "usage": usage, "finish": finish}


def measure_one(base_url: str, body: dict, budget: int | None, ids: tuple[list[int], list[int]], answer_tokens: int,
                row_id: str) -> dict:
    start, end = ids
    sample: dict = {"prompt_id": row_id, "budget": budget, "ok": False, "error": None}
    try:
        got = stream_answer(base_url, body, end, answer_tokens, timeout=600)
    except Exception as e:  # noqa: BLE001 - every failure is recorded, never dropped
        sample["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
        return sample
    span = think_span(got["prompt"], got["output"], start, end)
    ttft_content, e2e = timings(got["times"], span, answer_tokens)
    reported = ((got["usage"] or {}).get("completion_tokens_details") or {}).get("reasoning_tokens")
    sample.update(ok=bool(got["output"]), error=None if got["output"] else "no output tokens",
                  output_tokens=len(got["output"]), prompt_tokens=len(got["prompt"]), finish_reason=got["finish"],
                  opened=span.opened, prompt_think_tokens=span.prompt_think, think_tokens=span.think,
                  span_tokens=span.tokens, closed=span.closed, forced=forced(span, budget), content_tokens=span.content,
                  reasoning_tokens_reported=reported, ttft_s=got["times"][0] if got["times"] else None,
                  ttft_content_s=ttft_content, e2e_s=e2e)
    return sample


def reasoning_strings(variant) -> tuple[str, str]:
    """The variant's reasoning start and end strings: its SERVE_REASONING_CONFIG's, else the Qwen3 parser's.
    ThinkError for a variant without a reasoning configuration (vLLM would refuse every budget)."""
    cfg = json.loads(variant.resolved.get("SERVE_REASONING_CONFIG") or "{}")
    if not (variant.resolved.get("SERVE_REASONING_PARSER") or cfg):
        raise ThinkError(f"{variant.name} has no reasoning configuration (SERVE_REASONING_PARSER or "
                         "SERVE_REASONING_CONFIG): vLLM would refuse every thinking budget")
    return cfg.get("reasoning_start_str") or DEFAULT_START, cfg.get("reasoning_end_str") or DEFAULT_END


def reasoning_ids(base_url: str, model: str, strings: tuple[str, str]) -> tuple[list[int], list[int], dict]:
    """The token ids of the reasoning strings, by the served model's own tokenizer (the server's /tokenize)."""
    from scripts.common.server import http_post_json

    ids = []
    for text in strings:
        status, answer = http_post_json(f"{base_url}/tokenize", {"model": model, "prompt": text,
                                                                  "add_special_tokens": False}, timeout=60)
        if status != 200 or not isinstance(answer, dict) or not answer.get("tokens"):
            raise ThinkError(f"POST {base_url}/tokenize {text!r} answered {status}: {str(answer)[:200]}")
        ids.append(answer["tokens"])
    start, end = ids
    return start, end, {"start_str": strings[0], "end_str": strings[1], "start_ids": start, "end_ids": end}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a variant with a reasoning configuration (experiments/<variant>/config.env)")
    p.add_argument("--budgets", default=DEFAULT_BUDGETS, help="comma-separated thinking budgets, 'none' for no "
                   "budget (default %(default)s)")
    p.add_argument("--requests", type=int, default=DEFAULT_REQUESTS, help="requests per budget (default %(default)s)")
    p.add_argument("--answer-tokens", type=int, default=ANSWER_TOKENS,
                   help="content tokens every answer is timed to (default %(default)s)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--base-url", help="measure a running server instead of starting one")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def measure(args, variant, base_url: str, server, record: dict, budgets: list[int | None],
            rows: list[dict], info: dict) -> None:
    start, end, strings = reasoning_ids(base_url, variant.served_name, reasoning_strings(variant))
    ceiling = max([b for b in budgets if b is not None], default=0)
    fixed = fixed_body_for(variant)
    record["command"]["server"] = server.argv if server else None
    record["startup_s"] = server.startup_s if server else None
    record["inputs"] = {**info, "budgets": [label(b) for b in budgets], "requests_per_budget": args.requests,
                        "answer_tokens": args.answer_tokens, "none_max_think_tokens": ceiling, "temperature": 0,
                        "concurrency": 1, "fixed_length_request": fixed, "reasoning": strings, "base_url": base_url,
                        "variant_think_budget": variant.resolved.get("THINK_BUDGET")}
    model = variant.served_name
    measure_one(base_url, request_body(model, rows[0], 0, 1 + len(end) + 1, fixed), 0, (start, end), 1,
                "warmup")  # first request pays one-time costs (the tokenizer's and the engine's first step)
    t0 = time.monotonic()
    record["load_avg"] = {"start": os.getloadavg()}
    caps = {label(b): (ceiling if b is None else b) + len(end) + args.answer_tokens for b in budgets}
    by_budget: dict[str, list[dict]] = {label(b): [] for b in budgets}
    for row in rows:  # budgets interleaved per prompt: a load change on a shared machine touches every budget alike
        for budget in budgets:
            body = request_body(model, row, budget, caps[label(budget)], fixed)
            by_budget[label(budget)].append(measure_one(base_url, body, budget, (start, end), args.answer_tokens,
                                                        row["id"]))
    record["load_avg"]["end"] = os.getloadavg()
    for budget in budgets:
        samples = by_budget[label(budget)]
        summary = budget_summary(samples, budget)
        record["samples"].append({"budget": label(budget), "max_tokens": caps[label(budget)], "requests": samples})
        record["summary"][label(budget)] = summary
        print(f"budget {label(budget):>5s}: think max {summary['think_tokens_max']} mean "
              f"{summary['think_tokens_mean']}  forced {summary['forced_end']}  ttft->content p50 "
              f"{summary['median_ttft_content_ms']}  e2e p50 {summary['median_e2e_ms']}", flush=True)
        if bad := [s for s in samples if not s["ok"]]:
            raise ThinkError(f"{len(bad)} of {len(samples)} requests at budget {label(budget)} failed; first: "
                             f"{bad[0]['error']}")
    record["duration_s"] = round(time.monotonic() - t0, 2)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        budgets = parse_budgets(args.budgets)
        if args.requests < 1 or args.answer_tokens < 1:
            raise ValueError("--requests and --answer-tokens must be >= 1")
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        reasoning_strings(variant)
        rows, info = load_prompts(args.prompts, args.requests)
        if len(rows) < args.requests:
            raise ThinkError(f"--requests {args.requests}: {paths.shown(args.prompts)} holds {len(rows)} prompts")
    except (ValueError, VariantError, ThinkError, PromptSetError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    record = envelope("think", variant, command=[sys.executable, "-m", "scripts.measure.think_budget",
                                                 *(sys.argv[1:] if argv is None else argv)], server_command=None)
    error = None
    try:
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="think") as (base_url, server):
            measure(args, variant, base_url, server, record, budgets, rows, info)
    except (ThinkError, ServerError, CheckpointError, VariantError, OSError) as e:
        error = e
    return finish_record(record, args.out_dir or variant.path, "think", error)


if __name__ == "__main__":
    sys.exit(main())
