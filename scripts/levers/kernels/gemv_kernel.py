"""The Triton kernel of w4a16_gemv (its docstring says how it works), in a module of its own: Triton's interpreter
patches `tl` where a kernel's module holds it, and importing w4a16_gemv needs no Triton."""

from __future__ import annotations

import triton
import triton.language as tl

# The unpack shared by both forms' PTX. Its constants: a nibble pair's mask, 128.0 twice (the magic the nibbles are
# OR-ed into), 1.0 twice and -136.0 twice. The blocks are constexpr globals: a jit function reads no other global.
_UNPACK_REGS = ["mov.b32 lab_m, 0x000F000F;", "mov.b32 lab_c, 0x43004300;", "mov.b32 lab_one, 0x3F803F80;",
                "mov.b32 lab_k, 0xC308C308;"]


def _unpack(word: str, j: int, dst: str) -> list[str]:
    """PTX lines that put nibble pair j of `word` (nibbles j and j + 4) into `dst` as a bf16x2 of q = u - 8."""
    src = word
    lines = []
    if j:
        lines.append(f"shr.u32 lab_t, {word}, {4 * j};")
        src = "lab_t"
    return lines + [f"lop3.b32 {dst}, {src}, lab_m, lab_c, 0xea;", f"fma.rn.bf16x2 {dst}, {dst}, lab_one, lab_k;"]


def _asm(regs: str, lines: list[str]) -> str:
    """A PTX block: its registers, the unpack's constants, then `lines`."""
    return "{\n" + "\n".join([f".reg .b32 {regs};", *_UNPACK_REGS, *lines]) + "\n}"


# The pairs form (w4a16_gemv(..., form="pairs"), gemv's PAIRS): the unpack and the products on packed BF16 pairs, in
# PTX (sm_80+). A word's nibbles j and j + 4 (inputs 8i + j and 8i + j + 4) become one bf16x2 of 128 + u each by one
# LOP3 (u into the mantissa of 128.0), and one bf16x2 FMA takes 136 off both (q = u - 8, exact in BF16); four bf16x2
# FMAs then multiply the word's eight weights with its eight inputs, summed in BF16 pairs, and the pair is added in
# float32. Per weight that is ~2.4 instructions where the float32 form needs ~4.
UNPACK_ASM = tl.constexpr(_asm("lab_t, lab_m, lab_c, lab_one, lab_k",
                               [x for j in range(4) for x in _unpack("$4", j, f"${j}")]))
DOT_ASM = tl.constexpr("""{
.reg .b32 lab_a, lab_z, lab_lo, lab_hi;
mov.b32 lab_z, 0;
fma.rn.bf16x2 lab_a, $1, $5, lab_z;
fma.rn.bf16x2 lab_a, $2, $6, lab_a;
fma.rn.bf16x2 lab_a, $3, $7, lab_a;
fma.rn.bf16x2 lab_a, $4, $8, lab_a;
shl.b32 lab_lo, lab_a, 16;
and.b32 lab_hi, lab_a, 0xFFFF0000;
add.f32 $0, lab_lo, lab_hi;
}""")


@triton.jit
def _bf16_bits_to_f32(h):
    """BF16 bits (int32, low 16 bits) as float32: exact."""
    return (h << 16).to(tl.float32, bitcast=True)


@triton.jit
def _word_dot(packed, x_ptr_m, base, EMULATE: tl.constexpr):
    """Per word of `packed` (BLOCK_N x WORDS int32): the sum of its eight weights (q = u - 8) times the inputs
    x[base + j] (j = 0..7, base = the word's first input), float32. EMULATE: the same sum with float32 products, for
    Triton's interpreter (which runs no PTX)."""
    lo0 = tl.load(x_ptr_m + base + 0).to(tl.int32) & 0xFFFF
    lo1 = tl.load(x_ptr_m + base + 1).to(tl.int32) & 0xFFFF
    lo2 = tl.load(x_ptr_m + base + 2).to(tl.int32) & 0xFFFF
    lo3 = tl.load(x_ptr_m + base + 3).to(tl.int32) & 0xFFFF
    hi0 = tl.load(x_ptr_m + base + 4).to(tl.int32) & 0xFFFF
    hi1 = tl.load(x_ptr_m + base + 5).to(tl.int32) & 0xFFFF
    hi2 = tl.load(x_ptr_m + base + 6).to(tl.int32) & 0xFFFF
    hi3 = tl.load(x_ptr_m + base + 7).to(tl.int32) & 0xFFFF
    if EMULATE:
        out = ((((packed >> 0) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(lo0)[None, :]
               + (((packed >> 16) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(hi0)[None, :]
               + (((packed >> 4) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(lo1)[None, :]
               + (((packed >> 20) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(hi1)[None, :]
               + (((packed >> 8) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(lo2)[None, :]
               + (((packed >> 24) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(hi2)[None, :]
               + (((packed >> 12) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(lo3)[None, :]
               + (((packed >> 28) & 0xF) - 8).to(tl.float32) * _bf16_bits_to_f32(hi3)[None, :])
    else:
        q0, q1, q2, q3 = tl.inline_asm_elementwise(UNPACK_ASM, "=r,=r,=r,=r,r", [packed],
                                                   dtype=(tl.int32, tl.int32, tl.int32, tl.int32), is_pure=True,
                                                   pack=1)
        out = tl.inline_asm_elementwise(
            DOT_ASM, "=f,r,r,r,r,r,r,r,r",
            [q0, q1, q2, q3, (lo0 | (hi0 << 16))[None, :], (lo1 | (hi1 << 16))[None, :],
             (lo2 | (hi2 << 16))[None, :], (lo3 | (hi3 << 16))[None, :]],
            dtype=tl.float32, is_pure=True, pack=1)
    return out


@triton.jit
def gemv(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
         M_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
         GROUP_K: tl.constexpr, PAIRS: tl.constexpr = False, EMULATE: tl.constexpr = False):
    """PAIRS: the pairs form (below; x_ptr then holds the inputs' BF16 bits as int16); else the float32 form."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    span = K // SPLIT_K
    k_lo = pid_k * span
    groups: tl.constexpr = BLOCK_K // GROUP_K
    ms = tl.arange(0, M_PAD)
    acc = tl.zeros((M_PAD, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_lo, k_lo + span, BLOCK_K):
        words = k0 // 8 + tl.arange(0, BLOCK_K // 8)
        packed = tl.load(w_ptr + rows[:, None] * stride_wn + words[None, :], mask=row_ok[:, None], other=0)
        if not PAIRS:
            shifts = (tl.arange(0, 8) * 4)[None, None, :]
            nib = (packed[:, :, None] >> shifts) & 0xF  # BLOCK_N x BLOCK_K/8 x 8: input 8i + j at [:, i, j]
            w = (nib | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0  # (2^23 + q + 8) - (2^23 + 8) = q
            w = tl.reshape(w, (BLOCK_N, groups, GROUP_K))
            cols = k0 + tl.arange(0, BLOCK_K)
        g = k0 // GROUP_K + tl.arange(0, groups)
        scale = tl.load(s_ptr + rows[:, None] * stride_sn + g[None, :], mask=row_ok[:, None], other=0.0)
        scale = scale.to(tl.float32)
        for m in tl.static_range(M_PAD):
            if PAIRS:
                xm_ptr = x_ptr + tl.where(m < M, m, 0) * stride_xm  # a padded row reads row 0 and is never stored
                dot = _word_dot(packed, xm_ptr, words * 8, EMULATE)  # BLOCK_N x BLOCK_K/8
                per_group = tl.sum(tl.reshape(dot, (BLOCK_N, groups, GROUP_K // 8)), axis=2)
            else:
                xm = tl.load(x_ptr + m * stride_xm + cols, mask=(cols < K) & (cols * 0 + m < M),
                             other=0.0).to(tl.float32)
                per_group = tl.sum(w * tl.reshape(xm, (1, groups, GROUP_K)), axis=2)  # BLOCK_N x groups
            row_sum = tl.sum(per_group * scale, axis=1)  # BLOCK_N
            acc += tl.where(ms[:, None] == m, row_sum[None, :], 0.0)
    out = y_ptr + ms[:, None] * stride_ym + rows[None, :]
    ok = (ms[:, None] < M) & row_ok[None, :]
    if SPLIT_K == 1:
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=ok)
    else:
        tl.atomic_add(out, acc, mask=ok)


# The stream form (w4a16_gemv(..., form="stream"), gemv_stream): a word's unpack and its dot with its eight inputs in
# one PTX block. $1 is the word, $2..$5 the inputs paired as the unpack pairs the nibbles: (8i + j, 8i + j + 4) in the
# low and high halves, j = 0..3. The two BF16 halves of the pair sum are added in float32.
def _word_dot_asm() -> str:
    """WORD_DOT_ASM's text: per nibble pair j (the word shifted by 4j), the unpack into a bf16x2 of q and one bf16x2
    FMA with input pair $(2 + j), summed in the pair; then the two halves added in float32."""
    lines = ["mov.b32 lab_a, 0;"]
    for j in range(4):
        lines += [*_unpack("$1", j, "lab_q"), f"fma.rn.bf16x2 lab_a, lab_q, ${2 + j}, lab_a;"]
    lines += ["shl.b32 lab_lo, lab_a, 16;", "and.b32 lab_hi, lab_a, 0xFFFF0000;", "add.f32 $0, lab_lo, lab_hi;"]
    return _asm("lab_t, lab_m, lab_c, lab_one, lab_k, lab_q, lab_a, lab_lo, lab_hi", lines)


WORD_DOT_ASM = tl.constexpr(_word_dot_asm())


@triton.jit
def _paired_dot(packed, p0, p1, p2, p3, EMULATE: tl.constexpr):
    """Per word of `packed`: its eight weights (q = u - 8) times the paired inputs p0..p3 (the low half of pj is input
    8i + j, the high half 8i + j + 4), float32. EMULATE: float32 products (Triton's interpreter runs no PTX)."""
    if EMULATE:
        out = tl.zeros(packed.shape, dtype=tl.float32)
        for j in tl.static_range(4):
            p = p0 if j == 0 else (p1 if j == 1 else (p2 if j == 2 else p3))
            lo = (((packed >> (4 * j)) & 0xF) - 8).to(tl.float32)
            hi = (((packed >> (4 * j + 16)) & 0xF) - 8).to(tl.float32)
            out += lo * _bf16_bits_to_f32(p & 0xFFFF) + hi * _bf16_bits_to_f32((p >> 16) & 0xFFFF)
    else:
        out = tl.inline_asm_elementwise(WORD_DOT_ASM, "=f,r,r,r,r,r", [packed, p0, p1, p2, p3], dtype=tl.float32,
                                        is_pure=True, pack=1)
    return out


@triton.jit
def gemv_stream(x_ptr, w_ptr, s_ptr, y_ptr, N, K, stride_xm, stride_wn, stride_sn, stride_ym,
                BLOCK_N: tl.constexpr, GROUPS: tl.constexpr, SPLIT_K: tl.constexpr, AHEAD: tl.constexpr = 1,
                EMULATE: tl.constexpr = False):
    """The stream form: x_ptr holds the inputs as int32 (BF16 pairs; stride_xm in pairs). Program (n, k, m) owns
    BLOCK_N rows, one of SPLIT_K spans of whole groups and input row m (a batch re-reads the weights, from L2 at
    best: the form is written for M = 1), and walks its span GROUPS groups (16 words a row each) at a time, the next
    step's words (AHEAD = 2: the next two steps') loaded before this step's products. Sums stay per word, scaled by
    the word's group scale, until the span ends: one reduction a program. y_ptr: the output in x's dtype, stored
    (SPLIT_K == 1) or added atomically into zeros (the order of the spans' BF16 additions varies from call to call,
    so with split-K the last bits of an output may too)."""
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m = tl.program_id(2)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows_read = tl.minimum(rows, N - 1)  # the last tile's rows past N read row N - 1 and are never stored
    steps = K // 128 // SPLIT_K // GROUPS
    g_lo = pid_k * steps * GROUPS
    gi = tl.arange(0, GROUPS)
    word = gi[:, None] * 16 + tl.arange(0, 16)[None, :]  # GROUPS x 16: a step's words, from its first
    w_tile = w_ptr + rows_read[:, None, None] * stride_wn + word[None, :, :]  # BLOCK_N x GROUPS x 16
    s_tile = s_ptr + rows_read[:, None] * stride_sn + gi[None, :]  # BLOCK_N x GROUPS
    x_tile = x_ptr + pid_m * stride_xm + word[:, :, None] * 4 + tl.arange(0, 4)[None, None, :]  # a word's 4 pairs
    acc = tl.zeros((BLOCK_N, GROUPS, 16), dtype=tl.float32)
    nxt = tl.load(w_tile + g_lo * 16)
    if AHEAD == 2:
        nxt2 = tl.load(w_tile + (g_lo + tl.minimum(1, steps - 1) * GROUPS) * 16)
    for step in range(steps):
        g = g_lo + step * GROUPS
        packed = nxt
        if AHEAD == 2:
            nxt = nxt2
            nxt2 = tl.load(w_tile + (g_lo + tl.minimum(step + 2, steps - 1) * GROUPS) * 16)
        else:  # the last step's words are loaded again at the end
            nxt = tl.load(w_tile + (g_lo + tl.minimum(step + 1, steps - 1) * GROUPS) * 16)
        scale = tl.load(s_tile + g).to(tl.float32)[:, :, None]
        # a word's inputs as int32 pairs: a0 (0 1), a1 (2 3), a2 (4 5), a3 (6 7); split takes the last axis, so pair
        # 2i + j is [i, j] and the first split gives the even pairs
        even, odd = tl.split(tl.reshape(tl.load(x_tile + g * 64), (GROUPS, 16, 2, 2)))
        a0, a2 = tl.split(even)
        a1, a3 = tl.split(odd)
        p0 = (a0 & 0xFFFF) | (a2 << 16)  # inputs (8i, 8i + 4)
        p1 = ((a0 >> 16) & 0xFFFF) | (a2 & -65536)  # (8i + 1, 8i + 5); -65536: 0xFFFF0000 as int32
        p2 = (a1 & 0xFFFF) | (a3 << 16)
        p3 = ((a1 >> 16) & 0xFFFF) | (a3 & -65536)
        acc += _paired_dot(packed, p0[None, :, :], p1[None, :, :], p2[None, :, :], p3[None, :, :], EMULATE) * scale
    out = tl.sum(tl.sum(acc, axis=2), axis=1)
    ok = rows < N
    if SPLIT_K == 1:
        tl.store(y_ptr + pid_m * stride_ym + rows, out.to(y_ptr.dtype.element_ty), mask=ok)
    else:  # the spans' sums added in the output's dtype (BF16 atomics on sm_90: no float32 buffer, no cast)
        tl.atomic_add(y_ptr + pid_m * stride_ym + rows, out.to(y_ptr.dtype.element_ty), mask=ok, sem="relaxed")
