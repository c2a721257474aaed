"""py-spy's raw stacks reduced to busy time by part and by thread, a thread's share of a step, and the command's
refusals before any server starts."""

from __future__ import annotations

from scripts.measure import host_sample as hs

SPIN = "run_busy_loop (vllm/v1/engine/core.py:1);MessageQueue.acquire_read (shm.py:1);SpinCondition.wait (shm.py:2)"
SCHED = "EngineCore.step (core.py:1);Scheduler.schedule (sched/scheduler.py:3);OpOverloadPacket.__call__ (torch/_ops.py:1)"
DETOK = "output_handler (async_llm.py:1);IncrementalDetokenizer.update (vllm/v1/engine/detokenizer.py:9)"


def test_host_parts_and_split():
    assert hs.host_part(SPIN) == "waiting for the worker (shared-memory spin)"
    assert hs.host_part(SCHED) == "scheduler"
    assert hs.host_part(DETOK) == "detokenization"
    assert hs.host_part("main (x.py:1)") == "other"
    split = hs.host_split(f"{SPIN} 50\n{SCHED} 25\nnot a line\n", rate_hz=100, tokens=10)
    assert split["samples"] == 75
    assert split["busy_ms_per_token"] == 75.0
    assert split["parts_ms_per_token"]["scheduler"] == 25.0
    assert "threads_ms_per_token" not in split  # py-spy without -t names no thread


def test_threads_are_split_off_and_their_share_of_a_step():
    # py-spy -t: "thread (tid): name;frames"; the thread's name must not decide the part (asyncio_0 is not the loop)
    raw = (f"thread (0x1): MainThread;{SCHED} 40\nthread (0x2): asyncio_0;{DETOK} 10\n"
           f"thread (0x1): MainThread;{SPIN} 10\nthread (0x3): asyncio_1;main (x.py:1) 5\n")
    split = hs.host_split(raw, rate_hz=100, tokens=10)  # 10 ms a sample, 10 tokens
    assert split["threads_ms_per_token"] == {"MainThread": 50.0, "asyncio_0": 10.0, "asyncio_1": 5.0}
    assert split["parts_ms_per_token"] == {"scheduler": 40.0, "detokenization": 10.0,
                                           "waiting for the worker (shared-memory spin)": 10.0, "other": 5.0}
    assert hs.split_thread("thread (0x1): MainThread") == ("MainThread", "")
    assert hs.split_thread(f"thread (29262);{SCHED}") == ("thread (29262)", SCHED)  # a thread without a name
    sync = "run (core.py:1);get_output (gpu_model_runner.py:2);synchronize (torch/cuda/streams.py:3)"
    assert hs.host_part(sync) == "waiting for the GPU (synchronize, tolist)"  # not "model step"
    # 50 ms per token x 10 tokens = 0.5 s busy in a pass of 0.625 s
    assert hs.shares(split, 10, 0.625)["MainThread"] == 0.8
    assert hs.shares(split, 10, 0.0) == {}


def test_refusals_name_the_argument(tmp_path, capsys):
    fake = tmp_path / "py-spy"
    fake.write_text("")
    cases = [(["smollm2-bf16", "--concurrency", "0", "--py-spy", str(fake)], "--concurrency '0': levels must be >= 1"),
             (["smollm2-bf16", "--base-url", "http://127.0.0.1:1", "--py-spy", str(fake)],
              "--base-url and --server-pid go together"),
             (["smollm2-bf16", "--output-tokens", "1", "--py-spy", str(fake)], "--output-tokens 1: at least 2"),
             (["smollm2-bf16", "--window-s", "0", "--py-spy", str(fake)], "--window-s 0.0: a positive number"),
             (["smollm2-bf16", "--prompts", str(tmp_path), "--py-spy", str(fake)], str(tmp_path)),
             (["smollm2-bf16", "--py-spy", str(tmp_path / "none")], f"py-spy not found at {tmp_path / 'none'}"),
             (["no-such-variant", "--py-spy", str(fake)], "no-such-variant")]
    for argv, message in cases:
        assert hs.main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1, err


def test_the_real_server_is_sampled_by_process_and_thread(embedded_server, tmp_path):
    import json

    from scripts.report import schemas as check_schemas

    rc = hs.main(["smollm2-bf16", "--base-url", embedded_server.base_url, "--server-pid", str(embedded_server.engine_pid),
                  "--output-tokens", "24", "--out-dir", str(tmp_path)])
    (path,) = tmp_path.glob("hostsample_*.json")
    rec = json.loads(path.read_text())
    assert rc == 0, rec["failure"]
    level = rec["summary"]["1"]
    # passes back to back through py-spy's window: more than one request, every one of 24 tokens
    assert set(level["processes"]) >= {"api_server", "engine_core"} and level["requests"] > 1
    assert level["tokens"] == 24 * level["requests"]
    core = level["processes"]["engine_core"]
    # the engine core's main thread runs the model on a CPU: busy for most of the pass, the model step its main part
    assert 0.3 < core["threads_share_of_pass"]["MainThread"] <= 1.1
    assert next(iter(core["parts_ms_per_token"])) == "model step"
    assert check_schemas.check_file(path) == []
