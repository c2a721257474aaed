"""The exact tail's screen as one Triton kernel on a GPU ("triton-w8a16" in tail.KERNELS): the int8 rows read once,
dequantized in registers, multiplied by h rounded to BF16 with float32 sums (the weight-only kernel's arithmetic, so
the same bound), and in the same kernel |h|, |h - h^|, each row's bound and its pass against the best kept logit; it
writes the approximate logits (BF16) and the pass flags, nothing else, in one launch. torch._int_mm
("torch-int-mm") needs five more kernels for the quantization of h, the scales and the pass, which on an H200 cost
more than its product (results/vocab/qwen35-4b/screen-time-65536-cuda-20261127.json).

Two kernels share the epilogue: one position (a decode step at c=1) is a matrix-vector product on the CUDA cores;
2 to 16 positions are one tensor-core tile of 16 positions against BLOCK_N rows (on an H200 the per-position loop of
the first took 0.9 ms at 8 positions, the tile 0.28 ms).

Imported only where the screen runs on a GPU with Triton; tail.py holds the bound and its check.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

MAX_POSITIONS = 16  # positions a launch takes (a decode step of up to 16 sequences)
CONFIGS = [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
           for bn, bk, w in ((16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8), (64, 128, 4), (128, 128, 8))]
if os.environ.get("TRITON_INTERPRET") == "1":  # Triton's CPU interpreter (the tests): one config, nothing to time
    CONFIGS = [triton.Config({"BLOCK_N": 32, "BLOCK_K": 32})]


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
