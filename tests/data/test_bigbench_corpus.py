"""BIG-bench outside the evaluation suite (scripts.data.bigbench_corpus): Lite never read, its items left out of every
other task, the split by task, and prompt rows in the project's prompt-set format."""

from __future__ import annotations

import json
import shutil

import pytest

from scripts.common.loadgen import load_prompts
from scripts.data import bigbench
from scripts.data import bigbench_corpus as bbc

LITE = "BIGBENCH_LITE_TASK_NAMES = {\n  'bigbench_lite_v1': ['lite_task']\n}\n"
TASKS = {
    "lite_task": [{"input": "What is 2 + 2?", "target": "4"}, {"input": "Name a red fruit.", "target": "apple"}],
    # shares one Lite item (whitespace differs): it must be left out
    "other_gen": [{"input": "What is  2 + 2?\n", "target": "4"}] + [{"input": f"Spell {w}.", "target": w}
                                                                     for w in ("cat", "dog", "owl", "eel")],
    "other_mc": [{"input": f"Is {x} a colour?", "target_scores": {"yes": int(x == "red"), "no": int(x != "red")}}
                 for x in ("red", "soup", "tree")],
}


@pytest.fixture
def data(tmp_path):
    d = tmp_path / "bigbench"
    (d / "tasks").mkdir(parents=True)
    (d / "manifest.json").write_text(json.dumps({"sdist_sha256": bigbench.SDIST_SHA256}))
    (d / "bigbench_lite.py").write_text(LITE)
    for name, examples in TASKS.items():
        (d / "tasks" / name).mkdir()
        (d / "tasks" / name / "task.json").write_text(json.dumps({"name": name, "examples": examples}))
    bbc.lite_inputs.cache_clear()
    yield d
    bbc.lite_inputs.cache_clear()


def test_lite_tasks_are_never_read(data):
    assert "lite_task" not in bbc.tasks(data=data)
    with pytest.raises(bigbench.BigBenchError, match="lite_task.*evaluation suite"):
        list(bbc.examples("lite_task", data))


def test_a_lite_item_inside_another_task_is_left_out_and_counted(data, monkeypatch):
    monkeypatch.setattr(bbc, "split_of", lambda task: "calibration")
    pairs, info = bbc.texts("calibration", 10 ** 6, data)
    assert not any("2 + 2" in t for _, t in pairs)
    assert info["suite_duplicates_left_out"] == 1 and info["examples"] == 7
    assert ("other_mc", "Is red a colour?\nyes") in pairs  # multiple choice: the best-scored choice as target
    rows, pinfo = bbc.prompts("calibration", 2, data)
    assert [r["group"] for r in rows] == ["other_gen", "other_gen", "other_mc", "other_mc"]
    assert pinfo["prompts"] == 4 and not any("2 + 2" in r["messages"][0]["content"] for r in rows)
    out = bbc.write_prompts(rows, data / "not-yet" / "p.jsonl")  # a folder that does not exist yet is made
    loaded, linfo = load_prompts(out)
    assert loaded == rows and linfo["prompt_set_sha256"] == pinfo["sha256"]  # the hash names the exact file


def test_split_is_by_task_and_stable(data):
    both = bbc.tasks("calibration", data) + bbc.tasks("held_out", data)
    assert sorted(both) == ["other_gen", "other_mc"]
    assert all(bbc.split_of(t) == bbc.split_of(t) for t in both)
    with pytest.raises(bigbench.BigBenchError, match="unknown split"):
        bbc.tasks("test", data)


def test_character_budget_per_task(data, monkeypatch):
    monkeypatch.setattr(bbc, "split_of", lambda task: "calibration")
    pairs, info = bbc.texts("calibration", 1, data)  # one example per task
    assert [t for t, _ in pairs] == ["other_gen", "other_mc"] and info["chars_per_task"] == 1


def test_missing_lite_task_folders_are_refused_at_listing(data):
    """The held-out text is checked against every Lite input: a data folder holding only some tasks (a GPU machine's
    payload) is refused when the tasks are listed, before a build loads any model."""
    shutil.rmtree(data / "tasks" / "lite_task")
    with pytest.raises(bigbench.BigBenchError, match=r"lacks 1 of the 1 BIG-bench Lite task folders \(lite_task"):
        bbc.tasks("held_out", data)
