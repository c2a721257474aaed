"""`make optimize BUDGET=tiny` end to end on a checkpoint the test writes (SmolLM2 cut to two decoder layers), as a
user would: registered from a plain folder by `make download MODEL=… NAME=…`, then planned, built, laddered, gated
and reported against the real vLLM and llama-server servers. It runs in a copy of the repository (its code and
Makefile hard-linked, its environments linked, experiments/ and results/ empty) so nothing it writes reaches this
checkout; a second run reuses every step."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest

from scripts.common import paths
from scripts.common.records import all_records
from scripts.optimize.plan import read_plan

pytestmark = pytest.mark.slow
LINKED = ("Makefile", "pyproject.toml", "scripts", "eval", "schemas", "requirements")
ENVS = (".venv", ".venv-quant", ".venv-llamacpp", ".venv-llamaserver")
BASE = "tiny2l"


def two_layer_smollm2(src: Path, out: Path) -> Path:
    """SmolLM2-135M-Instruct with its first two decoder layers: a real model's weights, a user's plain folder."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True)
    config = json.loads((src / "config.json").read_text())
    config["num_hidden_layers"] = 2
    state = {}
    for f in src.glob("*.safetensors"):
        state.update(load_file(f))
    save_file({k: v for k, v in state.items() if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2},
              out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.suffix != ".safetensors" and f.name not in ("config.json", "PROVENANCE.json"):
            shutil.copy2(f, out / f.name)
    return out


@pytest.fixture(scope="module")
def lab(tmp_path_factory, embedded_weights) -> tuple[Path, Path]:
    """(the repository copy, the user's folder)"""
    root = tmp_path_factory.mktemp("lab")
    for name in LINKED:
        subprocess.run(["cp", "-al", str(paths.ROOT / name), str(root / name)], check=True)
    for name in ENVS:
        if (paths.ROOT / name).exists():
            (root / name).symlink_to(paths.ROOT / name)
    for name in ("experiments", "results", "weights"):
        (root / name).mkdir()
    return root, two_layer_smollm2(embedded_weights, tmp_path_factory.mktemp("user") / "my-finetune")


def make(lab: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    return subprocess.run(["make", "--no-print-directory", *args], cwd=lab, env=env, capture_output=True, text=True,
                          check=False, timeout=1500)


def test_optimize_tiny_from_a_plain_folder_to_a_report(lab):
    lab, folder = lab
    before = {f.name: f.stat().st_mtime_ns for f in folder.iterdir()}
    r = make(lab, "download", f"MODEL={folder}", f"NAME={BASE}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (lab / "experiments" / f"{BASE}-bf16" / "config.env").is_file()
    # killed once its ladder has begun (SIGTERM, as a lost machine or Ctrl-C), then the same command goes on
    state = lab / ".cache" / "optimize" / BASE / "state.json"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MAKE")}
    # every run with each rung's server started once, side by side (a GPU's default): the steps measure those
    p = subprocess.Popen(["make", "--no-print-directory", "optimize", f"BASE={BASE}", "BUDGET=tiny", "POOL=1"], cwd=lab, env=env,
                         stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 1200
    while p.poll() is None and time.monotonic() < deadline and not (
            state.is_file() and any(k.startswith("eval-latency:") for k in json.loads(state.read_text())["steps"])):
        time.sleep(1)
    os.killpg(p.pid, signal.SIGTERM)
    p.wait(timeout=120)
    kept = json.loads(state.read_text())["steps"]
    assert any(k.startswith("eval-latency:") for k in kept), kept
    assert not (lab / ".cache" / "optimize" / BASE / "pool" / "pool.json").exists(), "the killed run left its pool"
    r = make(lab, "optimize", f"BASE={BASE}", "BUDGET=tiny", "POOL=1")
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert re.search(r"\[pool\] (\d+) of \1 servers healthy", r.stdout), r.stdout[-3000:]
    logs = (lab / ".cache" / "optimize" / BASE / "logs").glob("*.log")
    assert any("running server of the pool" in f.read_text(errors="replace") for f in logs), "no step used the pool"
    assert not (lab / ".cache" / "optimize" / BASE / "pool" / "pool.json").exists(), "the pool was not stopped"
    for sid in kept:  # every step finished before the kill is reused, none measured again
        assert f"{sid}: reused" in r.stdout, (sid, r.stdout[-2000:])
    assert {f.name: f.stat().st_mtime_ns for f in folder.iterdir()} == before, "the user's folder was modified"

    plan = read_plan(lab / "eval" / "optimize" / f"{BASE}.yaml")
    assert plan.budget == "tiny" and plan.reference == f"{BASE}-bf16" and plan.candidates
    (report,) = sorted((lab / "results").glob(f"optimize_{BASE}_*.md"))
    text = report.read_text()
    assert report.with_suffix(".png").is_file()
    for section in ("## The winner", "## Serve it", "## Every candidate", "## Left out of the plan",
                    "## Wall time per phase"):
        assert section in text, section
    assert re.search(r"\| c=1 \| \S+", text) and re.search(r"\| c=8 \| \S+", text)
    assert f"make serve VARIANT={BASE}-" in text and f"make build VARIANT={BASE}-" in text
    for c in plan.candidates:  # every candidate built, laddered and judged: none failed
        row = next(line for line in text.splitlines() if line.startswith(f"| {c.variant} |"))
        assert any(v in row for v in ("certified", "tie", "rejected", "not certified", "not pursued")), row
        assert "| failed |" not in row, row
    latency = [json.loads(p.read_text()) for p in (lab / "experiments").glob("*/latency_*.json")]
    assert len({r["inputs"]["ladder_id"] for r in latency}) == 1
    for v in (plan.reference, *(c.variant for c in plan.candidates)):  # two rounds each, paired by round
        assert sorted(r["inputs"].get("round") for r in latency if r["variant"] == v) == [1, 2], v
    assert re.search(r"\| \d+\.\d\d \[\d+\.\d\d, \d+\.\d\d\] \|", text), "no ratio with its 95% interval"
    judged = [c for c in plan.candidates if any(
        json.loads(p.read_text()).get("status") == "ok"
        for p in (lab / "experiments" / (c.quality_of or c.variant)).glob("quality_*.json"))]
    assert judged, "no candidate was judged by quality records of its own"
    written = [json.loads(p.read_text()) for kind in ("latency", "quality")
               for p in (lab / "experiments").glob(f"{BASE}-*/{kind}_*.json")]
    assert written and all(w.get("trial") == f"optimize-tiny-{BASE}" for w in written), "a trial record not tagged"
    seen = [r["variant"] for _, r in all_records("quality", lab / "experiments") if r["variant"].startswith(f"{BASE}-")]
    assert not seen, f"make compare and make gate would read the trial's quality records of {seen}"

    r = make(lab, "optimize", f"BASE={BASE}", "POOL=1")  # everything matches: nothing is measured again
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " 0 steps run" in r.stdout or "(0 steps run" in r.stdout, r.stdout[-2000:]
    assert len(list((lab / "results").glob(f"optimize_{BASE}_*.md"))) >= 1
