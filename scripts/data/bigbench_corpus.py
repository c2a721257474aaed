"""BIG-bench outside the evaluation suite: calibration text and chat prompts for the levers that learn from data.

    python -m scripts.data.bigbench_corpus                 # sizes and hashes of both splits (nothing written)
    python -m scripts.data.bigbench_corpus --prompts-out eval/prompts/bb-prompts.jsonl --split calibration --per-task 20
    python -m scripts.data.bigbench_corpus --shared-prefix-out eval/prompts/shared-prefix-v1.jsonl   # 32 x 4, speed only

Reads the task JSON of the `bigbench` sdist (`make datasets`; scripts.data.bigbench) and never a task of BIG-bench
Lite, the evaluation suite (bigbench.refuse_evaluation is called on every task read). Beyond the task names, an
example whose input equals the input of any BIG-bench Lite example (whitespace-normalized) is left out and counted:
some tasks share items.

Split by source family, not by example: a task is held out when the first byte of sha256(task name) is below
HELD_OUT_BYTE (about 1 in 10 tasks), so held-out numbers measure tasks the calibration never saw.

- `texts(split, chars_per_task)`: per task, examples in a fixed pseudo-random order (sha256 of the task and index),
  each as its input, a newline and its first target, until the task's character budget is spent; every task weighs
  at most the same, so multiemo's 1.4 M examples cannot drown the others.
- `prompts(split, per_task)`: the first `per_task` examples of each task in the same order as chat prompts (BIG-bench's
  own zero-shot format, choices appended, as the user message), deduplicated by text.
Both return a description with the counts, the tasks and the SHA-256 of the exact output: the hash a keep list or a
draft head records as its corpus.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from scripts.common import paths
from scripts.data import bigbench

SPLITS = ("calibration", "held_out")
HELD_OUT_BYTE = 26  # first byte of sha256(task) below this: held out (26/256 ~ 10%)
PROMPT_MAX_TOKENS = 128
PROMPT_MAX_CHARS = 6_000  # a prompt longer than this (a whole document, an ASCII image) is skipped


def split_of(task: str) -> str:
    return "held_out" if hashlib.sha256(task.encode()).digest()[0] < HELD_OUT_BYTE else "calibration"


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text).strip()


@cache
def lite_inputs(data: Path | None = None) -> frozenset[str]:
    """The normalized input of every example of every BIG-bench Lite task (not only the suite's draw)."""
    out = set()
    for task in bigbench.lite_tasks(data):
        for _, path in bigbench.task_files(task, data):
            out.update(normalize(str(e.get("input", ""))) for e in json.loads(path.read_text()).get("examples", []))
    return frozenset(out)


def tasks(split: str | None = None, data: Path | None = None) -> list[str]:
    """Every task of the sdist outside BIG-bench Lite (of one split when given), in name order."""
    if split is not None and split not in SPLITS:
        raise bigbench.BigBenchError(f"unknown split {split!r}: {' | '.join(SPLITS)}")
    root = (data or bigbench.DATA) / "tasks"
    bigbench.manifest(data)
    if not root.is_dir():  # the suite alone travelled (a GPU machine's payload): the task JSON is not there
        raise bigbench.BigBenchError(f"{paths.shown(root)} is missing: the task JSON was not extracted here; run "
                                     f"`{bigbench.FETCH_COMMAND}`")
    lite = set(bigbench.lite_tasks(data))
    folders = {p.name for p in root.iterdir() if p.is_dir()}
    if lite - folders:  # every example read is checked against every Lite input (lite_inputs): refused before any work
        raise bigbench.BigBenchError(f"{paths.shown(root)} lacks {len(lite - folders)} of the {len(lite)} BIG-bench Lite "
                                     f"task folders ({min(lite - folders)}, …) that the leak check reads: run "
                                     f"`{bigbench.FETCH_COMMAND}`")
    return [t for t in sorted(folders) if t not in lite and (split is None or split_of(t) == split)]


def examples(task: str, data: Path | None = None) -> Iterator[tuple[str, dict, dict]]:
    """(key, task spec, example) of a task outside the suite, in its fixed order; Lite inputs left out."""
    bigbench.refuse_evaluation(task, data)
    lite = lite_inputs(data)
    rows = []
    for subtask, path in bigbench.task_files(task, data):
        spec = json.loads(path.read_text())
        for index, example in enumerate(spec.get("examples", [])):
            key = f"{task}/{subtask}/{index}"
            rows.append((hashlib.sha256(key.encode()).hexdigest(), key, spec, example))
    rows.sort(key=lambda r: r[0])
    for _, key, spec, example in rows:
        if normalize(str(example.get("input", ""))) in lite:
            yield key, spec, {}  # an empty example: counted as a suite duplicate by the callers
            continue
        yield key, spec, example


def first_target(example: dict) -> str:
    if "target" in example:
        t = example["target"]
        return str(t[0] if isinstance(t, list) and t else t)
    scores = example.get("target_scores") or {}
    return str(max(scores, key=scores.get)) if scores else ""


def _describe(kind: str, split: str, names: list[str], counts: dict, payload: str, extra: dict) -> dict:
    return {"source": f"bigbench {bigbench.VERSION} task JSON outside BIG-bench Lite", "kind": kind, "split": split,
            "held_out_rule": f"sha256(task)[0] < {HELD_OUT_BYTE}", "tasks": len(names),
            "task_names_sha256": hashlib.sha256("\n".join(names).encode()).hexdigest(), **counts, **extra,
            "sha256": hashlib.sha256(payload.encode()).hexdigest()}


def texts(split: str, chars_per_task: int, data: Path | None = None) -> tuple[list[tuple[str, str]], dict]:
    """(task, text) pairs of one split within a character budget per task, and their description."""
    out, dupes = [], 0
    names = tasks(split, data)
    for task in names:
        spent = 0
        for _, _, ex in examples(task, data):
            if not ex:
                dupes += 1
                continue
            text = f"{ex.get('input', '')}\n{first_target(ex)}".strip()
            if not text:
                continue
            out.append((task, text))
            spent += len(text)
            if spent >= chars_per_task:
                break
    payload = "\n\n".join(t for _, t in out)
    return out, _describe("text", split, names, {"examples": len(out), "chars": len(payload),
                                                 "suite_duplicates_left_out": dupes},
                          payload, {"chars_per_task": chars_per_task})


def prompts(split: str, per_task: int, data: Path | None = None,
            max_tokens: int = PROMPT_MAX_TOKENS) -> tuple[list[dict], dict]:
    """Chat prompt rows (loadgen.load_prompts' format) of one split, `per_task` per task, and their description."""
    rows, seen, dupes = [], set(), 0
    names = tasks(split, data)
    for task in names:
        n = 0
        for key, spec, ex in examples(task, data):
            if n >= per_task:
                break
            if not ex:
                dupes += 1
                continue
            text = bigbench.format_example(spec, ex)[0].strip()
            if not text or len(text) > PROMPT_MAX_CHARS or text in seen:
                continue
            seen.add(text)
            rows.append({"id": key, "group": task, "split": split, "max_tokens": max_tokens,
                         "messages": [{"role": "user", "content": text}]})
            n += 1
    payload = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    return rows, _describe("chat prompts", split, names, {"prompts": len(rows), "suite_duplicates_left_out": dupes},
                           payload, {"per_task": per_task, "max_tokens": max_tokens})


def shared_prefix(groups: int, per_group: int, shots: int = 4, max_tokens: int = 64,
                  data: Path | None = None) -> tuple[list[dict], dict]:
    """A prompt set whose requests share long prefixes, as few-shot serving does: `groups` calibration tasks (name
    order, those with enough examples and a few-shot block of 1,500-6,000 characters), each giving one system message
    (the task's first `shots` examples with their answers) and `per_group` questions (the next examples) after it.
    Rows are ordered group by group. For speed only (prefix caching, cache-aware routing), never for quality."""
    rows, names = [], []
    for task in tasks("calibration", data):
        if len(names) == groups:
            break
        items = [(key, spec, ex) for key, spec, ex in examples(task, data) if ex][:shots + per_group]
        if len(items) < shots + per_group:
            continue
        block = "\n\n".join(f"{bigbench.format_example(spec, ex)[0].strip()} {first_target(ex)}".strip()
                             for _, spec, ex in items[:shots])
        questions = [bigbench.format_example(spec, ex)[0].strip() for _, spec, ex in items[shots:]]
        if not 1_500 <= len(block) <= PROMPT_MAX_CHARS or any(not q or len(q) > 2_000 for q in questions):
            continue
        system = f"Answer in the style of these solved examples of the task '{task}'.\n\n{block}"
        names.append(task)
        rows += [{"id": key, "group": task, "split": "calibration", "max_tokens": max_tokens,
                  "messages": [{"role": "system", "content": system}, {"role": "user", "content": q}]}
                 for (key, _, _), q in zip(items[shots:], questions, strict=True)]
    if len(names) < groups:
        raise bigbench.BigBenchError(f"only {len(names)} calibration tasks fit a shared-prefix group; asked for {groups}")
    payload = "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows)
    return rows, _describe("shared-prefix chat prompts", "calibration", names, {"prompts": len(rows)}, payload,
                           {"groups": groups, "per_group": per_group, "shots": shots, "max_tokens": max_tokens})


def write_prompts(rows: list[dict], out: Path) -> Path:
    return paths.write_text_atomic(out, "".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--chars-per-task", type=int, default=200_000)
    p.add_argument("--per-task", type=int, default=20, help="prompts per task (default %(default)s)")
    p.add_argument("--split", choices=SPLITS, default="calibration", help="the split --prompts-out writes")
    p.add_argument("--prompts-out", type=Path, help="write that split's chat prompts here (JSONL)")
    p.add_argument("--shared-prefix-out", type=Path, help="write the shared-prefix set here (JSONL; --groups x "
                   "--per-group rows) and nothing else")
    p.add_argument("--groups", type=int, default=32)
    p.add_argument("--per-group", type=int, default=4)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.shared_prefix_out:
            rows, info = shared_prefix(args.groups, args.per_group)
            print(f"{info['prompts']} prompts in {info['groups']} groups from {info['tasks']} tasks "
                  f"(sha256 {info['sha256'][:12]}); wrote {paths.shown(write_prompts(rows, args.shared_prefix_out))}")
            return 0
        for split in SPLITS:
            _, info = texts(split, args.chars_per_task)
            rows, pinfo = prompts(split, args.per_task)
            print(f"{split}: {info['tasks']} tasks, {info['examples']:,} text examples ({info['chars']:,} chars, "
                  f"sha256 {info['sha256'][:12]}), {pinfo['prompts']:,} prompts; "
                  f"{info['suite_duplicates_left_out']:,} suite duplicates left out")
            if args.prompts_out and split == args.split:
                print(f"wrote {paths.shown(write_prompts(rows, args.prompts_out))}")
    except bigbench.BigBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
