"""Generate the speculative-decoding prompt sets, deterministically.

    python -m scripts.levers.speculate.prompts          # rewrites eval/prompts/spec-v1-{train,eval}.jsonl
    python -m scripts.levers.speculate.prompts --scale  # .cache/prompts/spec-v2.jsonl: BIG-bench at scale (`make datasets`)
    python -m scripts.levers.speculate.prompts --scale spec-v3   # spec-v2 and chat prompts over new families

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

spec-v3 (--scale spec-v3): spec-v2, then ~1.7k chat prompts of spec-v1's six kinds over families spec-v1 never used
(new concepts, list topics, coding tasks and writing subjects, and cpython-docs passages past the share parity
evaluates that no spec-v1 prompt quotes), each answered greedily and CHAT_SAMPLES times sampled. spec-v2's head saw
chat in 392 of 27,508 prompts and accepted less on spec-v1-eval's chat than on held-out BIG-bench tasks. One family
in three of each chat kind is `val`; a chat family equal to a spec-v1 family makes the build refuse, naming it.
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
from scripts.data.corpus import EVAL_FRACTION, cpython_docs, passages

SEED = 20261122
PER_KIND = 100
EVAL_EVERY = 3  # one family in three (rounded up) of each kind is held out for evaluation
MAX_TOKENS = 128
NAME = "spec-v1"
SCALE_NAME = "spec-v2"
SCALE_PER_TASK = 300  # BIG-bench prompts per calibration task (26.7k in all: many tasks have fewer)
SCALE_VAL_PER_TASK = 40  # per held-out task (the validation families)
CHAT_NAME = "spec-v3"
# spec-v3's chat prompts are answered greedily plus CHAT_SAMPLES times sampled (a row's `samples`, read by
# loadgen.greedy_ids): ~1.7k prompts x 8 answers, about a fifth of spec-v3's response tokens
CHAT_SAMPLES = 7
CHAT_PASSAGE_USES = 2  # each passage gives this many rewrite prompts and as many question prompts
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
# spec-v3's chat families: new concepts, topics, tasks and subjects for spec-v1's kinds, none of them a spec-v1 family
# (checked by chat_rows), so no spec-v1-eval prompt is a rewording of one of these
CHAT_CONCEPTS = [
    "a stack", "a heap", "a binary tree", "a graph", "dynamic programming", "big-O notation", "a regular expression",
    "an interpreter", "a thread", "a process", "deadlock", "a race condition", "load balancing", "a firewall",
    "public-key cryptography", "a checksum", "compression", "a bloom filter", "a trie", "a state machine",
    "object-oriented programming", "functional programming", "an event loop", "a callback", "a web server",
    "HTTP cookies", "a REST API", "JSON", "a spreadsheet", "a relational database", "SQL joins", "a transaction",
    "a backup", "a cloud server", "containers", "a package manager", "code review", "technical debt",
    "pair programming", "an algorithm", "a search engine", "a leap year", "a decision tree", "time zones",
    "probability", "the median", "standard deviation", "a histogram", "correlation", "sampling bias",
    "the scientific method", "evolution", "cells", "DNA", "the immune system", "the heart", "sleep", "nutrition",
    "muscles", "the solar system", "black holes", "the moon's phases", "tides", "seasons", "earthquakes", "volcanoes",
    "erosion", "rainbows", "magnetism", "friction", "energy", "electricity", "sound waves", "light", "atoms",
    "chemical reactions", "acids and bases", "the periodic table", "democracy", "taxes", "a budget", "interest rates",
    "a stock market", "insurance", "a loan", "saving money", "opportunity cost", "trade", "a contract", "copyright",
    "a patent", "the printing press", "the internet", "electric cars", "solar panels", "recycling", "composting",
    "biodiversity", "a food chain", "bird migration", "deforestation",
]
CHAT_LISTS = [
    "ways to stay focused while studying", "tips for a good night's sleep", "ideas for a school science project",
    "ways to make a small room feel bigger", "tips for writing a cover letter", "board games for a family evening",
    "ways to cut household waste", "tips for running a meeting", "vegetables that are easy to grow",
    "ways to learn to code", "tips for taking notes", "reasons to learn history", "ways to be a good neighbour",
    "tips for traveling on a budget", "things to check before buying a used car", "ways to keep a team motivated",
    "tips for saving water", "common mistakes in a first draft", "ideas for a birthday party", "ways to exercise at home",
    "tips for writing clear emails", "benefits of walking", "ways to protect your privacy online",
    "tips for a first day at a new job", "uses of a spreadsheet", "ways to improve handwriting",
    "questions to ask a doctor", "tips for cooking rice", "features of a good website", "ways to practice gratitude",
    "tips for learning to swim", "causes of traffic jams", "ways to make friends in a new city",
    "tips for keeping plants alive", "ideas for a weekend trip", "reasons to back up your files",
    "ways to reduce screen time", "tips for a long flight", "things a good manager does", "signs of a phishing email",
    "ways to memorize a speech", "tips for writing a resume", "parts of a bicycle", "ways to prepare for a marathon",
    "tips for packing a suitcase", "ideas for a short film", "things to know about owning a dog",
    "ways to speed up a slow laptop", "tips for giving feedback", "steps to plan a garden",
]
CHAT_CODE = [
    "check whether a list contains duplicates", "check whether a year is a leap year", "count the lines in a file", "find the first repeated character in a string",
    "convert a string to snake_case", "compute the power of a number", "check whether two strings are anagrams",
    "return the longest word in a sentence", "compute the sum of a list", "remove whitespace from a string",
    "find the index of an element in a list", "find all prime numbers below n", "convert minutes to hours and minutes",
    "check whether a list is sorted", "generate the multiplication table of n", "count the digits of a number",
    "compute the area of a circle", "split a list into chunks of size n", "merge two dictionaries",
    "check whether a number is even", "compute the length of a string without a built-in", "check whether a sentence is a pangram",
    "find the maximum of three numbers", "compute simple interest", "rotate a list by k positions",
    "count the uppercase letters in a string", "remove a given element from a list", "convert a number to binary",
    "check whether a string contains only digits", "compute the mean and the median of a list",
]
CHAT_WRITING = [
    "a short story about a robot learning to paint", "a poem about the sea", "a thank-you note to a teacher",
    "a product description for a reusable water bottle", "a letter to a pen pal", "a fable about a greedy crow",
    "a scene at a night market", "a short speech for a graduation", "a review of an imaginary movie",
    "an advert for a bicycle shop", "a diary entry on the first snow", "a dialogue between a student and a librarian",
    "a bedtime story about a brave mouse", "a postcard from the mountains", "a limerick about a cat",
    "a short mystery opening", "a welcome message for new club members", "a recipe introduction for apple pie",
    "a poem about autumn leaves", "a story about a lost umbrella", "a scene in a quiet library",
    "a motivational message for a sports team", "a short biography of an imaginary inventor",
    "an invitation to a neighbourhood picnic", "a story about two friends building a treehouse",
    "a haiku about the city at night", "a letter of apology for missing a meeting", "a travel blog intro about an island",
    "a speech about protecting the environment", "a story set on a train across the desert",
]
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


def chat_kinds(spec_v1_prompts: list[str]) -> dict[str, list[tuple[str, str]]]:
    """spec-v3's chat prompts, kind -> (family, prompt): spec-v1's kinds and templates over new families (the CHAT_*
    lists, and cpython-docs passages after the text parity evaluates that no spec-v1 prompt quotes)."""
    text = cpython_docs().text
    pool = [p for p in passages(text[int(len(text) * EVAL_FRACTION):], min_chars=300)
            if len(p) <= 900 and not any(p in q for q in spec_v1_prompts)]
    uses = range(CHAT_PASSAGE_USES)
    return {
        "explain": [(c, f"Explain {c} to {a}.") for c in CHAT_CONCEPTS for a in AUDIENCES],
        "list": [(t, f"List {n} {t}.") for t in CHAT_LISTS for n in ("three", "four", "five", "six", "seven")],
        "code": [(t, f"Write a {lang} function to {t}.") for t in CHAT_CODE for lang in LANGS],
        "writing": [(w, f"Write {w}.") for w in CHAT_WRITING] + [(w, f"Write {w}, in under 100 words.") for w in CHAT_WRITING]
                   + [(w, f"Write {w} for {a}.") for w in CHAT_WRITING for a in AUDIENCES],
        "rewrite": [(f"d{i}", f"{REWRITES[(i + u) % len(REWRITES)]}\n\n{t}") for i, t in enumerate(pool) for u in uses],
        "passage-qa": [(f"d{i}", f"Read the text and answer the question.\n\n{t}\n\nQuestion: "
                                 f"{QUESTIONS[(i + u) % len(QUESTIONS)]}") for i, t in enumerate(pool) for u in uses],
    }


def chat_rows(samples: int = CHAT_SAMPLES) -> tuple[list[dict], dict]:
    """spec-v3's chat rows (one family in three of each kind is `val`) and their description. Refuses a family that
    is a spec-v1 family (a concept, topic, task or subject of either split), naming it."""
    old = {*CONCEPTS, *LISTS, *CODE, *WRITING}
    if clash := sorted(old & {*CHAT_CONCEPTS, *CHAT_LISTS, *CHAT_CODE, *CHAT_WRITING}):
        raise PromptLeak(f"chat families that are spec-v1 families: {clash}")
    quoted = [json.loads(line)["messages"][-1]["content"] for split in ("train", "eval")
              for line in (paths.EVAL / "prompts" / f"{NAME}-{split}.jsonl").read_text().splitlines()]
    rng, rows = random.Random(SEED + 1), []
    # the split is drawn per kind, as spec-v1's: rewrite and passage-qa share passages, so a passage can be val in one
    # and train in the other (66 of 158 in spec-v3). Left so, since spec-v3's hash is pinned; a next set should split
    # passages across both kinds at once.
    for kind, prompts in chat_kinds(quoted).items():
        families = sorted({f for f, _ in prompts})
        held_out = set(rng.sample(families, math.ceil(len(families) / EVAL_EVERY)))
        for j, (family, text) in enumerate(prompts):
            rows.append({"id": f"chat-{kind}-{j}", "group": f"chat-{kind}", "max_tokens": MAX_TOKENS, "samples": samples,
                         "split": "val" if family in held_out else "train", "messages": [{"role": "user", "content": text}]})
    count = {s: sum(r["split"] == s for r in rows) for s in ("train", "val")}
    return rows, {"source": "spec-v1's six kinds and templates over new families (CHAT_* lists in "
                            "scripts/levers/speculate/prompts.py; cpython-docs passages past parity's share)",
                  "prompts": len(rows), **{f"{s}_prompts": n for s, n in count.items()}, "samples_per_prompt": samples,
                  "split_rule": "one family in three of each kind is val"}


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


def render_scale(name: str = SCALE_NAME, per_task: int = SCALE_PER_TASK,
                 val_per_task: int = SCALE_VAL_PER_TASK) -> tuple[str, dict]:
    """spec-v2 (or spec-v3: spec-v2 and the chat rows after it) as JSONL text, and its description (counts per split
    and source, tasks, SHA-256)."""
    train, tinfo = bigbench_corpus.prompts("calibration", per_task)
    val, vinfo = bigbench_corpus.prompts("held_out", val_per_task)
    spec = [{**json.loads(line), "split": "train"}
            for line in (paths.EVAL / "prompts" / f"{NAME}-train.jsonl").read_text().splitlines()]
    chat, cinfo = chat_rows() if name == CHAT_NAME else ([], None)
    rows, seen = [], set()
    for split, part in (("train", spec), ("train", train), ("val", val), (None, chat)):
        for r in part:
            text = bigbench_corpus.normalize(r["messages"][-1]["content"])
            if text not in seen:
                seen.add(text)
                rows.append({**r, "split": split or r["split"]})
    refuse_evaluation_rows(rows, evaluation_texts())
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    count = {s: sum(r["split"] == s for r in rows) for s in ("train", "val")}
    sources = {"bigbench_calibration": tinfo, "bigbench_held_out (val)": vinfo, f"{NAME}-train": len(spec),
               **({"chat": cinfo} if cinfo else {})}
    return text, {"name": name, "prompts": len(rows), **{f"{s}_prompts": n for s, n in count.items()},
                  "sources": sources,
                  "split_rule": "train: BIG-bench calibration tasks + spec-v1-train (+ chat train families); val: "
                                "BIG-bench held-out tasks (+ chat val families)",
                  "excluded": "BIG-bench Lite tasks and inputs, spec-v1-eval (refused if present)",
                  "per_task": per_task, "val_per_task": val_per_task,
                  "sha256": hashlib.sha256(text.encode()).hexdigest()}


def scale_paths(name: str) -> tuple[Path, Path]:
    """(the built prompt file under .cache/prompts, its committed description under results/speculate)."""
    return paths.CACHE / "prompts" / f"{name}.jsonl", paths.ROOT / "results" / "speculate" / f"{name}-prompts.json"


def write_scale(name: str = SCALE_NAME) -> dict:
    """Build spec-v2 or spec-v3 under .cache/prompts (temp file, rename); check its hash against the committed record,
    or write the record when there is none."""
    out, record = scale_paths(name)
    text, info = render_scale(name)
    if record.exists():
        want = json.loads(record.read_text())["sha256"]
        if want != info["sha256"]:
            raise PromptLeak(f"{name} rebuilt with sha256 {info['sha256'][:16]}, {paths.shown(record)} says "
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
    p.add_argument("--scale", nargs="?", const=SCALE_NAME, choices=(SCALE_NAME, CHAT_NAME),
                   help=f"build .cache/prompts/<name>.jsonl instead: {SCALE_NAME} (BIG-bench, the default) or "
                        f"{CHAT_NAME} ({SCALE_NAME} and chat prompts over new families)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.scale:
        try:
            info = write_scale(args.scale)
        except (PromptLeak, bigbench.BigBenchError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        out, record = scale_paths(args.scale)
        print(f"wrote {paths.shown(out)}: {info['train_prompts']:,} train + {info['val_prompts']:,} val prompts, "
              f"sha256 {info['sha256'][:16]} (record {paths.shown(record)})")
        return 0
    out = paths.EVAL / "prompts"
    for name, text in render().items():
        (out / name).write_text(text)
        print(f"wrote {paths.shown(out / name)} ({text.count(chr(10))} prompts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
