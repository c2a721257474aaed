"""The GPU side of make optimize's plan: the levers this GPU and this model admit, decided from the device's compute
capability and vLLM's own checks, never from a table of GPU names.

    python -m scripts.optimize.gpu smollm2-bf16      # on a CUDA machine: capability, each lever admitted or why not

vLLM's checks, as the installed vLLM has them (0.26.0 on the lent H200, the same classes in later releases):
- a compressed-tensors scheme's minimum capability (`get_min_capability()`): W8A8 FP8 (89: below it vLLM serves the
  same FP8 checkpoint weight-only, as CompressedTensorsW8A16Fp8 on Marlin), W4A8 FP8 (90), W8A8 INT8 (75), WNA16 (75);
- each mixed-precision kernel vLLM can select for CUDA (`_POSSIBLE_KERNELS`): its minimum capability and its
  `can_implement()` on every linear layer shape of the checkpoint (W4A16: 4-bit symmetric, group 128, BF16
  activations; W4A8: the same weights, FP8 activations), reached by the `--linear-backend` name vLLM maps to it.
A lever the GPU or the model cannot take is listed with the first reason vLLM gives.

Every CUDA GPU gets: an FP8 KV cache, max_num_seqs and CUDA-graph capture sizes matched to the concurrency levels,
n-gram speculation, the checkpoint's own MTP head where it carries one; W4A16 (GPTQ, group 128 where K allows) on
vLLM's choice and on each other kernel it admits, and on the lab's own kernel class (scripts/levers/kernels/
vllm_kernel.py, the rung's ENV_LAB_W4A16_KERNEL=stream: it holds the 4-bit weights twice) where that class admits
every layer, and on that class a checkpoint with the output layer in 4 bits too (`w4a16-stream-head`, the recipe's
-head form) where the class takes the output layer's shape; FP8 W8A8 with static activation scales where the scheme's
capability allows, else FP8 weights served weight-only and W8A8 INT8; W4A8 where its scheme and kernel allow; SGLang
serving the BF16 weights where SGLang is installed. The plan module adds the pruned output layer and committed EAGLE-3
heads on every machine. A shape proxy (random weights) gets its quantized forms written config-only (served with
vLLM's random weights) and no speculation; on Qwen3.5's Gated-DeltaNet layers W4A16 takes their projections too
(gptq-w4a16-gdn).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys
from contextlib import suppress
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import layer_family, read_safetensors_header
from scripts.common.engines import EngineError, version
from scripts.common.records import one_line
from scripts.common.variants import is_config_only
from scripts.levers.quantize.calibrate import (
    MLP_TARGET,
    CalibrateError,
    group_size_for,
    ignore_patterns,
    kernel_refusals,
    load_recipe,
)
from scripts.optimize.keys import IDENTITY, LOSSY_GATE, NGRAM_SPEC

GROUP = 128  # the group size of the W4A16 and W4A8 recipes (gptq-w4a16, rtn-w4a8-fp8; W4A16 takes less where K needs)
# a layer whose module name ends so is a linear layer the quantization recipes take (lm_head and embeddings are not)
LINEAR_SUFFIXES = ("proj", "fc1", "fc2", "c_fc", "c_proj", "query_key_value", "dense", "in_proj_qkvz", "in_proj_ba")
W4A16 = "W4A16 (GPTQ, group 128 or the largest power of two that divides K)"
HEAD_4BIT = "the output layer in 4 bits (W4A16 on the lab's stream kernel)"


class GpuPlanError(ValueError):
    """No CUDA device, or vLLM's CUDA checks cannot be read; one line, ready to print."""


def capability() -> int | None:
    """The capability query: the current CUDA device's compute capability as vLLM reads it (90 for 9.0), else None."""
    from vllm.platforms import current_platform

    if not current_platform.is_cuda():
        return None
    cc = current_platform.get_device_capability()
    return None if cc is None else cc.to_int()


def linear_shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    """{layer family: (N out, K in)} of the checkpoint's linear layers in its decoder (safetensors headers; one shape
    per family, the first layer's): what a quantized kernel must implement. Vision towers and MTP heads are left out."""
    out: dict[str, tuple[int, int]] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).items():
            module = name.removesuffix(".weight")
            if (len(t.shape) == 2 and name.endswith(".weight") and module.rsplit(".", 1)[-1].endswith(LINEAR_SUFFIXES)
                    and ".layers." in module and not any(x in module for x in ("visual", "vision", "mtp."))):
                out.setdefault(layer_family(module), (t.shape[0], t.shape[1]))
    return out


def targeted(shapes: dict[str, tuple[int, int]], recipe_name: str) -> dict[str, tuple[int, int]]:
    """The layers a calibrate recipe quantizes, by its scope and ignore rules (scripts/levers/quantize/calibrate.py):
    gptq-w4a16 leaves Qwen3.5's Gated-DeltaNet projections in BF16, rtn-w4a8-fp8 its in_proj_a / in_proj_b."""
    recipe, _ = load_recipe(recipe_name)
    ignore = [re.compile(p[3:]) for p in ignore_patterns(recipe)]
    return {f: s for f, s in shapes.items() if not any(p.match(f) for p in ignore)
            and (recipe.get("scope", "all") != "mlp" or MLP_TARGET.match(f))}


def _kernel_table() -> tuple[list[type], dict[type, str]]:
    """(vLLM's CUDA mixed-precision kernels in its own order of preference, {kernel: its --linear-backend name})."""
    from vllm.model_executor.kernels.linear import _LINEAR_BACKEND_KERNEL_MAP, _POSSIBLE_KERNELS
    from vllm.platforms.interface import PlatformEnum

    names = {k: b for b, ks in _LINEAR_BACKEND_KERNEL_MAP.items() for k in ks}
    return list(_POSSIBLE_KERNELS[PlatformEnum.CUDA]), names


def w4a8_recipe_refusals(shapes: dict[str, tuple[int, int]]) -> str | None:
    """The calibrate lever's own check of rtn-w4a8-fp8 (the kernel its recipe says vLLM serves it with), so the plan
    never proposes what the build step refuses; None where every targeted layer passes."""
    recipe, _ = load_recipe("rtn-w4a8-fp8")
    refused = kernel_refusals(recipe, {f: (k, n) for f, (n, k) in targeted(shapes, "rtn-w4a8-fp8").items()})
    if not refused:
        return None
    return (f"recipe rtn-w4a8-fp8 is served on {recipe['kernel']['name']}, which takes {len(refused)} of its layers "
            f"not: {refused[0]}")


def kernel_verdicts(shapes: dict[str, tuple[int, int]], cc: int, act: str = "bf16") -> dict[str, str | None]:
    """{--linear-backend name: None where vLLM's kernel implements every layer at capability cc, else vLLM's reason}
    for 4-bit symmetric weights with `act` activations: bf16 (W4A16, each layer's group the calibrate lever gives it:
    the largest power of two <= 128 dividing its input width) or fp8 (W4A8, group 128). Kernels with no backend name
    (vLLM cannot be told to use them) are left out."""
    kernels, names = _kernel_table()
    out: dict[str, str | None] = {}
    for k in kernels:
        if k not in names or names[k] in out:
            continue
        out[names[k]] = class_verdict(k, shapes, cc, act)
    return out


def _layer_fields(act: str) -> dict:
    """MPLinearLayerConfig's fields of a 4-bit symmetric layer with `act` activations (bf16: W4A16, fp8: W4A8),
    besides its shape and group."""
    import torch
    from vllm.model_executor.kernels.linear.mixed_precision import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    fields = {"weight_type": scalar_types.uint4b8 if act == "bf16" else scalar_types.int4,
              "act_type": torch.bfloat16 if act == "bf16" else torch.float8_e4m3fn, "zero_points": False,
              "out_type": torch.bfloat16}
    if "has_g_idx" in {f.name for f in dataclasses.fields(MPLinearLayerConfig)}:  # vLLM 0.26 (GPTQ act-order)
        fields["has_g_idx"] = False
    return fields


def class_verdict(k, shapes: dict[str, tuple[int, int]], cc: int, act: str = "bf16") -> str | None:
    """None where kernel class k implements every layer of `shapes` at capability cc with `act` activations, else the
    first reason."""
    from vllm.model_executor.kernels.linear.mixed_precision import MPLinearLayerConfig

    fields = _layer_fields(act)
    if k.get_min_capability() > cc:
        return f"{k.__name__} requires capability {k.get_min_capability()}, this GPU's is {cc}"
    for family, (n, kk) in shapes.items():
        try:  # W4A16: the group the calibrate lever gives this layer; W4A8: its recipe demands 128
            group = group_size_for(kk, GROUP, family) if act == "bf16" else GROUP
        except CalibrateError as e:
            return str(e)
        cfg = MPLinearLayerConfig(**fields, group_size=group, full_weight_shape=(kk, n), partition_weight_shape=(kk, n))
        try:
            ok, why = k.can_implement(cfg)
        except Exception as e:  # a kernel whose check needs a package or op this vLLM build lacks
            ok, why = False, one_line(e)
        if not ok:
            return f"{k.__name__} cannot implement {family} (N={n}, K={kk}): {why}"
    return None


def lab_kernel_verdict(shapes: dict[str, tuple[int, int]], cc: int) -> str | None:
    """The lab's W4A16 kernel class (scripts/levers/kernels/vllm_kernel.py, served with LAB_W4A16_KERNEL=stream) on
    the W4A16 layers: None where it implements every one at capability cc, else the first reason."""
    try:
        from scripts.levers.kernels.vllm_kernel import LabStreamLinearKernel
    except ImportError as e:  # a vLLM whose kernel modules moved
        return f"the lab's kernel class does not import with this vLLM: {one_line(e)}"
    return class_verdict(LabStreamLinearKernel, shapes, cc)


def output_layer_shape(model_dir: Path) -> tuple[int, int] | None:
    """(N vocabulary rows, K hidden) of the checkpoint's output layer: lm_head's weight, else (a tied output layer)
    the decoder's embedding; None where neither is stored."""
    embedding = None
    for f in sorted(model_dir.glob("*.safetensors")):
        for name, t in read_safetensors_header(f).items():
            if len(t.shape) != 2:
                continue
            if name.endswith("lm_head.weight") and "mtp." not in name:
                return t.shape[0], t.shape[1]
            if name.endswith("embed_tokens.weight") and not any(x in name for x in ("visual", "vision", "mtp.")):
                embedding = embedding or (t.shape[0], t.shape[1])
    return embedding


def output_layer_rung(base: str, recipe: str, quant: dict[str, str], shape: str | None, model_dir: Path,
                      layers: dict[str, tuple[int, int]], cc: int, made: str) -> tuple | str:
    """The W4A16 stream rung with the output layer in 4 bits too (the recipe's `-head` form: quantize_lm_head, a tied
    output layer untied), its own checkpoint on the same kernel class, judged against the BF16 reference: the
    template, or why not (no such recipe, no output layer stored, or the class refuses its shape). Its checkpoint is
    calibrated from the BF16 weights (PARENT the BF16 reference: the stream rung's is already 4-bit); a shape proxy's,
    written config-only, names the stream rung as its PARENT, the one lever it adds."""
    head = f"{recipe}-head"
    try:
        load_recipe(head)
    except CalibrateError:
        return f"no recipe {head} (the {recipe} recipe with quantize_lm_head)"
    if (lm := output_layer_shape(model_dir)) is None:
        return "the checkpoint stores no output layer or embedding"
    if why := lab_kernel_verdict({**layers, "lm_head": lm}, cc):
        return why
    rung = quantized(base, "w4a16-head", head, quant, shape)
    if "CALIBRATE_RECIPE" not in rung:  # written config-only: a lever on the stream rung; calibrated, PARENT stays BF16
        rung["PARENT"] = f"{base}-w4a16-stream"  # (make calibrate reads its source from PARENT's MODEL)
    return (f"W4A16 with the output layer ({lm[0]} x {lm[1]}) in 4 bits too (GPTQ, {made}), on the lab's stream "
            "kernel", "vllm", {**rung, "ENV_LAB_W4A16_KERNEL": "stream", "GATE_REFERENCE": f"{base}-bf16"}, [])


def scheme_capabilities() -> dict[str, int]:
    """vLLM's minimum compute capability of each compressed-tensors scheme the recipes write."""
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import (
        CompressedTensorsW4A8Fp8,
        CompressedTensorsW8A8Fp8,
        CompressedTensorsW8A8Int8,
        CompressedTensorsWNA16,
    )

    return {"fp8_w8a8": CompressedTensorsW8A8Fp8.get_min_capability(),
            "w4a8_fp8": CompressedTensorsW4A8Fp8.get_min_capability(),
            "int8_w8a8": CompressedTensorsW8A8Int8.get_min_capability(),
            "wna16": CompressedTensorsWNA16.get_min_capability()}


def mtp_layers(config: dict) -> int:
    """How many MTP layers the checkpoint's config declares (Qwen3.5 / Qwen3-Next `mtp_num_hidden_layers`, DeepSeek
    `num_nextn_predict_layers`); 0 where none."""
    text = config.get("text_config") or config
    return int(text.get("mtp_num_hidden_layers") or text.get("num_nextn_predict_layers") or 0)


def has_mtp_weights(model_dir: Path) -> bool:
    return any(name.startswith("mtp.") or ".mtp." in name for f in model_dir.glob("*.safetensors")
               for name in read_safetensors_header(f))


def serving(ref: dict[str, str]) -> dict[str, str]:
    """The reference's serving settings every GPU candidate keeps (its SERVE_ and ENV_ keys but the CPU's)."""
    return {k: v for k, v in ref.items() if (k.startswith(("SERVE_", "ENV_")) and not k.startswith("ENV_VLLM_CPU"))
            or k in ("SHAPE_PROXY", "EVAL_TASKS")}


def proxy_shape(ref: dict[str, str]) -> str | None:
    """The named shape a shape-proxy reference was written from (SOURCE shape-proxy:<shape> or config-only:<shape>),
    else None: its quantized forms are then written config-only instead of calibrated."""
    source = ref.get("SOURCE", "")
    if ref.get("SHAPE_PROXY") != "1" or not source.startswith(("shape-proxy:", "config-only:")):
        return None
    return source.split(":")[1]


def quantized(base: str, suffix: str, recipe: str, quant: dict[str, str], shape: str | None) -> dict[str, str]:
    """A quantized candidate's config: calibrated by llm-compressor from the BF16 weights (CALIBRATE_RECIPE), or, on a
    shape proxy, written config-only with the recipe's quantization_config and served with the random weights vLLM
    makes (SERVE_LOAD_FORMAT=dummy): calibrating random weights measures nothing and costs minutes on a 4B. A recipe
    that cannot be written config-only is calibrated on the proxy too."""
    from scripts.weights.shape_proxy import config_only_format

    if shape and config_only_format(load_recipe(recipe)[0]):
        return {"MODEL": f"weights/{base}-{suffix}", **quant, "SOURCE": f"config-only:{shape}:{recipe}",
                "SERVE_LOAD_FORMAT": "dummy"}
    return {"MODEL": f"weights/{base}-{suffix}", **quant, "CALIBRATE_RECIPE": recipe}


def templates(base: str, ref: dict[str, str], model_dir: Path, config: dict, cc: int,
              concurrency: list[int]) -> tuple[dict[str, tuple[str, str, dict[str, str], list[str]]],
                                                   list[dict[str, str]]]:
    """({suffix: (lever, engine, config, the variants it needs built first)}, [{lever, why} left out]) on a CUDA GPU of
    capability cc (90 for 9.0), cheapest first. A shape proxy (random weights: a speed ladder only) gets its
    quantized forms config-only and no speculation (its speed is the acceptance, which random weights do not have)."""
    r = f"{base}-bf16"
    keep = serving(ref)
    shape = proxy_shape(ref)
    made = "written config-only: random weights" if shape else "llm-compressor"  # the W4A16 and FP8 forms
    same = {"MODEL": ref["MODEL"], "SOURCE": ref.get("SOURCE", "lever"), "PARENT": r, "BASE": base, **keep}
    quant = {"SOURCE": "lever", "PARENT": r, "BASE": base, **keep, **LOSSY_GATE}
    out: dict[str, tuple[str, str, dict[str, str], list[str]]] = {}
    left: list[dict[str, str]] = []
    top = max(concurrency)
    out["graphs"] = (f"max_num_seqs {top} and CUDA graphs captured at exactly {sorted(set(concurrency))} (the ladder's "
                     "levels)", "vllm", {**same, "SERVE_MAX_NUM_SEQS": str(top), "SERVE_COMPILATION_CONFIG": json.dumps(
                         {"cudagraph_capture_sizes": sorted(set(concurrency))}), **IDENTITY}, [])
    out["fp8kv"] = ("FP8 (e4m3) KV cache", "vllm", {**same, "SERVE_KV_CACHE_DTYPE": "fp8", **LOSSY_GATE}, [])
    if ref.get("SHAPE_PROXY") == "1":
        left += [{"lever": lever, "why": "a shape proxy's random weights accept no draft as the model would: a "
                  "speculative lever's speed is its acceptance, which only real weights measure"}
                 for lever in ("n-gram speculation (K=4)", "the model's own MTP head")]
    else:
        out["ngram4"] = ("n-gram speculation (K=4), BF16 weights", "vllm", {**same, **NGRAM_SPEC, **IDENTITY}, [])
        if (n := mtp_layers(config)) and has_mtp_weights(model_dir):
            out["mtp3"] = (f"the checkpoint's own MTP head ({n} layer(s)), 3 tokens drafted a step", "vllm",
                           {**same, "SERVE_SPECULATIVE_CONFIG": '{"method": "mtp", "num_speculative_tokens": 3}',
                            **IDENTITY}, [])
        else:
            left.append({"lever": "the model's own MTP head", "why": "its checkpoint carries none" + (
                f" (config.json declares {n} MTP layer(s) but no mtp.* tensor is stored)" if n else
                " (config.json declares no MTP layer)")})
    shapes = linear_shapes(model_dir)
    caps = scheme_capabilities()
    if cc < caps["wna16"]:
        left.append({"lever": W4A16, "why": f"vLLM's CompressedTensorsWNA16 needs capability {caps['wna16']}, this "
                     f"GPU's is {cc}"})
    else:
        # Qwen3.5's Gated-DeltaNet projections in 4 bits too where the model has them: with gptq-w4a16 keeping them in
        # BF16, the 4B shape's W4A16 step still read 4.64 of BF16's 8.44 GB on the H200 (results/gpu-optimize-20261129)
        recipe = "gptq-w4a16-gdn" if set(targeted(shapes, "gptq-w4a16-gdn")) > set(targeted(shapes, "gptq-w4a16")) \
            else "gptq-w4a16"
        layers = targeted(shapes, recipe)  # the layers the recipe quantizes: what every 4-bit kernel must take
        kernels = kernel_verdicts(layers, cc)
        admitted = [b for b, why in kernels.items() if why is None]
        w4 = quantized(base, "w4a16", recipe, quant, shape)
        if not admitted:
            left.append({"lever": W4A16, "why": "no CUDA kernel of vLLM implements every layer: "
                         + "; ".join(f"{b}: {w}" for b, w in kernels.items())})
        else:
            gdn = ", Gated-DeltaNet projections included" if recipe.endswith("-gdn") else ""
            out["w4a16"] = (f"W4A16 (GPTQ, group 128{gdn}, {made}) on vLLM's own kernel choice", "vllm", w4, [])
            def on_w4a16(setting: dict) -> tuple[dict, list[str]]:
                """The W4A16 rung's checkpoint served another way: its settings with `setting`, judged on its quality
                records (the same file); it waits for the W4A16 rung's build where that calibrates."""
                return ({**{k: v for k, v in w4.items() if k != "CALIBRATE_RECIPE" and k not in LOSSY_GATE},
                         "PARENT": f"{base}-w4a16", **setting, "GATE_REFERENCE": r,
                         "GATE_QUALITY_OF": f"{base}-w4a16", **LOSSY_GATE},
                        ["w4a16"] if "CALIBRATE_RECIPE" in w4 else [])  # config-only: make weights

            for b in admitted:
                out[f"w4a16-{b}"] = (f"W4A16 (GPTQ) on the {b} kernel (--linear-backend {b})", "vllm",
                                     *on_w4a16({"SERVE_LINEAR_BACKEND": b}))
            left += [{"lever": f"W4A16 on the {b} kernel", "why": why} for b, why in kernels.items() if why]
            # the lab's own kernel: the stream form at M = 1, Marlin above (results/gpu-27b-20261207/)
            if (why := lab_kernel_verdict(layers, cc)) is None:
                out["w4a16-stream"] = ("W4A16 (GPTQ) on the lab's stream kernel at one token a step, Marlin above "
                                       "(LAB_W4A16_KERNEL=stream)", "vllm", *on_w4a16({"ENV_LAB_W4A16_KERNEL": "stream"}))
                head = output_layer_rung(base, recipe, quant, shape, model_dir, layers, cc, made)
                if isinstance(head, str):
                    left.append({"lever": HEAD_4BIT, "why": head})
                else:
                    out["w4a16-stream-head"] = head
            else:
                left.append({"lever": "W4A16 on the lab's stream kernel", "why": why})
                left.append({"lever": HEAD_4BIT, "why": "it is served by the lab's stream kernel, which this GPU or "
                             "model does not take (above)"})
    if cc >= caps["fp8_w8a8"]:
        out["fp8-static"] = (f"FP8 W8A8, static per-tensor activation scales ({made}): vLLM's norm and "
                             "activation fusions apply", "vllm",
                             quantized(base, "fp8-static", "fp8-w8a8-static", quant, shape), [])
        left.append({"lever": "W8A8 INT8", "why": f"FP8 W8A8 runs here (vLLM's CompressedTensorsW8A8Fp8 needs "
                     f"capability {caps['fp8_w8a8']}, this GPU's is {cc}): the same bytes, proposed instead"})
    else:
        out["fp8"] = (f"FP8 weights, served weight-only (vLLM's W8A8 FP8 needs capability {caps['fp8_w8a8']}, this "
                      f"GPU's is {cc}: CompressedTensorsW8A16Fp8)", "vllm",
                      quantized(base, "fp8", "fp8-w8a8", quant, shape), [])
        if cc >= caps["int8_w8a8"]:
            out["int8"] = ("W8A8 INT8, dynamic per-token activations (llm-compressor)", "vllm",
                           quantized(base, "int8", "int8-w8a8", quant, shape), [])
        else:
            left.append({"lever": "W8A8 INT8", "why": f"vLLM's CompressedTensorsW8A8Int8 needs capability "
                         f"{caps['int8_w8a8']}, this GPU's is {cc}"})
    w4a8 = kernel_verdicts(targeted(shapes, "rtn-w4a8-fp8"), cc, act="fp8") if cc >= caps["w4a8_fp8"] else {}
    if cc < caps["w4a8_fp8"]:
        left.append({"lever": "W4A8 (4-bit weights, FP8 activations)", "why": f"vLLM's CompressedTensorsW4A8Fp8 needs "
                     f"capability {caps['w4a8_fp8']}, this GPU's is {cc}"})
    elif None not in w4a8.values():
        left.append({"lever": "W4A8 (4-bit weights, FP8 activations)", "why": "no CUDA kernel of vLLM implements every "
                     "layer: " + "; ".join(f"{b}: {w}" for b, w in w4a8.items())})
    elif refused := w4a8_recipe_refusals(shapes):  # the builder would refuse it (a failed build, 2026-11-28 on SmolLM2)
        left.append({"lever": "W4A8 (4-bit weights, FP8 activations)", "why": refused})
    else:
        out["w4a8"] = ("W4A8: 4-bit group-128 weights, dynamic FP8 activations (on "
                       + ", ".join(b for b, why in w4a8.items() if why is None) + ")", "vllm",
                       quantized(base, "w4a8", "rtn-w4a8-fp8", quant, shape), [])
    if is_config_only(ref):  # no weights to calibrate: only config-only forms remain
        for suffix in [k for k, t in out.items() if "CALIBRATE_RECIPE" in t[2]]:
            lever, _, cfg, _ = out.pop(suffix)
            left.append({"lever": lever, "why": f"its recipe ({cfg['CALIBRATE_RECIPE']}) cannot be written config-only, "
                         "and a config-only reference has no weights to calibrate"})
    try:  # SGLang's own Python (LAB_SGLANG_PYTHON: its pins apart from vLLM's), not this one
        version("sglang")
    except EngineError as e:
        left.append({"lever": "SGLang serving the BF16 weights", "why": str(e)})
    else:
        out["sglang"] = ("SGLang serving the BF16 weights (a second engine)", "sglang",
                         {"MODEL": ref["MODEL"], "SOURCE": ref.get("SOURCE", "lever"), "PARENT": r, "BASE": base,
                          "ENGINE": "sglang", "SGLANG_DTYPE": "bfloat16",
                          "SGLANG_CONTEXT_LENGTH": ref.get("SERVE_MAX_MODEL_LEN", "8192"),
                          "SGLANG_MAX_RUNNING_REQUESTS": str(top),
                          # as the lab's SGLang rungs run on the lent GPU (experiments/smollm2-sglang): its carried
                          # kernel wheel has no FlashAttention-3, its FlashInfer sampling is another version than the
                          # vLLM bundle's, and the bench asks no structured output
                          "SGLANG_ATTENTION_BACKEND": "triton", "SGLANG_SAMPLING_BACKEND": "pytorch",
                          "SGLANG_GRAMMAR_BACKEND": "none", "SGLANG_SLEEP_ON_IDLE": "1", **IDENTITY,
                          **{k: v for k, v in ref.items() if k in ("SHAPE_PROXY", "EVAL_TASKS")}}, [])
    return out, left


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("reference", help="a base's BF16 variant, e.g. smollm2-bf16")
    p.add_argument("--concurrency", default="1,8", help="the ladder's levels (default 1,8)")
    return p


def main(argv: list[str] | None = None) -> int:
    from scripts.common.variants import VariantError, load_variant

    args = build_parser().parse_args(argv)
    try:
        ref = load_variant(args.reference).settings
        model_dir = paths.ROOT / ref["MODEL"]
        if not (model_dir / "config.json").is_file():
            raise GpuPlanError(f"{ref['MODEL']} does not exist: run `make weights VARIANT={args.reference}`")
        if (cc := capability()) is None:
            raise GpuPlanError("no CUDA device visible to vLLM here: the GPU plan needs one (VLLM_TARGET=cuda)")
        config = json.loads((model_dir / "config.json").read_text())
        out, left = templates(ref["BASE"], ref, model_dir, config, cc, [int(x) for x in args.concurrency.split(",")])
    except (GpuPlanError, VariantError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"compute capability {cc / 10:.1f}")
    for suffix, (lever, engine, _, _) in out.items():
        print(f"  propose {ref['BASE']}-{suffix} ({engine}): {lever}")
    for x in left:
        print(f"  leave out {x['lever']}: {x['why']}")
    return 0


if __name__ == "__main__":
    with suppress(BrokenPipeError):
        sys.exit(main())
