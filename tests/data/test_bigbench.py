"""BIG-bench offline: the sdist's extraction, BIG-bench's prompt format, the suite's draw, its lm-eval tasks and the
gate's pooled suite criterion; one slow test runs a fixture suite end to end through lm-eval against the real server."""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import io
import json
import shutil
import tarfile

import pytest

from scripts.common import gate, paths
from scripts.data import bigbench
from scripts.data import bigbench_tasks as mbt
from scripts.measure import quality as eval_quality
from scripts.report import schemas as check_schemas

LITE = "BIGBENCH_LITE_TASK_NAMES = {\n  'bigbench_lite_v1': ['fixture_mc', 'fixture_gen']\n}\n"
# Two tasks in BIG-bench's task.json format: multiple choice with two subtasks (one repeated example, one task_prefix,
# prefixes of its own) and a generative one with BIG-bench's default prefixes and a stop string.
MC_A = {"name": "a", "preferred_score": "multiple_choice_grade", "metrics": ["multiple_choice_grade"],
        "examples": [{"input": "Is the sky blue?", "target_scores": {"yes": 1, "no": 0}},
                     {"input": "Is fire cold?", "target_scores": {"yes": 0, "no": 1}},
                     {"input": "Is the sky blue?", "target_scores": {"yes": 1, "no": 0}},
                     {"input": "Which is a fruit?", "target_scores": {"apple": 1, "brick": 0, "car": 0}}]}
MC_B = {"name": "b", "preferred_score": "multiple_choice_grade", "metrics": ["multiple_choice_grade"],
        "task_prefix": "Answer the question.\n", "example_input_prefix": "\nQuestion: ",
        "example_output_prefix": "\nAnswer: ", "append_choices_to_input": False,
        "examples": [{"input": "Do fish swim?", "target_scores": {"yes": 1, "no": 0}},
                     {"input": "Do stones fly?", "target_scores": {"yes": 0, "no": 1}}]}
GEN = {"name": "fixture_gen", "preferred_score": "exact_str_match", "metrics": ["exact_str_match"],
       "stop_string": ".", "examples": [{"input": "2 + 2 =", "target": "4"}, {"input": "3 + 4 =", "target": ["7"]},
                                        {"input": "Repeat hello", "target": "hello"}]}


def make_sdist(path):
    """A tar.gz laid out as the bigbench sdist: task JSON under bigbench/benchmark_tasks, the Lite list."""
    files = {"bigbench/bbseqio/bigbench_lite.py": LITE,
             "bigbench/benchmark_tasks/fixture_mc/task.json": json.dumps({"name": "fixture_mc", "subtasks": ["a", "b"]}),
             "bigbench/benchmark_tasks/fixture_mc/a/task.json": json.dumps(MC_A),
             "bigbench/benchmark_tasks/fixture_mc/b/task.json": json.dumps(MC_B),
             "bigbench/benchmark_tasks/fixture_gen/task.json": json.dumps(GEN),
             "bigbench/benchmark_tasks/fixture_gen/README.md": "not extracted"}
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"bigbench-1.0.0/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return hashlib.sha256(path.read_bytes()).hexdigest()


@pytest.fixture
def fixture_data(tmp_path, monkeypatch):
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    monkeypatch.setattr(bigbench, "SDIST_SHA256", make_sdist(sdist))
    data = tmp_path / "cache" / "bigbench"
    monkeypatch.setattr(bigbench, "DATA", data)
    monkeypatch.setattr(mbt, "SUITE_DIR", data / "suite")
    bigbench.fetch(data, sdist=sdist)
    return data


def test_fetch_extracts_task_json_and_the_lite_list(fixture_data):
    m = bigbench.manifest(fixture_data)
    assert m["task_files"] == 4 and m["lite"] == ["fixture_mc", "fixture_gen"]
    assert (fixture_data / "tasks" / "fixture_mc" / "a" / "task.json").exists()
    assert not (fixture_data / "tasks" / "fixture_gen" / "README.md").exists()
    assert bigbench.fetch(fixture_data) == m  # cached: no download


def test_fetch_refuses_a_sdist_of_another_hash_and_leaves_nothing(tmp_path, monkeypatch):
    sdist = tmp_path / "bigbench-1.0.0.tar.gz"
    make_sdist(sdist)
    monkeypatch.setattr(bigbench, "SDIST_SHA256", "0" * 64)
    data = tmp_path / "cache" / "bigbench"
    with pytest.raises(bigbench.BigBenchError, match="refusing to extract"):
        bigbench.fetch(data, sdist=sdist)
    assert not data.exists() and list(data.parent.iterdir()) == []


def test_missing_cache_names_make_datasets(tmp_path):
    with pytest.raises(bigbench.BigBenchError, match="make datasets"):
        bigbench.manifest(tmp_path / "nothing")
    with pytest.raises(bigbench.BigBenchError, match="make datasets"):
        list(bigbench.items("winowhy", tmp_path / "nothing"))
    with pytest.raises(bigbench.BigBenchError, match="make datasets"):
        mbt.suite_manifest(tmp_path / "nothing")


def test_unknown_task_is_named(fixture_data):
    with pytest.raises(bigbench.BigBenchError, match="'no_such_task' is not in"):
        bigbench.task_files("no_such_task", fixture_data)


def test_bigbench_prompt_format_by_hand():
    # defaults: "\nQ: " + input + choices in RandomState(42).permutation(sorted(choices)) order + "\nA: "
    # (for two choices that permutation swaps them: ["no", "yes"] -> ["yes", "no"]; for three it keeps the order)
    prompt, choices, scores, targets = bigbench.format_example({}, MC_A["examples"][1])
    assert prompt == "\nQ: Is fire cold?\n  choice: yes\n  choice: no\nA: "
    assert choices == ("yes", "no") and scores == (0.0, 1.0)
    prompt, choices, _, _ = bigbench.format_example({}, MC_A["examples"][3])
    assert prompt == "\nQ: Which is a fruit?\n  choice: apple\n  choice: brick\n  choice: car\nA: "
    prompt, _, _, _ = bigbench.format_example(MC_B, MC_B["examples"][0])
    assert prompt == "Answer the question.\n\nQuestion: Do fish swim?\nAnswer: "
    prompt, choices, _, targets = bigbench.format_example({}, GEN["examples"][1])
    assert prompt == "\nQ: 3 + 4 =\nA: " and choices == () and targets == ("7",)


def test_items_have_stable_ids_and_drop_repeats(fixture_data):
    mc = list(bigbench.items("fixture_mc", fixture_data))
    assert [i.id for i in mc] == ["fixture_mc/a/0", "fixture_mc/a/1", "fixture_mc/a/3", "fixture_mc/b/0", "fixture_mc/b/1"]
    assert all(i.multiple_choice for i in mc)
    gen = list(bigbench.items("fixture_gen", fixture_data))
    assert [i.id for i in gen] == ["fixture_gen/0", "fixture_gen/1", "fixture_gen/2"]
    assert gen[0].targets == ("4",) and not gen[0].multiple_choice


def test_refuse_evaluation_names_the_suite(fixture_data):
    with pytest.raises(bigbench.BigBenchError, match="BIG-bench Lite"):
        bigbench.refuse_evaluation("fixture_mc/a", fixture_data)
    bigbench.refuse_evaluation("natural_instructions", fixture_data)  # not in the suite: allowed


def test_draw_sizes_floor_cap_and_top_up(monkeypatch):
    def pool(task, n, prompt_bytes):
        return [bigbench.Item(task, "", i, "x" * prompt_bytes, ("a", "b"), (1.0, 0.0), (), "") for i in range(n)]

    # cost per item = 2 choices x prompt + 2 bytes of choices
    pools = {"cheap": pool("cheap", 100, 9), "dear": pool("dear", 100, 99), "tiny": pool("tiny", 3, 9)}
    monkeypatch.setattr(mbt, "BYTES_PER_TASK", 400)
    monkeypatch.setattr(mbt, "FLOOR", 5)
    monkeypatch.setattr(mbt, "CAP", 50)
    monkeypatch.setattr(mbt, "TARGET_ITEMS", 0)
    # cheap: 400 / 20 = 20; dear: 400 / 200 = 2 -> floor 5; tiny: all 3
    assert mbt.draw_sizes(pools) == {"cheap": 20, "dear": 5, "tiny": 3}
    monkeypatch.setattr(mbt, "TARGET_ITEMS", 60)  # 32 short: the cheapest first, up to the cap (cheap 50), then dear
    assert mbt.draw_sizes(pools) == {"cheap": 50, "dear": 7, "tiny": 3}


def test_draw_does_not_depend_on_file_order(fixture_data):
    items = list(bigbench.items("fixture_mc", fixture_data))
    assert [i.id for i in mbt.draw(items, 3)] == [i.id for i in mbt.draw(items[::-1], 3)]


def test_build_suite_writes_docs_and_manifest(fixture_data):
    m = mbt.build_suite(fixture_data)
    assert m["items"] == 8 and m["sdist_sha256"] == bigbench.SDIST_SHA256
    assert m["tasks"]["fixture_mc"]["kind"] == "multiple_choice" and m["tasks"]["fixture_gen"]["kind"] == "generate"
    docs = [json.loads(x) for x in (fixture_data / "suite" / "bbl_fixture_mc.jsonl").read_text().splitlines()]
    fruit = next(d for d in docs if d["id"] == "fixture_mc/a/3")
    assert fruit["choices"] == ["apple", "brick", "car"] and fruit["scores"] == [1.0, 0.0, 0.0] and fruit["gold"] == 0
    gen = [json.loads(x) for x in (fixture_data / "suite" / "bbl_fixture_gen.jsonl").read_text().splitlines()]
    assert {d["id"]: d["targets"] for d in gen}["fixture_gen/1"] == ["7"] and gen[0]["stop_string"] == "."
    assert mbt.suite_manifest() == m and mbt.build_suite(fixture_data) == m  # deterministic
    assert mbt.suite_tasks() == ["bbl_fixture_mc", "bbl_fixture_gen"]


def test_committed_yaml_is_what_the_generator_writes():
    files = sorted(mbt.YAML_DIR.glob("*.yaml"))
    assert len(files) == 24  # BIG-bench Lite's 24 tasks
    for f in files:
        text = f.read_text()
        kind = "multiple_choice" if "output_type: multiple_choice" in text else "generate"
        assert text == mbt.task_yaml(f.stem[len(mbt.TASK_PREFIX):], kind), f"{f.name}: run make_bigbench_tasks --yaml"


def load_utils():
    spec = importlib.util.spec_from_file_location("bigbench_utils", mbt.YAML_DIR / "bigbench_utils.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_scoring_as_bigbench_defines_it():
    utils = load_utils()
    doc = {"scores": [0.0, 1.0, 0.5]}
    assert utils.process_multiple_choice(doc, [(-3.0, False), (-1.0, True), (-2.0, False)]) == {"multiple_choice_grade": 1.0}
    assert utils.process_multiple_choice(doc, [(-3.0, False), (-4.0, True), (-2.0, False)]) == {"multiple_choice_grade": 0.5}
    gen = {"targets": ["7"], "stop_string": None, "output_regex": None}
    assert utils.process_generate(gen, [" 7 \nQ: next"]) == {"exact_str_match": 1.0}
    assert utils.process_generate(gen, ["77"]) == {"exact_str_match": 0.0}
    assert utils.process_generate({**gen, "output_regex": r"\d+"}, ["= 7, then 8"]) == {"exact_str_match": 1.0}
    assert utils.process_generate({"targets": ["hi."], "stop_string": "."}, ["hi. there"]) == {"exact_str_match": 1.0}


# ---------------------------------------------------------------------------------------------------------- gate
def suite_record(variant, scores: dict[str, float], sha="s" * 64, hw=None):
    tasks = sorted({i.split("/")[0] for i in scores})
    return {"schema": {"kind": "quality"}, "variant": variant, "status": "ok",
            "hardware": hw or {"cpu": "x", "cores": 2}, "started_at": "2026-11-24T00:00:00Z",
            "inputs": {"kind": "lm-eval", "tasks": [f"bbl_{t}" for t in tasks],
                       "suite": {"name": "bigbench_lite", "sha256": sha, "sdist": "bigbench==1.0.0", "sdist_sha256": "b" * 64,
                                 "items": len(scores)},
                       "task_meta": {f"bbl_{t}": {"metric": "multiple_choice_grade"} for t in tasks}},
            "samples": [{"task": f"bbl_{i.split('/')[0]}", "item_id": i, "score": s} for i, s in scores.items()]}


def write(root, variant, rec, name="quality_20261124-000000.json"):
    (root / variant).mkdir(exist_ok=True)
    (root / variant / name).write_text(json.dumps(rec))


def test_suite_criterion_pools_items_and_reports_each_task(tmp_path):
    # 200 items over two tasks; the variant loses 4 the reference got and gains 1: b = 4, c = 1, n = 200
    ref = {f"t{k}/{i}": float(i % 2) for k in (1, 2) for i in range(100)}
    var = dict(ref)
    for i in (1, 3, 5, 7):
        var[f"t1/{i}"] = 0.0
    var["t2/0"] = 1.0
    write(tmp_path, "ref", suite_record("ref", ref))
    write(tmp_path, "var", suite_record("var", var))
    _, (c,) = gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)
    # Agresti-Min by hand: pb = 4.5/202, pc = 1.5/202, d = 3/202 = 1.485 points,
    # sd = sqrt(6/202 - (3/202)^2) = 0.17171, half = 1.6449 x 0.17171 / sqrt(202) = 1.987 points
    assert c.name == "GATE_MAX_SUITE_DROP[bigbench_lite]"
    assert c.value == pytest.approx(1.5) and c.lo == pytest.approx(-0.502, abs=1e-3) and c.hi == pytest.approx(3.472, abs=1e-3)
    assert c.status == "inconclusive" and "the suite draws 200" in c.decide
    assert c.beside[0].startswith("bbl_t1: reference 50.0, drop +4.00") and "over 100 items" in c.beside[0]
    assert c.beside[1].startswith("bbl_t2: reference 50.0, drop -1.00")


def test_suite_records_of_another_draw_are_refused(tmp_path):
    ref = {f"t1/{i}": 1.0 for i in range(10)}
    write(tmp_path, "ref", suite_record("ref", ref, sha="a" * 64))
    write(tmp_path, "var", suite_record("var", ref, sha="c" * 64))
    with pytest.raises(gate.GateError, match="refusing to pair bigbench_lite"):
        gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)


def test_suite_criterion_missing_names_the_command(tmp_path):
    write(tmp_path, "var", suite_record("var", {"t1/0": 1.0}))
    (tmp_path / "ref").mkdir()
    _, (c,) = gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)
    assert c.status == "missing" and "make eval-quality-full VARIANT=ref" in c.decide
    # a record from other hardware is not evidence either
    write(tmp_path, "ref", suite_record("ref", {"t1/0": 1.0}, hw={"cpu": "other", "cores": 64}))
    _, (c,) = gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)
    assert c.status == "missing"


def test_a_sample_record_counts_only_where_it_decides(tmp_path):
    ref = {f"t{k}/{i}": 1.0 for k in (1, 2) for i in range(400)}
    write(tmp_path, "ref", suite_record("ref", ref))
    sample = suite_record("var", {i: s for i, s in ref.items() if int(i.split("/")[1]) < 40})  # the first tenth
    sample["inputs"]["suite"]["sample"] = {"limit": 0.1, "stratified_by": "task", "items": 80}
    write(tmp_path, "var", sample, "quality_20261125-000000.json")
    _, (c,) = gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "5.0"}, tmp_path)
    # 80 paired items, none disagreeing: Agresti-Min pb = pc = 0.5/82, sd = sqrt(1/82) = 0.1104,
    # half = 1.6449 x 0.1104 / sqrt(82) = 2.0 points: <= 5 passes (decided by the sample), <= 1 is inconclusive
    assert c.status == "pass" and c.detail.startswith("a 10% sample of the suite; ") and "80 paired items" in c.detail
    _, (c,) = gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)
    assert c.status == "inconclusive" and "make eval-quality-full VARIANT=var" in c.decide, "a sample never stands in"
    write(tmp_path, "var", suite_record("var", ref), "quality_20261124-000000.json")  # an older record of every item
    _, (c,) = gate.gate_for("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)
    assert c.status == "pass" and "800 paired items" in c.detail, "the whole suite's record wins over a newer sample"


# ---------------------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow
def test_fixture_suite_end_to_end_through_lm_eval(fixture_data, embedded_server, tmp_path, monkeypatch):
    """make datasets' steps on the fixture sdist, the suite's YAMLs, real lm-eval against the real server, the record
    validated, and the gate pairing the record with itself."""
    m = mbt.build_suite(fixture_data)
    tasks_dir = tmp_path / "eval" / "tasks" / mbt.SUITE
    mbt.write_yaml(m, tasks_dir, fixture_data / "suite")
    shutil.copy(mbt.YAML_DIR / "bigbench_utils.py", tasks_dir)
    monkeypatch.setattr(paths, "EVAL", tmp_path / "eval")
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path / "experiments")
    (tmp_path / "experiments" / "smollm2-bf16").mkdir(parents=True)
    (tmp_path / "experiments" / "smollm2-bf16" / "config.env").write_text(
        (paths.ROOT / "experiments" / "smollm2-bf16" / "config.env").read_text())
    assert eval_quality.main(["smollm2-bf16", "--suite", "--profile", "full", "--base-url", embedded_server.base_url]) == 0
    (path,) = sorted((tmp_path / "experiments" / "smollm2-bf16").glob("quality_*.json"))
    assert check_schemas.check_file(path) == []
    rec = json.loads(path.read_text())
    assert rec["inputs"]["suite"]["sha256"] == m["sha256"] and rec["inputs"]["suite"]["items"] == 8
    assert rec["inputs"]["task_meta"]["bbl_fixture_mc"]["version"] == bigbench.SDIST_SHA256
    ids = {s["item_id"]: s for s in rec["samples"]}
    assert set(ids) == {i for t in m["tasks"].values() for i in t["ids"]}
    assert all(s["score"] in (0.0, 1.0) for s in rec["samples"])
    assert rec["summary"]["suite"]["items"] == 8
    assert rec["summary"]["suite"]["score"] == pytest.approx(sum(s["score"] for s in rec["samples"]) / 8)
    # the multiple-choice grade is the score of the most likely choice, from the log-likelihoods the server returned
    docs = {d["id"]: d for d in map(json.loads, (fixture_data / "suite" / "bbl_fixture_mc.jsonl").read_text().splitlines())}
    for s in (s for s in rec["samples"] if s["task"] == "bbl_fixture_mc"):
        lls = [x[0] if isinstance(x, (list, tuple)) else float(x) for x in ast.literal_eval(s["response"])]
        assert len(lls) == len(docs[s["item_id"]]["choices"]) and all(ll < 0 for ll in lls)
        assert s["score"] == docs[s["item_id"]]["scores"][lls.index(max(lls))]
    # a copy of the record as a variant of the reference: zero drop, and 8 items never certify
    exp = tmp_path / "experiments"
    (exp / "smollm2-self").mkdir()
    (exp / "smollm2-self" / path.name).write_text(json.dumps({**rec, "variant": "smollm2-self"}))
    _, (c,) = gate.gate_for("smollm2-self", {"PARENT": "smollm2-bf16", "GATE_MAX_SUITE_DROP": "1.0"}, exp)
    assert c.value == 0 and c.status == "inconclusive" and len(c.beside) == 2


def test_compare_lists_the_suite_scores_and_drops(tmp_path):
    from scripts.report import compare

    ref = {f"t1/{i}": float(i < 6) for i in range(10)}  # 60 %
    var = {**ref, "t1/0": 0.0}  # 50 %: drop 10 points
    recs = [(tmp_path / "a.json", {**suite_record("ref", ref), "config": {"BASE": "x"}}),
            (tmp_path / "b.json", {**suite_record("var", var), "config": {"PARENT": "ref"}})]
    for _, r in recs:
        write(tmp_path, r["variant"], r)
    judged = {"ref": compare.Judged("reference"),
              "var": compare.judge("var", {"PARENT": "ref", "GATE_MAX_SUITE_DROP": "1.0"}, tmp_path)}
    text = "\n".join(compare.suite_lines(recs, judged))
    assert "| ref | vLLM | — | 10 | 60.00 | — | — | reference |" in text
    assert "| var | vLLM | ref | 10 | 50.00 | +10.00 [" in text
    assert "| bbl_t1 | 10 | 60.0 | +10.0 |" in text


def test_an_engine_without_prompt_logprobs_is_named():
    ok = {"choices": [{"logprobs": {"token_logprobs": [None, -1.2, -0.3]}}]}
    assert eval_quality.prompt_logprobs_problem(200, ok) is None
    assert "HTTP 400" in eval_quality.prompt_logprobs_problem(400, {"error": "echo not supported"})
    assert "no log-probabilities" in eval_quality.prompt_logprobs_problem(200, {"choices": [{"logprobs": None}]})
    assert "no log-probabilities" in eval_quality.prompt_logprobs_problem(200, {"choices": [{"text": "2"}]})


def test_a_server_that_refuses_the_client_ends_the_quality_run(monkeypatch):
    """401/403 to the log-probability probe (a keyed server, or another server on the port) is an error naming it,
    never a generative subset scored with the multiple-choice tasks skipped."""
    for status in (401, 403):
        monkeypatch.setattr(eval_quality, "http_post_json", lambda url, body, status=status: (status, None))
        with pytest.raises(eval_quality.EvalError, match=f"answered HTTP {status}: the server refuses this client"):
            eval_quality.split_loglikelihood(["lab_arith_mc", "lab_ifeval"], "http://h", "m")


def test_loglikelihood_tasks_are_the_multiple_choice_ones(fixture_data):
    mbt.build_suite(fixture_data)
    assert eval_quality.loglikelihood_task("bbl_fixture_mc") and eval_quality.loglikelihood_task("lab_arith_mc")
    assert not eval_quality.loglikelihood_task("bbl_fixture_gen") and not eval_quality.loglikelihood_task("lab_ifeval")


def test_lm_eval_gguf_model_type_loses_the_answer_token_after_a_spaced_prompt():
    """Why llama.cpp is scored through local-completions, not lm-eval's `gguf` model type: that type finds the
    continuation by text offset, and a BIG-bench prompt ends in a space ("A: ") that the answer's first token carries
    (" yes"), so the answer's log-likelihood is summed from the wrong token (here: nothing, 0.0 for every choice)."""
    from lm_eval.models.gguf import get_result

    context = "\nQ: Is fire cold?\nA: "
    logprobs = {"tokens": ["\n", "Q", ":", " Is", " fire", " cold", "?", "\n", "A", ":", " yes", "\n"],
                "text_offset": [0, 1, 2, 3, 6, 11, 16, 17, 18, 19, 20, 24],
                "token_logprobs": [None, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -1.0, -2.5, -0.1],
                "top_logprobs": [{}] + [{"x": 0.0}] * 11}
    assert get_result(logprobs, len(context))[0] == 0.0  # the -2.5 of " yes" is never counted


@pytest.mark.slow
def test_llamacpp_loglikelihoods_equal_a_fresh_evaluation(embedded_weights):
    """llama.cpp in-process (the embedded GGUF): requests that share a context reuse its KV cache, and every answer
    equals the one the request gets alone; a request's log-likelihood is the sum of its tokens' log-probabilities."""
    from scripts.common.checkpoint import embedded_gguf

    gguf = str(embedded_gguf())
    q = [198, 65, 42, 1550, 3818, 30]  # "\nQ: Is fire cold?" in SmolLM2's ids
    pairs = [(q, [701]), (q, [701, 2]), (q[:4], q[4:]), (q[:4], [q[4]]), (q[:5], [q[5]]), ([q[0]], q[1:])]
    together = eval_quality.llamacpp_loglikelihoods(gguf, pairs)
    alone = [eval_quality.llamacpp_loglikelihoods(gguf, [p])[0] for p in pairs]
    for (lp, greedy), (lp1, greedy1) in zip(together, alone, strict=True):
        assert lp == pytest.approx(lp1, abs=1e-3) and greedy == greedy1
    assert all(lp < 0 for lp, _ in together)
    # chain rule: log p(q[4:] | q[:4]) = log p(q[4] | q[:4]) + log p(q[5] | q[:5])
    assert together[2][0] == pytest.approx(together[3][0] + together[4][0], abs=1e-3)


def test_make_datasets_takes_a_local_sdist_and_names_a_missing_one(tmp_path, monkeypatch, capsys):
    sdist = tmp_path / "copy" / "bigbench-1.0.0.tar.gz"
    sdist.parent.mkdir()
    monkeypatch.setattr(bigbench, "SDIST_SHA256", make_sdist(sdist))
    data = tmp_path / "cache" / "bigbench"
    monkeypatch.setattr(bigbench, "DATA", data)
    monkeypatch.setattr(mbt, "SUITE_DIR", data / "suite")
    assert mbt.main(["--sdist", str(tmp_path / "absent.tar.gz")]) == 1
    assert "absent.tar.gz: no such file" in capsys.readouterr().err and not data.exists()
    assert mbt.main(["--sdist", str(sdist), "--pip-python", "/nonexistent/python"]) == 0  # no download tried
    assert bigbench.manifest(data)["task_files"] == 4
