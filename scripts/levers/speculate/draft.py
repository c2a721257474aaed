"""Build a layer-truncated copy of a target as its speculative draft model (vLLM's `draft_model` method).

    python -m scripts.levers.speculate.draft smollm2-bf16-draft6     # `make draft VARIANT=…`

The variant's SERVE_SPECULATIVE_CONFIG names the draft folder under weights/ ({"method": "draft_model", "model":
"weights/…"}); DRAFT_LAYERS says how many of the PARENT's first decoder layers it keeps. Embedding, final norm and the
(tied) output layer are the parent's own, so drafter and target share the tokenizer and vocabulary as vLLM requires.
No training: the drafter is the target's first layers read out by its own head, the cheapest drafter that shares the
tokenizer; its acceptance says how far the early layers already predict the final token. The parent checkpoint is only
read; the draft is written to a temp folder, checked (scripts.common.checkpoint.verify) and renamed, with
PROVENANCE.json.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, copy_side_files, verify
from scripts.common.variants import VariantError, head_dir, load_variant, missing_model

LAYER = re.compile(r"^model\.layers\.(\d+)\.")


class DraftError(RuntimeError):
    pass


def truncate(parent: Path, out: Path, layers: int) -> dict:
    """Write the first `layers` decoder layers of `parent` (plus embedding, norm, head, tokenizer) to `out`."""
    from safetensors.torch import load_file, save_file

    cfg = json.loads((parent / "config.json").read_text())
    total = cfg.get("num_hidden_layers")
    if not isinstance(total, int) or not 1 <= layers < total:
        raise DraftError(f"DRAFT_LAYERS={layers}: must lie in 1..{(total or 1) - 1} ({parent.name} has {total} layers)")
    kept: dict = {}
    for shard in sorted(parent.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            m = LAYER.match(name)
            if m is None or int(m.group(1)) < layers:
                kept[name] = tensor
    save_file(kept, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": layers}, indent=2))
    copy_side_files(parent, out)
    return {"parent_layers": total, "layers": layers, "tensors": len(kept),
            "params": sum(t.numel() for t in kept.values())}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help="a variant whose SERVE_SPECULATIVE_CONFIG names a draft_model under weights/")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        variant = load_variant(args.variant)
        out = head_dir(variant)
        spec = json.loads(variant.resolved.get("SERVE_SPECULATIVE_CONFIG") or "{}")
        if out is None or spec.get("method") != "draft_model":
            raise DraftError(f"{variant.name}: SERVE_SPECULATIVE_CONFIG names no draft_model under weights/")
        if not variant.resolved.get("PARENT") or not variant.resolved.get("DRAFT_LAYERS", "").isdigit():
            raise DraftError(f"{variant.path / 'config.env'}: needs PARENT and DRAFT_LAYERS=<number of layers>")
        parent = load_variant(variant.resolved["PARENT"])
        if not Path(parent.model).is_dir():
            raise DraftError(missing_model(parent))
        with paths.staged(out) as tmp:
            info = truncate(Path(parent.model), tmp, int(variant.resolved["DRAFT_LAYERS"]))
            (tmp / "PROVENANCE.json").write_text(json.dumps({
                "lever": "make_draft_model (layer truncation)", "variant": variant.name, "target": parent.name,
                "target_model": parent.resolved["MODEL"], **info}, indent=1))
            verify(tmp)
    except (DraftError, VariantError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {paths.shown(out)}: {info['layers']} of {info['parent_layers']} layers, {info['params'] / 1e6:.1f}M parameters")
    return 0


if __name__ == "__main__":
    sys.exit(main())
