"""The atomic record writer, the schema checker and the comparison report (no server)."""

from __future__ import annotations

import copy
import datetime as dt
import json
import os

import pytest

from scripts.common import records
from scripts.common.gate import Criterion
from scripts.common.metrics import RequestSample, speed_ratio, summarize
from scripts.common.variants import load_variant
from scripts.report import compare
from scripts.report import schemas as check_schemas


def make_record(variant="smollm2-bf16", tput_scale=1.0, ladder=None) -> dict:
    v = load_variant(variant, target="cpu")
    rec = records.envelope("latency", v, command=["python", "-m", "scripts.measure.latency", variant], server_command=["vllm"])
    s = RequestSample("p0", ok=True, start_s=0, end_s=1.0 / tput_scale, prompt_tokens=5, output_tokens=10, ttft_s=0.1,
                      itl_s=[0.1] * 9)
    rec["inputs"] = {"prompt_set": "latency-v1.jsonl", "prompt_set_sha256": "a" * 64, "num_prompts": 1,
                     "modes": ["fixed"], "concurrency": [1], "ladder_id": ladder}
    rec["samples"] = [{"mode": "fixed", "concurrency": 1, "requests": [s.to_json()]}]
    rec["summary"] = {"fixed": {"1": summarize([s])}}
    rec["startup_s"], rec["server_metrics"], rec["duration_s"] = 1.0, {"available": False}, 1.0
    rec["model"] = {"model": "weights/x", "weight_bytes": 1000, "quantization": None}
    return rec


def write_ladder(exp, speeds: dict[str, float], parents: dict[str, str] | None = None,
                 engines: dict[str, dict] | None = None) -> None:
    """One ladder's latency records in two rounds: smollm2-bf16 at speed 1.0 and each other variant at its speed x 1.02
    in round 1 and / 1.02 in round 2 (the geometric mean is its speed; its 95% interval over the two rounds is
    exp(log speed -+ 12.706 x 0.0198)), child of smollm2-bf16 unless `parents` names another parent."""
    when = records.now_utc()
    for k, jitter in ((1, 1.02), (2, 1 / 1.02)):  # round k's records k seconds apart: file names sort by round
        for name, scale in {"smollm2-bf16": 1.0, **speeds}.items():
            rec = make_record("smollm2-bf16", scale * (1.0 if name == "smollm2-bf16" else jitter), ladder="L")
            rec["inputs"]["round"] = k
            if name != "smollm2-bf16":
                rec["variant"], rec["config"]["PARENT"] = name, (parents or {}).get(name, "smollm2-bf16")
            if name in (engines or {}):
                rec["engine"] = engines[name]
            records.write_record(rec, exp / name, "latency", when=when + dt.timedelta(seconds=k))


def test_atomic_writer_names_and_never_overwrites(tmp_path):
    when = records.now_utc()
    p1 = records.write_record({"a": 1}, tmp_path, "latency", when=when)
    p2 = records.write_record({"a": 2}, tmp_path, "latency", when=when)
    assert p1.name == f"latency_{when:%Y%m%d-%H%M%S}.json" and p2 != p1
    assert json.loads(p1.read_text()) == {"a": 1}
    assert not [p for p in tmp_path.iterdir() if p.suffix == ".tmp"]


def test_interrupted_write_leaves_nothing(tmp_path, monkeypatch):
    def boom(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", boom)
    with pytest.raises(KeyboardInterrupt):
        records.write_record({"a": 1}, tmp_path, "latency")
    assert list(tmp_path.iterdir()) == []


def test_valid_record_passes_schema(tmp_path):
    path = records.write_record(make_record(), tmp_path, "latency")
    assert check_schemas.check_file(path) == []



def test_a_trial_records_count_only_for_that_trial(tmp_path, monkeypatch):
    records.write_record(make_record(), tmp_path / "smollm2-bf16", "latency")
    monkeypatch.setenv(records.TRIAL_ENV, "optimize-tiny-smollm2")
    trial = make_record()
    assert trial["trial"] == "optimize-tiny-smollm2"
    path = records.write_record(trial, tmp_path / "smollm2-bf16", "latency")
    assert check_schemas.check_file(path) == []
    assert len(records.all_records("latency", tmp_path)) == 2  # the trial's reader sees both
    monkeypatch.setenv(records.TRIAL_ENV, "optimize-tiny-other")
    assert [r.get("trial") for _, r in records.all_records("latency", tmp_path)] == [None]
    monkeypatch.delenv(records.TRIAL_ENV)
    assert [r.get("trial") for _, r in records.all_records("latency", tmp_path)] == [None]

@pytest.mark.parametrize("edit, field", [
    (lambda r: r["summary"]["fixed"]["1"].pop("median_ttft_ms"), "summary/fixed/1"),
    (lambda r: r["git"].update(commit="abc"), "git/commit"),
    (lambda r: r.update(status="failed"), "failure"),
    (lambda r: r["summary"]["fixed"]["1"].update(output_throughput=-1), "summary/fixed/1/output_throughput"),
    (lambda r: r["inputs"].update(modes=["turbo"]), "inputs/modes/0"),
    (lambda r: r.pop("hardware"), "(top level)"),
    # the number arrays' fast path (scripts.report.schemas._numbers_passing) still fails each bad element by its index
    (lambda r: r["samples"][0]["requests"][0]["itl_s"].__setitem__(3, -0.1), "samples/0/requests/0/itl_s/3"),
    (lambda r: r["samples"][0]["requests"][0]["itl_s"].__setitem__(5, True), "samples/0/requests/0/itl_s/5"),
    (lambda r: r["samples"][0]["requests"][0]["itl_s"].__setitem__(0, "0.1"), "samples/0/requests/0/itl_s/0"),
])
def test_hand_edited_record_fails_with_file_and_field(tmp_path, edit, field):
    rec = copy.deepcopy(make_record())
    edit(rec)
    path = records.write_record(rec, tmp_path, "latency")
    errors = check_schemas.check_file(path)
    assert errors and str(path) in errors[0] and field in " ".join(errors), errors


def test_not_json(tmp_path):
    p = tmp_path / "latency_20260101-000000.json"
    p.write_text("{")
    assert "not valid JSON" in check_schemas.check_file(p)[0]


def test_committed_records_are_valid():
    assert check_schemas.main([]) == 0


def test_compare_ratio_back_to_back_and_excludes_failed(tmp_path):
    exp = tmp_path / "experiments"
    base = make_record("smollm2-bf16", 1.0, ladder="L1")
    fast = make_record("smollm2-bf16", 2.0, ladder="L1")
    fast["variant"], fast["config"]["PARENT"] = "smollm2-fast", "smollm2-bf16"
    bad = make_record("smollm2-bf16", 3.0)
    bad["variant"], bad["status"], bad["failure"] = "smollm2-broken", "failed", "2 of 16 requests failed"
    for rec in (base, fast, bad):
        records.write_record(rec, exp / rec["variant"], "latency")
    missing = compare.Judged("missing", [Criterion("GATE_MAX_MEAN_KLD", 0.05, "max", detail="no parity record")])
    text, rows = compare.build_report(records.all_records("latency", exp),
                                      {"smollm2-bf16": compare.Judged("reference"), "smollm2-fast": missing,
                                       "smollm2-broken": missing})
    line = next(x for x in text.splitlines() if x.startswith("| smollm2-fast"))
    assert "| 2.00 |" in line and "| yes |" in line and "missing: GATE_MAX_MEAN_KLD |" in line
    assert "c=1: none certified" in text and "- smollm2-fast (2.00×): missing GATE_MAX_MEAN_KLD" in text
    assert "smollm2-broken (" in text and "2 of 16 requests failed" in text
    assert compare.main(["--experiments", str(exp), "--out-dir", str(tmp_path / "out"), "--readme", ""]) == 0
    assert list((tmp_path / "out").glob("compare_*.png"))


def test_compare_keeps_each_hardware_newest_record(tmp_path):
    """A variant measured on a CPU and later on a GPU appears in both tables, each with its own newest record."""
    exp = tmp_path / "experiments"
    cpu = make_record("smollm2-bf16", 1.0)
    gpu = make_record("smollm2-bf16", 50.0)
    gpu["hardware"]["gpu"] = {"name": "NVIDIA H100 80GB HBM3", "memory": "81559 MiB", "driver": "1", "count": 1}
    records.write_record(cpu, exp / "smollm2-bf16", "latency", when=records.now_utc())
    records.write_record(gpu, exp / "smollm2-bf16", "latency",
                         when=records.now_utc() + dt.timedelta(seconds=5))
    text, rows = compare.build_report(records.all_records("latency", exp), {"smollm2-bf16": compare.Judged("reference")})
    assert "## NVIDIA H100 80GB HBM3 x1" in text and len([r for r in rows if r["variant"] == "smollm2-bf16"]) == 2


def test_compare_names_the_fastest_certified_variant_per_level(tmp_path):
    """The fastest variant is inconclusive: the winner is the fastest *certified* one, with its evidence lines."""
    exp = tmp_path / "experiments"
    write_ladder(exp, {"smollm2-a": 1.5, "smollm2-b": 3.0})
    kld = Criterion("GATE_MAX_MEAN_KLD", 0.05, "max", value=0.02, lo=0.018, hi=0.022, status="pass")
    top1 = Criterion("GATE_MIN_TOP1", 0.9, "min", value=0.9, lo=0.89, hi=0.91, status="inconclusive",
                     decide="≈24320 tokens would decide it")
    judged = {"smollm2-bf16": compare.Judged("reference"), "smollm2-a": compare.Judged("pass", [kld]),
              "smollm2-b": compare.Judged("inconclusive", [kld, top1])}
    text, rows = compare.build_report(records.all_records("latency", exp), judged)
    assert "Fastest at certified parity, c=1: smollm2-a** — 1.50 [1.17, 1.93]× smollm2-bf16" in text
    assert "- PASS         GATE_MAX_MEAN_KLD = 0.02 [0.018, 0.022]" in text
    assert "- smollm2-b: inconclusive GATE_MIN_TOP1 = 0.9 [0.89, 0.91] — ≈24320 tokens would decide it" in text
    assert compare.plot_pareto(rows, judged, tmp_path / "p.png") and (tmp_path / "p.png").stat().st_size > 0
    # a certified variant slower than BF16 is never "the fastest": the reference is
    judged["smollm2-b"] = compare.Judged("fail", [kld])
    slow = speed_ratio([(0.51, 1.0), (0.49, 1.0)])
    rows_slow = [{**r, "vs_base": {"1": slow.ratio}, "vs_base_ci": {"1": slow}} if r["variant"] == "smollm2-a" else r
                 for r in rows]
    assert "c=1: the BF16 reference** — no certified variant is faster with 95% confidence (the fastest certified, " \
           "smollm2-a, runs at 0.50 [" in "\n".join(compare.winner_lines([r for r in rows_slow if r["base"]], judged))
    # nor is one whose two rounds disagree (a tie), however fast its point estimate
    tie = speed_ratio([(2.0, 1.0), (1.1, 1.0)])
    rows_tie = [{**r, "vs_base": {"1": tie.ratio}, "vs_base_ci": {"1": tie}} if r["variant"] == "smollm2-a" else r
                for r in rows]
    assert "(the fastest certified, smollm2-a, runs at 1.48 [0.03, 66.18]× smollm2-bf16: a tie, its 95% interval " \
           "holds 1.00)" in "\n".join(compare.winner_lines([r for r in rows_tie if r["base"]], judged))


def test_pareto_front():
    pts = [(1.6, 0.015), (1.5, 0.03), (1.05, 0.04), (2.0, 0.3), (0.9, 0.01)]
    assert compare.pareto_front(pts) == [(0.9, 0.01), (1.6, 0.015), (2.0, 0.3)]


def test_quality_v2_lm_eval_record_needs_per_item_outcomes(tmp_path):
    rec = records.envelope("quality", load_variant("smollm2-bf16", target="cpu"), command=["x"], server_command=None)
    rec["inputs"] = {"kind": "lm-eval", "tasks": ["t"], "profile": "full", "limit": None, "plumbing": True,
                     "lm_eval": "0.4.13", "task_meta": {"t": {"version": "2.0", "metric": "acc", "n": 1,
                                                              "items_sha256": "a" * 64}}}
    rec["summary"] = {"tasks": {"t": {"acc": 1.0, "n": 1}}}
    rec["samples"] = [{"task": "t", "doc_id": 0, "item_id": "q0", "score": 1.0, "metrics": {"acc": 1.0}}]
    assert check_schemas.check_file(records.write_record(rec, tmp_path, "quality")) == []
    del rec["samples"][0]["item_id"]
    errors = check_schemas.check_file(records.write_record(rec, tmp_path, "quality"))
    assert errors and "item_id" in errors[0]


def test_compare_certifies_only_through_a_certified_reference():
    """A passing lossless variant on an inconclusive parent is inconclusive against BF16; on a passing parent it
    passes; the reference itself and a failing variant keep their verdicts."""
    from scripts.report.compare import Judged, chain

    configs = {"b": {}, "q": {"PARENT": "b"}, "q-spec": {"PARENT": "q"}, "ok": {"PARENT": "b"},
               "ok-spec": {"PARENT": "ok"}, "bad": {"PARENT": "b"}}
    judged = {"b": Judged("reference"), "q": Judged("inconclusive"), "q-spec": Judged("pass"), "ok": Judged("pass"),
              "ok-spec": Judged("pass"), "bad": Judged("fail")}
    out = chain(judged, configs)
    assert out["q-spec"].verdict == "inconclusive" and "reference q is inconclusive" in out["q-spec"].note
    assert [out[v].verdict for v in ("b", "q", "ok", "ok-spec", "bad")] == ["reference", "inconclusive", "pass", "pass", "fail"]


def test_compare_names_one_winner_across_engines(tmp_path):
    """Per engine, then across engines: a certified llama.cpp peer faster than every certified vLLM variant wins the
    machine's group, each measured against the same BF16 reference."""
    exp = tmp_path / "experiments"
    write_ladder(exp, {"smollm2-a": 1.5, "smollm2-gguf": 2.0},
                 engines={"smollm2-gguf": {"name": "llamacpp", "version": "0.3.36"}})
    drop = Criterion("GATE_MAX_SUITE_DROP[bigbench_lite]", 1.0, "max", value=0.1, lo=-0.3, hi=0.5, status="pass")
    judged = {"smollm2-bf16": compare.Judged("reference"), "smollm2-a": compare.Judged("pass", [drop]),
              "smollm2-gguf": compare.Judged("pass", [drop])}
    text, _ = compare.build_report(records.all_records("latency", exp), judged)
    across = text.split("### Across engines")[1]
    assert "Fastest at certified parity, c=1: smollm2-gguf** — 2.00 [1.56, 2.57]× smollm2-bf16" in across
    assert "Fastest at certified parity, c=1: smollm2-a** — 1.50 [1.17, 1.93]×" in text.split("### Across engines")[0]


def test_bf16_servers_are_the_reference_and_other_engines_on_unquantized_weights():
    configs = {"b": {}, "gguf": {"PARENT": "b", "GGUF_TYPE": "BF16"}, "srv": {"PARENT": "gguf", "ENGINE": "llamaserver"},
               "q8": {"PARENT": "b", "GGUF_TYPE": "Q8_0"}, "q8-srv": {"PARENT": "q8", "ENGINE": "llamaserver"},
               "srv-ngram": {"PARENT": "srv", "ENGINE": "llamaserver", "LLAMASERVER_SPEC_TYPE": "ngram-simple"},
               "fp32": {"PARENT": "b", "SERVE_DTYPE": "float32"}, "orphan": {"PARENT": "gone", "ENGINE": "llamaserver"}}
    assert [v for v in configs if compare.bf16_server(v, configs)] == ["b", "gguf", "srv"]


def test_compare_gives_the_winner_against_the_fastest_bf16_server(tmp_path):
    """Across engines: the winner (a Q8_0 llama-server rung) is named with its ratio to the fastest deployable BF16
    server of the machine (here llama-server on the BF16 GGUF, faster than vLLM's BF16), in the report and the README
    table; an uncertified BF16 server (llama-cpp-python without a soak) is not that server."""
    exp = tmp_path / "experiments"
    rungs = {"smollm2-gguf-bf16": (1.8, {"GGUF_TYPE": "BF16", "ENGINE": "llamacpp"}),
             "smollm2-srv": (1.5, {"PARENT": "smollm2-gguf-bf16", "ENGINE": "llamaserver"}),
             "smollm2-gguf-q8-0": (1.0, {"GGUF_TYPE": "Q8_0", "ENGINE": "llamacpp"}),
             "smollm2-q8-srv": (3.0, {"PARENT": "smollm2-gguf-q8-0", "ENGINE": "llamaserver"})}
    when = records.now_utc()
    for k, jitter in ((1, 1.02), (2, 1 / 1.02)):  # two rounds (write_ladder's jitter)
        ref = make_record("smollm2-bf16", 1.0, ladder="L")
        ref["inputs"]["round"] = k
        records.write_record(ref, exp / "smollm2-bf16", "latency", when=when + dt.timedelta(seconds=k))
        for name, (scale, keys) in rungs.items():
            rec = make_record("smollm2-bf16", scale * jitter, ladder="L")
            rec["variant"], rec["inputs"]["round"] = name, k
            rec["config"] = {k: v for k, v in rec["config"].items() if not k.startswith(("SERVE_", "ENV_"))}
            rec["config"].update({"PARENT": "smollm2-bf16", **keys})
            rec["engine"] = {"name": keys["ENGINE"], "version": "1"}
            records.write_record(rec, exp / name, "latency", when=when + dt.timedelta(seconds=k))
    ok = compare.Judged("pass", [Criterion("GATE_GREEDY_IDENTITY", 0, "max", value=0, status="pass")])
    judged = {"smollm2-bf16": compare.Judged("reference"), "smollm2-gguf-bf16": compare.Judged("missing", note="x"),
              "smollm2-srv": ok, "smollm2-gguf-q8-0": compare.Judged("missing", note="x"), "smollm2-q8-srv": ok}
    recs = records.all_records("latency", exp)
    text, rows = compare.build_report(recs, judged)
    across = text.split("### Across engines")[1]
    assert "c=1: smollm2-q8-srv** — 3.00 [2.33, 3.86]× smollm2-bf16" in across
    assert "; 2.00× the fastest BF16 server here, smollm2-srv (" in across
    configs = {r["variant"]: r["config"] for _, r in recs}
    (row,) = [line for line in compare.winners_table(rows, judged, configs) if "smollm2-q8-srv" in line]
    assert "| 3.00 [2.33, 3.86] | — | 2.00 (smollm2-srv) / — |" in row
    # another model on the same machine is measured against its own BF16 servers only
    for k, jitter in ((1, 1.02), (2, 1 / 1.02)):
        other = make_record("gemma3-270m-bf16", 1.0, ladder="L")
        other["inputs"]["round"] = k
        records.write_record(other, exp / "gemma3-270m-bf16", "latency", when=when + dt.timedelta(seconds=k))
        fast = make_record("gemma3-270m-bf16", 1.5 * jitter, ladder="L")
        fast["variant"], fast["config"]["PARENT"], fast["inputs"]["round"] = "gemma3-270m-fast", "gemma3-270m-bf16", k
        records.write_record(fast, exp / "gemma3-270m-fast", "latency", when=when + dt.timedelta(seconds=k))
    text, _ = compare.build_report(records.all_records("latency", exp), {**judged, "gemma3-270m-bf16":
                                   compare.Judged("reference"), "gemma3-270m-fast": ok})
    line = next(x for x in text.splitlines() if "c=1: gemma3-270m-fast**" in x)
    assert "the fastest BF16 server" not in line, line  # its fastest BF16 server is its own reference


def test_compare_leaves_superseded_variants_out_of_its_tables(tmp_path):
    """A superseded variant gets no row and is never the winner, but still serves as the parent speed of a row that
    names it; a line counts what was left out. main reads SUPERSEDED_BY from the config.env files."""
    exp = tmp_path / "experiments"
    write_ladder(exp, {"smollm2-old": 3.0, "smollm2-old-child": 1.5}, parents={"smollm2-old-child": "smollm2-old"})
    passed = compare.Judged("pass", [Criterion("GATE_GREEDY_IDENTITY", 0, "max", value=0, status="pass")])
    judged = {"smollm2-bf16": compare.Judged("reference"), "smollm2-old": passed, "smollm2-old-child": passed}
    text, rows = compare.build_report(records.all_records("latency", exp), judged, {"smollm2-old": "smollm2-new"})
    assert not any(line.startswith("| smollm2-old |") for line in text.splitlines())
    assert [r["variant"] for r in rows] == ["smollm2-bf16", "smollm2-old-child"]
    child = next(line for line in text.splitlines() if line.startswith("| smollm2-old-child"))
    assert "| 0.50 |" in child and "| 1.50 [1.17, 1.93] |" in child  # × its superseded parent, × BF16 (both rounds)
    assert "c=1: smollm2-old-child**" in text
    assert "1 superseded variant(s) left out of these tables" in text and "smollm2-old (by smollm2-new)" in text
    for name, extra in (("smollm2-bf16", ""), ("smollm2-new", "PARENT=smollm2-bf16\n"),
                        ("smollm2-old", "PARENT=smollm2-bf16\n# replaced\nSUPERSEDED_BY=smollm2-new\n")):
        (exp / name).mkdir(exist_ok=True)
        (exp / name / "config.env").write_text(f"MODEL=weights/x\nBASE=smollm2\n{extra}")
    assert compare.superseded(exp) == {"smollm2-old": "smollm2-new"}
    (exp / "smollm2-old" / "config.env").write_text("MODEL=weights/x\nBASE=smollm2\nSUPERSEDED_BY=smollm2-gone\n")
    assert compare.main(["--experiments", str(exp), "--out-dir", str(tmp_path / "out"), "--readme", ""]) == 2


FULL_DISK = """
import json, resource, sys
from pathlib import Path
from scripts.common import records
out = Path(sys.argv[1])
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # every file this process writes stops at 4 KiB
sys.exit(0 if records.save_record({"samples": ["x" * 100] * 100}, out, "latency") else 1)
"""


def test_a_full_disk_during_a_record_write_keeps_earlier_records_and_says_so(tmp_path):
    """A real write failure (the file size limit makes write() fail with EFBIG, as a full disk fails with ENOSPC): the
    earlier record is byte-identical, no temp file is left, and the error is one line."""
    import subprocess
    import sys

    from scripts.common import paths

    earlier = records.write_record({"samples": [1]}, tmp_path, "latency")
    before = earlier.read_bytes()
    r = subprocess.run([sys.executable, "-c", FULL_DISK, str(tmp_path)], cwd=paths.ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    err = r.stderr.strip()
    assert "\n" not in err and err.startswith("error: could not write a latency record in ") and "File too large" in err
    assert "earlier records are untouched" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == [earlier.name] and earlier.read_bytes() == before


def test_copied_tree_names_its_commit_in_full(monkeypatch):
    """A tree copied elsewhere (the GPU machine) names its commit through LAB_GIT_COMMIT: a full SHA only."""
    from scripts.common.records import git_state

    sha = "3ec047ffadca6a5992d5fb673ac2ce4604ed3224"
    monkeypatch.setenv("LAB_GIT_COMMIT", sha)
    monkeypatch.setenv("LAB_GIT_DIRTY", "1")
    assert git_state() == {"commit": sha, "dirty": True}
    monkeypatch.setenv("LAB_GIT_COMMIT", "3ec047f5")
    with pytest.raises(ValueError, match="LAB_GIT_COMMIT='3ec047f5': give the full 40-character commit SHA"):
        git_state()


def with_roofline(rec: dict, bandwidth: float | None, tpot_over: float | None) -> dict:
    """A GPU record carrying the roofline fields latency.py writes (bandwidth None: not measured, and why)."""
    rec["hardware"]["gpu"] = {"name": "NVIDIA H200", "memory": "143771 MiB", "driver": "1", "count": 1}
    rec["roofline"] = {"bytes": {"weights": {"by_dtype": {"BF16": 8_000_000_000}, "total": 8_000_000_000, "skipped": {}},
                                 "kv_bytes_per_token": 32768, "state_bytes_per_sequence": 26345472},
                       "bytes_note": None,
                       "bandwidth": {"bytes_per_s": bandwidth, "method": "copy", "device": "NVIDIA H200"} if bandwidth
                       else None,
                       "bandwidth_note": None if bandwidth else "not measured: no CUDA device"}
    rec["summary"]["fixed"]["1"]["roofline"] = {"context_tokens": 400.0, "step_bytes": 8.04e9,
                                                "roofline_ms": 2.0 if bandwidth else None,
                                                "tpot_over_roofline": tpot_over}
    return rec


def test_roofline_fields_in_schema_and_a_missing_bandwidth_must_say_why(tmp_path):
    good = records.write_record(with_roofline(make_record(), 4.0e12, 2.5), tmp_path, "latency")
    assert check_schemas.check_file(good) == []
    unmeasured = records.write_record(with_roofline(make_record(), None, None), tmp_path, "latency")
    assert check_schemas.check_file(unmeasured) == []
    silent = with_roofline(make_record(), None, None)
    silent["roofline"]["bandwidth_note"] = None
    errors = check_schemas.check_file(records.write_record(silent, tmp_path, "latency"))
    assert errors and "roofline/bandwidth_note" in " ".join(errors), errors


def test_compare_gpu_table_shows_percent_of_roofline_and_a_dash_without_bandwidth(tmp_path):
    exp = tmp_path / "experiments"
    base = with_roofline(make_record("smollm2-bf16", 1.0), 4.0e12, 2.5)   # roofline / TPOT = 40 %
    fast = with_roofline(make_record("smollm2-bf16", 2.0), None, None)
    fast["variant"], fast["config"]["PARENT"] = "smollm2-fast", "smollm2-bf16"
    for rec in (base, fast):
        records.write_record(rec, exp / rec["variant"], "latency")
    text, _ = compare.build_report(records.all_records("latency", exp),
                                   {"smollm2-bf16": compare.Judged("reference"), "smollm2-fast": compare.Judged("n/a")})
    header = next(x for x in text.splitlines() if x.startswith("| variant"))
    assert "| % of roofline c=1 | % of roofline c=8 |" in header
    cells = lambda v: next(x for x in text.splitlines() if x.startswith(f"| {v} ")).split(" | ")  # noqa: E731
    i = header.split(" | ").index("% of roofline c=1")
    assert cells("smollm2-bf16")[i] == "40" and cells("smollm2-fast")[i] == "—"
    cpu = make_record("smollm2-bf16", 1.0)   # a CPU table has no such column
    records.write_record(cpu, tmp_path / "cpu" / "smollm2-bf16", "latency")
    text, _ = compare.build_report(records.all_records("latency", tmp_path / "cpu"), {"smollm2-bf16": compare.Judged("reference")})
    assert "roofline" not in next(x for x in text.splitlines() if x.startswith("| variant"))


def gpu_round(variant: str, ttft_s: float, itl_s: float, k: int) -> dict:
    """Round k of ladder "G" on a GPU: one request of 10 tokens, its first after ttft_s, the rest itl_s apart."""
    rec = with_roofline(make_record("smollm2-bf16", ladder="G"), 4.0e12, 2.5)
    s = RequestSample("p0", ok=True, start_s=0, end_s=ttft_s + 9 * itl_s, prompt_tokens=5, output_tokens=10,
                      ttft_s=ttft_s, itl_s=[itl_s] * 9)
    rec["samples"], rec["summary"] = [{"mode": "fixed", "concurrency": 1, "requests": [s.to_json()]}], \
        {"fixed": {"1": summarize([s])}}
    rec["variant"], rec["inputs"]["round"] = variant, k
    if variant != "smollm2-bf16":
        rec["config"]["PARENT"] = "smollm2-bf16"
    return rec


def test_compare_gpu_table_gives_the_step_ratio_beside_the_output_rate(tmp_path):
    """A variant whose steps are 2.5x as fast but whose prefill is slower: TPOT x BF16 is BF16's TPOT over its own,
    paired by round with its interval; x BF16 (output tok/s) holds the slower first token."""
    exp, when = tmp_path / "experiments", records.now_utc()
    for k, (ref_itl, fast_itl) in ((1, (0.020, 0.0080)), (2, (0.020, 0.0079))):
        for rec in (gpu_round("smollm2-bf16", 0.09, ref_itl, k), gpu_round("smollm2-fast", 0.17, fast_itl, k)):
            records.write_record(rec, exp / rec["variant"], "latency", when=when + dt.timedelta(seconds=k))
    text, _ = compare.build_report(records.all_records("latency", exp),
                                   {"smollm2-bf16": compare.Judged("reference"), "smollm2-fast": compare.Judged("n/a")})
    header = next(x for x in text.splitlines() if x.startswith("| variant")).split(" | ")
    row = next(x for x in text.splitlines() if x.startswith("| smollm2-fast ")).split(" | ")
    step = speed_ratio([(1 / 0.0080, 1 / 0.020), (1 / 0.0079, 1 / 0.020)])
    out = speed_ratio([(10 / (0.17 + 9 * f), 10 / (0.09 + 9 * 0.020)) for f in (0.0080, 0.0079)])
    assert row[header.index("TPOT × BF16 c=1")] == step.text() and step.ratio > 2.4 and step.lo is not None
    assert row[header.index("× BF16 c=1")] == out.text() and out.ratio < 2.0
    cpu = make_record("smollm2-bf16", 1.0)  # a CPU table has no such column
    records.write_record(cpu, tmp_path / "cpu" / "smollm2-bf16", "latency")
    text, _ = compare.build_report(records.all_records("latency", tmp_path / "cpu"), {"smollm2-bf16": compare.Judged("reference")})
    assert "TPOT" not in next(x for x in text.splitlines() if x.startswith("| variant"))


def test_a_variant_on_llama_cpp_pythons_server_needs_a_passing_soak_to_be_offered():
    """compare.deployable: the serial llama-cpp-python server is no winner without a passing soak; the variants that
    take it as their reference (chain) are judged before, so the same file served by llama-server stays certified."""
    judged = {v: compare.Judged("pass") for v in ("gguf", "gguf-server", "vllm")}
    configs = {"gguf": {"ENGINE": "llamacpp"}, "gguf-server": {"ENGINE": "llamaserver"}, "vllm": {}}
    out = compare.deployable(judged, configs, {})
    assert out["gguf"].verdict == "missing" and "no soak record" in out["gguf"].note
    assert out["gguf-server"].certified and out["vllm"].certified
    assert "a failed soak" in compare.deployable(judged, configs, {"gguf": False})["gguf"].note
    assert compare.deployable(judged, configs, {"gguf": True})["gguf"].certified


def test_compare_leaves_out_a_shortened_run(tmp_path):
    """A newer run with max_tokens capped (make optimize BUDGET=tiny) does not replace the ladder's record."""
    exp = tmp_path / "experiments"
    full = make_record("smollm2-bf16", 1.0)
    short = make_record("smollm2-bf16", 9.0)
    short["inputs"]["max_tokens_cap"] = 32
    records.write_record(full, exp / "smollm2-bf16", "latency", when=records.now_utc())
    records.write_record(short, exp / "smollm2-bf16", "latency", when=records.now_utc() + dt.timedelta(seconds=5))
    groups, excluded = compare.comparable_groups(records.all_records("latency", exp))
    (members,) = groups.values()
    assert members["smollm2-bf16"]["summary"] == full["summary"]
    assert excluded and "shortened run" in excluded[0][2]


def test_a_ratio_is_read_inside_the_variants_own_ladder(tmp_path):
    """The reference measured again in a later ladder (another machine of the same kind, say) that did not measure the
    variant: the variant's ratio stays against the reference of its own ladder."""
    exp = tmp_path / "experiments"
    when = records.now_utc()
    base1, fast = make_record("smollm2-bf16", 1.0, ladder="L1"), make_record("smollm2-bf16", 2.0, ladder="L1")
    fast["variant"], fast["config"]["PARENT"] = "smollm2-fast", "smollm2-bf16"
    base2 = make_record("smollm2-bf16", 4.0, ladder="L2")
    for i, rec in enumerate((base1, fast, base2)):
        records.write_record(rec, exp / rec["variant"], "latency", when=when + dt.timedelta(seconds=i))
    judged = {"smollm2-bf16": compare.Judged("reference"), "smollm2-fast": compare.Judged("reference")}
    text, rows = compare.build_report(records.all_records("latency", exp), judged)
    row = next(r for r in rows if r["variant"] == "smollm2-fast")
    assert row["vs_base"]["1"] == pytest.approx(2.0) and row["b2b"] == "yes"
    assert next(r for r in rows if r["variant"] == "smollm2-bf16")["tput"]["1"] == pytest.approx(40.0)


def test_a_later_lease_of_the_reference_leaves_a_ladder_on_its_own_bf16_server(tmp_path):
    """A ladder of another engine (its BF16 server and a rung on it, L1) without the vLLM reference, which a later lease
    measures alone (L2): the rung's x BF16 stays against its own ladder's BF16 server, back to back, not against the
    later lease's record; the BF16 server itself, with no BF16 link in L1, reads the later record as separate runs."""
    exp = tmp_path / "experiments"
    when = records.now_utc()
    other = make_record("smollm2-bf16", 1.0, ladder="L1")
    other["variant"], other["config"] = "smollm2-sglang", {**other["config"], "ENGINE": "sglang", "PARENT": "smollm2-bf16"}
    fast = make_record("smollm2-bf16", 1.5, ladder="L1")
    fast["variant"], fast["config"] = "smollm2-sglang-fast", {**other["config"], "PARENT": "smollm2-sglang",
                                                               "SGLANG_SPECULATIVE_ALGORITHM": "NEXTN"}
    later = make_record("smollm2-bf16", 4.0, ladder="L2")
    for i, rec in enumerate((other, fast, later)):
        records.write_record(rec, exp / rec["variant"], "latency", when=when + dt.timedelta(seconds=i))
    judged = {v: compare.Judged("reference") for v in ("smollm2-bf16", "smollm2-sglang", "smollm2-sglang-fast")}
    _, rows = compare.build_report(records.all_records("latency", exp), judged)
    row = next(r for r in rows if r["variant"] == "smollm2-sglang-fast")
    assert row["vs_base"]["1"] == pytest.approx(1.5) and row["b2b"] == "yes" and row["base"] == "smollm2-sglang"
    server = next(r for r in rows if r["variant"] == "smollm2-sglang")
    assert server["vs_base"]["1"] == pytest.approx(0.25) and server["b2b"] == "no (separate runs)"
    # a longer chain in the same ladder: a quantized rung and a settings-only engine rung between the rung and the
    # BF16 server; the reference is the BF16 server nearest the base, never the quantized rung
    links = {"smollm2-sglang-open": ({**other["config"], "PARENT": "smollm2-sglang", "REQUEST_GUARD": "0"}, 1.2),
             "smollm2-sglang-int4": ({**other["config"], "PARENT": "smollm2-sglang-open", "CALIBRATE_RECIPE": "w4a16"}, 2.0)}
    for i, (name, (config, x)) in enumerate(links.items()):
        rec = make_record("smollm2-bf16", x, ladder="L1")
        rec["variant"], rec["config"] = name, config
        records.write_record(rec, exp / name, "latency", when=when + dt.timedelta(seconds=10 + i))
    fast["config"]["PARENT"] = "smollm2-sglang-int4"
    records.write_record(fast, exp / fast["variant"], "latency", when=when + dt.timedelta(seconds=20))
    judged |= {v: compare.Judged("reference") for v in links}
    _, rows = compare.build_report(records.all_records("latency", exp), judged)
    row = next(r for r in rows if r["variant"] == "smollm2-sglang-fast")
    assert row["base"] == "smollm2-sglang" and row["vs_base"]["1"] == pytest.approx(1.5)


def test_the_reference_is_found_through_a_parent_not_measured_in_the_group(tmp_path):
    """A llama-server rung whose parent (the llama-cpp-python variant of the same file) has no latency record there:
    its × BF16 is still read against the reference its config.env chain leads to."""
    exp = tmp_path / "experiments"
    base = make_record("smollm2-bf16", 1.0, ladder="L")
    server = make_record("smollm2-bf16", 2.5, ladder="L")
    server["variant"], server["config"]["PARENT"] = "smollm2-gguf-q8-0-server", "smollm2-gguf-q8-0"
    for rec in (base, server):
        records.write_record(rec, exp / rec["variant"], "latency")
    judged = {"smollm2-bf16": compare.Judged("reference"), "smollm2-gguf-q8-0-server": compare.Judged("reference")}
    _, rows = compare.build_report(records.all_records("latency", exp), judged)
    row = next(r for r in rows if r["variant"] == "smollm2-gguf-q8-0-server")
    assert row["base"] == "smollm2-bf16" and row["vs_base"]["1"] == pytest.approx(2.5)


def test_compare_judges_each_kind_of_machine_on_its_own_evidence(tmp_path):
    """One variant laddered on a CPU and on a GPU: each table's gate cell and winner come from that kind's verdicts (a
    GPU server's quality is not certified by a CPU run's records), and judge_all splits the records so."""
    exp = tmp_path / "experiments"
    write_ladder(exp, {"smollm2-a": 1.5})
    for _, rec in records.all_records("latency", exp):  # the same ladder again on a GPU
        rec["hardware"] = {**rec["hardware"], "gpu": {"name": "NVIDIA H100 80GB HBM3", "count": 1}}
        rec["inputs"]["ladder_id"] = "G"
        records.write_record(rec, exp / rec["variant"], "latency", when=records.now_utc() + dt.timedelta(minutes=1))
    judged = compare.PerDevice(cpu={"smollm2-bf16": compare.Judged("reference"), "smollm2-a": compare.Judged("pass")},
                               gpu={"smollm2-bf16": compare.Judged("reference"),
                                    "smollm2-a": compare.Judged("missing", [Criterion("GATE_MAX_MEAN_KLD", 0.05, "max")])})
    text, rows = compare.build_report(records.all_records("latency", exp), judged)
    cpu, gpu = (next(line for line in text.split(f"## {hw}")[1].splitlines() if line.startswith("| smollm2-a "))
                for hw in ("AMD", "NVIDIA"))
    assert cpu.endswith("| pass |") and gpu.endswith("| missing: GATE_MAX_MEAN_KLD |")
    table = "\n".join(compare.winners_table(rows, judged, {}))
    assert "| c=1 | smollm2-a |" in table.split("NVIDIA")[0]
    assert "NVIDIA H100 80GB HBM3 x1 | latency-v1.jsonl | c=1, c=8 | the BF16 reference" in table
    assert compare.device_of({"hardware": {"gpu": {"name": "x"}}}) == "gpu" and compare.device_of({"hardware": {}}) == "cpu"
