"""The SASS count of the GEMV's K loop (scripts/levers/kernels/sass.py): its parsing on a few SASS lines, and the
stream form's loop as Triton compiles it for sm_90 here (no shuffle in it; the pairs form reduces every step)."""

from __future__ import annotations

import pytest

from scripts.levers.kernels import sass
from scripts.levers.kernels import w4a16_gemv as gemv_mod

TEXT = """
        /*0500*/                   MOV R1, c[0x0][0x28] ;                  /* 0x00000a0000017a02 */
        /*0510*/              @!P0 LDG.E.128 R8, desc[UR6][R8.64] ;          /* 0x0000000608088981 */
        /*0520*/                   HFMA2 R2, R3, R4, R5 ;                  /* 0x0000000403027231 */
        /*0530*/                   SHFL.BFLY PT, R6, R7, 0x8, 0x1f ;       /* 0x0d001f0007067f89 */
        /*0540*/               @P1 BRA 0x510 ;                             /* 0x0000000000001947 */
        /*0550*/                   EXIT ;                                  /* 0x000000000000794d */
"""


def test_a_loop_is_the_span_of_its_backward_branch():
    body = sass.loops(TEXT)
    assert len(body) == 1 and [sass.opcode(t) for t in body[0]] == ["LDG", "HFMA2", "SHFL", "BRA"]
    assert sass.loops(TEXT.replace("BRA 0x510", "BRA 0x550")) == []  # a forward branch is no loop


def test_the_stream_forms_loop_has_no_shuffle():
    pytest.importorskip("triton")
    if gemv_mod.interpreted():
        pytest.skip("TRITON_INTERPRET=1: Triton's jit runs the interpreter")
    try:
        stream = sass.stream_loop(16, 4)
        pairs = sass.pairs_loop(32, 512)
    except sass.SassError as e:
        pytest.skip(str(e))
    assert stream.opcodes.get("SHFL", 0) == 0 and pairs.opcodes.get("SHFL", 0) > 0
    assert stream.opcodes["HFMA2"] >= 8 * 16 * 4 * 16 // 128  # eight bf16x2 FMAs a word, the thread's words
    assert 1.0 < stream.per_weight < 8.0
