"""The instructions of the lab GEMV's K loop, per weight, as an H100 runs them: Triton compiles the kernel for sm_90 on
this machine (its own ptxas, no GPU needed), with the divisibility a GPU call specializes on, and its cuobjdump prints
the SASS; the loop is the span of the backward branch, and its instructions are counted by opcode.

    python -m scripts.levers.kernels.sass                       # the stream form's and the pairs form's tiles
    python -m scripts.levers.kernels.sass --form stream --tile 16,4,1,4,1

Per weight = the loop's instructions / the weights one thread handles a step (the tile's words a step / its threads
x 8). A count, not a speed: the GEMM microbench times them.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import dataclass

LINE = re.compile(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
BRANCH = re.compile(r"BRA\s+(?:`?\(?\.L_x_\d+\)?|0x([0-9a-f]+))")


class SassError(RuntimeError):
    """This Triton cannot compile ahead of time or has no cuobjdump; one line."""


@dataclass(frozen=True)
class Loop:
    instructions: int
    per_weight: float
    opcodes: dict[str, int]


def opcode(text: str) -> str:
    """The opcode of one SASS instruction ('@!P0 LDG.E.128 R8, …' -> 'LDG')."""
    words = [w for w in text.split() if not w.startswith("@")]
    return words[0].split(".")[0] if words else ""


def loops(sass: str) -> list[list[str]]:
    """The instruction texts of each loop body (from a backward branch's target to the branch)."""
    body = [(int(m.group(1), 16), m.group(2)) for m in map(LINE.match, sass.splitlines()) if m]
    out = []
    for addr, text in body:
        b = BRANCH.search(text)
        if b and b.group(1) and int(b.group(1), 16) < addr:
            lo = int(b.group(1), 16)
            out.append([t for a, t in body if lo <= a <= addr])
    return out


def stream_signature() -> dict:
    """gemv_stream's argument types as a served call passes them (int32 input pairs, a BF16 output)."""
    return {"x_ptr": "*i32", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": "*bf16", "N": "i32", "K": "i32",
            "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}


def gemv_signature(pairs: bool) -> dict:
    """gemv's argument types (the pairs form takes the inputs' BF16 bits as int16; float32 sums out)."""
    return {"x_ptr": "*i16" if pairs else "*bf16", "w_ptr": "*i32", "s_ptr": "*bf16", "y_ptr": "*fp32", "M": "i32",
            "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_sn": "i32", "stride_ym": "i32"}


def aligned(sig: dict) -> tuple[str, ...]:
    """The arguments a GPU call specializes as 16-divisible here: all but the scales' row stride (K/128)."""
    return tuple(n for n in sig if n != "stride_sn")


def compile_sm90(fn, sig: dict, consts: dict, num_warps: int = 4, aligned: tuple[str, ...] = ()) -> dict:
    """Triton's sm_90 compile of a jit function on this machine (its own ptxas), `aligned` arguments marked as a GPU
    call specializes them (16-byte aligned pointers, integers that are multiples of 16): its asm (ptx, cubin)."""
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except ImportError as e:
        raise SassError(f"this Triton cannot compile ahead of time: {e}") from e
    sig = {**sig, **{name: "constexpr" for name in consts}}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in aligned}
    return triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs),
                          target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps}).asm


def compile_sass(fn, sig: dict, consts: dict, num_warps: int, aligned: tuple[str, ...]) -> str:
    """The sm_90 SASS of a jit function (its cubin through Triton's cuobjdump)."""
    import triton

    cubin = compile_sm90(fn, sig, consts, num_warps, aligned)["cubin"]
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        raise SassError(f"no cuobjdump in this Triton ({tool})")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([tool, "-sass", f.name], capture_output=True, text=True, check=True).stdout


def stream_loop(block_n: int, groups: int, split_k: int = 1, num_warps: int = 4, ahead: int = 1) -> Loop:
    """The stream form's K loop for one tile (a BF16 output: the served path)."""
    from scripts.levers.kernels import gemv_kernel

    sig = stream_signature()
    consts = {"BLOCK_N": block_n, "GROUPS": groups, "SPLIT_K": split_k, "AHEAD": ahead, "EMULATE": False}
    sass = compile_sass(gemv_kernel.gemv_stream, sig, consts, num_warps, aligned(sig))
    return _loop(sass, block_n * groups * 16 * 8 / (num_warps * 32))


def pairs_loop(block_n: int, block_k: int, split_k: int = 1, num_warps: int = 4) -> Loop:
    """The pairs form's K loop for one tile at M = 1."""
    from scripts.levers.kernels import gemv_kernel

    sig = gemv_signature(pairs=True)
    consts = {"M_PAD": 1, "BLOCK_N": block_n, "BLOCK_K": block_k, "SPLIT_K": split_k, "GROUP_K": 128, "PAIRS": True,
              "EMULATE": False}
    sass = compile_sass(gemv_kernel.gemv, sig, consts, num_warps, aligned(sig))
    return _loop(sass, block_n * block_k / (num_warps * 32))


def _loop(sass: str, weights_a_thread: float) -> Loop:
    found = loops(sass)
    if not found:
        raise SassError("no loop in the SASS")
    body = max(found, key=len)
    return Loop(len(body), len(body) / weights_a_thread, dict(Counter(opcode(t) for t in body).most_common()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--form", choices=("stream", "pairs"), help="one form (with --tile) instead of the default list")
    p.add_argument("--tile", help="stream: rows,groups,split,warps,ahead; pairs: rows,block_k,split,warps")
    args = p.parse_args(argv)
    if args.form and not args.tile:
        p.error("--form needs --tile")
    try:
        ints = [int(x) for x in args.tile.split(",")] if args.tile else []
    except ValueError:
        p.error(f"--tile {args.tile}: integers separated by commas")
    todo = [(args.form, ints)] if args.form else [
        ("stream", [16, 4, 1, 4, 1]), ("stream", [16, 4, 1, 4, 2]), ("stream", [32, 4, 1, 8, 1]),
        ("stream", [64, 4, 1, 4, 1]), ("stream", [8, 4, 1, 2, 1]), ("stream", [16, 4, 1, 2, 1]),
        ("pairs", [32, 512, 1, 4]), ("pairs", [16, 512, 1, 4])]
    try:
        for form, tile in todo:
            loop = (stream_loop if form == "stream" else pairs_loop)(*tile)
            top = ", ".join(f"{k} {v}" for k, v in list(loop.opcodes.items())[:8])
            print(f"{form} {','.join(map(str, tile))}: {loop.instructions} instructions a step, "
                  f"{loop.per_weight:.2f} a weight; shuffles {loop.opcodes.get('SHFL', 0)}; {top}")
    except (SassError, TypeError) as e:
        print(f"error: {str(e).splitlines()[0]}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
