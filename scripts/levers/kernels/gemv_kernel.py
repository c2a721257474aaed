"""The Triton kernel of w4a16_gemv (its docstring says how it works), in a module of its own: Triton's interpreter
patches `tl` where a kernel's module holds it, and importing w4a16_gemv needs no Triton."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def gemv(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
         M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
         GROUP_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    span = K // SPLIT_K
    k_lo = pid_k * span
    groups: tl.constexpr = BLOCK_K // GROUP_K
    ms = tl.arange(0, M_PAD)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + span, BLOCK_K):
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + words[None, :], mask=row_ok[:, None], other=0)
        nib = (packed[:, :, None] >> shifts) & 0xF  # BLOCK_N x BLOCK_K/8 x 8: input 8i + j at [:, i, j]
        w = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # (2^23 + q + 8) - (2^23 + 8) = q
        w = tl.reshape(w, (BLOCK_N, groups, GROUP_K))
        g = k0 // GROUP_K + tl.arange(0, groups)
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :], mask=row_ok[:, None], other=0.0)
        scale = scale.to(tl.float32)
        cols = k0 + tl.arange(0, BLOCK_K)
        for m in tl.static_range(M_PAD):
            xm = tl.load(x_ptr + m * stride_xm + cols, mask=(cols < K) & (cols * 0 + m < M), other=0.0).to(tl.float32)
            per_group = tl.sum(w * tl.reshape(xm, (1, groups, GROUP_K)), axis=2)  # BLOCK_N x groups
            row_sum = tl.sum(per_group * scale, axis=1)  # BLOCK_N
            acc += tl.where(ms[:, None] == m, row_sum[None, :], 0.0)
    out = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    ok = (ms[:, None] < M) & row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)
