"""vLLM's own load generator (`vllm bench serve`) as the latency bench's client: the same record, the same summary
and roofline, the requests sent and timed by vLLM's benchmark instead of the lab's client.

    python -m scripts.measure.latency V --base-url URL --client vllm-bench [--vllm-bench-shape 256,128] [--limit 16]

Each level is one run of vLLM's `bench serve` in a Python process of its own (random dataset: `--random-input-len` /
`--random-output-len` tokens, seed SEED, `--ignore-eos`: every request generates exactly its output length, as the
lab's fixed mode) at `--max-concurrency` c. vLLM's detailed result is read back into the lab's request samples (its
TTFTs, inter-token gaps, latencies, output lengths and errors), so the summary is computed as the lab's client's is;
vLLM's own headline figures are kept beside it (`vllm_bench`) as vLLM printed them. Records of this client name their
prompt set `vllm-bench-random-<in>-<out>`, hashed from the dataset's parameters and the tokenizer its token ids are
drawn from: `make compare` tables them apart from the lab's prompt sets. Before its timed requests, vLLM's bench sends
its first prompt once untimed (its ready check), so with prefix caching that prompt's timed request finds its prefix
cached: one TTFT of a level may read low; its TPOT is unaffected.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from scripts.common.checkpoint import sha256_file
from scripts.common.metrics import RequestSample

SEED = 0
SHAPE = "256,128"  # --vllm-bench-shape's default: prompt and output tokens a request
REQUESTS = 16  # requests a level without --limit
# vLLM's headline figures kept beside the lab's summary of the same requests (names as vLLM writes them)
HEADLINE = ("completed", "duration", "output_throughput", "median_ttft_ms", "median_tpot_ms", "mean_tpot_ms",
            "median_itl_ms", "p99_tpot_ms")

# one level's argv through vLLM's own parser and main (the parser's module moved between releases)
RUNNER = """
import json, sys
try:
    from vllm.utils.argparse_utils import FlexibleArgumentParser
except ImportError:
    from vllm.utils import FlexibleArgumentParser
from vllm.benchmarks.serve import add_cli_args, main
p = FlexibleArgumentParser()
add_cli_args(p)
main(p.parse_args(json.loads(sys.argv[1])))
"""
# the per-request lists of vLLM's detailed result that samples_of reads (latencies and start_times where written)
PER_REQUEST = ("ttfts", "itls", "input_lens", "output_lens", "errors")


class VllmBenchError(RuntimeError):
    """vLLM's benchmark did not run or wrote no result; one line, ready to print."""


def parse_shape(text: str) -> tuple[int, int]:
    """`--vllm-bench-shape IN,OUT` (prompt and output tokens a request)."""
    try:
        a, b = (int(x) for x in text.split(","))
    except ValueError:
        raise ValueError(f"--vllm-bench-shape {text!r}: give prompt and output tokens as IN,OUT (e.g. {SHAPE})") \
            from None
    if a < 1 or b < 2:
        raise ValueError(f"--vllm-bench-shape {text!r}: at least 1 prompt token and 2 output tokens (TPOT needs two)")
    return a, b


def tokenizer_digest(tokenizer: Path) -> str | None:
    """sha256 of the tokenizer's vocabulary file (tokenizer.json), None where it has none."""
    f = tokenizer / "tokenizer.json"
    return sha256_file(f) if f.is_file() else None


def prompt_set(shape: tuple[int, int], n: int, tokenizer: Path) -> dict:
    """The record's prompt-set fields for vLLM's random dataset of n requests: named and hashed from its parameters and
    its tokenizer (vLLM draws the token ids from the tokenizer's vocabulary with its seed)."""
    params = {"dataset": "random", "input_len": shape[0], "output_len": shape[1], "range_ratio": 0, "seed": SEED,
              "num_prompts": n, "tokenizer_sha256": tokenizer_digest(tokenizer)}
    digest = hashlib.sha256(json.dumps(params, sort_keys=True).encode()).hexdigest()
    return {"prompt_set": f"vllm-bench-random-{shape[0]}-{shape[1]}", "prompt_set_sha256": digest, "num_prompts": n,
            "vllm_bench_dataset": params}


def level_argv(base_url: str, model: str, tokenizer: str, shape: tuple[int, int], n: int, c: int,
               out: Path) -> list[str]:
    """vLLM's `bench serve` arguments for one level: the completions endpoint, greedy, exactly `shape[1]` tokens."""
    return ["--backend", "vllm", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--dataset-name", "random", "--random-input-len", str(shape[0]),
            "--random-output-len", str(shape[1]), "--random-range-ratio", "0", "--num-prompts", str(n),
            "--max-concurrency", str(c), "--request-rate", "inf", "--ignore-eos", "--temperature", "0",
            "--seed", str(SEED), "--percentile-metrics", "ttft,tpot,itl,e2el", "--disable-tqdm",
            "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"c{c}.json"]


def samples_of(result: dict) -> list[RequestSample]:
    """The lab's request samples from vLLM's detailed result: a request's end is its start plus its latency (vLLM's
    `latencies`; older releases without them: TTFT plus the inter-token gaps), its start vLLM's `start_times` where
    written, relative to the first."""
    n = len(result.get("ttfts") or [])
    if not n:
        raise VllmBenchError("vLLM's result holds no per-request data (was --save-detailed dropped?)")
    optional = [k for k in ("latencies", "start_times") if result.get(k)]
    if bad := [k for k in (*PER_REQUEST, *optional) if len(result.get(k) or []) != n]:
        raise VllmBenchError(f"vLLM's result lists {n} TTFTs but not as many {', '.join(bad)}: an unknown result "
                             "format")
    starts = result.get("start_times") or [0.0] * n
    t0 = min(starts)
    latencies = result.get("latencies") or [None] * n
    out = []
    for i in range(n):
        ttft, itl, err = result["ttfts"][i], list(result["itls"][i] or []), result["errors"][i]
        ok = not err and bool(ttft)
        lat = latencies[i] if latencies[i] is not None else (ttft or 0.0) + sum(itl)
        start = starts[i] - t0
        # a failed request's reason: the last line of what vLLM kept (a traceback for one that raised)
        why = ((err or "").strip().splitlines() or ["vLLM's bench recorded no reason"])[-1] if not ok else None
        out.append(RequestSample(prompt_id=f"random-{i}", ok=ok, start_s=start, end_s=start + (lat if ok else 0.0),
                                 prompt_tokens=int(result["input_lens"][i]),
                                 output_tokens=int(result["output_lens"][i]),
                                 ttft_s=ttft if ok else None, itl_s=itl, error=why))
    return out


def headline(result: dict) -> dict:
    """vLLM's own figures of a level, as it printed them (HEADLINE's keys; None where its release writes none)."""
    return {k: result.get(k) for k in HEADLINE}


def run_level(base_url: str, model: str, tokenizer: str, shape: tuple[int, int], n: int, c: int,
              timeout_s: float = 1800) -> dict:
    """vLLM's result of one `bench serve` run at concurrency c (its duration checked: the level's time)."""
    with tempfile.TemporaryDirectory(prefix="vllm-bench-") as tmp:
        out = Path(tmp)
        try:
            proc = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(level_argv(base_url, model, tokenizer,
                                                                                      shape, n, c, out))],
                                  capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            raise VllmBenchError(f"vLLM's bench serve ran past {timeout_s:.0f} s at c={c}") from None
        f = out / f"c{c}.json"
        if not f.exists():
            tail = (proc.stderr or proc.stdout or "").strip().splitlines()[-1:] or ["no output"]
            raise VllmBenchError(f"vLLM's bench serve wrote no result at c={c} (exit {proc.returncode}): {tail[0]}")
        try:
            result = json.loads(f.read_text())
        except (OSError, ValueError) as e:  # a result cut short (its process killed while writing it)
            raise VllmBenchError(f"vLLM's result at c={c} does not read as JSON: {e}") from None
    if not isinstance(result.get("duration"), (int, float)) or result["duration"] <= 0:
        raise VllmBenchError(f"vLLM's result at c={c} states no duration: an unknown result format")
    return result
