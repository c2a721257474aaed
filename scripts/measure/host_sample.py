"""Where a server's host time goes while it decodes: py-spy samples each of its processes (the API server, vLLM's
engine core, a worker) during c concurrent greedy requests of exactly --output-tokens tokens, no profiler attached.

    python -m scripts.measure.host_sample smollm2-bf16                       # starts the variant's server itself
    python -m scripts.measure.host_sample qwen35-4b-dummy-w4a16-stream-head --base-url http://127.0.0.1:8202 \\
        --server-pid 1330 --py-spy /root/extra/bin/py-spy                    # a running server (the GPU machine)

--server-pid is the API server's pid, the leader of the server's process group (scripts.serve starts it in a session
of its own); the engine core and a worker are found in that group by their process titles (vLLM sets them through
setproctitle). For each level: one pass of c requests to time it, then py-spy (`record -f raw --nonblocking -t`: the
process is not paused; threads py-spy finds idle are left out) on every process for about --window-s seconds while
passes run back to back. Each process's busy time per generated token is split by part (HOST_RULES: the first part
with a fragment in any frame) and by thread. A thread's share of the passes = its busy seconds / their wall time
(first request sent to last token): at steady decode, the fraction of each step it runs on a CPU. A CUDA
synchronization spins on a CPU, so a thread waiting for the GPU looks busy too: its "waiting for the GPU" part says how
much. A thread near 1.0 whose time is not that wait sets the step's pace: on a GPU, the GPU waits on it. py-spy's own
sampling takes some CPU, so the passes' TPOT is a little slower than a latency run's, which is the speed to quote.
Writes experiments/<variant>/hostsample_<stamp>.json (kind "hostsample").
"""

from __future__ import annotations

import argparse
import math
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.loadgen import PromptSetError, load_prompts, parse_levels
from scripts.common.records import envelope, finish_record
from scripts.common.server import ServerError, group_pids
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.measure.profile import ProfileError, run_requests, short_prompts
from scripts.measure.stepsplit import level_parser, warm_up, warmup_note
from scripts.serve.launch import variant_server

KIND = "hostsample"
# Parts of a process's busy samples: the first rule with a fragment in any frame of the stack decides; (part, fragments)
HOST_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the engine core's wait for the worker process (multiproc executor): a spin on a shared-memory queue
    # (sched_yield in a loop), busy time that competes for a core
    ("waiting for the worker (shared-memory spin)", ("spincondition.wait", "acquire_read")),
    # a CUDA synchronization spins on a CPU by default: busy in py-spy's eyes, but the GPU's time, not the host's
    ("waiting for the GPU (synchronize, tolist)", ("synchronize", "tolist", "_to_list")),
    ("detokenization", ("detokeniz", "tokenizers", "decode_token", "convert_ids_to_tokens", "incremental")),
    ("scheduler", ("scheduler.schedule", "sched/", "kv_cache_manager", "block_pool", "update_from_output")),
    ("sampling", ("sample_tokens", "sampler")),
    ("model step", ("execute_model", "model_runner", "_model_forward", "compile_fx", "torch/")),
    ("IPC (ZeroMQ, msgpack, shared memory)", ("zmq", "msgspec", "serial_utils", "core_client", "process_input_socket",
                                              "process_output_socket", "pickle", "messagequeue")),
    ("output processing", ("output_processor", "outputs.py", "logprobs")),
    ("request preprocessing", ("chat_template", "renderer", "input_processor", "preprocess", "jinja", "tokeniz")),
    ("HTTP and streaming", ("serving_chat", "serving_completion", "serving_engine", "starlette", "uvicorn", "fastapi",
                            "h11", "httptools", "sse", "streaming", "json")),
    ("asyncio loop", ("asyncio", "uvloop", "selectors")),
)
SAMPLE_RATE_HZ = 250
WINDOW_S = 6.0  # seconds py-spy samples each level
LEAD_S = 0.5  # py-spy's attach before the first pass


class HostSampleError(Exception):
    pass


# ------------------------------------------------------------------------------------------------ pure
def host_part(stack: str) -> str:
    """The part of one collapsed py-spy stack (frames root;...;leaf): the first HOST_RULES part with a fragment in any
    of its frames."""
    low = stack.lower()
    for part, fragments in HOST_RULES:
        if any(f in low for f in fragments):
            return part
    return "other"


def split_thread(stack: str) -> tuple[str | None, str]:
    """(thread, the rest) of a stack py-spy wrote with -t ("thread (0x1f): MainThread;frame;...", or "thread (0x1f);..."
    where the thread has no name: then "thread (0x1f)"); (None, stack) without -t."""
    head, sep, rest = stack.partition(";")
    if head.startswith("thread (") and ")" in head:  # py-spy names a thread only where Python knows its name
        return head.partition("): ")[2] or head, rest if sep else ""
    return None, stack


def host_split(raw: str, rate_hz: float, tokens: int) -> dict:
    """Busy ms per generated token by part and by thread, from py-spy's raw output (idle threads excluded by py-spy)."""
    parts: Counter = Counter()
    threads: Counter = Counter()
    for line in raw.splitlines():
        stack, _, count = line.rpartition(" ")
        if not (stack and count.isdigit()):
            continue
        thread, frames = split_thread(stack)
        parts[host_part(frames)] += int(count)
        if thread is not None:
            threads[thread] += int(count)

    def ms(n: int) -> float:
        return round(n / rate_hz * 1000 / max(tokens, 1), 3)

    out = {"samples": sum(parts.values()), "busy_ms_per_token": ms(sum(parts.values())),
           "parts_ms_per_token": {k: ms(v) for k, v in parts.most_common()}}
    if threads:
        out["threads_ms_per_token"] = {k: ms(v) for k, v in threads.most_common()}
    return out


def shares(split: dict, tokens: int, wall_s: float) -> dict[str, float]:
    """Each thread's busy seconds (its ms per token x the passes' tokens) / the passes' wall time ({} without one)."""
    if wall_s <= 0:
        return {}
    return {k: round(v * tokens / 1000 / wall_s, 3) for k, v in split.get("threads_ms_per_token", {}).items()}


# ------------------------------------------------------------------------------------------------ processes
def server_processes(api_pid: int) -> dict[str, int]:
    """PIDs of the API server (the started process, `api_pid`), vLLM's engine core (titled VLLM::EngineCore) and, with
    the multiprocessing executor, the worker that runs the model (titled VLLM::Worker...): the server's process group."""
    found = {"api_server": api_pid}
    for pid in group_pids(api_pid):  # started in its own session: the group is the server's
        try:
            title = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "EngineCore" in title:
            found["engine_core"] = pid
        elif "Worker" in title:
            found["worker"] = pid
    return found


def sampled_pass(base: str, model: str, rows: list[dict], c: int, output_tokens: int, pids: dict[str, int],
                 folder: Path, py_spy: Path, window_s: float = WINDOW_S) -> dict:
    """py-spy on each server process for about window_s seconds while passes of c requests run back to back, from
    LEAD_S in until the next pass would outlast the window (one pass at least): each process's split over the passes'
    tokens, each thread's share of their wall time, and the client's TPOT. Samples outside the passes (the lead, the
    tail) count as busy time too: a server that idles without spinning adds next to nothing there."""
    def one_pass() -> list:
        got = run_requests(base, model, short_prompts(rows, c, output_tokens))
        if bad := [s for s in got if not s.ok]:
            raise ServerError(f"{len(bad)} of {c} requests failed; first: {bad[0].error}")
        return got

    pass_s = max(s.end_s for s in one_pass())  # how long one pass takes
    duration = max(math.ceil(window_s), math.ceil(LEAD_S + 1.5 * pass_s + 1))  # py-spy takes whole seconds
    procs: dict[str, tuple[subprocess.Popen, Path]] = {}
    try:
        for name, pid in pids.items():
            out = folder / f"pyspy-{name}-c{c}.txt"
            procs[name] = (subprocess.Popen([str(py_spy), "record", "-p", str(pid), "-d", str(duration), "-r",
                                             str(SAMPLE_RATE_HZ), "-f", "raw", "-o", str(out), "--nonblocking", "-t"],
                                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out)
        time.sleep(LEAD_S)  # py-spy attaches
        samples, wall_s, t0 = [], 0.0, time.perf_counter()
        while True:
            samples += (got := one_pass())
            wall_s += max(s.end_s for s in got)
            if LEAD_S + time.perf_counter() - t0 + 1.5 * max(s.end_s for s in got) > duration - 0.2:
                break
        tokens = sum(s.output_tokens for s in samples)
        tpots = sorted(s.tpot_s for s in samples if s.tpot_s is not None)
        tpot_ms = round(tpots[len(tpots) // 2] * 1e3, 3) if tpots else None
        result = {"tokens": tokens, "requests": len(samples), "tpot_ms_p50_under_pyspy": tpot_ms,
                  "wall_s": round(wall_s, 3), "tok_s": round(tokens / wall_s, 2), "sampling_s": duration,
                  "processes": {}}
        for name, (proc, out) in procs.items():
            _, err = proc.communicate(timeout=duration + 60)
            if proc.returncode or not out.exists():
                raise ProfileError(f"py-spy on the {name} failed: "
                                   f"{(err.decode(errors='replace').strip().splitlines() or ['?'])[-1]}")
            split = host_split(out.read_text(), SAMPLE_RATE_HZ, tokens)
            if thread_shares := shares(split, tokens, wall_s):
                split["threads_share_of_pass"] = thread_shares
            result["processes"][name] = split
        return result
    finally:  # a pass that failed leaves no py-spy attached to the server
        for proc, _ in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def find_py_spy(given: Path | None) -> Path:
    """--py-spy, else py-spy on PATH, else the lab's environment's."""
    found = given or (Path(w) if (w := shutil.which("py-spy")) else paths.ROOT / ".venv" / "bin" / "py-spy")
    if not found.is_file():
        raise HostSampleError(f"py-spy not found at {found}: make install (requirements/cpu.txt pins it), or pass "
                              "--py-spy PATH (on the GPU machine: its wheel in the payload's whl/, /root/extra/bin/py-spy)")
    return found


# ------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = level_parser(__doc__, concurrency="1", port=8133)
    p.add_argument("--base-url", help="a running server of the variant (with --server-pid); else it is started here")
    p.add_argument("--server-pid", type=int, help="the running server's API-server pid, leader of its process group")
    p.add_argument("--py-spy", type=Path, help="py-spy's command (default: on PATH, else .venv/bin/py-spy)")
    p.add_argument("--window-s", type=float, default=WINDOW_S, help="seconds py-spy samples each level (default "
                                                                    "%(default)s; longer where one pass is)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        levels = parse_levels(args.concurrency)
        if args.window_s <= 0:
            raise HostSampleError(f"--window-s {args.window_s}: a positive number of seconds")
        if args.output_tokens < 2:
            raise HostSampleError(f"--output-tokens {args.output_tokens}: at least 2 (a TPOT needs two tokens)")
        if bool(args.base_url) != bool(args.server_pid):
            raise HostSampleError("--base-url and --server-pid go together: py-spy needs the running server's pid")
        if args.server_pid and not Path(f"/proc/{args.server_pid}").exists():
            raise HostSampleError(f"--server-pid {args.server_pid}: no such process on this machine")
        py_spy = find_py_spy(args.py_spy)
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        rows, _ = load_prompts(args.prompts)
    except (HostSampleError, VariantError, PromptSetError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    folder = paths.CACHE / "host_sample" / f"{variant.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    record = envelope(KIND, variant, command=[sys.executable, "-m", "scripts.measure.host_sample", *argv],
                      server_command=None)
    record["inputs"] = {"concurrency": levels, "output_tokens": args.output_tokens, "prompts": args.prompts.name,
                        "rate_hz": SAMPLE_RATE_HZ, "host_rules": [[c, list(f)] for c, f in HOST_RULES],
                        "warmup": warmup_note(levels),
                        "rule": "busy ms per token = a process's (thread's) non-idle py-spy samples / rate / tokens "
                                "of the passes in py-spy's window; a thread's share = its busy seconds / the passes' wall "
                                "time (first request sent to last token, summed over passes)", "window_s": args.window_s}
    results: dict = {}
    error: Exception | None = None
    try:
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="host_sample") as (base, server):
            pids = server_processes(server.pid if server else args.server_pid)
            if variant.engine == "vllm" and "engine_core" not in pids:
                raise HostSampleError(f"no process titled VLLM::EngineCore in the process group of pid "
                                      f"{pids['api_server']}: is it the API server's pid (the group's leader)?")
            model = variant.served_name
            warm_up(base, model, rows, levels)
            for c in levels:
                res = results[str(c)] = sampled_pass(base, model, rows, c, args.output_tokens, pids, folder, py_spy,
                                                      args.window_s)
                for name, split in res["processes"].items():
                    top = ", ".join(f"{k} {v:.2f}" for k, v in list(split["parts_ms_per_token"].items())[:4])
                    busiest = max(split.get("threads_share_of_pass", {}).items(), key=lambda kv: kv[1], default=None)
                    print(f"c={c} {name}: busy {split['busy_ms_per_token']:.2f} ms per token ({top})"
                          + (f"; busiest thread {busiest[0]} busy {busiest[1]:.0%} of the pass" if busiest else ""),
                          flush=True)
                print(f"c={c}: TPOT p50 under py-spy {res['tpot_ms_p50_under_pyspy']} ms", flush=True)
    except (HostSampleError, ProfileError, ServerError, CheckpointError, OSError, subprocess.SubprocessError) as e:
        error = e  # the levels measured before it are kept
    record["summary"] = results
    return finish_record(record, args.out_dir or variant.path, KIND, error)


if __name__ == "__main__":
    sys.exit(main())
