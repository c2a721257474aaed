"""BIG-bench Lite as lm-eval tasks: the suite of record, drawn deterministically from the cached BIG-bench task JSON.

    python -m scripts.data.bigbench_tasks              # `make datasets` runs it: suite JSONL + manifest under the cache
    python -m scripts.data.bigbench_tasks --yaml       # also rewrite the committed task YAMLs (eval/tasks/bigbench_lite)

One lm-eval task per BIG-bench Lite task (`bbl_<task>`, tag `bigbench_lite`), zero-shot in BIG-bench's own prompt
format (scripts/data/bigbench.py). Multiple-choice items are scored by log-likelihood of each `target_scores` choice
(BIG-bench's `multiple_choice_grade`: the score of the most likely choice); generative items by BIG-bench's
`exact_str_match` (the answer cut at the task's stop string and a newline, trimmed). Each item keeps its stable id
(task/subtask/index) and the version of every task is the sdist's SHA-256.

Size (the gate's power calculation, scripts/common/gate.py): a one-sided 95% bound on a paired drop clears a tolerance
`tol` at item disagreement q and true drop 0 after n ≈ q z² / tol² items; at q = 0.10 and tol = 1 point that is
0.10 × 1.645² / 0.01² = 2,706 items, and a 0.2-point true drop needs 0.10 × 2.706 / 0.008² = 4,228. Log-likelihood
scoring costs one prompt per choice, so a task's share is set by what it costs to score: every task gets
`BYTES_PER_TASK` bytes of scored UTF-8 text (prompt × choices), at least `FLOOR` items and at most `CAP`; then, until
the suite holds `TARGET_ITEMS` (the 1-point tolerance at ~10% disagreement, above), the cheapest tasks are filled up to
`CAP` in order of their mean cost. Items are drawn in the order of SHA-256(item id), so the draw never depends on file
order; the manifest records which items were drawn.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
from pathlib import Path

from scripts.common import paths
from scripts.data import bigbench

SUITE = "bigbench_lite"
TASK_PREFIX = "bbl_"
YAML_DIR = paths.EVAL / "tasks" / SUITE
SUITE_DIR = bigbench.DATA / "suite"
# The draw (module docstring); the README gives the items, tokens and run time it comes to.
BYTES_PER_TASK = 90_000
FLOOR = 30
CAP = 1_500
TARGET_ITEMS = 4_000
# Generative items: tokens an answer may take (BIG-bench Lite's answers are one line) and the stop every task shares.
MAX_GEN_TOKS = 48
STOP = "\n"
GEN_BYTES = 4 * MAX_GEN_TOKS  # what a generated answer costs, in bytes of scored text


def cost(item: bigbench.Item) -> int:
    """UTF-8 bytes the engine reads to score the item: the prompt once per choice (or once, plus the answer)."""
    prompt = len(item.prompt.encode())
    if item.multiple_choice:
        return prompt * len(item.choices) + sum(len(c.encode()) for c in item.choices)
    return prompt + GEN_BYTES


def draw_order(item_id: str) -> str:
    return hashlib.sha256(item_id.encode()).hexdigest()


def mean_cost(items: list[bigbench.Item]) -> float:
    return sum(cost(i) for i in items) / len(items)


def draw_sizes(pools: dict[str, list[bigbench.Item]]) -> dict[str, int]:
    """Items per task: FLOOR ≤ n ≤ CAP at about BYTES_PER_TASK each, then the cheapest tasks up to CAP until the
    suite holds TARGET_ITEMS."""
    means = {t: mean_cost(items) for t, items in pools.items()}
    sizes = {t: min(len(pools[t]), max(FLOOR, min(CAP, math.floor(BYTES_PER_TASK / means[t])))) for t in pools}
    for t in sorted(pools, key=means.__getitem__):
        short = TARGET_ITEMS - sum(sizes.values())
        if short <= 0:
            break
        sizes[t] = min(len(pools[t]), CAP, sizes[t] + short)
    return sizes


def draw(items: list[bigbench.Item], n: int) -> list[bigbench.Item]:
    """The first n items in SHA-256 order of their ids."""
    return sorted(items, key=lambda i: draw_order(i.id))[:n]


def doc(item: bigbench.Item) -> dict:
    d = {"id": item.id, "prompt": item.prompt}
    if item.multiple_choice:
        d.update(choices=list(item.choices), scores=list(item.scores),
                 gold=max(range(len(item.scores)), key=item.scores.__getitem__))
    else:
        d.update(targets=list(item.targets), stop_string=item.stop_string, output_regex=item.output_regex)
    return d


def draw_settings() -> dict:
    return {"bytes_per_task": BYTES_PER_TASK, "floor": FLOOR, "cap": CAP, "target_items": TARGET_ITEMS,
            "order": "sha256(item id)", "max_gen_toks": MAX_GEN_TOKS}


def build_suite(data: Path | None = None, out: Path | None = None) -> dict:
    """Write <out>/bbl_<task>.jsonl for every Lite task and <out>/manifest.json; returns the manifest."""
    data = data or bigbench.DATA
    out = out or data / "suite"
    source = bigbench.manifest(data)
    tasks = {}
    tmp = out.with_name(out.name + ".tmp")
    tmp.mkdir(parents=True, exist_ok=True)
    pools = {task: list(bigbench.items(task, data)) for task in bigbench.lite_tasks(data)}
    for task, every in pools.items():
        if not every:
            raise bigbench.BigBenchError(f"BIG-bench task {task} has no examples in {paths.shown(data)}")
        if len({i.multiple_choice for i in every}) != 1:
            raise bigbench.BigBenchError(f"{task} mixes multiple-choice and generative examples")
    sizes = draw_sizes(pools)
    for task, every in pools.items():
        chosen = draw(every, sizes[task])
        lines = [json.dumps(doc(i), ensure_ascii=False) for i in chosen]
        text = "\n".join(lines) + "\n"
        (tmp / f"{TASK_PREFIX}{task}.jsonl").write_text(text)
        tasks[task] = {"kind": "multiple_choice" if chosen[0].multiple_choice else "generate",
                       "preferred_score": chosen[0].preferred_score, "available": len(every), "drawn": len(chosen),
                       "subtasks": sorted({i.subtask for i in chosen if i.subtask}),
                       "scored_bytes": sum(cost(i) for i in chosen),
                       "items_sha256": hashlib.sha256(text.encode()).hexdigest(), "ids": [i.id for i in chosen]}
    manifest = {"suite": SUITE, "sdist": source["sdist"], "sdist_sha256": source["sdist_sha256"],
                "draw": draw_settings(),
                "items": sum(t["drawn"] for t in tasks.values()),
                "sha256": hashlib.sha256("".join(t["items_sha256"] for t in tasks.values()).encode()).hexdigest(),
                "tasks": tasks}
    (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    if out.exists():
        for p in out.iterdir():
            p.unlink()
        out.rmdir()
    os.replace(tmp, out)
    return manifest


def suite_manifest(out: Path | None = None) -> dict:
    """The drawn suite's manifest; a BigBenchError naming `make datasets` when it is missing or stale."""
    path = (out or SUITE_DIR) / "manifest.json"
    if not path.exists():
        raise bigbench.BigBenchError(f"the {SUITE} suite is not built ({paths.shown(path)} missing): run "
                                     f"`{bigbench.FETCH_COMMAND}`")
    m = json.loads(path.read_text())
    if m.get("sdist_sha256") != bigbench.SDIST_SHA256 or m.get("draw") != draw_settings():
        raise bigbench.BigBenchError(f"{paths.shown(path)} was drawn from another sdist or draw: run "
                                     f"`{bigbench.FETCH_COMMAND}`")
    return m


def suite_tasks() -> list[str]:
    """The lm-eval task names of the suite, in BIG-bench Lite's order."""
    return [f"{TASK_PREFIX}{t}" for t in suite_manifest()["tasks"]]


# ---------------------------------------------------------------------------------------------------------- YAML
def task_yaml(task: str, kind: str, suite_dir: Path | None = None) -> str:
    data_file = paths.shown((suite_dir or SUITE_DIR) / f"{TASK_PREFIX}{task}.jsonl")
    head = (f"# BIG-bench Lite task {task}, zero-shot in BIG-bench's own format; written by scripts/data/bigbench_tasks.py "
            f"(do not edit).\n# Items: {data_file} (`make datasets`); version: the sdist's SHA-256.\n"
            f"task: {TASK_PREFIX}{task}\ntag: {SUITE}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
            f"    test: {data_file}\ntest_split: test\nnum_fewshot: 0\ndoc_to_text: prompt\n")
    if kind == "multiple_choice":
        body = ("output_type: multiple_choice\ndoc_to_choice: choices\ndoc_to_target: gold\ntarget_delimiter: \"\"\n"
                "process_results: !function bigbench_utils.process_multiple_choice\nmetric_list:\n"
                "  - metric: multiple_choice_grade\n    aggregation: mean\n    higher_is_better: true\n")
    else:
        body = ("output_type: generate_until\ndoc_to_target: \"{{targets[0]}}\"\ngeneration_kwargs:\n"
                f"  until: [{json.dumps(STOP)}]\n  do_sample: false\n  temperature: 0.0\n  max_gen_toks: {MAX_GEN_TOKS}\n"
                "process_results: !function bigbench_utils.process_generate\nmetric_list:\n"
                "  - metric: exact_str_match\n    aggregation: mean\n    higher_is_better: true\n")
    return head + body + f"metadata:\n  version: \"{bigbench.SDIST_SHA256}\"\n"


def write_yaml(manifest: dict, directory: Path | None = None, suite_dir: Path | None = None) -> list[Path]:
    directory = directory or YAML_DIR
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for task, meta in manifest["tasks"].items():
        path = directory / f"{TASK_PREFIX}{task}.yaml"
        path.write_text(task_yaml(task, meta["kind"], suite_dir))
        written.append(path)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--yaml", action="store_true", help="also rewrite the committed YAMLs under eval/tasks/bigbench_lite")
    p.add_argument("--pip-python", help="the Python whose pip downloads the sdist (make datasets: .venv-datasets)")
    p.add_argument("--sdist", type=Path, help=f"a local copy of {bigbench.SDIST_FILE} instead of the download "
                   f"(make datasets BIGBENCH_SDIST=PATH; its SHA-256 is checked)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        source = bigbench.fetch(sdist=args.sdist, pip_python=args.pip_python)
        print(f"{source['sdist']}: {source['task_files']} task files (sha256 {source['sdist_sha256'][:12]}…) in "
              f"{paths.shown(bigbench.DATA)}")
        m = build_suite(bigbench.DATA, SUITE_DIR)
    except bigbench.BigBenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.yaml:
        write_yaml(m)
    for task, meta in m["tasks"].items():
        print(f"{TASK_PREFIX}{task:38s} {meta['kind']:15s} {meta['drawn']:5d} of {meta['available']:6d}")
    print(f"{SUITE}: {m['items']} items from {m['sdist']} (sha256 {m['sdist_sha256'][:12]}…), suite "
          f"{m['sha256'][:12]}… → {paths.shown(SUITE_DIR)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
