"""Where a decode step's time goes: vLLM's torch profiler around fixed-length requests, GPU kernels per category.

    python -m scripts.measure.profile qwen35-4b-proxy-bf16 --base-url http://127.0.0.1:8200 \\
        --set 'SERVE_PROFILER_CONFIG={"profiler":"torch","torch_profiler_dir":"/root/run/prof","ignore_frontend":true,\
"torch_profiler_with_stack":false,"torch_profiler_dump_cuda_time_total":false,"delay_iterations":16,"max_iterations":64}'
    python -m scripts.measure.profile qwen35-4b-proxy-bf16 --trace /root/run/prof/x.pt.trace.json.gz --concurrency 8 \\
        --bandwidth-gbs 2900                                   # re-analyse a trace already written, no server
    python -m scripts.measure.profile qwen35-4b-proxy-fp8-static-v64k --concurrency 1 \
        --project experiments/…/profile_X.json --tpot-from experiments/…/latency_A.json …/latency_B.json
                                                # the unprofiled step split (weight GEMMs, other kernels, GPU idle)
                                                # and the A10G projection with the unprofiled TPOT

The server must run with vLLM's profiler on (0.26: `--profiler-config`, i.e. SERVE_PROFILER_CONFIG, the same value
the server was started with; it also mounts /start_profile and /stop_profile). The first example's value records
64 engine steps from the 17th of each window (delay/max_iterations: steady decode at batch c, no prefill or tail), skips
the front end's CPU trace and Python stacks (less profiler overhead in the gaps) and the summary table vLLM would print
at every stop. After a warm-up, for each concurrency c (default 1,8):
POST /start_profile, c concurrent streamed greedy requests of exactly --output-tokens tokens (ignore_eos, short
prompts), POST /stop_profile, then the newest worker trace in the profiler's folder (Chrome trace events, json or
json.gz; the front end's `*.async_llm.*` CPU trace is skipped) is reduced to time per step per category:

  gemm:<kind>  weight GEMMs by layer kind (linear_attn, self_attn, mlp, lm_head), mapped by MAPPING_RULE
  attention    full-attention kernels (FlashAttention, FlashInfer, Triton, KV-cache writes)
  gdn          Gated-DeltaNet kernels (recurrent / chunked delta rule, causal conv1d, gating)
  norm, activation, rope, quant, sampling, other   by kernel-name fragments (RULES, first match wins; inductor's
               fused triton kernels are named after their ops: rsqrt/mean -> norm, silu/mul -> activation)
  memcpy, memset                                   GPU copies and fills (trace categories gpu_memcpy / gpu_memset)
  cpu/launch gaps  the window (first to last GPU activity) minus the union of GPU-busy intervals

Steps: STEPS_RULE. Roofline per category: bytes read per step (weights from the checkpoint's safetensors headers,
by layer kind; KV and recurrent-state bytes estimated from config.json) / bandwidth (--bandwidth-gbs, else a
device-to-device copy measured with torch in a subprocess). A step-time model per concurrency, fitted from this
profile, and a labelled A10G projection come with it (step_model; --project redoes it with the same lease's
unprofiled TPOTs, since the profiled step carries the profiler's own host gaps), as do the host's launch calls per
step (launches_per_step: CUDA-graph replays against eager kernel launches). Writes experiments/<variant>/profile_<stamp>.json
(kind "profile") and a markdown table next to it; raw traces stay in the profiler's folder (not in git).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import gzip
import json
import re
import shutil
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import combinations
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import DTYPE_BYTES, QUANT_SUFFIXES, CheckpointError, read_checkpoint
from scripts.common.hardware import A10G_GBS
from scripts.common.loadgen import PromptSetError, load_prompts, openai_client, stream_one
from scripts.common.records import envelope, read_json, save_record
from scripts.common.server import ServerError, http_get, http_post
from scripts.common.variants import VariantError, load_variant, parse_overrides

KIND = "profile"
DEFAULT_CONCURRENCY = "1,8"
DEFAULT_OUTPUT_TOKENS = 128
WARMUP_TOKENS = 16

# Kernel name fragments (lower case) per category, tried in this order; the first category with a matching fragment
# wins. Sampling first (FlashInfer's sampling kernels also say "flashinfer"), GDN and attention before GEMMs
# (FlashAttention-3's kernels are cutlass::device_kernel<flash::...>), norm before activation (a fused
# add+rmsnorm+mul kernel is a norm).
RULES: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("sampling", ("sampling", "sampler", "argmax", "topk", "top_k", "top_p", "gumbel", "multinomial", "penalt")),
    ("gdn", ("gated_delta", "delta_rule", "gdn", "conv1d", "causal_conv", "recurrent", "solve_tril",
             "chunk_local_cumsum", "recompute_w_u", "chunk_fwd_kernel_o", "chunk_scaled_dot", "l2norm")),
    ("attention", ("flash", "attention", "attn", "paged", "batchdecode", "batchprefill", "reshape_and_cache",
                   "fmha", "mha_", "merge_attn_states", "cascade")),
    ("gemm", ("gemm", "gemv", "nvjet", "xmma", "cutlass", "marlin", "machete", "cublas", "splitk", "wgmma",
              "scaled_mm", "matmul", "triton_tem_fused", "bmm")),
    ("sampling", ("softmax",)),
    ("quant", ("quant", "fp8", "clamp")),  # dynamic activation quantization: abs-max, clamp, scale
    ("norm", ("rms", "rsqrt", "norm", "mean")),
    ("activation", ("silu", "gelu", "act_and_mul", "swiglu", "sigmoid", "mul")),
    ("rope", ("rotary", "rope")),
)
# the lab's W4A16 op (scripts/levers/kernels/vllm_kernel.py, torch.library "lab::w4a16_stream_or_marlin"): Inductor
# names the norm and activation kernels around it after it; its own kernels are the stream form's Triton GEMVs
LAB_W4A16_OP = "w4a16_stream_or_marlin"
LAB_W4A16_KERNELS = ("gemv_stream", "gemv")
GPU_CATS = {"kernel": None, "gpu_memcpy": "memcpy", "gpu_memset": "memset"}
TRACE_CATEGORIES = {c for c in GPU_CATS.values() if c}  # categories read from the trace's event category, not a name
WEIGHT_BITS = (4, 8, 16)  # served weight bits a family can have
GAPS = "cpu/launch gaps"
ORDER = ("gemm:linear_attn", "gemm:self_attn", "gemm:mlp", "gemm:lm_head", "gemm:unmapped", "attention", "gdn", "norm",
         "activation", "rope", "quant", "sampling", "memcpy", "memset", "other", GAPS)

# vLLM fuses these checkpoint matrices into one GEMM (packed_modules_mapping of its Qwen3.5 and Llama models)
PACKED = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
          "up_proj": "gate_up_proj", "in_proj_qkv": "in_proj_qkvz", "in_proj_z": "in_proj_qkvz",
          "in_proj_b": "in_proj_ba", "in_proj_a": "in_proj_ba"}
LAYER_KINDS = ("linear_attn", "self_attn", "mlp")
TORCH_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
_LAYER_RE = re.compile(r"(?:^|\.)layers\.(\d+)\.([a-z_]+)\.(.+)$")
_STEP_ANNOTATION = re.compile(r"^execute_(?:\d+_)?context_(\d+)\(.*?\)_generation_(\d+)\(")

MAPPING_RULE = (
    "GEMM kernels grouped by signature (name, grid, block). Each checkpoint linear layer (vLLM's fused qkv_proj, "
    "gate_up_proj, in_proj_qkvz, in_proj_ba; one lm_head) is a weight family: calls per step = the number of layers of "
    "its kind (config.json layer_types: linear_attention -> linear_attn, full_attention -> self_attn; every layer has "
    "an mlp; lm_head once), families of identical tensor shapes merged (one kernel serves them: Qwen3.5's GDN out_proj "
    "and attention o_proj). Signature calls / steps, rounded, must equal a family's calls per step; among signatures "
    "and families with the same count, the longer mean kernel time goes with the larger bytes per call. A merged "
    "family's time is split between its kinds by their layer counts. Signatures left over: gemm:unmapped.")
STEPS_RULE = (
    "steps = vLLM's per-step trace annotations (execute_context_N(..)_generation_M(..); decode-only steps have N = 0) "
    "where the trace has them; else calls of the output layer's GEMM signature (the largest family, once per step): of "
    "the 5 longest-mean GEMM signatures, the one under which the most GEMM time falls on whole family counts per step. "
    "Both counts are reported, with the requests' token counts (a pruned or quantized output layer can make another "
    "signature look like the head: the annotations win).")


class ProfileError(RuntimeError):
    pass


# ------------------------------------------------------------------------------------------------ pure: kernels
def classify(name: str, cat: str = "kernel") -> str:
    """The category of one GPU event: memcpy/memset by trace category, kernels by RULES (GEMMs as 'gemm')."""
    if GPU_CATS.get(cat):
        return GPU_CATS[cat]
    low = name.lower()
    if low.startswith("triton_") and not low.startswith("triton_tem"):
        # Inductor names a fused kernel after its nodes' origins: a norm or activation that reads a quantized GEMM's
        # output says "cutlass_scaled_mm" / "machete_mm" without running it (only a template, triton_tem, is a GEMM)
        for op in ("cutlass_scaled_mm", "scaled_mm", "machete_mm", "marlin_gemm", LAB_W4A16_OP, "gemm"):
            low = low.replace(op, "")
    for category, fragments in RULES:
        if any(f in low for f in fragments):
            return category
    return "other"


@dataclass(frozen=True)
class GpuEvent:
    name: str
    cat: str
    ts: float  # µs
    dur: float  # µs
    grid: tuple[int, ...] = ()
    block: tuple[int, ...] = ()

    @property
    def signature(self) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
        return self.name, self.grid, self.block


def gpu_events(trace_events: list[dict]) -> list[GpuEvent]:
    """Complete ('X') GPU events of a Chrome trace: kernels, memcpys, memsets, in time order."""
    out = []
    for e in trace_events:
        cat = str(e.get("cat", "")).lower()  # older Kineto wrote "Kernel"
        if e.get("ph") == "X" and cat in GPU_CATS and "dur" in e:
            a = e.get("args") or {}
            out.append(GpuEvent(e.get("name", "?"), cat, float(e["ts"]), float(e["dur"]),
                                tuple(a.get("grid") or ()), tuple(a.get("block") or ())))
    return sorted(out, key=lambda g: g.ts)


def launches_per_step(trace_events: list[dict], steps: int) -> dict[str, float]:
    """Host-side launch calls per step, by API name (the trace's cuda_runtime / cuda_driver events): work replayed from
    a CUDA graph costs one cudaGraphLaunch per graph, work run eagerly one cudaLaunchKernel (or cuLaunchKernel) per
    kernel, so a part of the step outside every graph (a drafter, say) shows as kernel launches beside the graphs."""
    counts: Counter = Counter()
    for e in trace_events:
        if (e.get("ph") == "X" and str(e.get("cat", "")).lower() in ("cuda_runtime", "cuda_driver")
                and "Launch" in str(e.get("name", ""))):
            counts[e["name"]] += 1
    return {name: round(n / steps, 2) for name, n in sorted(counts.items())} if steps else {}


def busy_union_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (GPU busy time; overlapping streams count once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def step_annotations(trace_events: list[dict]) -> dict[str, int]:
    """vLLM's per-step CPU annotations: steps seen, decode-only steps (no context request), and mixed ones."""
    steps = decode = 0
    for e in trace_events:
        if e.get("ph") == "X" and (m := _STEP_ANNOTATION.match(e.get("name", ""))) and e.get("cat") == "user_annotation":
            steps += 1
            decode += int(m.group(1)) == 0
    return {"steps": steps, "decode_only": decode, "with_prefill": steps - decode}


@dataclass
class SigAgg:
    name: str
    grid: tuple[int, ...]
    block: tuple[int, ...]
    category: str
    calls: int = 0
    total_us: float = 0.0

    @property
    def mean_us(self) -> float:
        return self.total_us / self.calls if self.calls else 0.0


def aggregate(events: list[GpuEvent]) -> list[SigAgg]:
    """One row per kernel signature (name, grid, block) with its calls and total time, longest total first."""
    rows: dict[tuple, SigAgg] = {}
    for e in events:
        key = (e.cat, *e.signature)
        if key not in rows:
            rows[key] = SigAgg(e.name, e.grid, e.block, classify(e.name, e.cat))
        rows[key].calls += 1
        rows[key].total_us += e.dur
    return sorted(rows.values(), key=lambda r: -r.total_us)


# ------------------------------------------------------------------------------------------------ pure: weights
@dataclass
class Family:
    """Weight matrices of one shape, served by one GEMM kernel: how often per step, by which layer kinds."""
    units: list[str]
    kinds: dict[str, int]  # layer kind -> calls per step
    bytes_per_call: int
    shape: tuple
    bits: int = 16  # weight bits as served: 16 (BF16/F16), 8 (FP8/INT8), 4 (packed INT4)
    parts: tuple = ()  # families one GEMM signature serves together (different shapes, one kernel): their Family rows

    @property
    def count(self) -> int:
        return sum(self.kinds.values())

    @property
    def label(self) -> str:
        return "+".join(sorted(self.units))

    def kind_bytes(self) -> dict[str, float]:
        """Bytes per step by layer kind (the split of a signature's time between kinds)."""
        out: Counter = Counter()
        for f in self.parts or (self,):
            for k, n in f.kinds.items():
                out[k] += n * f.bytes_per_call
        return dict(out)


def weight_bits(members) -> int:
    """Served weight bits of one linear unit from its tensors (suffix, dtype, shape): packed INT4, 8-bit, or 16."""
    if any(s == "weight_packed" for s, _, _ in members):
        return 4
    return 8 if any(s == "weight" and d in ("F8_E4M3", "F8_E5M2", "I8") for s, d, _ in members) else 16


def kernel_bits(name: str) -> int:
    """Weight bits a GEMM kernel reads, from its name: Machete/Marlin/int4 templates and the lab's GEMVs 4, FP8/INT8 8,
    else 16."""
    low = name.lower()
    if low in LAB_W4A16_KERNELS or any(f in low for f in ("integer_subbyte<4", "machete", "marlin", "uint4", "int4",
                                                          "u4b8")):
        return 4
    return 8 if any(f in low for f in ("e4m3", "e5m2", "fp8", "int8", "_s8")) else 16


def text_config(config: dict) -> dict:
    return config.get("text_config", config)


def layer_kinds(config: dict) -> dict[str, int]:
    """Layers per kind: linear_attn / self_attn from layer_types (or full_attention_interval), mlp = every layer."""
    text = text_config(config)
    n = int(text["num_hidden_layers"])
    types = text.get("layer_types")
    if not types:
        interval = text.get("full_attention_interval")
        types = (["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
                 if interval else ["full_attention"] * n)
    types = types[:n]
    return {"linear_attn": types.count("linear_attention"), "self_attn": sum(t != "linear_attention" for t in types),
            "mlp": n}


def served_bytes(dtype: str, shape: tuple[int, ...], fp8_online: bool) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel * (1 if fp8_online else DTYPE_BYTES.get(dtype, 2))


def weight_catalogue(tensors: dict, config: dict, serve_quantization: str | None = None
                     ) -> tuple[list[Family], dict[str, int]]:
    """GEMM weight families and bytes read per step by kind, from safetensors header entries (name -> TensorInfo).

    MTP and vision tensors are left out (text-only serving without speculation). SERVE_QUANTIZATION=fp8 on an
    unquantized checkpoint (vLLM's online FP8) serves the layers' linear weights at 1 byte per element; lm_head stays.
    The embedding is read only as rows (negligible) unless the output layer is tied to it.
    """
    text = text_config(config)
    fp8_online = serve_quantization == "fp8" and not (config.get("quantization_config")
                                                        or text.get("quantization_config"))
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    units: dict[tuple[int, str, str], list[tuple[str, str, tuple, str]]] = defaultdict(list)
    other: Counter = Counter()
    head: list[tuple[str, str, tuple]] = []
    embed: list[tuple[str, str, tuple]] = []
    for name, t in tensors.items():
        if name.startswith("mtp.") or ".visual." in name or name.startswith(("visual.", "model.visual")):
            continue
        if m := _LAYER_RE.search(name):
            layer, kind, rest = int(m.group(1)), m.group(2), m.group(3)
            module, _, suffix = rest.rpartition(".")
            is_linear = kind in LAYER_KINDS and module and (
                (suffix == "weight" and len(t.shape) == 2) or suffix in QUANT_SUFFIXES)
            if is_linear:
                leaf = module.rsplit(".", 1)[-1]
                units[(layer, kind, PACKED.get(leaf, leaf))].append((suffix, t.dtype, tuple(t.shape), module))
            else:
                other[kind if kind in LAYER_KINDS else "norm"] += served_bytes(t.dtype, t.shape, False)
        elif name.startswith("lm_head."):
            head.append((name.split(".", 1)[1], t.dtype, tuple(t.shape)))
        elif name.endswith("embed_tokens.weight"):
            embed.append(("weight", t.dtype, tuple(t.shape)))
        else:
            other["norm"] += served_bytes(t.dtype, t.shape, False)
    out_layer = head if head and not tied else embed
    families: dict[tuple, Family] = {}
    for (_, kind, unit), members in sorted(units.items()):
        shape = tuple(sorted((s, ("F8_E4M3" if fp8_online and s == "weight" else d), sh)
                             for s, d, sh, _ in members))
        nbytes = sum(served_bytes(d, sh, fp8_online and s == "weight") for s, d, sh, _ in members)
        fam = families.setdefault(shape, Family([], {}, nbytes, shape, weight_bits(shape)))
        if f"{kind}.{unit}" not in fam.units:
            fam.units.append(f"{kind}.{unit}")
        fam.kinds[kind] = fam.kinds.get(kind, 0) + 1
    if out_layer:
        shape = tuple(sorted(out_layer))
        families[("lm_head", shape)] = Family(["lm_head"], {"lm_head": 1},
                                              sum(served_bytes(d, sh, False) for _, d, sh in out_layer), shape,
                                              weight_bits(shape))
    by_kind: Counter = Counter()
    for fam in families.values():
        for kind, n in fam.kinds.items():
            by_kind[kind] += n * fam.bytes_per_call
    bytes_per_step = {k: by_kind.get(k, 0) for k in (*LAYER_KINDS, "lm_head")}
    bytes_per_step["other_params"] = sum(other.values())
    return sorted(families.values(), key=lambda f: -f.bytes_per_call), bytes_per_step


def state_bytes_per_step(config: dict, concurrency: int, context_tokens: float, kv_cache_dtype: str | None) -> dict:
    """Estimated bytes the non-GEMM mixers move per step: full-attention KV read (context_tokens per request) and the
    Gated-DeltaNet recurrent state read + written once per request and layer (conv state left out: kernel-1 rows)."""
    text = text_config(config)
    kinds = layer_kinds(config)
    model_bytes = TORCH_DTYPE_BYTES.get(text.get("dtype") or text.get("torch_dtype") or config.get("dtype"), 2)
    kv_bytes = 1 if (kv_cache_dtype or "auto").startswith("fp8") else model_bytes
    head_dim = text.get("head_dim") or text["hidden_size"] // text["num_attention_heads"]
    per_token = 2 * kinds["self_attn"] * text.get("num_key_value_heads", text["num_attention_heads"]) * head_dim * kv_bytes
    ssm_bytes = TORCH_DTYPE_BYTES.get(text.get("mamba_ssm_dtype"), model_bytes)
    state = 0
    if kinds["linear_attn"]:
        state = (2 * kinds["linear_attn"] * text["linear_num_value_heads"] * text["linear_key_head_dim"]
                 * text["linear_value_head_dim"] * ssm_bytes)
    return {"attention": round(concurrency * context_tokens * per_token), "gdn": concurrency * state,
            "kv_bytes_per_token": per_token, "gdn_state_bytes_per_request": state,
            "assumed_context_tokens": round(context_tokens, 1)}


# ------------------------------------------------------------------------------------------------ pure: mapping
def regular(calls_per_step: float, counts: set[int]) -> bool:
    """Calls per step within 10 % of a whole number that is some family's calls per step."""
    m = round(calls_per_step)
    return m in counts and abs(calls_per_step - m) <= 0.1 * m


def find_steps(gemms: list[SigAgg], families: list[Family], candidates: int = 5) -> tuple[int, SigAgg | None]:
    """Forward steps in the window (STEPS_RULE): each of the `candidates` longest-mean GEMM signatures is tried as the
    largest family (steps = its calls / that family's calls per step); the one under which the most GEMM time has a
    family's calls per step wins (ties: the longer mean). A prefill-shaped GEMM, long but rare, loses to the head."""
    if not gemms or not families:
        return 0, None
    counts = {f.count for f in families}
    total = sum(s.total_us for s in gemms) or 1.0
    best: tuple = (-1.0, 0.0, 0, None)
    for top in sorted(gemms, key=lambda s: -s.mean_us)[:candidates]:
        steps = max(1, round(top.calls / families[0].count))
        fit = sum(s.total_us for s in gemms if regular(s.calls / steps, counts)) / total
        if (fit, top.mean_us) > best[:2]:
            best = (fit, top.mean_us, steps, top)
    return best[2], best[3]


def map_gemms(gemms: list[SigAgg], families: list[Family], steps: int) -> dict[tuple, Family | None]:
    """Signature -> weight family (MAPPING_RULE); None for a signature no family takes."""
    out: dict[tuple, Family | None] = {}
    for bits in sorted({f.bits for f in families} | {kernel_bits(s.name) for s in gemms}):
        out.update(_map_same_bits([s for s in gemms if kernel_bits(s.name) == bits],
                                  [f for f in families if f.bits == bits], steps))
    return out


def _map_same_bits(gemms: list[SigAgg], families: list[Family], steps: int) -> dict[tuple, Family | None]:
    out: dict[tuple, Family | None] = {}
    by_count: dict[int, list[SigAgg]] = defaultdict(list)
    fams: dict[int, list[Family]] = defaultdict(list)
    for f in families:
        fams[f.count].append(f)
    counts = set(fams) | {a.count + b.count for a, b in combinations(families, 2)}
    for s in gemms:
        n = s.calls / steps if steps else 0
        if regular(n, counts):
            by_count[round(n)].append(s)
        else:
            out[(s.name, s.grid, s.block)] = None
    taken: set[int] = set()
    for m, sigs in by_count.items():
        ranked = sorted(sigs, key=lambda s: -s.mean_us)
        candidates = sorted(fams.get(m, []), key=lambda f: -f.bytes_per_call)
        for i, s in enumerate(ranked):
            out[(s.name, s.grid, s.block)] = candidates[i] if i < len(candidates) else None
            taken |= {id(candidates[i])} if i < len(candidates) else set()
    # one kernel serving two families of different shapes (a persistent-grid Machete or CUTLASS GEMM): its calls per
    # step are the sum of theirs; the largest such pair of families no signature took
    for key in [k for k, f in out.items() if f is None]:
        s = next(x for x in gemms if (x.name, x.grid, x.block) == key)
        n = s.calls / steps if steps else 0
        pairs = [(a, b) for a, b in combinations(families, 2) if id(a) not in taken and id(b) not in taken
                 and regular(n, {a.count + b.count})]
        if pairs:
            a, b = max(pairs, key=lambda ab: ab[0].count * ab[0].bytes_per_call + ab[1].count * ab[1].bytes_per_call)
            kinds = Counter(a.kinds) + Counter(b.kinds)
            out[key] = Family(a.units + b.units, dict(kinds), (a.count * a.bytes_per_call + b.count * b.bytes_per_call)
                              // (a.count + b.count), (), a.bits, (a, b))
            taken |= {id(a), id(b)}
    return out


def split_family_time(total_us: float, family: Family | None) -> dict[str, float]:
    """A family's GEMM time by layer kind, in proportion to each kind's bytes per step (one shape: to its calls)."""
    if family is None:
        return {"gemm:unmapped": total_us}
    kb = family.kind_bytes()
    total = sum(kb.values())
    return {f"gemm:{k}": total_us * b / total for k, b in kb.items()}


# ------------------------------------------------------------------------------------------------ pure: the table
def roofline_us(nbytes: float, bandwidth_gbs: float) -> float:
    """Time to read nbytes at bandwidth_gbs (GB/s = 1e9 B/s), in µs."""
    return nbytes / (bandwidth_gbs * 1e3)


def category_table(events: list[GpuEvent], families: list[Family], annotated_steps: int = 0) -> dict:
    """Per-step time by category, the window, the GPU-busy union and the gaps; per-signature rows. Steps (STEPS_RULE):
    annotated_steps (vLLM's step annotations) where there are any, else find_steps."""
    if not events:
        raise ProfileError("no GPU kernel events in the trace (was the profiler on during the requests?)")
    start = min(e.ts for e in events)
    window = max(e.ts + e.dur for e in events) - start
    busy = busy_union_us([(e.ts, e.ts + e.dur) for e in events])
    return signature_table(aggregate(events), families, annotated_steps, window, busy,
                           sum(e.dur for e in events) - busy)


def signature_table(sigs: list[SigAgg], families: list[Family], annotated_steps: int, window: float, busy: float,
                    overlap: float) -> dict:
    """category_table from kernel signatures already aggregated (a trace's, or a record's signature rows) and the
    window's length, GPU-busy union and overlap."""
    gemms = [s for s in sigs if s.category == "gemm"]
    by_signature, top = find_steps(gemms, families)
    steps = annotated_steps or by_signature
    if not steps:
        raise ProfileError("cannot count steps: no GEMM kernels matched to weights and no step annotations")
    mapping = map_gemms(gemms, families, steps) if families else {}
    totals: Counter = Counter()
    calls: Counter = Counter()
    read: dict[int, list[float]] = defaultdict(lambda: [0.0, 0.0])  # served bits -> [bytes, µs] of mapped GEMMs
    rows = []
    for s in sigs:
        key = (s.name, s.grid, s.block)
        if s.category == "gemm":
            fam = mapping.get(key)
            for cat, us in split_family_time(s.total_us, fam).items():
                totals[cat] += us
            if fam:
                read[fam.bits][0] += s.calls * fam.bytes_per_call
                read[fam.bits][1] += s.total_us
            calls["gemm:" + ("+".join(sorted(fam.kinds)) if fam else "unmapped")] += s.calls
        else:
            fam = None
            totals[s.category] += s.total_us
            calls[s.category] += s.calls
        rows.append({"name": s.name, "grid": list(s.grid), "block": list(s.block), "category": s.category,
                     "calls": s.calls, "calls_per_step": round(s.calls / steps, 3), "total_us": round(s.total_us, 3),
                     "mean_us": round(s.mean_us, 3), "family": fam.label if fam else None})
    totals[GAPS] = window - busy
    per_step = {c: totals.get(c, 0.0) / steps for c in ORDER}
    return {"steps": steps, "steps_signature": top.name if top else None, "steps_by_signature": by_signature,
            "window_us": window, "busy_us": busy, "overlap_us": overlap, "per_step_us": per_step,
            "calls_per_step": {c: n / steps for c, n in calls.items()}, "signatures": rows,
            "by_bits": {bits: (b / steps, us / steps) for bits, (b, us) in sorted(read.items())},
            "unmapped_gemm_signatures": sum(1 for s in gemms if mapping.get((s.name, s.grid, s.block)) is None)}


def signatures_of(rows: list[dict]) -> list[SigAgg]:
    """A record's signature rows (category_table's "signatures") as aggregates, classified by this version's rules
    (memcpy and memset rows keep theirs: it came from the trace's event category, which a row does not hold)."""
    return [SigAgg(r["name"], tuple(r["grid"]), tuple(r["block"]),
                   r["category"] if r["category"] in TRACE_CATEGORIES else classify(r["name"]), int(r["calls"]),
                   float(r["total_us"])) for r in rows]


def gemm_by_bits(by_bits: dict[int, tuple[float, float]], bandwidth_gbs: float) -> dict[str, dict]:
    """The mapped weight GEMMs by served weight bits: bytes and µs per step, the rate they read at and its share of the
    copy bandwidth (the microbench's measure, here inside the served step). Unmapped GEMM kernels (a cuBLAS split-K
    reduce after its GEMM) are left out of the time."""
    return {str(bits): {"bytes_per_step": round(b), "us_per_step": round(us, 2),
                        "gbs": round(b / us / 1e3, 1) if us else None,
                        "of_bandwidth": round(b / us / 1e3 / bandwidth_gbs, 4) if us and bandwidth_gbs else None}
            for bits, (b, us) in by_bits.items()}


def roofline_rows(per_step_us: dict[str, float], bytes_per_step: dict[str, float], bandwidth_gbs: float) -> list[dict]:
    """The table: per category µs per step, share of the step, bytes per step and the roofline time at bandwidth."""
    step = sum(per_step_us.values())
    out = []
    for cat in ORDER:
        us = per_step_us.get(cat, 0.0)
        b = bytes_per_step.get(cat)
        ideal = roofline_us(b, bandwidth_gbs) if b is not None else None
        out.append({"category": cat, "us_per_step": round(us, 2), "share": round(us / step, 4) if step else None,
                    "bytes_per_step": b, "roofline_us": round(ideal, 2) if ideal is not None else None,
                    "vs_roofline": round(us / ideal, 2) if ideal else None})
    out.append({"category": "total", "us_per_step": round(step, 2), "share": 1.0 if step else None,
                "bytes_per_step": sum(v for v in bytes_per_step.values() if v is not None),
                "roofline_us": round(sum(r["roofline_us"] or 0 for r in out), 2), "vs_roofline": None})
    return out


def step_model(step_us: float, weight_gemm_us: float, weight_bytes: float, device_gbs: float, concurrency: int,
               target_gbs: float = A10G_GBS) -> dict:
    """step_us = fixed_us + weight_bytes / bandwidth, fitted to this profile (bandwidth = the weights' achieved
    streaming rate in their GEMMs, fixed_us = everything else), and the projection to a GPU of target_gbs."""
    achieved = weight_bytes / weight_gemm_us / 1e3 if weight_gemm_us else None  # GB/s
    fixed = step_us - weight_gemm_us
    eff = min(1.0, achieved / device_gbs) if achieved and device_gbs else None
    proj = fixed + roofline_us(weight_bytes, target_gbs * eff) if eff else None
    peak = fixed + roofline_us(weight_bytes, target_gbs)
    return {
        "fit": {"fixed_us": round(fixed, 2), "bandwidth_gbs": round(achieved, 1) if achieved else None,
                "weight_bytes": weight_bytes, "efficiency_vs_device": round(eff, 3) if eff else None,
                "formula": "step_us = fixed_us + weight_bytes / bandwidth"},
        "projection": {"label": "projection (not a measurement)", "target": f"{'A10G' if target_gbs == A10G_GBS else 'a GPU'}, {target_gbs:g} GB/s",
                       "step_us": round(proj, 2) if proj else None,
                       "tokens_per_s": round(concurrency * 1e6 / proj, 1) if proj else None,
                       "step_us_at_peak": round(peak, 2), "tokens_per_s_at_peak": round(concurrency * 1e6 / peak, 1),
                       "formula": (f"step_us = fixed_us + weight_bytes / ({target_gbs:g} GB/s x efficiency_vs_device); "
                                   "at_peak: efficiency 1. Assumes the non-weight part (other kernels, CPU/launch "
                                   "gaps) takes as long there as here: optimistic for a slower GPU and host.")}}


def project(profile: dict, tpots_ms: list[float], concurrency: int = 1, target_gbs: float = A10G_GBS) -> dict:
    """The step model of a profile record with the step's unprofiled time: step_us = the median of `tpots_ms` (TPOT
    p50 of latency records at the same concurrency, no profiler attached), of which the weight GEMMs take what the
    profile measured (every gemm:* row, unmapped signatures included); fixed = the rest, projected to target_gbs.
    The profiled step carries the profiler's own host gaps, so its fixed part overstates the real one. The profiler
    adds host time, not GPU time, so the fixed part splits further where the profile has its GPU-busy union:
    other_kernels_us = busy per step - weight GEMMs (every other kernel and copy), host_us = step_us - busy per step
    (where the GPU's work a step is the profile's: the unprofiled step's time with the GPU idle, waiting on the host)."""
    if str(concurrency) not in profile.get("summary", {}):
        raise ProfileError(f"the profile has no level c={concurrency} (it has c={', '.join(profile.get('summary', {}))})")
    summary = profile["summary"][str(concurrency)]
    gemm_us = sum(r["us_per_step"] for r in summary["table"] if r["category"].startswith("gemm:"))
    weight_bytes = summary["step_model"]["fit"]["weight_bytes"]
    step_us = statistics.median(tpots_ms) * 1e3
    if step_us <= gemm_us:
        raise ProfileError(f"TPOT {step_us:.0f} us is not above the profiled weight GEMMs' {gemm_us:.0f} us: "
                           "records of another machine or setting?")
    out = step_model(step_us, gemm_us, weight_bytes, profile["inputs"]["bandwidth_gbs"], concurrency, target_gbs)
    out["fit"]["step_us"] = round(step_us, 2)
    out["fit"]["tpots_ms"] = [round(t, 3) for t in tpots_ms]
    if summary.get("busy_us") and summary.get("steps"):
        busy = summary["busy_us"] / summary["steps"]
        out["split"] = {"weight_gemms_us": round(gemm_us, 2), "other_kernels_us": round(busy - gemm_us, 2),
                        "host_us": round(step_us - busy, 2), "gpu_busy_us": round(busy, 2),
                        "formula": "step_us = weight_gemms_us + other_kernels_us + host_us; gpu_busy_us = the "
                                   "profile's GPU-busy union per step; host_us = step_us - gpu_busy_us (negative: "
                                   "the unprofiled step is shorter than the profiled GPU work)"}
    return out


def markdown(variant: str, gpu: str, results: dict) -> str:
    lines = [f"# Profile of {variant} ({gpu})", "", f"Steps: {STEPS_RULE}", "", f"GEMM mapping: {MAPPING_RULE}", ""]
    for c, r in results.items():
        lines += [f"## c={c}: {r['steps']} steps, {r['step_us']:.1f} us/step, window {r['window_us'] / 1e3:.1f} ms", "",
                  "| category | us/step | share | MB/step | roofline us | x roofline |", "|---|---:|---:|---:|---:|---:|"]
        for row in r["table"]:
            if not row["us_per_step"] and not row["bytes_per_step"]:
                continue  # a category this model never runs (gdn on a llama) or an empty one
            mb = f"{row['bytes_per_step'] / 1e6:.1f}" if row["bytes_per_step"] is not None else ""
            lines.append(f"| {row['category']} | {row['us_per_step']:.1f} | "
                         f"{(row['share'] or 0) * 100:.1f}% | {mb} | {row['roofline_us'] if row['roofline_us'] is not None else ''} | "
                         f"{row['vs_roofline'] if row['vs_roofline'] is not None else ''} |")
        fit, proj = r["step_model"]["fit"], r["step_model"]["projection"]
        read = [(bits, x) for bits, x in sorted((r.get("gemm_by_bits") or {}).items(), key=lambda kv: int(kv[0]))
                if x["gbs"]]
        if read:
            lines += ["", "Weight GEMMs by served bits (mapped signatures; % of the copy bandwidth): " + "; ".join(
                f"{bits}-bit {x['bytes_per_step'] / 1e9:.3f} GB/step in {x['us_per_step']:.1f} us, {x['gbs']:,.0f} GB/s"
                + (f" ({x['of_bandwidth'] * 100:.1f} %)" if x["of_bandwidth"] is not None else "") for bits, x in read)
                      + "."]
        if r.get("launches_per_step"):
            lines += ["", "Host launch calls per step: " + ", ".join(f"{k} {v}" for k, v in r["launches_per_step"].items())
                      + " (a CUDA graph is one cudaGraphLaunch; eager work one kernel launch per kernel)."]
        lines += ["", f"Step model: fixed {fit['fixed_us']} us + {fit['weight_bytes'] / 1e9:.3f} GB / "
                      f"{fit['bandwidth_gbs']} GB/s ({fit['formula']}).",
                  f"{proj['label']}, {proj['target']}: {proj['step_us']} us/step, {proj['tokens_per_s']} tok/s "
                  f"(at peak {proj['step_us_at_peak']} us, {proj['tokens_per_s_at_peak']} tok/s); {proj['formula']}", ""]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------ I/O
def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def is_worker_trace(path: Path) -> bool:
    return path.name.endswith((".pt.trace.json", ".pt.trace.json.gz")) and ".async_llm." not in path.name \
        and "capture_traces" not in path.parts


def newest_trace(folder: Path, since: float, wait_s: float = 120.0) -> Path:
    """The newest worker trace written after `since` (epoch s), once its size has stopped changing."""
    deadline = time.time() + wait_s
    last = None
    while time.time() < deadline:
        found = sorted((p for p in folder.rglob("*.pt.trace.json*") if is_worker_trace(p) and p.stat().st_mtime >= since),
                       key=lambda p: p.stat().st_mtime)
        if found:
            size = found[-1].stat().st_size
            if last == (found[-1], size) and size > 0:
                return found[-1]
            last = (found[-1], size)
        time.sleep(1.0)
    raise ProfileError(f"no worker trace newer than the window in {folder} after {wait_s:.0f} s")


BANDWIDTH_SNIPPET = """
import time, torch
n = 512 * 2**20
a = torch.empty(n, dtype=torch.uint8, device="cuda"); b = torch.empty_like(a)
for _ in range(5): b.copy_(a)
torch.cuda.synchronize(); t = time.perf_counter()
for _ in range(50): b.copy_(a)
torch.cuda.synchronize(); print(2 * n * 50 / (time.perf_counter() - t) / 1e9)
"""


def measure_bandwidth_gbs() -> float:
    """Device-to-device copy of 512 MiB, 50 times: (read + written bytes) / time, GB/s (a subprocess: no CUDA here)."""
    r = subprocess.run([sys.executable, "-c", BANDWIDTH_SNIPPET], capture_output=True, text=True, timeout=300)
    if r.returncode:
        raise ProfileError(f"bandwidth measurement failed: {r.stderr.strip().splitlines()[-1:]}")
    return float(r.stdout.strip().splitlines()[-1])


def profiler_settings(variant) -> dict:
    raw = variant.resolved.get("SERVE_PROFILER_CONFIG")
    return json.loads(raw) if raw else {}


def checkpoint_facts(variant) -> tuple[dict | None, dict]:
    """config.json and the safetensors headers of the served checkpoint (None, {} where it is not here)."""
    path = Path(variant.model)
    if not (path / "config.json").exists():
        return None, {}
    report = read_checkpoint(path)
    return report.config, report.tensors


def short_prompts(rows: list[dict], n: int, output_tokens: int) -> list[dict]:
    """n requests of the prompt set's 'short' group (all rows if it has none), each generating output_tokens."""
    short = [r for r in rows if r.get("group") == "short"] or rows
    return [{**short[i % len(short)], "max_tokens": output_tokens} for i in range(n)]


def run_requests(base_url: str, model: str, rows: list[dict]) -> list:
    client = openai_client(base_url)
    t0 = time.perf_counter()
    with cf.ThreadPoolExecutor(len(rows)) as ex:
        return list(ex.map(lambda r: stream_one(client, model, r, "fixed", t0, None), rows))


def profiled_requests(base: str, model: str, rows: list[dict], concurrency: int, output_tokens: int) -> list:
    """POST /start_profile, `concurrency` requests of exactly output_tokens tokens at once, POST /stop_profile; their
    samples (a failed request or profiler call raises ServerError)."""
    if (code := http_post(f"{base}/start_profile")) != 200:
        raise ServerError(f"POST /start_profile answered {code}: is the profiler on (SERVE_PROFILER_CONFIG)?")
    samples = run_requests(base, model, short_prompts(rows, concurrency, output_tokens))
    if (code := http_post(f"{base}/stop_profile")) != 200:
        raise ServerError(f"POST /stop_profile answered {code}")
    if bad := [s for s in samples if not s.ok]:
        raise ServerError(f"{len(bad)} of {concurrency} requests failed; first: {bad[0].error}")
    return samples


def analyze(events: list[dict], *, families: list[Family], bytes_per_step: dict, config: dict | None,
            concurrency: int, context_tokens: float, kv_cache_dtype: str | None, bandwidth_gbs: float,
            states: dict | None = None) -> dict:
    """Everything derived from one trace: the category table with rooflines, the step counts and the step model.
    KV and recurrent-state bytes from config.json, or `states` as given (a re-analysis without the checkpoint)."""
    annotations = step_annotations(events)
    table = category_table(gpu_events(events), families, annotations["steps"])
    return summarize(table, annotations, launches_per_step(events, table["steps"]), bytes_per_step=bytes_per_step,
                     config=config, concurrency=concurrency, context_tokens=context_tokens,
                     kv_cache_dtype=kv_cache_dtype, bandwidth_gbs=bandwidth_gbs, states=states)


def summarize(table: dict, annotations: dict, launches: dict, *, bytes_per_step: dict, config: dict | None,
              concurrency: int, context_tokens: float, kv_cache_dtype: str | None, bandwidth_gbs: float,
              states: dict | None = None) -> dict:
    """A category table (category_table or signature_table) with rooflines, the step counts and the step model."""
    steps = table["steps"]
    per_bytes: dict[str, float] = {f"gemm:{k}": v for k, v in bytes_per_step.items() if k != "other_params"}
    if config:
        states = state_bytes_per_step(config, concurrency, context_tokens, kv_cache_dtype)
    states = states or {}
    if states:
        per_bytes.update(attention=states["attention"], gdn=states["gdn"])
    weight_bytes = sum(v for k, v in bytes_per_step.items() if k != "other_params")
    weight_us = sum(table["per_step_us"][f"gemm:{k}"] for k in (*LAYER_KINDS, "lm_head"))
    step_us = table["window_us"] / steps
    return {"steps": steps, "steps_from": {"lm_head_signature": table["steps_signature"],
                                           "lm_head_signature_steps": table["steps_by_signature"],
                                           "annotations": annotations},
            "step_us": step_us, "window_us": table["window_us"], "busy_us": table["busy_us"],
            "overlap_us": table["overlap_us"], "table": roofline_rows(table["per_step_us"], per_bytes, bandwidth_gbs),
            "calls_per_step": table["calls_per_step"], "state_bytes": states, "launches_per_step": launches,
            "gemm_by_bits": gemm_by_bits(table["by_bits"], bandwidth_gbs),
            "unmapped_gemm_signatures": table["unmapped_gemm_signatures"],
            "step_model": step_model(step_us, weight_us, weight_bytes, bandwidth_gbs, concurrency),
            "signatures": table["signatures"]}


# ------------------------------------------------------------------------------------------------ CLI
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--base-url", help="a running vLLM server started with the profiler on (SERVE_PROFILER_CONFIG)")
    src.add_argument("--trace", type=Path, help="analyse this trace file instead (one --concurrency level)")
    src.add_argument("--reanalyze", type=Path, metavar="RECORD",
                     help="analyse a profile record's traces again with this version's rules (no checkpoint needed: "
                          "weights and state bytes come from the record; a trace that is not here: the record's "
                          "signature rows); a new record beside it names both")
    src.add_argument("--project", type=Path, metavar="RECORD",
                     help="no trace: this profile record's step model with the unprofiled TPOT of --tpot-from, "
                          "split into weight GEMMs, other kernels and time with the GPU idle, and projected to "
                          "--target-gbs (a projection), printed as JSON")
    p.add_argument("--tpot-from", type=Path, nargs="+", metavar="LATENCY",
                   help="with --project: latency records of the variant (their fixed-length TPOT p50, median)")
    p.add_argument("--target-gbs", type=float, default=A10G_GBS,
                   help="with --project: the target GPU's memory bandwidth (default %(default)g, the A10G)")
    p.add_argument("--trace-dir", type=Path, help="with --reanalyze: the folder holding its trace files")
    p.add_argument("--bits", action="append", default=[], type=bits_entry, metavar="UNIT=BITS",
                   help="with --reanalyze: a family's served weight bits, over the record's (lm_head=4: a 4-bit output "
                        "layer that a record before 2026-12-07 counted as 16-bit)")
    p.add_argument("--reference", type=Path, metavar="RECORD",
                   help="with --reanalyze of a record without weight bits: a 16-bit profile record of the same model")
    p.add_argument("--concurrency", default=DEFAULT_CONCURRENCY, help="comma-separated levels (default %(default)s)")
    p.add_argument("--output-tokens", type=int, default=DEFAULT_OUTPUT_TOKENS,
                   help="tokens every request generates (ignore_eos; default %(default)s)")
    p.add_argument("--prompts", type=Path, default=paths.EVAL / "prompts" / "latency-v1.jsonl",
                   help="prompt set; its 'short' group is used")
    p.add_argument("--profiler-dir", type=Path, help="default: torch_profiler_dir of SERVE_PROFILER_CONFIG")
    p.add_argument("--bandwidth-gbs", type=float,
                   help="memory bandwidth for the roofline (default: a device-to-device copy measured here)")
    p.add_argument("--trace-wait", type=float, default=180.0, help="seconds to wait for the trace file")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config.env key")
    p.add_argument("--out-dir", type=Path, help="write the record here instead of experiments/<variant>/")
    return p


def new_record(variant, argv: list[str]) -> dict:
    command = [sys.executable, "-m", "scripts.measure.profile", *argv]
    return envelope(KIND, variant, command=command, server_command=None)


def record_families(record: dict, reference: dict | None, bits_of: dict[str, int] | None = None) -> list[Family]:
    """A record's weight families; weight bits from bits_of (unit -> bits, the label of a family: "lm_head",
    "mlp.down_proj"), else from the record, else from the bytes of the same units in a 16-bit reference record of the
    same model (ratio > 0.75: 16, > 0.4: 8, else 4). The output layer counts as 16-bit where nothing says otherwise (a
    pruned head has fewer rows, not fewer bits; records before 2026-12-07 say 16 for a 4-bit one: bits_of)."""
    ref = {tuple(f["units"]): f["bytes_per_call"] for f in (reference or {}).get("weights", {}).get("families", [])}
    bits_of = dict(bits_of or {})
    out = []
    for f in record["weights"]["families"]:
        bits = bits_of.pop("+".join(sorted(f["units"])), f.get("bits"))
        if bits is None and f["units"] == ["lm_head"]:
            bits = 16
        elif bits is None:
            if tuple(f["units"]) not in ref:
                raise ProfileError(f"family {'+'.join(f['units'])} has no weight bits in the record: pass --reference "
                                   "with a 16-bit profile record of the same model")
            ratio = f["bytes_per_call"] / ref[tuple(f["units"])]
            bits = 16 if ratio > 0.75 else 8 if ratio > 0.4 else 4
        out.append(Family(f["units"], f["calls_per_step"], f["bytes_per_call"], (), bits))
    if bits_of:
        raise ProfileError(f"--bits {', '.join(bits_of)}: no such family in the record (its families: "
                           f"{', '.join('+'.join(sorted(f['units'])) for f in record['weights']['families'])})")
    return out


def bits_entry(item: str) -> tuple[str, int]:
    """One --bits UNIT=BITS entry (argparse type: a malformed one is a usage error)."""
    unit, _, bits = item.partition("=")
    if not unit or bits not in {str(b) for b in WEIGHT_BITS}:
        raise argparse.ArgumentTypeError(f"{item!r}: UNIT=BITS, BITS one of {', '.join(map(str, WEIGHT_BITS))} "
                                         "(UNIT a family of the record, e.g. lm_head)")
    return unit, int(bits)


def parse_bits(entries: list[tuple[str, int]]) -> dict[str, int]:
    """--bits entries as {unit: bits}; a unit named twice is refused."""
    out: dict[str, int] = {}
    for unit, bits in entries:
        if unit in out:
            raise ProfileError(f"--bits names {unit} twice")
        out[unit] = bits
    return out


def trace_events(trace: Path) -> list[dict]:
    """A trace file's events, or a ProfileError naming it (a truncated gzip, not JSON, no traceEvents)."""
    try:
        return load_trace(trace)
    except (OSError, EOFError, ValueError, KeyError) as e:
        raise ProfileError(f"{trace}: not a trace this version reads ({e!r})") from None


def record_levels(record: dict, path: Path, trace_dir: Path | None) -> list[dict]:
    """What a re-analysis reads of each profiled level of a record: its trace's path, its sample, its signature rows
    (classified again) and the old summary's window, steps and launches; KeyError and the like where a field is
    missing or malformed."""
    levels = []
    for c, old in record["summary"].items():
        sample = next(x for x in record["samples"] if x["concurrency"] == int(c))
        levels.append({"c": c, "old": old, "sample": sample,
                       "trace": (trace_dir or path.parent) / Path(old["trace_file"]).name,
                       "rows": signatures_of(sample["signatures"]) if sample.get("signatures") else None,
                       "window": (float(old["window_us"]), float(old["busy_us"]), float(old["overlap_us"])),
                       "annotations": old["steps_from"]["annotations"], "steps": int(old["steps"]),
                       "launches": dict(old.get("launches_per_step") or {}),
                       "facts": {"bytes_per_step": record["weights"]["bytes_per_step"], "config": None,
                                 "concurrency": int(c), "context_tokens": 0, "kv_cache_dtype": None,
                                 "bandwidth_gbs": float(record["inputs"]["bandwidth_gbs"]),
                                 "states": old.get("state_bytes") or {}}})
    return levels


def reanalyze(variant_name: str, path: Path, args: argparse.Namespace, argv: list[str]) -> int:
    """A profile record's traces analysed again (STEPS_RULE, MAPPING_RULE of this version): the measurement's envelope
    (hardware, versions, git of the run) is kept; `reanalysis` names the record, the command and this checkout."""
    from scripts.common.records import git_state, now_utc

    trace_dir, out_dir = args.trace_dir, args.out_dir
    try:
        record = read_json(path, "the record", ProfileError)
        if record.get("variant") != variant_name or record.get("schema", {}).get("kind") != KIND:
            raise ProfileError(f"{path}: not a profile record of {variant_name}")
        reference = read_json(args.reference, "--reference", ProfileError) if args.reference else None
        families = record_families(record, reference, parse_bits(args.bits))
        for row, f in zip(record["weights"]["families"], families, strict=True):
            row["bits"] = f.bits
        levels = record_levels(record, path, trace_dir)
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (KeyError, StopIteration, TypeError, ValueError, AttributeError) as e:
        what = f"no {e} in it" if isinstance(e, KeyError) else "no sample of a profiled level" \
            if isinstance(e, StopIteration) else f"a malformed field ({e})"
        print(f"error: {path}: {what}: not a profile record this version reads", file=sys.stderr)
        return 1
    results = {}
    try:
        for lv in levels:
            if lv["trace"].is_file():
                res = analyze(trace_events(lv["trace"]), families=families, **lv["facts"])
            elif trace_dir is None and lv["rows"]:
                # the trace stayed on the GPU machine: the record's signature rows (every kernel's calls and time)
                # and its window hold what the mapping and the table need
                table = signature_table(lv["rows"], families, lv["annotations"]["steps"], *lv["window"])
                # launches a step as recorded, over this analysis's step count (the rules may count other steps)
                per = lv["steps"] / table["steps"]
                res = summarize(table, lv["annotations"], {k: round(v * per, 2) for k, v in lv["launches"].items()},
                                **lv["facts"])
                res["from_signature_rows"] = True
            elif trace_dir is not None:
                raise ProfileError(f"no trace {lv['trace']} in --trace-dir"
                                   + (" (leave it out to use the record's signature rows)" if lv["rows"] else ""))
            else:
                raise ProfileError(f"no trace {lv['trace']}, and {path} has no signature rows to analyse instead")
            res["steps_from"]["tokens"] = lv["old"]["steps_from"].get("tokens")
            res["trace_file"] = lv["old"]["trace_file"]
            lv["sample"]["signatures"] = res.pop("signatures")
            results[lv["c"]] = res
    except ProfileError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    record["summary"] = results
    record["steps_rule"], record["mapping_rule"] = STEPS_RULE, MAPPING_RULE
    record["reanalysis"] = {"of": path.name, "command": [sys.executable, "-m", "scripts.measure.profile", *argv],
                            "git": git_state(), "at": now_utc().isoformat(timespec="seconds")}
    if (out := save_record(record, out_dir or path.parent, KIND)) is None:
        return 1
    gpu = (record["hardware"].get("gpu") or {}).get("name", "no GPU")
    out.with_suffix(".md").write_text(markdown(variant_name, gpu, results))
    for c, r in results.items():
        print(f"c={c}: {r['steps']} steps, {r['step_us']:.1f} us/step")
    print(f"wrote {paths.shown(out)} and {out.with_suffix('.md').name} (reanalysis of {path.name})")
    return 0


def print_projection(args: argparse.Namespace) -> int:
    """--project: a profile record and latency records of the same variant, at each --concurrency level."""
    try:
        if not args.tpot_from:
            raise ProfileError("--project needs --tpot-from LATENCY… (latency records of the same variant)")
        profile = json.loads(args.project.read_text())
        records = [json.loads(p.read_text()) for p in args.tpot_from]
        if any(r.get("variant") != args.variant for r in [profile, *records]):
            raise ProfileError(f"every record must be of {args.variant}")
        out = {"variant": args.variant, "profile": args.project.name, "latency": [p.name for p in args.tpot_from]}
        for c in (int(x) for x in args.concurrency.split(",")):
            levels = [r["summary"]["fixed"].get(str(c)) or {} for r in records]
            tpots = [lv["p50_tpot_ms"] for lv in levels if lv.get("p50_tpot_ms")]
            if not tpots:
                raise ProfileError(f"no latency record has a fixed-length level c={c} with a TPOT")
            out[f"c={c}"] = project(profile, tpots, c, args.target_gbs)
    except (ProfileError, OSError, KeyError, ValueError, TypeError, AttributeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(out, indent=2))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.bits and not args.reanalyze:
        parser.error("--bits needs --reanalyze")
    if args.reanalyze:
        return reanalyze(args.variant, args.reanalyze, args, argv)
    if args.project:
        return print_projection(args)

    try:
        variant = load_variant(args.variant, overrides=parse_overrides(args.set))
        levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
        if not levels or min(levels) < 1 or (args.trace and len(levels) != 1):
            raise ProfileError(f"--concurrency {args.concurrency!r}: positive integers (one level with --trace)")
        prof = profiler_settings(variant)
        folder = args.profiler_dir or (Path(prof["torch_profiler_dir"]) if prof.get("torch_profiler_dir") else None)
        if args.base_url and folder is None:
            raise ProfileError("no profiler folder: start the server with SERVE_PROFILER_CONFIG (pass the same --set "
                               "here) or name it with --profiler-dir")
        last = prof.get("delay_iterations", 0) + prof.get("max_iterations", 0)
        if args.base_url and prof.get("max_iterations") and last >= args.output_tokens:
            raise ProfileError(f"delay_iterations + max_iterations = {last} >= --output-tokens {args.output_tokens}: "
                               "the window would reach past the requests' last step")
        bandwidth, bw_source = args.bandwidth_gbs, "--bandwidth-gbs"
        if bandwidth is None:
            if not shutil.which("nvidia-smi"):
                raise ProfileError("no GPU visible to measure the bandwidth: pass --bandwidth-gbs")
            bandwidth, bw_source = measure_bandwidth_gbs(), "device-to-device copy, (read + written bytes) / time"
        if args.base_url and http_get(f"{args.base_url.rstrip('/')}/health", timeout=5)[0] != 200:
            raise ServerError(f"no healthy server at {args.base_url}")
        config, tensors = checkpoint_facts(variant)
        families, bytes_per_step = weight_catalogue(tensors, config, variant.resolved.get("SERVE_QUANTIZATION")) \
            if config else ([], {})
    except (ProfileError, VariantError, CheckpointError, ServerError, ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1

    record = new_record(variant, argv)
    record["inputs"] = {"base_url": args.base_url, "trace": str(args.trace) if args.trace else None,
                        "concurrency": levels, "output_tokens": args.output_tokens, "temperature": 0,
                        "prompts": args.prompts.name, "warmup": f"1 request, then {max(levels)} at once, "
                        f"{WARMUP_TOKENS} tokens each", "profiler_dir": str(folder) if folder else None,
                        "profiler_config": prof, "bandwidth_gbs": round(bandwidth, 1), "bandwidth_source": bw_source,
                        "layers": layer_kinds(config) if config else None}
    record["mapping_rule"], record["steps_rule"] = MAPPING_RULE, STEPS_RULE
    record["weights"] = {"bytes_per_step": bytes_per_step,
                         "families": [{"units": f.units, "calls_per_step": f.kinds, "bytes_per_call": f.bytes_per_call,
                                       "bits": f.bits} for f in families]}
    if not config:
        record["weights"]["note"] = f"{variant.resolved['MODEL']} is not here: GEMMs unmapped, no weight roofline"
    results: dict[str, dict] = {}
    t_run = time.monotonic()
    try:
        if args.trace:
            sources = [(levels[0], args.trace, [])]
        else:
            base = args.base_url.rstrip("/")
            model = variant.served_name
            rows, _ = load_prompts(args.prompts)
            run_requests(base, model, short_prompts(rows, 1, WARMUP_TOKENS))
            run_requests(base, model, short_prompts(rows, max(levels), WARMUP_TOKENS))
            sources = []
            for c in levels:
                since = time.time() - 1
                samples = profiled_requests(base, model, rows, c, args.output_tokens)
                sources.append((c, newest_trace(folder, since, args.trace_wait), samples))
        for c, trace, samples in sources:
            prompt = sum(s.prompt_tokens for s in samples) / len(samples) if samples else 0
            res = analyze(load_trace(trace), families=families, bytes_per_step=bytes_per_step, config=config,
                          concurrency=c, context_tokens=prompt + args.output_tokens / 2,
                          kv_cache_dtype=variant.resolved.get("SERVE_KV_CACHE_DTYPE"), bandwidth_gbs=bandwidth)
            res["steps_from"]["tokens"] = {"output_tokens_per_request": args.output_tokens,
                                           "profiler_delay_iterations": prof.get("delay_iterations"),
                                           "profiler_max_iterations": prof.get("max_iterations")}
            res["trace_file"] = str(trace)
            record["samples"].append({"concurrency": c, "requests": [s.to_json() for s in samples],
                                      "signatures": res.pop("signatures")})
            results[str(c)] = res
            print(f"c={c}: {res['steps']} steps, {res['step_us']:.1f} us/step; gaps "
                  f"{next(r['us_per_step'] for r in res['table'] if r['category'] == GAPS):.1f} us/step ({trace.name})",
                  flush=True)
    except (ProfileError, ServerError, PromptSetError, OSError, json.JSONDecodeError) as e:
        record["status"], record["failure"] = "failed", str(e)
        print(f"error: {e}", file=sys.stderr)
    record["summary"] = results
    record["duration_s"] = round(time.monotonic() - t_run, 2)
    if (out := save_record(record, args.out_dir or variant.path, KIND)) is None:
        return 1
    gpu = (record["hardware"].get("gpu") or {}).get("name", "no GPU")
    if results:
        out.with_suffix(".md").write_text(markdown(variant.name, gpu, results))
    print(f"wrote {paths.shown(out)}" + (f" and {out.with_suffix('.md').name}" if results else "")
          + f" (status {record['status']})")
    return 0 if record["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
