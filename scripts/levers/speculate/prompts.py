"""Generate the speculative-decoding prompt sets, deterministically.

    python -m scripts.levers.speculate.prompts          # rewrites eval/prompts/spec-v1-{train,eval}.jsonl
    python -m scripts.levers.speculate.prompts --scale  # .cache/prompts/spec-v2.jsonl: BIG-bench at scale (`make datasets`)

600 varied chat prompts in six kinds (explain, list, code, rewrite/summarize a passage, answer a question about a
passage, free-form writing), made from this project's word lists and passages of the offline cpython-docs corpus.
One family in three of each kind (a concept, topic, task or passage, with all its rewordings) goes to the evaluation
split, the rest to the training split: a draft head is distilled on `train` only, and acceptance and speed are
reported on `eval` only. Both files use the latency bench's
row format (`id`, `group`, `max_tokens`, `messages`), so `measure.latency --prompts` replays either.

spec-v2 (--scale), the distillation set at scale: chat prompts from the BIG-bench task JSON outside BIG-bench Lite
(scripts.data.bigbench_corpus: SCALE_PER_TASK per task, Lite inputs left out), plus spec-v1-train. Split by source
family: the calibration tasks and spec-v1-train are `train`, the held-out tasks (sha256 rule) `val`, so a head's
validation accuracy is measured on task families it never saw. Deduplicated by text; a row equal to a spec-v1-eval
prompt or a BIG-bench Lite input (whitespace-normalized) makes the build refuse, naming it. Too large to commit
(~15 MB): the build is deterministic and its SHA-256 is committed in results/speculate/spec-v2-prompts.json, which
a rebuild is checked against.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import random
import sys
from pathlib import Path

from scripts.common import paths
from scripts.data import bigbench, bigbench_corpus
from scripts.data.corpus import cpython_docs, passages

SEED = 20261122
PER_KIND = 100
EVAL_EVERY = 3  # one family in three (rounded up) of each kind is held out for evaluation
MAX_TOKENS = 128
NAME = "spec-v1"
SCALE_NAME = "spec-v2"
SCALE_PER_TASK = 300  # BIG-bench prompts per calibration task (26.7k in all: many tasks have fewer)
SCALE_VAL_PER_TASK = 40  # per held-out task (the validation families)
SCALE_OUT = paths.CACHE / "prompts" / f"{SCALE_NAME}.jsonl"
SCALE_RECORD = paths.ROOT / "results" / "speculate" / f"{SCALE_NAME}-prompts.json"
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


class PromptLeak(ValueError):
    """A distillation prompt equals an evaluation one."""


def refuse_evaluation_rows(rows: list[dict], forbidden: dict[str, str]) -> None:
    """Refuse when any row's text (whitespace-normalized) is an evaluation prompt; `forbidden` maps normalized
    evaluation text to where it comes from."""
    for r in rows:
        text = bigbench_corpus.normalize(" ".join(m["content"] for m in r["messages"] if m["role"] == "user"))
        if text in forbidden:
            raise PromptLeak(f"{r['id']} ({r.get('group')}) is an evaluation prompt of {forbidden[text]}: "
                             f"{text[:80]!r}")


def evaluation_texts() -> dict[str, str]:
    """Normalized text -> source, of every prompt the speculation levers are judged on: spec-v1-eval, BIG-bench Lite."""
    out = {t: "BIG-bench Lite" for t in bigbench_corpus.lite_inputs()}
    for line in (paths.EVAL / "prompts" / f"{NAME}-eval.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[bigbench_corpus.normalize(r["messages"][-1]["content"])] = f"{NAME}-eval ({r['id']})"
    return out


def render_scale(per_task: int = SCALE_PER_TASK, val_per_task: int = SCALE_VAL_PER_TASK) -> tuple[str, dict]:
    """spec-v2 as JSONL text, and its description (counts per split and source, tasks, SHA-256)."""
    train, tinfo = bigbench_corpus.prompts("calibration", per_task)
    val, vinfo = bigbench_corpus.prompts("held_out", val_per_task)
    spec = [{**json.loads(line), "split": "train"}
            for line in (paths.EVAL / "prompts" / f"{NAME}-train.jsonl").read_text().splitlines()]
    rows, seen = [], set()
    for split, part in (("train", spec), ("train", train), ("val", val)):
        for r in part:
            text = bigbench_corpus.normalize(r["messages"][-1]["content"])
            if text not in seen:
                seen.add(text)
                rows.append({**r, "split": split})
    refuse_evaluation_rows(rows, evaluation_texts())
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    count = {s: sum(r["split"] == s for r in rows) for s in ("train", "val")}
    return text, {"name": SCALE_NAME, "prompts": len(rows), **{f"{s}_prompts": n for s, n in count.items()},
                  "sources": {"bigbench_calibration": tinfo, "bigbench_held_out (val)": vinfo,
                              f"{NAME}-train": len(spec)},
                  "split_rule": "train: BIG-bench calibration tasks + spec-v1-train; val: BIG-bench held-out tasks",
                  "excluded": "BIG-bench Lite tasks and inputs, spec-v1-eval (refused if present)",
                  "per_task": per_task, "val_per_task": val_per_task,
                  "sha256": hashlib.sha256(text.encode()).hexdigest()}


def write_scale(out: Path = SCALE_OUT, record: Path = SCALE_RECORD) -> dict:
    """Build spec-v2 into `out` (temp file, rename); check its hash against the committed record, or write the record
    when there is none."""
    text, info = render_scale()
    if record.exists():
        want = json.loads(record.read_text())["sha256"]
        if want != info["sha256"]:
            raise PromptLeak(f"{SCALE_NAME} rebuilt with sha256 {info['sha256'][:16]}, {paths.shown(record)} says "
                             f"{want[:16]}: the BIG-bench data or the builder changed")
    else:
        record.parent.mkdir(parents=True, exist_ok=True)
        record.write_text(json.dumps(info, indent=1) + "\n")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(text)
    tmp.rename(out)
    return info


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--scale", action="store_true", help=f"build {paths.shown(SCALE_OUT)} from BIG-bench instead")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.scale:
        try:
            info = write_scale()
        except (PromptLeak, bigbench.BigBenchError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"wrote {paths.shown(SCALE_OUT)}: {info['train_prompts']:,} train + {info['val_prompts']:,} val prompts, "
              f"sha256 {info['sha256'][:16]} (record {paths.shown(SCALE_RECORD)})")
        return 0
    out = paths.EVAL / "prompts"
    for name, text in render().items():
        (out / name).write_text(text)
        print(f"wrote {paths.shown(out / name)} ({text.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
