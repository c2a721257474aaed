"""Generate the speculative-decoding prompt set (eval/prompts/spec-v1-{train,eval}.jsonl), deterministically.

    python -m scripts.levers.speculate.prompts          # rewrites the committed files (identical output every time)

600 varied chat prompts in six kinds (explain, list, code, rewrite/summarize a passage, answer a question about a
passage, free-form writing), made from this project's word lists and passages of the offline cpython-docs corpus.
One family in three of each kind (a concept, topic, task or passage, with all its rewordings) goes to the evaluation
split, the rest to the training split: a draft head is distilled on `train` only, and acceptance and speed are
reported on `eval` only. Both files use the latency bench's
row format (`id`, `group`, `max_tokens`, `messages`), so `measure.latency --prompts` replays either.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys

from scripts.common import paths
from scripts.data.corpus import cpython_docs, passages

SEED = 20261122
PER_KIND = 100
EVAL_EVERY = 3  # one family in three (rounded up) of each kind is held out for evaluation
MAX_TOKENS = 128
NAME = "spec-v1"
CONCEPTS = ["recursion", "a hash table", "garbage collection", "a binary search", "photosynthesis", "inflation",
            "a compiler", "TCP handshakes", "gravity", "an API", "a linked list", "version control", "encryption",
            "a database index", "caching", "the water cycle", "supply and demand", "a neural network", "DNS",
            "unit testing", "a mutex", "latency versus throughput", "a virtual machine", "compound interest",
            "an operating system", "climate", "vaccines", "electric circuits", "a sorting algorithm", "a queue"]
AUDIENCES = ["a child", "a beginner", "a busy manager", "a high-school student", "a new programmer"]
LISTS = ["ways to save energy at home", "tips for learning a language", "healthy breakfast ideas",
         "reasons to use version control", "things to pack for a hike", "common sorting algorithms",
         "habits of good writers", "uses of Python", "ways to reduce stress", "benefits of reading",
         "steps to debug a program", "features of a good password", "kinds of renewable energy",
         "questions to ask in an interview", "rules for clean code", "ideas for a rainy day",
         "signs of a slow database query", "parts of a computer", "tips for public speaking", "fruits rich in fiber"]
CODE = ["reverse a string", "check whether a number is prime", "count the words in a sentence",
        "compute the factorial of n", "merge two sorted lists", "find the largest number in a list",
        "remove duplicates from a list", "read a CSV file and print each row", "compute Fibonacci numbers",
        "check whether a string is a palindrome", "flatten a nested list", "convert Celsius to Fahrenheit",
        "count vowels in a string", "sort a dictionary by value", "compute the average of a list",
        "find common elements of two lists", "capitalize every word of a sentence", "sum the digits of a number",
        "check balanced parentheses", "compute the greatest common divisor"]
LANGS = ["Python", "JavaScript", "Go", "Rust", "C"]
WRITING = ["a short story about a lost key", "a poem about the morning", "a letter to a future self",
           "a product description for a smart lamp", "a diary entry after a long trip", "a toast for a friend",
           "a fable about a patient turtle", "a dialogue between a cat and a dog", "an advert for a bakery",
           "a short speech about kindness", "a haiku sequence about rain", "a scene in a busy train station",
           "a review of an imaginary restaurant", "a motivational note for exam week", "a bedtime story about stars"]
REWRITES = ["Summarize the following text in two sentences.", "Rewrite the following text in plain English.",
            "List the three main points of the following text.", "Explain the following text to a beginner."]
QUESTIONS = ["What is the main purpose of what this text describes?", "What does the text say about arguments or "
             "parameters?", "Give one example of how the described feature could be used.",
             "What would a beginner find confusing in this text?"]


def kinds(rng: random.Random) -> dict[str, list[tuple[str, str]]]:
    """kind -> PER_KIND distinct (family, prompt) pairs; a family (a concept, topic, task or passage) is what the
    splits keep apart, so no evaluation prompt is a rewording of a training one."""
    texts = [p for p in passages(cpython_docs().text, min_chars=300) if len(p) <= 900]
    picked = rng.sample(texts, 2 * PER_KIND)
    return {
        "explain": [(c, f"Explain {c} to {a}.") for c in CONCEPTS for a in AUDIENCES][:PER_KIND],
        "list": [(t, f"List {n} {t}.") for t in LISTS for n in ("three", "four", "five", "six", "seven")],
        "code": [(t, f"Write a {lang} function to {t}.") for t in CODE for lang in LANGS],
        "writing": ([(w, f"Write {w}.") for w in WRITING] + [(w, f"Write {w}, in under 100 words.") for w in WRITING]
                    + [(w, f"Write {w} for {a}.") for w in WRITING for a in AUDIENCES])[:PER_KIND],
        "rewrite": [(f"p{i}", f"{REWRITES[i % len(REWRITES)]}\n\n{t}") for i, t in enumerate(picked[:PER_KIND])],
        "passage-qa": [(f"q{i}", f"Read the text and answer the question.\n\n{t}\n\nQuestion: "
                                 f"{QUESTIONS[i % len(QUESTIONS)]}") for i, t in enumerate(picked[PER_KIND:])],
    }


def render() -> dict[str, str]:
    rng = random.Random(SEED)
    splits: dict[str, list[dict]] = {"train": [], "eval": []}
    for kind, prompts in kinds(rng).items():
        if len({p for _, p in prompts}) != PER_KIND:
            raise ValueError(f"{kind}: {len({p for _, p in prompts})} distinct prompts, need {PER_KIND}")
        families = sorted({f for f, _ in prompts})
        held_out = set(rng.sample(families, math.ceil(len(families) / EVAL_EVERY)))
        for j, (family, text) in enumerate(prompts):
            split = "eval" if family in held_out else "train"
            splits[split].append({"id": f"{kind}-{j}", "group": kind, "split": split, "max_tokens": MAX_TOKENS,
                                  "messages": [{"role": "user", "content": text}]})
    return {f"{NAME}-{s}.jsonl": "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
            for s, rows in splits.items()}


def build_parser() -> argparse.ArgumentParser:
    return argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)


def main(argv: list[str] | None = None) -> int:
    build_parser().parse_args(argv)
    out = paths.EVAL / "prompts"
    for name, text in render().items():
        (out / name).write_text(text)
        print(f"wrote {paths.shown(out / name)} ({text.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
