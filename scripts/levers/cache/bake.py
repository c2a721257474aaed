"""Pre-bake a variant's compile caches into cache_import.tar.gz, and measure a cold start against a warm one.

    python -m scripts.levers.cache.bake smollm2-bf16                      # `make bake-cache VARIANT=smollm2-bf16`
    python -m scripts.levers.cache.bake smollm2-bf16 --measure-warm       # + a second start from the packed cache
    python -m scripts.serve smollm2-bf16 --cache cache_import.tar.gz   # `make serve VARIANT=… CACHE=…`

Starts the variant's server with every cache it fills pointed into one empty bake directory (scripts/common/
compile_cache.py: VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR, TRITON_CACHE_DIR with TRITON_CACHE_AUTOTUNING=1, and on a
GPU CUDA_CACHE_PATH and FlashInfer's workspace) — the directory an import of the tarball unpacks into, so
caches that record absolute paths stay valid — waits for /health, sends a warm-up at every batch size 1, 2, 4, …
up to SERVE_MAX_NUM_SEQS (the sizes CUDA graphs are captured for), stops the server cleanly, and packs the directory
with manifest.json: the variant, its serve-config hash (SERVE_*/ENV_* settings and the checkpoint's config.json), the
vLLM / torch / Triton versions, the device (GPU name and sm_XX, or CPU model and ISA flags), vLLM's own
cache_key_factors.json, and the bake's start broken into phases. What keys the caches (vLLM source): its compile cache
hashes vLLM's version, model and compilation config, VLLM_* variables, traced source files and compiler factors
including the device name; inductor's FX-graph cache keys on the device name too; Triton's on the architecture. So a
cache is used only where every factor matches; a different GPU name of the same architecture is the device-name shim's
case (LAB_CACHE_SHIM, scripts/serve/shim/cache_patch.py), not a silent reuse.

--measure-warm then imports the tarball as `make serve` would and starts again; both starts (time to /health and
phases from vLLM's log) go to results/cold-start-<target>-<date>/startup_<variant>_<time>.json.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import datetime as dt
import json
import shutil
import sys
import tempfile
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.hardware import hardware
from scripts.common.loadgen import openai_client
from scripts.common.records import git_state, versions
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.serve.compile_cache import (
    MANIFEST_VERSION,
    CacheError,
    cache_env,
    expected_manifest,
    import_cache,
    key_factors,
    now_stamp,
    pack,
    phases,
    place,
    shim_env,
)
from scripts.serve.launch import make_server


def batch_sizes(max_num_seqs: int) -> list[int]:
    sizes, b = [], 1
    while b < max_num_seqs:
        sizes.append(b)
        b *= 2
    return [*sizes, max_num_seqs]


def warm_up(base_url: str, model: str, max_num_seqs: int) -> list[int]:
    """Short greedy completions, `b` at once for every batch size b: every shape a decode step can take is run."""
    client = openai_client(base_url)
    sizes = batch_sizes(max_num_seqs)
    for b in sizes:
        with cf.ThreadPoolExecutor(b) as ex:
            list(ex.map(lambda i: client.completions.create(model=model, prompt=f"Count to {i + 3}:", max_tokens=8,
                                                            temperature=0), range(b)))
    return sizes


def timed_start(variant, env: dict[str, str], log: Path, port: int, warm: bool) -> tuple[dict, list[int]]:
    """Start the server with `env` added, wait for /health, optionally warm it up, stop it; the start's phases."""
    server = make_server(variant, host="127.0.0.1", port=port, api_key=None, log_path=log)
    server.env.update(env)
    start_wall = dt.datetime.now(dt.UTC)
    server.start()
    sizes: list[int] = []
    try:
        ready = server.wait_healthy()
        if warm:
            sizes = warm_up(server.base_url, variant.served_name, variant.max_num_seqs)
    finally:
        server.stop()
    return {"command": server.argv, "env": env, **phases(log.read_text(errors="replace"), start_wall, ready)}, sizes


def bake(variant_name: str, out: Path, overrides: dict[str, str], port: int, measure_warm: bool,
         device_name: str | None = None) -> Path:
    """device_name: bake through the device-name shim under another GPU name of this architecture (a cache made
    "elsewhere" on one GPU model); the manifest records that name, and --measure-warm imports with the shim."""
    variant = load_variant(variant_name, overrides=overrides)
    target = variant.target
    here = expected_manifest(variant)
    shim = shim_env({**here, "device_name": device_name}) if device_name else {}
    paths.CACHE.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"bake-{variant_name}-", dir=paths.CACHE))  # logs
    home = place(variant)  # baked where it will be imported: caches that record absolute paths stay valid
    shutil.rmtree(home, ignore_errors=True)
    try:
        caches = home / "caches"
        print(f"cold start of {variant_name} with empty caches in {paths.shown(caches)}", flush=True)
        if shim:
            print(f"device-name shim: {here['device_name']} reports itself as {device_name}", flush=True)
        cold, sizes = timed_start(variant, cache_env(caches, target) | shim, work / "cold.log", port, warm=True)
        print(f"  healthy after {cold['ready_s']} s; warmed up at batch sizes {sizes}", flush=True)
        manifest = {"manifest_version": MANIFEST_VERSION, **here, **({"device_name": device_name} if shim else {}),
                    "created_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"), "git": git_state(),
                    "warm_up_batch_sizes": sizes, "vllm_key_factors": key_factors(caches), "bake_start": cold}
        pack(caches, manifest, out)
        shutil.rmtree(home)  # an import unpacks the tarball afresh: the warm start uses only what it carries
        size_mb = out.stat().st_size / 1e6
        print(f"wrote {paths.shown(out)} ({size_mb:.1f} MB)", flush=True)
        if measure_warm:
            env, message = import_cache(out, variant, shim=bool(shim))
            print(message, flush=True)
            if not env:
                raise CacheError(message)
            warm, _ = timed_start(variant, env, work / "warm.log", port, warm=False)
            print(f"  warm start healthy after {warm['ready_s']} s ({warm['ready_s'] / cold['ready_s']:.0%} of cold)")
            record = {"kind": "startup", "variant": variant_name, "config": dict(variant.resolved),
                      **({"baked_as_device": device_name} if shim else {}),
                      "command": ["python", "-m", "scripts.levers.cache.bake", *sys.argv[1:]], "git": git_state(),
                      "versions": versions(), "hardware": hardware(), "cache_tarball_mb": round(size_mb, 1),
                      "manifest": {k: v for k, v in manifest.items() if k != "bake_start"},
                      "cold": cold, "warm": warm, "warm_over_cold": round(warm["ready_s"] / cold["ready_s"], 3)}
            rdir = paths.RESULTS / f"cold-start-{target}-{dt.datetime.now(dt.UTC):%Y%m%d}"
            rdir.mkdir(parents=True, exist_ok=True)
            tag = "_shim" if shim else ""
            rpath = rdir / f"startup_{variant_name}{tag}_{now_stamp()}.json"
            rpath.write_text(json.dumps(record, indent=1) + "\n")
            for name in ("cold.log", "warm.log"):
                shutil.copy(work / name, rdir / f"{variant_name}{tag}-{name}")
            print(f"wrote {paths.shown(rpath)}")
    except BaseException:
        shutil.rmtree(home, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", nargs="?", help="experiments/<variant>/config.env")
    p.add_argument("--out", type=Path, default=Path("cache_import.tar.gz"), help="tarball (default %(default)s)")
    p.add_argument("--measure-warm", action="store_true", help="start again from the packed cache; write both starts")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--port", type=int, default=8127)
    p.add_argument("--device-name", metavar="NAME", help="bake under this GPU name through the device-name shim (same "
                   "architecture; LAB_CACHE_SHIM_NAME/ARCH in the server): the manifest records it, --measure-warm "
                   "imports with the shim")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.variant:
        print("error: which variant? python -m scripts.levers.cache.bake VARIANT (make bake-cache VARIANT=…)", file=sys.stderr)
        return 2
    try:
        bake(args.variant, args.out.resolve(), parse_overrides(args.set), args.port, args.measure_warm,
             args.device_name)
    except (VariantError, CheckpointError, ServerError, CacheError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
