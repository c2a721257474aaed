"""Generate the project's own offline lm-eval task data (eval/tasks/data/*.jsonl), deterministically.

    python -m scripts.make_plumbing_tasks            # rewrites the committed files (identical output every time)

PLUMBING CHECKS, NOT BENCHMARKS. They exist so the real lm-evaluation-harness runs end to end against the real server
with no network: `lab_arith_mc` (multiple choice by log-likelihood, local-completions), `lab_arith_gen` (exact match
of generated numbers, local-chat-completions) and `lab_ifeval` (IFEval-format items scored by lm-eval's own IFEval
checkers, restricted to instructions that need no NLTK data). Their scores say nothing about a model's quality;
MMLU-Pro / IFEval / GPQA-Diamond do (`make datasets` where the hub is reachable).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from scripts.common import paths

DATA = paths.EVAL / "tasks" / "data"
SEED = 20261121
N_ITEMS = 50
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "silver", "forest", "candle", "bridge"]

# IFEval instructions whose checkers use regular expressions only (no NLTK tokenizer data, which needs a download).
IFEVAL_ITEMS = [
    ("Write two sentences about the sea without using any commas.", ["punctuation:no_comma"], [{}]),
    ("Describe a cat in one short paragraph. Your entire response must be in lowercase letters.",
     ["change_case:english_lowercase"], [{}]),
    ("Give a one-line greeting. Your entire response must be in capital letters.", ["change_case:english_capital"], [{}]),
    ("Name three fruits. Include the keyword 'banana' in your answer.", ["keywords:existence"], [{"keywords": ["banana"]}]),
    ("List exactly 3 benefits of walking as markdown bullet points like '* point'.",
     ["detectable_format:number_bullet_lists"], [{"num_bullets": 3}]),
    ("Say something kind and end your response with the exact phrase 'Is there anything else I can help with?'",
     ["startend:end_checker"], [{"end_phrase": "Is there anything else I can help with?"}]),
    ("Write a short poem with a title wrapped in double angular brackets, like <<title>>.", ["detectable_format:title"], [{}]),
    ("Wrap your entire answer in double quotation marks. What color is the sky?", ["startend:quotation"], [{}]),
]


def arith_items(rng: random.Random) -> tuple[list[dict], list[dict]]:
    mc, gen = [], []
    for i in range(N_ITEMS):
        a, b = rng.randint(2, 49), rng.randint(2, 49)
        op = rng.choice(["+", "-"])
        ans = a + b if op == "+" else a - b
        wrong = sorted({ans + d for d in rng.sample([-10, -2, -1, 1, 2, 10], 3)})
        choices = [str(x) for x in sorted([ans, *wrong])]
        mc.append({"id": f"mc-{i}", "question": f"{a} {op} {b} =", "choices": choices, "answer": choices.index(str(ans))})
        gen.append({"id": f"gen-{i}", "question": f"What is {a} {op} {b}? Reply with the number only.", "answer": str(ans)})
    for i in range(N_ITEMS // 5):  # string questions: which word comes first alphabetically
        words = rng.sample(WORDS, 4)
        mc.append({"id": f"mc-str-{i}", "question": f"Of {', '.join(words)}, the first in alphabetical order is",
                   "choices": words, "answer": words.index(min(words))})
    return mc, gen


def ifeval_items() -> list[dict]:
    return [{"key": 1000 + i, "prompt": p, "instruction_id_list": ids, "kwargs": kw}
            for i, (p, ids, kw) in enumerate(IFEVAL_ITEMS)]


def render() -> dict[str, str]:
    mc, gen = arith_items(random.Random(SEED))
    files = {"lab_arith_mc.jsonl": mc, "lab_arith_gen.jsonl": gen, "lab_ifeval.jsonl": ifeval_items()}
    return {name: "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows) for name, rows in files.items()}


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    DATA.mkdir(parents=True, exist_ok=True)
    for name, text in render().items():
        (DATA / name).write_text(text)
        print(f"wrote {DATA / name} ({text.count(chr(10))} items)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
