"""The exact tail's screen as one Triton kernel on a GPU ("triton-w8a16" in tail.KERNELS): the int8 rows read once,
dequantized in registers, multiplied by h rounded to BF16 with float32 sums (the weight-only kernel's arithmetic, so
the same bound), and in the same kernel |h|, |h - h^|, each row's bound and its pass against the best kept logit; it
writes the approximate logits (BF16) and the pass flags, nothing else, in one launch. torch._int_mm
("torch-int-mm") needs five more kernels for the quantization of h, the scales and the pass, which on an H200 cost
more than its product (results/vocab/qwen35-4b/screen-time-65536-cuda-20261127.json).

Two kernels share the epilogue: one position (a decode step at c=1) is a matrix-vector product on the CUDA cores;
2 to 16 positions are one tensor-core tile of 16 positions against BLOCK_N rows (on an H200 the per-position loop of
the first took 0.9 ms at 8 positions, the tile 0.28 ms).

The 5-bit screen ("triton-int5") is the CPU's int5-g32 screen (tail_lowbit.py) on a GPU: the same values and fp16
scales per group of 32 (tail_lowbit.group_values()), 0.69 bytes a value against 1 for int8, laid out for coalesced
loads (pack5(): per row, a byte holds value j of a group in its low half and value j + 16 in its high half, a bit plane
holds every value's fifth bit, then the scales). Its bound is the L1 bound per group of tail_lowbit, here with h in
float32 at one position (no rounding of h) and in BF16 on the tensor cores in a tile (|h - h^| per group joins it):

    |w . h - est| <= sum_g s_g (1/2 |h_g|_1 + 15 |h_g - h^_g|_1) + the float32 sums' rounding (coefficients())

On an H200 the 5-bit kernel is bound by its unpacking, not by memory (0.30 / 0.87 ms at 1 / 8 positions on the
Qwen3.5-4B head's shape against the int8 kernel's 0.19 / 0.24; results/vocab-lowbit-20261128/README.md), so the
load-time timing keeps the int8 one there.

Imported only where the screen runs on a GPU with Triton; tail.py holds the bound and its check.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

from scripts.levers.vocab import tail_lowbit

MAX_POSITIONS = 16  # positions a launch takes (a decode step of up to 16 sequences)
CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
           for bn, bk, w in ((16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8), (64, 128, 4), (128, 128, 8))]
CONFIGS5_ONE = [triton.Config({"BLOCK_N": bn, "BLOCK_G": bg}, num_warps=w)
                for bn, bg, w in ((16, 8, 4), (32, 4, 4), (32, 8, 8), (64, 4, 8), (64, 2, 4), (128, 2, 8))]
CONFIGS5_TILE = [triton.Config({"BLOCK_N": bn, "BLOCK_G": bg}, num_warps=w)
                 for bn, bg, w in ((32, 2, 4), (32, 4, 4), (64, 2, 4), (64, 4, 8), (128, 2, 8))]
if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter (the tests): one config, nothing to time
    CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})]
    CONFIGS5_ONE = [triton.Config({"BLOCK_N": 32, "BLOCK_G": 2})]
    CONFIGS5_TILE = [triton.Config({"BLOCK_N": 32, "BLOCK_G": 2})]
LV5 = tail_lowbit.LEVELS[5]


@triton.jit
def _epilogue(acc, rm, rn, M, N, hn2, hq2, scale_ptr, err_ptr, qn_ptr, mk_ptr, a_ptr, pass_ptr, arith, acc_k):
    """Scale the products, bound each one and write the logits and the pass flags (positions rm, rows rn)."""
    mn = rn < N
    a = acc * tl.load(scale_ptr + rn, mask=mn, other=0.0)[None, :]
    hn = tl.sqrt(hn2)
    hq = tl.sqrt(hq2) + acc_k * hn
    best = tl.load(mk_ptr + rm, mask=rm < M, other=0.0)
    t = tl.where(best == float("inf"), best, best - arith * tl.abs(best))
    err = tl.load(err_ptr + rn, mask=mn, other=0.0)
    qn = tl.load(qn_ptr + rn, mask=mn, other=0.0)
    bound = hn[:, None] * err[None, :] + hq[:, None] * qn[None, :] + arith * tl.abs(a)
    ok = (rm < M)[:, None] & mn[None, :]
    offs = rm[:, None] * N + rn[None, :]
    tl.store(a_ptr + offs, a.to(tl.bfloat16), mask=ok)
    tl.store(pass_ptr + offs, (a + bound >= t[:, None]).to(tl.int8), mask=ok)


@triton.jit
def _rows(q_ptr, rn, kk, K, mn, mk):
    """The int8 rows rn, columns kk, as float32 (exact); int64 offsets: rows x hidden may pass 2^31."""
    return tl.load(q_ptr + rn.to(tl.int64)[:, None] * K + kk[None, :], mask=mn[:, None] & mk[None, :],
                   other=0).to(tl.float32)


@triton.autotune(configs=CONFIGS, key=["N", "K"])
@triton.jit
def _screen_one(h_ptr, q_ptr, scale_ptr, err_ptr, qn_ptr, mk_ptr, a_ptr, pass_ptr, M, N, K, arith, acc_k,
                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One position: a matrix-vector product on the CUDA cores, each program reading BLOCK_N rows once."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    mn = rn < N
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    hn2 = tl.zeros((1,), dtype=tl.float32)
    hq2 = tl.zeros((1,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mk = kk < K
        w = _rows(q_ptr, rn, kk, K, mn, mk)
        h = tl.load(h_ptr + kk, mask=mk, other=0.0).to(tl.float32)
        hb = h.to(tl.bfloat16).to(tl.float32)
        acc += tl.sum(w * hb[None, :], axis=1)
        hn2 += tl.sum(h * h, axis=0)
        hq2 += tl.sum((h - hb) * (h - hb), axis=0)
    _epilogue(acc[None, :], tl.arange(0, 1), rn, M, N, hn2, hq2, scale_ptr, err_ptr, qn_ptr, mk_ptr, a_ptr, pass_ptr,
              arith, acc_k)


@triton.autotune(configs=CONFIGS, key=["N", "K"])
@triton.jit
def _screen_tile(h_ptr, q_ptr, scale_ptr, err_ptr, qn_ptr, mk_ptr, a_ptr, pass_ptr, M, N, K, arith, acc_k,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Up to 16 positions: one tensor-core tile of 16 positions against BLOCK_N rows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, 16)
    mn, mm = rn < N, rm < M
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    hn2 = tl.zeros((16,), dtype=tl.float32)
    hq2 = tl.zeros((16,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mk = kk < K
        h = tl.load(h_ptr + rm[:, None] * K + kk[None, :], mask=mm[:, None] & mk[None, :], other=0.0).to(tl.float32)
        hb = h.to(tl.bfloat16)
        w = _rows(q_ptr, rn, kk, K, mn, mk)
        # float32 operands (TF32 on the tensor cores holds BF16 and int8 values exactly; Triton's interpreter, unlike
        # the GPU, multiplies BF16 operands wrongly), float32 sums
        acc += tl.dot(hb.to(tl.float32), tl.trans(w))
        d = h - hb.to(tl.float32)
        hn2 += tl.sum(h * h, axis=1)
        hq2 += tl.sum(d * d, axis=1)
    _epilogue(acc, rm, rn, M, N, hn2, hq2, scale_ptr, err_ptr, qn_ptr, mk_ptr, a_ptr, pass_ptr, arith, acc_k)


def run(h, s, best, arith: float):
    """(approximate logits BF16 [positions, dropped], pass flags int8 [positions, dropped]) of the states h (any float
    dtype; multiplied in BF16), against the best kept logit per position (float32; +inf: nothing passes)."""
    import torch

    m, k = h.shape
    if m > MAX_POSITIONS:
        raise ValueError(f"the Triton screen takes at most {MAX_POSITIONS} positions a launch, not {m}")
    n = s["q"].shape[0]
    a = torch.empty((m, n), dtype=torch.bfloat16, device=h.device)
    passed = torch.empty((m, n), dtype=torch.int8, device=h.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    kernel = _screen_one if m == 1 else _screen_tile
    kernel[grid](h.contiguous(), s["q"], s["scale"], s["err"], s["qnorm"], best.float().contiguous(), a, passed, m, n,
                 k, arith, s["acc"])
    return a, passed


# ------------------------------------------------------------------------------------------------ the 5-bit screen
def pack5(rows) -> dict:
    """The 5-bit screen's data for these rows (float32 [n, hidden], on the GPU): "nib" uint8 [n, hidden / 2] (byte j
    of a group: value j in the low half, j + 16 in the high half), "plane" int32 [n, hidden / 32] (bit j of a group's
    word: value j's fifth bit), "sc" fp16 [n, hidden / 32]; values stored as q + 15 (0..30)."""
    import torch

    n, d = rows.shape
    s16, q = tail_lowbit.group_values(rows, 5)
    u = (q + LV5).to(torch.int32)  # [n, groups, 32]
    nib = ((u[..., :16] & 0x0F) | ((u[..., 16:] & 0x0F) << 4)).to(torch.uint8)
    bits = 2 ** torch.arange(32, dtype=torch.int64, device=rows.device)
    plane = ((u >> 4).to(torch.int64) * bits).sum(-1)
    plane = torch.where(plane >= 2 ** 31, plane - 2 ** 32, plane).to(torch.int32)  # the word's bits as int32
    nib, plane, sc = nib.reshape(n, d // 2).contiguous(), plane.contiguous(), s16.contiguous()
    return {"nib": nib, "plane": plane, "sc": sc, "rows": n, "hidden": d,
            "bytes": nib.numel() + 4 * plane.numel() + 2 * sc.numel()}


def dequantize5(s: dict):
    """The rows as the 5-bit kernels see them (float32 [rows, hidden]), unpacked from pack5()'s layout."""
    import torch

    n, d = s["rows"], s["hidden"]
    nib = s["nib"].reshape(n, d // 32, 16)
    u = torch.cat([nib & 0x0F, nib >> 4], -1).to(torch.int32)  # [n, groups, 32]
    u = u | (((s["plane"][..., None] >> torch.arange(32, device=nib.device, dtype=torch.int32)) & 1) << 4)
    return ((u - LV5).float() * s["sc"].float()[..., None]).reshape(n, d)


def coefficients(hidden: int) -> tuple[float, float, float]:
    """(c_one, c_half, c_delta): the bounds sum_g s_g c_one |h_g|_1 (one position, h in float32) and sum_g s_g (c_half
    |h_g|_1 + c_delta |h_g - h^_g|_1) (a tile, h^ = h in BF16). Each holds 1/2 |w - s q| per value with float32's
    rounding of w / s (tail_lowbit.WEIGHT_SLACK) and the float32 products' and sums' rounding, all with the bound's own
    sums' slack (tail_lowbit.SUM_SLACK):
      - one position: each value taken as v = 1 + u / 32 (u = q + 15 in 0..30; v exact in float32), v h rounded once
        and summed over a group in any order, then 32 (that sum - sum(h_g)) - 15 sum(h_g), then over the groups:
        each step's rounding is below 2^-24 of terms no larger than 128 |h_g|_1, so (32 + groups + 16) 2^-17 of
        sum_g s_g |h_g|_1;
      - a tile: the tensor cores multiply exactly (h^ has 8 significant bits, each s q split into two parts of at
        most 10, float32 holds them whole in TF32) and sum in float32 in an order of their own: (hidden + groups +
        8) 2^-23 of |s q h^| <= 15 s_g (|h_g|_1 + |h_g - h^_g|_1)."""
    groups = hidden // tail_lowbit.GROUP
    slack = 1 + tail_lowbit.SUM_SLACK
    half = 0.5 * (1 + tail_lowbit.WEIGHT_SLACK)
    g_one = (tail_lowbit.GROUP + groups + 16) * 2.0 ** -17
    g_tile = (hidden + groups + 8) * 2.0 ** -23
    return (half + g_one) * slack, (half + LV5 * g_tile) * slack, LV5 * (1 + g_tile) * slack


@triton.jit
def _epilogue5(acc, bnd, rm, rn, M, N, mk_ptr, a_ptr, pass_ptr, bound_ptr, arith, WANT_BOUND: tl.constexpr):
    """Write the estimates (BF16; the bound covers their rounding) and the pass flags (and the bounds)."""
    mn = rn < N
    best = tl.load(mk_ptr + rm, mask=rm < M, other=0.0)
    t = tl.where(best == float("inf"), best, best - arith * tl.abs(best))
    bound = bnd + arith * tl.abs(acc)
    ok = (rm < M)[:, None] & mn[None, :]
    offs = rm.to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(a_ptr + offs, acc.to(tl.bfloat16), mask=ok)
    tl.store(pass_ptr + offs, (acc + bound >= t[:, None]).to(tl.int8), mask=ok)
    if WANT_BOUND:
        tl.store(bound_ptr + offs, bound, mask=ok)


@triton.jit
def _values5(nib_ptr, plane_ptr, sc_ptr, r64, gg, rj, K, groups, mn, mg):
    """Rows r64, groups gg: (v = 1 + u / 32 of the low halves and of the high halves, float32 [rows, groups, 16], u in
    0..30, made from the bits without an integer-to-float conversion; the scales float32 [rows, groups])."""
    m2 = mn[:, None] & mg[None, :]
    m3 = m2[:, :, None] & (rj < 16)[None, None, :]
    nib = tl.load(nib_ptr + r64[:, None, None] * (K // 2) + (gg[:, None] * 16 + rj[None, :])[None, :, :], mask=m3,
                  other=0).to(tl.int32)
    word = tl.load(plane_ptr + r64[:, None] * groups + gg[None, :], mask=m2, other=0)[:, :, None]
    one = 0x3F800000  # 1.0: u's five bits go to the top of the mantissa
    v_lo = (one | ((nib & 15) << 18) | (((word >> rj[None, None, :]) & 1) << 22)).to(tl.float32, bitcast=True)
    v_hi = (one | ((nib >> 4) << 18) | (((word >> (rj + 16)[None, None, :]) & 1) << 22)).to(tl.float32, bitcast=True)
    s = tl.load(sc_ptr + r64[:, None] * groups + gg[None, :], mask=m2, other=0.0).to(tl.float32)
    return v_lo, v_hi, s


@triton.autotune(configs=CONFIGS5_ONE, key=["N", "K"])
@triton.jit
def _screen5_one(h_ptr, nib_ptr, plane_ptr, sc_ptr, mk_ptr, a_ptr, pass_ptr, bound_ptr, M, N, K, arith, c_one,
                 LV: tl.constexpr, WANT_BOUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """One position: BLOCK_N rows, BLOCK_G groups at a time, on the CUDA cores; h in float32 (no rounding of h):
    sum_g s_g (32 (v_g . h_g - sum(h_g)) - 15 sum(h_g)) = sum_g s_g q_g . h_g."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    r64 = rn.to(tl.int64)
    groups = K // 32
    rg = tl.arange(0, BLOCK_G)
    rj = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    bnd = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for g0 in range(0, groups, BLOCK_G):
        gg = g0 + rg
        mg = gg < groups
        v_lo, v_hi, s = _values5(nib_ptr, plane_ptr, sc_ptr, r64, gg, rj, K, groups, mn, mg)
        k_lo = gg[:, None] * 32 + rj[None, :]
        mh = mg[:, None] & (rj < 16)[None, :]
        h_lo = tl.load(h_ptr + k_lo, mask=mh, other=0.0).to(tl.float32)
        h_hi = tl.load(h_ptr + k_lo + 16, mask=mh, other=0.0).to(tl.float32)
        dot = tl.sum(v_lo * h_lo[None, :, :] + v_hi * h_hi[None, :, :], axis=2)
        hsum = tl.sum(h_lo + h_hi, axis=1)[None, :]
        part = 32 * (dot - hsum) - LV * hsum  # [BLOCK_N, BLOCK_G]
        acc += tl.sum(s * part, axis=1)
        bnd += tl.sum(s * tl.sum(tl.abs(h_lo) + tl.abs(h_hi), axis=1)[None, :], axis=1)
    _epilogue5(acc[None, :], c_one * bnd[None, :], tl.arange(0, 1), rn, M, N, mk_ptr, a_ptr, pass_ptr, bound_ptr,
               arith, WANT_BOUND)


@triton.jit
def _split_dot(b, q, s, BLOCK_N: tl.constexpr, WIDTH: tl.constexpr):
    """b [16, WIDTH] (BF16 values) times the rows s q ([BLOCK_N, groups, 16] values, [BLOCK_N, groups] scales) on the
    tensor cores, exactly: s = s1 + s2 with s1 its top 6 significant bits, so s1 q and s2 q fit TF32 whole."""
    s1 = (s.to(tl.int32, bitcast=True) & -262144).to(tl.float32, bitcast=True)  # 0xFFFC0000: sign, exponent, 5 bits
    w1 = tl.reshape(q * s1[:, :, None], (BLOCK_N, WIDTH))
    w2 = tl.reshape(q * (s - s1)[:, :, None], (BLOCK_N, WIDTH))
    return tl.dot(b, tl.trans(w1)) + tl.dot(b, tl.trans(w2))


@triton.autotune(configs=CONFIGS5_TILE, key=["N", "K"])
@triton.jit
def _screen5_tile(h_ptr, nib_ptr, plane_ptr, sc_ptr, mk_ptr, a_ptr, pass_ptr, bound_ptr, M, N, K, arith, c_half,
                  c_delta, LV: tl.constexpr, WANT_BOUND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_G: tl.constexpr):
    """Up to 16 positions: 16 positions (h in BF16) against BLOCK_N rows, BLOCK_G groups at a time, on the tensor
    cores (_split_dot)."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mn = rn < N
    r64 = rn.to(tl.int64)
    rm = tl.arange(0, 16)
    mm = rm < M
    rg = tl.arange(0, BLOCK_G)
    rj = tl.arange(0, 16)
    groups = K // 32
    acc = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    bnd = tl.zeros((16, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, groups, BLOCK_G):
        gg = g0 + rg
        mg = gg < groups
        v_lo, v_hi, s = _values5(nib_ptr, plane_ptr, sc_ptr, r64, gg, rj, K, groups, mn, mg)
        hrow = h_ptr + rm[:, None, None] * K + (gg[:, None] * 32 + rj[None, :])[None, :, :]
        mh = mm[:, None, None] & mg[None, :, None] & (rj < 16)[None, None, :]
        h_lo = tl.load(hrow, mask=mh, other=0.0).to(tl.float32)  # [16, BLOCK_G, 16]
        h_hi = tl.load(hrow + 16, mask=mh, other=0.0).to(tl.float32)
        b_lo = h_lo.to(tl.bfloat16).to(tl.float32)
        b_hi = h_hi.to(tl.bfloat16).to(tl.float32)
        acc += _split_dot(tl.reshape(b_lo, (16, BLOCK_G * 16)), 32 * v_lo - (32 + LV), s, BLOCK_N, BLOCK_G * 16)
        acc += _split_dot(tl.reshape(b_hi, (16, BLOCK_G * 16)), 32 * v_hi - (32 + LV), s, BLOCK_N, BLOCK_G * 16)
        beta = c_half * tl.sum(tl.abs(h_lo) + tl.abs(h_hi), axis=2) \
            + c_delta * tl.sum(tl.abs(h_lo - b_lo) + tl.abs(h_hi - b_hi), axis=2)  # [16, BLOCK_G]
        bnd += tl.sum(beta[:, None, :] * s[None, :, :], axis=2)
    _epilogue5(acc, bnd, rm, rn, M, N, mk_ptr, a_ptr, pass_ptr, bound_ptr, arith, WANT_BOUND)


def run5(h, s, best, arith: float, want_bound: bool = False):
    """(estimates BF16 [positions, rows], pass flags int8 [positions, rows], bounds float32 or None) of the 5-bit
    screen (pack5()) for states h (any float dtype, at most MAX_POSITIONS) against the best kept logit per position
    (float32; +inf: nothing passes); each bound covers its estimate's BF16 rounding."""
    import torch

    m, k = h.shape
    if m > MAX_POSITIONS:
        raise ValueError(f"the Triton screen takes at most {MAX_POSITIONS} positions a launch, not {m}")
    n = s["rows"]
    a = torch.empty((m, n), dtype=torch.bfloat16, device=h.device)
    passed = torch.empty((m, n), dtype=torch.int8, device=h.device)
    bound = torch.empty((m, n), dtype=torch.float32, device=h.device) if want_bound else passed
    c_one, c_half, c_delta = coefficients(k)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (h.contiguous(), s["nib"], s["plane"], s["sc"], best.float().contiguous(), a, passed, bound, m, n, k, arith)
    if m == 1:
        _screen5_one[grid](*args, c_one, LV=LV5, WANT_BOUND=want_bound)
    else:
        _screen5_tile[grid](*args, c_half, c_delta, LV=LV5, WANT_BOUND=want_bound)
    return a, passed, bound if want_bound else None
