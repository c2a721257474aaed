"""Multi-turn chat latency: one conversation of N turns, each resending the whole history; per-turn TTFT.

    python -m scripts.measure.chat_latency smollm2-bf16 --base-url http://127.0.0.1:8000 --turns 6

With prefix caching the history is already in the KV cache, so TTFT should stay flat as the history grows; without
it TTFT grows with the prompt. Prints one line per turn and the prefix-cache hit rate the server reports; with
--out writes the turns as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from scripts.common.loadgen import openai_client
from scripts.common.server import is_healthy
from scripts.measure.prom import scrape, server_counters

QUESTIONS = [
    "Tell me about the history of bicycles in two sentences.",
    "What were the first bicycles made of?",
    "Who invented the chain drive?",
    "How did pneumatic tyres change cycling?",
    "What is the fastest recorded speed on a bicycle?",
    "Summarize our conversation so far in one sentence.",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", help="served model name (the variant name)")
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--turns", type=int, default=len(QUESTIONS))
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--out", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:

    args = build_parser().parse_args(argv)
    if not is_healthy(args.base_url):
        print(f"error: no healthy server at {args.base_url}", file=sys.stderr)
        return 1
    client = openai_client(args.base_url)
    before = scrape(args.base_url)
    history, turns = [], []
    for i in range(args.turns):
        history.append({"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]})
        start = time.perf_counter()
        ttft, text, usage = None, [], None
        for chunk in client.chat.completions.create(model=args.model, messages=history, max_tokens=args.max_tokens,
                                                    temperature=0, stream=True, stream_options={"include_usage": True}):
            if chunk.choices and chunk.choices[0].delta.content:
                ttft = ttft or time.perf_counter() - start
                text.append(chunk.choices[0].delta.content)
            usage = chunk.usage or usage
        history.append({"role": "assistant", "content": "".join(text)})
        turns.append({"turn": i + 1, "prompt_tokens": usage.prompt_tokens if usage else None,
                      "ttft_ms": ttft * 1000 if ttft else None, "e2el_ms": (time.perf_counter() - start) * 1000})
        print(f"turn {i + 1}: prompt {turns[-1]['prompt_tokens']} tokens, ttft {turns[-1]['ttft_ms'] or 0:.1f} ms", flush=True)
    counters = server_counters(before, scrape(args.base_url))
    print(f"prefix-cache hit rate over the conversation: {counters.get('prefix_cache_hit_rate')}")
    if args.out:
        args.out.write_text(json.dumps({"turns": turns, "server_metrics": counters}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
