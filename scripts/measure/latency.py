"""Latency and throughput of a variant's server: TTFT, ITL, TPOT, E2E at several concurrencies; writes a record.

    python -m scripts.measure.latency smollm2-bf16                          # starts the server, measures, stops it
    python -m scripts.measure.latency smollm2-bf16 --base-url http://127.0.0.1:8000   # a server already running
    python -m scripts.measure.latency smollm2-bf16 --concurrency 1,8 --modes fixed --limit 8
    python -m scripts.measure.latency smollm2-bf16 --topology .cache/replicas/smollm2-bf16.json \
        --prompts eval/prompts/shared-prefix-v1.jsonl --concurrency 1,8,32,128 --request-rate 1,2,4 --modes fixed

Replays a fixed, versioned prompt set (eval/prompts/latency-v1.jsonl) with streamed greedy chat requests, after a
warm-up, at each concurrency (at most N requests in flight). Modes: `fixed` (ignore_eos: every request generates
exactly its max_tokens, the fair speed comparison) and `natural` (stops at EOS). Scrapes /metrics before and after
(KV capacity, KV usage, preemptions, prefix-cache hits, speculative acceptance). Writes
experiments/<variant>/latency_<YYYYMMDD-HHMMSS>.json atomically; a run with failed requests is recorded as failed.

Scale: `--repeat K` sends every prompt K times (high concurrency levels stay full), `--request-rate` adds open-loop
levels with Poisson arrivals (seeded), and every level records each server's prefix-cache hits. Every record names
its topology (tensor and data parallel size, replicas, router and policy, GPUs): one server unless `--topology` names
the file `make serve-replicas` writes, in which case requests go to the router and every replica's /metrics is read.

`--client vllm-bench` (a vLLM server) sends and times the requests with vLLM's own `bench serve` instead (random
prompts, `--vllm-bench-shape IN,OUT` tokens, `--limit` requests a level, fixed length: scripts/measure/vllm_bench.py):
the same record, beside the lab's client's.

On a GPU host each concurrency level (not the rate sweep) also records what every GPU ran at meanwhile
(`gpu_clocks`: SM clock min / p50 / max, power, temperature and the share of samples NVML gave each reason for lower
clocks; scripts/measure/gpu_clocks.py).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.common.engines import engine_of, fixed_body_for, vllm_cpu_cores
from scripts.common.hardware import busy_share, cpu_jiffies
from scripts.common.loadgen import (
    DEFAULT_PROMPTS,
    SESSION_HEADER,
    PromptSetError,
    load_prompts,
    openai_client,
    parse_levels,
    repeat_rows,
    run_level,
    run_rate,
    stream_one,
    with_sessions,
)
from scripts.common.metrics import goodput, round_orders, summarize
from scripts.common.records import envelope, now_utc, read_counters, reset_counters, save_record
from scripts.common.server import Server, ServerError, group_rss_mib, http_post, is_healthy, stays_healthy
from scripts.common.variants import VariantError, list_variants, load_variant, parse_overrides
from scripts.measure import gpu_clocks, vllm_bench
from scripts.measure.kernel_log import kernels_by_family
from scripts.measure.prom import scrape, server_counters
from scripts.measure.roofline import for_bench, level_roofline, mean_decode_context
from scripts.serve.launch import variant_server
from scripts.serve.replicas import ReplicaError, parallel_size, parallelism, read_topology

DEFAULT_CONCURRENCY = "1,4,8"
MODES = ("fixed", "natural")
WARMUP_REQUESTS = 2


class BenchError(RuntimeError):
    pass


KERNEL_LINE = re.compile(r"(Using \S+Kernel for \S+|Selected \S+Kernel for \S+|Using \S+ GDN prefill kernel)")


def kernels_from_log(log: Path | None) -> list[str]:
    """Kernel choices vLLM logged at start (e.g. 'Using MacheteLinearKernel for CompressedTensorsWNA16')."""
    if not log or not log.exists():
        return []
    return sorted({m.group(1) for m in KERNEL_LINE.finditer(log.read_text(errors="replace"))})


def engine_cores(server: Server | None, gpu: bool) -> dict | None:
    """The cores a CPU engine computes on: vLLM's model threads and reserved CPUs as its start log states them (no
    structured output says so), llama.cpp's thread flag from its command; None for a GPU or a server not started
    here."""
    if server is None or gpu:
        return None
    argv = server.argv
    for flag in ("--n_threads", "--threads"):  # llama-cpp-python's server, llama-server
        if flag in argv:
            return {"compute_threads": int(argv[argv.index(flag) + 1]), "reserved_cpus": [],
                    "source": f"llama.cpp {flag}"}
    return vllm_cpu_cores(server.log_text(), server.env)


def model_facts(variant) -> dict:
    """Weight bytes on disk and quantization of the served checkpoint (None for a hub id not present here)."""
    model = variant.resolved["MODEL"]
    path = Path(variant.model)
    if path.suffix == ".gguf" and path.is_file():  # llama.cpp: one file, its tensor type named by the variant
        return {"model": model, "weight_bytes": path.stat().st_size, "quantization": variant.resolved.get("GGUF_TYPE")}
    if not path.is_dir():
        return {"model": model, "weight_bytes": None, "quantization": None}
    report = read_checkpoint(path)
    quant = report.quantization
    return {"model": model, "weight_bytes": report.total_bytes,
            "quantization": quant.get("quant_method") if quant else variant.resolved.get("SERVE_QUANTIZATION")}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="variant name (with --ladder: a base model, e.g. smollm2)")
    p.add_argument("--ladder", action="store_true", help="measure every variant of this base back to back")
    p.add_argument("--only", help="with --ladder: comma-separated variants to keep (the reference always stays)")
    p.add_argument("--ladder-id", help="without --ladder: the ladder this one variant's run belongs to (make optimize "
                   "measures its ladder a rung at a time, so a killed ladder continues)")
    p.add_argument("--rounds", type=int, default=1, help="with --ladder: measure the ladder this many times, alternating "
                   "the order (make eval-latency-ladder ROUNDS=2): the ratios then carry a 95%% interval")
    p.add_argument("--round", type=int, help="with --ladder-id: which round of the ladder this run is (rounds alternate a "
                   "candidate and its reference; make compare pairs their records by round for the ratio's interval)")
    p.add_argument("--base-url", help="measure a running server instead of starting one")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels (default %(default)s)")
    p.add_argument("--modes", help="fixed,natural (default both; with --client vllm-bench fixed)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, help="use the first N prompts only")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's max_tokens (short smoke runs)")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    p.add_argument("--repeat", type=int, default=1, help="send every prompt this many times (default %(default)s)")
    p.add_argument("--request-rate", help="comma-separated open-loop levels, requests/s with Poisson arrivals")
    p.add_argument("--rate-seed", type=int, default=0, help="seed of the Poisson arrivals (default %(default)s)")
    p.add_argument("--reset-prefix-cache", action="store_true", help="empty every server's prefix cache before each "
                   "level (POST /reset_prefix_cache: servers started with VLLM_SERVER_DEV_MODE=1), so no level reuses "
                   "what an earlier one cached")
    p.add_argument("--server-log", type=Path, help="with --base-url: the running server's log, for the kernels vLLM "
                   "chose (per layer family where the project's kernel_log plugin wrote them)")
    p.add_argument("--topology", type=Path, help="measure the replicas `make serve-replicas` runs (its topology "
                   "file, .cache/replicas/<variant>.json): requests to the router, /metrics of every replica")
    p.add_argument("--session-header", action="store_true", help=f"send each request's prompt group (else its id) as "
                   f"{SESSION_HEADER}: the key a router's consistent_hash policy routes by")
    p.add_argument("--slo-ttft-ms", type=float, help="with --slo-tpot-ms: every level's goodput, the requests served "
                   "within both targets (per request) and their rate, beside its raw throughput")
    p.add_argument("--slo-tpot-ms", type=float)
    p.add_argument("--client", choices=("lab", "vllm-bench"), default="lab", help="who sends and times the requests: "
                   "the lab's client (default) or vLLM's own `bench serve` (a vLLM server; fixed length only)")
    p.add_argument("--vllm-bench-shape", default=vllm_bench.SHAPE, help="with --client vllm-bench: prompt and output "
                   f"tokens a request, IN,OUT (default %(default)s, random token ids, seed {vllm_bench.SEED})")
    return p


def single_topology(variant, hw: dict) -> dict:
    """The topology of one server of the variant: vLLM's tensor and data parallel sizes, no router."""
    par = parallelism(variant)
    return {"router": None, "policy": None, "replicas": 1, "tensor_parallel": par["tensor_parallel"],
            "data_parallel": par["data_parallel"], "gpus": parallel_size(variant) if hw.get("gpu") else 0,
            "shared_gpu": False}


def replica_topology(topo: dict) -> dict:
    """What a record keeps of a running topology (URLs and placement; PIDs only identify the run)."""
    return {"router": topo["router"], "router_version": topo.get("router_version"), "policy": topo["policy"],
            "replicas": len(topo["replicas"]), "tensor_parallel": topo["tensor_parallel"],
            "data_parallel": topo["data_parallel"], "gpus": topo["gpus"], "shared_gpu": topo.get("shared_gpu", False),
            "replica_urls": [r["url"] for r in topo["replicas"]],
            "placement": [r["placement"] for r in topo["replicas"]]}


def per_server(urls: list[str], before: list) -> list[dict]:
    """Each server's requests served, prefix-cache hits, prompt and generated tokens and the mean time of each request
    phase (prom.PHASES: the server's TTFT, queue, prefill, decode) between `before` and now."""
    out = []
    for url, b in zip(urls, before, strict=True):
        after = scrape(url)
        c = server_counters(b, after)
        served = after[0].get("vllm:request_success_total", 0.0) - b[0].get("vllm:request_success_total", 0.0) \
            if b and after else None
        out.append({"url": url, "requests": served,
                    **{k: c.get(k) for k in ("prefix_cache_queries", "prefix_cache_hits", "prefix_cache_hit_rate",
                                             "prompt_tokens", "generation_tokens", "phase_ms", "phase_requests")}})
    return out


def phase_line(servers: list[dict]) -> str:
    """The servers' mean TTFT and prefill in ms as the bench prints them ("" where no server keeps them)."""
    phases = [s.get("phase_ms") or {} for s in servers]
    if not any(p.get("ttft") is not None for p in phases):
        return ""
    return "  server ttft/prefill ms " + ", ".join(
        "/".join("—" if p.get(k) is None else f"{p[k]:.1f}" for k in ("ttft", "prefill")) for p in phases)


def reset_prefix_caches(urls: list[str]) -> None:
    for url in urls:
        if (status := http_post(f"{url}/reset_prefix_cache", timeout=60)) != 200:
            raise BenchError(f"POST {url}/reset_prefix_cache answered {status}: start the server with "
                             "VLLM_SERVER_DEV_MODE=1 (--set ENV_VLLM_SERVER_DEV_MODE=1) or leave out --reset-prefix-cache")


def clock_line(gpus: list[dict] | None) -> str:
    """The level's SM clock p50 and clock reasons on each GPU, for the progress line ('' off a GPU)."""
    return "".join(f"  sm MHz p50 {g['sm_mhz']['p50']:.0f}" + (f" ({', '.join(g['reasons'])})" if g.get("reasons") else "")
                   for g in gpus or () if g.get("sm_mhz"))


def level_summary(samples, duration: float, urls: list[str], before: list, gpus: int, slo: tuple | None) -> dict:
    summary = summarize(samples, duration)
    summary["servers"] = per_server(urls, before)
    if slo:
        summary["goodput"] = goodput(samples, duration, *slo)
    if gpus:
        summary["gpus"] = gpus
        summary["output_throughput_per_gpu"] = (summary["output_throughput"] or 0) / gpus
    return summary


def measure(args, variant, base_url: str, server: Server | None, topo: dict | None = None) -> dict:

    rows, info = load_prompts(args.prompts, args.limit)
    if vllm_client := args.client == "vllm-bench":  # its arguments checked before the server started (check_client)
        tokenizer = paths.resolve_model(variant.resolved.get("TOKENIZER", variant.resolved["MODEL"]))
        info = vllm_bench.prompt_set(args.vllm_shape, args.limit or vllm_bench.REQUESTS, Path(tokenizer))
    rows = repeat_rows(rows, args.repeat)
    if args.session_header:
        rows = with_sessions(rows)
    slo = (args.slo_ttft_ms, args.slo_tpot_ms) if args.slo_ttft_ms is not None else None
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        raise BenchError(f"--modes: unknown {bad}; valid: {', '.join(MODES)}")
    levels = parse_levels(args.concurrency)
    rates = [float(r) for r in args.request_rate.split(",") if r.strip()] if args.request_rate else []
    if any(r <= 0 for r in rates):
        raise BenchError(f"--request-rate {args.request_rate!r}: rates must be > 0")
    record = envelope("latency", variant, command=[sys.executable, "-m", "scripts.measure.latency", *sys.argv[1:]],
                      server_command=server.argv if server else None)
    record["inputs"] = {**info, "client": args.client, "modes": modes, "concurrency": levels,
                        "max_tokens_cap": args.max_tokens_cap, "temperature": 0, "warmup_requests": WARMUP_REQUESTS,
                        "base_url": base_url, "repeat": args.repeat,
                        "requests_per_level": info["num_prompts"] if vllm_client else len(rows),
                        "prefix_cache_reset_per_level": args.reset_prefix_cache,
                        "session_header": SESSION_HEADER if args.session_header else None,
                        "slo": {"ttft_ms": slo[0], "tpot_ms": slo[1]} if slo else None}
    record["topology"] = replica_topology(topo) if topo else single_topology(variant, record["hardware"])
    urls = record["topology"].get("replica_urls") or [base_url]
    gpus = record["topology"]["gpus"]
    record["startup_s"] = server.startup_s if server else None
    record["model"] = model_facts(variant)
    log = server.log_path if server else args.server_log
    record["kernels"] = kernels_from_log(log)
    record["kernels_by_family"] = kernels_by_family(log.read_text(errors="replace")) if log and log.exists() else None
    # the bytes a decode step reads and this device's copy bandwidth, measured now (GPU), before any level runs
    record["roofline"] = for_bench(Path(variant.model), variant.resolved, bool(record["hardware"].get("gpu")))
    record["engine_cores"] = engine_cores(server, bool(record["hardware"].get("gpu")))
    health = engine_of(variant).health_path
    fixed = fixed_body_for(variant)
    record["inputs"]["fixed_length_request"] = fixed
    client = openai_client(base_url)
    t_run = time.monotonic()
    model = args.served_model
    record["inputs"]["models"] = model
    for i, row in enumerate(rows[:WARMUP_REQUESTS]):
        stream_one(client, model[i % len(model)], row, "fixed", time.perf_counter(), 8, fixed)
    run_before = [scrape(u) for u in urls]
    log_start = log.stat().st_size if log and log.exists() else None  # the timed levels' part of the server log
    jiffies = cpu_jiffies()
    failure = None

    def failed(samples, what: str) -> str | None:
        if not (bad := [s for s in samples if not s.ok]):
            return None
        text = f"{len(bad)} of {len(samples)} requests failed ({what}); first: {bad[0].error}"
        return text + ("; server no longer healthy" if not stays_healthy(base_url, path=health) else "")

    for mode in modes:
        for c in levels:
            if args.reset_prefix_cache:
                reset_prefix_caches(urls)
            before = [scrape(u) for u in urls]
            clocks = gpu_clocks.start() if record["hardware"].get("gpu") else None  # what the GPU ran at meanwhile
            duration = None
            try:
                if vllm_client:  # vLLM's bench serve sends and times this level's requests
                    try:
                        peer = vllm_bench.run_level(base_url, model[0], tokenizer, args.vllm_shape, info["num_prompts"], c)
                        samples, duration = vllm_bench.samples_of(peer), peer["duration"]
                    except vllm_bench.VllmBenchError as e:
                        if not record["samples"]:  # no level measured: one line, no record
                            raise
                        failure = failure or str(e)  # the levels measured are kept, the record marked failed
                        break
                else:
                    samples, duration = run_level(client, model, rows, mode, c, args.max_tokens_cap, fixed)
            finally:  # the lab's client's level is the whole call; vLLM's bench's its last `duration` seconds (before
                # them its process starts and checks the server)
                ran_at = clocks.stop(duration if vllm_client else None) if clocks else None
            summary = level_summary(samples, duration, urls, before, gpus, slo)
            if ran_at:
                summary["gpu_clocks"] = ran_at
            if vllm_client:
                summary["vllm_bench"] = vllm_bench.headline(peer)
            if facts := record["roofline"]["bytes"]:
                bw = (record["roofline"]["bandwidth"] or {}).get("bytes_per_s")
                ctx = mean_decode_context([(s.prompt_tokens, s.output_tokens) for s in samples if s.ok])
                summary["roofline"] = (level_roofline(facts, bw, ctx, c, summary.get("median_tpot_ms"), record["topology"])
                                      if ctx else None)
            record["samples"].append({"mode": mode, "concurrency": c, "requests": [s.to_json() for s in samples]})
            record["summary"].setdefault(mode, {})[str(c)] = summary
            print(f"{mode:7s} c={c:<3d} ok {summary['completed']}/{len(samples)}  out {summary['output_throughput'] or 0:7.1f} tok/s"
                  f"  ttft p50 {summary['median_ttft_ms'] or 0:7.1f} ms  tpot p50 {summary['median_tpot_ms'] or 0:6.1f} ms"
                  f"  prefix hits {[s['prefix_cache_hit_rate'] and round(s['prefix_cache_hit_rate'], 3) for s in summary['servers']]}"
                  + phase_line(summary["servers"]) + clock_line(summary.get("gpu_clocks")), flush=True)
            if (failure := failure or failed(samples, f"{mode}, c={c}")) and "no longer healthy" in failure:
                break
        if failure and not is_healthy(base_url, path=health):
            break
    if rates and not (failure and not is_healthy(base_url, path=health)):
        record["rate_sweep"] = []
        for rate in rates:
            if args.reset_prefix_cache:
                reset_prefix_caches(urls)
            before = [scrape(u) for u in urls]
            samples, duration = run_rate(client, model, rows, modes[0], rate, args.max_tokens_cap, fixed, args.rate_seed)
            summary = level_summary(samples, duration, urls, before, gpus, slo)
            record["samples"].append({"mode": modes[0], "request_rate": rate, "requests": [s.to_json() for s in samples]})
            record["rate_sweep"].append({"mode": modes[0], "request_rate": rate, "seed": args.rate_seed, "summary": summary})
            print(f"{modes[0]:7s} rate={rate:<5g} ok {summary['completed']}/{len(samples)}  out "
                  f"{summary['output_throughput'] or 0:7.1f} tok/s  ttft p99 {summary['p99_ttft_ms'] or 0:7.1f} ms  "
                  f"tpot p99 {summary['p99_tpot_ms'] or 0:6.1f} ms", flush=True)
            failure = failure or failed(samples, f"rate {rate}/s")
    healthy = is_healthy(base_url, path=health)
    if topo:
        record["server_metrics"] = {"available": False, "replicas": per_server(urls, run_before) if healthy else None}
    else:
        record["server_metrics"] = server_counters(run_before[0], scrape(base_url) if healthy else None)
        if variant.engine == "sglang" and log_start is not None:  # no /metrics without --enable-metrics: its log's
            try:  # only what the timed levels wrote
                with log.open("rb") as f:
                    if f.seek(0, os.SEEK_END) < log_start:
                        record["server_metrics"]["spec_decode_source"] = "SGLang's log is shorter than at the run's start"
                    f.seek(log_start)
                    text = f.read()
            except OSError as e:
                text, record["server_metrics"]["spec_decode_source"] = b"", f"SGLang's log unreadable after the run ({e})"
            record["server_metrics"].update(sglang_acceptance(text.decode(errors="replace")))
    record["server_rss_mib"] = group_rss_mib(server.pid) if server else None  # after the run: weights, KV, adapters
    # how busy the whole machine was while the levels ran (this bench, the engine and anything else on it): on a GPU
    # machine, whether the pool's idle servers or other work took the host the engine schedules from
    record["host_cpu"] = {"busy_share": busy_share(jiffies, cpu_jiffies()), "cpus": os.cpu_count()}
    record["duration_s"] = round(time.monotonic() - t_run, 2)
    if failure:
        record["status"], record["failure"] = "failed", failure
    return record


SGLANG_ACCEPT = re.compile(r"Decode batch.*?accept len: ([0-9.]+)")


def sglang_acceptance(log_text: str) -> dict:
    """SGLang's tokens a step under speculation, from its log: each "Decode batch" line of a speculative server says
    "accept len: X" (1 + the drafts accepted a step, over its logging interval); their mean, with how many lines gave
    it. Empty where no line says so (no speculation)."""
    lens = [float(m) for m in SGLANG_ACCEPT.findall(log_text)]
    if not lens:
        return {}
    return {"spec_decode_mean_acceptance_length": sum(lens) / len(lens),
            "spec_decode_source": f"SGLang's log: the mean accept len of {len(lens)} decode-batch lines"}


def check_client(args, variant) -> None:
    """--client vllm-bench's arguments, before any server starts: a vLLM server's one model, closed-loop fixed-length
    levels (vLLM's bench has no natural mode, Poisson sweep, repeat, session header or router topology here); sets
    args.vllm_shape and the default modes."""
    args.modes = args.modes or ("fixed" if args.client == "vllm-bench" else ",".join(MODES))
    if args.client != "vllm-bench":
        return
    args.vllm_shape = vllm_bench.parse_shape(args.vllm_bench_shape)
    if args.limit is not None and args.limit < 1:
        raise BenchError(f"--client vllm-bench: --limit {args.limit}: requests a level is a count of at least 1")
    if variant.engine != "vllm":
        raise BenchError(f"--client vllm-bench: {variant.name} is served by {variant.engine}; vLLM's bench serve "
                         "drives a vLLM server")
    if len(variant.request_models) > 1:
        raise BenchError(f"--client vllm-bench: {variant.name} serves {len(variant.request_models)} models (adapters); "
                         "vLLM's bench sends to one: use the lab's client")
    if (args.request_rate or args.repeat > 1 or args.topology or args.max_tokens_cap or args.session_header
            or args.modes != "fixed"):
        raise BenchError("--client vllm-bench runs closed-loop fixed-length levels of one server: leave out "
                         "--request-rate, --repeat, --topology, --max-tokens-cap and --session-header, and --modes "
                         "other than fixed")


def run_variant(name: str, args, ladder_id: str | None = None) -> int:
    """Measure one variant (starting its server unless --base-url) and write its record. Returns an exit code."""
    try:
        if (args.slo_ttft_ms is None) != (args.slo_tpot_ms is None):
            raise BenchError("--slo-ttft-ms and --slo-tpot-ms go together (goodput counts requests within both)")
        variant = load_variant(name, overrides=parse_overrides(args.set))
        check_client(args, variant)
        args.served_model = variant.request_models
        reset_counters(variant)
        topo = read_topology(args.topology) if args.topology else None
        if topo and args.base_url:
            raise BenchError("--topology names the router's URL: leave out --base-url")
        health = engine_of(variant).health_path
        if topo and (down := [r["url"] for r in topo["replicas"] if not is_healthy(r["url"], path=health)]):
            # make serve-replicas keeps serving with a replica down; a record of the topology would count it anyway
            raise BenchError(f"replica {', '.join(down)} of {args.topology} is down: measure the topology once every "
                             "replica answers (make serve-replicas restarts one that exited)")
        with variant_server(variant, base_url=topo["base_url"] if topo else args.base_url, port=args.port,
                            purpose="bench") as (base_url, server):
            record = measure(args, variant, base_url, server, topo)
        if counters := read_counters(variant):
            record["engine_counters"] = counters  # over the whole server run: warm-up requests included
        record["inputs"]["ladder_id"] = ladder_id
        if args.round:
            record["inputs"]["round"] = args.round
    except (BenchError, PromptSetError, VariantError, ServerError, CheckpointError, ReplicaError, ValueError,
            vllm_bench.VllmBenchError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if (path := save_record(record, args.out_dir or variant.path, "latency")) is None:
        return 1
    print(f"wrote {paths.shown(path)} (status {record['status']})")
    if record["status"] != "ok":
        print(f"error: {record['failure']}", file=sys.stderr)
        return 1
    return 0


def ladder(base: str) -> list[str]:
    """Variants of one base model whose weights are present, reference (no PARENT) first."""
    names = []
    for name in list_variants():
        v = load_variant(name)
        model = v.resolved["MODEL"]
        if v.resolved["BASE"] == base and (not model.startswith("weights/") or (paths.ROOT / model).exists()):
            names.append((bool(v.resolved.get("PARENT")), name))
    return [n for _, n in sorted(names)]


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.ladder:
        return run_variant(args.variant, args, args.ladder_id)
    names = ladder(args.variant)
    if args.only:
        keep = set(args.only.split(","))
        names = [n for i, n in enumerate(names) if i == 0 or n in keep]
    if not names:
        print(f"error: no variant of base {args.variant!r} has its weights present", file=sys.stderr)
        return 1
    ladder_id = f"{args.variant}-{now_utc():%Y%m%d-%H%M%S}"
    print(f"ladder {ladder_id}: {', '.join(names)} (back to back, {args.rounds} round(s))", flush=True)
    worst = 0
    for k, order in enumerate(round_orders(names, args.rounds), start=1):
        args.round = k if args.rounds > 1 else None
        worst = max([worst, *(run_variant(n, args, ladder_id) for n in order)])
    return worst


if __name__ == "__main__":
    sys.exit(main())
