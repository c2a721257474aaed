"""The GPU session's steps (scripts/gpu/device.sh) refuse bad input before they touch a GPU: `cycle`, which outlasts a
call under `detach`, must fail at once and in one line rather than an hour later on the lent machine."""

from __future__ import annotations

import subprocess

import pytest

DEVICE = "scripts/gpu/device.sh"


def step(*args: str, run_dir, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", DEVICE, *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "LAB_RUN_DIR": str(run_dir), **env})


@pytest.mark.parametrize("args, env, says", [
    ((), {}, "name the specs"),
    (("qwen35-27b-dummy-bf16", "no-such-variant"), {}, "experiments/no-such-variant/config.env"),
    (("qwen35-27b-dummy-bf16",), {"PROFILE_ROUNDS": "first"}, "round numbers apart by spaces"),
    (("qwen35-27b-dummy-bf16",), {"PROFILE_ROUNDS": "1", "SET": "SERVE_KV_CACHE_MEMORY_BYTES=1"},
     "needs SERVE_PROFILER_CONFIG in SET"),
])
def test_cycle_refuses_bad_input_in_one_line(args, env, says, tmp_path):
    out = step("cycle", *args, run_dir=tmp_path, **env)
    assert out.returncode == 2 and says in out.stdout and len(out.stdout.splitlines()) == 1, out
    assert not out.stderr


def test_cycle_refuses_to_run_beside_servers_of_an_earlier_start(tmp_path):
    (tmp_path / "servers").write_text("qwen35-27b-dummy-bf16 qwen35-27b-dummy-bf16 8200 123 -\n")
    out = step("cycle", "qwen35-27b-dummy-bf16", run_dir=tmp_path)
    assert out.returncode == 2 and "servers of an earlier start are running" in out.stdout, out


def test_an_unknown_step_is_refused(tmp_path):
    out = step("no-such-step", run_dir=tmp_path)
    assert out.returncode == 2 and "unknown step no-such-step" in out.stdout


def test_hostsample_refuses_without_py_spy_before_sampling(tmp_path):
    # the payload without py-spy's wheel: one line naming what to carry, no server touched ($EXTRA is /root/extra)
    (tmp_path / "servers").write_text("qwen35-4b-dummy-bf16 qwen35-4b-dummy-bf16 8200 123 -\n")
    out = step("hostsample", run_dir=tmp_path)
    assert out.returncode == 1 and out.stdout.strip().startswith("py-spy missing") and "whl/" in out.stdout, out
    assert len(out.stdout.splitlines()) == 1 and not list(tmp_path.glob("host-res-*"))
