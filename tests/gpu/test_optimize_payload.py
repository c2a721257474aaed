"""scripts/gpu/optimize-payload.sh: the GPU payload's wheels pinned by the locks, and bad input refused in one line
(no download: DRY=1 and the argument checks come first)."""

from __future__ import annotations

import re
import subprocess

from scripts.common import paths

SCRIPT = paths.ROOT / "scripts" / "gpu" / "optimize-payload.sh"


def run(*args: str, dry: bool = True) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", **({"DRY": "1"} if dry else {})}
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=60,
                          check=False)


def lock_pins(lock: str) -> dict[str, str]:
    text = (paths.ROOT / "requirements" / lock).read_text()
    return {re.sub(r"[-_.]+", "-", m[1].lower()): m[2] for m in re.finditer(r"^([A-Za-z0-9_.-]+)==(\S+)", text, re.M)}


def test_every_wheel_is_the_locks_pin(tmp_path):
    r = run(str(tmp_path / "out"))
    assert r.returncode == 0, r.stderr
    sections, current = {}, None
    for line in r.stdout.splitlines():
        if line.endswith(":"):
            current = sections.setdefault(line[:-1], [])
        else:
            current.append(line)
    assert set(sections) == {"whl", "first", "quant"}
    for section, lock in (("whl", "cuda.txt"), ("first", "cuda.txt"), ("quant", "quant.txt")):
        pins = lock_pins(lock)
        for req in sections[section]:
            name, version = req.split("==")
            assert pins[re.sub(r"[-_.]+", "-", name.lower())] == version, (section, req)
    assert "lm_eval==0.4.13" in sections["whl"] and sections["first"] == ["transformers==5.24.0"]
    assert not (tmp_path / "out").exists(), "DRY=1 writes nothing"


def test_a_user_model_folder_without_a_config_is_refused_in_one_line(tmp_path):
    (tmp_path / "model").mkdir()
    r = run(str(tmp_path / "out"), str(tmp_path / "model"), dry=False)
    assert r.returncode == 1 and r.stderr.strip().count("\n") == 0
    assert r.stderr.startswith(f"error: {tmp_path / 'model'}: no config.json")
    assert not (tmp_path / "out").exists(), "nothing half-written"
