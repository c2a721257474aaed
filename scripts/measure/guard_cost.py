"""What the request front costs a llama-server variant, paired on one engine: the same server reached through its
front (scripts/serve/front.py) and directly on the engine's loopback port, in alternating rounds.

    python -m scripts.measure.guard_cost smollm2-gguf-q8-0-server          # `make guard-cost VARIANT=…`
    python -m scripts.measure.guard_cost smollm2-gguf-q8-0-server --rounds 16 --concurrency 1,8 --max-tokens 64

A ladder of two variants (guarded, REQUEST_GUARD=0) compares two servers started apart, so their own spread (the
process, its memory, the machine's moment) sits in the ratio; here both paths reach one engine process, and each round
is one wave of --requests requests at the level, half through the front and half direct, the paths taking turns
request by request (the first request's path alternating over the rounds). At c=1 the two paths alternate in time;
above it they share the engine's batches: either way both sample the same moment of the machine, and what differs is
the front alone. Per level: the ratio front / direct of TPOT, TTFT and end-to-end latency (the medians of each path's
requests in a round), the geometric mean over the rounds with its 95% interval (Student's t on the log ratios:
scripts/common/metrics.speed_ratio). Writes experiments/<variant>/guard_<YYYYMMDD-HHMMSS>.json; the front's target
(TPOT at c=1 <= 1.02, its interval's upper end) is judged in its summary.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.engines import engine_of, fixed_body_for
from scripts.common.loadgen import PromptSetError, load_prompts, openai_client, parse_levels, stream_one
from scripts.common.metrics import SpeedRatio, speed_ratio, summarize
from scripts.common.records import envelope, exit_status, mark_unmet, save_record
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant
from scripts.serve.launch import variant_server

PROMPTS = paths.ROOT / "eval" / "prompts" / "latency-v1.jsonl"
METRICS = ("tpot_ms", "ttft_ms", "e2el_ms")
TARGET_TPOT_C1 = 1.02  # the front's cost at c=1: the upper end of the TPOT ratio's 95% interval


class GuardCostError(RuntimeError):
    pass


def engine_url(argv: list[str]) -> str:
    """The engine's own loopback URL from the front's command (`--engine-port P`)."""
    if "--engine-port" not in argv:
        raise GuardCostError("the server has no request front (REQUEST_GUARD=0, or not a llama-server variant)")
    return f"http://127.0.0.1:{argv[argv.index('--engine-port') + 1]}"


def wave(urls: dict[str, str], model: str, rows: list[dict], concurrency: int, max_tokens: int, body: dict,
         first: str) -> dict:
    """One round: the rows at `concurrency`, paths taking turns from `first`; each path's medians (ms)."""
    clients = {path: openai_client(url) for path, url in urls.items()}
    order = [first, next(p for p in urls if p != first)]
    routes = [order[i % 2] for i in range(len(rows))]
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(concurrency) as ex:
        samples = list(ex.map(lambda ir: stream_one(clients[routes[ir[0]]], model, ir[1], "fixed", t0, max_tokens, body),
                              enumerate(rows)))
    if failed := [(r, s) for r, s in zip(routes, samples, strict=True) if not s.ok]:
        raise GuardCostError(f"{len(failed)} of {len(samples)} requests failed ({failed[0][0]}: {failed[0][1].error})")
    out = {}
    for path in urls:
        mine = [s for r, s in zip(routes, samples, strict=True) if r == path]
        got = summarize(mine)
        out[path] = {"tpot_ms": got["median_tpot_ms"], "ttft_ms": got["median_ttft_ms"], "e2el_ms": got["median_e2el_ms"],
                     "requests": len(mine)}
    return out


# speed_ratio's verdict reads its pairs as speeds (higher is faster); these are latencies, front over direct
COST = {"faster": "costlier", "slower": "cheaper", "tie": "tie", "one round": "one round"}


def ratios(rounds: list[dict]) -> dict:
    """front / direct per metric over the rounds, with its interval; verdict costlier (the interval above 1.00: the
    front adds latency), cheaper, or tie."""
    out = {}
    for key in METRICS:
        sr = speed_ratio([(r["front"][key], r["direct"][key]) for r in rounds])
        out[key] = {**sr.to_json(), "verdict": COST[sr.verdict]} if sr else None
    return out


def measure(variant, args) -> dict:
    rows, prompt_meta = load_prompts(args.prompts)
    body = fixed_body_for(variant)
    levels = {}
    with variant_server(variant, base_url=args.base_url, port=None, purpose="guard-cost") as (front, server):
        direct = args.engine_url or engine_url(server.argv)
        for c in args.concurrency:
            n = max(args.requests, 2 * c)  # both paths in every batch of c
            n += n % 2
            wave_rows = (rows * (n // len(rows) + 1))[:n]
            rounds = []
            for k in range(1, args.rounds + 1):
                first = "front" if k % 2 else "direct"
                got = wave({"front": front, "direct": direct}, variant.served_name, wave_rows, c, args.max_tokens,
                           body, first)
                rounds.append({"round": k, "first": first, **got})
            levels[str(c)] = {"rounds": rounds, "front_over_direct": ratios(rounds)}
            tp = levels[str(c)]["front_over_direct"]["tpot_ms"]
            print(f"c={c}: TPOT front / direct " + (f"{SpeedRatio.from_json(tp).text('.3f')} over {tp['rounds']} "
                  f"rounds ({tp['verdict']})" if tp else "not measured (no request had two tokens)"), flush=True)
    return {"levels": levels, "prompt_set": prompt_meta, "server_command": server.argv if server else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a llama-server variant served behind the front (REQUEST_GUARD=1, the default)")
    p.add_argument("--rounds", type=int, default=32, help="alternating rounds per level (default %(default)s)")
    p.add_argument("--concurrency", type=parse_levels, default=[1, 8], help="levels, e.g. 1,8 (default 1,8)")
    p.add_argument("--requests", type=int, default=8,
                   help="requests a round, half through each path (at least twice the level; default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens each request generates (default %(default)s)")
    p.add_argument("--prompts", type=Path, default=PROMPTS, help="prompt set (default %(default)s)")
    p.add_argument("--base-url", help="a running server of the variant (its front); with --engine-url")
    p.add_argument("--engine-url", help="that server's engine on its loopback port (the front's --engine-port)")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.rounds < 2 or args.max_tokens < 2 or bool(args.base_url) != bool(args.engine_url):
        print("error: --rounds and --max-tokens must be at least 2 (an interval needs two rounds, a TPOT two tokens), "
              "and --base-url and --engine-url go together", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    try:
        variant = load_variant(args.variant)
        if engine_of(variant).name != "llamaserver" or variant.resolved.get("REQUEST_GUARD", "1") != "1":
            raise GuardCostError(f"{variant.name} is not served behind the request front (a llama-server variant "
                                 f"with REQUEST_GUARD=1): nothing to measure")
        got = measure(variant, args)
    except (GuardCostError, VariantError, ServerError, PromptSetError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    record = envelope("guard", variant, command=[sys.executable, "-m", "scripts.measure.guard_cost", *sys.argv[1:]],
                      server_command=got["server_command"])
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["inputs"] = {"rounds": args.rounds, "concurrency": args.concurrency, "requests": args.requests,
                        "max_tokens": args.max_tokens,
                        "mode": "fixed", "prompt_set": got["prompt_set"],
                        "paths": {"front": "the variant's port (scripts/serve/front.py)",
                                  "direct": "the engine's loopback port (--engine-port), the same process"}}
    record["levels"] = got["levels"]
    c1 = got["levels"].get("1", {}).get("front_over_direct", {}).get("tpot_ms")
    judged = c1 is not None and c1["hi"] is not None  # c=1 measured with an interval: the target is judged
    criteria = {"tpot_c1_upper": {"value": c1["hi"], "target": TARGET_TPOT_C1, "pass": c1["hi"] <= TARGET_TPOT_C1}
                } if judged else {}
    record["summary"] = {"front_over_direct": {lv: v["front_over_direct"] for lv, v in got["levels"].items()},
                         "criteria": criteria, "pass": criteria["tpot_c1_upper"]["pass"] if judged else None}
    record["status"], record["failure"] = "ok", None
    if judged:
        mark_unmet(record)
    else:
        print("note: c=1 was not measured with an interval: the front's target is not judged", file=sys.stderr)
    if (path := save_record(record, args.out_dir or variant.path, "guard")) is None:
        return 1
    return exit_status(record, path)


if __name__ == "__main__":
    sys.exit(main())
