"""Where a server's host time goes while it decodes: py-spy samples each of its processes (the API server, vLLM's
engine core, a worker) during c concurrent greedy requests of exactly --output-tokens tokens, no profiler attached.

    python -m scripts.measure.host_sample smollm2-bf16                       # starts the variant's server itself
    python -m scripts.measure.host_sample qwen35-4b-dummy-w4a16-stream-head --base-url http://127.0.0.1:8202 \\
        --server-pid 1330 --py-spy /root/extra/bin/py-spy                    # a running server (the GPU machine)

--server-pid is the API server's pid, the leader of the server's process group (scripts.serve starts it in a session
of its own); the engine core and a worker are found in that group by their process titles. For each level: one pass
of the requests to time it, then py-spy (`record -f raw --nonblocking -t`: the process is not paused; threads py-spy
finds idle are left out) on every process while the same requests run again. Each process's busy time per generated
token is split by part (HOST_RULES: the first part with a fragment in any frame) and by thread. A thread's share of
the pass = its busy seconds / the pass's wall time (first request sent to last token): at steady decode, the fraction
of each step it runs on a CPU. A thread near 1.0 sets the step's pace: on a GPU, the GPU waits on it. py-spy's own
sampling takes some CPU, so the pass's TPOT is a little slower than a latency run's, which is the speed to quote.
Writes experiments/<variant>/hostsample_<stamp>.json (kind "hostsample").
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.loadgen import PromptSetError, load_prompts
from scripts.common.records import envelope, finish_record
from scripts.common.server import ServerError, group_pids
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.measure.profile import ProfileError, run_requests, short_prompts
from scripts.serve.launch import variant_server

KIND = "hostsample"
# Parts of a process's busy samples: the first rule with a fragment in any frame of the stack decides; (part, fragments)
HOST_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the engine core's wait for the worker process (multiproc executor): a spin on a shared-memory queue
    # (sched_yield in a loop), busy time that competes for a core
    ("waiting for the worker (shared-memory spin)", ("spincondition.wait", "acquire_read")),
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
WARMUP_TOKENS = 16


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
    """(thread name, the rest) of a stack py-spy wrote with -t ("thread (0x1f): MainThread;frame;..."); (None, stack)
    without it."""
    head, sep, rest = stack.partition(";")
    if head.startswith("thread (") and "): " in head:
        return head.split("): ", 1)[1] or head, rest if sep else ""
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
    """Each thread's busy seconds (its ms per token x the pass's tokens) / the pass's wall time ({} without one)."""
    if wall_s <= 0:
        return {}
    return {k: round(v * tokens / 1000 / wall_s, 3) for k, v in split.get("threads_ms_per_token", {}).items()}


# ------------------------------------------------------------------------------------------------ processes
def server_processes(server) -> dict[str, int]:
    """PIDs of the API server (the started process), vLLM's engine core (titled VLLM::EngineCore) and, with the
    multiprocessing executor, the worker that runs the model (titled VLLM::Worker...): the server's process group."""
    found = {"api_server": server.pid}
    for pid in group_pids(server.pid):  # started in its own session: the group is the server's
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
                 folder: Path, py_spy: Path) -> dict:
    """c unprofiled requests while py-spy samples each server process; the client's TPOT and each process's split."""
    samples = run_requests(base, model, short_prompts(rows, c, output_tokens))  # how long one pass takes
    duration = max(int(max(s.end_s for s in samples)) + 2, 3)
    procs = {}
    for name, pid in pids.items():
        out = folder / f"pyspy-{name}-c{c}.txt"
        procs[name] = (subprocess.Popen([str(py_spy), "record", "-p", str(pid), "-d", str(duration), "-r",
                                         str(SAMPLE_RATE_HZ), "-f", "raw", "-o", str(out), "--nonblocking", "-t"],
                                        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE), out)
    time.sleep(0.5)
    samples = run_requests(base, model, short_prompts(rows, c, output_tokens))
    tokens = sum(s.output_tokens for s in samples)
    if bad := [s for s in samples if not s.ok]:
        raise ServerError(f"{len(bad)} of {c} requests failed; first: {bad[0].error}")
    tpots = sorted(s.tpot_s for s in samples if s.tpot_s is not None)
    tpot_ms = round(tpots[len(tpots) // 2] * 1e3, 3) if tpots else None
    wall_s = max(s.end_s for s in samples)
    result = {"tokens": tokens, "tpot_ms_p50_under_pyspy": tpot_ms, "wall_s": round(wall_s, 3),
              "tok_s": round(tokens / wall_s, 2), "sampling_s": duration, "processes": {}}
    for name, (proc, out) in procs.items():
        _, err = proc.communicate(timeout=duration + 60)
        if proc.returncode or not out.exists():
            raise ProfileError(f"py-spy on the {name} failed: {(err.decode(errors='replace').strip().splitlines() or ['?'])[-1]}")
        # tokens generated while py-spy sampled: the pass began 0.5 s into the window and ends inside it
        split = host_split(out.read_text(), SAMPLE_RATE_HZ, tokens)
        if thread_shares := shares(split, tokens, wall_s):
            split["threads_share_of_pass"] = thread_shares
        result["processes"][name] = split
    return result


def find_py_spy(given: Path | None) -> Path:
    """--py-spy, else py-spy on PATH, else the lab's environment's."""
    found = given or (Path(w) if (w := shutil.which("py-spy")) else paths.ROOT / ".venv" / "bin" / "py-spy")
    if not found.is_file():
        raise HostSampleError(f"py-spy not found at {found}: make install (requirements/cpu.txt pins it), or pass "
                              "--py-spy PATH (on the GPU machine: its wheel in the payload's whl/, /root/extra/bin/py-spy)")
    return found


# ------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--base-url", help="a running server of the variant (with --server-pid); else it is started here")
    p.add_argument("--server-pid", type=int, help="the running server's API-server pid, leader of its process group")
    p.add_argument("--concurrency", default="1", help="comma-separated levels (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=96, help="tokens per request (default %(default)s)")
    p.add_argument("--prompts", type=Path, default=paths.EVAL / "prompts" / "latency-v1.jsonl")
    p.add_argument("--py-spy", type=Path, help="py-spy's command (default: on PATH, else .venv/bin/py-spy)")
    p.add_argument("--port", type=int, default=8133)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    try:
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        if not levels or min(levels) < 1:
            raise HostSampleError(f"--concurrency {args.concurrency!r}: positive integers")
        if args.output_tokens < 2:
            raise HostSampleError(f"--output-tokens {args.output_tokens}: at least 2 (a TPOT needs two tokens)")
        if bool(args.base_url) != bool(args.server_pid):
            raise HostSampleError("--base-url and --server-pid go together: py-spy needs the running server's pid")
        if args.server_pid and not Path(f"/proc/{args.server_pid}").exists():
            raise HostSampleError(f"--server-pid {args.server_pid}: no such process on this machine")
        py_spy = find_py_spy(args.py_spy)
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        rows, _ = load_prompts(args.prompts)
    except (HostSampleError, VariantError, PromptSetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    folder = paths.CACHE / "host_sample" / f"{variant.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    record = envelope(KIND, variant, command=[sys.executable, "-m", "scripts.measure.host_sample", *argv],
                      server_command=None)
    record["inputs"] = {"concurrency": levels, "output_tokens": args.output_tokens, "prompts": args.prompts.name,
                        "rate_hz": SAMPLE_RATE_HZ, "host_rules": [[c, list(f)] for c, f in HOST_RULES],
                        "warmup": f"1 request, then {max(levels)} at once, {WARMUP_TOKENS} tokens each",
                        "rule": "busy ms per token = a process's (thread's) non-idle py-spy samples / rate / tokens "
                                "of the pass; a thread's share of the pass = its busy seconds / the pass's wall time "
                                "(first request sent to last token)"}
    results: dict = {}
    try:
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="host_sample") as (base, server):
            pids = server_processes(server or SimpleNamespace(pid=args.server_pid))
            model = variant.served_name
            run_requests(base, model, short_prompts(rows, 1, WARMUP_TOKENS))
            run_requests(base, model, short_prompts(rows, max(levels), WARMUP_TOKENS))
            for c in levels:
                res = results[str(c)] = sampled_pass(base, model, rows, c, args.output_tokens, pids, folder, py_spy)
                for name, split in res["processes"].items():
                    top = ", ".join(f"{k} {v:.2f}" for k, v in list(split["parts_ms_per_token"].items())[:4])
                    busiest = max(split.get("threads_share_of_pass", {}).items(), key=lambda kv: kv[1], default=None)
                    print(f"c={c} {name}: busy {split['busy_ms_per_token']:.2f} ms per token ({top})"
                          + (f"; busiest thread {busiest[0]} busy {busiest[1]:.0%} of the pass" if busiest else ""),
                          flush=True)
                print(f"c={c}: TPOT p50 under py-spy {res['tpot_ms_p50_under_pyspy']} ms", flush=True)
    except (ProfileError, ServerError, CheckpointError, OSError, subprocess.SubprocessError) as e:
        record["summary"] = results
        return finish_record(record, args.out_dir or variant.path, KIND, e)
    record["summary"] = results
    return finish_record(record, args.out_dir or variant.path, KIND)


if __name__ == "__main__":
    sys.exit(main())
