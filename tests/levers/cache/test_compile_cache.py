"""Pre-baked compile caches: manifest matching, damaged tarballs, phases from a vLLM log (pure logic)."""

from __future__ import annotations

import datetime as dt
import json
import tarfile

import pytest

from scripts.serve import compile_cache as cc

HERE = {"variant": "smollm2-bf16", "serve_config_sha256": "ab" * 32, "vllm": "0.32.0", "torch": "2.13.0+cpu",
        "triton": "absent", "target": "cpu", "arch": "x86_64:avx512f", "device_name": "Xeon",
        "root": "/work/main"}


def manifest(**changes):
    return {"manifest_version": cc.MANIFEST_VERSION, **HERE, **changes}


def test_matching_manifest_is_used():
    assert cc.mismatch(manifest(), HERE) is None


@pytest.mark.parametrize("key,value", [("vllm", "0.26.0"), ("arch", "sm_90"), ("serve_config_sha256", "cd" * 32),
                                       ("variant", "smollm2-int8"), ("torch", "2.11.0"),
                                       ("root", "/app")])
def test_each_factor_that_differs_is_named(key, value):
    why = cc.mismatch(manifest(**{key: value}), HERE)
    assert why is not None and why.startswith(f"{key}:") and value in why


def test_other_gpu_name_of_same_arch_needs_the_shim():
    here = {**HERE, "target": "cuda", "arch": "sm_90", "device_name": "NVIDIA H100 80GB HBM3"}
    baked = manifest(target="cuda", arch="sm_90", device_name="NVIDIA H200")
    assert "LAB_CACHE_SHIM=1" in cc.mismatch(baked, here)
    assert cc.mismatch(baked, here, shim=True) is None
    assert cc.mismatch({**baked, "arch": "sm_80"}, here, shim=True).startswith("arch:")  # never across architectures


def test_truncated_and_foreign_tarballs_are_one_clear_error(tmp_path):
    good = tmp_path / "c.tar.gz"
    (tmp_path / "caches").mkdir()
    (tmp_path / "caches" / "x").write_bytes(b"0" * 100_000)
    cc.pack(tmp_path / "caches", manifest(), good)
    assert cc.read_manifest(good)["variant"] == "smollm2-bf16"
    cut = tmp_path / "cut.tar.gz"
    cut.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(cc.CacheError, match="damaged or truncated"):
        cc.read_manifest(cut)
    foreign = tmp_path / "foreign.tar.gz"
    with tarfile.open(foreign, "w:gz") as tar:
        tar.add(tmp_path / "caches", arcname="caches")
    with pytest.raises(cc.CacheError, match="no manifest.json"):
        cc.read_manifest(foreign)
    with pytest.raises(cc.CacheError, match="does not exist"):
        cc.read_manifest(tmp_path / "missing.tar.gz")
    assert not list(tmp_path.glob(".*.tmp"))


def test_cache_env_points_every_cache_into_the_root(tmp_path):
    cpu = cc.cache_env(tmp_path, "cpu")
    gpu = cc.cache_env(tmp_path, "cuda")
    assert all(v.startswith(str(tmp_path)) for k, v in cpu.items() if k != "TRITON_CACHE_AUTOTUNING")
    assert {"CUDA_CACHE_PATH", "FLASHINFER_WORKSPACE_BASE"} <= set(gpu) and "CUDA_CACHE_PATH" not in cpu


def test_phases_from_a_vllm_log():
    log = "\n".join([
        "(EngineCore pid=1) INFO 11-22 03:14:08 [core.py:133] Initializing a V1 LLM engine (v0.32.0) with config",
        "(Worker pid=2) INFO 11-22 03:14:22 [default_loader.py:501] Loading weights took 0.29 seconds",
        "(Worker pid=2) INFO 11-22 03:14:23 [cpu_model_runner.py:87] Warming up model for the compilation...",
        "(Worker pid=2) INFO 11-22 03:14:30 [backends.py:1] Directly load the compiled graph(s) for compile range "
        "from the cache, took 1.50 s",
        "(Worker pid=2) INFO 11-22 03:14:45 [cpu_model_runner.py:91] Warming up done.",
        "(EngineCore pid=1) INFO 11-22 03:14:47 [core.py:402] init engine (profile, create kv cache, warmup model) "
        "took 25.01 s",
    ])
    start = dt.datetime(2026, 11, 22, 3, 13, 50, tzinfo=dt.UTC)
    p = cc.phases(log, start, 70.0)
    assert p["to_event_s"] == {"engine_start": 18.0, "weights_loaded": 32.0, "compile_start": 33.0,
                               "compile_done": 55.0, "engine_ready": 57.0}
    assert p["reported_s"] == {"weights_load_s": 0.29, "engine_init_s": 25.01, "cache_load_s": 1.5}
    assert p["cache_load_logged"] and not p["recompiled_after_load_failure"]
    json.dumps(p)


# ------------------------------------------------------------------------------------------ device-name shim
class FakeProps:
    def __init__(self, name, major, minor):
        self.name, self.major, self.minor, self.total_memory = name, major, minor, 80 << 30


def test_shim_reports_the_baked_name_on_the_same_architecture():
    from scripts.serve.shim import cache_patch as shim

    get = shim.wrap(lambda i=0: FakeProps("NVIDIA H100 80GB HBM3", 9, 0), "NVIDIA H200", "sm_90")
    props = get(0)
    assert props.name == "NVIDIA H200" and props.total_memory == 80 << 30 and props.major == 9


def test_shim_refuses_across_architectures():
    from scripts.serve.shim import cache_patch as shim

    said = []
    get = shim.wrap(lambda i=0: FakeProps("NVIDIA A10G", 8, 6), "NVIDIA A40", "sm_80", warn=said.append)
    assert get(0).name == "NVIDIA A10G" and get(0).name == "NVIDIA A10G"
    assert len(said) == 1 and "sm_86" in said[0] and "sm_80" in said[0]


def test_shim_is_inert_without_its_variables(monkeypatch):
    from scripts.serve.shim import cache_patch as shim

    monkeypatch.delenv(shim.NAME_VAR, raising=False)
    assert shim.install() is False


def test_shim_env_puts_sitecustomize_on_the_path():
    env = cc.shim_env({"device_name": "NVIDIA H200", "arch": "sm_90"})
    assert env["PYTHONPATH"].split(":")[0].endswith("/scripts/serve/shim")
    assert (cc.paths.ROOT / "scripts" / "serve" / "shim" / "sitecustomize.py").exists()


def test_extraction_without_tarfile_filter_refuses_escapes(tmp_path, monkeypatch):
    """Python < 3.11.4 (Debian bookworm's 3.11.2, the image's) has no extraction filter: members are checked."""
    import io

    monkeypatch.delattr(tarfile, "data_filter", raising=False)
    evil = tmp_path / "evil.tar.gz"
    with tarfile.open(evil, "w:gz") as tar:
        info = tarfile.TarInfo("../outside")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    dest = tmp_path / "dest"
    dest.mkdir()
    with tarfile.open(evil, "r:gz") as tar, pytest.raises(cc.CacheError, match="outside the cache directory"):
        cc.safe_extract(tar, dest)
    assert not (tmp_path / "outside").exists()
