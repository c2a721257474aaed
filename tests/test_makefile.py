"""The Makefile documents itself, and the commands of the README and docs/ point to real targets and files."""

from __future__ import annotations

import re
import subprocess

import pytest

from scripts.common import paths
from tests.test_docs import PAGES


def make_targets() -> set[str]:
    text = (paths.ROOT / "Makefile").read_text()
    return set(re.findall(r"^([a-zA-Z_-]+):", text, flags=re.M))


def test_help_lists_every_phony_target_with_one_line():
    out = subprocess.run(["make", "-s", "help"], cwd=paths.ROOT, capture_output=True, text=True, check=True).stdout
    listed = {line.split()[0] for line in out.splitlines() if line.strip()}
    phony = set(re.search(r"^\.PHONY:(.*)$", (paths.ROOT / "Makefile").read_text(), re.M).group(1).split())
    assert phony <= listed, f"targets without a ## line: {phony - listed}"
    assert all(len(line.split(None, 1)) == 2 for line in out.splitlines() if line.strip())


def test_readme_puts_the_setup_commands_first():
    readme = (paths.ROOT / "README.md").read_text()
    assert readme.index("make serve") < readme.index("make test") < 400, "the two setup commands come first"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(paths.ROOT).as_posix())
def test_page_commands_are_real_targets_and_paths(page):
    """README.md and every docs/ page: each `make X` a target, each path it quotes a file, each VARIANT= a variant."""
    text = page.read_text()
    targets = make_targets()
    for target in re.findall(r"`?make ([a-z][a-z-]+)", text):
        assert target in targets, f"{page.name} names `make {target}`, which the Makefile lacks"
    for path in re.findall(r"`((?:scripts|experiments|tests|requirements|schemas|eval)/[\w./-]+?)(?:::\w+)?`", text):
        assert (paths.ROOT / path.rstrip("/")).exists(), f"{page.name} names {path}, which does not exist"
    for variant in re.findall(r"VARIANT=([a-z0-9.-]+)", text):
        assert (paths.EXPERIMENTS / variant / "config.env").exists(), f"{page.name}: {variant}"


def test_ci_runs_the_readme_test_command():
    assert "make test" in (paths.ROOT / ".ci" / "run").read_text()
