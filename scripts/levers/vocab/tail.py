"""The exact tail fallback of a pruned output vocabulary: a 5- or 8-bit screen of the dropped rows with a proven bound.

    make prune-vocab VARIANT=gemma3-270m-v32k-tail      # PRUNE_TAIL=1 in config.env; nothing is fitted

A pruned head (scripts.levers.vocab.prune) computes logits for the kept rows only, so a dropped token can never be
chosen, even where the parent would choose it. With PRUNE_TAIL=1 the serving plugin also screens every dropped token
on every step, cheaply and without ever missing one that could win:

  1. at load, the dropped rows w_j of the full output matrix (the tied input embedding, which the model keeps anyway)
     are quantized to int8, one scale per row; each row's error |e_j| = |w_j - deq(w_j)| and |deq(w_j)| are kept;
  2. per step, one product gives every dropped logit approximately: a_j = h^ . deq(w_j), on one of two kernels:
     - "onednn-w8a8", where the CPU has 8-bit dot products (VNNI or AMX): vLLM's oneDNN int8 GEMM (the kernel of its
       W8A8 layers), with h quantized to int8 per position by vLLM's own quantizer, so its h^ is known exactly;
     - "torch-w8a16" elsewhere: torch's int8 weight-only kernel (rows dequantized in registers, h^ = h in BF16,
       float32 sums). On AVX2 alone oneDNN multiplies u8 x s8 pairs into saturating 16-bit sums (vpmaddubsw): on
       an AMD EPYC without VNNI its screen of Gemma 3's dropped rows broke the bound (1.25x) and ran 10x slower than
       the weight-only kernel (prune record of gemma3-270m-v32k-tail, 2026-11-25). Saturation depends on the data,
       so the choice follows the CPU's flags, not the random check of build();
     - "torch-int-mm" on a GPU (and on request on a CPU): torch._int_mm, int8 x int8 with exact int32 sums, h
       quantized to int8 per position here (cuBLASLt on CUDA, which needs more than 16 rows: a step is padded);
     - "triton-w8a16" on a GPU with Triton: one kernel for the product (the weight-only arithmetic) and the pass of
       step 4 (tail_triton.py);
     - "int5-g32" on every CPU (tail_lowbit.py, its own C kernel built at first use): the rows in 5 bits with one
       scale per 32 values (101 MB of Gemma 3's dropped rows against the int8 copy's 147.7), h in int8 per 32
       values; its bound is the smaller of an L1 bound per group (in the kernel) and step 3's, on these rows;
     - "triton-int5" on a GPU with Triton: the same 5-bit rows and L1 bound per group in one Triton kernel, h in
       float32 at one position and in BF16 on the tensor cores for 2-16 (tail_triton.py);
  3. since h . w_j - h^ . deq(w_j) = h . e_j + (h - h^) . deq(w_j), Cauchy-Schwarz puts the exact logit within
         bound_j = |h| |e_j| + (|h - h^| + ACC |h|) |deq(w_j)| + ARITH |a_j|
     of a_j (ARITH covers the BF16 rounding of the kernel's output, ACC the float32 sums of the weight-only kernel;
     int8 products accumulate exactly, ACC = 0 there);
  4. a dropped row with a_j + bound_j below the best kept logit cannot be the argmax; every other one ("screened in")
     gets its exact logit from its BF16 row. Where more than FULL_FRACTION of the dropped rows are screened in at one
     step, or the step has more than SCREEN_MAX_POSITIONS positions, it reads the whole matrix instead.

The served row is then: kept logits exact, screened-in dropped logits exact, every other dropped logit within its
bound of the parent's (not -inf: sampling sees the tail as the parent does, up to the screen's rounding). The greedy
choice is the parent's at every position by construction, not by a margin fitted on data; what remains is the BF16
rounding any change of kernel has (near-ties, scripts/measure/identity.py). Nothing is fitted or stored: the screen
is derived at load from the very rows the model serves, so it cannot belong to another checkpoint or keep list;
build() checks the bound against exact products before the model serves, and refuses to serve if it does not hold.

At load every kernel of exact_kernels() is built, checked and timed at 1 and 8 positions; the fastest serves
(LAB_VOCAB_TAIL_KERNEL names one, or `int8` for the int8 ones alone). Where that is the 5-bit screen, which opens
more rows than an int8 one, the next fastest stays loaded beside it and the served steps decide (fill()).

This replaces the one-row estimator of the best dropped logit (measured 2026-11-24 at commit cf09158: its error spanned
~10 nats, so to miss no dropped argmax it read the full row at 70-96 % of positions, 0.76x BF16 on Gemma 3 270M). A
4-bit screen on torch's CPU int4 kernel was tried first (commit 37c5bd4): exact too, but that kernel's time grows with
every position of a step (17 ms at 8 positions against 4 ms at one), so it lost to BF16 at 8 concurrent requests;
the 5-bit screen's own kernel reads once for up to 8 positions.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

from scripts.levers.vocab.keep import VocabError

METHOD = "screen"  # derived at load on the fastest exact kernel: int8 or 5-bit rows
OLD_METHODS = ("int8-screen",)  # the same method's name before the 5-bit kernel (checkpoints built until 2026-11-28)
ARITH = 2.0 ** -7  # relative slack for the BF16 rounding of the kernel's output
FULL_FRACTION = 0.25  # more dropped rows than this share screened in at one step: one product with the whole matrix
# more positions than this in one step (a prefill asking for prompt log-probabilities): the whole matrix at once,
# where the per-position bound arithmetic would cost more than it saves
SCREEN_MAX_POSITIONS = 8
CHECK_VECTORS = 8  # random hidden states build() checks the bound on
ACC_PER_TERM = 2.0 ** -22  # float32 sums of the weight-only kernel: relative error per summed term, with slack
ONEDNN, WEIGHT_ONLY, INT_MM, TRITON = "onednn-w8a8", "torch-w8a16", "torch-int-mm", "triton-w8a16"  # (KERNELS)
INT5 = "int5-g32"  # the 5-bit screen (tail_lowbit.py): its own bound, its own C kernel
TRITON5 = "triton-int5"  # the same 5-bit screen on a GPU (tail_triton.py)
LOWBIT = (INT5, TRITON5)  # fewer bytes than an int8 screen, more rows opened: the served steps decide (fill())
INT8 = "int8"  # LAB_VOCAB_TAIL_KERNEL=int8: every int8 kernel above, the 5-bit one left out
TRITON_KERNELS = (TRITON, TRITON5)  # GPU-only: Triton kernels
GPU_KERNELS = (INT_MM, *TRITON_KERNELS)
CHOICE_BATCHES, CHOICE_REPEAT = (1, 8), 5  # the timing by which build() picks a kernel: positions a step, calls
ONLINE_TRIALS = 8  # served steps of each step size a screen and its runner-up take each before fill() keeps one
INT_MM_MIN_ROWS = 17  # cuBLASLt's int8 GEMM in torch._int_mm takes more than 16 rows


class TailError(VocabError):
    """A tail fallback that cannot serve exactly; the message is one line."""


def config() -> dict:
    """The `tail` entry of a pruned checkpoint's vocab_pruning block."""
    return {"method": METHOD}


def check_config(entry, where: str) -> None:
    if not isinstance(entry, dict) or entry.get("method") not in (METHOD, *OLD_METHODS):
        raise TailError(f"{where}: vocab_pruning.tail is {entry!r}; this plugin serves {config()} (rebuild with "
                        f"`make prune-vocab`)")


def exact_kernels(cpu_flags=None, device: str = "cpu") -> list[str]:
    """The kernels whose products the screen's bound holds for on this device: torch._int_mm (and Triton's int8 and
    5-bit screens) on a GPU; on a CPU the 5-bit screen (its own C kernel, exact on every CPU) and, with 8-bit dot
    products, every int8 kernel (oneDNN's W8A8 GEMM first), elsewhere torch's int8 weight-only kernel alone.
    LAB_VOCAB_TAIL_KERNEL names one instead, or `int8` for the int8 ones alone, to compare them on one machine."""
    import os

    from scripts.common.hardware import INT8_DOT_FLAGS, cpu_model_and_flags

    forced = os.environ.get("LAB_VOCAB_TAIL_KERNEL")
    if forced and forced != INT8:
        if forced not in KERNELS:
            raise TailError(f"LAB_VOCAB_TAIL_KERNEL={forced!r}: the screen's kernels are {', '.join(KERNELS)} (or "
                            f"{INT8}: the fastest int8 one)")
        return [forced]
    if device != "cpu":
        import importlib.util

        found = list(GPU_KERNELS) if importlib.util.find_spec("triton") else [INT_MM]
    else:
        flags = cpu_model_and_flags()[1] if cpu_flags is None else cpu_flags
        found = [INT5, ONEDNN, INT_MM, WEIGHT_ONLY] if any(f in flags for f in INT8_DOT_FLAGS) else [INT5, WEIGHT_ONLY]
    # `int8`: the int8 screens alone, the fastest of them (a variant that compares them with the 5-bit one)
    return [k for k in found if k not in LOWBIT] if forced == INT8 else found


def kernel_name(cpu_flags=None, device: str = "cpu") -> str:
    """The screen's kernel on this device before any timing (build() times every exact one and keeps the fastest)."""
    return exact_kernels(cpu_flags, device)[0]


def quantize(rows, scale_dtype):
    """(int8 rows, scale per row in scale_dtype, dequantized rows float32): symmetric, the scale the row's largest
    value, rounded to the dtype the kernel reads it in so that deq is what the kernel multiplies by."""
    import torch

    scale = (rows.abs().amax(1) / 127).clamp(min=1e-12).to(scale_dtype).contiguous()
    q = torch.round(rows / scale[:, None].float()).clamp(-127, 127)
    return q.to(torch.int8), scale, q * scale[:, None].float()


def onednn_handler(q, scale):
    """vLLM's oneDNN int8 GEMM over these rows. The handler reads q and scale again whenever it builds a primitive for
    a new batch size, so the caller keeps both referenced as long as the handler."""
    import torch
    from vllm import _custom_ops as ops

    if not getattr(ops, "_supports_onednn", False):
        raise TailError("this vLLM build has no oneDNN kernels (torch.ops._C.create_onednn_scaled_mm_handler): the "
                        "onednn-w8a8 screen runs on vLLM's CPU build")
    return ops.create_onednn_scaled_mm(q.t(), scale, torch.bfloat16, True, False, 32)


def onednn_products(h, s):
    import torch
    from vllm import _custom_ops as ops

    xq, xs, _ = ops.onednn_scaled_int8_quant(h.to(torch.bfloat16).contiguous(), None, None, True)
    out = torch.empty((h.shape[0], len(s["dropped"])), dtype=torch.bfloat16)
    ops.onednn_scaled_mm(s["handler"], xq, out, xs, None, None, None)
    return out, xq.float() * xs


def weight_only_products(h, s):
    import torch

    hb = h.to(torch.bfloat16).contiguous()
    return torch._weight_int8pack_mm(hb, s["q"], s["scale"]), hb.float()


def int_mm_products(h, s):
    import torch

    hf = h.float()
    hs = (hf.abs().amax(1) / 127).clamp(min=1e-12)
    hq = torch.round(hf / hs[:, None]).clamp(-127, 127).to(torch.int8)
    m, n = hq.shape[0], s["q"].shape[0]
    q = s.get("q_padded", s["q"])  # on a GPU: columns padded to a multiple of 8 at build()
    if hq.is_cuda and m < INT_MM_MIN_ROWS:  # cuBLASLt's int8 GEMM: more than 16 rows
        hq = torch.cat([hq, hq.new_zeros(INT_MM_MIN_ROWS - m, hq.shape[1])])
    out = torch._int_mm(hq, q.t())[:m, :n].float() * hs[:, None] * s["scale"]
    return out, hq[:m].float() * hs[:, None]


def triton_products(h, s):
    import torch

    from scripts.levers.vocab import tail_triton

    never = torch.full((h.shape[0],), float("inf"), device=h.device)
    parts = [tail_triton.run(h[i:i + tail_triton.MAX_POSITIONS], s, never[i:i + tail_triton.MAX_POSITIONS], ARITH)[0]
             for i in range(0, h.shape[0], tail_triton.MAX_POSITIONS)]
    return torch.cat(parts), h.to(torch.bfloat16).float()


def triton_screen(h, s, max_kept):
    import torch

    from scripts.levers.vocab import tail_triton

    a, passed = tail_triton.run(h, s, max_kept, ARITH)
    return a, passed.view(torch.bool)


def triton5_data(rows, dropped) -> dict:
    from scripts.levers.vocab import tail_triton

    return {"kernel": TRITON5, "dropped": dropped, **tail_triton.pack5(rows)}


def _triton5(h, s, best, want_bound: bool = False):
    """tail_triton.run5() over any number of positions, MAX_POSITIONS a launch: (estimates, pass, bounds or None)."""
    import torch

    from scripts.levers.vocab import tail_triton

    step = tail_triton.MAX_POSITIONS
    parts = [tail_triton.run5(h[i:i + step], s, best[i:i + step], ARITH, want_bound) for i in range(0, len(h), step)]
    return (torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]).view(torch.bool),
            torch.cat([p[2] for p in parts]) if want_bound else None)


def triton5_products(h, s):
    import torch

    never = torch.full((h.shape[0],), float("inf"), device=h.device)
    return _triton5(h, s, never)[0], h.float()  # (its bound holds |h - h^| itself)


def triton5_screen(h, s, max_kept):
    return _triton5(h, s, max_kept)[:2]


def triton5_bound(h, s):
    import torch

    a, _, bound = _triton5(h, s, torch.full((h.shape[0],), float("inf"), device=h.device), want_bound=True)
    return a.float(), bound


def threshold(max_kept):
    """The logit a dropped row must reach to be screened in: the best kept logit less its BF16 rounding (float32)."""
    return max_kept.float() - ARITH * max_kept.float().abs()


def lowbit_approx_and_bound(h, s):
    """The low-bit screen's estimates and bounds: the kernel's L1 bound per group, or the row's Cauchy-Schwarz bound
    where that is smaller (as lowbit_screen() passes rows)."""
    import torch

    from scripts.levers.vocab import tail_lowbit

    est = KERNELS[INT5].products(h, s)[0]
    bound = tail_lowbit.run(h, s, torch.full((h.shape[0],), float("inf")), want_bound=True)[2]
    return est, torch.minimum(bound, lowbit_cs_bound(h, s))


def lowbit_data(rows, dropped, bits: int | None = None) -> dict:
    """The low-bit screen of these rows (float32 [n, hidden], the dropped ones): packed for the kernel (built here
    first, if it is not yet), with each row's quantization error and norm for the Cauchy-Schwarz bound."""
    from scripts.levers.vocab import tail_lowbit

    try:
        s = {"kernel": INT5, "dropped": dropped, **tail_lowbit.pack(rows, bits or tail_lowbit.BITS)}
        tail_lowbit.library()
    except tail_lowbit.LowbitError as e:
        raise TailError(str(e)) from None
    deq = tail_lowbit.dequantize(s)
    s["lb_err"], s["lb_qnorm"] = (rows - deq).norm(dim=1), deq.norm(dim=1)
    return s


def lowbit_products(h, s):
    import torch

    from scripts.levers.vocab import tail_lowbit

    return tail_lowbit.run(h, s, torch.full((h.shape[0],), float("inf")))[0], tail_lowbit.rounded(h, s["bits"])


def lowbit_cs_bound(h, s, rows=None, pos=None, act=None):
    """|h| |e_j| + |h - h^| |deq(w_j)| + the kernel's float rounding, for every row and position (or the pairs
    pos, rows): the int8 screen's bound, on the low-bit rows (act: tail_lowbit.activations(h), if at hand)."""
    from scripts.levers.vocab import tail_lowbit

    hf = h.float()
    hq = tail_lowbit.rounded(h, s["bits"], act)
    hn, dn, qn = hf.norm(dim=1), (hf - hq).norm(dim=1), hq.norm(dim=1)
    rnd = (hf.shape[1] // tail_lowbit.GROUP + 4) * 2.0 ** -23
    slack = (1 + tail_lowbit.WEIGHT_SLACK) * (1 + tail_lowbit.SUM_SLACK)
    if rows is None:
        return (hn[:, None] * s["lb_err"] + (dn + rnd * qn)[:, None] * s["lb_qnorm"]) * slack
    return (hn[pos] * s["lb_err"][rows] + (dn + rnd * qn)[pos] * s["lb_qnorm"][rows]) * slack


def lowbit_screen(h, s, max_kept):
    """The kernel's pass (its L1 bound), then the Cauchy-Schwarz bound on the rows that passed: a row stays screened
    in only where both bounds reach the threshold."""
    from scripts.levers.vocab import tail_lowbit

    t = threshold(max_kept)
    act = tail_lowbit.activations(h, s["bits"])  # once for the kernel and the Cauchy-Schwarz bound
    est, passed, _ = tail_lowbit.run(h, s, t, act=act)
    pos, row = passed.nonzero(as_tuple=True)
    if len(pos):
        keep = est[pos, row] + lowbit_cs_bound(h, s, row, pos, act) >= t[pos]
        passed[pos[~keep], row[~keep]] = False
    return est, passed


def lowbit_fill_screen(h, s, max_kept, full):
    """dense_fill_screen() in the kernel itself: it writes its estimates into the logits at their ids and lists the
    passing (position, row) pairs, which the Cauchy-Schwarz bound then thins as lowbit_screen() does; rows None
    where more pairs passed than it lists (the whole matrix is read)."""
    import torch

    from scripts.levers.vocab import tail_lowbit

    t = threshold(max_kept)
    act = tail_lowbit.activations(h, s["bits"])  # once for the kernel and the Cauchy-Schwarz bound
    got = tail_lowbit.serve(h, s, t, full, act=act)
    if got is None:
        return h.shape[0], None
    pos, row, est = got
    keep = est + lowbit_cs_bound(h, s, row, pos, act) >= t[pos]
    return int(torch.unique(pos[keep]).numel()), torch.unique(row[keep])


class Kernel(NamedTuple):
    scale_dtype: str  # the dtype the kernel reads the row scales in
    handler: Callable | None  # built at load from (q, scale), or None
    products: Callable  # (h, s) -> (approximate logits, BF16 or float32 as the kernel writes them; h^ float32)
    acc_per_term: float  # relative error per summed term of the kernel's sums
    screen: Callable | None = None  # (h, s, max_kept) -> screen()'s answer in one kernel, where the kernel has one
    bound: Callable | None = None  # (h, s) -> approx_and_bound()'s answer, where the kernel has a bound of its own
    fill_screen: Callable | None = None  # (h, s, max_kept, full) -> dense_fill_screen()'s answer, where it has its own


KERNELS = {ONEDNN: Kernel("float32", onednn_handler, onednn_products, 0.0),
           WEIGHT_ONLY: Kernel("bfloat16", None, weight_only_products, ACC_PER_TERM),
           # int32 sums are exact; the float32 conversions of h^ and deq(w) the bound uses are within 2^-24 each
           INT_MM: Kernel("float32", None, int_mm_products, 2.0 ** -23),
           TRITON: Kernel("float32", None, triton_products, ACC_PER_TERM, triton_screen),
           INT5: Kernel("float16", None, lowbit_products, 0.0, lowbit_screen, lowbit_approx_and_bound,
                        lowbit_fill_screen),
           TRITON5: Kernel("float16", None, triton5_products, 0.0, triton5_screen, triton5_bound)}


def step_time_us(s, hidden: int, batches=CHOICE_BATCHES, repeat: int = CHOICE_REPEAT) -> dict:
    """The screen's own cost of one step (nothing screened in), median µs of `repeat` calls per batch size."""
    import torch

    out = {}
    for b in batches:
        h = torch.randn(b, hidden, device=s["dropped"].device).to(torch.bfloat16)
        never = torch.full((b,), float("inf"), device=h.device)
        sync = torch.cuda.synchronize if h.is_cuda else (lambda: None)  # a GPU kernel returns before it is done
        screen(h, s, never)
        times = []
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            screen(h, s, never)
            sync()
            times.append(time.perf_counter() - t0)
        out[f"batch_{b}"] = round(sorted(times)[len(times) // 2] * 1e6, 1)
    return out


def fastest(matrix, kept_ids, kernels) -> dict:
    """The checked screen of the kernel with the least measured time per step (summed over CHOICE_BATCHES); every
    kernel's times under s["timed"]. A kernel whose bound fails is left out; if every one fails, the first error.
    Where a 5-bit screen (LOWBIT) wins, the next fastest stays beside it as s["runner_up"]: these timings open no row,
    and a 5-bit screen opens more than an int8 one, so fill() times both on the served steps themselves."""
    built, timed, errors = {}, {}, []
    for k in kernels:
        try:  # a kernel this machine cannot run (a compile, a shape, a missing op) is left out as one that is inexact
            s = build(matrix, kept_ids, kernel=k)
            timed[k] = step_time_us(s, matrix.shape[1])
        except Exception as e:  # noqa: BLE001
            timed[k] = {"refused": f"{type(e).__name__}: {e}".splitlines()[0][:300]}
            errors.append(e if isinstance(e, TailError) else TailError(f"the {k} screen failed: {timed[k]['refused']}"))
            continue
        built[k] = s
    if not built:
        raise errors[0]
    order = sorted(built, key=lambda k: sum(timed[k].values()))
    best = built[order[0]]
    best["timed"] = timed
    if best["kernel"] in LOWBIT and len(order) > 1:  # fewer bytes, more rows opened: the served steps decide (fill())
        best["runner_up"] = built[order[1]]
    return best


def build(matrix, kept_ids, kernel: str | None = None, check: bool = True) -> dict:
    """The screen of every row of `matrix` ([vocab, hidden], the full output matrix) not in kept_ids, checked (unchecked
    only to time a kernel that this CPU does not compute exactly). Without a kernel named: every exact kernel on this
    device timed, the fastest kept (fastest())."""
    import torch

    if kernel is None:
        candidates = exact_kernels(device=matrix.device.type)
        if len(candidates) > 1:
            return fastest(matrix, kept_ids, candidates)
        kernel = candidates[0]
    if matrix.device.type == "cpu" and kernel in TRITON_KERNELS:
        raise TailError(f"the {kernel} screen runs on a GPU; the output matrix is on the CPU")
    if matrix.device.type != "cpu" and kernel not in GPU_KERNELS:
        raise TailError(f"the {kernel} screen runs on the CPU only; the output matrix is on {matrix.device} (the "
                        f"{', '.join(GPU_KERNELS[:-1])} and {GPU_KERNELS[-1]} screens run there)")
    if matrix.device.type == "cuda" and kernel == INT_MM and matrix.shape[1] % 8:
        raise TailError(f"the {INT_MM} screen on a GPU needs a hidden size that is a multiple of 8, not "
                        f"{matrix.shape[1]} (cuBLASLt's int8 GEMM)")
    k = KERNELS[kernel]
    mask = torch.ones(matrix.shape[0], dtype=torch.bool, device=matrix.device)
    mask[torch.as_tensor(kept_ids, dtype=torch.long, device=matrix.device)] = False
    dropped = mask.nonzero().squeeze(1)
    rows = matrix[dropped].float()
    if kernel in LOWBIT:
        s = (lowbit_data if kernel == INT5 else triton5_data)(rows, dropped)
        if check:
            check_bound(s, matrix)
        return s
    q, scale, deq = quantize(rows, getattr(torch, k.scale_dtype))
    padded = None
    if matrix.device.type == "cuda" and kernel == INT_MM and len(dropped) % 8:  # cuBLASLt: columns by eights
        padded = torch.cat([q, q.new_zeros(-len(dropped) % 8, q.shape[1])])
        q = padded[:len(dropped)]  # a view: one copy of the rows on the GPU
    err, qnorm = (rows - deq).norm(dim=1), deq.norm(dim=1)
    s = {"kernel": kernel, "dropped": dropped, "q": q, "scale": scale, "err": err, "qnorm": qnorm,
         "acc": k.acc_per_term * matrix.shape[1], "max_err": float(err.max()), "max_qnorm": float(qnorm.max())}
    s["handler"] = k.handler(q, scale) if k.handler else None
    if padded is not None:
        s["q_padded"] = padded
    if check:
        check_bound(s, matrix)
    return s


def products(h, s):
    """(every dropped row's approximate logit, BF16 [positions, dropped] as the kernel writes it; |h| and
    |h - h^| + ACC |h| per position, float32)."""
    hf = h.float()
    out, hq = KERNELS[s["kernel"]].products(h, s)
    hn = hf.norm(dim=1)
    return out, hn, (hf - hq).norm(dim=1) + s.get("acc", 0.0) * hn  # (the 5-bit screen bounds its sums itself)


def approx_and_bound(h, s):
    """Every dropped row's approximate logit and the bound on its error, float32 [positions, dropped]."""
    if own := KERNELS[s["kernel"]].bound:
        return own(h, s)
    a, hn, hq = products(h, s)
    a = a.float()
    return a, hn[:, None] * s["err"] + hq[:, None] * s["qnorm"] + ARITH * a.abs()


def check_bound(s, matrix, h=None) -> None:
    """Refuse a screen whose bound does not hold on exact products (a kernel whose layout or arithmetic is not the
    one assumed here): random hidden states, scaled like a final norm's output, unless given."""
    import torch

    if h is None:
        gen = torch.Generator().manual_seed(0)
        h = torch.randn(CHECK_VECTORS, matrix.shape[1], generator=gen) * 4
    h = h.to(device=matrix.device, dtype=matrix.dtype)
    a, bound = approx_and_bound(h, s)
    exact = h.float() @ matrix[s["dropped"]].float().T
    worst = float(((exact - a).abs() / bound).max())
    if worst > 1:
        raise TailError(f"the {s['kernel']} screen's error bound fails on exact products (error {worst:.2f}x the "
                        f"bound): the {s['kernel']} kernel does not compute what the screen assumes")
    if KERNELS[s["kernel"]].screen:  # a kernel with its own pass: it must pass every row at the top, 1 and n positions
        for part, top in ((h[:1], exact[:1]), (h, exact)):
            best = top.max(-1).values
            a1, bound1 = approx_and_bound(part, s)
            passed = screen(part, s, best)[1]
            if float(((top - a1).abs() / bound1).max()) > 1 or not bool(passed[top >= best[:, None]].all()):
                raise TailError(f"the {s['kernel']} screen misses a row that could win at {len(part)} position(s): "
                                f"the kernel does not compute what the screen assumes")


def screen(h, s, max_kept):
    """(approximate dropped logits (BF16), bool [positions, dropped]: rows that could beat the best kept logit).

    A row passes where a + bound >= T (T: the best kept logit less its BF16 rounding). Two passes keep that cheap:
    the largest |e_j| and |deq(w_j)| over all rows give one threshold L per position that every passing row's a must reach
    (a + ARITH |a| is increasing in a), and only rows at or above it get their own bound."""
    import torch

    if own := KERNELS[s["kernel"]].screen:
        return own(h, s, max_kept)
    a, hn, hq = products(h, s)
    t = threshold(max_kept)
    r = t - hn * s["max_err"] - hq * s["max_qnorm"]
    low = torch.where(r >= 0, r / (1 + ARITH), r / (1 - ARITH))
    pos, row = (a >= low[:, None]).nonzero(as_tuple=True)
    av = a[pos, row].float()
    keep = av + hn[pos] * s["err"][row] + hq[pos] * s["qnorm"][row] + ARITH * av.abs() >= t[pos]
    screened_in = torch.zeros_like(a, dtype=torch.bool)
    screened_in[pos[keep], row[keep]] = True
    return a, screened_in


def fill(h, kept_logits, kept_idx, s, matrix, vocab: int):
    """The full row of logits for these hidden states: kept ones as given, dropped ones screened and recomputed where
    they could win. Returns (logits [positions, vocab] in kept_logits' dtype, counters of this step).

    A screen with a runner-up (fastest()) serves the first ONLINE_TRIALS steps of each step size (positions a step)
    on each of the two, timed whole (screen, recomputed rows, whole-matrix reads), and from then on the one with the
    smaller median; s["online"] keeps the times."""
    other = s.get("runner_up")
    if other is None:
        return screened_fill(h, kept_logits, kept_idx, s, matrix, vocab)
    trials = s.setdefault("online", {}).setdefault(int(h.shape[0]), {s["kernel"]: [], other["kernel"]: []})
    pending = [k for k, t in trials.items() if len(t) < ONLINE_TRIALS]
    k = pending[0] if pending else min(trials, key=lambda k: sorted(trials[k])[len(trials[k]) // 2])
    t0 = time.perf_counter()
    full, counts = screened_fill(h, kept_logits, kept_idx, s if k == s["kernel"] else other, matrix, vocab)
    if pending:
        trials[k].append(time.perf_counter() - t0)
    return full, {**counts, f"calls:{k}": 1}


def dense_fill_screen(h, s, max_kept, full):
    """The screen's estimates written into the step's logits at the dropped ids; (positions screened in, indices into
    s["dropped"] of the rows screened in at any position)."""
    a, screened_in = screen(h, s, max_kept)
    full.index_copy_(1, s["dropped"], a if a.dtype == full.dtype else a.to(full.dtype))
    return int(screened_in.any(1).sum()), screened_in.any(0).nonzero().squeeze(1)


def screened_fill(h, kept_logits, kept_idx, s, matrix, vocab: int):
    """fill() on one screen."""
    mx = kept_logits.float().max(-1).values
    full = kept_logits.new_empty(kept_logits.shape[0], vocab)
    full.index_copy_(1, kept_idx, kept_logits)
    if h.shape[0] > SCREEN_MAX_POSITIONS:
        screened_in, rows, whole = None, s["dropped"], True
    else:
        screened_in, rows = (KERNELS[s["kernel"]].fill_screen or dense_fill_screen)(h, s, mx, full)
        whole = rows is None or rows.numel() > FULL_FRACTION * len(s["dropped"])
        rows = s["dropped"] if rows is None else rows
    if whole:
        exact = (h.to(matrix.dtype) @ matrix[:vocab].T)[:, s["dropped"]]
        ids = s["dropped"]
    elif rows.numel():
        ids = s["dropped"][rows]
        exact = h.to(matrix.dtype) @ matrix.index_select(0, ids).T
    else:
        ids, exact = None, None
    if ids is not None:
        full.index_copy_(1, ids, exact.to(full.dtype))
    wins = 0 if exact is None else int((exact.float().max(-1).values > mx).sum())
    counts = {"positions": int(h.shape[0]), "rows_recomputed": 0 if whole else int(rows.numel()),
              "positions_screened_in": int(h.shape[0]) if screened_in is None else screened_in,
              "whole_matrix_reads": int(whole), "dropped_argmax": wins}
    return full, counts


# ------------------------------------------------------------------------------------------------------- report
# held-out sets the report teacher-forces: BIG-bench tasks the keep list never saw (their text, and the parent's
# answers to their prompts), and the parent's answers to spec-v1-eval (results/vocab/<base>/answers/)
REPORT_SETS = {"text/held_out": None, "answers/held_out": "bigbench-held_out-*",
               "generations/held_out": "spec-v1-eval.jsonl-*"}


def held_out_sources(base: str, sets=None) -> dict:
    """Per held-out set to report (REPORT_SETS, or the named ones): None for BIG-bench's held-out text, else the newest
    answers file. Raises TailError (a missing answers file names `make analyze-vocab`) or BigBenchError (no BIG-bench
    sdist: `make datasets`) before any work is done."""
    from scripts.common import paths
    from scripts.data import bigbench_corpus
    from scripts.levers.vocab.keep import vocab_dir

    unknown = sorted(set(sets or ()) - set(REPORT_SETS))
    if unknown:
        raise TailError(f"no held-out set {', '.join(unknown)}: the sets are {', '.join(REPORT_SETS)}")
    out = {}
    for name, glob in REPORT_SETS.items():
        if sets is not None and name not in sets:
            continue
        if glob is None:
            bigbench_corpus.tasks("held_out")  # the extracted sdist, or BigBenchError naming `make datasets`
            out[name] = None
            continue
        files = sorted((vocab_dir(base) / "answers").glob(glob + ".json.gz"))
        if not files:
            raise TailError(f"no {paths.shown(vocab_dir(base) / 'answers')}/{glob}.json.gz: run `make analyze-vocab` "
                            f"first")
        out[name] = files[-1]
    return out


def held_out_sequences(tok, base: str, max_positions: int, chunk: int = 256,
                       sets=None) -> dict[str, list[tuple[list, int]]]:
    """Per set (REPORT_SETS, or the named ones), (token ids, first scored position) pairs, up to max_positions scored
    positions each."""
    from scripts.data import bigbench_corpus
    from scripts.levers.vocab.analyze import read_answers

    out: dict[str, list[tuple[list, int]]] = {}
    for name, source in held_out_sources(base, sets).items():
        if source is None:
            pairs, _ = bigbench_corpus.texts("held_out", 2_000)
            rows = [(ids[:chunk], 1) for ids in tok([t for _, t in pairs], add_special_tokens=False)["input_ids"]
                    if len(ids) >= 8]
        else:
            rows = [(a["prompt_ids"] + a["ids"], len(a["prompt_ids"])) for a in read_answers(source) if a["ids"]]
        seqs, n = [], 0
        for ids, start in rows:
            if n >= max_positions:
                break
            seqs.append((ids, start))
            n += len(ids) - start
        out[name] = seqs
    return out


def report(parent_dir, base: str, kept_ids, max_positions: int = 2_000, sets=None) -> dict:
    """The screen on the parent's own held-out positions, teacher-forced with transformers (the parent is read, never
    written): how often a dropped token is the argmax, how often any row is screened in and how many, and the
    largest error seen as a share of its bound (at most 1, or build() would have refused)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.monotonic()
    tok = AutoTokenizer.from_pretrained(parent_dir)
    model = AutoModelForCausalLM.from_pretrained(parent_dir, dtype=torch.bfloat16).eval()
    rows = model.get_output_embeddings().weight.detach()
    s = build(rows, kept_ids)
    kept_idx = torch.as_tensor(kept_ids, dtype=torch.long)
    out = {"kernel": s["kernel"], "positions_per_set": max_positions, "sets": {}}
    with torch.inference_mode():
        for name, seqs in held_out_sequences(tok, base, max_positions, sets=sets).items():
            counts, worst, wins, caught = [], 0.0, 0, 0
            for ids, start in seqs:
                h = model.model(torch.tensor([ids])).last_hidden_state[0, start - 1:-1]
                exact = h.float() @ rows.float().T
                mx = (h @ rows[kept_idx].T).float().max(-1).values  # the best kept logit as served (BF16)
                _, screened_in = screen(h, s, mx)
                a, bound = approx_and_bound(h, s)
                worst = max(worst, float(((exact[:, s["dropped"]] - a).abs() / bound).max()))
                win = exact[:, s["dropped"]].max(-1)
                won = win.values > exact[:, kept_idx].max(-1).values  # the parent's argmax is dropped
                wins += int(won.sum())
                caught += int(screened_in[won, win.indices[won]].sum())
                counts.append(screened_in.sum(1))
            c = torch.cat(counts).float()
            out["sets"][name] = {
                "positions": len(c), "argmax_dropped": wins, "argmax_dropped_screened_in": caught,
                "positions_screened_in": int((c > 0).sum()),
                "positions_screened_in_rate": round(float((c > 0).float().mean()), 4),
                "rows_screened_in_per_position": {"mean": round(float(c.mean()), 2), "p99": float(c.quantile(0.99)),
                                                  "max": int(c.max())},
                "max_error_over_bound": round(worst, 4)}
    out["seconds"] = round(time.monotonic() - t0, 1)
    return out
