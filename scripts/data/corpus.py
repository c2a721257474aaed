"""Text corpora for parity metrics and calibration, each with a name and a SHA-256 of its exact text.

- `wikitext2`: the Wikitext-2 raw test split, when `make datasets-hub` has cached it (HF datasets, offline read).
- `bigbench-held-out`: the inputs and targets of BIG-bench's held-out tasks (outside BIG-bench Lite and outside
  every calibration; scripts.data.bigbench_corpus), up to 20,000 characters per task, after `make datasets`.
- `cpython-docs`: an offline corpus this project assembles from the running CPython's own documentation strings of a
  fixed list of standard-library modules, plus its license text. Real English technical prose, available everywhere;
  its hash depends on the Python version, which is part of its name.

Calibration never sees evaluated text: parity reads its chunks from the start of a corpus, and offline calibration
samples come only from the cpython-docs text after its first EVAL_FRACTION (measure.parity refuses to read past it).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import platform
import random
import sys
from dataclasses import dataclass
from pathlib import Path

# Fixed order: the corpus must be the same text every time on the same Python.
DOC_MODULES = (
    "abc", "argparse", "asyncio", "base64", "bisect", "calendar", "collections", "contextlib", "copy", "csv",
    "dataclasses", "datetime", "decimal", "difflib", "email", "enum", "fractions", "functools", "gzip", "hashlib",
    "heapq", "html", "http.client", "inspect", "io", "itertools", "json", "logging", "math", "os", "pathlib",
    "pickle", "queue", "random", "re", "shutil", "socket", "sqlite3", "statistics", "string", "subprocess",
    "tarfile", "tempfile", "textwrap", "threading", "time", "typing", "unittest", "urllib.parse", "uuid", "zipfile",
)


# Share of the cpython-docs text, from its start, reserved for evaluation (~23k SmolLM2 tokens; parity's default
# 8192 scored tokens at ctx 512 read the first ~16k).
EVAL_FRACTION = 0.4


class CorpusError(ValueError):
    pass


@dataclass(frozen=True)
class Corpus:
    name: str
    text: str

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.text.encode()).hexdigest()

    def describe(self) -> dict:
        return {"corpus": self.name, "corpus_sha256": self.sha256, "corpus_chars": len(self.text)}


def cpython_docs() -> Corpus:
    import importlib

    parts = []
    for modname in DOC_MODULES:
        mod = importlib.import_module(modname)
        if doc := inspect.getdoc(mod):
            parts.append(doc)
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or getattr(obj, "__module__", None) != mod.__name__:
                continue
            if (inspect.isfunction(obj) or inspect.isclass(obj)) and (doc := inspect.getdoc(obj)) and len(doc) > 200:
                parts.append(doc)
    import builtins

    parts.append(str(builtins.license))  # the license's repr tells how to show it; the text is what we want
    license_text = getattr(builtins.license, "_Printer__lines", None)
    if license_text:
        parts[-1] = "\n".join(license_text)
    return Corpus(name=f"cpython-{platform.python_version()}-docs", text="\n\n".join(parts))


def dataset_cached(path: str, name: str | None = None) -> bool:
    """Whether `make datasets-hub` left this HF dataset in the local datasets cache (checked without the network)."""
    import datasets

    d = Path(datasets.config.HF_DATASETS_CACHE) / path.replace("/", "___")
    return (d / name).is_dir() if name else d.is_dir()


def wikitext2() -> Corpus:
    import datasets

    if not dataset_cached("wikitext", "wikitext-2-raw-v1"):
        raise CorpusError("wikitext2 is not cached; run `make datasets-hub` where the hub is reachable, "
                          "or use --corpus cpython-docs")
    ds = datasets.load_dataset("wikitext", "wikitext-2-raw-v1", split="test")
    return Corpus(name="wikitext-2-raw-v1/test", text="".join(ds["text"]))


def bigbench_held_out() -> Corpus:
    """The text of BIG-bench's held-out tasks (scripts.data.bigbench_corpus): no keep list or estimator ranks or fits
    on it, so a pruned vocabulary's argmax coverage is measured on task families its calibration never saw."""
    from scripts.data import bigbench, bigbench_corpus

    try:
        pairs, info = bigbench_corpus.texts("held_out", 20_000)
    except bigbench.BigBenchError as e:
        raise CorpusError(str(e)) from e
    return Corpus(name=f"bigbench-{bigbench.VERSION}-held-out-tasks", text="\n\n".join(t for _, t in pairs))


CORPORA = {"wikitext2": wikitext2, "cpython-docs": cpython_docs, "bigbench-held-out": bigbench_held_out}


def load_corpus(name: str) -> Corpus:
    """`auto` takes wikitext2 when cached, else the offline cpython-docs corpus."""
    if name == "auto":
        try:
            return wikitext2()
        except CorpusError as e:
            print(f"note: {e}; using cpython-docs", file=sys.stderr)
            return cpython_docs()
    if name not in CORPORA:
        raise CorpusError(f"unknown corpus {name!r}; choose auto, {', '.join(CORPORA)}")
    return CORPORA[name]()


def passages(text: str, min_chars: int) -> list[str]:
    out, cur = [], ""
    for para in text.split("\n\n"):
        cur = f"{cur}\n\n{para}" if cur else para
        if len(cur) >= min_chars:
            out.append(cur)
            cur = ""
    return out


def build_samples(tokenizer, n: int, seq_len: int, *, seed: int = 0, dataset: str | None = None):
    """(datasets.Dataset with a `text` column, provenance dict)."""
    import datasets

    rng = random.Random(seed)
    if dataset:
        rows = datasets.load_dataset(dataset, split="train_sft" if "ultrachat" in dataset else "train")
        idx = rng.sample(range(len(rows)), n)
        chats = [rows[i]["messages"] for i in idx]
        name = dataset
    else:
        corpus = cpython_docs()
        held_out = int(len(corpus.text) * EVAL_FRACTION)  # the evaluated text is never calibrated on
        pool = passages(corpus.text[held_out:], min_chars=seq_len * 3)  # ~4 chars per token: enough to fill seq_len
        if len(pool) < n:
            pool = pool * (n // len(pool) + 1)
        rng.shuffle(pool)
        chats = []
        for p in pool[:n]:
            cut = len(p) // 3
            chats.append([{"role": "user", "content": p[:cut]}, {"role": "assistant", "content": p[cut:]}])
        name = f"{corpus.name} ({corpus.sha256[:12]}), text after the first {EVAL_FRACTION:.0%} (held out for evaluation)"
    if getattr(tokenizer, "chat_template", None):
        texts = [tokenizer.apply_chat_template(c, tokenize=False) for c in chats]
    else:  # a base model (no chat format): the plain text after its <bos>
        texts = [(tokenizer.bos_token or "") + "".join(m["content"] for m in c) for c in chats]
    digest = hashlib.sha256(json.dumps(texts).encode()).hexdigest()
    info = {"corpus": name, "samples": n, "seq_len": seq_len, "seed": seed, "sha256": digest}
    # the texts' own hash as the dataset's fingerprint: datasets would hash the Arrow table with dill, which fails under
    # some Python / dill pairs ("Can't pickle <class 'MonthDayNano'>", Python 3.12 with the GPU bundle's dill)
    import pyarrow as pa

    return datasets.Dataset(pa.table({"text": texts}), fingerprint=digest[:16]), info
