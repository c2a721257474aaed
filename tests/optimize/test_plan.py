"""make optimize's pure parts: the plan file round-trips, registration's checks and template, bad input in one line."""

from __future__ import annotations

import json

import pytest

from scripts.common import paths
from scripts.optimize import plan as plan_mod
from scripts.optimize import run as run_mod
from scripts.optimize.plan import Candidate, Plan, PlanError, read_plan, write_plan
from scripts.weights import download, register


def a_plan() -> Plan:
    return Plan(base="x", reference="x-bf16", budget="tiny", concurrency=[1, 8], slo_tpot_ms=40.0,
                hardware="AMD EPYC (2 cores, avx2)",
                candidates=[Candidate("x-gguf-q8-0-server", "GGUF Q8_0, llama-server", "llamaserver", "parity",
                                      ["x-gguf-q8-0"], "x-gguf-q8-0"),
                            Candidate("x-ngram4", "n-gram: 'quoted' # not a comment", "vllm", "identity")],
                left_out=[{"lever": "EAGLE-3 draft head", "why": "no committed head: `make redistill`"}])


def test_the_plan_file_round_trips(tmp_path):
    p = a_plan()
    path = write_plan(p, tmp_path / "x.yaml")
    assert read_plan(path) == p
    assert path.read_text().startswith("# make optimize's plan for base x")
    assert not list(tmp_path.glob(".*partial*"))


def test_an_edited_plan_keeps_the_edit(tmp_path):
    path = write_plan(a_plan(), tmp_path / "x.yaml")
    text = path.read_text()
    cut = text.index("- variant: x-ngram4")
    path.write_text(text[:cut] + text[text.index("left_out:"):])
    assert [c.variant for c in read_plan(path).candidates] == ["x-gguf-q8-0-server"]


@pytest.mark.parametrize("text", ["base: [unclosed", "base: x\ncandidates: []\n", "- just\n- a list\n"])
def test_a_broken_plan_file_is_one_line_naming_it(tmp_path, text):
    (tmp_path / "x.yaml").write_text(text)
    with pytest.raises(PlanError) as e:
        read_plan(tmp_path / "x.yaml")
    assert "x.yaml" in str(e.value) and "\n" not in str(e.value)


def test_the_budgets_cut_evidence_in_order():
    tiny, normal, full = (plan_mod.BUDGETS[b] for b in ("tiny", "normal", "full"))
    assert tiny.suite is None and normal.suite == "sample" and full.suite == "full"
    assert set(tiny.levers) < set(plan_mod.templates("x", {"MODEL": "weights/x"}))
    assert normal.levers is None and full.levers is None


def test_templates_give_each_candidate_its_gate():
    t = plan_mod.templates("x", {"MODEL": "weights/x", "SERVE_MAX_NUM_SEQS": "8", "EVAL_TASKS": "lab_arith_mc"})
    q8 = t["gguf-q8-0-server"][2]
    assert q8["GATE_QUALITY_OF"] == "x-gguf-q8-0" and q8["GATE_REFERENCE"] == "x-bf16"
    assert q8["GATE_MAX_MEAN_KLD"] == plan_mod.LOSSY_GATE["GATE_MAX_MEAN_KLD"]
    ngram = t["gguf-q8-0-server-ngram4"][2]
    assert ngram["PARENT"] == "x-gguf-q8-0-server" and ngram["GATE_GREEDY_IDENTITY"] == "1"
    assert not {k for k in ngram if k.startswith("GATE_")} - {"GATE_GREEDY_IDENTITY"}
    assert t["gguf-bf16-server"][2]["GATE_GREEDY_IDENTITY"] == "1"
    assert t["int8sq"][2]["MODEL"] == "weights/x-int8sq" and t["int8sq"][2]["PARENT"] == "x-bf16"


def test_lineage_keeps_across_machines_and_changes_with_the_weights(tmp_path, monkeypatch):
    """A base downloaded again on another machine (other seconds, copied instead of hard-linked) keeps its steps' keys;
    other files do not."""
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path)
    weights = tmp_path / "w"
    weights.mkdir()
    (tmp_path / "x-bf16").mkdir()
    (tmp_path / "x-bf16" / "config.env").write_text(f"MODEL={weights}\nSOURCE=local:/u/x\nBASE=x\n")

    def provenance(sha: str, seconds: float, how: str) -> str:
        text = json.dumps({"local_folder": "/u/x", "registered": how, "files_sha256": {"a.safetensors": sha},
                           "seconds": seconds}, indent=2)
        (weights / "PROVENANCE.json").write_text(text + "\n")
        return run_mod.lineage("x-bf16")

    first = provenance("aa", 0.3, "hard-linked")
    assert provenance("aa", 2.1, "copied") == first
    assert provenance("ab", 0.3, "hard-linked") != first
    (weights / "PROVENANCE.json").write_text("not json")  # a damaged file keys by its text, never a traceback
    assert run_mod.lineage("x-bf16") not in (first, None)
    (weights / "PROVENANCE.json").write_bytes(b"\xff\xfe{")
    assert run_mod.lineage("x-bf16") not in (first, None)
    # a hub snapshot names its repository alone (a newer revision shares it): every download keys anew
    hub = [json.dumps({"hub_repo": "org/x", "seconds": s}) for s in (1.0, 2.0)]
    keys = []
    for text in hub:
        (weights / "PROVENANCE.json").write_text(text)
        keys.append(run_mod.lineage("x-bf16"))
    assert keys[0] != keys[1]


def test_lineage_changes_when_an_ancestor_config_changes(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path)
    for name, text in {"x-bf16": "MODEL=weights/.absent-x\nSOURCE=embedded\nBASE=x\n",
                       "x-int8": "MODEL=weights/.absent-x-int8\nSOURCE=lever\nPARENT=x-bf16\nBASE=x\n"
                                 "CALIBRATE_RECIPE=int8-w8a8\n"}.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.env").write_text(text)
    before = run_mod.lineage("x-int8")
    assert run_mod.lineage("x-int8") == before
    (tmp_path / "x-bf16" / "config.env").write_text("MODEL=weights/.absent-x\nSOURCE=embedded\nBASE=x\n"
                                                    "SERVE_MAX_NUM_SEQS=4\n")
    assert run_mod.lineage("x-int8") != before


def test_kv_budget_and_template_follow_the_model(tmp_path):
    cfg = {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "hidden_size": 576, "max_position_embeddings": 2048}
    gib, per_token = register.kv_gib(cfg, 2048, 8)
    assert per_token == 2 * 30 * 3 * 64 * 2 and gib == 1
    text = register.config_env("mine", tmp_path, cfg, has_chat_template=False)
    assert "SERVE_MAX_MODEL_LEN=2048\n" in text and "SOURCE=local:" in text
    assert "SERVE_CHAT_TEMPLATE=./eval/templates/base-plain.jinja" in text
    assert "SERVE_CHAT_TEMPLATE" not in register.config_env("mine", tmp_path, cfg, has_chat_template=True)


def hf_folder(tmp_path, *, config=True, weights=True, tokenizer=True):
    d = tmp_path / "ckpt"
    d.mkdir()
    if config:
        (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    if weights:
        (d / "model.safetensors").write_bytes(b"\0" * 8)
    if tokenizer:
        (d / "tokenizer.json").write_text("{}")
    return d


@pytest.mark.parametrize("case, expect", [
    ("missing", "no such folder"), ("file", "not a folder"), ("no-config", "no config.json"),
    ("no-weights", "no *.safetensors"), ("no-tokenizer", "no tokenizer"), ("bad-name", "a base name is"),
])
def test_registering_a_bad_folder_is_one_line_and_exit_2(tmp_path, monkeypatch, capsys, case, expect):
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path / "experiments")
    monkeypatch.setattr(paths, "WEIGHTS", tmp_path / "weights")
    source = {"missing": lambda: tmp_path / "nowhere", "file": lambda: hf_folder(tmp_path) / "config.json",
              "no-config": lambda: hf_folder(tmp_path, config=False),
              "no-weights": lambda: hf_folder(tmp_path, weights=False),
              "no-tokenizer": lambda: hf_folder(tmp_path, tokenizer=False),
              "bad-name": lambda: hf_folder(tmp_path)}[case]()
    rc = download.main([str(source), "--name", "Bad_Name" if case == "bad-name" else "mine"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: ") and "\n" not in err and expect in err, err
    assert not (tmp_path / "weights").exists() or not any((tmp_path / "weights").iterdir())
    assert not (tmp_path / "experiments").exists()


def test_a_name_taken_by_another_source_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path / "experiments")
    (tmp_path / "experiments" / "mine-bf16").mkdir(parents=True)
    (tmp_path / "experiments" / "mine-bf16" / "config.env").write_text("MODEL=weights/mine\nSOURCE=embedded\nBASE=mine\n")
    rc = download.main([str(hf_folder(tmp_path)), "--name", "mine"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "base mine is taken" in err and "\n" not in err


def test_a_config_only_base_has_no_cpu_plan(tmp_path, monkeypatch):
    """A config-only base (no weights on disk, SERVE_LOAD_FORMAT=dummy) on a CPU: one line naming the GPU, never a
    GGUF export or calibration of the sparse header's zeros (a 4B one ran both for minutes before)."""
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path / "experiments")
    (tmp_path / "experiments" / "d-bf16").mkdir(parents=True)
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (tmp_path / "experiments" / "d-bf16" / "config.env").write_text(
        f"MODEL={tmp_path / 'w'}\nSOURCE=config-only:qwen35-4b\nSHAPE_PROXY=1\nBASE=d\nSERVE_LOAD_FORMAT=dummy\n")
    with pytest.raises(PlanError, match=r"d-bf16 is config-only .* run make optimize on a GPU machine"):
        plan_mod.propose("d", "normal", [1, 8], None, "test", cpu_flags=["avx2"])


def test_an_unknown_base_is_one_line_and_exit_2(capsys):
    rc = run_mod.main(["no-such-base"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.startswith("error: unknown BASE=no-such-base") and "make download MODEL=" in err
    assert "\n" not in err
    assert run_mod.main(["smollm2", "--concurrency", "1,x"]) == 2


@pytest.mark.skipif(not (paths.ROOT / ".venv-quant").is_dir(), reason="llm-compressor not installed (make install-quant)")
def test_w8a8_is_proposed_only_where_the_cpu_has_int8_dot_products(embedded_weights):
    def int8(flags, budget="normal"):
        plan, _ = plan_mod.propose("smollm2", budget, [1], None, "test", cpu_flags=flags)
        return ({c.variant for c in plan.candidates if c.variant.startswith("smollm2-int8")},
                [o["why"] for o in plan.left_out if o["lever"].startswith("W8A8")])

    w8a8 = {"smollm2-int8", "smollm2-int8sq", "smollm2-int8sq-ceagle2"}  # the committed head on int8sq comes along
    assert int8(["avx2", "avx512f", "avx512_vnni"]) == (w8a8, [])
    proposed, why = int8(["avx2"])
    assert proposed == set() and len(why) == 2 and all("none of avx512_vnni" in w for w in why)
    assert int8(["avx2"], "full")[0] == w8a8


def test_vocab_pruning_with_the_exact_tail_is_proposed_from_a_committed_keep_list():
    (name, cfg), lever = plan_mod.vocab_tail("gemma3-270m", {"SERVE_MAX_NUM_SEQS": "8", "MODEL": "w"},
                                             {"text_config": {"vocab_size": 262144}})
    assert name == "gemma3-270m-v32k-tail" and "32,768 of 262,144" in lever
    assert cfg["PRUNE_KEEP"] == "32768" and cfg["PRUNE_TAIL"] == "1" and cfg["GATE_GREEDY_IDENTITY"] == "1"
    assert cfg["SERVE_MAX_NUM_SEQS"] == "8" and "MODEL" in cfg and cfg["MODEL"] == f"weights/{name}"
    none, why = plan_mod.vocab_tail("gemma3-270m", {}, {"vocab_size": 40000})
    assert none is None and "too small to pay" in why
    none, why = plan_mod.vocab_tail("no-such-base", {}, {"vocab_size": 262144})
    assert none is None and "make analyze-vocab VOCAB_REFS=no-such-base-bf16" in why


@pytest.mark.parametrize("settings", [{"PRUNE_KEEP": "8"}, {"LORA_ADAPTER": "a"}, {"GGUF_TYPE": "Q8_0"}, {}])
def test_every_build_target_has_its_lever_code_in_the_step_key(settings):
    from scripts.common.variants import build_target

    assert (paths.ROOT / run_mod.STEP_CODE[build_target(settings)]).exists()


def test_kept_steps_are_counted_in_their_own_phase():
    from scripts.optimize.report import kept_seconds

    steps = {"prune-vocab:x-v32k-tail": {"seconds": 511}, "eval-quality:x-bf16": {"seconds": 40},
             "eval-latency:x-bf16": {"phase": "ladder", "seconds": 9}, "calibrate:x-int8": {"seconds": 3}}
    spent = kept_seconds(steps, ("plan", "build", "ladder", "suite"))
    assert spent == {"plan": 0, "build": 514, "ladder": 9, "suite": 40}


def test_a_ladder_of_another_budget_gets_its_own_id(tmp_path, monkeypatch):
    import datetime as dt
    import itertools

    clock = (dt.datetime(2026, 11, 27, 12, 0, s, tzinfo=dt.UTC) for s in itertools.count())
    monkeypatch.setattr(run_mod, "now_utc", lambda: next(clock))
    plan = Plan(base="x", reference="x-bf16", budget="tiny", concurrency=[1], slo_tpot_ms=None, hardware="h",
                candidates=[], left_out=[])
    state = run_mod.State(tmp_path / "state.json")
    r = run_mod.Runner(plan, state, "h", tmp_path)

    calls = []

    def step(phase, target, variant, args=(), extra_key="", records=None, tag=""):
        calls.append((variant, args[args.index("--round") + 1], tag))
        state.steps[f"{target}:{variant}{tag}"] = {"status": "ok", "record": None}
        return state.steps[f"{target}:{variant}{tag}"]

    monkeypatch.setattr(r, "step", step)
    run_mod.ladder(r, ["x-bf16"])
    tiny = state.ladder_id
    run_mod.ladder(r, ["x-bf16"])
    assert state.ladder_id == tiny  # the same ladder, resumed
    plan.budget = "normal"
    run_mod.ladder(r, ["x-bf16"])
    assert state.ladder_id != tiny and "--limit" not in state.ladder_args


def test_the_ladder_alternates_its_rounds(tmp_path, monkeypatch):
    plan = Plan(base="x", reference="x-bf16", budget="normal", concurrency=[1], slo_tpot_ms=None, hardware="h",
                candidates=[], left_out=[])
    r = run_mod.Runner(plan, run_mod.State(tmp_path / "state.json"), "h", tmp_path)
    calls = []

    def step(phase, target, variant, args=(), extra_key="", records=None, tag=""):
        calls.append((variant, args[args.index("--round") + 1], tag))
        return {"status": "ok" if (variant, tag) != ("x-b", "#r2") else "failed", "record": f"{variant}{tag}.json"}

    monkeypatch.setattr(r, "step", step)
    speeds = run_mod.ladder(r, ["x-bf16", "x-a", "x-b"])  # two rounds on a CPU under BUDGET=normal, ABBA
    assert calls == [("x-bf16", "1", "#r1"), ("x-a", "1", "#r1"), ("x-b", "1", "#r1"),
                     ("x-b", "2", "#r2"), ("x-a", "2", "#r2"), ("x-bf16", "2", "#r2")]
    assert speeds.rounds["x-a"] == ["x-a#r1.json", "x-a#r2.json"] and speeds.rounds["x-b"] == ["x-b#r1.json", None]
    assert "round 2" in r.notes["x-b"][0]
    r.gpu, calls[:] = True, []
    run_mod.ladder(r, ["x-bf16", "x-a"])  # three on a GPU
    assert [c[0] for c in calls] == ["x-bf16", "x-a", "x-a", "x-bf16", "x-bf16", "x-a"]
    plan.rounds, calls[:] = 4, []  # the plan file's own number wins
    run_mod.ladder(r, ["x-bf16"])
    assert len(calls) == 4


def test_a_ladder_resumed_on_another_machine_kind_starts_anew(tmp_path, monkeypatch, capsys):
    plan = Plan(base="x", reference="x-bf16", budget="normal", concurrency=[1], slo_tpot_ms=None, hardware="h",
                candidates=[], left_out=[])
    state = run_mod.State(tmp_path / "state.json")
    r = run_mod.Runner(plan, state, "AMD EPYC (2 cores, avx2)", tmp_path)
    monkeypatch.setattr(r, "step", lambda *a, **k: state.steps.setdefault(f"eval-latency:{a[2]}{k['tag']}",
                                                                          {"status": "ok", "record": None}))
    run_mod.ladder(r, ["x-bf16"])
    first = state.ladder_id
    again = run_mod.State(state.path, state.steps, state.ladder_id, state.ladder_args, state.ladder_hardware)
    r2 = run_mod.Runner(plan, again, "NVIDIA H200 x1", tmp_path)
    monkeypatch.setattr(r2, "step", lambda *a, **k: {"status": "ok", "record": None})
    monkeypatch.setattr(run_mod, "now_utc", lambda: __import__("datetime").datetime(2030, 1, 1))
    run_mod.ladder(r2, ["x-bf16"])
    out = capsys.readouterr().out
    assert again.ladder_id != first and again.ladder_hardware == "NVIDIA H200 x1"
    assert "was measured on AMD EPYC (2 cores, avx2); this machine is NVIDIA H200 x1" in out
