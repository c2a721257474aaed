"""The CPU step profile's pure parts: self times from nested trace events, categories, weight bytes (its py-spy parts:
tests/measure/test_host_sample.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from scripts.common.checkpoint import TensorInfo
from scripts.measure import cpu_profile as cp


def op(name: str, ts: float, dur: float, cat: str = "cpu_op", tid: int = 1) -> dict:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def step(ts: float) -> dict:
    return op("execute_context_0(0)_generation_1(1)", ts, 30.0, cat="user_annotation")


def scope(name: str, ts: float, dur: float) -> dict:
    return op(f"{cp.SCOPE_PREFIX}{name}", ts, dur, cat="user_annotation")


def test_self_times_subtract_children_per_thread():
    events = [op("outer", 0, 100), op("inner", 10, 30), op("inner2", 50, 20), op("other thread", 0, 100, tid=2)]
    got = {e["name"]: (s, [a["name"] for a in anc]) for e, s, anc in cp.self_times(events)}
    assert got["outer"] == (50.0, [])
    assert got["inner"] == (30.0, ["outer"])
    assert got["inner2"] == (20.0, ["outer"])
    assert got["other thread"] == (100.0, [])


def test_gemm_is_split_by_the_scope_it_runs_in():
    fwd, post = scope("forward", 0, 50), scope("postprocess", 60, 20)
    mm = op("_C::onednn_mm", 5, 10)
    assert cp.category_of(mm, [fwd]) == "gemm:layers"
    assert cp.category_of(op("_C::onednn_mm", 61, 5), [post]) == "gemm:lm_head"
    # an unclassified op inside a classified one inherits its category; inside a scope only, the scope's
    assert cp.category_of(op("aten::view", 6, 1), [fwd, op("_C::cpu_attention_with_kv_cache", 5, 3)]) == "attention"
    assert cp.category_of(op("aten::slice", 6, 1), [fwd]) == "runner: forward"
    assert cp.category_of(op("aten::slice", 6, 1), []) == "outside scopes"


def test_step_table_accounts_for_the_whole_period():
    events = [step(0), scope("forward", 1, 20), op("## Call CompiledFxGraph abc", 2, 18), op("_C::onednn_mm", 3, 10),
              step(40), scope("forward", 41, 20), op("## Call CompiledFxGraph abc", 42, 18), op("_C::onednn_mm", 43, 10),
              step(80)]
    table = cp.step_table(events)
    per = table["per_step_us"]
    assert table["periods"] == 2 and table["step_us"] == 40.0
    assert per["gemm:layers"] == 10.0
    assert per["compiled graph (fused kernels)"] == 8.0
    assert per["runner: forward"] == 2.0
    assert sum(per.values()) == pytest.approx(40.0)
    assert per["between steps"] == pytest.approx(10.0)


def test_step_table_refuses_an_empty_window():
    with pytest.raises(cp.ProfileError, match="fewer than two engine step"):
        cp.step_table([step(0)])


def test_weight_bytes_count_the_tied_embedding_once_as_the_lm_head():
    tensors = {"model.embed_tokens.weight": TensorInfo("BF16", (100, 8), "a"),
               "model.layers.0.mlp.up_proj.weight": TensorInfo("BF16", (16, 8), "a"),
               "model.layers.0.input_layernorm.weight": TensorInfo("BF16", (8,), "a")}
    assert cp.weight_bytes(tensors, {"tie_word_embeddings": True}) == {
        "gemm:lm_head": 1600, "gemm:layers": 256, "other": 16}
    assert "gemm:lm_head" not in cp.weight_bytes(tensors, {"tie_word_embeddings": False})


def test_model_threads_from_this_starts_log_only(tmp_path: Path):
    """The binding line of this start counts, not an earlier start's in the same (appended) log; without one (the
    uniprocess executor) the server's OMP_NUM_THREADS does."""
    from scripts.common.server import Server
    from scripts.common.variants import load_variant

    log = tmp_path / "server.log"
    log.write_text("(EngineCore pid=1) INFO [ompmultiprocessing.py:185] \tlocal_rank=0, core ids=[0, 1]\n")
    server = Server(argv=["x"], base_url="http://127.0.0.1:9", log_path=log)
    server.log_offset = log.stat().st_size  # as Server.start sets it
    with log.open("a") as f:
        f.write("no binding: the uniprocess executor\n")
    assert cp.vllm_cpu_cores(server.log_text())["compute_threads"] is None
    assert cp.vllm_cpu_cores(log.read_text())["compute_threads"] == 2
    env = load_variant("smollm2-bf16", overrides={"ENV_OMP_NUM_THREADS": "2"}).env()
    assert cp.vllm_cpu_cores(server.log_text(), env)["compute_threads"] == 2


def test_floor_rows_and_projection_are_labelled():
    rows = cp.floor_rows({"gemm:layers": 1000.0, "between steps": 500.0}, {"gemm:layers": 15_000_000}, read_gbs=30.0)
    assert rows[0]["roofline_us"] == 500.0 and rows[1]["roofline_us"] is None
    model = cp.step_model(1500.0, 1000.0, 15_000_000, {"engine": {"read_gbs": 30.0}, "all": {"read_gbs": 60.0}})
    assert "projection" in model["projection"]["label"] and model["projection"]["step_us"] == 1000.0


@pytest.mark.slow
def test_the_cpu_profile_of_a_real_server_and_llamacpp(embedded_server, tmp_path: Path):
    """scripts.measure.cpu_profile end to end on this CPU: the real vLLM server under the torch profiler and py-spy,
    llama.cpp on the BF16 GGUF of the same weights, one record that passes the profile schema, whose step table
    accounts for the step and whose GEMM rows carry the weights' bytes. It starts its own server of the same variant
    once the session server (embedded_server) has compiled, so the compile cache serves its start."""
    import json
    import os

    from scripts.common import paths
    from scripts.common.server import free_port
    from scripts.common.variants import load_variant
    from scripts.levers.gguf.export import export
    from scripts.report import schemas as check_schemas
    from tests.conftest import server_args

    if not (paths.ROOT / load_variant("smollm2-gguf-bf16").resolved["MODEL"]).exists():
        export("smollm2-gguf-bf16", record_dir=tmp_path / "export")
    # the session server's dtype (tests/conftest.py TEST_DTYPE): the same compiled graphs, so its compile cache serves
    rc = cp.main(["smollm2-bf16", "--concurrency", "1", "--output-tokens", "40", "--window-steps", "16",
                  "--peer", "smollm2-gguf-bf16", "--port", str(free_port()), "--out-dir", str(tmp_path),
                  *server_args()])
    (path,) = tmp_path.glob("profile_*.json")
    rec = json.loads(path.read_text())
    assert rc == 0 and rec["status"] == "ok" and check_schemas.check_file(path) == []
    level = rec["summary"]["1"]
    rows = {r["category"]: r for r in level["table"]}
    assert sum(r["us_per_step"] for r in rows.values()) == pytest.approx(level["step_us"], rel=0.01)
    assert rows["gemm:layers"]["bytes_per_step"] > 0 and rows["gemm:layers"]["roofline_us"] > 0
    assert rec["inputs"]["model_threads"] >= 1 and rec["floor"]["weight_bytes_per_token"] > 2e8
    assert rec["host"]["1"]["processes"]["engine_core"]["samples"] > 0
    assert {"1", str(os.cpu_count())} <= set(rec["peer"]["by_threads"])
    assert all(r["ms_per_token"] > 0 for r in rec["peer"]["by_threads"].values())
