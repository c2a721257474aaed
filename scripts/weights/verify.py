"""Check a checkpoint before anything serves it.

    python -m scripts.weights.verify weights/SmolLM2-135M-Instruct
    python -m scripts.weights.verify weights/smollm2-awq --source weights/SmolLM2-135M-Instruct

Checks: files present, config parses, every safetensors shard whole, tensor names and shapes match the config
(through a meta-device model of the config's architecture), dtype and quantization_config sane, tokenizer round-trips,
and with --source that no tensor of the source was dropped. Prints the total size. Exit 1 with one error line on failure.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from scripts.common.checkpoint import CheckpointError, human_bytes, verify
from scripts.common.variants import VariantError, load_variant


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("path", type=Path, nargs="?", help="checkpoint directory")
    p.add_argument("--variant", help="verify this variant's MODEL (instead of a path)")
    p.add_argument("--source", type=Path, help="the checkpoint this one was derived from: refuse dropped tensors")
    p.add_argument("--no-tokenizer", action="store_true", help="skip the tokenizer round-trip")
    p.add_argument("--no-shapes", action="store_true", help="skip the config-vs-tensor shape check")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.variant:
            variant = load_variant(args.variant)
            args.path = Path(variant.model)
            args.no_tokenizer = args.no_tokenizer or variant.is_shape_proxy
        if args.path is None:
            raise CheckpointError("give a checkpoint directory or --variant")
        report = verify(args.path, source=args.source, tokenizer=not args.no_tokenizer, shapes=not args.no_shapes)
    except (CheckpointError, VariantError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    quant = report.quantization
    cfg = report.text_config
    print(f"ok: {report.path}")
    print(f"  model_type {report.config['model_type']}, {cfg.get('num_hidden_layers')} layers, hidden {cfg.get('hidden_size')}, "
          f"vocab {cfg.get('vocab_size')}")
    print(f"  {len(report.tensors)} tensors, {report.num_params / 1e6:.1f} M stored elements, {human_bytes(report.total_bytes)} on disk")
    print(f"  quantization: {quant.get('quant_method') if quant else 'none'}"
          + ("; SHAPE PROXY (random weights: speed only)" if report.config.get("shape_proxy") else ""))
    for note in report.notes:
        print(f"  {note}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
