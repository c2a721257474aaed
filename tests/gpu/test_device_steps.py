"""The GPU session's steps (scripts/gpu/device.sh) refuse bad input before they touch a GPU: `cycle`, which outlasts a
call under `detach`, must fail at once and in one line rather than an hour later on the lent machine."""

from __future__ import annotations

import subprocess

import pytest

DEVICE = "scripts/gpu/device.sh"


def step(*args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", DEVICE, *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", **env})


@pytest.mark.parametrize("args, env, says", [
    ((), {}, "name the specs"),
    (("qwen35-27b-dummy-bf16", "no-such-variant"), {}, "experiments/no-such-variant/config.env"),
    (("qwen35-27b-dummy-bf16",), {"PROFILE_ROUNDS": "first"}, "round numbers apart by spaces"),
    (("qwen35-27b-dummy-bf16",), {"PROFILE_ROUNDS": "1", "SET": "SERVE_KV_CACHE_MEMORY_BYTES=1"},
     "needs SERVE_PROFILER_CONFIG in SET"),
])
def test_cycle_refuses_bad_input_in_one_line(args, env, says):
    out = step("cycle", *args, **env)
    assert out.returncode == 2 and says in out.stdout and len(out.stdout.splitlines()) == 1, out
    assert not out.stderr


def test_an_unknown_step_is_refused():
    out = step("no-such-step")
    assert out.returncode == 2 and "unknown step no-such-step" in out.stdout
