"""Merge a variant's LoRA adapter into its PARENT's BF16 weights: a new checkpoint, the variant's MODEL.

    python -m scripts.levers.lora.merge smollm2-lora-a        # `make merge-lora VARIANT=smollm2-lora-a`

Refuses a quantized parent (merge into BF16, then quantize the merged model with make calibrate: a variant whose
PARENT is the merged one, e.g. smollm2-lora-a-int8sq), an adapter trained on another base (its card's config hash),
and a missing adapter. The merge runs in FP32 (W + scale·B·A, then rounded once to BF16). Before writing, the merged
model's logits on held-out text are compared with PEFT's base + adapter forward (both FP32): the largest difference
is recorded. Output: a temp folder (PARENT's tokenizer files copied, checkpoint verified), renamed into place, with
PROVENANCE.json; the same facts as experiments/<variant>/merge_lora_<time>.json. PARENT is never modified.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, copy_side_files, verify
from scripts.common.hardware import hardware
from scripts.common.records import git_state, now_utc, versions, write_record
from scripts.common.variants import VariantError, load_variant, missing_model
from scripts.levers.lora import adapters as lora


def merge(name: str, overrides: dict[str, str] | None = None, record_dir: Path | None = None) -> Path:
    """Write `name`'s MODEL: PARENT with the adapter merged; the record goes under record_dir (default the variant's)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    variant = load_variant(name, overrides=overrides)
    s = lora.settings(variant)
    if not variant.resolved.get("PARENT"):
        raise lora.LoraError(f"{name}: no PARENT to merge into")
    parent = load_variant(variant.resolved["PARENT"])
    base_dir, dest = Path(parent.model), Path(variant.model)
    if dest == base_dir:
        raise lora.LoraError(f"{name}: MODEL is PARENT's folder; a merge writes a new checkpoint")
    if not (base_dir / "config.json").exists():
        raise lora.LoraError(missing_model(parent))
    if lora.quantized(base_dir):
        raise lora.LoraError(f"{parent.name} is quantized: merge into the BF16 model, then quantize the merged one "
                             f"(a variant with PARENT={name} and CALIBRATE_RECIPE=…)")
    card = lora.read_card(s.adapter)
    lora.check_base(card, s.adapter, base_dir)
    tok = AutoTokenizer.from_pretrained(base_dir)
    probe = torch.tensor([tok(lora.general_text()[:4000], add_special_tokens=False)["input_ids"][:256]])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), s.adapter)
    with torch.no_grad():
        before = model(input_ids=probe).logits
        merged = model.merge_and_unload()
        after = merged(input_ids=probe).logits
    diff = (before - after).abs().max().item()
    if diff > 1e-2:
        raise lora.LoraError(f"merged logits differ from base + adapter by {diff:.3g} (FP32): the merge is wrong")
    merged = merged.to(torch.bfloat16)
    provenance = {"kind": "lora-merge", "variant": name, "parent": parent.name, "parent_model": paths.shown(base_dir),
                  "adapter": paths.shown(s.adapter), "adapter_card": {k: card[k] for k in (
                      "rank", "alpha", "targets", "data", "steps_run", "kept_step", "heldout_ppl", "general_ppl")},
                  "merge_dtype": "float32 -> bfloat16", "max_abs_logit_diff_fp32": diff,
                  "probe_tokens": probe.shape[1], "command": ["python", "-m", "scripts.levers.lora.merge", name],
                  "git": git_state(), "versions": versions(), "hardware": hardware(),
                  "finished_at": now_utc().isoformat(timespec="seconds")}
    with paths.staged(dest) as tmp:
        merged.save_pretrained(tmp)
        copy_side_files(base_dir, tmp)
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
        verify(tmp, source=base_dir)
    record = write_record(provenance, record_dir or variant.path, "merge_lora")
    print(f"wrote {paths.shown(dest)} ({paths.shown(s.adapter)} merged into {paths.shown(base_dir)}; largest logit "
          f"difference to base + adapter {diff:.2e}); record {paths.shown(record)}")
    return dest


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", nargs="?", help="a variant with LORA_ADAPTER whose MODEL is the merged checkpoint")
    args = p.parse_args(argv)
    if not args.variant:
        print("error: which variant? make merge-lora VARIANT=<variant with LORA_ADAPTER>", file=sys.stderr)
        return 2
    try:
        merge(args.variant)
    except (VariantError, lora.LoraError, CheckpointError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
