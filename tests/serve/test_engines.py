"""Engines behind one HTTP interface: argv, refusals, the fixed-length request (pure logic); the GGUF export's rotary
permutation and tensor names (tiny arrays); and llama.cpp for real (slow): a BF16 and a Q8_0 export of smollm2-bf16
served by llama-cpp-python's server, benched into a record that names the engine, scored by llama.cpp's own logits,
and a server killed mid-run recorded as failed (llama-cpp-python's and llama-server alike)."""

from __future__ import annotations

import json
import threading

import pytest

from scripts.common import engines, paths
from scripts.common.engines import engine_of
from scripts.common.variants import VariantError, load_variant
from scripts.serve import command

GGUF_VARIANT = "smollm2-gguf-q8-0"
SERVER_VARIANT = "smollm2-gguf-bf16-server"
# The fault tests run against both llama.cpp servers on the same Q8_0 file: llama-cpp-python's and llama-server
FAULT_VARIANTS = pytest.mark.parametrize("variant", [GGUF_VARIANT, "smollm2-gguf-q8-0-server"])


def test_engine_of_defaults_to_vllm_and_refuses_unknown_and_foreign_flags(tmp_path):
    assert engines.engine_of(load_variant("smollm2-bf16")).name == "vllm"
    assert engines.engine_of(load_variant(GGUF_VARIANT)).name == "llamacpp"
    with pytest.raises(VariantError, match="valid engines: vllm, llamacpp, llamaserver, sglang"):
        engines.engine_of(load_variant("smollm2-bf16", overrides={"ENGINE": "tgi"}))
    d = tmp_path / "smollm2-mixed"
    d.mkdir()
    (d / "config.env").write_text("MODEL=weights/x.gguf\nBASE=smollm2\nENGINE=llamacpp\nSERVE_MAX_NUM_SEQS=8\n")
    with pytest.raises(VariantError, match="reads LLAMACPP_\\* flags, not SERVE_MAX_NUM_SEQS"):
        engines.engine_of(load_variant("smollm2-mixed", root=tmp_path))


def test_weights_format_is_checked_per_engine():
    with pytest.raises(engines.EngineError, match="safetensors checkpoint: serve a GGUF export"):
        command.check_weights(load_variant("smollm2-bf16", overrides={"ENGINE": "llamacpp"}).serving(),
                              engines.ENGINES["llamacpp"])
    with pytest.raises(engines.EngineError, match="GGUF file: serve it with ENGINE=llamacpp"):
        command.check_weights(load_variant(GGUF_VARIANT, overrides={"ENGINE": "vllm"}).serving(), engines.ENGINES["vllm"])
    with pytest.raises(engines.EngineError, match="ENGINE=llamaserver serves a GGUF file"):
        command.check_weights(load_variant("smollm2-bf16", overrides={"ENGINE": "llamaserver"}).serving(),
                              engines.ENGINES["llamaserver"])
    assert engines.ENGINES["llamaserver"].gguf and engines.ENGINES["llamacpp"].gguf
    assert not engines.ENGINES["vllm"].gguf


def test_llama_server_flags_switches_paths_and_defaults(monkeypatch):
    monkeypatch.setattr(engines, "version", lambda name: "0")
    v = load_variant(SERVER_VARIANT, overrides={"LLAMASERVER_KV_UNIFIED": "1", "LLAMASERVER_NO_WARMUP": "0",
                                                "LLAMASERVER_THREADS": "1",
                                                "LLAMASERVER_SPEC_DRAFT_MODEL": "weights/d/model.gguf"})
    argv = command.serve_argv(v.serving(), engine_of(v), host="127.0.0.1", port=9)
    assert argv[0].endswith("/.venv-llamaserver/bin/llama-server") and "--api-key" not in argv
    assert argv[argv.index("--alias") + 1] == SERVER_VARIANT and argv[argv.index("--parallel") + 1] == "8"
    assert "--kv-unified" in argv and "--no-warmup" not in argv  # 1 adds a switch, 0 leaves it out
    assert argv.count("--threads") == 1 and argv[argv.index("--threads") + 1] == "1"  # the variant's, not the default
    assert argv[argv.index("--ctx-size") + 1] == str(8192 * 8)  # 8192 per slot
    assert argv[argv.index("--spec-draft-model") + 1] == str(paths.ROOT / "weights/d/model.gguf")
    assert engines.fixed_length_body("llamaserver") == {"ignore_eos": True}


def test_llama_server_version_is_its_build(monkeypatch, tmp_path):
    engines.version.cache_clear()
    monkeypatch.setattr(engines, "LLAMASERVER_BIN", tmp_path)
    try:
        with pytest.raises(engines.EngineError, match="run `make install-llama-server`"):
            engines.version("llamaserver")
        fake = tmp_path / "llama-server"
        fake.write_text("#!/bin/sh\necho 'version: 0.6.0-dev (build 11434, commit 515e85511)' >&2\n")
        fake.chmod(0o755)
        engines.version.cache_clear()
        assert engines.version("llamaserver") == "b11434 (515e85511)"
    finally:
        engines.version.cache_clear()


def test_missing_engine_names_the_target_that_installs_it(monkeypatch, tmp_path):
    monkeypatch.setattr(engines, "LLAMACPP_VENV", tmp_path / "nowhere")
    engines.version.cache_clear()
    try:
        with pytest.raises(engines.EngineError, match="run `make install-llamacpp`"):
            engines.version("llamacpp")
        assert engines.describe(load_variant(GGUF_VARIANT)) == {"name": "llamacpp", "version": "unknown"}
    finally:
        engines.version.cache_clear()


def test_flags_follow_each_engines_spelling(monkeypatch):
    v = load_variant(GGUF_VARIANT, overrides={"LLAMACPP_N_BATCH": "256", "LLAMACPP_N_THREADS": "1"})
    monkeypatch.setattr(engines, "version", lambda name: "0")
    argv = command.serve_argv(v.serving(), engine_of(v), host="127.0.0.1", port=9)
    assert argv[1:3] == ["-m", "llama_cpp.server"] and "--api_key" not in argv
    assert argv[argv.index("--n_batch") + 1] == "256" and argv[argv.index("--model_alias") + 1] == GGUF_VARIANT
    assert argv.count("--n_threads") == 1 and argv[argv.index("--n_threads") + 1] == "1"  # the variant's, not the default
    assert argv[argv.index("--interrupt_requests") + 1] == "False"
    s = load_variant("smollm2-bf16", overrides={"ENGINE": "sglang", "SGLANG_MEM_FRACTION_STATIC": "0.2",
                                                "SGLANG_DISABLE_CUDA_GRAPH": "1", "SGLANG_ENABLE_TORCH_COMPILE": "0",
                                                "SGLANG_SLEEP_ON_IDLE": "1"})
    assert command.flags(s.serving()) == ["--mem-fraction-static", "0.2", "--disable-cuda-graph", "--sleep-on-idle"]


def test_fixed_length_request_per_engine():
    assert engines.fixed_length_body("vllm") == {"ignore_eos": True}
    assert engines.fixed_length_body("sglang") == {"ignore_eos": True}
    assert engines.fixed_length_body("llamacpp", [2, 7]) == {"logit_bias": {"2": -100, "7": -100}}


def test_rotary_permutation_matches_llamacpp_layout_and_inverts():
    import numpy as np

    from scripts.levers.gguf.export import permute_rotary, unpermute_rotary

    # one head of dim 4: rows [x0, x1, y0, y1] -> llama.cpp's interleaved [x0, y0, x1, y1]
    w = np.arange(8).reshape(4, 2)
    assert permute_rotary(w, 1)[:, 0].tolist() == [0, 4, 2, 6]
    w = np.random.default_rng(0).normal(size=(3 * 8, 5))  # 3 heads of dim 8
    assert np.array_equal(unpermute_rotary(permute_rotary(w, 3), 3), w)
    assert not np.array_equal(permute_rotary(w, 3), w)


def test_tensor_names_and_tied_output():
    import numpy as np

    from scripts.levers.gguf.export import gguf_tensors

    cfg = {"num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "tie_word_embeddings": True}
    state = {"model.embed_tokens.weight": np.zeros((6, 4)), "lm_head.weight": np.zeros((6, 4)),
             "model.layers.0.self_attn.k_proj.weight": np.arange(8.0).reshape(4, 2),
             "model.layers.0.mlp.down_proj.weight": np.zeros((4, 8)), "model.norm.weight": np.ones(4)}
    out = gguf_tensors(state, cfg)
    assert sorted(out) == ["blk.0.attn_k.weight", "blk.0.ffn_down.weight", "output_norm.weight", "token_embd.weight"]
    assert out["blk.0.attn_k.weight"][:, 0].tolist() == [0, 4, 2, 6]  # one KV head: permuted by head_count_kv


# --- llama.cpp for real ---------------------------------------------------------------------------------------------


def test_the_key_goes_to_each_engines_environment_never_its_argv(tmp_path):
    for name, var in (("vllm", "VLLM_API_KEY"), ("llamacpp", "API_KEY"), ("llamaserver", "LLAMA_API_KEY"),
                      ("sglang", "LAB_SGLANG_API_KEY")):
        (tmp_path / f"v-{name}").mkdir()
        (tmp_path / f"v-{name}" / "config.env").write_text(f"MODEL=weights/x\nBASE=smollm2\nENGINE={name}\n")
        v = load_variant(f"v-{name}", root=tmp_path)
        env = command.serve_env(v.serving(), engine_of(v), "k3y")
        assert env[var] == "k3y" and "k3y" not in command.printable(["x"], env)
        assert command.serve_env(v.serving(), engine_of(v), None) == v.env()


def test_serve_reads_the_key_from_the_environment_or_a_private_file(tmp_path):
    import os
    import subprocess
    import sys

    def serve(*args, **env):
        return subprocess.run([sys.executable, "-m", "scripts.serve", "smollm2-bf16", "--dry-run", *args],
                              cwd=paths.ROOT, capture_output=True, text=True, env={**os.environ, **env}, check=False)

    r = serve(API_KEY="s3cret-env")
    assert r.returncode == 0 and "VLLM_API_KEY=***" in r.stdout and "s3cret" not in r.stdout + r.stderr
    key = tmp_path / "key"
    key.write_text("s3cret-file\n")
    key.chmod(0o644)
    r = serve("--api-key-file", str(key))
    assert r.returncode == 2 and "readable by others (mode 644): chmod 600 it" in r.stderr
    key.chmod(0o600)
    r = serve("--api-key-file", str(key))
    assert r.returncode == 0 and "VLLM_API_KEY=***" in r.stdout and "s3cret" not in r.stdout
    r = serve("--api-key", "s3cret")
    assert r.returncode != 0 and "unrecognized arguments: --api-key" in r.stderr


@pytest.fixture(scope="module")
def q8_export(embedded_weights, tmp_path_factory):
    """smollm2-bf16 exported to Q8_0 by llama.cpp's quantizer (weights/smollm2-gguf-q8-0; kept when present)."""
    from scripts.levers.gguf.export import export

    v = load_variant(GGUF_VARIANT)
    if not (paths.ROOT / v.resolved["MODEL"]).exists():
        export(GGUF_VARIANT, record_dir=tmp_path_factory.mktemp("export"))
    return v


@pytest.mark.slow
def test_export_refuses_what_llamacpp_cannot_take(q8_export, tmp_path):
    from scripts.levers.gguf.export import ExportError, export

    with pytest.raises(ExportError, match="not a GGUF variant"):
        export("smollm2-bf16", record_dir=tmp_path)
    before = (paths.ROOT / q8_export.resolved["MODEL"]).stat().st_mtime
    d = tmp_path / "exp"
    (d / "smollm2-gguf-bad").mkdir(parents=True)
    (d / "smollm2-gguf-bad" / "config.env").write_text(
        "MODEL=weights/.test-bad.gguf\nBASE=smollm2\nENGINE=llamacpp\nGGUF_TYPE=Q9_9\nPARENT=smollm2-bf16\n")
    (d / "smollm2-bf16").mkdir()
    (d / "smollm2-bf16" / "config.env").write_text((paths.EXPERIMENTS / "smollm2-bf16" / "config.env").read_text())
    import scripts.levers.gguf.export as ex

    orig = ex.load_variant
    ex.load_variant = lambda name, **kw: orig(name, root=d, **kw)
    try:
        with pytest.raises(ExportError, match="no file type 'Q9_9'"):
            export("smollm2-gguf-bad", record_dir=tmp_path)
    finally:
        ex.load_variant = orig
    assert not list(paths.WEIGHTS.glob("*.test-bad*")) and not list(paths.WEIGHTS.glob(".test-bad*"))
    assert (paths.ROOT / q8_export.resolved["MODEL"]).stat().st_mtime == before  # nothing else touched


@pytest.mark.slow
def test_llamacpp_parity_is_scored_by_llamacpp(q8_export, tmp_path):
    from scripts.measure import parity as eval_parity

    assert eval_parity.main([GGUF_VARIANT, "--tokens", "256", "--ctx", "128", "--out-dir", str(tmp_path)]) == 0
    rec = json.loads(next(tmp_path.glob("quality_*.json")).read_text())
    p = rec["summary"]["parity"]
    assert rec["inputs"]["backend"] == "llamacpp" and rec["engine"]["name"] == "llamacpp"
    # Q8_0 of the same weights: close to the reference, never identical
    assert 0 < p["mean_kld"] < 0.05 and p["top1_agreement"] > 0.85 and 0.95 < p["ppl_ratio"] < 1.05


@pytest.mark.slow
@FAULT_VARIANTS
def test_llamacpp_bench_names_engine_and_a_killed_server_fails_the_record(q8_export, tmp_path, variant):
    from scripts.common.server import free_port
    from scripts.measure import latency as bench_latency
    from scripts.serve.launch import variant_server

    v = load_variant(variant)
    engine = engine_of(v).name
    with variant_server(v, base_url=None, port=free_port(), purpose="test") as (url, server):
        args = ["--base-url", url, "--concurrency", "1,2", "--modes", "fixed", "--limit", "4", "--out-dir", str(tmp_path)]
        assert bench_latency.main([variant, *args]) == 0
        rec = json.loads(next(tmp_path.glob("latency_*.json")).read_text())
        assert rec["engine"]["name"] == engine and rec["engine"]["version"] == engines.version(engine)
        reqs = [q for s in rec["samples"] for q in s["requests"]]
        # fixed mode: every request ran to exactly its max_tokens (end-of-sequence banned); llama-cpp-python's stream
        # carries no usage (its tokens are counted from the chunks), llama-server's does
        counted = "stream chunks" if engine == "llamacpp" else "usage"
        assert all(q["output_tokens"] == 32 and q["tokens_from"] == counted for q in reqs[:4])
        died = tmp_path / "died"
        killer = threading.Timer(4.0, server.stop)
        killer.start()
        rc = bench_latency.main([variant, *args[:-1], str(died), "--concurrency", "1", "--limit", "16"])
        killer.join()
    assert rc == 1
    failed = json.loads(next(died.glob("latency_*.json")).read_text())
    assert failed["status"] == "failed" and "server no longer healthy" in failed["failure"]
    from scripts.report.compare import build_report

    report, rows = build_report([(died, failed)], {})  # a failed record is listed as not comparable, never ranked
    assert rows == [] and "## Not comparable" in report and f"{variant} (" in report


@pytest.mark.slow
@FAULT_VARIANTS
def test_a_server_killed_during_a_quality_run_leaves_a_failed_record(q8_export, tmp_path, variant):
    """lm-eval against a llama.cpp server stopped mid-run: exit 1, one complete record with status failed that says
    why and passes its schema, no temp file."""
    from scripts.common.server import free_port
    from scripts.measure import quality as eval_quality
    from scripts.report import schemas as check_schemas
    from scripts.serve.launch import variant_server

    v = load_variant(variant)
    with variant_server(v, base_url=None, port=free_port(), purpose="test") as (url, server):
        killer = threading.Timer(12.0, server.stop)  # lm-eval loads in ~5 s; 1,200 items take minutes
        killer.start()
        rc = eval_quality.main([variant, "--tasks", "lab_arith_gen", "--limit", "1200", "--base-url", url,
                                "--out-dir", str(tmp_path)])
        killer.join()
    assert rc == 1
    (path,) = tmp_path.iterdir()
    rec = json.loads(path.read_text())
    assert path.name.startswith("quality_") and rec["status"] == "failed" and rec["samples"] == []
    assert "lm-eval failed" in rec["failure"] and "no longer healthy" in rec["failure"]
    assert check_schemas.check_file(path) == []


@pytest.mark.slow
@FAULT_VARIANTS
def test_a_measuring_script_terminated_midway_stops_its_server_and_writes_nothing(q8_export, tmp_path, variant):
    """SIGTERM to a latency run that started its own server: the server's port is free again afterwards (no orphan
    left to answer the next run's health checks) and no record, partial or not, is written."""
    import signal
    import subprocess
    import sys
    import time

    from scripts.common.server import free_port, port_in_use

    port = free_port()
    log = tmp_path / "bench.log"
    with log.open("w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "scripts.measure.latency", variant, "--port", str(port),
                                 "--concurrency", "1", "--limit", "16", "--out-dir", str(tmp_path / "rec")],
                                cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 300
        while "healthy after" not in log.read_text() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        time.sleep(2)  # into the measurement
        assert proc.poll() is None and port_in_use(f"http://127.0.0.1:{port}"), log.read_text()[-1500:]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 128 + signal.SIGTERM
    assert not port_in_use(f"http://127.0.0.1:{port}"), "the server outlived its measuring script"
    assert not (tmp_path / "rec").exists() or not any((tmp_path / "rec").iterdir())


def test_a_server_is_not_started_on_a_port_in_use():
    import socket

    from scripts.common.server import Server, ServerError

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        url = f"http://127.0.0.1:{busy.getsockname()[1]}"
        with pytest.raises(ServerError, match="already in use"):
            Server(argv=["true"], base_url=url).start()


def test_a_server_sharing_its_port_with_another_process_is_refused():
    """Two real processes listening on one port (SO_REUSEPORT, as vLLM may bind): the server's own check names the
    other process and stops it; alone on a port the check passes."""
    import subprocess
    import sys

    from scripts.common.server import Server, ServerError, free_port, listeners

    port = free_port()
    listen = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1); "
              f"s.bind(('127.0.0.1', {port})); s.listen(); print('up', flush=True); time.sleep(60)")
    other = subprocess.Popen([sys.executable, "-c", listen], stdout=subprocess.PIPE, text=True)
    try:
        assert other.stdout.readline().strip() == "up"
        # launched as start() launches it (start() itself refuses a port that already answers, which is the other
        # half of the protection; SO_REUSEPORT is how a second server gets past it)
        mine = Server(argv=[sys.executable, "-c", listen], base_url=f"http://127.0.0.1:{port}")
        mine.proc = subprocess.Popen(mine.argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
        assert mine.proc.stdout.readline().strip() == "up"
        assert {other.pid, mine.proc.pid} <= listeners(port)
        with pytest.raises(ServerError, match=f"port {port} is also held by process {other.pid}, not this server"):
            mine.check_own_port()
        assert mine.proc.poll() is not None  # stopped
    finally:
        other.kill()
        other.wait()
    alone = Server(argv=[sys.executable, "-c", listen], base_url=f"http://127.0.0.1:{port}")
    alone.proc = subprocess.Popen(alone.argv, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert alone.proc.stdout.readline().strip() == "up"
        alone.check_own_port()
    finally:
        alone.stop()


def test_a_second_serve_on_a_busy_port_is_one_line(embedded_weights, capsys):
    import socket

    from scripts.serve.__main__ import main as serve_main

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc = serve_main(["smollm2-bf16", "--port", str(busy.getsockname()[1])])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and "already in use" in err and "Traceback" not in err


@pytest.mark.slow
def test_a_served_key_is_in_no_process_cmdline_and_guards_v1(q8_export):
    """The real llama.cpp server started with a key (seconds to start): no process's /proc/<pid>/cmdline holds the
    key, and /v1 refuses a request without it."""
    from scripts.common.server import free_port
    from scripts.serve.launch import make_server
    from tests.conftest import assert_key_guarded

    key = "k3y-" + "x" * 20
    server = make_server(q8_export, host="127.0.0.1", port=free_port(), api_key=key)
    server.start()
    try:
        server.wait_healthy(120)  # its health path, /v1/models, asked with the key
        assert_key_guarded(server.base_url, key)
    finally:
        server.stop()


# --- llama-server for real ------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_llama_server_ngram_speculation_drafts_and_keeps_greedy_output(bf16_export, tmp_path):
    """llama-server with n-gram speculation against llama-server without it, both real: every answer at c=1 and c=4
    (parallel slots batched) has the reference's greedy ids, or diverges only at a teacher-forced near-tie; the record
    names the engine and counts the drafts."""
    from scripts.measure import identity
    from scripts.report import schemas as check_schemas

    rc = identity.main(["smollm2-gguf-bf16-server-ngram4", "--limit", "4", "--max-tokens", "48", "--concurrency",
                        "1,4", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("quality_*.json")
    rec = json.loads(path.read_text())
    assert rc == 0 and check_schemas.check_file(path) == []
    assert rec["engine"]["name"] == "llamaserver" and rec["inputs"]["reference"] == "smollm2-gguf-bf16-server"
    assert rec["summary"]["identity"]["sequences"] == 8 and rec["summary"]["identity"]["divergences_beyond_tie"] == 0
    spec = rec["engine_counters"]["speculative"]
    assert spec["draft_tokens"] > 0 and 0 <= spec["acceptance_rate"] <= 1 and spec["mean_tokens_per_step"] >= 1


@pytest.mark.slow
def test_llama_server_answers_fuzzed_bodies_with_2xx_or_4xx(bf16_export, tmp_path):
    """`make fuzz VARIANT=smollm2-gguf-bf16-server` in small: scripts.measure.fuzz starts llama-server behind the
    lab's request front, sends 60 of the drawn bodies (named for its served model) and writes a record that passes its
    schema; every answer is 2xx or 4xx and the server healthy after each (llama-server alone answers a `tools` field
    that is not an array and a negative token id to /detokenize with 500: the front answers them 400)."""
    from scripts.common.server import free_port
    from scripts.measure import fuzz
    from scripts.report import schemas as check_schemas

    rc = fuzz.main(["smollm2-gguf-bf16-server", "--cases", "60", "--port", str(free_port()), "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("fuzz_*.json")
    rec = json.loads(path.read_text())
    assert check_schemas.check_file(path) == []
    assert rec["engine"]["name"] == "llamaserver" and rec["summary"]["cases"] == 60
    assert [s for s in rec["samples"] if s["outcome"] != "ok"] == [] and rc == 0 and rec["status"] == "ok"
