"""Quantize a checkpoint with llm-compressor from a recipe file; writes a compressed-tensors checkpoint vLLM serves.

    python -m scripts.levers.quantize.calibrate int8-w8a8 --model weights/SmolLM2-135M-Instruct --out weights/smollm2-int8
    make calibrate VARIANT=smollm2-int8        # recipe, parent weights and output from the variant's config.env

Runs in .venv-quant (llm-compressor 0.14 pins compressed-tensors 0.19; vLLM pins 0.17). Recipes are data
(scripts/levers/quantize/recipes/<name>.yaml): algorithm (rtn | awq | gptq | smoothquant-gptq), weight/activation scheme, scope
(all linear layers or MLP only), ignore list and calibration size; `quantize_lm_head` and `quantize_linear_attn` lift
the matching default ignore (below). Calibration data is used by awq / gptq / smoothquant and by any recipe with
static (non-dynamic) activation scales, whose observers need activations to set them. Group sizes are chosen per layer: the largest
power of two <= the recipe's group size that divides the layer's input width (SmolLM2's 576-wide layers get 64).
Model-aware ignores: lm_head (unless the recipe quantizes it), routers, and for Qwen3.5 the vision tower, MTP layers
and Gated-DeltaNet projections. Output goes to a temp dir, is verified (no tensor of the source dropped), then renamed.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import sys
import time
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, check_dropped, layer_family, read_checkpoint
from scripts.common.variants import VariantError, load_variant, missing_model

RECIPES = paths.ROOT / "scripts" / "levers" / "quantize" / "recipes"
ALGORITHMS = ("rtn", "awq", "gptq", "smoothquant-gptq")
# Kept in BF16 by default: output head, MoE routers, and for Qwen3.5 the vision tower, MTP head and linear attention.
DEFAULT_IGNORE = ["re:.*lm_head$", "re:.*mlp\\.gate$", "re:.*shared_expert_gate$", "re:.*visual.*", "re:.*mtp.*",
                  "re:.*linear_attn.*"]
MLP_TARGET = re.compile(r".*mlp\.(gate|up|down)_proj$")


RECIPE_KEYS = ("algorithm", "scope", "weights", "input_activations", "ignore", "quantize_lm_head", "quantize_linear_attn",
               "format", "calibration", "duo_scaling", "dampening_frac", "smoothing_strength", "kernel")
# recipe switch -> the default ignore pattern it lifts
LIFTS = {"quantize_lm_head": "lm_head", "quantize_linear_attn": "linear_attn"}


class CalibrateError(ValueError):
    pass


def apply_overrides(recipe: dict, sets: list[str]) -> dict:
    """`--set weights.group_size=32 --set scope=mlp`: dotted keys into the recipe, values parsed as YAML scalars."""
    import copy

    import yaml

    out = copy.deepcopy(recipe)
    for item in sets:
        key, sep, raw = item.partition("=")
        parts = key.split(".")
        if not sep or parts[0] not in RECIPE_KEYS or len(parts) > 2:
            raise CalibrateError(f"--set {item!r}: expected KEY=VALUE with KEY one of {', '.join(RECIPE_KEYS)} "
                                 f"(or KEY.FIELD for weights / calibration / kernel)")
        value = yaml.safe_load(raw)
        if len(parts) == 1:
            out[key] = value
        else:
            if not isinstance(out.get(parts[0], {}), dict):
                raise CalibrateError(f"--set {item!r}: {parts[0]} is not a mapping in this recipe")
            out.setdefault(parts[0], {})[parts[1]] = value
    if out.get("algorithm") not in ALGORITHMS:
        raise CalibrateError(f"algorithm must be one of {ALGORITHMS}")
    return out


def load_recipe(name: str) -> tuple[dict, str]:
    import yaml

    path = RECIPES / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in RECIPES.glob("*.yaml")))
        raise CalibrateError(f"unknown recipe {name!r}; known: {known}")
    raw = path.read_bytes()
    recipe = yaml.safe_load(raw)
    if recipe.get("algorithm") not in ALGORITHMS:
        raise CalibrateError(f"{path}: algorithm must be one of {ALGORITHMS}")
    return recipe, hashlib.sha256(raw).hexdigest()


def disable_pin_memory_without_cuda() -> None:
    """llm-compressor 0.14's AWQ pins cached activations for faster GPU onloading; without CUDA, pin_memory()
    raises. Pinning is only a transfer optimisation, so it is skipped when no GPU is present."""
    import torch

    if torch.cuda.is_available():
        return
    from llmcompressor.pipelines.cache import IntermediatesCache

    IntermediatesCache.pin_memory = lambda self, *args, **kwargs: None


def ignore_patterns(recipe: dict) -> list[str]:
    """The default ignores (less those the recipe's quantize_* switches lift) and the recipe's own."""
    lifted = [word for key, word in LIFTS.items() if recipe.get(key)]
    return [p for p in DEFAULT_IGNORE if not any(w in p for w in lifted)] + recipe.get("ignore", [])


def needs_calibration_data(recipe: dict) -> bool:
    """awq / gptq / smoothquant fit on activations; so do static activation scales (observers), even with rtn weights."""
    acts = recipe.get("input_activations") or {}
    return recipe["algorithm"] != "rtn" or (bool(acts) and not acts.get("dynamic", False))


def linear_layers(model, recipe: dict) -> dict[str, int]:
    """Targeted Linear layers → input width, after scope and ignore rules."""
    import torch

    ignore = [re.compile(p[3:]) for p in ignore_patterns(recipe)]
    out = {}
    for name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        if recipe.get("scope", "all") == "mlp" and not MLP_TARGET.match(name):
            continue
        if any(p.match(name) for p in ignore):
            continue
        out[name] = mod.in_features
    if not out:
        raise CalibrateError("the recipe targets no Linear layer of this model (check scope/ignore)")
    return out


def group_size_for(width: int, wanted: int, layer: str) -> int:
    g = wanted
    while g >= 16:
        if width % g == 0:
            return g
        g //= 2
    raise CalibrateError(f"layer {layer}: input width {width} has no power-of-two group size <= {wanted} (>= 16)")


def kernel_refusals(recipe: dict, shapes: dict[str, tuple[int, int]]) -> list[str]:
    """Layers the recipe's serving kernel cannot take, one line each: `kernel` names the one kernel vLLM serves the
    scheme with and what its can_implement() demands (group_size, in_multiple, out_multiple). `shapes`: targeted
    layer -> (input width, output width). A recipe without `kernel` runs where vLLM has a fallback for any shape."""
    k = recipe.get("kernel")
    if not k:
        return []
    weights, out = recipe["weights"], []
    for name, (width, rows) in shapes.items():
        why = []
        if k.get("in_multiple") and width % k["in_multiple"]:
            why.append(f"input width {width} does not divide by {k['in_multiple']}")
        if k.get("out_multiple") and rows % k["out_multiple"]:
            why.append(f"output width {rows} does not divide by {k['out_multiple']}")
        group = group_size_for(width, weights["group_size"], name) if weights.get("strategy") == "group" else None
        if k.get("group_size") and group != k["group_size"]:
            why.append(f"group size {group} is not {k['group_size']}" if group else
                       f"{weights.get('strategy')}-wise weights, not group {k['group_size']}")
        if why:
            out.append(f"{name}: {'; '.join(why)}")
    return out


def check_kernel(recipe_name: str, recipe: dict, shapes: dict[str, tuple[int, int]]) -> None:
    if recipe.get("kernel") and not recipe["kernel"].get("name"):
        raise CalibrateError(f"recipe {recipe_name}: `kernel` needs a name (the vLLM kernel whose demands it states)")
    refused = kernel_refusals(recipe, shapes)
    if refused:
        families = sorted({layer_family(r.split(":")[0]) for r in refused})
        raise CalibrateError(
            f"recipe {recipe_name}: {len(refused)} layer(s) cannot run on {recipe['kernel']['name']}, the kernel vLLM "
            f"serves this scheme with (families {', '.join(families)}); first: {refused[0]}. Add them to the "
            f"recipe's ignore (they stay BF16)")


def config_groups(recipe: dict, layers: dict[str, int]) -> tuple[dict, list[str]]:
    """compressed-tensors config groups and ignore list. With one group size the group targets Linear (or the MLP
    projections) and lists the exclusions in `ignore`; with several, each group names its layers exactly."""
    weights = dict(recipe["weights"])
    by_size: dict[int | None, list[str]] = {}
    for name, width in layers.items():
        g = group_size_for(width, weights["group_size"], name) if weights.get("strategy") == "group" else None
        by_size.setdefault(g, []).append(name)
    acts = recipe.get("input_activations")
    # `format`: the compressed-tensors format of every group where llm-compressor's own inference would differ
    # (4-bit weights with FP8 activations: it stores int8 "int-quantized"; vLLM's W4A8 scheme loads "pack-quantized")
    fmt = {"format": recipe["format"]} if recipe.get("format") else {}
    if len(by_size) == 1:
        (g,) = by_size
        targets = [f"re:{MLP_TARGET.pattern}"] if recipe.get("scope", "all") == "mlp" else ["Linear"]
        if any(n.endswith("lm_head") for n in layers) and targets == ["Linear"]:
            # vLLM matches "Linear" by class name, and its output layer is a ParallelLMHead: name it
            targets.append("re:.*lm_head$")
        ignore = ignore_patterns(recipe)
        w = {**weights, **({"group_size": g} if g else {})}
        return {"group_0": {"targets": targets, "weights": w, "input_activations": acts, **fmt}}, ignore
    groups = {}
    for i, (g, names) in enumerate(sorted(by_size.items(), key=lambda kv: -(kv[0] or 0))):
        groups[f"group_{i}"] = {"targets": [f"re:^{re.escape(n)}$" for n in names],
                                "weights": {**weights, "group_size": g}, "input_activations": acts, **fmt}
    return groups, []


def modifiers(recipe: dict, groups: dict, ignore: list[str]) -> list:
    from llmcompressor.modifiers.awq import AWQModifier
    from llmcompressor.modifiers.quantization import GPTQModifier, QuantizationModifier
    from llmcompressor.modifiers.smoothquant import SmoothQuantModifier

    algo = recipe["algorithm"]
    if algo == "rtn":
        return [QuantizationModifier(config_groups=groups, ignore=ignore)]
    if algo == "awq":
        return [AWQModifier(config_groups=groups, ignore=ignore, duo_scaling=recipe.get("duo_scaling", True))]
    gptq = GPTQModifier(config_groups=groups, ignore=ignore, dampening_frac=recipe.get("dampening_frac", 0.01))
    if algo == "gptq":
        return [gptq]
    return [SmoothQuantModifier(smoothing_strength=recipe.get("smoothing_strength", 0.8), ignore=ignore), gptq]


def load_model(model_dir: Path):
    """The checkpoint's own architecture class (AutoModelForCausalLM would load only the text part of a multimodal
    model such as Qwen3.5 and drop its vision tower)."""
    import torch
    import transformers

    arch = (json.loads((model_dir / "config.json").read_text()).get("architectures") or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    return (cls or transformers.AutoModelForCausalLM).from_pretrained(model_dir, dtype=torch.bfloat16)


def carry_over(source: Path, out: Path) -> list[str]:
    """Copy, unchanged, every source tensor the saved model lacks (e.g. Qwen3.5's mtp.* layers, which transformers
    does not load): an extra shard plus the index entries. Returns the names copied."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    have = read_checkpoint(out)
    src = read_checkpoint(source)
    have_modules = {n.rsplit(".", 1)[0] for n in have.tensors}
    missing = [n for n in src.tensors if n not in have.tensors and n.rsplit(".", 1)[0] not in have_modules]
    if not missing:
        return []
    tensors = {}
    for name in missing:
        with safe_open(source / src.tensors[name].file, "pt") as f:
            tensors[name] = f.get_tensor(name)
    extra = "model-carried-over.safetensors"
    save_file(tensors, out / extra, metadata={"format": "pt"})
    index_path = out / "model.safetensors.index.json"
    if index_path.exists():
        index = json.loads(index_path.read_text())
    else:
        index = {"metadata": {}, "weight_map": {n: t.file for n, t in have.tensors.items()}}
    index["weight_map"].update(dict.fromkeys(missing, extra))
    index_path.write_text(json.dumps(index, indent=2))
    return missing


def calibrate(recipe_name: str, recipe: dict, recipe_sha: str, model_dir: Path, out: Path, *,
              samples: int | None = None, seq_len: int | None = None, sets: list[str] | None = None) -> dict:
    """Quantize model_dir into out with `recipe` (already loaded and overridden; name, hash and overrides are
    recorded in PROVENANCE.json)."""
    import torch
    from llmcompressor import oneshot
    from transformers import AutoTokenizer

    from scripts.data.corpus import build_samples

    source = read_checkpoint(model_dir)
    if source.quantization:
        raise CalibrateError(f"{model_dir} is already quantized ({source.quantization.get('quant_method')})")
    disable_pin_memory_without_cuda()
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_model(model_dir)
    layers = linear_layers(model, recipe)
    check_kernel(recipe_name, recipe, {n: (m.in_features, m.out_features) for n, m in model.named_modules()
                                       if n in layers})
    groups, ignore = config_groups(recipe, layers)
    cal = recipe.get("calibration", {})
    n = samples or cal.get("samples", 0)
    length = seq_len or cal.get("seq_len", 512)
    kwargs: dict = {}
    corpus_info = None
    if needs_calibration_data(recipe):
        ds, corpus_info = build_samples(tok, n, length, seed=cal.get("seed", 0))
        kwargs = {"dataset": ds, "num_calibration_samples": n, "max_seq_length": length}
    t0 = time.monotonic()
    oneshot(model=model, tokenizer=tok, recipe=modifiers(recipe, groups, ignore), output_dir=None, **kwargs)
    model.save_pretrained(out, save_compressed=True)
    tok.save_pretrained(out)
    if any(n.endswith("lm_head") for n in layers):
        # a quantized output layer is no longer the embedding; transformers unties only the top level of a
        # multimodal config (Qwen3.5), and vLLM reads its text_config
        cfg = json.loads((out / "config.json").read_text())
        for level in (cfg, cfg.get("text_config")):
            if level is not None:
                level["tie_word_embeddings"] = False
        (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for extra in ("generation_config.json", "chat_template.jinja"):
        if (model_dir / extra).exists() and not (out / extra).exists():
            shutil.copy(model_dir / extra, out / extra)
    provenance = {"source": paths.shown(model_dir),
                  "recipe": recipe_name, "recipe_sha256": recipe_sha, "overrides": sets or [],
                  "effective_recipe": recipe, "calibration": corpus_info,
                  "quantized_layers": len(layers), "group_sizes": sorted({g["weights"]["group_size"]
                                                                          for g in groups.values() if g["weights"].get("group_size")}),
                  "seconds": round(time.monotonic() - t0, 1), "device": "cuda" if torch.cuda.is_available() else "cpu"}
    provenance["carried_over_unquantized"] = len(carry_over(model_dir, out))
    (out / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
    check_dropped(read_checkpoint(out), source)
    return provenance


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("recipe", nargs="?", help="recipe name (scripts/levers/quantize/recipes/<name>.yaml)")
    p.add_argument("--model", type=Path, help="source checkpoint (never modified)")
    p.add_argument("--out", type=Path, help="output checkpoint directory (must not exist)")
    p.add_argument("--variant", help="take recipe (CALIBRATE_RECIPE), source (PARENT's MODEL) and out (MODEL) from it")
    p.add_argument("--samples", type=int, help="override the recipe's calibration sample count")
    p.add_argument("--seq-len", type=int, help="override the recipe's calibration sequence length")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="override a recipe field, e.g. weights.group_size=32, scope=mlp, weights.actorder=group "
                        "(repeatable; a variant's CALIBRATE_SET holds the same, space-separated)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.variant:
            v = load_variant(args.variant)
            if "CALIBRATE_RECIPE" not in v.resolved or "PARENT" not in v.resolved:
                raise CalibrateError(f"{v.name}: config.env needs CALIBRATE_RECIPE and PARENT")
            args.recipe = args.recipe or v.resolved["CALIBRATE_RECIPE"]
            parent = load_variant(v.resolved["PARENT"])
            if args.model is None and not Path(parent.model).is_dir():
                raise CalibrateError(missing_model(parent))
            args.model = args.model or Path(parent.model)
            args.out = args.out or Path(v.model)
            args.samples = args.samples or (int(v.resolved["CALIBRATE_SAMPLES"]) if "CALIBRATE_SAMPLES" in v.resolved else None)
            args.seq_len = args.seq_len or (int(v.resolved["CALIBRATE_SEQ_LEN"]) if "CALIBRATE_SEQ_LEN" in v.resolved else None)
            args.sets = v.resolved.get("CALIBRATE_SET", "").split() + args.sets
        if not (args.recipe and args.model and args.out):
            raise CalibrateError("give RECIPE --model DIR --out DIR, or --variant NAME")
        if args.out.exists():
            raise CalibrateError(f"{args.out} exists; remove it first (outputs are never overwritten)")
        recipe, recipe_sha = load_recipe(args.recipe)
        recipe = apply_overrides(recipe, args.sets)  # a bad --set fails before the model loads
        from scripts.common.checkpoint import verify

        verify(args.model)  # a source that fails verification is refused before any work
        with paths.staged(args.out) as tmp:
            prov = calibrate(args.recipe, recipe, recipe_sha, args.model, tmp, samples=args.samples,
                             seq_len=args.seq_len, sets=args.sets)
            verify(tmp)
    except (CalibrateError, CheckpointError, VariantError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(prov, indent=2))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
