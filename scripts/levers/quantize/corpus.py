"""Calibration samples for llm-compressor: chat-formatted with the model's own template, deterministic, hashed.

    python -m scripts.levers.quantize.corpus weights/SmolLM2-135M-Instruct --samples 256 --seq-len 512 --out cal.jsonl
    python -m scripts.levers.quantize.corpus weights/Qwen3.5-4B --dataset HuggingFaceH4/ultrachat_200k

Offline (default) the text is the project's cpython-docs corpus (scripts/data/corpus.py): passages are cut at
paragraph boundaries, shuffled with the seed, and each becomes a two-turn chat (the first part as the user's message,
the rest as the assistant's) rendered by the tokenizer's chat template. With --dataset, conversations of an HF chat
dataset (a `messages` column, e.g. ultrachat) are used instead. The corpus name, sample count, length, seed and the
SHA-256 of the rendered samples go into every quantized checkpoint's PROVENANCE.json.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.data.corpus import build_samples


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model", type=Path, help="checkpoint whose tokenizer and chat template render the samples")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dataset", help="HF chat dataset with a messages column (needs the hub or a cache)")
    p.add_argument("--out", type=Path, help="write the rendered samples as JSONL")
    return p


def main(argv: list[str] | None = None) -> int:
    from transformers import AutoTokenizer

    args = build_parser().parse_args(argv)
    if not (args.model / "config.json").exists():
        print(f"error: {args.model} is not a checkpoint directory", file=sys.stderr)
        return 1
    tok = AutoTokenizer.from_pretrained(args.model)
    if not tok.chat_template:
        print(f"error: {args.model} has no chat template", file=sys.stderr)
        return 1
    ds, info = build_samples(tok, args.samples, args.seq_len, seed=args.seed, dataset=args.dataset)
    if args.out:
        args.out.write_text("".join(json.dumps({"text": t}) + "\n" for t in ds["text"]))
    print(json.dumps(info, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
