"""Roofline of a decode step: the bytes one step reads, the device's measured copy bandwidth, and TPOT over the time
those bytes take at that bandwidth.

    python -m scripts.measure.roofline qwen35-4b-proxy-bf16 --context 400 --concurrency 1,8   # bytes, no bandwidth
    python -m scripts.measure.roofline qwen35-4b-proxy-bf16 --bandwidth                       # + a copy on this GPU

A decode step of a batch of c sequences reads every weight the forward pass uses once (shared by the batch), and per
sequence its KV cache (full-attention layers at its current length, sliding-window layers at most their window) and
its recurrent state (Qwen3.5's
Gated-DeltaNet layers: the conv state and the temporal state, read and written every step; only the reads are
counted). Weights come from the checkpoint's safetensors headers, grouped by dtype (packed int4 is I32, FP8 F8_E4M3);
tensors a text-only decode step never reads are left out and named: the vision tower, the MTP head (read only when it
drafts), and an input embedding that is not also the output layer (a step reads c of its rows). A tied embedding is
read whole, as the output layer. KV bytes per token and the state come from config.json and the serving dtypes
(SERVE_KV_CACHE_DTYPE, SERVE_MAMBA_CACHE_DTYPE / SERVE_MAMBA_SSM_CACHE_DTYPE; "auto": the model dtype, as vLLM 0.26).

roofline_s(c) = (weight bytes + c x (KV bytes per token x context + windowed KV bytes per token x min(context, window)
+ state bytes)) / copy bandwidth, where the copy
bandwidth is (bytes read + bytes written) / second of a device-to-device torch copy measured on that device in the
same run (`copy_bandwidth`): never an assumed figure. TPOT / roofline_s is how many times the step takes longer than
its bytes need; a record without a bandwidth measurement says so and has no ratio.

Over several GPUs (a record's topology) the bound is one GPU's share, read at one GPU's bandwidth: E engines (data
parallel x replicas) each read the weights once per step, tensor parallel splits every engine's weights, KV and state
over its GPUs, and the c sequences are split over the engines, so a GPU reads (E x weights + c x per-sequence bytes) /
GPUs per step (one engine on one GPU: the formula above; two replicas sharing one GPU read the weights twice).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

from scripts.common.checkpoint import DTYPE_BYTES
from scripts.common.paths import write_text_atomic

TORCH_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4,
                     "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# (pattern, why a text-only decode step does not read it)
NOT_READ = ((re.compile(r"(^|\.)(visual|vision_tower|vision_model)\."), "vision tower (text-only serving)"),
            (re.compile(r"^mtp\.|\.mtp\."), "MTP head (read only when it drafts)"))
EMBED = re.compile(r"(^|\.)embed_tokens\.")
COPY_BYTES = 1 << 30


class RooflineError(ValueError):
    pass


def step_weight_bytes(tensors: dict[str, tuple[str, tuple[int, ...]]], tied: bool) -> dict:
    """{"by_dtype": {dtype: bytes}, "total": bytes, "skipped": {why: bytes}} for one decode step's weight reads;
    `tensors` maps name -> (safetensors dtype, shape)."""
    by_dtype: dict[str, int] = {}
    skipped: dict[str, int] = {}
    for name, (dtype, shape) in tensors.items():
        if dtype not in DTYPE_BYTES:
            raise RooflineError(f"tensor {name}: unknown safetensors dtype {dtype!r}")
        n = DTYPE_BYTES[dtype]
        for d in shape:
            n *= d
        why = next((w for p, w in NOT_READ if p.search(name)), None)
        if why is None and EMBED.search(name) and not tied:
            why = "input embedding, untied (a step reads one row per sequence)"
        if why:
            skipped[why] = skipped.get(why, 0) + n
        else:
            by_dtype[dtype] = by_dtype.get(dtype, 0) + n
    return {"by_dtype": dict(sorted(by_dtype.items())), "total": sum(by_dtype.values()), "skipped": skipped}


def dtype_bytes(setting: str | None, model_bytes: int) -> int:
    s = (setting or "auto").lower()
    if s not in TORCH_DTYPE_BYTES:
        raise RooflineError(f"cache dtype {setting!r}: known {', '.join(TORCH_DTYPE_BYTES)}")
    return TORCH_DTYPE_BYTES[s] or model_bytes


def cache_bytes(text: dict, *, kv_dtype: str | None = None, mamba_dtype: str | None = None,
                ssm_dtype: str | None = None) -> dict:
    """KV cache bytes per token (all full-attention layers, K and V), the same for sliding-window layers (a step reads
    at most `sliding_window` tokens of theirs) and recurrent-state bytes per sequence (Gated-DeltaNet layers: conv
    state (kernel-1) x conv_dim, temporal state v_heads x v_dim x k_dim) from a text config."""
    model = DTYPE_BYTES.get({"bfloat16": "BF16", "float16": "F16", "float32": "F32"}.get(
        str(text.get("dtype") or text.get("torch_dtype") or "bfloat16"), "BF16"), 2)
    layers = text.get("layer_types") or ["full_attention"] * int(text["num_hidden_layers"])
    full = sum(t == "full_attention" for t in layers)
    linear = sum(t == "linear_attention" for t in layers)
    sliding = sum(t == "sliding_attention" for t in layers)
    if full + linear + sliding != len(layers):
        raise RooflineError(f"layer_types: only full_attention / sliding_attention / linear_attention are known, got "
                            f"{sorted(set(layers))}")
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    kv_heads = text.get("num_key_value_heads") or text["num_attention_heads"]
    per_layer = 2 * kv_heads * head_dim * dtype_bytes(kv_dtype, model)
    kv = full * per_layer
    state = 0
    if linear:
        kh, vh = text["linear_num_key_heads"], text["linear_num_value_heads"]
        kd, vd = text["linear_key_head_dim"], text["linear_value_head_dim"]
        conv_b = dtype_bytes(mamba_dtype, model)
        ssm_b = dtype_bytes(ssm_dtype, conv_b)
        conv = (text["linear_conv_kernel_dim"] - 1) * (2 * kh * kd + vh * vd) * conv_b
        state = linear * (conv + vh * vd * kd * ssm_b)
    if sliding and not isinstance(text.get("sliding_window"), int):
        raise RooflineError(f"{sliding} sliding_attention layers but sliding_window is {text.get('sliding_window')!r}")
    window = {"window_kv_bytes_per_token": sliding * per_layer, "sliding_window": text["sliding_window"],
              "sliding_attention_layers": sliding} if sliding else {}
    return {"kv_bytes_per_token": kv, "state_bytes_per_sequence": state, "full_attention_layers": full,
            "linear_attention_layers": linear, **window}


def step_bytes(weights: int, kv_per_token: int, state_per_seq: int, context: float, concurrency: int,
               window_kv_per_token: int = 0, window: float = 0) -> float:
    """Bytes one decode step of `concurrency` sequences, each `context` tokens long, reads (a sliding-window layer's
    KV: its last `window` tokens at most)."""
    return weights + concurrency * (kv_per_token * context + window_kv_per_token * min(context, window) + state_per_seq)


def roofline(step: float, bandwidth: float | None, tpot_ms: float | None) -> dict:
    """The step's time at the bandwidth (ms) and TPOT / that time; None where either is missing."""
    t = step / bandwidth * 1e3 if bandwidth else None
    return {"roofline_ms": t, "tpot_over_roofline": tpot_ms / t if t and tpot_ms else None}


def checkpoint_bytes(model_dir: Path, settings: dict[str, str]) -> dict:
    """Weights and cache bytes of a served checkpoint directory (headers only) under the variant's settings."""
    from scripts.common.checkpoint import read_checkpoint

    report = read_checkpoint(model_dir)
    text = report.text_config
    tied = bool(report.config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))
    weights = step_weight_bytes({n: (t.dtype, t.shape) for n, t in report.tensors.items()}, tied)
    caches = cache_bytes(text, kv_dtype=settings.get("SERVE_KV_CACHE_DTYPE"),
                         mamba_dtype=settings.get("SERVE_MAMBA_CACHE_DTYPE"),
                         ssm_dtype=settings.get("SERVE_MAMBA_SSM_CACHE_DTYPE"))
    online = settings.get("SERVE_QUANTIZATION") if not report.quantization else None
    return {"weights": weights, **caches, "tied_embedding": tied,
            "online_quantization": online,
            "note": (f"weights are the checkpoint's; vLLM quantizes them to {online} at load, so a step reads fewer "
                     "bytes than counted here: no roofline ratio") if online else None}


def copy_bandwidth(nbytes: int = COPY_BYTES, iters: int = 20, warmup: int = 5) -> dict:
    """Device-to-device copy bandwidth of the current CUDA device: (read + written) bytes per second, median of
    `iters` timed copies after `warmup`, each timed with CUDA events and synchronized."""
    import torch

    if not torch.cuda.is_available():
        raise RooflineError("no CUDA device: copy bandwidth not measured")
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    for _ in range(warmup):
        dst.copy_(src)
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    times.sort()
    med = times[len(times) // 2]
    del src, dst
    torch.cuda.empty_cache()
    return {"bytes_per_s": 2 * nbytes / med, "method": "torch device-to-device copy, (read + write) bytes / median "
            "time", "buffer_bytes": nbytes, "iters": iters, "warmup": warmup,
            "min_s": times[0], "median_s": med, "max_s": times[-1], "device": torch.cuda.get_device_name(),
            "measured_at": time.time()}


def engines_and_gpus(topology: dict | None) -> tuple[int, int]:
    """(engines that each read the weights every step, GPUs whose bandwidth they share) of a record's topology."""
    if not topology:
        return 1, 1
    engines = int(topology.get("data_parallel") or 1) * int(topology.get("replicas") or 1)
    gpus = int(topology.get("gpus") or 1)
    return engines, max(gpus, 1)


def level_roofline(facts: dict, bandwidth: float | None, context: float, concurrency: int,
                   tpot_ms: float | None, topology: dict | None = None) -> dict:
    """One concurrency level's roofline fields (the bytes always; times only with a measured bandwidth and no
    online quantization). step_bytes is one GPU's share under the topology (module docstring)."""
    engines, gpus = engines_and_gpus(topology)
    w = facts["weights"]["total"]
    windowed = (facts.get("window_kv_bytes_per_token", 0), facts.get("sliding_window", 0))
    kv = concurrency * (facts["kv_bytes_per_token"] * context + windowed[0] * min(context, windowed[1]))
    state = concurrency * facts["state_bytes_per_sequence"]
    step = step_bytes(engines * w, facts["kv_bytes_per_token"], facts["state_bytes_per_sequence"], context,
                      concurrency, *windowed) / gpus
    out = {"context_tokens": context, "concurrency": concurrency, "weight_bytes": w, "kv_bytes": kv,
           "state_bytes": state, "step_bytes": step}
    if (engines, gpus) != (1, 1):
        out.update(engines=engines, gpus=gpus)
    out.update(roofline(step, None if facts.get("online_quantization") else bandwidth, tpot_ms))
    return out


def mean_decode_context(pairs: list[tuple[int, int]]) -> float | None:
    """Mean length of a sequence over its decode steps, over (prompt_tokens, output_tokens) of the requests: a request
    decodes from prompt to prompt + output, so its mean is prompt + output / 2."""
    return sum(p + o / 2 for p, o in pairs) / len(pairs) if pairs else None


def for_bench(model_dir: Path | None, settings: dict[str, str], gpu: bool) -> dict:
    """What a latency record carries before its levels run: the checkpoint's bytes (None for a file model such as a
    GGUF) and, on a GPU, the copy bandwidth measured now; where it is not measured, why (never a figure)."""
    from scripts.common.checkpoint import CheckpointError

    out: dict = {"bytes": None, "bytes_note": None, "bandwidth": None, "bandwidth_note": None}
    if model_dir is not None and model_dir.is_dir():
        try:
            out["bytes"] = checkpoint_bytes(model_dir, settings)
        except (RooflineError, CheckpointError, KeyError) as e:  # e.g. a layer type not modelled here
            out["bytes_note"] = f"not counted: {type(e).__name__}: {e}"
    else:
        out["bytes_note"] = "not counted: the model is not a checkpoint directory"
    if not gpu:
        out["bandwidth_note"] = "not measured: CPU record"
        return out
    try:
        out["bandwidth"] = copy_bandwidth()
    except Exception as e:  # noqa: BLE001 - any failure leaves the record without a bandwidth, and says why
        out["bandwidth_note"] = f"not measured: {type(e).__name__}: {e}"
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", nargs="?")
    p.add_argument("--context", type=float, default=0.0, help="tokens per sequence (default %(default)s)")
    p.add_argument("--concurrency", default="1", help="comma-separated batch sizes (default %(default)s)")
    p.add_argument("--bandwidth", action="store_true", help="measure this GPU's copy bandwidth too")
    p.add_argument("--refresh", type=Path, nargs="+", metavar="RECORD",
                   help="recompute the fixed levels' roofline of latency records from their own bytes, bandwidth, "
                        "topology and samples (a record taken before the formula knew its topology); the record names "
                        "the commit that recomputed it")
    return p


def refresh(path: Path) -> dict:
    """The record at `path` with every fixed level's roofline recomputed from what the record holds."""
    from scripts.common.records import git_state

    rec = json.loads(path.read_text())
    facts, bw = rec["roofline"]["bytes"], (rec["roofline"]["bandwidth"] or {}).get("bytes_per_s")
    if not facts:
        raise RooflineError(f"{path}: no bytes counted, nothing to recompute")
    for level in rec["samples"]:
        if level["mode"] != "fixed" or "concurrency" not in level:  # open-loop levels carry no roofline
            continue
        ok = [r for r in level["requests"] if r["ok"]]
        ctx = mean_decode_context([(r["prompt_tokens"], r["output_tokens"]) for r in ok])
        summary = rec["summary"]["fixed"][str(level["concurrency"])]
        summary["roofline"] = (level_roofline(facts, bw, ctx, level["concurrency"], summary.get("median_tpot_ms"),
                                              rec.get("topology")) if ctx else None)
    rec["roofline"]["levels_recomputed_by"] = git_state()
    return rec


def main(argv: list[str] | None = None) -> int:
    from scripts.common.checkpoint import CheckpointError
    from scripts.common.variants import VariantError, load_variant

    args = build_parser().parse_args(argv)
    if args.refresh:
        try:
            done = [(p, refresh(p)) for p in args.refresh]
        except (RooflineError, OSError, KeyError, ValueError) as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        for p, rec in done:  # all read and recomputed before any is written
            write_text_atomic(p, json.dumps(rec, indent=1) + "\n")
            print(f"refreshed {p}")
        return 0
    if not args.variant:
        print("error: name a variant (or --refresh RECORD...)", file=sys.stderr)
        return 2
    try:
        v = load_variant(args.variant)
        if not Path(v.model).is_dir():
            raise RooflineError(f"{v.model}: no checkpoint directory (make weights VARIANT={v.name})")
        facts = checkpoint_bytes(Path(v.model), v.resolved)
        bw = copy_bandwidth() if args.bandwidth else None
        levels = {c: level_roofline(facts, bw and bw["bytes_per_s"], args.context, int(c), None)
                  for c in args.concurrency.split(",")}
    except (RooflineError, VariantError, CheckpointError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"facts": facts, "bandwidth": bw, "levels": levels}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
