"""bench_latency against the real embedded server (shared session fixture) and its bad-input paths."""

from __future__ import annotations

import json

import pytest

from scripts.common.server import free_port
from scripts.measure import latency as bench_latency
from scripts.report import schemas as check_schemas


def test_unreachable_server_is_one_clear_error(capsys):
    code = bench_latency.main(["smollm2-bf16", "--base-url", f"http://127.0.0.1:{free_port()}"])
    err = capsys.readouterr().err
    assert code == 1 and "error: no healthy server at" in err


def test_a_topology_with_a_replica_down_is_refused_naming_it(tmp_path, capsys):
    down = f"http://127.0.0.1:{free_port()}"
    topo = tmp_path / "topology.json"
    topo.write_text(json.dumps({"router": "vllm-router", "policy": "round_robin", "base_url": down, "replicas": [
        {"url": down, "pid": 1, "placement": {}}], "tensor_parallel": 1, "data_parallel": 1, "gpus": 0}))
    assert bench_latency.main(["smollm2-bf16", "--topology", str(topo)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: replica {down} of {topo} is down") and len(err.splitlines()) == 1, err


def test_empty_prompt_set(tmp_path):
    (tmp_path / "p.jsonl").write_text("\n")
    from scripts.common.loadgen import PromptSetError, load_prompts

    with pytest.raises(PromptSetError, match="is empty"):
        load_prompts(tmp_path / "p.jsonl")


def test_an_slo_needs_both_targets(capsys):
    assert bench_latency.main(["smollm2-bf16", "--base-url", "http://127.0.0.1:9", "--slo-ttft-ms", "1000"]) == 1
    assert "go together" in capsys.readouterr().err


def test_sessions_are_prompt_groups_else_ids():
    from scripts.common.loadgen import with_sessions

    rows = with_sessions([{"id": "a/1", "group": "a"}, {"id": "a/2", "group": "a"}, {"id": "b"}])
    assert [r["session"] for r in rows] == ["a", "a", "b"]


def test_bad_concurrency():
    with pytest.raises(ValueError, match="levels must be >= 1"):
        bench_latency.parse_levels("1,0")


@pytest.mark.slow
def test_short_real_run_writes_valid_record(embedded_server, embedded_weights, tmp_path):
    code = bench_latency.main(["smollm2-bf16", "--base-url", embedded_server.base_url, "--limit", "4",
                               "--concurrency", "1,2", "--modes", "fixed,natural", "--max-tokens-cap", "8",
                               "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("latency_*.json")
    assert check_schemas.check_file(path) == []
    rec = json.loads(path.read_text())
    fixed = rec["summary"]["fixed"]
    assert fixed["1"]["completed"] == 4 and fixed["1"]["failed"] == 0
    assert fixed["2"]["total_output_tokens"] == 4 * 8, "fixed mode must generate exactly max_tokens"
    assert all(r["ttft_s"] > 0 for lvl in rec["samples"] for r in lvl["requests"])
    assert rec["server_metrics"]["kv_cache_tokens"] > 0
    assert 0 < rec["host_cpu"]["busy_share"] <= 1 and rec["host_cpu"]["cpus"] >= 1  # a server was generating
    assert rec["server_metrics"]["prefix_cache_queries"] is not None
    assert rec["topology"] == {"router": None, "policy": None, "replicas": 1, "tensor_parallel": 1, "data_parallel": 1,
                               "gpus": 0, "shared_gpu": False}
    assert fixed["1"]["servers"][0]["requests"] == 4 and fixed["1"]["servers"][0]["url"] == embedded_server.base_url
    # the server's own split of the first token (vLLM's phase histograms over this level's four requests): its prefill
    # inside its TTFT, its TTFT inside the client's
    phase = fixed["1"]["servers"][0]["phase_ms"]
    assert 0 < phase["prefill"] <= phase["ttft"] <= fixed["1"]["mean_ttft_ms"] and phase["queue"] >= 0
    assert set(fixed["1"]["servers"][0]["phase_requests"].values()) == {4.0}
    assert bench_latency.phase_line([{"phase_ms": phase}, {"phase_ms": {"ttft": None}}]).endswith(
        f"{phase['ttft']:.1f}/{phase['prefill']:.1f}, —/—")
    # roofline accounting: SmolLM2's bytes from its headers (tied embedding read as the output layer; 30 layers x K,V x
    # 3 KV heads x 64 x 2 B per token), no bandwidth on a CPU and therefore no ratio, never an assumed figure
    roof = rec["roofline"]
    assert roof["bytes"]["kv_bytes_per_token"] == 30 * 2 * 3 * 64 * 2 and roof["bytes"]["tied_embedding"]
    from scripts.common.checkpoint import read_checkpoint

    # every tensor is read each step, all BF16: 2 B per parameter (the files also hold their headers)
    assert roof["bytes"]["weights"]["by_dtype"] == {"BF16": 2 * read_checkpoint(embedded_weights).num_params}
    assert roof["bandwidth"] is None and roof["bandwidth_note"] == "not measured: CPU record"
    lv = fixed["1"]["roofline"]
    assert lv["step_bytes"] > roof["bytes"]["weights"]["total"] and lv["tpot_over_roofline"] is None


def test_vllm_bench_client_writes_the_same_record(embedded_server, tmp_path, capsys):
    """--client vllm-bench: vLLM's own bench serve sends and times the level (random prompts of the asked shape,
    exactly the asked output tokens), the lab summarizes vLLM's per-request timings as its own client's, and vLLM's
    headline figures sit beside them; the record names a prompt set of its own (compare tables it apart)."""
    code = bench_latency.main(["smollm2-bf16", "--base-url", embedded_server.base_url, "--client", "vllm-bench",
                               "--vllm-bench-shape", "24,6", "--limit", "3", "--concurrency", "2", "--modes", "fixed",
                               "--out-dir", str(tmp_path)])
    assert code == 0, capsys.readouterr().err
    (path,) = tmp_path.glob("latency_*.json")
    assert check_schemas.check_file(path) == []
    rec = json.loads(path.read_text())
    assert rec["inputs"]["client"] == "vllm-bench" and rec["inputs"]["prompt_set"] == "vllm-bench-random-24-6"
    lvl = rec["summary"]["fixed"]["2"]
    assert lvl["completed"] == 3 and lvl["total_output_tokens"] == 3 * 6
    reqs = rec["samples"][0]["requests"]
    assert all(r["prompt_tokens"] == 24 and r["ttft_s"] > 0 and len(r["itl_s"]) == 5 for r in reqs)
    peer = lvl["vllm_bench"]
    assert peer["completed"] == 3 and peer["median_tpot_ms"] == pytest.approx(lvl["median_tpot_ms"], rel=0.02)
    # bad input, refused before any server starts: a mode vLLM's bench does not have, a shape without IN,OUT, a
    # variant another engine serves
    assert bench_latency.main(["smollm2-bf16", "--client", "vllm-bench", "--modes", "fixed,natural"]) == 1
    assert "--modes other than fixed" in capsys.readouterr().err
    assert bench_latency.main(["smollm2-bf16", "--client", "vllm-bench", "--vllm-bench-shape", "24"]) == 1
    assert "IN,OUT" in capsys.readouterr().err
    assert bench_latency.main(["smollm2-sglang", "--client", "vllm-bench"]) == 1
    assert "is served by sglang" in capsys.readouterr().err
    assert bench_latency.main(["smollm2-bf16", "--client", "vllm-bench", "--limit", "0"]) == 1
    assert "--limit 0: requests a level is a count of at least 1" in capsys.readouterr().err


OLD = {"ttfts": [0.1, 0.0], "itls": [[0.01, 0.02], []], "input_lens": [5, 5], "output_lens": [3, 0], "errors": ["", "boom"]}


def test_vllm_bench_samples_from_an_older_result_without_latencies():
    """A release whose detailed result has no latencies or start times: a request ends at its TTFT plus its gaps; a
    failed request stays a failure."""
    from scripts.measure.vllm_bench import VllmBenchError, samples_of

    got = samples_of(OLD)
    assert got[0].ok and got[0].e2el_s == pytest.approx(0.13) and got[0].tpot_s == pytest.approx(0.015)
    assert not got[1].ok and got[1].error == "boom"
    assert got[1].error == "boom" and samples_of({**OLD, "errors": ["", "Traceback\n  ...\nTimeoutError: read"]})[
        1].error == "TimeoutError: read"  # the last line of a traceback
    with pytest.raises(VllmBenchError, match="no per-request data"):
        samples_of({"completed": 0})
    with pytest.raises(VllmBenchError, match="not as many output_lens"):
        samples_of({**OLD, "output_lens": [3]})


def test_a_vllm_bench_result_cut_short_is_one_error(tmp_path, monkeypatch):
    """A level whose result file is cut short (its process killed while writing it) fails as VllmBenchError, which
    keeps the earlier levels, not as a JSON traceback."""
    from scripts.measure import vllm_bench

    cut = ("import json, sys, pathlib; a = json.loads(sys.argv[1]); "
           "d = pathlib.Path(a[a.index('--result-dir') + 1]); (d / a[a.index('--result-filename') + 1]).write_text('{\"dur')")
    monkeypatch.setattr(vllm_bench, "RUNNER", cut)
    with pytest.raises(vllm_bench.VllmBenchError, match="at c=2 does not read as JSON"):
        vllm_bench.run_level("http://127.0.0.1:9/v1", "m", "t", (8, 4), 2, 2, timeout_s=30)


def test_open_loop_levels_and_repeats(embedded_server, tmp_path):
    """--repeat multiplies the requests of every level; --request-rate adds Poisson levels in rate_sweep; with an SLO
    every level records its goodput (a TTFT target of an hour: every request is within it); a session header rides
    along."""
    code = bench_latency.main(["smollm2-bf16", "--base-url", embedded_server.base_url, "--limit", "2", "--repeat", "3",
                               "--concurrency", "4", "--request-rate", "20", "--modes", "fixed", "--max-tokens-cap", "4",
                               "--slo-ttft-ms", "3600000", "--slo-tpot-ms", "3600000", "--session-header",
                               "--out-dir", str(tmp_path)])
    assert code == 0
    (path,) = tmp_path.glob("latency_*.json")
    assert check_schemas.check_file(path) == []
    rec = json.loads(path.read_text())
    assert rec["summary"]["fixed"]["4"]["completed"] == 6
    assert rec["summary"]["fixed"]["4"]["goodput"]["requests"] == 6
    assert rec["inputs"]["session_header"] == "X-Session-ID" and rec["inputs"]["slo"]["ttft_ms"] == 3600000
    (level,) = rec["rate_sweep"]
    assert level["request_rate"] == 20 and level["summary"]["completed"] == 6
    assert level["summary"]["goodput"]["output_throughput"] == pytest.approx(level["summary"]["output_throughput"])
    starts = sorted(r["start_s"] for r in rec["samples"][-1]["requests"])
    assert starts[-1] > 0.05, "open-loop requests are spread over their arrival times"


def test_poisson_arrivals_are_seeded_and_have_the_asked_rate():
    from scripts.common.loadgen import poisson_arrivals, repeat_rows

    a = poisson_arrivals(4000, 8.0, seed=1)
    assert a == poisson_arrivals(4000, 8.0, seed=1) and a != poisson_arrivals(4000, 8.0, seed=2)
    assert all(x < y for x, y in zip(a, a[1:], strict=False))
    assert abs(len(a) / a[-1] - 8.0) < 0.5
    with pytest.raises(ValueError, match="must be > 0"):
        poisson_arrivals(3, 0.0, seed=0)
    rows = [{"id": "a"}, {"id": "b"}]
    assert [r["id"] for r in repeat_rows(rows, 2)] == ["a#0", "b#0", "a#1", "b#1"] and repeat_rows(rows, 1) is rows


@pytest.mark.slow
def test_failed_requests_are_counted_not_dropped(embedded_server, tmp_path):
    prompts = tmp_path / "beyond-context.jsonl"
    row = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 100_000}  # > the 8192-token context
    prompts.write_text("".join(json.dumps({"id": f"p{i}", **row}) + "\n" for i in range(4)))
    code = bench_latency.main(["smollm2-bf16", "--base-url", embedded_server.base_url, "--prompts", str(prompts),
                               "--concurrency", "1", "--modes", "fixed", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("latency_*.json")
    rec = json.loads(path.read_text())
    assert code == 1 and rec["status"] == "failed" and "requests failed" in rec["failure"]
    assert rec["summary"]["fixed"]["1"]["failed"] == 4
    assert check_schemas.check_file(path) == []


@pytest.mark.slow
def test_chat_latency_turns(embedded_server, tmp_path):
    from scripts.measure import chat_latency as bench_chat_latency

    out = tmp_path / "chat.json"
    assert bench_chat_latency.main([embedded_server.variant, "--base-url", embedded_server.base_url, "--turns", "3",
                                    "--max-tokens", "8", "--out", str(out)]) == 0
    turns = json.loads(out.read_text())["turns"]
    assert [t["turn"] for t in turns] == [1, 2, 3]
    assert turns[2]["prompt_tokens"] > turns[0]["prompt_tokens"], "history is not resent"
    assert all(t["ttft_ms"] > 0 for t in turns)


@pytest.mark.slow
def test_monitor_one_probe_exports_gauges(embedded_server, capsys):
    from scripts.common.server import http_get
    from scripts.measure import monitor

    port = free_port()
    assert monitor.main([embedded_server.variant, "--base-url", embedded_server.base_url, "--batch", "2",
                         "--probes", "1", "--every", "0", "--port", str(port)]) == 0
    assert "probe 1:" in capsys.readouterr().out
    status, body = http_get(f"http://127.0.0.1:{port}/metrics")
    assert status == 200 and b'variant_lab_output_throughput{variant="smollm2-bf16"}' in body


def test_engine_cores_from_the_vllm_log_and_the_llamacpp_command(tmp_path):
    from scripts.common.server import Server

    log = tmp_path / "engine.log"
    # the worker's binding line counts, not the engine core's "Reducing Torch threads" (the scheduler process)
    log.write_text("INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n"
                   "INFO [ompmultiprocessing.py:185] \treserved_cpus=[]\n"
                   "INFO [torch_utils.py:295] Reducing Torch threads from 2 to 1 for serving.\n")
    vllm = Server(argv=["vllm", "serve"], base_url="http://x", log_path=log)
    assert bench_latency.engine_cores(vllm, gpu=False) == {"compute_threads": 2, "model_cpus": [0, 1],
                                                           "reserved_cpus": [], "source": "vLLM start log"}
    log.write_text("no binding: the uniprocess executor\n")
    assert bench_latency.engine_cores(vllm, gpu=False)["compute_threads"] is None
    uni = Server(argv=["vllm", "serve"], base_url="http://x", log_path=log, env={"OMP_NUM_THREADS": "2"})
    assert bench_latency.engine_cores(uni, gpu=False) == {"compute_threads": 2, "model_cpus": [], "reserved_cpus": [],
                                                          "source": "OMP_NUM_THREADS"}
    assert bench_latency.engine_cores(vllm, gpu=True) is None
    llama = Server(argv=["python", "-m", "llama_cpp.server", "--n_threads", "2"], base_url="http://x")
    assert bench_latency.engine_cores(llama, gpu=False)["compute_threads"] == 2
    server = Server(argv=["llama-server", "--threads", "1"], base_url="http://x")
    assert bench_latency.engine_cores(server, gpu=False) == {"compute_threads": 1, "reserved_cpus": [],
                                                             "source": "llama.cpp --threads"}
    assert bench_latency.engine_cores(None, gpu=False) is None


def test_busy_share_of_two_cpu_readings():
    from scripts.common.hardware import busy_share, cpu_jiffies

    assert busy_share((100, 400), (160, 500)) == 0.6
    assert busy_share(None, (1, 2)) is None and busy_share((5, 10), (5, 10)) is None
    busy, total = cpu_jiffies()
    assert 0 <= busy <= total


def test_sglangs_acceptance_from_its_log():
    """SGLang (no /metrics without --enable-metrics) says its tokens a step in its log: the excerpt of a K=3 rung's log
    from the 2026-12-07 round (random weights: 1.00) and lines of other values give their mean; a plain log none."""
    from pathlib import Path

    from scripts.common.records import tokens_a_step

    logs = Path(__file__).resolve().parents[2] / "results/gpu-sglang-20261207c"
    k3 = bench_latency.sglang_acceptance((logs / "qwen35-4b-dummy-sglang-mtp3-server.log").read_text())
    assert k3["spec_decode_mean_acceptance_length"] == 1.0 and "decode-batch lines" in k3["spec_decode_source"]
    assert bench_latency.sglang_acceptance((logs / "qwen35-4b-dummy-sglang-server.log").read_text()) == {}
    line = "[2026-12-07 05:48:20] Decode batch, #running-req: 1, mamba usage: 0.19, accept len: {}, accept rate: 0.5"
    got = bench_latency.sglang_acceptance("\n".join(line.format(x) for x in ("2.50", "3.50")))
    assert got["spec_decode_mean_acceptance_length"] == 3.0
    assert tokens_a_step({"server_metrics": {"available": False, **got}}) == 3.0
