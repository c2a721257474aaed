"""Hash the pip locks: each `name==version` pin gets the SHA-256 of every file of its release, in pip's hash-checking
format, so `pip install --require-hashes` installs those files and nothing else.

    python -m scripts.image.locks                          # make hash-locks: every requirements/*.txt, in place
    python -m scripts.image.locks requirements/cpu.txt     # one lock (make lock / make lock-quant do this after freeze)
    python -m scripts.image.locks --check                  # no network: exit 1 naming every pin without hashes
    python -m scripts.image.locks requirements/cuda.txt --report deps.json   # make lock-cuda: pins from pip's report

A pin is written as
    name==version \\
        --hash=sha256:<one line per file of the release>
Hashes come from PyPI's JSON API (https://pypi.org/pypi/<name>/<version>/json; where that answers 404, the project's
https://pypi.org/pypi/<name>/json and its releases): every wheel and the sdist, so the lock installs on other
platforms too. A release PyPI lacks (torch==2.13.0+cpu: local versions are not on PyPI) is hashed from its files in
pip's find-links folders (`pip config list`, PIP_FIND_LINKS). Existing hashes are replaced; the header, comments and
order are kept. A pin with no file found, or a requirement not pinned with ==, is a one-line error (exit 2) and
nothing is written; otherwise the lock is written to a temporary file and renamed over it.

--report FILE (repeatable): replace the lock's pins by the packages of pip installation reports (`pip install
--dry-run --ignore-installed --report FILE`), sorted as pip freeze sorts, then hash them.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import hashlib
import json
import os
import re
import shutil
import ssl
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.image.build import PIN, normalize, pip_config_lines, pip_sources

LOCK_DIR = paths.ROOT / "requirements"
PYPI = "https://pypi.org/pypi"
INDENT = "    "
FETCH_THREADS = 8

# url -> parsed JSON, or None when the server answers 404
Fetch = Callable[[str], dict | None]


class LockError(RuntimeError):
    """A lock that cannot be hashed or read; the message is one line."""


@dataclass
class Pin:
    """One `name[extras]==version` requirement of a lock, with the comment that followed it on its line."""

    name: str
    extras: str
    version: str
    comment: str = ""
    hashes: list[str] = field(default_factory=list)

    @property
    def spec(self) -> str:
        return f"{self.name}{self.extras}=={self.version}"

    def lines(self) -> list[str]:
        head = [f"# {self.comment}"] if self.comment else []  # pip reads no comment inside a continued line
        if not self.hashes:
            return [*head, self.spec]
        return [*head, f"{self.spec} \\", *[f"{INDENT}--hash=sha256:{h} \\" for h in self.hashes[:-1]],
                f"{INDENT}--hash=sha256:{self.hashes[-1]}"]


# ------------------------------------------------------------------------------------------------- pure logic
def parse(text: str) -> list[str | Pin]:
    """A lock -> its lines: comments and blank lines as they are, each requirement (continued lines joined) a Pin.
    A requirement that is not `name[extras]==version` (what --require-hashes needs) is a LockError."""
    out: list[str | Pin] = []
    pending = ""
    for raw in text.splitlines():
        raw = raw.rstrip()
        if not pending and (not raw.strip() or raw.strip().startswith("#")):
            out.append(raw)
            continue
        if raw.endswith("\\"):
            pending += " " + raw[:-1]
            continue
        line, pending = pending + " " + raw, ""
        comment = ""
        if m := re.search(r"(?:^|\s)#\s?(.*)$", line):  # pip: a comment starts at a # after whitespace
            line, comment = line[: m.start()], m.group(1).strip()
        hashes = re.findall(r"--hash=sha256:([0-9a-f]{64})", line)
        spec = re.sub(r"\s--hash=\S+", "", " " + line).strip()
        m = PIN.fullmatch(spec)
        if not m:
            raise LockError(f"{spec!r} is not pinned as name==version (--require-hashes needs every requirement so)")
        out.append(Pin(m.group(1), m.group(2) or "", m.group(3), comment, hashes))
    if pending:
        raise LockError(f"the last line ends with a backslash: {pending.strip()[:80]!r}")
    return out


def render(items: Iterable[str | Pin]) -> str:
    lines: list[str] = []
    for item in items:
        lines += item.lines() if isinstance(item, Pin) else [item]
    return "\n".join(lines) + "\n"


def unhashed(text: str) -> list[str]:
    """The pins of a lock that carry no --hash (a lock pip's --require-hashes would refuse)."""
    return [item.spec for item in parse(text) if isinstance(item, Pin) and not item.hashes]


def canonical_version(version: str) -> str:
    """Enough of PEP 440's normalization to find a pip-freeze version among PyPI's release keys (1.0 == 1.0.0)."""
    v = version.strip().lower().removeprefix("v").replace("_", ".").replace("-", ".")
    m = re.match(r"^(\d+(?:\.\d+)*)(.*)$", v)
    return (re.sub(r"(\.0+)+$", "", m.group(1)) + m.group(2)) if m else v


def release_hashes(doc: dict, version: str) -> list[str] | None:
    """SHA-256 of every file of `version` in a PyPI JSON document (a release's: `urls`; a project's: `releases`);
    None when the document has no such release."""
    if "releases" in doc:
        want = canonical_version(version)
        files = next((f for v, f in doc["releases"].items() if v == version or canonical_version(v) == want), None)
    else:
        files = doc.get("urls")
    if not files:
        return None
    return sorted({f["digests"]["sha256"] for f in files})


def pypi_hashes(name: str, version: str, fetch: Fetch, index: str = PYPI) -> list[str] | None:
    """Hashes of a release on PyPI; None when PyPI has no such release."""
    name = normalize(name)  # PyPI's own spelling of the project (lm_eval -> lm-eval), no redirect needed
    doc = fetch(f"{index}/{name}/{version}/json")
    found = release_hashes(doc, version) if doc else None
    if found is None:
        doc = fetch(f"{index}/{name}/json")
        found = release_hashes(doc, version) if doc else None
    return found


def dist_name_version(filename: str) -> tuple[str, str] | None:
    """(name, version) of a wheel or sdist file name; None for anything else."""
    if filename.endswith(".whl"):
        parts = filename[:-4].split("-")
        return (parts[0], parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
        if filename.endswith(ext) and "-" in filename:
            name, _, version = filename[: -len(ext)].rpartition("-")
            return name, version
    return None


def local_files(name: str, version: str, folders: Iterable[Path]) -> list[Path]:
    """The files of name==version in find-links folders."""
    want = (normalize(name), canonical_version(version))
    out = []
    for folder in folders:
        for f in sorted(Path(folder).glob("*")) if Path(folder).is_dir() else []:
            nv = dist_name_version(f.name)
            if nv and (normalize(nv[0]), canonical_version(nv[1])) == want:
                out.append(f)
    return out


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def rewrite(text: str, lookup: Callable[[str, str], list[str] | None]) -> str:
    """The lock with each pin's hashes replaced by lookup(name, version); every pin without any is named in one
    LockError (nothing is returned then)."""
    items = parse(text)
    pins = [item for item in items if isinstance(item, Pin)]
    with cf.ThreadPoolExecutor(FETCH_THREADS) as pool:
        found = list(pool.map(lambda p: lookup(p.name, p.version), pins))
    missing = [p.spec for p, h in zip(pins, found, strict=True) if not h]
    if missing:
        raise LockError(f"no file found on PyPI or in pip's find-links for {', '.join(missing)}")
    for pin, hashes in zip(pins, found, strict=True):
        pin.hashes = sorted(set(hashes))
    return render(items)


def report_pins(reports: Iterable[dict]) -> list[Pin]:
    """The packages pip installation reports would install, as pins sorted the way pip freeze sorts them."""
    seen: dict[str, Pin] = {}
    for report in reports:
        for entry in report.get("install", []):
            meta = entry["metadata"]
            seen[normalize(meta["name"])] = Pin(meta["name"], "", meta["version"])
    return sorted(seen.values(), key=lambda p: p.name.lower())


def with_pins(text: str, pins: list[Pin]) -> str:
    """The lock's header (everything up to its first blank line) followed by `pins`."""
    lines = text.splitlines()
    head = lines[: lines.index("") + 1] if "" in lines else []
    return render([*head, *pins])


# ------------------------------------------------------------------------------------------------- network, files
def ssl_context(cafile: str | None) -> ssl.SSLContext:
    """TLS for PyPI: pip's configured certificate bundle where there is one (pip_sources' `cert`), else the system's."""
    return ssl.create_default_context(cafile=cafile) if cafile else ssl.create_default_context()


def https_fetch(cafile: str | None, timeout: float = 60.0) -> Fetch:
    context = ssl_context(cafile)

    def fetch(url: str) -> dict | None:
        req = urllib.request.Request(url, headers={"Accept": "application/json", "User-Agent": "variant-lab-locks"})
        try:
            with urllib.request.urlopen(req, timeout=timeout, context=context) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            if e.code == 404:
                return None
            raise LockError(f"{url}: HTTP {e.code}") from None
        except (urllib.error.URLError, OSError) as e:
            raise LockError(f"{url}: {getattr(e, 'reason', e)}") from None

    return fetch


def lookup_from(fetch: Fetch, folders: list[Path]) -> Callable[[str, str], list[str] | None]:
    def lookup(name: str, version: str) -> list[str] | None:
        found = pypi_hashes(name, version, fetch)
        if found is None:
            found = [sha256_of(f) for f in local_files(name, version, folders)] or None
        return found

    return lookup


def fetch_sdists(lock: Path, dest: Path, fetch: Fetch, cafile: str | None = None, index: str = PYPI) -> list[Path]:
    """Download the sdist of every pin of a hashed lock into dest, each checked against the lock's hashes (a file
    whose SHA-256 the lock does not list is removed and refused). For sources pip must not build itself: `pip download`
    of an sdist prepares its metadata, building its build requirements from source too under --no-binary."""
    out = []
    context = ssl_context(cafile)
    for pin in (i for i in parse(lock.read_text()) if isinstance(i, Pin)):
        if not pin.hashes:
            raise LockError(f"{paths.shown(lock)}: {pin.spec} has no hashes: make hash-locks")
        url = f"{index}/{normalize(pin.name)}/{pin.version}/json"
        files = (fetch(url) or {}).get("urls")
        if not files:  # the project's document, where the release's own answers 404 (as pypi_hashes)
            url = f"{index}/{normalize(pin.name)}/json"
            releases = (fetch(url) or {}).get("releases", {})
            files = next((f for v, f in releases.items() if canonical_version(v) == canonical_version(pin.version)), [])
        sdist = next((f for f in files if f.get("packagetype") == "sdist"), None)
        if sdist is None:
            raise LockError(f"{pin.spec}: PyPI lists no sdist")
        target = dest / sdist["filename"]
        source = urllib.parse.urljoin(url, sdist["url"])  # an index may answer with relative file addresses
        with urllib.request.urlopen(source, timeout=600, context=context) as r, open(target, "wb") as f:
            shutil.copyfileobj(r, f)
        if (digest := sha256_of(target)) not in pin.hashes:
            target.unlink()
            raise LockError(f"{sdist['filename']}: SHA-256 {digest} is not in {paths.shown(lock)}")
        out.append(target)
    return out


def write_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def default_locks() -> list[Path]:
    return sorted(LOCK_DIR.glob("*.txt"))


# ------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("locks", nargs="*", type=Path, help="lock files (default: every requirements/*.txt)")
    p.add_argument("--check", action="store_true", help="only report pins without hashes (no network); exit 1 if any")
    p.add_argument("--fetch-sdists", type=Path, metavar="DIR",
                   help="download the sdist of every pin of the one lock named into DIR, checked against its hashes")
    p.add_argument("--report", action="append", type=Path, default=[],
                   help="pip installation report (pip install --dry-run --report): its packages become the pins")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    locks = args.locks or default_locks()
    try:
        if args.report and len(locks) != 1:
            raise LockError("--report writes one lock: name it")
        if args.check:
            bad = {paths.shown(lock): unhashed(lock.read_text()) for lock in locks}
            bad = {k: v for k, v in bad.items() if v}
            for lock, pins in bad.items():
                print(f"{lock}: {len(pins)} pins without hashes: {', '.join(pins[:8])}{' …' if len(pins) > 8 else ''}")
            return 1 if bad else 0
        sources = pip_sources(pip_config_lines(), dict(os.environ))
        cafile = next(iter(sources["cert"]), None)
        if args.fetch_sdists:
            if len(locks) != 1:
                raise LockError("--fetch-sdists reads one lock: name it")
            for path in fetch_sdists(locks[0], args.fetch_sdists, https_fetch(cafile), cafile):
                print(f"{paths.shown(path)}: SHA-256 matches {paths.shown(locks[0])}")
            return 0
        folders = [Path(v.removeprefix("file://")) for v in sources["find-links"] if v.startswith(("/", "file://"))]
        lookup = lookup_from(https_fetch(cafile), folders)
        texts = {}
        for lock in locks:
            text = lock.read_text()
            if args.report:
                text = with_pins(text, report_pins(json.loads(r.read_text()) for r in args.report))
            texts[lock] = rewrite(text, lookup)  # every lock is hashed before any is written
        for lock, text in texts.items():
            write_atomic(lock, text)
            print(f"{paths.shown(lock)}: {sum(isinstance(i, Pin) for i in parse(text))} pins hashed")
    except (LockError, OSError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
