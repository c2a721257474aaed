"""Sweep-file validation and the commands a sweep runs (pure; the real sweep is `make sweep`)."""

from __future__ import annotations

import pytest

from scripts.common import paths
from scripts.levers.quantize import sweep as sw


def write(tmp_path, text):
    p = tmp_path / "s.yaml"
    p.write_text(text)
    return p


def test_shipped_sweep_loads_and_names_real_recipes():
    spec = sw.load_sweep(paths.EVAL / "sweeps" / "smollm2-w4.yaml")
    recipes = {p.stem for p in (paths.ROOT / "scripts" / "levers" / "quantize" / "recipes").glob("*.yaml")}
    assert spec["attempts"] and all(a["recipe"] in recipes for a in spec["attempts"])


@pytest.mark.parametrize("text, message", [
    ("name: x\nvariant: smollm2-awq\n", "missing 'attempts'"),
    ("name: x\nvariant: v\nattempts: [{name: a}]\n", "attempt 0: needs name and recipe"),
    ("name: x\nvariant: v\nattempts: [{name: a, recipe: r, sample: 3}]\n", "unknown \\['sample'\\]"),
    ("name: x\nvariant: v\nattempts: [{name: a, recipe: r}, {name: a, recipe: q}]\n", "'a' repeats"),
])
def test_bad_sweep_files_are_refused(tmp_path, text, message):
    with pytest.raises(sw.SweepError, match=message):
        sw.load_sweep(write(tmp_path, text))


def test_cli_errors_are_one_line(tmp_path, capsys):
    assert sw.main([str(tmp_path / "none.yaml")]) == 1
    assert "no such sweep file" in capsys.readouterr().err
    p = write(tmp_path, "name: x\nvariant: smollm2-awq-mlp\nattempts: [{name: a, recipe: rtn-w4a16-mlp}]\n")
    assert sw.main([str(p), "--only", "b"]) == 1
    assert "unknown attempt(s) b" in capsys.readouterr().err


def test_build_command_passes_calibration_and_overrides(tmp_path):
    a = {"name": "g32", "recipe": "awq-w4a16-mlp", "samples": 64, "seq_len": 256, "set": ["weights.group_size=32"]}
    cmd = sw.build_command(a, "weights/SmolLM2-135M-Instruct", paths.WEIGHTS / "sweep" / "s" / "g32")
    assert cmd[1:] == ["-m", "scripts.levers.quantize.calibrate", "awq-w4a16-mlp", "--model",
                       "weights/SmolLM2-135M-Instruct", "--out", "weights/sweep/s/g32", "--samples", "64",
                       "--seq-len", "256", "--set", "weights.group_size=32"]
