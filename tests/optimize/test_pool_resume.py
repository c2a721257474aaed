"""make optimize's pool on a resumed run (scripts/optimize/run.py): the servers started are those still needed, the
rungs with a ladder round left to measure, and a variant a later step asks for joins the running pool with the
reference it is compared against. The pool's start is faked (pure logic: which servers, in which starts)."""

from __future__ import annotations

import pytest

from scripts.optimize import run
from scripts.optimize.plan import Plan

RUNGS = ["x-bf16", "x-a", "x-b", "x-c"]


class FakePool:
    starts: list[list[str]] = []

    def __init__(self, folder):
        self.servers, self.failed, self.file = {}, {}, folder / "pool.json"

    def start(self, variants):
        names = [v.name for v in variants]
        FakePool.starts.append(names)
        self.servers.update(dict.fromkeys(names))
        return self


@pytest.fixture
def runner(monkeypatch, tmp_path):
    FakePool.starts = []
    monkeypatch.setattr(run, "Pool", FakePool)
    monkeypatch.setattr(run, "make_weights", lambda v, log: None)
    # every rung's reference is the BF16 one but x-c's, which stacks on x-b
    monkeypatch.setattr(run, "load_variant", lambda v: type("V", (), {
        "name": v, "resolved": {"PARENT": "x-b" if v == "x-c" else "x-bf16"}})())
    monkeypatch.setattr(run.Runner, "step_key", lambda self, phase, target, v, args=(), extra_key="", tag="":
                        (f"{target}:{v}{tag}", "same-inputs"))
    # x-bf16 and x-a measured in all three rounds before the machine was taken back, x-b in the first round only
    done = {"key": "same-inputs", "status": "ok", "record": None}
    steps = {f"eval-latency:{v}#r{k}": dict(done) for v in ("x-bf16", "x-a") for k in (1, 2, 3)}
    steps["eval-latency:x-b#r1"] = dict(done)
    r = run.Runner(Plan("x", "x-bf16", "normal", [1, 8], None, "gpu", [], []), run.State(tmp_path / "state.json", steps),
                   "gpu", tmp_path / "logs", gpu=True)
    r.pool_rungs = list(RUNGS)
    return r


def test_the_ladder_pools_only_the_rungs_with_a_round_to_measure(runner, monkeypatch):
    measured = []

    def step(phase, target, variant, args=(), extra_key="", records=None, tag=""):
        sid, key = runner.step_key(phase, target, variant, args, extra_key, tag)
        if runner.reusable(phase, sid, key, variant) is None:
            runner.pooled(phase, variant)
            measured.append(f"{variant}{tag}")
        return {"status": "ok", "record": None}

    monkeypatch.setattr(runner, "step", step)
    run.ladder(runner, RUNGS)
    assert runner.pending == {"x-b", "x-c"}
    assert FakePool.starts == [["x-b", "x-c"]], "one start, side by side, of the two rungs still to measure"
    assert sorted(measured) == ["x-b#r2", "x-b#r3", "x-c#r1", "x-c#r2", "x-c#r3"]


def test_a_later_step_adds_its_variant_and_its_reference_to_the_running_pool(runner):
    runner.pending = {"x-a"}
    assert runner.pooled("ladder", "x-a") is None
    runner.pooled("parity", "x-a")  # parity reads its reference's server too
    runner.pooled("identity", "x-c")  # scored against its parent x-b, not the BF16 reference
    runner.pooled("reliability", "x-a")  # the soak reads its own server only: nothing started
    assert FakePool.starts == [["x-a"], ["x-bf16"], ["x-b", "x-c"]]


def test_a_first_run_starts_every_rung_at_once(runner):
    runner.state.steps.clear()
    runner.pending = None  # not computed yet: every rung
    runner.pooled("ladder", "x-bf16")
    assert FakePool.starts == [RUNGS]


def test_a_server_that_failed_to_start_is_not_started_again(runner):
    runner.pending = {"x-b"}
    runner.pool = FakePool(runner.log_dir)
    runner.pool.failed["x-b"] = "server did not start: out of memory"
    assert runner.pooled("ladder", "x-b") == "server did not start: out of memory"
    assert FakePool.starts == []
