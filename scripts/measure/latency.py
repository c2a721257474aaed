"""Latency and throughput of a variant's server: TTFT, ITL, TPOT, E2E at several concurrencies; writes a record.

    python -m scripts.measure.latency smollm2-bf16                          # starts the server, measures, stops it
    python -m scripts.measure.latency smollm2-bf16 --base-url http://127.0.0.1:8000   # a server already running
    python -m scripts.measure.latency smollm2-bf16 --concurrency 1,8 --modes fixed --limit 8

Replays a fixed, versioned prompt set (eval/prompts/latency-v1.jsonl) with streamed greedy chat requests, after a
warm-up, at each concurrency (at most N requests in flight). Modes: `fixed` (ignore_eos: every request generates
exactly its max_tokens, the fair speed comparison) and `natural` (stops at EOS). Scrapes /metrics before and after
(KV capacity, KV usage, preemptions, prefix-cache hits, speculative acceptance). Writes
experiments/<variant>/latency_<YYYYMMDD-HHMMSS>.json atomically; a run with failed requests is recorded as failed.
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.common.engines import engine_of, fixed_body_for, vllm_cpu_cores
from scripts.common.loadgen import (
    DEFAULT_PROMPTS,
    PromptSetError,
    load_prompts,
    openai_client,
    parse_levels,
    run_level,
    stream_one,
)
from scripts.common.metrics import summarize
from scripts.common.records import envelope, now_utc, read_counters, reset_counters, save_record
from scripts.common.server import Server, ServerError, group_rss_mib, is_healthy, stays_healthy
from scripts.common.variants import VariantError, list_variants, load_variant, parse_overrides
from scripts.measure.prom import scrape, server_counters
from scripts.serve.launch import variant_server

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
    p.add_argument("--base-url", help="measure a running server instead of starting one")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels (default %(default)s)")
    p.add_argument("--modes", default=",".join(MODES), help="fixed,natural")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, help="use the first N prompts only")
    p.add_argument("--max-tokens-cap", type=int, help="cap every request's max_tokens (short smoke runs)")
    p.add_argument("--port", type=int, default=8123, help="port of the server this script starts")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def measure(args, variant, base_url: str, server: Server | None) -> dict:

    rows, info = load_prompts(args.prompts, args.limit)
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in MODES]:
        raise BenchError(f"--modes: unknown {bad}; valid: {', '.join(MODES)}")
    levels = parse_levels(args.concurrency)
    record = envelope("latency", variant, command=[sys.executable, "-m", "scripts.measure.latency", *sys.argv[1:]],
                      server_command=server.argv if server else None)
    record["inputs"] = {**info, "modes": modes, "concurrency": levels, "max_tokens_cap": args.max_tokens_cap,
                        "temperature": 0, "warmup_requests": WARMUP_REQUESTS, "base_url": base_url}
    record["startup_s"] = server.startup_s if server else None
    record["model"] = model_facts(variant)
    record["kernels"] = kernels_from_log(server.log_path if server else None)
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
    before = scrape(base_url)
    failure = None
    for mode in modes:
        for c in levels:
            samples, duration = run_level(client, model, rows, mode, c, args.max_tokens_cap, fixed)
            summary = summarize(samples, duration)
            record["samples"].append({"mode": mode, "concurrency": c, "requests": [s.to_json() for s in samples]})
            record["summary"].setdefault(mode, {})[str(c)] = summary
            print(f"{mode:7s} c={c:<3d} ok {summary['completed']}/{len(samples)}  out {summary['output_throughput'] or 0:7.1f} tok/s"
                  f"  ttft p50 {summary['median_ttft_ms'] or 0:7.1f} ms  tpot p50 {summary['median_tpot_ms'] or 0:6.1f} ms",
                  flush=True)
            if summary["failed"]:
                first = next(s.error for s in samples if not s.ok)
                failure = f"{summary['failed']} of {len(samples)} requests failed ({mode}, c={c}); first: {first}"
                if not stays_healthy(base_url, path=health):
                    failure += "; server no longer healthy"
                    break
        if failure and not is_healthy(base_url, path=health):
            break
    record["server_metrics"] = server_counters(before, scrape(base_url) if is_healthy(base_url, path=health) else None)
    record["server_rss_mib"] = group_rss_mib(server.pid) if server else None  # after the run: weights, KV, adapters
    record["duration_s"] = round(time.monotonic() - t_run, 2)
    if failure:
        record["status"], record["failure"] = "failed", failure
    return record


def run_variant(name: str, args, ladder_id: str | None = None) -> int:
    """Measure one variant (starting its server unless --base-url) and write its record. Returns an exit code."""
    try:
        variant = load_variant(name, overrides=parse_overrides(args.set))
        args.served_model = variant.request_models
        reset_counters(variant)
        with variant_server(variant, base_url=args.base_url, port=args.port, purpose="bench") as (base_url, server):
            record = measure(args, variant, base_url, server)
        if counters := read_counters(variant):
            record["engine_counters"] = counters  # over the whole server run: warm-up requests included
        record["inputs"]["ladder_id"] = ladder_id
    except (BenchError, PromptSetError, VariantError, ServerError, CheckpointError, ValueError) as e:
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
        return run_variant(args.variant, args)
    names = ladder(args.variant)
    if args.only:
        keep = set(args.only.split(","))
        names = [n for i, n in enumerate(names) if i == 0 or n in keep]
    if not names:
        print(f"error: no variant of base {args.variant!r} has its weights present", file=sys.stderr)
        return 1
    ladder_id = f"{args.variant}-{now_utc():%Y%m%d-%H%M%S}"
    print(f"ladder {ladder_id}: {', '.join(names)} (back to back)", flush=True)
    return max(run_variant(n, args, ladder_id) for n in names)


if __name__ == "__main__":
    sys.exit(main())
