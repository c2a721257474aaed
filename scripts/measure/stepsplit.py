"""Where a decode step's time goes in vLLM's model runner, on any device: target forward, sampling, drafting, the rest.

    python -m scripts.measure.stepsplit smollm2-bf16-bbeagle4          # starts the server with the profiler on
    python -m scripts.measure.stepsplit smollm2-bf16 --concurrency 1,8 --output-tokens 96

vLLM wraps each part of a step in a profiler scope (gpu_model_runner: preprocess, forward, postprocess, sample,
draft, bookkeep, ...; the CPU runner inherits them) when VLLM_CUSTOM_SCOPES_FOR_PROFILING=1, which this sets. The variant's server is started with vLLM's torch profiler
(SERVE_PROFILER_CONFIG: PROFILER below, writing under .cache/stepsplit/<variant>), warmed up, then for each
concurrency c: POST /start_profile, c concurrent greedy requests of exactly --output-tokens tokens, POST
/stop_profile; the worker's trace is reduced to milliseconds per engine step per scope (the profiler's window skips
the first `delay_iterations` steps: steady decode). For a speculative variant, `forward` is the verification of K+1
tokens per request, `sample` includes rejection sampling and `draft` the proposer (K drafter passes for EAGLE, the
lookup for n-gram); with the tokens per step (output tokens / steps) that says whether the drafting or the
verification eats the gain. CPU times are wall time of the scopes (the CPU runner executes inside them); on a GPU
they include only launches unless the scope synchronizes. Writes experiments/<variant>/stepsplit_<stamp>.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.loadgen import PromptSetError, load_prompts
from scripts.common.records import envelope, finish_record
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant, parse_overrides
from scripts.measure.profile import (
    ProfileError,
    load_trace,
    newest_trace,
    profiled_requests,
    run_requests,
    short_prompts,
    step_annotations,
)
from scripts.measure.prom import scrape, server_counters
from scripts.serve.launch import variant_server

KIND = "stepsplit"
SCOPE_PREFIX = "gpu_model_runner: "
DELAY_STEPS = 8  # profiler window: skip the first steps of each window (prefill, ramp-up)
WARMUP_TOKENS = 16


def profiler_config(folder: Path, window_steps: int) -> dict:
    return {"profiler": "torch", "torch_profiler_dir": str(folder), "ignore_frontend": True,
            "torch_profiler_with_stack": False, "torch_profiler_dump_cuda_time_total": False,
            "delay_iterations": DELAY_STEPS, "max_iterations": window_steps}


def scope_split(events: list[dict]) -> dict:
    """ms per engine step per runner scope. A step's time is the period between consecutive steps (the starts of
    vLLM's execute_* annotations): the annotation covers execute_model only (preprocess, forward, postprocess, where
    the logits are computed), while sampling, drafting and bookkeeping run in sample_tokens after it; `other` is the
    period minus every scope (scheduling, output processing, the gaps)."""
    steps = step_annotations(events)
    starts = sorted(e["ts"] for e in events if e.get("ph") == "X" and e.get("cat") == "user_annotation"
                    and e.get("name", "").startswith("execute_"))
    if len(starts) < 2:
        raise ProfileError("the trace holds fewer than two engine step annotations (execute_*): was the window empty?")
    scopes: dict[str, float] = defaultdict(float)
    for e in events:  # scopes of the steps whose period is known: from the first step start to the last
        if e.get("ph") == "X" and e.get("name", "").startswith(SCOPE_PREFIX) and starts[0] <= e["ts"] < starts[-1]:
            scopes[e["name"][len(SCOPE_PREFIX):]] += e.get("dur", 0.0)
    n = len(starts) - 1
    period_ms = (starts[-1] - starts[0]) / n / 1000
    per = {k: round(v / n / 1000, 3) for k, v in sorted(scopes.items(), key=lambda kv: -kv[1])}
    return {"steps": steps, "periods": n, "step_ms": round(period_ms, 3), "scopes_ms_per_step": per,
            "other_ms_per_step": round(period_ms - sum(per.values()), 3)}


def level_parser(doc: str, concurrency: str, port: int) -> argparse.ArgumentParser:
    """The arguments of a run of fixed-length requests per concurrency level against a variant's server (this script,
    scripts.measure.cpu_profile and scripts.measure.host_sample)."""
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--concurrency", default=concurrency, help="comma-separated levels (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=96, help="tokens per request (default %(default)s)")
    p.add_argument("--prompts", type=Path, default=paths.EVAL / "prompts" / "latency-v1.jsonl")
    p.add_argument("--port", type=int, default=port)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path)
    return p


def window_parser(doc: str, concurrency: str, port: int) -> argparse.ArgumentParser:
    """level_parser's arguments and the profiler's window (this script and scripts.measure.cpu_profile)."""
    p = level_parser(doc, concurrency, port)
    p.add_argument("--window-steps", type=int, default=48, help="engine steps the profiler records per level")
    return p


def warm_up(base: str, model: str, rows: list[dict], levels: list[int]) -> None:
    """One request, then the largest level's count at once, WARMUP_TOKENS tokens each (warmup_note says so)."""
    run_requests(base, model, short_prompts(rows, 1, WARMUP_TOKENS))
    run_requests(base, model, short_prompts(rows, max(levels), WARMUP_TOKENS))


def warmup_note(levels: list[int]) -> str:
    return f"1 request, then {max(levels)} at once, {WARMUP_TOKENS} tokens each"


def profiled_variant(args: argparse.Namespace, folder: Path):
    """(levels, profiler config, the variant with vLLM's profiler and runner scopes on) from window_parser's arguments;
    ProfileError / VariantError / ValueError for bad ones."""
    levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    if not levels or min(levels) < 1:
        raise ProfileError(f"--concurrency {args.concurrency!r}: positive integers")
    if DELAY_STEPS + args.window_steps >= args.output_tokens:
        raise ProfileError(f"{DELAY_STEPS} + --window-steps {args.window_steps} must stay below --output-tokens "
                           f"{args.output_tokens}: the window would reach past the requests' last step")
    prof = profiler_config(folder, args.window_steps)
    # vLLM opens its runner scopes only under VLLM_CUSTOM_SCOPES_FOR_PROFILING (vllm/v1/utils.py)
    variant = load_variant(args.variant, overrides={**parse_overrides(args.set),
                                                    "SERVE_PROFILER_CONFIG": json.dumps(prof),
                                                    "ENV_VLLM_CUSTOM_SCOPES_FOR_PROFILING": "1"})
    return levels, prof, variant


def build_parser() -> argparse.ArgumentParser:
    return window_parser(__doc__, concurrency="1", port=8131)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    folder = paths.CACHE / "stepsplit" / f"{args.variant}-{time.strftime('%Y%m%d-%H%M%S')}"
    try:
        levels, prof, variant = profiled_variant(args, folder)
        rows, _ = load_prompts(args.prompts)
    except (ProfileError, VariantError, PromptSetError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    record = envelope(KIND, variant, command=[sys.executable, "-m", "scripts.measure.stepsplit", *argv],
                      server_command=None)
    record["inputs"] = {"concurrency": levels, "output_tokens": args.output_tokens, "prompts": args.prompts.name,
                        "profiler_config": prof, "warmup": warmup_note(levels), "rule": "ms per engine step = period between consecutive execute_* annotations; a "
                        "scope's = its summed durations within those periods / periods"}
    results = {}
    try:
        with variant_server(variant, base_url=None, port=args.port, purpose="stepsplit") as (base, _):
            model = variant.served_name
            warm_up(base, model, rows, levels)
            for c in levels:
                since, before = time.time() - 1, scrape(base)
                samples = profiled_requests(base, model, rows, c, args.output_tokens)
                trace = newest_trace(folder, since)
                res = scope_split(load_trace(trace))
                counters = server_counters(before, scrape(base))
                # tokens a request gains per step: the mean acceptance length of the level's requests (1: plain)
                per_step = counters.get("spec_decode_mean_acceptance_length") or 1.0
                res.update(trace_file=str(trace), output_tokens=sum(s.output_tokens for s in samples),
                           tokens_per_request_step=round(per_step, 3),
                           ms_per_token=round(res["step_ms"] / per_step, 3),
                           acceptance_per_position=counters.get("spec_decode_acceptance_per_position"))
                results[str(c)] = res
                per = ", ".join(f"{k} {v:.2f}" for k, v in list(res["scopes_ms_per_step"].items())[:6])
                print(f"c={c}: {res['steps']['steps']} steps in the window, {res['step_ms']:.2f} ms/step ({per}; "
                      f"other {res['other_ms_per_step']:.2f}); {per_step:.2f} tokens per request per step: "
                      f"{res['ms_per_token']:.2f} ms per token", flush=True)
    except (ProfileError, ServerError, CheckpointError, OSError, json.JSONDecodeError) as e:
        record["summary"] = results
        return finish_record(record, args.out_dir or variant.path, KIND, e)
    record["summary"] = results
    return finish_record(record, args.out_dir or variant.path, KIND)


if __name__ == "__main__":
    sys.exit(main())
