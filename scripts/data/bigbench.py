"""BIG-bench, offline: the task JSON that the PyPI source distribution `bigbench` 1.0.0 ships, and its prompt format.

    from scripts.data import bigbench
    bigbench.fetch()                          # `make datasets`: pip download, SHA-256 check, extract, manifest
    bigbench.lite_tasks()                     # the 24 BIG-bench Lite task names, read from the sdist itself
    for item in bigbench.items("winowhy"):    # formatted zero-shot items with stable ids
        item.id, item.prompt, item.choices, item.scores, item.targets

The sdist is never installed (its dependencies are an old TensorFlow stack): pip only downloads it, its hash is
checked against SDIST_SHA256, and every task.json plus bigbench/bbseqio/bigbench_lite.py is extracted under
DATA (1,041 task files, 1.7 GB), with a manifest naming the sdist and its hash. Readers of other tasks (calibration,
keep lists, distillation corpora) must call `refuse_evaluation` so BIG-bench Lite never enters them.

Prompt format: BIG-bench's own `default_format_fn` + `task_prefix` (bigbench/api/json_task.py) at zero shots: the
task's `task_prefix`, then `example_input_prefix` + input (+ `choice_prefix` and the choices in the order a
RandomState(42) permutation of the sorted choices gives, where `append_choices_to_input`), then
`example_output_prefix`; a choice or target is scored right after that, with no separator.
"""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import sha256_file

VERSION = "1.0.0"
SDIST = f"bigbench=={VERSION}"
SDIST_FILE = f"bigbench-{VERSION}.tar.gz"
SDIST_SHA256 = "1bb398a5512c6d798cdebe0dfa0ac03f67f6033fa6b39c6ef71df978c7cbc5c2"
DATA = paths.CACHE / "datasets" / f"bigbench-{VERSION}"
TASKS_MEMBER = "bigbench/benchmark_tasks/"
LITE_MEMBER = "bigbench/bbseqio/bigbench_lite.py"
LITE_VERSION = "bigbench_lite_v1"
FETCH_COMMAND = "make datasets"
# BIG-bench's defaults where a task.json leaves a field out (bigbench/api/json_task.py)
DEFAULT_INPUT_PREFIX = "\nQ: "
DEFAULT_OUTPUT_PREFIX = "\nA: "
DEFAULT_CHOICE_PREFIX = "\n  choice: "
CHOICE_SEED = 42  # JsonTask's random_seed: each example's choices are permuted by a fresh RandomState(42)


class BigBenchError(RuntimeError):
    """One line, ready to print."""


@dataclass(frozen=True)
class Item:
    task: str
    subtask: str  # "" for a task without subtasks
    index: int  # position in the (sub)task's examples list
    prompt: str
    choices: tuple[str, ...]  # multiple choice: in the task's own order; () for a generative item
    scores: tuple[float, ...]  # target_scores of the choices
    targets: tuple[str, ...]  # generative: the accepted answers
    preferred_score: str
    stop_string: str | None = None  # generative post-processing, as the task.json sets it
    output_regex: str | None = None

    @property
    def id(self) -> str:
        return f"{self.task}/{self.subtask}/{self.index}" if self.subtask else f"{self.task}/{self.index}"

    @property
    def multiple_choice(self) -> bool:
        return bool(self.choices)


# ---------------------------------------------------------------------------------------------------------- fetch
def manifest(data: Path | None = None) -> dict:
    """The extraction's manifest, or a BigBenchError naming the command that writes it."""
    data = data or DATA
    path = data / "manifest.json"
    if not path.exists():
        raise BigBenchError(f"BIG-bench task data is not cached ({paths.shown(data)}): run `{FETCH_COMMAND}`")
    m = json.loads(path.read_text())
    if m.get("sdist_sha256") != SDIST_SHA256:
        raise BigBenchError(f"{paths.shown(data)} was extracted from another sdist ({m.get('sdist_sha256', '?')[:12]}); "
                            f"delete it and run `{FETCH_COMMAND}`")
    return m


def download_sdist(dest: Path, pip_python: str | None = None) -> Path:
    """pip download of the sdist (no dependencies, never installed) into dest by the pip of `pip_python` (pip 26.3
    refuses this sdist: requirements/datasets.txt); one-line error without an index."""
    r = subprocess.run([pip_python or sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", SDIST,
                        "-d", str(dest)],
                       capture_output=True, text=True, check=False)
    path = dest / SDIST_FILE
    if r.returncode != 0 or not path.exists():
        last = next((ln for ln in reversed(r.stderr.strip().splitlines()) if ln.strip()), "no output")
        raise BigBenchError(f"cannot download {SDIST} from the package index ({last.strip()[:160]}); run "
                            f"`{FETCH_COMMAND}` where PyPI offers it, or `{FETCH_COMMAND} BIGBENCH_SDIST=PATH` with "
                            f"a copy of {SDIST_FILE} (SHA-256 {SDIST_SHA256[:16]}…)")
    return path


def extract(sdist: Path, dest: Path) -> dict:
    """task.json files and the Lite list from the sdist into dest; returns the manifest (not yet written)."""
    files = {}
    with tarfile.open(sdist, "r:gz") as tar:
        for member in tar:
            name = member.name.split("/", 1)[1] if "/" in member.name else member.name
            keep = (name.startswith(TASKS_MEMBER) and name.endswith("/task.json")) or name == LITE_MEMBER
            if not keep or not member.isfile():
                continue
            rel = name[len(TASKS_MEMBER):] if name.startswith(TASKS_MEMBER) else Path(name).name
            target = dest / ("tasks" if name.startswith(TASKS_MEMBER) else "") / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            with tar.extractfile(member) as src, open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            files[str(target.relative_to(dest))] = member.size
    task_files = sorted(f for f in files if f.startswith("tasks/"))
    if not task_files or Path(LITE_MEMBER).name not in files:
        raise BigBenchError(f"{sdist.name} holds no BIG-bench task JSON: not the expected sdist")
    return {"sdist": SDIST, "sdist_file": SDIST_FILE, "sdist_sha256": SDIST_SHA256, "task_files": len(task_files),
            "bytes": sum(files.values()), "lite": lite_tasks(dest)}


def fetch(data: Path | None = None, sdist: Path | None = None, pip_python: str | None = None) -> dict:
    """Download (or take `sdist`), check, extract into a temp dir beside `data`, then rename: never half-written."""
    data = data or DATA
    try:
        return manifest(data)
    except BigBenchError:
        pass
    if sdist is not None and not sdist.is_file():
        raise BigBenchError(f"{sdist}: no such file (a copy of {SDIST_FILE}: BIGBENCH_SDIST=PATH)")
    data.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=data.parent, prefix=".bigbench-") as tmp:
        tmp = Path(tmp)
        src = sdist or download_sdist(tmp, pip_python)
        got = sha256_file(src)
        if got != SDIST_SHA256:
            raise BigBenchError(f"{src.name} has SHA-256 {got[:16]}…, expected {SDIST_SHA256[:16]}… ({SDIST}); "
                                f"refusing to extract it")
        out = tmp / "extract"
        m = extract(src, out)
        (out / "manifest.json").write_text(json.dumps(m, indent=1) + "\n")
        if data.exists():
            shutil.rmtree(data)
        os.replace(out, data)
    return m


# ---------------------------------------------------------------------------------------------------------- read
def lite_tasks(data: Path | None = None) -> list[str]:
    """BIG-bench Lite's task names as the sdist's bigbench_lite.py defines them."""
    path = (data or DATA) / Path(LITE_MEMBER).name
    if not path.exists():
        raise BigBenchError(f"{paths.shown(path)} missing: run `{FETCH_COMMAND}`")
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "BIGBENCH_LITE_TASK_NAMES" for t in node.targets):
            return list(ast.literal_eval(node.value)[LITE_VERSION])
    raise BigBenchError(f"{paths.shown(path)} defines no BIGBENCH_LITE_TASK_NAMES")


def task_files(task: str, data: Path | None = None) -> list[tuple[str, Path]]:
    """(subtask, task.json) of a task, subtasks in name order; a task.json that only lists subtasks is left out."""
    data = data or DATA
    root = data / "tasks" / task
    if not (root / "task.json").exists():
        manifest(data)  # names `make datasets` if nothing is cached at all
        raise BigBenchError(f"BIG-bench task {task!r} is not in {paths.shown(data)}: check the name, or run "
                            f"`{FETCH_COMMAND}`")
    subs = sorted(p for p in root.glob("*/task.json"))
    return [(p.parent.name, p) for p in subs] if subs else [("", root / "task.json")]


def refuse_evaluation(task: str, data: Path | None = None) -> None:
    """Raise when `task` belongs to the evaluation suite: calibration, keep lists and distillation never read it."""
    if task.split("/")[0] in lite_tasks(data):
        raise BigBenchError(f"BIG-bench task {task!r} is in BIG-bench Lite, the evaluation suite: it never enters a "
                            f"calibration, keep-list or distillation corpus")


def choice_order(choices: list[str]) -> list[str]:
    """The order BIG-bench appends choices to the input: RandomState(42).permutation(sorted(choices))."""
    import numpy as np

    return [str(c) for c in np.random.RandomState(seed=CHOICE_SEED).permutation(sorted(choices))]


def format_example(spec: dict, example: dict) -> tuple[str, tuple[str, ...], tuple[float, ...], tuple[str, ...]]:
    """(prompt, choices, scores, targets) of one example, zero-shot, in BIG-bench's own format."""
    text = example["input"]
    choices, scores = (), ()
    if "target_scores" in example:
        choices = tuple(example["target_scores"])
        scores = tuple(float(v) for v in example["target_scores"].values())
        if spec.get("append_choices_to_input", True):
            prefix = spec.get("choice_prefix", DEFAULT_CHOICE_PREFIX)
            text = text + prefix + prefix.join(choice_order(list(choices)))
    target = example.get("target", ())
    targets = tuple(str(t) for t in (target if isinstance(target, list) else [target]))
    prompt = (str(spec.get("task_prefix", "")) + spec.get("example_input_prefix", DEFAULT_INPUT_PREFIX) + text
              + spec.get("example_output_prefix", DEFAULT_OUTPUT_PREFIX))
    return prompt, choices, scores, targets


def items(task: str, data: Path | None = None) -> Iterator[Item]:
    """Every distinct example of a task (all subtasks), formatted; duplicates dropped as BIG-bench drops them."""
    for subtask, path in task_files(task, data):
        spec = json.loads(path.read_text())
        seen = set()
        for index, example in enumerate(spec.get("examples", [])):
            key = json.dumps(example)
            if key in seen:
                continue
            seen.add(key)
            prompt, choices, scores, targets = format_example(spec, example)
            yield Item(task, subtask, index, prompt, choices, scores, targets, str(spec.get("preferred_score", "")),
                       spec.get("stop_string"), spec.get("output_regex"))
