"""Parity of a variant with its reference, without labels: KL divergence, top-1 agreement and perplexity.

    python -m scripts.measure.parity smollm2-int8                        # `make eval-parity VARIANT=smollm2-int8`
    python -m scripts.measure.parity smollm2-int8 --tokens 8192 --ctx 512 --corpus cpython-docs
    python -m scripts.measure.parity qwen35-4b-awq-ref --backend vllm    # kernels that exist only in vLLM
    python -m scripts.measure.parity smollm2-gguf-q8-0                   # ENGINE=llamacpp: llama.cpp scores it

Both models score the same token sequences: the corpus (Wikitext-2 when cached, else the offline cpython-docs corpus)
tokenized once, cut into chunks of --ctx tokens; as llama.cpp's --kl-divergence does, only the second half of each
chunk is scored (every scored token sees at least ctx/2 tokens of context). Per scored token: KL(P_ref || P_var) of
the next-token distributions, whether their argmax agree, and -log p(actual next token) under each (perplexity).

Backends: `transformers` (full distributions; BF16 and any checkpoint transformers loads, compressed-tensors
included) and `vllm` (each model's server returns its top-K prompt logprobs; KL is then computed over the reference's
top-K tokens plus one bucket for the rest of the mass, an approximation the record names) and `llamacpp` (a GGUF
variant's full distributions from llama.cpp itself, against the reference's from transformers; the default for an
ENGINE=llamacpp variant, whose export checked that its tokenizer's ids are the parent's). A variant that differs from
its reference only in what vLLM applies to the same weights (an FP8 KV cache, online quantization) is scored by vLLM:
transformers would compare the checkpoint with itself (KL 0, what make optimize on the H200 recorded for the FP8 KV
rungs before 2026-11-29). The reference is the
variant's GATE_REFERENCE, else its PARENT. Writes experiments/<variant>/quality_<YYYYMMDD-HHMMSS>.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.common.checkpoint import tokenizer_fingerprint as vocab_fingerprint
from scripts.common.engines import EngineError, engine_of
from scripts.common.gate import engine_only
from scripts.common.loadgen import openai_client
from scripts.common.metrics import parity_stats
from scripts.common.records import envelope, save_record
from scripts.common.server import ServerError
from scripts.common.variants import Variant, VariantError, load_variant, missing_model, reference_name
from scripts.data.corpus import EVAL_FRACTION, CorpusError, load_corpus
from scripts.levers.gguf import logits as llamacpp_logits
from scripts.levers.vocab.keep import kept_ids
from scripts.serve.launch import variant_server

DEFAULT_TOKENS = 8192
DEFAULT_CTX = 512
TOP_K = 20  # vLLM's default max_logprobs


class ParityError(RuntimeError):
    pass


def engine_only_numerics(var: Variant, ref: Variant) -> list[str]:
    """The numerics settings the variant's engine applies to the reference's own weights that the reference's does not
    (gate.engine_only: FP8 KV cache, online quantization), which transformers applies none of: [] where the weights
    differ (transformers then compares the checkpoints) or nothing differs."""
    if Path(var.model).resolve() != Path(ref.model).resolve():
        return []
    return engine_only(var.resolved, ref.resolved)


def reference_of(variant: Variant) -> str:
    ref = reference_name(variant.resolved)
    if not ref:
        raise ParityError(f"{variant.name} has no PARENT or GATE_REFERENCE: nothing to compare it with")
    return ref


def tokenizer_fingerprint(model_dir: str) -> str:
    from transformers import AutoTokenizer

    return vocab_fingerprint(AutoTokenizer.from_pretrained(model_dir))


def check_same_tokenizer(var: Variant, ref: Variant) -> None:
    a = tokenizer_fingerprint(var.resolved.get("TOKENIZER", var.model))
    b = tokenizer_fingerprint(ref.resolved.get("TOKENIZER", ref.model))
    if a != b:
        raise ParityError(f"{var.name} and {ref.name} have different tokenizers: KL divergence across vocabularies is "
                          f"meaningless without a declared token-id mapping")


def make_chunks(token_ids: list[int], n_tokens: int, ctx: int) -> list[list[int]]:
    """Enough whole chunks of ctx tokens to score about n_tokens (ctx/2 scored per chunk)."""
    if ctx < 4:
        raise ParityError(f"--ctx {ctx}: too small")
    n_chunks = max(1, math.ceil(n_tokens / (ctx // 2)))
    available = len(token_ids) // ctx
    if available == 0:
        raise ParityError(f"corpus has {len(token_ids)} tokens, shorter than one context of {ctx}")
    if available < n_chunks:
        raise ParityError(f"corpus has {len(token_ids)} tokens: {available} chunks of {ctx}, need {n_chunks} to score "
                          f"{n_tokens} tokens; lower --tokens or --ctx")
    return [token_ids[i * ctx:(i + 1) * ctx] for i in range(n_chunks)]


def check_held_out(corpus, ids: list[int], chunks: list[list[int]], tokenizer) -> None:
    """Offline calibration samples cpython-docs after its first EVAL_FRACTION: scoring past it would grade a
    quantized model on its own calibration text."""
    if not corpus.name.startswith("cpython-"):
        return
    read = len(tokenizer.decode(ids[:sum(len(c) for c in chunks)]))
    if read > len(corpus.text) * EVAL_FRACTION:
        raise ParityError(f"--tokens/--ctx read {read} chars of {corpus.name}, past its first {EVAL_FRACTION:.0%} "
                          f"held out from calibration; lower --tokens")


def load_transformers(model_dir: str):
    """A checkpoint in transformers; a vocabulary-pruned one (scripts.levers.vocab.prune) gets its kept-row lm_head whose
    logits are scattered to the original ids (-inf elsewhere), as scripts.levers.vocab.plugin serves it."""
    import torch
    from transformers import AutoModelForCausalLM

    pruning = kept_ids(model_dir)
    if pruning is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()
    from safetensors import safe_open

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, ignore_mismatched_sizes=True).eval()
    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        rows = f.get_tensor("lm_head.weight")
    model.lm_head = ScatterHead(rows, pruning, model.config.get_text_config().vocab_size)
    return model


def ScatterHead(rows, kept: list[int], vocab_size: int):  # noqa: N802 - builds a module (torch imported lazily)
    """lm_head of kept rows: logits at the kept ids, -inf at every dropped id."""
    import torch

    class _ScatterHead(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("rows", rows)
            self.register_buffer("kept", torch.tensor(kept))

        def forward(self, h):
            logits = h @ self.rows.T
            full = logits.new_full((*logits.shape[:-1], vocab_size), float("-inf"))
            return full.index_copy_(-1, self.kept, logits)

    return _ScatterHead()


def scored_logprobs(model, chunk: list[int]):
    """Log-probabilities a transformers model gives the second half of a chunk: [ctx/2, vocab], float32."""
    import torch

    half = len(chunk) // 2
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([chunk])).logits[0, half - 1:-1].float(), -1)


def full_stats(lp_r, lp_v, target):
    """Per-token (kld, agree, nll_ref, nll_var, None) of two full next-token distributions over the same vocabulary."""
    agree = lp_r.argmax(-1) == lp_v.argmax(-1)
    nll_r = -lp_r.gather(-1, target[:, None])[:, 0]
    nll_v = -lp_v.gather(-1, target[:, None])[:, 0]
    kld = (lp_r.exp() * (lp_r - lp_v)).sum(-1).clamp_min(0)
    return kld.tolist(), agree.tolist(), nll_r.tolist(), nll_v.tolist(), None


def per_token_llamacpp(ref_dir: str, var: Variant, chunks: list[list[int]]):
    """The reference in transformers, the variant in llama.cpp itself (a GGUF file): both full distributions. llama.cpp
    runs in its own environment (scripts.levers.gguf.logits), writing one file of logits per chunk, read back here."""
    import numpy as np
    import torch

    ref_model = load_transformers(ref_dir)
    paths.CACHE.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="parity-llamacpp-", dir=paths.CACHE) as tmp:
        (Path(tmp) / "chunks.json").write_text(json.dumps(chunks))
        try:
            llamacpp_logits.run([var.model, str(Path(tmp) / "chunks.json"), tmp])
        except EngineError as e:
            raise ParityError(f"llama.cpp could not score {var.resolved['MODEL']}: {e}") from None
        for i, chunk in enumerate(chunks):
            lp_v = torch.log_softmax(torch.from_numpy(np.load(Path(tmp) / f"{i:04d}.npy")), -1)
            yield full_stats(scored_logprobs(ref_model, chunk), lp_v, torch.tensor(chunk[len(chunk) // 2:]))


def per_token_transformers(ref_dir: str, var_dir: str, chunks: list[list[int]]):
    """Yield per-chunk (kld, agree, nll_ref, nll_var, vocab) from both models' full distributions. For a pruned
    variant `vocab` holds per token: the reference's argmax kept, its mass on dropped ids, the gold token kept; KL is
    then over the kept ids with the reference renormalized there (plain KL is infinite wherever the reference puts
    mass on a dropped id), and NLLs cover the positions whose gold token is kept (the rest are counted)."""
    import torch

    models = [load_transformers(d) for d in (ref_dir, var_dir)]
    kept_list = kept_ids(var_dir)
    kept = None if kept_list is None else torch.tensor(kept_list)
    for chunk in chunks:
        lp_r, lp_v = (scored_logprobs(m, chunk) for m in models)
        target = torch.tensor(chunk[len(chunk) // 2:])
        if kept is None:
            yield full_stats(lp_r, lp_v, target)
            continue
        agree = lp_r.argmax(-1) == lp_v.argmax(-1)
        nll_r = -lp_r.gather(-1, target[:, None])[:, 0]
        nll_v = -lp_v.gather(-1, target[:, None])[:, 0]
        lp_rk = lp_r[:, kept]
        log_kept_mass = torch.logsumexp(lp_rk, -1)
        lp_rk = lp_rk - log_kept_mass[:, None]
        kld = (lp_rk.exp() * (lp_rk - lp_v[:, kept])).sum(-1).clamp_min(0)
        gold_kept = torch.isin(target, kept)
        vocab = {"argmax_kept": torch.isin(lp_r.argmax(-1), kept).tolist(),
                 "dropped_mass": (1 - log_kept_mass.exp()).clamp_min(0).tolist(), "gold_kept": gold_kept.tolist()}
        yield (kld.tolist(), agree.tolist(), nll_r[gold_kept].tolist(), nll_v[gold_kept].tolist(), vocab)


def prompt_logprobs(base_url: str, model: str, chunks: list[list[int]]) -> list[list[dict[int, float]]]:
    """vLLM's top-K prompt logprobs (plus the actual token) for every position of every chunk."""

    client = openai_client(base_url)
    out = []
    for chunk in chunks:
        r = client.completions.create(model=model, prompt=chunk, max_tokens=1, temperature=0,
                                      extra_body={"prompt_logprobs": TOP_K})
        plp = r.model_dump()["choices"][0]["prompt_logprobs"]
        out.append([{int(k): v["logprob"] for k, v in (pos or {}).items()} for pos in plp])
    return out


def topk_kl(ref: dict[int, float], var: dict[int, float]) -> float:
    """KL over the reference's top-K tokens plus one bucket for the remaining mass (vLLM path approximation).

    A token in the reference's top-K but not in the variant's list gets the variant's smallest listed probability
    (an upper bound on its true probability)."""
    floor = min(var.values())
    keys = sorted(ref, key=ref.get, reverse=True)[:TOP_K]
    pr = [math.exp(ref[k]) for k in keys]
    pv = [math.exp(var.get(k, floor)) for k in keys]
    kl = sum(p * (math.log(p) - math.log(q)) for p, q in zip(pr, pv, strict=True) if p > 0)
    tail_r, tail_v = max(1 - sum(pr), 1e-12), max(1 - sum(pv), 1e-12)
    return max(kl + tail_r * (math.log(tail_r) - math.log(tail_v)), 0.0)


def per_token_vllm(ref: Variant, var: Variant, chunks: list[list[int]], urls: dict[str, str | None], port: int | None):
    logprobs = {}
    for role, v in (("ref", ref), ("var", var)):
        with variant_server(v, base_url=urls[role], port=port, purpose="parity") as (url, _):
            logprobs[role] = prompt_logprobs(url, v.served_name, chunks)
    for chunk, lr, lv in zip(chunks, logprobs["ref"], logprobs["var"], strict=True):
        half = len(chunk) // 2
        kld, agree, nll_r, nll_v = [], [], [], []
        for pos in range(half, len(chunk)):  # logprobs at position pos are for token chunk[pos] given chunk[:pos]
            r, v, tok = lr[pos], lv[pos], chunk[pos]
            kld.append(topk_kl(r, v))
            agree.append(max(r, key=r.get) == max(v, key=v.get))
            nll_r.append(-r[tok])
            nll_v.append(-v[tok])
        yield kld, agree, nll_r, nll_v, None


def vocab_stats(per_token: dict[str, list]) -> dict:
    """The pruned-vocabulary criteria over all scored tokens."""
    from scripts.common.metrics import percentile

    n = len(per_token["argmax_kept"])
    cov = sum(per_token["argmax_kept"]) / n
    return {"argmax_coverage": cov, "argmax_coverage_se": math.sqrt(cov * (1 - cov) / n),
            "dropped_mass": sum(per_token["dropped_mass"]) / n, "dropped_mass_p99": percentile(per_token["dropped_mass"], 99),
            "gold_dropped": n - sum(per_token["gold_kept"]), "gold_dropped_share": 1 - sum(per_token["gold_kept"]) / n,
            "kl_over": "kept ids, reference renormalized on them",
            "ppl_over": "positions whose gold token is kept (gold_dropped are excluded and counted)"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    p.add_argument("--reference", help="reference variant (default: GATE_REFERENCE, else PARENT)")
    p.add_argument("--corpus", default="auto", help="auto | wikitext2 | cpython-docs | bigbench-held-out")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS, help="tokens to score (default %(default)s)")
    p.add_argument("--ctx", type=int, default=DEFAULT_CTX, help="context per chunk (default %(default)s)")
    p.add_argument("--backend", choices=["auto", "transformers", "vllm", "llamacpp"], default="auto",
                   help="auto: llamacpp for a variant served by llama.cpp (ENGINE=llamacpp); vllm for one that differs "
                        "from its reference only in what the engine applies (FP8 KV cache, online quantization: "
                        "ENGINE_NUMERICS); else transformers")
    p.add_argument("--ref-url", help="vllm backend: the reference's running server")
    p.add_argument("--var-url", help="vllm backend: the variant's running server")
    p.add_argument("--port", type=int, help="port of the server this script starts (default: a free one, checked to be its own after the start)")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    p.add_argument("--model", help="score this checkpoint directory in the variant's place (a recipe sweep); the record "
                                   "names it and carries its PROVENANCE.json")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    t0 = time.monotonic()
    try:
        var = load_variant(args.variant, overrides={"MODEL": args.model} if args.model else None)
        ref = load_variant(args.reference or reference_of(var))
        for v in (var, ref):
            if v.is_shape_proxy:
                raise ParityError(f"{v.name} is a shape proxy (random weights): quality is never measured on it")
            if v.resolved["MODEL"].startswith("weights/") and not Path(v.model).exists():
                raise ParityError(missing_model(v))
        engine = engine_of(var).name
        gguf = engine_of(var).gguf  # llama-cpp-python's server or llama-server: the GGUF file, scored by llama.cpp
        numerics = [] if gguf else engine_only_numerics(var, ref)
        if args.backend == "auto":
            args.backend = "llamacpp" if gguf else "vllm" if numerics else "transformers"
        if (args.backend == "llamacpp") != gguf:
            raise ParityError(f"--backend {args.backend} does not run {var.name} (ENGINE={engine})")
        if args.backend == "transformers" and numerics:
            raise ParityError(f"{var.name} differs from {ref.name} only in what vLLM applies ({', '.join(numerics)}): "
                              f"transformers would score the same weights twice; use --backend vllm")
        if args.backend != "llamacpp":
            check_same_tokenizer(var, ref)
        corpus = load_corpus(args.corpus)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(ref.resolved.get("TOKENIZER", ref.model))
        ids = tokenizer.encode(corpus.text, add_special_tokens=False)
        chunks = make_chunks(ids, args.tokens, args.ctx)
        check_held_out(corpus, ids, chunks, tokenizer)
        if args.backend == "transformers":
            per_chunk = per_token_transformers(ref.model, var.model, chunks)
        elif args.backend == "llamacpp":
            per_chunk = per_token_llamacpp(ref.model, var, chunks)
        else:
            per_chunk = per_token_vllm(ref, var, chunks, {"ref": args.ref_url, "var": args.var_url}, args.port)
        if args.backend == "vllm" and kept_ids(var.model) is not None:
            raise ParityError(f"{var.name} has a pruned vocabulary: its parity needs full distributions (--backend "
                              f"transformers)")
        kld, agree, nll_r, nll_v, samples = [], [], [], [], []
        per_vocab: dict[str, list] = {"argmax_kept": [], "dropped_mass": [], "gold_kept": []}
        for i, (k, a, r, v, vocab) in enumerate(per_chunk):
            kld += k
            agree += a
            nll_r += r
            nll_v += v
            sample = {"chunk": i, "tokens": len(k), "mean_kld": sum(k) / len(k), "top1_agreement": sum(a) / len(a),
                      "nll_ref_sum": sum(r), "nll_var_sum": sum(v)}
            if vocab:
                for key in per_vocab:
                    per_vocab[key] += vocab[key]
                sample.update(argmax_coverage=sum(vocab["argmax_kept"]) / len(k),
                              dropped_mass=sum(vocab["dropped_mass"]) / len(k), nll_tokens=len(r))
            samples.append(sample)
        stats = parity_stats(kld, agree, nll_r, nll_v)
        if per_vocab["argmax_kept"]:
            stats.update(vocab_stats(per_vocab))
    except (ParityError, VariantError, CorpusError, CheckpointError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    record = envelope("quality", var, command=[sys.executable, "-m", "scripts.measure.parity", *sys.argv[1:]],
                      server_command=None)
    record["duration_s"] = round(time.monotonic() - t0, 1)
    record["inputs"] = {"kind": "parity", "reference": ref.name, "reference_model": ref.resolved["MODEL"],
                        "backend": args.backend, **({"engine_numerics": numerics} if numerics else {}),
                        "kl_method": "full distribution" if args.backend != "vllm"
                        else f"top-{TOP_K} + tail bucket (approximation)", **corpus.describe(),
                        "ctx": args.ctx, "chunks": len(chunks), "scored": "second half of each chunk"}
    prov = Path(var.model) / "PROVENANCE.json"
    if prov.exists():  # how the checkpoint was built: recipe, overrides, calibration corpus and hash
        record["inputs"]["model_provenance"] = json.loads(prov.read_text())
    record["summary"] = {"parity": stats}
    record["samples"] = samples
    if (path := save_record(record, args.out_dir or var.path, "quality")) is None:
        return 1
    print(f"{var.name} vs {ref.name} ({args.backend}, {stats['tokens']} tokens of {corpus.name}):")
    print(f"  mean KLD {stats['mean_kld']:.4f} ± {stats['mean_kld_se']:.4f}  median {stats['median_kld']:.4f}  "
          f"p99 {stats['p99_kld']:.4f}")
    print(f"  top-1 agreement {stats['top1_agreement']:.1%} ± {stats['top1_agreement_se']:.1%}")
    print(f"  PPL ref {stats['ppl_ref']:.3f}  var {stats['ppl_var']:.3f}  ratio {stats['ppl_ratio']:.4f}")
    if "argmax_coverage" in stats:
        print(f"  pruned vocabulary: argmax coverage {stats['argmax_coverage']:.4%}, reference mass on dropped ids "
              f"mean {stats['dropped_mass']:.2e} p99 {stats['dropped_mass_p99']:.2e}, gold token dropped "
              f"{stats['gold_dropped']} times ({stats['gold_dropped_share']:.3%}); KL {stats['kl_over']}")
    print(f"wrote {paths.shown(path)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
