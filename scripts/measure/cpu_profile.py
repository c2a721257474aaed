"""Where a CPU decode step goes: vLLM's step split by op class and by process part, beside llama.cpp on the same
weights and the machine's weight-streaming floor.

    python -m scripts.measure.cpu_profile smollm2-bf16                     # make profile VARIANT=smollm2-bf16 (CPU)
    python -m scripts.measure.cpu_profile smollm2-bf16 --concurrency 1,8 --peer smollm2-gguf-bf16 --set KEY=VALUE

Four measurements, one record (kind "profile", the GPU profiles' schema; experiments/<variant>/profile_<stamp>.json):

1. vLLM's torch profiler (worker trace, runner scopes under VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, as
   scripts.measure.stepsplit) around c concurrent greedy requests of exactly --output-tokens tokens. Every CPU op's self
   time (its duration minus its children's, per thread) goes to the category of the innermost classified event around
   it (OP_RULES on op names, then the runner scope it sits in): GEMMs of the layers and of the LM head, attention,
   the compiled graph's own time (inductor's fused C++ kernels: norms, rotary, activation, residual adds), the runner's
   framework work per scope (input preparation, sampling, ...), and `between steps` (the period between two engine
   steps that no op covers: the engine core's scheduler, output serialization and socket hops).
2. A sampling profiler (py-spy; the torch profiler idle) over the API server, the engine core and, with the
   multiproc executor, the worker during the same requests again: each process's busy time per generated token by part
   (HOST_RULES: model step, waiting for the worker, scheduler, IPC, detokenization, HTTP/streaming, ...), and the
   client's TPOT of that pass. py-spy's own sampling takes CPU from the server on a small machine: that TPOT is slower
   than a latency run's, which is the speed to quote.
3. llama.cpp on the peer GGUF (the same weights): its own per-token eval timing (llama_perf_context) with 1 thread and
   with every core, from .venv-llamacpp.
4. The weight-streaming floor: bytes of weights read per decoded token (safetensors headers; the tied embedding is
   read once, by the LM head) / read bandwidth measured on this machine with torch (a 1 GiB sum, 1 thread and every
   core; a copy's read+write bandwidth beside it).

The table per level lists ms per step by category with the floor of the GEMM rows (bytes / read bandwidth of the
engine's threads). Nothing here is projected except `step_model.projection`, labelled with its formula.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.common.engines import ENGINES, EngineError, python_of, vllm_cpu_cores
from scripts.common.loadgen import PromptSetError, load_prompts
from scripts.common.records import envelope, finish_record
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant, serving_target
from scripts.measure.host_sample import HOST_RULES, HostSampleError, find_py_spy, sampled_pass, server_processes
from scripts.measure.profile import (
    DTYPE_BYTES,
    ProfileError,
    load_trace,
    newest_trace,
    profiled_requests,
    short_prompts,
)
from scripts.measure.stepsplit import SCOPE_PREFIX, profiled_variant, warm_up, warmup_note, window_parser
from scripts.serve.launch import variant_server

KIND = "profile"
# (category, name fragments), first match wins; lower-case op names of vLLM's CPU backend and torch
OP_RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("gemm", ("onednn_mm", "onednn_scaled_mm", "int8_scaled_mm", "aten::mm", "aten::addmm", "aten::bmm",
              "aten::matmul", "aten::linear", "mkldnn", "_linear_pointwise", "cpu_gemm", "wna16")),
    ("attention", ("attention", "reshape_and_cache", "kv_cache_update", "scheduler_metadata", "paged")),
    ("norm", ("rms_norm", "layer_norm")),
    ("rotary", ("rotary",)),
    ("activation", ("silu", "gelu", "act_and_mul")),
    ("sampling ops", ("argmax", "topk", "top_k", "softmax", "aten::sort", "multinomial", "sampler")),
    ("compiled graph (fused kernels)", ("## call compiledfxgraph",)),
)
OP_RULE = ("a CPU op's self time (duration minus its children's on the same thread) goes to the innermost classified "
           "event around it: OP_RULES on the op name, else the runner scope; GEMMs are split by the scope they run in "
           "(forward: the layers, postprocess: the LM head, draft: the drafter); time in a period no op covers is "
           "`between steps`")
STEPS_RULE = ("a step is the period between the starts of consecutive execute_* annotations (vLLM's per-step "
              "annotation); the profiler window skips the first DELAY_STEPS steps of each level")
GEMM_SCOPES = {"forward": "gemm:layers", "postprocess": "gemm:lm_head", "draft": "gemm:draft"}

PEER_SNIPPET = r"""
import json, sys, time
import llama_cpp
from llama_cpp import Llama
path, threads, n_out, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
m = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=2048, verbose=False)
eos = {m.token_eos(): -1e9}
m.create_completion(prompt, max_tokens=16, temperature=0.0, logit_bias=eos)
rows = []
for _ in range(3):
    m.reset()
    llama_cpp.llama_perf_context_reset(m._ctx.ctx)
    t = time.perf_counter()
    out = m.create_completion(prompt, max_tokens=n_out, temperature=0.0, logit_bias=eos)
    wall = time.perf_counter() - t
    p = llama_cpp.llama_perf_context(m._ctx.ctx)
    rows.append({"eval_ms": p.t_eval_ms, "n_eval": p.n_eval, "prompt_ms": p.t_p_eval_ms, "n_prompt": p.n_p_eval,
                 "wall_s": wall, "completion_tokens": out["usage"]["completion_tokens"]})
print(json.dumps({"llama_cpp_python": llama_cpp.__version__, "threads": threads, "runs": rows}))
"""

BANDWIDTH_SNIPPET = r"""
import json, sys, time, torch
threads = int(sys.argv[1]); torch.set_num_threads(threads)
n = 2**28  # float32 elements: 1 GiB
a = torch.ones(n, dtype=torch.float32); b = torch.empty_like(a)
def best(fn, reps=7):
    fn(); times = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); times.append(time.perf_counter() - t)
    return min(times)
read = 4 * n / best(lambda: a.sum()) / 1e9
copy = 2 * 4 * n / best(lambda: b.copy_(a)) / 1e9
print(json.dumps({"threads": threads, "read_gbs": read, "copy_gbs": copy}))
"""


# ------------------------------------------------------------------------------------------------ pure: torch trace
def classify_op(name: str) -> str | None:
    low = name.lower()
    for category, fragments in OP_RULES:
        if any(f in low for f in fragments):
            return category
    return None


def self_times(events: list[dict]) -> list[tuple[dict, float, list[dict]]]:
    """(event, self time in us, its enclosing events outermost first) for every complete event, per thread: nesting
    from start times and durations (an event that starts inside another and ends inside it is its child)."""
    by_thread: dict[tuple, list[dict]] = defaultdict(list)
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation") and "dur" in e:
            by_thread[(e.get("pid"), e.get("tid"))].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e["ts"], -e["dur"]))
        stack: list[list] = []  # [event, its children's time so far]
        for e in [*evs, None]:  # None: the end, closing every open event
            while stack and (e is None or e["ts"] >= stack[-1][0]["ts"] + stack[-1][0]["dur"]):
                ev, child = stack.pop()
                out.append((ev, max(ev["dur"] - child, 0.0), [s[0] for s in stack]))
                if stack:
                    stack[-1][1] += ev["dur"]
            if e is not None:
                stack.append([e, 0.0])
    return out


def category_of(event: dict, ancestors: list[dict]) -> str:
    """The category of an event's self time: the innermost classified op among itself and its ancestors, else the
    innermost runner scope ('scope: <name>'), else 'outside scopes'."""
    chain = [*ancestors, event]
    scope = next((e["name"][len(SCOPE_PREFIX):] for e in reversed(chain) if e["name"].startswith(SCOPE_PREFIX)), None)
    for e in reversed(chain):
        if e.get("cat") == "cpu_op" and (cat := classify_op(e["name"])):
            return GEMM_SCOPES.get(scope or "", "gemm:other") if cat == "gemm" else cat
    if scope:
        return f"runner: {scope}"
    return "outside scopes"


def step_table(events: list[dict]) -> dict:
    """us per engine step by category, over the periods between consecutive execute_* annotations."""
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("execute_"))
    if len(starts) < 2:
        raise ProfileError("the trace holds fewer than two engine step annotations (execute_*): was the window empty?")
    lo, hi, n = starts[0], starts[-1], len(starts) - 1
    per: dict[str, float] = defaultdict(float)
    for ev, self_us, ancestors in self_times(events):
        if lo <= ev["ts"] < hi:
            # the step annotation's own time is op-free time inside execute_model: the runner's Python
            step = ev.get("cat") == "user_annotation" and ev["name"].startswith("execute_")
            per["runner: execute_model (op-free)" if step else category_of(ev, ancestors)] += self_us
    period_us = (hi - lo) / n
    table = {k: v / n for k, v in per.items()}
    table["between steps"] = max(period_us - sum(table.values()), 0.0)
    return {"periods": n, "step_us": period_us, "per_step_us": dict(sorted(table.items(), key=lambda kv: -kv[1]))}


# ------------------------------------------------------------------------------------------------ pure: bytes
def weight_bytes(tensors: dict, config: dict) -> dict:
    """Bytes of weights read per decoded token: the layers' matrices, the LM head (the embedding when tied), and
    the rest (norms; the untied embedding's one row is negligible and not counted)."""
    out: Counter = Counter()
    tied = config.get("tie_word_embeddings", False)
    for name, t in tensors.items():
        nbytes = DTYPE_BYTES.get(t.dtype, 2)
        for d in t.shape:
            nbytes *= d
        if "embed_tokens" in name:
            if tied:
                out["gemm:lm_head"] += nbytes
        elif "lm_head" in name:
            out["gemm:lm_head"] += nbytes
        elif ".layers." in name and len(t.shape) >= 2:
            out["gemm:layers"] += nbytes
        else:
            out["other"] += nbytes
    return dict(out)


def floor_rows(per_step_us: dict[str, float], weight: dict[str, int], read_gbs: float) -> list[dict]:
    """The record's table: category, us per step, share, bytes per step and the streaming floor of those bytes."""
    total = sum(per_step_us.values()) or 1.0
    rows = []
    for cat, us in per_step_us.items():
        nbytes = weight.get(cat, 0)
        rows.append({"category": cat, "us_per_step": round(us, 1), "share": round(us / total, 4),
                     "bytes_per_step": nbytes, "roofline_us": round(nbytes / read_gbs / 1e3, 1) if nbytes else None})
    return rows


def step_model(step_us: float, gemm_us: float, weight_total: int, bw: dict) -> dict:
    """A two-term fit of the step (weight streaming at the engine's bandwidth + the rest) and one labelled projection:
    the same step with every core streaming the weights."""
    rest_us = step_us - gemm_us
    floor_eng = weight_total / bw["engine"]["read_gbs"] / 1e3
    return {"fit": {"step_us": round(step_us, 1), "gemm_us": round(gemm_us, 1), "rest_us": round(rest_us, 1),
                    "gemm_floor_us_engine_threads": round(floor_eng, 1),
                    "gemm_efficiency": round(floor_eng / gemm_us, 3) if gemm_us else None},
            "projection": {"label": "projection, not a measurement: the GEMMs at this efficiency with every core's "
                                    "read bandwidth, the rest unchanged",
                           "formula": "rest_us + gemm_us * read_gbs(engine threads) / read_gbs(all cores)",
                           "step_us": round(rest_us + gemm_us * bw["engine"]["read_gbs"] / bw["all"]["read_gbs"], 1)}}


# ------------------------------------------------------------------------------------------------ measurements
def measure_bandwidth(threads: int) -> dict:
    r = subprocess.run([sys.executable, "-c", BANDWIDTH_SNIPPET, str(threads)], capture_output=True, text=True,
                       timeout=600)
    if r.returncode:
        raise ProfileError(f"bandwidth measurement failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def peer_timing(model: Path, threads: int, output_tokens: int, prompt: str) -> dict:
    py = python_of(ENGINES["llamacpp"])
    r = subprocess.run([py, "-c", PEER_SNIPPET, str(model), str(threads), str(output_tokens), prompt],
                       capture_output=True, text=True, timeout=900)
    if r.returncode:
        raise ProfileError(f"llama.cpp timing failed: {(r.stderr.strip().splitlines() or ['?'])[-1]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    best = min(out["runs"], key=lambda x: x["eval_ms"] / max(x["n_eval"], 1))
    out["ms_per_token"] = round(best["eval_ms"] / max(best["n_eval"], 1), 3)
    out["prompt_ms_per_token"] = round(best["prompt_ms"] / max(best["n_prompt"], 1), 3)
    return out


# ------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = window_parser(__doc__, concurrency="1,8", port=8132)
    p.add_argument("--peer", help="the GGUF variant of the same weights timed with llama.cpp (default: the variant's "
                                  "PROFILE_PEER key, else none)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    folder = paths.CACHE / "cpu_profile" / f"{args.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        levels, prof, variant = profiled_variant(args, folder)
        if variant.engine != "vllm" or serving_target() != "cpu":
            raise ProfileError(f"{variant.name}: the CPU profile measures a vLLM variant on a CPU (engine "
                               f"{variant.engine}, target {serving_target()}); a GGUF variant is timed as a vLLM "
                               f"variant's PROFILE_PEER, and a GPU server by make profile BASE_URL=…")
        peer_name = args.peer or variant.resolved.get("PROFILE_PEER")
        peer = load_variant(peer_name) if peer_name else None
        if peer and not Path(peer.model).is_file():
            raise ProfileError(f"the peer's GGUF {peer.resolved['MODEL']} is missing: make export-gguf VARIANT={peer.name}")
        report = read_checkpoint(Path(variant.model))
        rows, _ = load_prompts(args.prompts)
        py_spy = find_py_spy(None)
    except (ProfileError, VariantError, PromptSetError, CheckpointError, ValueError, HostSampleError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    folder.mkdir(parents=True, exist_ok=True)
    cores = os.cpu_count() or 1
    weight = weight_bytes(report.tensors, report.config)
    record = envelope(KIND, variant, command=[sys.executable, "-m", "scripts.measure.cpu_profile", *argv],
                      server_command=None)
    record.update(device="cpu", weights={"bytes_per_step": weight, "families": [],
                                         "rule": weight_bytes.__doc__.split(":")[0]},
                  mapping_rule=OP_RULE, steps_rule=STEPS_RULE, op_rules=[[c, list(f)] for c, f in OP_RULES],
                  host_rules=[[c, list(f)] for c, f in HOST_RULES])
    record["inputs"] = {"concurrency": levels, "output_tokens": args.output_tokens, "prompts": args.prompts.name,
                        "profiler_config": prof, "bandwidth_source": "torch on this CPU: a 1 GiB float32 sum (read) "
                        "and copy (read+write), best of 7, in a subprocess", "peer": peer.name if peer else None,
                        "warmup": warmup_note(levels)}
    try:
        bw = {"engine": None, "all": measure_bandwidth(cores), "one": measure_bandwidth(1)}
        print(f"read bandwidth: 1 thread {bw['one']['read_gbs']:.1f} GB/s, {cores} threads "
              f"{bw['all']['read_gbs']:.1f} GB/s", flush=True)
        results, host = {}, {}
        with variant_server(variant, base_url=None, port=args.port, purpose="cpu_profile") as (base, server):
            model = variant.served_name
            warm_up(base, model, rows, levels)
            # no binding line and no OMP_NUM_THREADS: the engine core cut torch to one thread
            threads = vllm_cpu_cores(server.log_text(), server.env)["compute_threads"] or 1
            bw["engine"] = bw["one"] if threads == 1 else bw["all"]
            record["inputs"].update(model_threads=threads, model_threads_source="vLLM's OpenMP binding log (core "
                                    "ids of the worker), else the server's OMP_NUM_THREADS (uniprocess executor)",
                                    bandwidth_gbs=round(bw["engine"]["read_gbs"], 2))
            pids = server_processes(server.pid)
            for c in levels:
                since = time.time() - 1
                profiled_requests(base, model, rows, c, args.output_tokens)
                table = step_table(load_trace(newest_trace(folder, since)))
                per = table["per_step_us"]
                gemm_us = sum(v for k, v in per.items() if k.startswith("gemm:"))
                results[str(c)] = {"steps": table["periods"], "step_us": round(table["step_us"], 1),
                                   "table": floor_rows(per, weight, bw["engine"]["read_gbs"]),
                                   "step_model": step_model(table["step_us"], gemm_us, sum(weight.values()), bw)}
                host[str(c)] = sampled_pass(base, model, rows, c, args.output_tokens, pids, folder, py_spy)
                top = ", ".join(f"{k} {v / 1e3:.2f}" for k, v in list(per.items())[:7])
                print(f"c={c}: {table['step_us'] / 1e3:.2f} ms/step profiled ({top}); TPOT p50 under py-spy "
                      f"{host[str(c)]['tpot_ms_p50_under_pyspy']} ms", flush=True)
        record["summary"], record["host"] = results, host
        record["bandwidth"] = bw
        total = sum(weight.values())
        record["floor"] = {"weight_bytes_per_token": total,
                           "ms_per_token_engine_threads": round(total / bw["engine"]["read_gbs"] / 1e6, 3),
                           "ms_per_token_all_cores": round(total / bw["all"]["read_gbs"] / 1e6, 3),
                           "rule": "weight bytes per token / read bandwidth (weights streamed once per step at c=1)"}
        if peer:
            prompt = short_prompts(rows, 1, 1)[0]["messages"][-1]["content"]
            record["peer"] = {"variant": peer.name, "model": peer.resolved["MODEL"],
                              "by_threads": {str(t): peer_timing(Path(peer.model), t, args.output_tokens, prompt)
                                             for t in sorted({1, cores})}}
            for t, r in record["peer"]["by_threads"].items():
                print(f"llama.cpp {peer.name}, {t} thread(s): {r['ms_per_token']:.2f} ms per token (its own eval "
                      f"timing)", flush=True)
    except (ProfileError, ServerError, OSError, json.JSONDecodeError, subprocess.SubprocessError, EngineError) as e:
        return finish_record(record, args.out_dir or variant.path, KIND, e)
    return finish_record(record, args.out_dir or variant.path, KIND)


if __name__ == "__main__":
    sys.exit(main())
