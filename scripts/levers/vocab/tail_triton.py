"""The exact tail's screen as one Triton kernel on a GPU ("triton-w8a16" in tail.KERNELS): the int8 rows read once,
dequantized in registers, multiplied by h in BF16 with float32 sums (the weight-only kernel's arithmetic, so the same
bound), and each row's bound and pass against the best kept logit computed in the same kernel; it writes the
approximate logits (BF16) and the pass flags, nothing else. torch._int_mm ("torch-int-mm") needs five more kernels
for the quantization of h, the scales and the pass, which on an H200 cost more than its product
(results/vocab/qwen35-4b/screen-time-65536-cuda-20261127.json).

Imported only where the screen runs on a GPU with Triton; tail.py holds the bound and its check.
"""

from __future__ import annotations

import triton
import triton.language as tl

BLOCK_M = 16  # positions per tile: tl.dot takes 16 rows at least; a step of up to 16 positions is one tile


@triton.autotune(
    configs=[triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
             for bn, bk, w, st in ((64, 128, 4, 4), (64, 256, 4, 3), (128, 128, 4, 4), (128, 256, 8, 3),
                                   (32, 256, 4, 4), (256, 64, 8, 4))],
    key=["N", "K"])
@triton.jit
def _screen(h_ptr, q_ptr, scale_ptr, err_ptr, qn_ptr, hn_ptr, hq_ptr, t_ptr, a_ptr, pass_ptr, M, N, K, arith,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    mn, mm = rn < N, rm < M
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        h = tl.load(h_ptr + rm[:, None] * K + kk[None, :], mask=mm[:, None] & (kk[None, :] < K), other=0.0)
        w = tl.load(q_ptr + rn[:, None] * K + kk[None, :], mask=mn[:, None] & (kk[None, :] < K), other=0)
        acc += tl.dot(h, tl.trans(w.to(tl.bfloat16)))
    a = acc * tl.load(scale_ptr + rn, mask=mn, other=0.0)[None, :]
    hn = tl.load(hn_ptr + rm, mask=mm, other=0.0)
    hq = tl.load(hq_ptr + rm, mask=mm, other=0.0)
    t = tl.load(t_ptr + rm, mask=mm, other=0.0)
    err = tl.load(err_ptr + rn, mask=mn, other=0.0)
    qn = tl.load(qn_ptr + rn, mask=mn, other=0.0)
    bound = hn[:, None] * err[None, :] + hq[:, None] * qn[None, :] + arith * tl.abs(a)
    ok = mm[:, None] & mn[None, :]
    offs = rm[:, None] * N + rn[None, :]
    tl.store(a_ptr + offs, a.to(tl.bfloat16), mask=ok)
    tl.store(pass_ptr + offs, (a + bound >= t[:, None]).to(tl.int8), mask=ok)


def run(hb, s, hn, hq, t, arith: float):
    """(approximate logits BF16 [positions, dropped], pass flags int8 [positions, dropped]) of BF16 states hb."""
    import torch

    m, k = hb.shape
    if m > BLOCK_M:
        raise ValueError(f"the Triton screen takes at most {BLOCK_M} positions a call, not {m}")
    n = s["q"].shape[0]
    a = torch.empty((m, n), dtype=torch.bfloat16, device=hb.device)
    passed = torch.empty((m, n), dtype=torch.int8, device=hb.device)
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _screen[grid](hb, s["q"], s["scale"], s["err"], s["qnorm"], hn, hq, t, a, passed, m, n, k, arith,
                  BLOCK_M=BLOCK_M)
    return a, passed
