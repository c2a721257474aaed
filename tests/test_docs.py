"""README.md is a product page, and every page under docs/ points only at what exists.

Every relative link in README.md and docs/*.md resolves to a file or folder of the checkout; every record a page names
(`experiments/<variant>/<record>.json`, a path under results/) exists; README.md stays within MAX_README_LINES.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from scripts.common import paths

MAX_README_LINES = 250
PAGES = [paths.ROOT / "README.md", *sorted((paths.ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")
# A record path as pages write it, up to the first character that cannot be part of one.
RECORD = re.compile(r"(?<![\w/.-])((?:experiments|results)/[^\s`'\"()\[\]|,;]+)")
PLACEHOLDER = set("*…<>{}?")  # a pattern or a placeholder (`experiments/<variant>/`), not one path


def broken_links(page: Path, root: Path) -> list[str]:
    """Relative link targets of `page` (anchors dropped) that name nothing under `root`."""
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue  # a URL or an anchor on the same page
        path = (page.parent / target.split("#", 1)[0]).resolve()
        if not path.exists() or not path.is_relative_to(root.resolve()):
            bad.append(target)
    return bad


def missing_records(page: Path, root: Path) -> list[str]:
    """Paths under experiments/ or results/ that `page` names and the checkout lacks."""
    bad = []
    for name in RECORD.findall(page.read_text()):
        name = name.rstrip(".:")
        if PLACEHOLDER & set(name) or name.endswith("/…"):
            continue
        if name.startswith("experiments/") and name.count("/") < 2 and not name.endswith("/"):
            continue  # prose such as "experiments/<variant>" cut at a placeholder
        if not (root / name.rstrip("/")).exists():
            bad.append(name)
    return bad


def test_readme_is_a_short_page():
    lines = len((paths.ROOT / "README.md").read_text().splitlines())
    assert lines <= MAX_README_LINES, f"README.md has {lines} lines; the narratives belong in docs/"


def test_every_lever_and_concern_has_a_page():
    for topic in ("quantize", "vocab", "speculate", "cache", "lora", "gguf", "serving", "gate", "scale",
                  "reliability", "image", "gpu", "commands"):
        assert (paths.ROOT / "docs" / f"{topic}.md").exists(), topic


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(paths.ROOT).as_posix())
def test_links_resolve(page):
    assert broken_links(page, paths.ROOT) == [], f"{page.name} links to missing files"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(paths.ROOT).as_posix())
def test_named_records_exist(page):
    assert missing_records(page, paths.ROOT) == [], f"{page.name} names records that do not exist"


def test_a_broken_link_and_a_missing_record_are_caught(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "experiments/v").mkdir(parents=True)
    (tmp_path / "experiments/v/latency_1.json").write_text("{}")
    page = tmp_path / "docs/x.md"
    page.write_text("[ok](../experiments/v/latency_1.json) [gone](../experiments/v/latency_2.json#a) "
                    "[web](https://example.org) [here](#top) [out](../../etc)\n"
                    "`experiments/v/latency_1.json`, `experiments/v/quality_9.json`. `results/r/` "
                    "`experiments/<variant>/latency_*.json`\n")
    assert broken_links(page, tmp_path) == ["../experiments/v/latency_2.json#a", "../../etc"]
    assert missing_records(page, tmp_path) == ["experiments/v/quality_9.json", "results/r/"]
