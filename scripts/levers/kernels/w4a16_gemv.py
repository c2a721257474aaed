"""A W4A16 GEMV for decode batches (M = 1 … 8) on the compressed-tensors form vLLM serves, written for the weights'
bytes: split-K over the inputs so every SM streams weights, the 4-bit unpack done with integer ops only (issue 60,
item 2: at M = 1 no 4-bit kernel vLLM 0.26 can select read at more than 57% of the copy bandwidth on an H200 on any
27B layer but the output layer (Marlin 69%), results/gpu-kernels-20261128/).

    from scripts.levers.kernels.w4a16_gemv import w4a16_gemv
    y = w4a16_gemv(x, weight_packed, weight_scale)         # x: M x K BF16, y: M x N BF16
    y = w4a16_gemv(x, weight_packed, weight_scale, form="stream")   # the fastest form at M = 1 (below)
    python -m scripts.measure.gemm_bench --kernels bf16,vllm-marlin,lab-gemv-stream --m 1   # timed beside vLLM's
    python -m pytest tests/levers/kernels       # on a CPU: the kernel run by Triton's interpreter (its own process)

The weights are llm-compressor's `pack-quantized` W4A16 g128 symmetric layout, as the checkpoint stores them:
`weight_packed` N x K/8 int32, input 8i + j of a row in bits 4j of word i, stored as q + 8 (uint4b8); `weight_scale`
N x K/128 BF16, one per group of 128 inputs; w = q * scale. No repacking: the kernel reads the checkpoint's tensors.

How a program works: it owns BLOCK_N output rows and one of SPLIT_K equal spans of the inputs, and walks its span
BLOCK_K inputs at a time: per row BLOCK_K/8 consecutive words (one coalesced read), each nibble turned into a float
by OR-ing it into the mantissa of 2^23 and subtracting 2^23 + 8 (exact: integer and float ops at full rate, no
int-to-float conversion), multiplied with the inputs in float32 and summed per group of 128 before its scale is
applied (one multiply a group, not a weight). With SPLIT_K > 1 the spans' sums are added into a float32 output
(atomic adds, so the last bits of a sum may differ from call to call) and cast to BF16 once at the end: a call is
three launches (the zeroed sum, the GEMV, the cast). The tile sizes are tuned per (M, N, K) by triton.autotune on a
GPU; `config` fixes them (tests, the interpreter).

The pairs form (form="pairs", gemv_kernel.gemv with PAIRS; BF16 inputs, sm_80+): the same tiles, with the unpack and the
products on packed BF16 pairs in PTX. One LOP3 turns a word's nibbles j and j + 4 into a bf16x2 of 128 + u, one
bf16x2 FMA takes 136 off both (q, exact), four bf16x2 FMAs multiply the word's eight weights with its eight inputs,
and that pair is added in float32: ~2.4 instructions a weight against the float32 form's ~4, at the price of sums of
four products in BF16 (relative error ~0.004 against ~0.002). Triton's interpreter runs no PTX: there the kernel
computes the same sums in float32 (EMULATE), which checks everything but the PTX; the microbench checks that on a GPU.

The stream form (form="stream", gemv_kernel.gemv_stream; BF16 inputs, sm_80+): the pairs form's arithmetic with
other data movement. A program reads its rows' words as a [rows x groups x 16] tile in 128-bit loads, the next step's
tile before this step's products; a word's unpack and dot are one PTX block, and its float32 sum, scaled by its group
scale, stays per word until the span ends (one reduction a program, none in the K loop). The inputs arrive as int32
pairs, 128 bits a word, and are paired (8i + j, 8i + j + 4) once a step for all of the thread's rows. Without split-K
a call is one launch storing BF16; with it, the spans are added into a zeroed BF16 output by BF16 atomics. The tile
(StreamConfig: rows, groups a step, split-K, warps, steps loaded ahead) is tuned per (M, N, K) by timing whole calls
in a CUDA graph over random weights holding 4x the L2 cache (tune_stream), so it must run before a caller captures
graphs of its own. A program reads one input row: a batch re-reads the weights, so the form is for M = 1.

Measured (one H100, M = 1, over the layers the served W4A16 recipe holds in 4 bits; results/gpu-kernels-20261206/,
-20261207/, -20261207b/; one --quick run each): the float32 form 31% of the copy bandwidth, the pairs form 58%, Marlin
65%, the stream form 68-70% at trees 57a944d to 0ec1782 (every 27B layer in 4 bits: 68% against Marlin's 51%; the
output layer 96-97%), faster than Marlin on every layer of both Qwen3.5 shapes in the last two runs; at M = 8 it reads
at 12%. The two-warp tiles came after (4c620d3) and have not run on a GPU. vllm_kernel.LabStreamLinearKernel serves
it in vLLM at M = 1 (results/gpu-27b-20261207/: the 27B shape's c=1 step 8.805 -> 8.298 ms against Marlin, one round).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass

GROUP = 128  # the recipes' group size along K
MAX_M = 8  # a GEMV: larger batches belong to a GEMM (tensor cores)


class GemvError(ValueError):
    """Inputs this kernel does not take; one line naming what."""


@dataclass(frozen=True)
class Config:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 3


def check(m: int, n: int, k: int, packed_shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    """Raise GemvError unless x (m x k), the packed weights and the scales fit this kernel."""
    if not 1 <= m <= MAX_M:
        raise GemvError(f"M={m}: the GEMV takes 1 to {MAX_M} rows")
    if k % GROUP:
        raise GemvError(f"K={k} is not a multiple of the group size {GROUP}")
    if tuple(packed_shape) != (n, k // 8):
        raise GemvError(f"weight_packed is {tuple(packed_shape)}, expected (N, K/8) = ({n}, {k // 8})")
    if tuple(scale_shape) != (n, k // GROUP):
        raise GemvError(f"weight_scale is {tuple(scale_shape)}, expected (N, K/{GROUP}) = ({n}, {k // GROUP})")


def fits(cfg: Config, k: int) -> bool:
    """Whether the tile splits K evenly: SPLIT_K spans of whole BLOCK_K steps, each step whole groups."""
    return cfg.block_k % GROUP == 0 and k % (cfg.block_k * cfg.split_k) == 0


def candidates(k: int) -> list[Config]:
    """The tiles autotune tries for a layer of K inputs (the ones that split K evenly)."""
    out = []
    for block_n in (16, 32):  # each tile is compiled once per padded M: few of them
        for block_k in (256, 512) if k % 256 == 0 else (GROUP,):  # K = 640 (Gemma 3 270M): steps of one group
            for split_k in (1, 2, 4):
                cfg = Config(block_n, block_k, split_k)
                if fits(cfg, k):
                    out.append(cfg)
    return out


def m_pad(m: int) -> int:
    """M rounded up to a power of two: one compiled kernel per padded size."""
    return 1 << (m - 1).bit_length()


def interpreted() -> bool:
    """Whether Triton runs kernels in its interpreter (on a CPU: chosen before Triton is imported)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


FORMS = ("float32", "pairs", "stream")  # how the nibbles become products (the module's docstring)


@dataclass(frozen=True)
class StreamConfig:
    """The stream form's tile: BLOCK_N rows, GROUPS groups of 128 inputs a step, SPLIT_K spans of K, warps, and how
    many steps ahead the weights are loaded (1 or 2)."""
    block_n: int
    groups: int
    split_k: int
    num_warps: int = 4
    ahead: int = 1


def stream_fits(cfg: StreamConfig, k: int) -> bool:
    """Whether the spans hold whole steps of whole groups."""
    return k % GROUP == 0 and (k // GROUP) % (cfg.groups * cfg.split_k) == 0


def stream_candidates(k: int) -> list[StreamConfig]:
    """The stream form's tiles for K inputs: per row count, warps and split, the largest step of 4, 2 or 1 groups
    that fits; on tiles of up to 32 rows also a step of 8 groups where that fits, and (split at most 2) loads two
    steps ahead: more bytes in flight a thread, for the layers too narrow to fill the GPU with programs."""
    out = []
    # two-warp tiles: more words a thread (fewer instructions a weight in the K loop: 3.0-3.4 against 3.7 at 16 rows
    # and 4 warps, counted in the sm_90 SASS) and more programs on the narrow layers (8 rows: 640 on N = 5120)
    for block_n, warps in ((8, 2), (16, 2), (16, 4), (32, 4), (64, 4), (32, 8), (64, 8)):
        for split_k in (1, 2, 4, 8):
            fitting = [g for g in (4, 2, 1) if stream_fits(StreamConfig(block_n, g, split_k, warps), k)]
            out += [StreamConfig(block_n, g, split_k, warps) for g in fitting[:1]]
            if block_n <= 32 and stream_fits(StreamConfig(block_n, 8, split_k, warps), k):
                out.append(StreamConfig(block_n, 8, split_k, warps))
            if block_n <= 32 and split_k <= 2 and fitting:
                out.append(StreamConfig(block_n, fitting[0], split_k, warps, ahead=2))
    return out


def stream_tile(m: int, n: int, k: int) -> StreamConfig | None:
    """The tile the stream form tuned for (M, N, K) in this process, if it has."""
    return _STREAM_TUNED.get((m, n, k))


_STREAM_TUNED: dict[tuple[int, int, int], StreamConfig] = {}  # (M, N, K): the tile measured fastest on this GPU


@functools.cache
def _kernels(form: str = "float32"):
    """(the jitted kernel, its autotuned form for `form`): imported and wrapped on first use, so importing this module
    needs no Triton. One kernel for both forms, one autotuner each: the tuning key (M, N, K) does not hold the form,
    so a shared one would give one form the other's tiles."""
    import triton

    from scripts.levers.kernels import gemv_kernel

    tiles = {c for k in (640, 2560, 5120, 6144, 9216, 17408) for c in candidates(k)}  # Gemma 3's, Qwen3.5's K
    tuned = triton.autotune(
        configs=[triton.Config({"BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "SPLIT_K": c.split_k},
                               num_warps=c.num_warps, num_stages=c.num_stages) for c in sorted(tiles, key=str)],
        key=["M_PAD", "N", "K"],
        prune_configs_by={"early_config_prune": lambda cfgs, named, **kw: [  # the tiles that split this K evenly
            c for c in cfgs if fits(Config(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]), named["K"])]},
        reset_to_zero=["y_ptr"],
    )(gemv_kernel.gemv)
    return gemv_kernel.gemv, tuned


def _stream_call(x, weight_packed, weight_scale, cfg: StreamConfig):
    """One call of the stream form with a fixed tile: one launch without split-K, two with it (the zeroed output)."""
    import torch
    import triton

    from scripts.levers.kernels import gemv_kernel

    m, k = x.shape
    n = weight_packed.shape[0]
    # Triton's interpreter has no BF16 atomics: there the spans are added in float32 and cast after
    out_dtype = torch.float32 if cfg.split_k > 1 and interpreted() else x.dtype
    y = (torch.empty if cfg.split_k == 1 else torch.zeros)((m, n), dtype=out_dtype, device=x.device)
    xi = x.view(torch.int32)  # BF16 pairs
    gemv_kernel.gemv_stream[(triton.cdiv(n, cfg.block_n), cfg.split_k, m)](
        xi, weight_packed, weight_scale, y, n, k, xi.stride(0), weight_packed.stride(0), weight_scale.stride(0),
        y.stride(0), BLOCK_N=cfg.block_n, GROUPS=cfg.groups, SPLIT_K=cfg.split_k, AHEAD=cfg.ahead,
        EMULATE=interpreted(), num_warps=cfg.num_warps)
    return y.to(x.dtype)


def stream_gemv(x, weight_packed, weight_scale, config: StreamConfig | None = None):
    """The stream form without w4a16_gemv's checks, for a caller that checked its shapes once (vllm_kernel, at load):
    x contiguous BF16 (M x K), the checkpoint's tensors; `config` fixes the tile, else the tuned one (tuned now where
    none is, unless a CUDA graph is being captured)."""
    import torch

    m, k = x.shape
    n = weight_packed.shape[0]
    if config is not None and not stream_fits(config, k):
        raise GemvError(f"tile {config} does not split K={k} into whole steps of whole groups")
    if config is None:
        if interpreted():  # the interpreter has no device to tune on
            config = stream_candidates(k)[0]
        elif (m, n, k) in _STREAM_TUNED:
            config = _STREAM_TUNED[(m, n, k)]
        elif torch.cuda.is_current_stream_capturing():
            raise GemvError(f"no tuned stream tile for M={m}, N={n}, K={k} while a CUDA graph is captured: "
                            "tune_stream before capturing")
        else:
            config = tune_stream(m, weight_packed, weight_scale)
    return _stream_call(x, weight_packed, weight_scale, config)


CHECK_TOLERANCE = 2e-2  # max |y - y_ref| / max |y_ref|; the GEMM microbench checks every kernel against it too
CHECK_ROWS = 64  # the rows checked at each end of a layer


def check_stream(name: str, weight_packed, weight_scale) -> float:
    """The stream form's max relative error against the dequantized product on the first and last CHECK_ROWS rows of
    a layer for one random input row (a server checks each layer so at load); raises GemvError naming the layer above
    CHECK_TOLERANCE."""
    import torch

    n, k = weight_packed.shape[0], weight_scale.shape[1] * GROUP
    gen = torch.Generator(device=weight_packed.device).manual_seed(n * 7919 + k)
    x = torch.randn((1, k), generator=gen, device=weight_packed.device).to(torch.bfloat16)
    rows = torch.unique(torch.cat([torch.arange(min(CHECK_ROWS, n)), torch.arange(max(0, n - CHECK_ROWS), n)]))
    rows = rows.to(weight_packed.device)
    y = w4a16_gemv(x, weight_packed, weight_scale, form="stream").float()[:, rows]
    ref = x.float() @ dequantize(weight_packed[rows], weight_scale[rows]).T
    err = float((y - ref).abs().max() / ref.abs().max().clamp_min(1e-30))
    if not err <= CHECK_TOLERANCE:  # NaN fails too
        raise GemvError(f"{name or 'a W4A16 layer'} (N={n}, K={k}): the stream form differs from the dequantized "
                        f"product by {err:.3g} > {CHECK_TOLERANCE:g}; the lab's kernel is not used for it")
    return err


def dequantize(weight_packed, weight_scale):
    """The float32 weights (N x K) of the compressed-tensors W4A16 g128 tensors: (q - 8) * scale, nibble j of word i
    being input 8i + j."""
    import torch

    n = weight_packed.shape[0]
    shifts = torch.arange(0, 32, 4, device=weight_packed.device, dtype=torch.int32)
    nib = (weight_packed[:, :, None] >> shifts) & 0xF  # the sign bits shifted in are masked away
    q = nib.reshape(n, -1).float() - 8.0
    return q * weight_scale.float().repeat_interleave(GROUP, dim=1)


def tune_stream(m: int, weight_packed, weight_scale, l2_multiple: int = 4, reps: int = 7,
                finalists: int = 3) -> StreamConfig:
    """The fastest stream tile for M input rows on these weights' (N, K) on this GPU, remembered (a server tunes at
    load, before it captures CUDA graphs): every candidate timed as whole calls (its launches and buffers) on a random
    BF16 input, in one CUDA graph over copies of random weights holding l2_multiple times the L2 cache, so each call
    reads from HBM as a served layer does (the median of `reps` replays); the `finalists` fastest are timed again, and
    the lowest median over both rounds wins."""
    import torch

    from scripts.common.cudagraph import capture, replay_ms
    from scripts.common.records import one_line

    n, k = weight_packed.shape[0], weight_scale.shape[1] * GROUP
    x = torch.randn((m, k), device=weight_packed.device).to(torch.bfloat16)
    props = torch.cuda.get_device_properties(x.device)
    per_copy = weight_packed.numel() * 4 + weight_scale.numel() * weight_scale.element_size()
    copies = max(2, min(64, -(-l2_multiple * props.L2_cache_size // per_copy)))
    gen = torch.Generator(device=x.device).manual_seed(0)
    ws = [torch.randint(-2**31, 2**31 - 1, weight_packed.shape, dtype=torch.int32, device=x.device, generator=gen)
          for _ in range(copies)]
    ss = [(torch.rand(weight_scale.shape, device=x.device, generator=gen) * 0.01).to(weight_scale.dtype)
          for _ in range(copies)]
    graphs, errors = {}, []
    for cfg in stream_candidates(k):
        try:
            for w_, s_ in zip(ws[:2], ss[:2], strict=True):  # compile and warm up outside the graph
                _stream_call(x, w_, s_, cfg)
        except Exception as e:  # noqa: BLE001 - a tile this GPU's Triton cannot build is left out
            errors.append(f"{cfg}: {one_line(e, 200)}")
            continue
        graphs[cfg] = capture(lambda cfg=cfg: [_stream_call(x, w_, s_, cfg) for w_, s_ in zip(ws, ss, strict=True)])
    best = fastest({cfg: replay_ms(g, reps) for cfg, g in graphs.items()}, lambda cfg: replay_ms(graphs[cfg], reps),
                   finalists)
    for held in (graphs, ws, ss):
        held.clear()
    torch.cuda.empty_cache()  # the copies' memory back to the device (a server tunes while it loads)
    if best is None:
        raise GemvError(f"no stream tile ran for N={n}, K={k}: {errors[0]}")
    _STREAM_TUNED[(m, n, k)] = best
    return best


def fastest(times: dict, again, finalists: int = 3):
    """The key of `times` ({tile: [ms, ...]}) with the lowest median after the `finalists` fastest were timed again
    (again(tile) -> more times, added to theirs); None where `times` is empty."""
    import statistics

    times = {k: list(v) for k, v in times.items()}
    for key in sorted(times, key=lambda c: statistics.median(times[c]))[:finalists]:
        times[key] += again(key)
    return min(times, key=lambda c: statistics.median(times[c])) if times else None


def w4a16_gemv(x, weight_packed, weight_scale, config: Config | None = None, form: str = "float32"):
    """y = x @ W^T for x of M <= 8 rows (BF16), W the compressed-tensors W4A16 g128 weights; y in x's dtype.
    `config` fixes the tile (else tuned per M, N, K on a GPU; a StreamConfig for the stream form); `form`: float32,
    pairs or stream (BF16 x only)."""
    import torch
    import triton

    if form not in FORMS:
        raise GemvError(f"form {form!r}: one of {', '.join(FORMS)}")
    if form in ("pairs", "stream"):
        if x.dtype != torch.bfloat16:
            raise GemvError(f"the {form} form takes BF16 inputs, not {x.dtype}")
        cc = torch.cuda.get_device_capability(x.device) if x.is_cuda else None
        if cc is not None and cc < (8, 0):
            raise GemvError(f"the {form} form's bf16x2 PTX needs compute capability 8.0 or newer, not {cc[0]}.{cc[1]}")
    m, k = x.shape
    n = weight_packed.shape[0]
    check(m, n, k, tuple(weight_packed.shape), tuple(weight_scale.shape))
    if weight_packed.dtype != torch.int32:
        raise GemvError(f"weight_packed is {weight_packed.dtype}, expected torch.int32 (eight 4-bit inputs a word)")
    weight_packed, weight_scale = weight_packed.contiguous(), weight_scale.contiguous()  # the kernel steps K by one
    if form == "stream":
        if config is not None and not isinstance(config, StreamConfig):
            raise GemvError(f"the stream form takes a StreamConfig, not {config}")
        return stream_gemv(x.contiguous(), weight_packed, weight_scale, config)
    if config is not None and not fits(config, k):
        raise GemvError(f"tile {config} does not split K={k} evenly")
    if config is None and interpreted():  # the interpreter has no device to tune on
        config = candidates(k)[0]
    x = x.contiguous()
    raw, tuned = _kernels(form)
    pad = m_pad(m)
    split = config.split_k if config is not None else None
    # the float32 sum of the spans, cast once; with SPLIT_K=1 the kernel stores into it all the same
    y32 = torch.zeros((m, n), dtype=torch.float32, device=x.device)
    args = (x.view(torch.int16) if form == "pairs" else x, weight_packed, weight_scale, y32, m, n, k, x.stride(0),
            weight_packed.stride(0), weight_scale.stride(0), y32.stride(0))
    extra = {"PAIRS": True, "EMULATE": interpreted()} if form == "pairs" else {}  # the interpreter runs no PTX
    if config is not None:
        grid = (triton.cdiv(n, config.block_n), split)
        raw[grid](*args, M_PAD=pad, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split, GROUP_K=GROUP,
                  num_warps=config.num_warps, num_stages=config.num_stages, **extra)
    else:
        tuned[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), meta["SPLIT_K"])](*args, M_PAD=pad, GROUP_K=GROUP,
                                                                               **extra)
    return y32.to(x.dtype)
