"""Generate the project's own offline lm-eval task data (eval/tasks/data/*.jsonl), deterministically.

    python -m scripts.data.plumbing_tasks            # rewrites the committed files (identical output every time)

PLUMBING CHECKS, NOT BENCHMARKS. They exist so the real lm-evaluation-harness runs end to end against the real server
with no network: `lab_arith_mc` (multiple choice by log-likelihood, local-completions), `lab_arith_gen` (exact match
of generated numbers, local-chat-completions) and `lab_ifeval` (IFEval-format items scored by lm-eval's own IFEval
checkers, restricted to instructions that need no NLTK data). Their sizes come from the gate's power calculation
(the N_* sizes below), so a paired 2-point tolerance can be decided on them. Their scores say nothing about a model's quality;
MMLU-Pro / IFEval / GPQA-Diamond do (`make datasets-hub` where the hub is reachable).
"""

from __future__ import annotations

import argparse
import json
import random
import sys

from scripts.common import paths

DATA = paths.EVAL / "tasks" / "data"
SEED = 20261121
# Sizes from the gate's power calculation (scripts/common/gate.py): a one-sided 95% bound on a paired drop needs about
# n = q z^2 / (tol - d)^2 items at item disagreement rate q and true drop d. Measured on the 50-60-item version 1 sets,
# smollm2-int8 / -int8sq / -gptq-mlp disagreed with smollm2-bf16 on 7-10% of arithmetic items; at q = 0.10, d = 0 and
# tol = 2 points: 0.10 x 1.645^2 / 0.02^2 = 677 items; 1200 still decides a 0.3-point true drop
# (0.10 x 2.71 / 0.017^2 = 937). IFEval-format items generate up to 64 tokens each, ~12x the cost of an arithmetic
# item, so they get the n that decides at q = 0.06 (ideal for checks that rarely flip): 0.06 x 2.71 / 0.02^2 = 406.
N_ARITH_MC = 1200
N_ARITH_GEN = 1200
N_STRING_MC = 300  # of N_ARITH_MC: alphabetical-order questions
N_IFEVAL = 500
WORDS = ["apple", "river", "stone", "cloud", "garden", "window", "silver", "forest", "candle", "bridge", "ocean",
         "pencil", "meadow", "lantern", "harbor", "violin", "desert", "copper", "island", "thunder"]
TOPICS = ["the sea", "a cat", "autumn", "a city at night", "coffee", "mountains", "a library", "rain", "bicycles",
          "the moon", "a garden", "trains", "friendship", "winter", "music", "a forest", "bread", "the sun", "birds",
          "a river", "snow", "books", "the desert", "a market", "clocks", "tea", "a bridge", "the wind", "stars",
          "a lighthouse", "honey", "a museum", "the ocean floor", "spring", "a violin", "maps", "an island", "thunder",
          "candles", "a harbor"]
ASKS = ["Write two sentences about {t}.", "Describe {t} in one short sentence.", "Give one short fact about {t}.",
        "Write a one-line slogan about {t}."]
# IFEval instructions whose checkers use regular expressions only (no NLTK tokenizer data, which needs a download).
INSTRUCTIONS = [
    ("Do not use any commas.", "punctuation:no_comma", {}),
    ("Your entire response must be in lowercase letters.", "change_case:english_lowercase", {}),
    ("Your entire response must be in capital letters.", "change_case:english_capital", {}),
    ("Include the keyword '{w}' in your answer.", "keywords:existence", {"keywords": ["{w}"]}),
    ("Do not use the word '{w}'.", "keywords:forbidden_words", {"forbidden_words": ["{w}"]}),
    ("Wrap your entire answer in double quotation marks.", "startend:quotation", {}),
    ("Start with a title wrapped in double angular brackets, like <<title>>.", "detectable_format:title", {}),
    ("End your response with the exact phrase 'That is all.'", "startend:end_checker", {"end_phrase": "That is all."}),
    ("Answer with exactly 2 markdown bullet points like '* point'.", "detectable_format:number_bullet_lists",
     {"num_bullets": 2}),
    ("After your answer add a postscript starting with P.S.", "detectable_content:postscript",
     {"postscript_marker": "P.S."}),
]


def arith_items(rng: random.Random) -> tuple[list[dict], list[dict]]:
    """Distinct arithmetic questions (multiple choice and generated), then alphabetical-order questions."""
    mc, gen, seen = [], [], set()
    while len(gen) < N_ARITH_GEN or len(mc) < N_ARITH_MC - N_STRING_MC:
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice(["+", "-"])
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        ans = a + b if op == "+" else a - b
        if len(mc) < N_ARITH_MC - N_STRING_MC:
            wrong = sorted({ans + d for d in rng.sample([-10, -2, -1, 1, 2, 10], 3)})
            choices = [str(x) for x in sorted([ans, *wrong])]
            mc.append({"id": f"mc-{len(mc)}", "question": f"{a} {op} {b} =", "choices": choices,
                       "answer": choices.index(str(ans))})
        if len(gen) < N_ARITH_GEN:
            gen.append({"id": f"gen-{len(gen)}", "question": f"What is {a} {op} {b}? Reply with the number only.",
                        "answer": str(ans)})
    strings = set()
    while len(strings) < N_STRING_MC:
        strings.add(tuple(rng.sample(WORDS, 4)))
    for i, words in enumerate(sorted(strings)):
        mc.append({"id": f"mc-str-{i}", "question": f"Of {', '.join(words)}, the first in alphabetical order is",
                   "choices": list(words), "answer": words.index(min(words))})
    return mc, gen


def ifeval_items(rng: random.Random) -> list[dict]:
    """N_IFEVAL distinct (ask, topic, instruction) combinations, each with one IFEval-checkable instruction."""
    combos = [(a, t, i) for a in range(len(ASKS)) for t in range(len(TOPICS)) for i in range(len(INSTRUCTIONS))]
    out = []
    for n, (a, t, i) in enumerate(sorted(rng.sample(combos, N_IFEVAL))):
        text, iid, kwargs = INSTRUCTIONS[i]
        word = WORDS[(a + t + i) % len(WORDS)]
        kw = json.loads(json.dumps(kwargs).replace("{w}", word))
        out.append({"key": 1000 + n, "prompt": f"{ASKS[a].format(t=TOPICS[t])} {text.replace('{w}', word)}",
                    "instruction_id_list": [iid], "kwargs": [kw]})
    return out


def render() -> dict[str, str]:
    rng = random.Random(SEED)
    mc, gen = arith_items(rng)
    files = {"lab_arith_mc.jsonl": mc, "lab_arith_gen.jsonl": gen, "lab_ifeval.jsonl": ifeval_items(rng)}
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
