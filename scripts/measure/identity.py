"""Greedy-output identity of a variant with its reference: the parity criterion of lossless speculative decoding.

    python -m scripts.measure.identity smollm2-ngram4                       # eval split of spec-v1, c=1 and c=8
    python -m scripts.measure.identity smollm2-bf16-eagle4 --limit 16 --max-tokens 48 --concurrency 1,8

The variant's server answers every prompt greedily at each concurrency (batch 1, and several requests verified in
one batch); the reference's server answers them at batch 1. Where a variant's token ids differ from the reference's,
the reference server teacher-forces the variant's whole output (prompt logprobs over prompt + output): at every
generated position the gap between the reference's best logprob and its logprob of the variant's token. A gap of at
most TIE_NATS is a BF16 near-tie resolved the other way by a different batch shape or kernel order (the serving
tests' rule); anything larger is a real divergence, which fails GATE_GREEDY_IDENTITY.

Beside the ids, the text a user reads: whether the two answers' strings are identical, whether they agree (identical,
or one is a prefix of the other and the shorter stopped at the token cap: a pruned vocabulary spells a dropped token
out in several kept ones, so its text runs behind by a few characters at the cap), and the character offset of the
first difference. `spelled_out` counts the answers whose ids diverge while the text agrees. GATE_MIN_TEXT_IDENTITY
judges the share that agrees at c=1 (one answer per prompt). Writes a quality record of kind `greedy-identity` to experiments/<variant>/.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.loadgen import PromptSetError, greedy_ids, llama_server_call, load_prompts, openai_client
from scripts.common.metrics import TIE_NATS, near_tie
from scripts.common.records import envelope, read_counters, reset_counters, save_record
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, load_variant, reference_name
from scripts.serve.launch import variant_server

DEFAULT_PROMPTS = paths.EVAL / "prompts" / "spec-v1-eval.jsonl"


class IdentityError(RuntimeError):
    pass


def tie_gaps(base_url: str, model: str, prompt_ids: list[int], ids: list[int]) -> list[float]:
    """Per generated token: the reference's best logprob minus its logprob of that token, given the same prefix."""
    r = openai_client(base_url).completions.create(model=model, prompt=prompt_ids + ids, max_tokens=1, temperature=0,
                                                   extra_body={"prompt_logprobs": 1}).model_dump()
    plp = r["choices"][0]["prompt_logprobs"]
    gaps = []
    for pos, tok in enumerate(ids, start=len(prompt_ids)):
        entry = {int(k): v["logprob"] for k, v in (plp[pos] or {}).items()}
        gaps.append(max(entry.values()) - entry[tok])
    return gaps


def tie_gaps_llamaserver(base_url: str, prompt_ids: list[int], ids: list[int], top: int = 20) -> list[float]:
    """tie_gaps through llama-server, which scores no prompt: one single-token completion per generated position on
    the variant's prefix, with the top `top` log-probabilities. A token outside them gets the gap to the last one
    listed: a lower bound, already far beyond a tie."""
    gaps = []
    for k, tok in enumerate(ids):
        r = llama_server_call(base_url, "/completion", {"prompt": prompt_ids + ids[:k], "n_predict": 1, "n_probs": top,
                                                        "temperature": 0, "cache_prompt": True})
        listed = {e["id"]: e["logprob"] for e in r["completion_probabilities"][0]["top_logprobs"]}
        gaps.append(max(listed.values()) - listed.get(tok, min(listed.values())))
    return gaps


def draft_counters(outputs: list[dict]) -> dict | None:
    """llama-server's speculative counts over the variant's answers (their `timings`): drafted and accepted tokens,
    the acceptance rate and the mean tokens per verification step (every step yields one token of its own beside the
    drafts it accepts: steps = generated - accepted). None where nothing was drafted."""
    timings = [o.get("timings") or {} for o in outputs]
    drafted = sum(t.get("draft_n", 0) for t in timings)
    if not drafted:
        return None
    accepted = sum(t.get("draft_n_accepted", 0) for t in timings)
    generated = sum(t.get("predicted_n", 0) for t in timings)
    return {"source": "llama-server timings of the identity answers", "draft_tokens": drafted,
            "accepted_tokens": accepted, "generated_tokens": generated,
            "acceptance_rate": round(accepted / drafted, 4),
            "mean_tokens_per_step": round(generated / max(generated - accepted, 1), 4)}


def text_agreement(ref: dict, var: dict) -> dict:
    """What a user sees: the two answers' texts equal, or equal until the shorter one stopped at the token cap (a
    word the variant spelled out in more tokens), and the character offset of the first difference."""
    a, b = ref.get("text", ""), var.get("text", "")
    first = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)
    if first is None and len(a) != len(b):
        first = min(len(a), len(b))
    shorter = ref if len(a) < len(b) else var
    agrees = first is None or (first == min(len(a), len(b)) and shorter.get("finish_reason") == "length")
    return {"text_identical": first is None, "text_agrees": agrees, "first_char_difference": first}


def compare(ref: dict, var: dict, gaps: list[float] | None) -> dict:
    """One sequence's verdict: identical, a near-tie divergence, or a divergence beyond a tie; and its text's."""
    n = min(len(ref["ids"]), len(var["ids"]))
    first = next((i for i in range(n) if ref["ids"][i] != var["ids"][i]), None)
    if first is None and len(ref["ids"]) != len(var["ids"]):
        first = n
    out = {"id": var["id"], "tokens": len(var["ids"]), "identical": first is None, "first_divergence": first,
           **text_agreement(ref, var)}
    if first is not None:
        if gaps is None:
            raise IdentityError(f"{var['id']}: diverges at token {first} but was not teacher-forced")
        out["max_gap_nats"] = max(gaps, default=0.0)
        out["gap_at_divergence_nats"] = gaps[first] if first < len(gaps) else None
        out["near_tie"] = near_tie(out["max_gap_nats"])
    return out


def summarize_identity(samples: list[dict]) -> dict:
    diverged = [s for s in samples if not s["identical"]]
    offsets = [s["first_char_difference"] for s in samples if not s["text_identical"]]
    return {"sequences": len(samples), "identical": len(samples) - len(diverged),
            "near_tie_divergences": sum(1 for s in diverged if s["near_tie"]),
            "divergences_beyond_tie": sum(1 for s in diverged if not s["near_tie"]),
            "tokens_compared": sum(s["tokens"] for s in samples), "tie_nats": TIE_NATS,
            "max_gap_nats": max((s["max_gap_nats"] for s in diverged), default=0.0),
            "text_identical": sum(1 for s in samples if s["text_identical"]),
            "text_agrees": sum(1 for s in samples if s["text_agrees"]),
            "spelled_out": sum(1 for s in diverged if s["text_agrees"]),
            "median_first_char_difference": sorted(offsets)[len(offsets) // 2] if offsets else None}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--reference", help="reference variant (default: GATE_REFERENCE, else PARENT)")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--limit", type=int, default=32, help="first N prompts (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="cap on each prompt's max_tokens (default %(default)s)")
    p.add_argument("--concurrency", default="1,8", help="levels the variant is run at (default %(default)s)")
    p.add_argument("--var-url", help="the variant's running server (default: start one)")
    p.add_argument("--ref-url", help="the reference's running server (default: start one)")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        var = load_variant(args.variant)
        ref_name = args.reference or reference_name(var.resolved)
        if not ref_name:
            raise IdentityError(f"{var.name} has no PARENT or GATE_REFERENCE: nothing to compare it with")
        ref = load_variant(ref_name)
        for v in (var, ref):  # before any server starts
            if v.engine == "llamacpp":
                raise IdentityError(f"{v.name} is served by llama-cpp-python, whose answers carry no token ids: compare "
                                    f"a vLLM or llama-server variant (--reference, or GATE_REFERENCE in config.env)")
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        rows, info = load_prompts(args.prompts, args.limit)
        reset_counters(var)
        with variant_server(var, base_url=args.var_url, port=args.port, purpose="identity") as (url, server):
            var_server = server.argv if server else None
            outputs = {c: greedy_ids(url, var.served_name, rows, args.max_tokens, c, engine=var.engine) for c in levels}
        counters = read_counters(var)
        if var.engine == "llamaserver":
            counters = {**(counters or {}), **({"speculative": d} if (d := draft_counters(
                [o for outs in outputs.values() for o in outs])) else {})}
        with variant_server(ref, base_url=args.ref_url, port=args.port, purpose="identity") as (url, server):
            ref_server = server.argv if server else None
            reference = {r["id"]: r for r in greedy_ids(url, ref.served_name, rows, args.max_tokens, 1,
                                                        engine=ref.engine)}
            samples = []
            for c, outs in outputs.items():
                for o in outs:
                    r = reference[o["id"]]
                    if o["prompt_ids"] != r["prompt_ids"]:
                        raise IdentityError(f"{o['id']}: the two servers tokenized the prompt differently")
                    gaps = (None if o["ids"] == r["ids"] else
                            tie_gaps_llamaserver(url, o["prompt_ids"], o["ids"]) if ref.engine == "llamaserver" else
                            tie_gaps(url, ref.served_name, o["prompt_ids"], o["ids"]))
                    samples.append({"concurrency": c, **compare(r, o, gaps)})
    except (IdentityError, VariantError, PromptSetError, ServerError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    record = envelope("quality", var, command=[sys.executable, "-m", "scripts.measure.identity", *sys.argv[1:]],
                      server_command=var_server)
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["inputs"] = {"kind": "greedy-identity", "reference": ref.name, "reference_server": ref_server, **info,
                        "max_tokens": args.max_tokens, "concurrency": levels, "temperature": 0}
    record["samples"] = samples
    if counters:
        record["engine_counters"] = counters
    record["summary"] = {"identity": summarize_identity(samples),
                         "per_concurrency": {str(c): summarize_identity([s for s in samples if s["concurrency"] == c])
                                             for c in levels}}
    if (path := save_record(record, args.out_dir or var.path, "quality")) is None:
        return 1
    s = record["summary"]["identity"]
    print(f"{var.name} vs {ref.name}: {s['identical']}/{s['sequences']} identical, {s['near_tie_divergences']} "
          f"near-tie divergences, {s['divergences_beyond_tie']} beyond a tie (max gap {s['max_gap_nats']:.3f} nats); "
          f"text agrees on {s['text_agrees']}/{s['sequences']} ({s['spelled_out']} spelled out in other tokens, "
          f"median first difference at character {s['median_first_char_difference']})")
    print(f"wrote {paths.shown(path)}")
    return 0 if s["divergences_beyond_tie"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
