"""The exact tail's screen as one Triton kernel on a GPU ("triton-w8a16" in tail.KERNELS): the int8 rows read once,
dequantized in registers, multiplied by h rounded to BF16 with float32 sums (the weight-only kernel's arithmetic, so
the same bound), and in the same kernel |h|, |h - h^|, each row's bound and its pass against the best kept logit; it
writes the approximate logits (BF16) and the pass flags, nothing else, in one launch. torch._int_mm
("torch-int-mm") needs five more kernels for the quantization of h, the scales and the pass, which on an H200 cost
more than its product (results/vocab/qwen35-4b/screen-time-65536-cuda-20261127.json).

A decode step has at most a few positions (tail.SCREEN_MAX_POSITIONS): the kernel is a matrix-vector product per
position over the same rows (CUDA cores, no tensor-core tile of 16 positions to fill), each program reading BLOCK_N
rows once for every position of the step.

Imported only where the screen runs on a GPU with Triton; tail.py holds the bound and its check.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_POSITIONS = 8  # positions a launch takes (a decode step of up to 8 sequences)


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w)
             for bn, bk, w in ((16, 512, 4), (32, 256, 4), (32, 512, 8), (64, 256, 8), (64, 128, 4), (128, 128, 8))],
    key=["N", "K", "BLOCK_M"])
@triton.jit
def _screen(h_ptr, q_ptr, scale_ptr, err_ptr, qn_ptr, mk_ptr, a_ptr, pass_ptr, M, N, K, arith, acc_k,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    rm = tl.arange(0, BLOCK_M)
    mn = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    hn2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    hq2 = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        mk = kk < K
        w = tl.load(q_ptr + rn[:, None] * K + kk[None, :], mask=mn[:, None] & mk[None, :], other=0).to(tl.float32)
        for m in tl.static_range(BLOCK_M):
            h = tl.load(h_ptr + m * K + kk, mask=mk & (kk * 0 + m < M), other=0.0).to(tl.float32)
            hb = h.to(tl.bfloat16).to(tl.float32)
            row = rm == m
            acc += tl.where(row[:, None], tl.sum(w * hb[None, :], axis=1)[None, :], 0.0)
            hn2 += tl.where(row, tl.sum(h * h, axis=0), 0.0)
            hq2 += tl.where(row, tl.sum((h - hb) * (h - hb), axis=0), 0.0)
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
    block_m = triton.next_power_of_2(m)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _screen[grid](h.contiguous(), s["q"], s["scale"], s["err"], s["qnorm"], best.float().contiguous(), a, passed, m,
                  n, k, arith, s["acc"], BLOCK_M=block_m)
    return a, passed
