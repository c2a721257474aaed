"""The Triton kernel of w4a16_gemv (its docstring says how it works), in a module of its own: Triton's interpreter
patches `tl` where a kernel's module holds it, and importing w4a16_gemv needs no Triton."""

from __future__ import annotations

import triton
import triton.language as tl

from scripts.levers.kernels.w4a16_gemv import candidates


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
    ms = tl.arange(0, M_PAD)
    shifts = (tl.arange(0, 8) * 4)[None, None, :]
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    words_per_group: tl.constexpr = GROUP_K // 8
    lane = (tl.arange(0, BLOCK_K // 8) * 8)[:, None] + tl.arange(0, 8)[None, :]  # input 8i + j at [i, j]
    for k0 in range(k_lo, k_lo + span, BLOCK_K):
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + words[None, :], mask=row_ok[:, None], other=0)
        nib = (packed[:, :, None] >> shifts) & 0xF  # BLOCK_N x BLOCK_K/8 x 8, kept in the words' own layout
        w = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # (2^23 + q + 8) - (2^23 + 8) = q
        # each word's group scale (16 words share one: read from L1 after the first)
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + (words // words_per_group)[None, :], mask=row_ok[:, None],
                        other=0.0).to(tl.float32)
        cols = k0 + lane
        for m in tl.static_range(M_PAD):
            xm = tl.load(x_ptr + m * stride_xm + cols, mask=(cols < K) & (cols * 0 + m < M), other=0.0).to(tl.float32)
            per_word = tl.sum(w * xm[None, :, :], axis=2)  # BLOCK_N x BLOCK_K/8
            row_sum = tl.sum(per_word * scale, axis=1)  # BLOCK_N
            acc += tl.where(ms[:, None] == m, row_sum[None, :], 0.0)
    out = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    ok = (ms[:, None] < M) & row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)



gemv_tuned = triton.autotune(
    configs=[triton.Config({"BLOCK_N": c.block_n, "BLOCK_K": c.block_k, "SPLIT_K": c.split_k},
                           num_warps=c.num_warps, num_stages=c.num_stages)
             for c in {c for k in (2560, 5120, 6144, 9216, 17408) for c in candidates(k)}],
    key=["M_PAD", "N", "K"],
    prune_configs_by={"early_config_prune": lambda cfgs, named, **kw: [
        c for c in cfgs if named["K"] % (c.kwargs["BLOCK_K"] * c.kwargs["SPLIT_K"]) == 0]},
    reset_to_zero=["y_ptr"],
)(gemv)
