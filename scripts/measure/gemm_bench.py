"""W4A16 GEMM microbench: every 4-bit weight-only kernel we can load, on Qwen3.5's linear layers at decode batch sizes,
against the BF16 GEMM and the GPU's copy bandwidth measured in the same run (issue 60, item 2).

    python -m scripts.measure.gemm_bench --list                       # kernels and layer shapes (no GPU needed)
    python -m scripts.measure.gemm_bench --quick                      # the whole grid, ~3 min on an H200
    python -m scripts.measure.gemm_bench --kernels bf16,vllm-marlin,vllm-machete --shapes qwen35-27b --m 1,8
    python -m scripts.measure.gemm_bench --from-record RECORD --layers qkv_proj,o_proj   # its tables over those layers
    GEMM_ARGS=--quick bash scripts/gpu/device.sh gemm                 # on the lent GPU machine (scripts/gpu/README.md)

What is timed: y = x @ W^T, x of M rows in BF16 (M = 1, 2, 4, 8 by default), W (N x K) in the compressed-tensors
W4A16 form llm-compressor writes and vLLM serves: 4-bit symmetric (stored as uint4b8, q + 8), one BF16 scale per
group of 128 along K, no zero points. The shapes (N, K) are the linear layers of a Qwen3.5 text config as vLLM 0.26
merges them (layer_shapes): full-attention qkv_proj (q doubled by the output gate) and o_proj, Gated-DeltaNet
in_proj_qkvz, in_proj_ba and out_proj, the MLP's gate_up_proj and down_proj, and the output layer (lm_head; the 4B
ties it to the embedding, the 27B does not; vLLM's W4A16 recipes leave it BF16 unless a recipe names it). The 4B
config is scripts.weights.shape_proxy's QWEN35_4B_TEXT, the 27B one its QWEN35_27B_TEXT.

The kernels (--list): each W4A16 kernel class vLLM 0.26 can select (vllm/model_executor/kernels/linear/
mixed_precision), driven as vLLM drives it: CompressedTensorsWNA16.create_weights registers the checkpoint's
parameters on a module (with the kernel choice forced to that class), the packed weights and scales are copied in,
process_weights_after_loading repacks them, apply_weights is timed; a class whose can_implement refuses the shape
says why in its row. Then libraries vLLM does not pick itself: gemlite's Triton GEMV/GEMM (its own choice per M, or
one matmul type by name), torchao's int4 weight-only tensors (tinygemm's tile-packed form, and the preshuffled one
that runs MSLK's CUTLASS kernel), MSLK's and FBGEMM GenAI's bf16 x int4 GEMMs (rowwise-grouped and preshuffled),
each fed the same integers and scales, and the BF16 GEMM (torch.nn.functional.linear) on the dequantized weights.
A library that does not import (probed in a subprocess first, so a crashing extension cannot take the run down)
has its rows marked unavailable with its own one-line error.

Correctness: every kernel's output at M rows is compared with the product of the BF16 dequantized weights computed
in float32, on the first and the last copy of its weights; max |y - y_ref| / max |y_ref| above --tolerance (2e-2)
fails the row, which is then not timed. Every group of the random weights holds both ends of the int4 range, so a
library that quantizes the BF16 weights itself (torchao) recovers the same integers and scales.

Timing: the prepared weights are copied until the copies together hold --l2-multiple (4) times the GPU's L2 cache (60
MiB on an H200; at most 4096 copies, 1024 with --quick: a row where that cap binds says l2_cold false), and the calls
rotate over the copies, so every call reads its weights from HBM. After a warm-up, the
same launches are timed eagerly (one CUDA-event pair around a loop of Python calls: launch overhead included) and as
one CUDA graph (launch overhead gone); each is the median of several repetitions. Bytes per call = the W4A16 g128
weights (N*K/2), their scales (2 bytes per group), the activations read and the output written (BF16); the BF16 row
counts its 2-byte weights instead. GB/s = bytes / graph time (eager time where the graph failed); "% copy" = that
over the device-to-device copy bandwidth (scripts.measure.roofline.copy_bandwidth) measured at the start. Every
4-bit row uses the same W4A16 bytes, so GB/s ranks the kernels exactly as their times do; the bytes a kernel's own
format holds (padding, zero points) are in `state_bytes`. A model's number per (kernel, M) is total bytes / total
time over its layers, each weighted by how often a decode step calls it (the bytes-weighted harmonic mean of the
layers' GB/s), so it is the GEMM share of one decode step; a kernel missing a layer is marked partial and never
"best". Records: results/gpu-kernels/gemm_<YYYYMMDD-HHMMSS>.json (+ .md with the tables), schemas/gemm.schema.json.

--quick: 3 repetitions of at least 16 launches, and the measuring stops at --budget-s 140 (one kernel at
--kernel-budget-s 45: a JIT-compiling kernel cannot eat the run); skipped rows say so. --device cpu runs the same path
on the CPU with wall-clock eager times and no bandwidth: a functional check (the tests use it), no numbers.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from scripts.common import paths
from scripts.common import records as rec
from scripts.common.cudagraph import capture, replay_ms
from scripts.common.records import one_line
from scripts.common.server import free_port
from scripts.levers.kernels.w4a16_gemv import CHECK_TOLERANCE, GROUP  # GROUP: compressed-tensors g128
from scripts.weights.shape_proxy import QWEN35_4B_TEXT, QWEN35_27B_TEXT

KIND = "gemm"
WEIGHT_BITS = 4
TOLERANCE = CHECK_TOLERANCE  # the lab kernel's load check: every kernel passes it here
DEFAULT_M = (1, 2, 4, 8)
SHAPES = {"qwen35-4b": QWEN35_4B_TEXT, "qwen35-27b": QWEN35_27B_TEXT}
DEFAULT_OUT = paths.RESULTS / "gpu-kernels"
L2_FALLBACK = 60 * 2**20  # what torch reported on the H200 (KINDS.md); read from the device when it says
VARIANT = "gemm-w4a16-g128"  # records carry the envelope's variant field: this bench's name, not a served variant


@dataclass(frozen=True)
class Timing:
    reps: int  # timed repetitions, median reported
    min_launches: int  # launches per repetition (at least one per weight copy)
    warmup: int
    max_copies: int  # in_proj_ba of the 4B holds 90 kB: 4096 copies are 360 MB, 1024 are 90 MB (1.5 L2s)


FULL = Timing(reps=7, min_launches=64, warmup=5, max_copies=4096)
QUICK = Timing(reps=3, min_launches=16, warmup=2, max_copies=1024)
QUICK_BUDGET_S, QUICK_KERNEL_BUDGET_S = 140.0, 45.0  # --quick: ~40 s of probes and imports + the grid: ~3 min


@dataclass(frozen=True)
class Kernel:
    name: str
    library: str  # the import the kernel needs: vllm, torch, gemlite, torchao, mslk, fbgemm
    what: str
    default: bool = True
    target: str | None = None  # vLLM's class name, gemlite's matmul type, or the lab GEMV's form


KERNELS = (
    Kernel("bf16", "torch", "BF16 GEMM: torch.nn.functional.linear on the dequantized weights (the reference row)"),
    Kernel("vllm-marlin", "vllm", "vLLM MarlinLinearKernel (gptq_marlin_gemm)", target="MarlinLinearKernel"),
    Kernel("vllm-machete", "vllm", "vLLM MacheteLinearKernel (CUTLASS, Hopper)", target="MacheteLinearKernel"),
    Kernel("vllm-triton", "vllm", "vLLM TritonW4A16LinearKernel", target="TritonW4A16LinearKernel"),
    Kernel("vllm-humming", "vllm", "vLLM HummingLinearKernel (humming-kernels, JIT-built CUDA)",
           target="HummingLinearKernel"),
    Kernel("vllm-conch", "vllm", "vLLM ConchLinearKernel (conch-triton-kernels)", target="ConchLinearKernel"),
    Kernel("vllm-allspark", "vllm", "vLLM AllSparkLinearKernel", target="AllSparkLinearKernel"),
    Kernel("vllm-exllama", "vllm", "vLLM ExllamaLinearKernel (gptq_gemm)", target="ExllamaLinearKernel"),
    Kernel("vllm-cutlass-w4a8", "vllm", "vLLM CutlassW4A8LinearKernel (FP8 activations only)",
           target="CutlassW4A8LinearKernel"),
    Kernel("vllm-dynamic4bit", "vllm", "vLLM Dynamic4bitLinearKernel (CPU)", target="Dynamic4bitLinearKernel"),
    Kernel("vllm-bitblas", "vllm", "vLLM BitBLASLinearKernel (in releases before 0.26)", target="BitBLASLinearKernel"),
    Kernel("vllm-cpu", "vllm", "vLLM CPUWNA16LinearKernel (vLLM's CPU build: the functional check on a CPU)",
           default=False, target="CPUWNA16LinearKernel"),
    Kernel("gemlite", "gemlite", "gemlite GemLiteLinear, its own GEMV/GEMM choice per M (autotuned)"),
    Kernel("gemlite-gemv-revsplitk", "gemlite", "gemlite GEMV_REVSPLITK forced", default=False,
           target="GEMV_REVSPLITK"),
    Kernel("gemlite-gemv-splitk", "gemlite", "gemlite GEMV_SPLITK forced", default=False, target="GEMV_SPLITK"),
    Kernel("gemlite-gemm-splitk", "gemlite", "gemlite GEMM_SPLITK forced", default=False, target="GEMM_SPLITK"),
    Kernel("gemlite-gemm", "gemlite", "gemlite GEMM forced", default=False, target="GEMM"),
    Kernel("torchao-tinygemm", "torchao", "torchao Int4TilePackedTo4dTensor (tinygemm, aten._weight_int4pack_mm)"),
    Kernel("torchao-preshuffled", "torchao", "torchao Int4PreshuffledTensor (MSLK bf16i4bf16_shuffled)"),
    Kernel("mslk-rowwise", "mslk", "MSLK bf16i4bf16_rowwise (CUTLASS, group scales)"),
    Kernel("mslk-shuffled", "mslk", "MSLK bf16i4bf16_shuffled (preshuffled int4, Hopper)"),
    Kernel("fbgemm-rowwise", "fbgemm", "FBGEMM GenAI bf16i4bf16_rowwise"),
    Kernel("fbgemm-shuffled", "fbgemm", "FBGEMM GenAI bf16i4bf16_shuffled (preshuffled int4)"),
    Kernel("lab-gemv", "lab", "the lab's split-K W4A16 GEMV in Triton on the checkpoint's own tensors, tiles autotuned "
           "per M, N, K (scripts/levers/kernels/w4a16_gemv.py; M <= 8)", target="float32"),
    Kernel("lab-gemv-pairs", "lab", "the lab's GEMV in its pairs form: unpack and products on packed BF16 pairs in "
           "PTX, float32 sums a word (w4a16_gemv form='pairs'; M <= 8, sm_80+)", target="pairs"),
    Kernel("lab-stream-vllm", "vllm", "the lab's vLLM kernel class (plugin LAB_W4A16_KERNEL=stream): the stream form "
           "at M = 1, Marlin above, driven as vLLM drives it (scripts/levers/kernels/vllm_kernel.py)",
           target="scripts.levers.kernels.vllm_kernel:LabStreamLinearKernel"),
    Kernel("lab-gemv-stream", "lab", "the lab's GEMV in its stream form: 128-bit weight loads a step ahead, the pairs "
           "form's PTX a word, one reduction a program, one launch without split-K; tiles tuned per M, N, K as whole "
           "calls from HBM (w4a16_gemv form='stream'; written for M = 1, sm_80+)", target="stream"),
)
BY_NAME = {k.name: k for k in KERNELS}
# what imports each library (run in a subprocess first: an extension built for another torch can crash on load)
PROBES = {
    "vllm": ("vllm._custom_ops", "vllm.model_executor.kernels.linear"),
    "gemlite": ("gemlite",),
    "torchao": ("torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor",),
    "mslk": ("mslk", "mslk.quantize.shuffle"),
    "fbgemm": ("fbgemm_gpu.experimental.gen_ai",),
    "humming": ("humming", "humming.layer"),
    "conch": ("conch.ops.quantization.gemm",),
    "lab": ("triton",),
}
# kernels that need a second package (its probe decides before vLLM's own can_implement or torchao looks)
NEEDS = {"vllm-humming": "humming", "vllm-conch": "conch", "torchao-preshuffled": "mslk"}
# the kernel libraries whose versions a record names beside the lab's own (records.VERSIONED_PACKAGES)
VERSION_PACKAGES = ("gemlite", "torchao", "mslk-cuda", "fbgemm-gpu-genai", "humming-kernels", "conch-triton-kernels")


class BenchError(ValueError):
    """Bad input: one line, exit 2."""


class Unsupported(Exception):
    """The kernel refuses this shape (its own words)."""


class Unavailable(Exception):
    """The kernel's library does not import here (its own words)."""


class Interrupted(BaseException):
    """SIGTERM (the device step's timeout): the record is written with the rows so far."""


# ---------------------------------------------------------------------------------------------------------------------
# Pure parts: shapes, bytes, tolerance, aggregation, tables


def linear_layers(text: dict) -> list[tuple[str, list[int], int, int]]:
    """(name, output partition sizes, K, calls per decode step) of every linear layer a Qwen3.5 text config has, merged
    as vLLM 0.26 merges them (qwen3_next.py, qwen_gdn_linear_attn.py, qwen2_moe.py's MLP)."""
    h, inter, n_layers = text["hidden_size"], text["intermediate_size"], text["num_hidden_layers"]
    types = text.get("layer_types")
    if not types:
        every = text.get("full_attention_interval")
        types = [("full_attention" if not every or (i + 1) % every == 0 else "linear_attention")
                 for i in range(n_layers)]
    full, linear = types.count("full_attention"), types.count("linear_attention")
    if full + linear != len(types) or len(types) != n_layers:
        raise BenchError(f"layer_types: {n_layers} full_attention / linear_attention entries expected, got "
                         f"{sorted(set(types))} x {len(types)}")
    heads = text["num_attention_heads"]
    kv = text.get("num_key_value_heads") or heads
    hd = text.get("head_dim") or h // heads
    gate = 2 if text.get("attn_output_gate", True) else 1  # Qwen3.5's gated attention: q_proj outputs q and its gate
    out: list[tuple[str, list[int], int, int]] = []
    if full:
        out += [("qkv_proj", [heads * hd * gate, kv * hd, kv * hd], h, full), ("o_proj", [h], heads * hd, full)]
    if linear:
        key = text["linear_num_key_heads"] * text["linear_key_head_dim"]
        nv = text["linear_num_value_heads"]
        value = nv * text["linear_value_head_dim"]
        out += [("in_proj_qkvz", [key, key, value, value], h, linear), ("in_proj_ba", [nv, nv], h, linear),
                ("out_proj", [h], value, linear)]
    out += [("gate_up_proj", [inter, inter], h, n_layers), ("down_proj", [h], inter, n_layers),
            ("lm_head", [text["vocab_size"]], h, 1)]
    return out


def layer_shapes(text: dict) -> list[tuple[str, int, int, int]]:
    """(name, N, K, count per model) of every linear layer of a Qwen3.5 text config (linear_layers, merged outputs)."""
    return [(name, sum(parts), k, count) for name, parts, k, count in linear_layers(text)]


def call_bytes(n: int, k: int, m: int, *, weight_bits: int = WEIGHT_BITS, group_size: int | None = GROUP,
               scale_bytes: int = 2, zero_bytes: int = 0, act_bytes: int = 2, out_bytes: int = 2) -> int:
    """Bytes one y = x @ W^T call moves at least: the packed weights, the group scales (and zero points), the M x K
    activations read and the M x N output written. group_size None: no scales (a plain BF16 weight)."""
    weights = n * k * weight_bits // 8
    meta = n * (k // group_size) * (scale_bytes + zero_bytes) if group_size else 0
    return weights + meta + m * k * act_bytes + m * n * out_bytes


def bf16_call_bytes(n: int, k: int, m: int) -> int:
    return call_bytes(n, k, m, weight_bits=16, group_size=None)


def row_bytes(kernel: str, n: int, k: int, m: int) -> int:
    return bf16_call_bytes(n, k, m) if kernel == "bf16" else call_bytes(n, k, m)


def max_rel_error(y, y_ref) -> float:
    """max |y - y_ref| / max |y_ref| (float32); inf when the shapes differ, nan when y holds a NaN."""
    if tuple(y.shape) != tuple(y_ref.shape):
        return math.inf
    ref = y_ref.float()
    scale = ref.abs().max().item()
    diff = (y.float() - ref).abs().max().item()
    return diff / scale if scale else (0.0 if diff == 0 else math.inf)


def within_tolerance(err: float, tolerance: float) -> bool:
    return math.isfinite(err) and err <= tolerance


def model_level(rows: list[dict], layers: dict[str, list[tuple[str, int, int, int]]],
                copy_bw: float | None) -> list[dict]:
    """Per (kernel, shape, M): the layers' bytes and times summed, each weighted by its calls per decode step; GB/s =
    total bytes / total time (the bytes-weighted harmonic mean of the layers' GB/s), % of the copy bandwidth, and
    which layers are missing (a kernel that refused or failed a layer is partial)."""
    out = []
    seen: list[tuple[str, str, int]] = []
    for r in rows:
        key = (r["kernel"], r["shape"], r["m"])
        if key not in seen:
            seen.append(key)
    for kernel, shape, m in seen:
        mine = {r["layer"]: r for r in rows if (r["kernel"], r["shape"], r["m"]) == (kernel, shape, m)}
        ok = [(mine[name], count) for name, _, _, count in layers[shape]
              if mine.get(name, {}).get("status") == "ok" and mine[name].get("time_us")]
        missing = [name for name, _, _, _ in layers[shape] if name not in {r["layer"] for r, _ in ok}]
        total_bytes = sum(r["bytes"] * c for r, c in ok)
        total_us = sum(r["time_us"] * c for r, c in ok)
        every = sum(row_bytes(kernel, n, k, m) * c for _, n, k, c in layers[shape])
        bw = total_bytes / (total_us * 1e-6) if total_us else None
        out.append({"kernel": kernel, "shape": shape, "m": m, "step_us": total_us if ok else None,
                    "bytes": total_bytes, "gbps": bw / 1e9 if bw else None,
                    "pct_copy": 100 * bw / copy_bw if bw and copy_bw else None,
                    "coverage": total_bytes / every if every else 0.0, "complete": not missing, "missing": missing})
    bf16 = {(e["shape"], e["m"]): {r["layer"]: r for r in rows if r["kernel"] == "bf16" and r["status"] == "ok"
                                   and (r["shape"], r["m"]) == (e["shape"], e["m"])}
            for e in out if e["kernel"] == "bf16"}
    for e in out:  # x BF16: BF16's time over the same layers (and counts) / this kernel's
        ref = bf16.get((e["shape"], e["m"]), {})
        covered = [(name, c) for name, _, _, c in layers[e["shape"]] if name not in e["missing"]]
        e["x_bf16"] = (sum(ref[name]["time_us"] * c for name, c in covered) / e["step_us"]
                       if e["step_us"] and covered and all(name in ref for name, _ in covered) else None)
    return out


def composite(rows: list[dict], layers: dict[str, list[tuple[str, int, int, int]]],
              copy_bw: float | None) -> list[dict]:
    """Per (shape, M): the fastest 4-bit kernel of each layer, summed as model_level sums: what a per-layer choice of
    kernel would give (vLLM picks one class per layer type by its own order, not by speed)."""
    out = []
    for shape, m in dict.fromkeys((r["shape"], r["m"]) for r in rows):
        pick, total_bytes, total_us = {}, 0, 0.0
        for name, _, _, count in layers[shape]:
            ok = [r for r in rows if (r["shape"], r["m"], r["layer"]) == (shape, m, name) and r["kernel"] != "bf16"
                  and r["status"] == "ok" and r.get("time_us")]
            if not ok:
                pick[name] = None
                continue
            best = min(ok, key=lambda r: r["time_us"])
            pick[name] = best["kernel"]
            total_bytes += best["bytes"] * count
            total_us += best["time_us"] * count
        bw = total_bytes / (total_us * 1e-6) if total_us else None
        out.append({"shape": shape, "m": m, "per_layer": pick, "step_us": total_us or None,
                    "gbps": bw / 1e9 if bw else None, "pct_copy": 100 * bw / copy_bw if bw and copy_bw else None,
                    "complete": all(pick.values())})
    return out


def best_per_shape(models: list[dict]) -> list[dict]:
    """Per (shape, M): the 4-bit kernel with the highest model-level GB/s among those that ran every layer."""
    out = []
    for shape, m in dict.fromkeys((e["shape"], e["m"]) for e in models):
        cands = [e for e in models if (e["shape"], e["m"]) == (shape, m) and e["kernel"] != "bf16"
                 and e["complete"] and e["gbps"]]
        best = max(cands, key=lambda e: e["gbps"]) if cands else None
        out.append({"shape": shape, "m": m, "kernel": best and best["kernel"], "gbps": best and best["gbps"],
                    "pct_copy": best and best["pct_copy"], "x_bf16": best and best["x_bf16"],
                    "step_us": best and best["step_us"]})
    return out


def _gbps(v: float | None) -> str:
    return "—" if not v else f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def _cell(e: dict | None) -> str:
    if not e or not e.get("gbps"):
        return "—"
    pct = f" ({e['pct_copy']:.0f}%)" if e.get("pct_copy") is not None else ""
    return f"{_gbps(e['gbps'])}{pct}{'' if e.get('complete', True) else '*'}"


def _picks(by_layer: dict[str, str]) -> str:
    """vLLM's own class per layer, grouped: "Machete: qkv_proj, o_proj; Marlin: in_proj_ba"."""
    groups: dict[str, list[str]] = {}
    for layer, pick in by_layer.items():
        name = "none" if pick.startswith("none") else pick.removesuffix("LinearKernel")
        groups.setdefault(name, []).append(layer)
    return "; ".join(f"{k}: {', '.join(v)}" for k, v in groups.items()) or "—"


def markdown(models: list[dict], best: list[dict], comp: list[dict], *, gpu: str, copy_bw: float | None,
             vllm_pick: dict | None = None) -> str:
    """The record's tables: model-level GB/s (% of copy bandwidth) per kernel x (shape, M), then the best kernel per
    (shape, M) beside the per-layer composite and vLLM's own pick."""
    cols = list(dict.fromkeys((e["shape"], e["m"]) for e in models))
    bw = f"{copy_bw / 1e12:.2f} TB/s" if copy_bw else "not measured"
    lines = [f"W4A16 g128 GEMMs on {gpu}; device-to-device copy bandwidth {bw}. Cells: model-level GB/s (total bytes / "
             "total time over the model's linear layers, each weighted by its calls per decode step) and % of the "
             "copy bandwidth; * = some layers missing (refused or failed: see the record's rows).", "",
             "| kernel | " + " | ".join(f"{s} M={m}" for s, m in cols) + " |", "| --- |" + " --- |" * len(cols)]
    for kernel in dict.fromkeys(e["kernel"] for e in models):
        by = {(e["shape"], e["m"]): e for e in models if e["kernel"] == kernel}
        if not any(e["gbps"] for e in by.values()):
            continue
        label = f"{kernel} (reference)" if kernel == "bf16" else kernel
        lines.append(f"| {label} | " + " | ".join(_cell(by.get(c)) for c in cols) + " |")
    comp_by = {(c["shape"], c["m"]): c for c in comp}
    lines += ["", "| shape | M | best kernel (every layer) | GB/s | % copy | × BF16 | per-layer best, composite GB/s "
              "(% copy) | vLLM's own pick |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b in best:
        c = comp_by.get((b["shape"], b["m"]))
        gbps = _gbps(b["gbps"])
        pct = f"{b['pct_copy']:.0f}" if b["pct_copy"] is not None else "—"
        x_bf16 = f"{b['x_bf16']:.2f}" if b["x_bf16"] else "—"
        lines.append(f"| {b['shape']} | {b['m']} | {b['kernel'] or '—'} | {gbps} | {pct} | {x_bf16} | {_cell(c)} | "
                     f"{_picks((vllm_pick or {}).get(b['shape'], {}))} |")
    return "\n".join(lines) + "\n"


def parse_list(text: str, what: str) -> list[str]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise BenchError(f"--{what}: empty list")
    return list(dict.fromkeys(items))


def resolve_kernels(text: str) -> list[str]:
    names: list[str] = []
    for item in parse_list(text, "kernels"):
        if item in ("default", "all"):
            names += [k.name for k in KERNELS if item == "all" or k.default]
        elif item in BY_NAME:
            names.append(item)
        else:
            raise BenchError(f"unknown kernel {item!r}; known: default, all, {', '.join(BY_NAME)}")
    return list(dict.fromkeys(names))


def resolve_m(text: str) -> list[int]:
    try:
        ms = [int(x) for x in parse_list(text, "m")]
    except ValueError:
        raise BenchError(f"--m {text!r}: comma-separated positive integers expected") from None
    if any(m < 1 for m in ms):
        raise BenchError(f"--m {text!r}: batch sizes must be at least 1")
    return ms


# ---------------------------------------------------------------------------------------------------------------------
# GPU parts (torch and the libraries are imported inside)


class Weights:
    """A layer's W4A16 weights: q (N x K int8 in [-8, 7]) and one BF16 scale per group of 128 (N x K/128). Every group
    holds both -8 and 7, so a library's own quantizer (min/max or absmax) recovers exactly these q and scales."""

    def __init__(self, n: int, k: int, parts: list[int], seed: int, device: str = "cuda"):
        import torch

        if k % GROUP:
            raise Unsupported(f"K={k} is not a multiple of the group size {GROUP}")
        self.n, self.k, self.parts, self.device = n, k, list(parts), device
        g = torch.Generator(device=device).manual_seed(seed)
        self.q = torch.randint(-8, 8, (n, k), generator=g, device=device, dtype=torch.int8)
        self.q[:, 0::GROUP], self.q[:, 1::GROUP] = -8, 7
        self.s = (torch.rand((n, k // GROUP), generator=g, device=device) * 0.01 + 0.005).to(torch.bfloat16)
        self._bf16 = None

    def _rows(self) -> int:
        return max(1, (1 << 26) // self.k)  # 64 M elements per chunk: big layers dequantize in pieces

    def bf16(self):
        """The dequantized weights in BF16 (N x K), cached."""
        import torch

        if self._bf16 is None:
            w = torch.empty((self.n, self.k), dtype=torch.bfloat16, device=self.device)
            for lo in range(0, self.n, self._rows()):
                hi = min(self.n, lo + self._rows())
                w[lo:hi] = (self.q[lo:hi].float() * self.s[lo:hi].float().repeat_interleave(GROUP, dim=1)).bfloat16()
            self._bf16 = w
        return self._bf16

    def reference(self, x):
        """x @ W^T with the BF16 dequantized weights, in float32."""
        import torch

        w, xf = self.bf16(), x.float()
        y = torch.empty((x.shape[0], self.n), dtype=torch.float32, device=self.device)
        for lo in range(0, self.n, self._rows()):
            hi = min(self.n, lo + self._rows())
            y[:, lo:hi] = xf @ w[lo:hi].float().T
        return y

    def uint4b8(self):
        """q + 8 as uint8 (N x K): the stored form of symmetric 4-bit weights (vLLM's scalar type uint4b8)."""
        import torch

        return (self.q + 8).to(torch.uint8)


def pack_compressed_tensors(q):
    """compressed-tensors' pack-quantized layout of symmetric 4-bit weights (vLLM's `weight_packed`): uint4b8 values
    (q + 8), eight consecutive inputs per int32, input j of each eight at bits 4j; N x K/8 int32."""
    import torch

    n, k = q.shape
    out = torch.empty((n, k // 8), dtype=torch.int32, device=q.device)
    rows = max(1, (1 << 25) // k)
    for lo in range(0, n, rows):
        u = q[lo:lo + rows].to(torch.int64) + 8
        packed = sum(u[:, j::8] << (4 * j) for j in range(8))
        out[lo:lo + rows] = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return out


def pack_int4(q):
    """Two signed 4-bit values per int8 along K, the even input in the low nibble (MSLK's and FBGEMM's pack_int4)."""
    import torch

    low, high = q[:, ::2], q[:, 1::2]
    return torch.bitwise_or(torch.bitwise_and(low, 0xF), torch.bitwise_left_shift(high, 4)).contiguous()


def state_bytes(obj) -> int:
    """Bytes of every tensor a prepared kernel holds (its weights in its own format, padding included)."""
    import torch

    if isinstance(obj, torch.nn.Module):
        seen = {id(t): t for t in [*obj.parameters(), *obj.buffers()] if t is not None}
        seen.update({id(v): v for v in vars(obj).values() if isinstance(v, torch.Tensor)})
        return sum(state_bytes(t) for t in seen.values())
    if isinstance(obj, torch.Tensor):
        if type(obj) not in (torch.Tensor, torch.nn.Parameter) and hasattr(obj, "__tensor_flatten__"):
            names, _ = obj.__tensor_flatten__()
            return sum(state_bytes(getattr(obj, n)) for n in names if getattr(obj, n, None) is not None)
        return obj.numel() * obj.element_size()
    if isinstance(obj, (tuple, list)):
        return sum(state_bytes(o) for o in obj)
    return 0


def clone_module(m):
    """A copy of a prepared module whose tensors are new (parameters, buffers, tensor attributes) and whose other
    attributes are shared (kernel settings); methods bound to the original are bound to the copy."""
    import copy
    import types

    import torch

    new = copy.copy(m)
    new._parameters = {k: (None if p is None else torch.nn.Parameter(p.detach().clone(), requires_grad=False))
                       for k, p in m._parameters.items()}
    new._buffers = {k: (None if b is None else b.clone()) for k, b in m._buffers.items()}
    new._modules = {k: (None if c is None else clone_module(c)) for k, c in m._modules.items()}
    for k, v in vars(m).items():
        if k.startswith("_"):
            continue
        if isinstance(v, torch.Tensor):
            new.__dict__[k] = v.clone()
        elif isinstance(v, types.MethodType) and v.__self__ is m:
            new.__dict__[k] = types.MethodType(v.__func__, new)
    return new


def clone_tensors(state):
    return tuple(t.clone() for t in state)


@dataclass
class Prepared:
    state: Any
    run: Any  # (state, x) -> y
    clone: Any  # state -> a copy with its own tensors
    tile: Any = None  # (m, n, k) -> the tile a self-tuning kernel chose, or None


@dataclass
class Env:
    """What the run found: torch, the GPU's capability, the libraries that import and the vLLM glue."""

    device: str = "cuda"
    capability: int = 0
    missing: dict[str, str] = field(default_factory=dict)  # library -> why it does not import
    notes: list[str] = field(default_factory=list)
    vllm_ready: bool = False
    copy_bw: float | None = None  # bytes / s, read + written
    keep: list = field(default_factory=list)  # context managers left open for the run


def vllm_parallel_state(env: Env) -> None:
    """vLLM's parameters ask the tensor-parallel group for their rank: a one-process group, as vLLM's kernel tests set
    up (a default VllmConfig current); where that fails, rank 0 of 1 is patched into vllm.model_executor.parameter."""
    if env.vllm_ready:
        return
    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel

        cm = set_current_vllm_config(VllmConfig())
        cm.__enter__()
        env.keep.append(cm)
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
        env.notes.append("vLLM: one-process tensor-parallel group (gloo) under a default VllmConfig")
    except Exception as e:  # noqa: BLE001 - fall back and say so
        import vllm.model_executor.parameter as vp

        vp.get_tensor_model_parallel_rank = lambda: 0
        vp.get_tensor_model_parallel_world_size = lambda: 1
        env.notes.append(f"vLLM's distributed init failed ({one_line(e)}): tensor-parallel rank 0 of 1 patched into "
                         "vllm.model_executor.parameter")
    env.vllm_ready = True


def mp_config(n: int, k: int):
    """vLLM's MPLinearLayerConfig of a compressed-tensors W4A16 g128 layer (CompressedTensorsWNA16.create_weights)."""
    import dataclasses

    import torch
    from vllm.model_executor.kernels.linear import MPLinearLayerConfig
    from vllm.scalar_type import scalar_types

    extra = {"has_g_idx": False} if "has_g_idx" in {f.name for f in dataclasses.fields(MPLinearLayerConfig)} else {}
    return MPLinearLayerConfig(full_weight_shape=(k, n), partition_weight_shape=(k, n),
                               weight_type=scalar_types.uint4b8, act_type=torch.bfloat16, group_size=GROUP,
                               zero_points=False, **extra)


def vllm_pick(n: int, k: int) -> str:
    """The class vLLM 0.26 itself chooses for this layer (choose_mp_linear_kernel), or its refusal."""
    from vllm.model_executor.kernels.linear import choose_mp_linear_kernel

    try:
        return choose_mp_linear_kernel(mp_config(n, k)).__name__
    except Exception as e:  # noqa: BLE001 - vLLM's own words
        return f"none: {one_line(e, 160)}"


def vllm_layer(kernel_cls, w: Weights, device: str = "cuda"):
    """A module holding w exactly as vLLM loads a compressed-tensors W4A16 layer with kernel_cls chosen: the scheme's
    create_weights registers weight_packed (N x K/8 int32), weight_scale (N x K/128) and weight_shape, the
    checkpoint's values are copied in, and the kernel repacks them (process_weights_after_loading)."""
    import torch
    from vllm.model_executor.layers.quantization.compressed_tensors.schemes import compressed_tensors_wNa16 as wna16

    scheme = wna16.CompressedTensorsWNA16(strategy="group", num_bits=WEIGHT_BITS, group_size=GROUP, symmetric=True)
    layer = torch.nn.Module()
    chosen = wna16.choose_mp_linear_kernel
    wna16.choose_mp_linear_kernel = lambda *_a, **_k: kernel_cls  # the one class under test, as --linear-backend does
    try:
        with torch.device(device):
            scheme.create_weights(layer=layer, output_size=w.n, input_size=w.k, output_partition_sizes=list(w.parts),
                                  input_size_per_partition=w.k, params_dtype=torch.bfloat16,
                                  weight_loader=lambda *_a, **_k: None)
    finally:
        wna16.choose_mp_linear_kernel = chosen
    layer.input_size, layer.output_size = w.k, w.n  # what a LinearBase carries besides (humming reads them)
    with torch.no_grad():
        layer.weight_packed.data.copy_(pack_compressed_tensors(w.q))
        layer.weight_scale.data.copy_(w.s)
        layer.weight_shape.data.copy_(torch.tensor([w.n, w.k], dtype=torch.int64))
    scheme.process_weights_after_loading(layer)
    return scheme, layer


def prepare_vllm(kernel: Kernel, w: Weights, env: Env) -> Prepared:
    import vllm.model_executor.kernels.linear as lin

    if ":" in (kernel.target or ""):  # a class the lab's plugin registers: module:Class
        module, _, name = kernel.target.partition(":")
        cls = getattr(importlib.import_module(module), name, None)
    else:
        cls = getattr(lin, kernel.target or "", None)
    if cls is None:
        import vllm

        raise Unsupported(f"vLLM {vllm.__version__} has no {kernel.target}")
    if env.capability and cls.get_min_capability() > env.capability:
        raise Unsupported(f"{cls.__name__} requires capability {cls.get_min_capability()}, this GPU has "
                          f"{env.capability}")
    ok, why = cls.can_implement(mp_config(w.n, w.k))
    if not ok:
        raise Unsupported(f"can_implement: {why}")
    vllm_parallel_state(env)
    scheme, layer = vllm_layer(cls, w, env.device)
    # the CPU build vLLM loads on an AVX2-only EPYC lacks the op (2026-12-07): a refusal, not a failure of the kernel
    if cls.__name__ == "CPUWNA16LinearKernel" and not cpu_wna16_built():
        raise Unsupported("vLLM's CPU build loaded on this CPU has no _C.cpu_gemm_wna16")
    return Prepared(layer, lambda layer, x: scheme.apply_weights(layer, x, None), clone_module)


def cpu_wna16_built() -> bool:
    """Whether the vLLM CPU library loaded here registers the W4A16 GEMM CPUWNA16LinearKernel calls."""
    import torch

    return hasattr(torch.ops._C, "cpu_gemm_wna16")


def prepare_bf16(kernel: Kernel, w: Weights, env: Env) -> Prepared:
    import torch

    return Prepared(w.bf16(), lambda weight, x: torch.nn.functional.linear(x, weight), lambda t: t.clone())


def prepare_gemlite(kernel: Kernel, w: Weights, env: Env) -> Prepared:
    from gemlite import DType, GemLiteLinear

    layer = GemLiteLinear(WEIGHT_BITS, group_size=GROUP, in_features=w.k, out_features=w.n,
                          input_dtype=DType.BF16, output_dtype=DType.BF16)
    layer.pack(w.uint4b8(), w.s, 8, None)  # W = (W_q - 8) * scales: the uint4b8 form, gemlite's W_group_mode 3
    if kernel.target:
        def run(m, x):
            return m.forward_manual(x, kernel.target)
    else:
        def run(m, x):
            return m.forward_auto_no_warmup(x)  # GemLiteLinear's forward: its matmul type for this M
    return Prepared(layer, run, clone_module)


def prepare_torchao(kernel: Kernel, w: Weights, env: Env) -> Prepared:
    """torchao's int4 weight-only tensors as Int4WeightOnlyConfig(group_size=128, int4_packing_format=...) builds
    them (_int4_weight_only_quantize_tensor: from_hp on the BF16 weight), called through F.linear."""
    import torch

    F = torch.nn.functional
    if kernel.name == "torchao-tinygemm":
        from torchao.quantization.quantize_.workflows.int4.int4_tile_packed_to_4d_tensor import (
            Int4TilePackedTo4dTensor as T,
        )

        t = T.from_hp(w.bf16(), [1, GROUP])

        def clone(t):
            return T(t.qdata.clone(), t.scale_and_zero.clone(), t.block_size, t.shape, None)
    else:
        from torchao.quantization.quantize_.workflows.int4.int4_preshuffled_tensor import Int4PreshuffledTensor as T

        t = T.from_hp(w.bf16(), [1, GROUP], activation_dtype=torch.bfloat16)

        def clone(t):
            return T(t.qdata.clone(), t.group_scale.clone(), t.block_size, t.shape,
                     group_zero=None if t.group_zero is None else t.group_zero.clone(), row_scale=None)
    return Prepared(t, lambda weight, x: F.linear(x, weight), clone)


def prepare_meta(kernel: Kernel, w: Weights, env: Env) -> Prepared:
    """MSLK's / FBGEMM GenAI's bf16 x int4 GEMMs on these q and scales: int4 packed two per byte (pack_int4), scales
    and zero points K/128 x N in BF16 (w = q * scale + zero, zero 0); the preshuffled form through preshuffle_i4, as
    their quantize_int4_preshuffle(dtype="bf16") does after quantizing."""
    import torch

    if kernel.library == "mslk":
        import mslk  # noqa: F401 - registers torch.ops.mslk
    else:
        import fbgemm_gpu.experimental.gen_ai  # noqa: F401 - registers torch.ops.fbgemm
    ops = getattr(torch.ops, kernel.library)
    wq, scale = pack_int4(w.q), w.s.t().contiguous()
    zero = torch.zeros_like(scale)
    if kernel.name.endswith("shuffled"):
        wq, scale = ops.preshuffle_i4(wq, scale)
        fn = ops.bf16i4bf16_shuffled
    else:
        fn = ops.bf16i4bf16_rowwise
    return Prepared((wq, scale, zero), lambda st, x: fn(x, *st), clone_tensors)


def prepare_lab(kernel: Kernel, w: Weights, env: Env) -> Prepared:
    """The lab's GEMV on the checkpoint's tensors as vLLM loads them (weight_packed, weight_scale): no repacking."""
    from scripts.levers.kernels.w4a16_gemv import interpreted, stream_tile, w4a16_gemv

    if env.device != "cuda" and not interpreted():
        raise Unsupported("a Triton kernel: on a CPU only under TRITON_INTERPRET=1 (set before Triton is imported)")
    return Prepared((pack_compressed_tensors(w.q), w.s.clone()), lambda st, x: w4a16_gemv(x, *st, form=kernel.target),
                    clone_tensors, tile=stream_tile if kernel.target == "stream" else None)


PREPARE = {"vllm": prepare_vllm, "torch": prepare_bf16, "gemlite": prepare_gemlite, "torchao": prepare_torchao,
           "mslk": prepare_meta, "fbgemm": prepare_meta, "lab": prepare_lab}


def probe_libraries(libraries: list[str], timeout_s: float = 180.0) -> dict[str, str]:
    """{library: why it does not import} for those whose import fails or crashes in a fresh interpreter (all at once)."""
    procs = {lib: subprocess.Popen([sys.executable, "-c", "import " + ", ".join(PROBES[lib])], stdout=subprocess.DEVNULL,
                                   stderr=subprocess.PIPE, text=True) for lib in libraries}
    missing = {}
    for lib, p in procs.items():
        try:
            _, err = p.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.kill()
            missing[lib] = f"import did not finish in {timeout_s:.0f} s"
            continue
        if p.returncode < 0:
            missing[lib] = f"the import crashed (signal {-p.returncode})"
        elif p.returncode:
            lines = [x.strip() for x in err.splitlines() if x.strip()]
            errs = [x for x in lines if "Error" in x.split(":")[0] or x.startswith(("OSError", "ImportError"))]
            missing[lib] = (errs or lines or ["import failed"])[-1][:300]
    return missing


def time_calls(call, launches: int, timing: Timing, device: str = "cuda") -> dict:
    """Eager and CUDA-graph time per call (us) of call(0..launches-1), medians of timing.reps repetitions (on the CPU:
    wall-clock eager time only, a functional check)."""
    import torch

    for i in range(timing.warmup):
        call(i)
    if device == "cpu":
        eager = []
        for _ in range(timing.reps):
            t0 = time.perf_counter()
            for i in range(launches):
                call(i)
            eager.append((time.perf_counter() - t0) * 1e6 / launches)
        return {"eager_us": statistics.median(eager), "eager_us_reps": eager, "graph_us": None,
                "graph_error": "no CUDA graph on the CPU"}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    eager = []
    for _ in range(timing.reps):
        start.record()
        for i in range(launches):
            call(i)
        end.record()
        end.synchronize()
        eager.append(start.elapsed_time(end) * 1e3 / launches)
    out: dict[str, Any] = {"eager_us": statistics.median(eager), "eager_us_reps": eager, "graph_us": None}
    graph = None
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for i in range(min(3, launches)):
                call(i)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = capture(lambda: [call(i) for i in range(launches)])
        times = [ms * 1e3 / launches for ms in replay_ms(graph, timing.reps)]
        out.update(graph_us=statistics.median(times), graph_us_reps=times)
    except Exception as e:  # noqa: BLE001 - eager time stands; the row says why there is no graph time
        out["graph_error"] = one_line(e)
        torch.cuda.synchronize()
    finally:
        del graph
    return out


def l2_bytes(device: str = "cuda") -> int:
    import torch

    if device != "cuda":
        return L2_FALLBACK
    return int(getattr(torch.cuda.get_device_properties(0), "L2_cache_size", 0) or L2_FALLBACK)


def empty_cache(env: Env) -> None:
    import torch

    if env.device == "cuda":
        torch.cuda.empty_cache()


@dataclass
class Plan:
    kernels: list[str]
    shapes: list[str]
    ms: list[int]
    timing: Timing
    tolerance: float
    l2_multiple: float
    budget_s: float | None
    kernel_budget_s: float | None
    seed: int
    device: str = "cuda"


def bench_layer(plan: Plan, env: Env, shape: str, layer: tuple[str, list[int], int, int], spent: dict[str, float],
                t_start: float, rotate_bytes: int, emit, log) -> None:
    """Every kernel of the plan on one layer: prepare, copies, correctness per M, timing per M; each row to emit."""
    import torch

    name, parts, k, count = layer
    n = sum(parts)
    base = {"shape": shape, "layer": name, "n": n, "k": k, "count": count}

    def row(kernel: Kernel, m: int, status: str, reason: str | None = None, **kw) -> dict:
        return {"kernel": kernel.name, "library": kernel.library, **base, "m": m, "status": status, "reason": reason,
                "bytes": row_bytes(kernel.name, n, k, m), "graph_us": None, "eager_us": None, "time_us": None,
                "gbps": None, "pct_copy": None, "max_rel_err": None, **kw}

    seed = plan.seed + 7919 * (list(SHAPES).index(shape) + 1) + sum(map(ord, name))
    w = Weights(n, k, parts, seed, env.device)
    g = torch.Generator(device=env.device).manual_seed(seed + 1)
    xs = {m: torch.randn((m, k), generator=g, device=env.device).to(torch.bfloat16) for m in plan.ms}
    refs = {m: w.reference(x) for m, x in xs.items()}
    rows: list[dict] = []

    def add(*new: dict) -> None:
        rows.extend(new)
        for r in new:
            emit(r)

    for kname in plan.kernels:
        kernel = BY_NAME[kname]
        t0 = time.monotonic()
        over = (plan.budget_s is not None and t0 - t_start > plan.budget_s)
        over_k = plan.kernel_budget_s is not None and spent.get(kname, 0.0) > plan.kernel_budget_s
        if over or over_k:
            why = (f"time budget spent (--budget-s {plan.budget_s:g})" if over else
                   f"kernel time budget spent (--kernel-budget-s {plan.kernel_budget_s:g})")
            add(*(row(kernel, m, "skipped", why) for m in plan.ms))
            continue
        missing = next((f"{lib}: {env.missing[lib]}" for lib in (kernel.library, NEEDS.get(kname)) if lib in env.missing),
                       None)
        if missing:
            add(*(row(kernel, m, "unavailable", missing) for m in plan.ms))
            continue
        states: list = []
        try:
            prep = PREPARE[kernel.library](kernel, w, env)
            states = [prep.state]
            size = state_bytes(prep.state)
            copies = max(2, min(plan.timing.max_copies, math.ceil(rotate_bytes / max(size, 1))))
            states += [prep.clone(prep.state) for _ in range(copies - 1)]
            launches = max(copies, plan.timing.min_launches)
        except (Unsupported, Unavailable) as e:
            status = "unsupported" if isinstance(e, Unsupported) else "unavailable"
            add(*(row(kernel, m, status, str(e)[:300]) for m in plan.ms))
            spent[kname] = spent.get(kname, 0.0) + time.monotonic() - t0
            continue
        except Exception as e:  # noqa: BLE001 - the library's own words, one line
            add(*(row(kernel, m, "failed", f"prepare: {one_line(e)}") for m in plan.ms))
            states = []
            _check_context(env)
            empty_cache(env)
            spent[kname] = spent.get(kname, 0.0) + time.monotonic() - t0
            continue
        # l2_cold: the copies together hold the rotation's bytes (every call reads HBM); false where max_copies capped
        extra = {"state_bytes": size, "copies": copies, "launches": launches, "l2_cold": copies * size >= rotate_bytes}
        done = []
        for m in plan.ms:
            x = xs[m]
            try:
                with torch.no_grad():  # the first and the last copy: a copy that shares or lost data shows here
                    errs = [max_rel_error(prep.run(states[0], x), refs[m]),
                            max_rel_error(prep.run(states[-1], x), refs[m])]
                err = max(errs) if all(math.isfinite(e) for e in errs) else math.nan
                if not within_tolerance(err, plan.tolerance):
                    add(row(kernel, m, "failed", f"max relative error {err:.3g} > tolerance {plan.tolerance:g}"
                            if math.isfinite(err) else "output has NaN/inf or the wrong shape",
                            max_rel_err=err if math.isfinite(err) else None, **extra))
                    done.append(f"M={m} wrong ({err:.2g})")
                    continue
                with torch.no_grad():
                    t = time_calls(lambda i, x=x, f=prep.run, st=states: f(st[i % len(st)], x), launches, plan.timing,
                                   env.device)
                us = t["graph_us"] or t["eager_us"]
                bw = row_bytes(kname, n, k, m) / (us * 1e-6)
                tile = prep.tile and prep.tile(m, n, k)
                add(row(kernel, m, "ok", t.get("graph_error") and f"no graph time: {t['graph_error']}",
                                graph_us=t["graph_us"], eager_us=t["eager_us"], time_us=us, gbps=bw / 1e9,
                                pct_copy=100 * bw / env.copy_bw if env.copy_bw else None,
                                max_rel_err=err, graph_us_reps=t.get("graph_us_reps"),
                                eager_us_reps=t["eager_us_reps"], **extra, **({"tile": str(tile)} if tile else {})))
                pct = f" {rows[-1]['pct_copy']:.0f}%" if rows[-1]["pct_copy"] is not None else ""
                done.append(f"M={m} {us:.1f} us {bw / 1e9:,.0f} GB/s{pct}")
            except torch.cuda.OutOfMemoryError as e:
                add(row(kernel, m, "failed", one_line(e), **extra))
                done.append(f"M={m} out of memory")
                empty_cache(env)
            except Exception as e:  # noqa: BLE001 - one row fails, the run goes on
                add(row(kernel, m, "failed", one_line(e), **extra))
                done.append(f"M={m} failed")
                _check_context(env)
        log(f"{shape} {name} (N={n}, K={k}) {kname} [{copies} copies]: " + "; ".join(done))
        del states, prep
        empty_cache(env)
        spent[kname] = spent.get(kname, 0.0) + time.monotonic() - t0
    for kname in plan.kernels:  # one line for a kernel that did not run on this layer (unavailable: said once before)
        first = next((r for r in rows if r["kernel"] == kname), None)
        if first and (first["status"] in ("unsupported", "skipped") or (first["reason"] or "").startswith("prepare:")):
            log(f"{shape} {name} {kname}: {first['status']}: {first['reason']}")


class ContextLost(RuntimeError):
    pass


def _check_context(env: Env) -> None:
    """After a kernel raised: a CUDA error that poisons the context (an illegal address) ends the run."""
    import torch

    if env.device != "cuda":
        return
    try:
        torch.cuda.synchronize()
    except Exception as e:  # noqa: BLE001
        raise ContextLost(f"the CUDA context is unusable after a kernel's error ({one_line(e)})") from None


def versions() -> dict[str, str]:
    out = rec.versions(VERSION_PACKAGES)
    try:
        import torch

        out["torch_build"] = f"{torch.__version__} (CUDA {torch.version.cuda})"
    except ImportError:
        pass
    return out


def new_record(command: list[str], plan: Plan) -> dict:
    """The lab's record envelope (scripts/common/records.py) for a bench that measures no served variant: variant is
    the bench's name, config names the shapes, command.server is null."""
    return {
        "schema": {"kind": KIND, "version": rec.SCHEMA_VERSIONS[KIND]},
        "variant": VARIANT,
        "config": {"MODEL": "config-only:" + ",".join(plan.shapes), "BASE": "qwen35", "GROUP_SIZE": str(GROUP),
                   "WEIGHT_BITS": str(WEIGHT_BITS)},
        "shape_proxy": True,  # random weights, exact shapes: speed only
        "command": {"measure": list(command), "server": None},
        "git": rec.git_state(),
        "versions": versions(),
        "hardware": rec.hardware(),
        "started_at": rec.now_utc().isoformat(timespec="seconds"),
        "duration_s": None,
        "inputs": {
            "shapes": {s: [list(x) for x in layer_shapes(SHAPES[s])] for s in plan.shapes},
            "m": plan.ms, "kernels": plan.kernels, "group_size": GROUP, "weight_bits": WEIGHT_BITS,
            "symmetric": True, "tolerance": plan.tolerance, "l2_multiple": plan.l2_multiple, "l2_bytes": None,
            "rotate_bytes": None,
            "timing": {"reps": plan.timing.reps, "min_launches": plan.timing.min_launches,
                       "warmup": plan.timing.warmup, "quick": plan.timing == QUICK},
            "budget_s": plan.budget_s, "kernel_budget_s": plan.kernel_budget_s, "seed": plan.seed,
            "device": plan.device,
            "bytes_rule": "W4A16 g128: N*K/2 + 2 B per group + M*K*2 + M*N*2 (BF16 row: N*K*2 + M*K*2 + M*N*2)",
        },
        "bandwidth": None,
        "bandwidth_note": None,
        "kernels": {},
        "samples": [],
        "summary": {},
        "status": "ok",
        "failure": None,
    }


def only_layers(layers: dict[str, list[tuple[str, int, int, int]]],
                names: list[str]) -> dict[str, list[tuple[str, int, int, int]]]:
    """The shapes' layers restricted to `names` (e.g. those a served recipe holds in 4 bits: gptq-w4a16-gdn leaves
    in_proj_ba and the output layer in BF16); BenchError naming one that no shape has."""
    known = {name for shape in layers.values() for name, *_ in shape}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise BenchError(f"--layers: {', '.join(unknown)} is no layer of this record; its layers: "
                         f"{', '.join(sorted(known))}")
    return {s: [x for x in v if x[0] in names] for s, v in layers.items()}


def summarize(record: dict, names: list[str] | None = None) -> str:
    """Fill the record's summary from its rows; the markdown tables. `names`: only those layers are summed (the
    summary then says so)."""
    copy_bw = (record.get("bandwidth") or {}).get("bytes_per_s")
    layers = {s: [tuple(x) for x in v] for s, v in record["inputs"]["shapes"].items()}
    if names:
        layers = only_layers(layers, names)
    models = model_level(record["samples"], layers, copy_bw)
    best, comp = best_per_shape(models), composite(record["samples"], layers, copy_bw)
    record["summary"] = {"copy_bandwidth_bytes_per_s": copy_bw, "models": models, "best": best, "composite": comp,
                         "vllm_pick": record["summary"].get("vllm_pick", {}), **({"layers": names} if names else {})}
    gpu = (record["hardware"].get("gpu") or {}).get("name", "no GPU")
    picks = {shape: {layer: k for layer, k in by.items() if not names or layer in names}
             for shape, by in record["summary"]["vllm_pick"].items()}
    table = markdown(models, best, comp, gpu=gpu, copy_bw=copy_bw, vllm_pick=picks)
    return f"Only the layers {', '.join(names)}.\n\n{table}" if names else table


def resummarize(path: Path, names: list[str] | None) -> str:
    """A written record's tables again, over `names` only where given (nothing is written)."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise BenchError(f"--from-record {path}: unreadable ({one_line(e)})") from None
    try:
        return summarize(record, names)
    except BenchError:
        raise
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise BenchError(f"--from-record {path}: not a gemm_bench record ({e.__class__.__name__}: {one_line(e)}); "
                         f"records are results/gpu-kernels*/gemm_*.json") from None


def require_device(device: str) -> None:
    """BenchError unless torch imports and (device cuda) sees a GPU; checked before any record is started."""
    try:
        import torch
    except ImportError as e:
        raise BenchError(f"torch does not import ({one_line(e)}): the GEMM bench needs torch and a CUDA GPU") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise BenchError("no CUDA device: the GEMM bench needs a GPU (--list shows the plan without one)")


def run(plan: Plan, record: dict, out_dir: Path, log) -> None:
    """The measurement: fills record (bandwidth, kernels, vllm_pick, rows). Raises Interrupted or ContextLost, with
    the rows measured so far already in the record."""
    import torch

    from scripts.measure.roofline import copy_bandwidth

    env = Env(device=plan.device)
    if env.device == "cuda":
        major, minor = torch.cuda.get_device_capability()
        env.capability = major * 10 + minor
    libraries = sorted({BY_NAME[k].library for k in plan.kernels} - {"torch"}
                       | {NEEDS[k] for k in plan.kernels if k in NEEDS})
    if libraries:
        log(f"probing imports: {', '.join(libraries)}")
        env.missing = probe_libraries(libraries)
    for lib in libraries:  # the in-process import (vLLM sets itself up; torchao and gemlite log at import)
        if lib in env.missing or lib in ("humming", "conch"):  # those two vLLM imports itself
            continue
        try:
            for module in PROBES[lib]:
                importlib.import_module(module)
        except Exception as e:  # noqa: BLE001
            env.missing[lib] = one_line(e)
    record["kernels"] = {k: {"library": BY_NAME[k].library, "what": BY_NAME[k].what,
                             "available": BY_NAME[k].library not in env.missing and NEEDS.get(k) not in env.missing,
                             "error": env.missing.get(BY_NAME[k].library) or env.missing.get(NEEDS.get(k, ""))}
                         for k in plan.kernels}
    for lib, why in env.missing.items():
        log(f"unavailable: {lib}: {why}")
    try:
        if env.device != "cuda":
            raise BenchError("a CPU run (--device cpu) is a functional check; its times mean nothing")
        bw = copy_bandwidth()
        record["bandwidth"], env.copy_bw = bw, bw["bytes_per_s"]
        log(f"copy bandwidth {bw['bytes_per_s'] / 1e12:.2f} TB/s ({bw['device']})")
    except Exception as e:  # noqa: BLE001
        record["bandwidth_note"] = f"not measured: {e if isinstance(e, BenchError) else one_line(e)}"
    l2 = l2_bytes(env.device)
    rotate = int(plan.l2_multiple * l2)
    record["inputs"].update(l2_bytes=l2, rotate_bytes=rotate)
    if any(BY_NAME[k].library == "vllm" for k in plan.kernels) and "vllm" not in env.missing:
        vllm_parallel_state(env)
        record["summary"]["vllm_pick"] = {s: {name: vllm_pick(sum(parts), k)
                                              for name, parts, k, _ in linear_layers(SHAPES[s])} for s in plan.shapes}
    record["notes"] = env.notes
    partial = out_dir / f".{KIND}_partial.jsonl"  # the rows so far, for a run killed outright; removed at the end
    t_start, spent = time.monotonic(), {}
    with open(partial, "w") as f:
        def emit(r: dict) -> None:
            record["samples"].append(r)
            f.write(json.dumps(r) + "\n")
            f.flush()

        for shape in plan.shapes:
            for layer in linear_layers(SHAPES[shape]):
                try:
                    bench_layer(plan, env, shape, layer, spent, t_start, rotate, emit, log)
                except (Interrupted, ContextLost):
                    raise
                except Exception as e:  # noqa: BLE001 - the layer's weights did not fit, say; the next layer goes on
                    done = {(r["kernel"], r["m"]) for r in record["samples"]
                            if (r["shape"], r["layer"]) == (shape, layer[0])}
                    n = sum(layer[1])
                    for kname in plan.kernels:
                        for m in plan.ms:
                            if (kname, m) not in done:
                                emit({"kernel": kname, "library": BY_NAME[kname].library, "shape": shape,
                                      "layer": layer[0], "n": n, "k": layer[2], "count": layer[3], "m": m,
                                      "status": "failed", "reason": f"layer setup: {one_line(e)}",
                                      "bytes": row_bytes(kname, n, layer[2], m), "graph_us": None, "eager_us": None,
                                      "time_us": None, "gbps": None, "pct_copy": None, "max_rel_err": None})
                    log(f"{shape} {layer[0]}: failed: {one_line(e)}")
                    _check_context(env)
                empty_cache(env)
    partial.unlink(missing_ok=True)


def teardown() -> None:
    """The one-process group vllm_parallel_state started, if any (torch warns about one left at exit)."""
    try:
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - leaving is all that is left to do
        pass


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernels", default="default",
                   help="comma-separated kernel names, 'default' (all but the forced gemlite matmul types) or 'all' "
                        "(default %(default)s; --list names them)")
    p.add_argument("--shapes", default=",".join(SHAPES), help="model shapes (default %(default)s)")
    p.add_argument("--m", default=",".join(map(str, DEFAULT_M)), help="rows of x, comma-separated (default %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK.reps} repetitions of >= {QUICK.min_launches} launches (not {FULL.reps} of "
                        f">= {FULL.min_launches}), --budget-s {QUICK_BUDGET_S:g} and --kernel-budget-s "
                        f"{QUICK_KERNEL_BUDGET_S:g} unless given: ~3 minutes on an H200")
    p.add_argument("--tolerance", type=float, default=TOLERANCE,
                   help="max |y - y_ref| / max |y_ref| a kernel may reach (default %(default)g)")
    p.add_argument("--l2-multiple", type=float, default=4.0,
                   help="weight copies hold this many times the GPU's L2 cache (default %(default)g)")
    p.add_argument("--budget-s", type=float, help="seconds of measuring after which the remaining rows are skipped")
    p.add_argument("--kernel-budget-s", type=float,
                   help="seconds one kernel may take over all layers before its remaining rows are skipped")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                   help="cpu: a functional check of the whole path on the CPU (wall-clock eager times, no graph, no "
                        "bandwidth: numbers that mean nothing); default %(default)s")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT,
                   help=f"folder of the record (default {paths.shown(DEFAULT_OUT)})")
    p.add_argument("--list", action="store_true", help="print the kernels and the layer shapes, measure nothing")
    p.add_argument("--from-record", type=Path, metavar="RECORD",
                   help="measure nothing: print a written record's tables again (with --layers, over those only)")
    p.add_argument("--layers", help="with --from-record: comma-separated layers to sum, e.g. the ones a served recipe "
                                    "holds in 4 bits (qkv_proj,o_proj,in_proj_qkvz,out_proj,gate_up_proj,down_proj)")
    return p


def plan_from(args: argparse.Namespace) -> Plan:
    kernels = resolve_kernels(args.kernels)
    shapes = parse_list(args.shapes, "shapes")
    for s in shapes:
        if s not in SHAPES:
            raise BenchError(f"unknown shape {s!r}; known: {', '.join(SHAPES)}")
    if not args.tolerance > 0:
        raise BenchError(f"--tolerance {args.tolerance}: must be positive")
    if not args.l2_multiple > 0:
        raise BenchError(f"--l2-multiple {args.l2_multiple}: must be positive")
    timing = QUICK if args.quick else FULL
    budget = args.budget_s if args.budget_s is not None else (QUICK_BUDGET_S if args.quick else None)
    kbudget = args.kernel_budget_s if args.kernel_budget_s is not None else (QUICK_KERNEL_BUDGET_S if args.quick
                                                                             else None)
    return Plan(kernels, shapes, resolve_m(args.m), timing, args.tolerance, args.l2_multiple, budget, kbudget,
                args.seed, args.device)


def list_plan(plan: Plan) -> str:
    lines = ["kernels:"]
    lines += [f"  {k.name:24s} {k.library:8s} {k.what}{'' if k.default else ' (not in default)'}" for k in KERNELS]
    for s in plan.shapes:
        lines.append(f"{s}: layer N K calls-per-step W4A16-bytes-at-M=1")
        lines += [f"  {name:14s} {n:7d} {k:6d} {c:3d} {call_bytes(n, k, 1):,}" for name, n, k, c in layer_shapes(SHAPES[s])]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    try:
        if args.layers is not None and not args.from_record:
            raise BenchError("--layers goes with --from-record RECORD (a run times every layer)")
        if args.from_record:
            print(resummarize(args.from_record,
                              parse_list(args.layers, "layers") if args.layers is not None else None))
            return 0
        plan = plan_from(args)
        if args.list:
            print(list_plan(plan))
            return 0
        require_device(plan.device)
        args.out.mkdir(parents=True, exist_ok=True)
    except BenchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"error: --out {args.out}: {e.strerror or e}", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, flush=True)

    def on_term(signum, _frame):
        raise Interrupted(f"signal {signum}")

    record = new_record([sys.executable, "-m", "scripts.measure.gemm_bench", *argv], plan)
    t0, error = time.monotonic(), None
    old = signal.signal(signal.SIGTERM, on_term)
    try:
        run(plan, record, args.out, log)
    except (Interrupted, KeyboardInterrupt) as e:
        error = f"interrupted ({e or 'KeyboardInterrupt'}); the rows measured before are kept"
    except ContextLost as e:
        error = str(e)
    except Exception as e:  # noqa: BLE001 - the record says what broke, in one line
        error = f"the bench broke: {one_line(e)}"
    finally:
        signal.signal(signal.SIGTERM, old)
        teardown()
    record["duration_s"] = round(time.monotonic() - t0, 1)
    table = summarize(record)
    if error is None and not any(r["status"] == "ok" for r in record["samples"]):
        error = "no kernel produced a timed row"
    if error:
        record["status"], record["failure"] = "failed", error
    print(table)
    try:
        path = rec.write_record(record, args.out, KIND)
        path.with_suffix(".md").write_text(table)
        (args.out / f".{KIND}_partial.jsonl").unlink(missing_ok=True)  # an interrupted run's rows: all in the record
    except (rec.RecordError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return rec.exit_status(record, path)


if __name__ == "__main__":
    sys.exit(main())
