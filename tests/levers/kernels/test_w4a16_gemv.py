"""The lab's W4A16 GEMV against the product of the dequantized weights, run by Triton's interpreter on a CPU (the
same kernel the GPU compiles; its speed is the GEMM microbench's, never a test's). The interpreter must be chosen
before Triton is imported (its own jit functions, tl.zeros among them, are decorated then), so the kernel runs in a
fresh interpreter process: one for every case."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from scripts.common import paths
from scripts.levers.kernels import sass
from scripts.levers.kernels import w4a16_gemv as gemv_mod
from scripts.levers.kernels.w4a16_gemv import Config, GemvError, check, fits

CASES = [(1, Config(16, 256, 1)), (3, Config(16, 256, 2)), (8, Config(8, 512, 1)), (2, Config(32, 128, 4)), (1, None)]
# the pairs form, as the interpreter runs it (its float32 emulation of the PTX: the data movement, the nibbles' pairing
# with their inputs, the scales and split-K; the PTX itself is checked on a GPU by the microbench's comparison)
PAIRS = [(1, Config(16, 256, 1)), (3, Config(16, 256, 2)), (8, Config(8, 512, 1)), (2, Config(32, 128, 4))]
# the stream form: (M, N, K, tile): split-K, a last tile partly past N, steps of 1, 2 and 4 groups, K = 640 with no
# tile given (the interpreter takes the first candidate), two steps loaded ahead
STREAM = [(1, 40, 512, (16, 2, 1)), (3, 40, 1024, (32, 2, 2)), (1, 70, 1024, (64, 4, 2)), (2, 40, 1024, (16, 1, 8)),
          (1, 40, 640, None), (1, 40, 1536, (16, 4, 1, 4, 2)), (1, 40, 256, (16, 2, 1, 4, 2))]  # 2 ahead: 3 steps, 1
RUN_STREAM = """
import json, sys
import torch
from scripts.levers.kernels.w4a16_gemv import StreamConfig, w4a16_gemv
from scripts.measure.gemm_bench import Weights, pack_compressed_tensors
out = []
for m, n, k, cfg, swap in json.loads(sys.argv[1]):
    w = Weights(n, k, [n], seed=m, device="cpu")
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    q = w.q.reshape(n, k // 8, 8)[:, :, [4, 5, 6, 7, 0, 1, 2, 3]].reshape(n, k) if swap else w.q
    y = w4a16_gemv(x, pack_compressed_tensors(q), w.s, config=cfg and StreamConfig(*cfg), form="stream")
    ref = w.reference(x)
    out.append({"shape": list(y.shape), "dtype": str(y.dtype),
                "err": float((y.float() - ref).abs().max() / ref.abs().max())})
print(json.dumps(out))
"""
RUN = """
import json, sys
import torch
from scripts.levers.kernels.w4a16_gemv import Config, w4a16_gemv
from scripts.measure.gemm_bench import Weights, pack_compressed_tensors
out = []
for m, cfg, swap, form in json.loads(sys.argv[1]):
    n, k = 40, (640 if cfg is None else 512)  # 40 rows: the last tile of 16 or 32 is partly outside N; K = 640: 5 groups
    w = Weights(n, k, [n], seed=m, device="cpu")
    x = torch.randn((m, k), generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    q = w.q.reshape(n, k // 8, 8)[:, :, [4, 5, 6, 7, 0, 1, 2, 3]].reshape(n, k) if swap else w.q
    y = w4a16_gemv(x, pack_compressed_tensors(q), w.s, config=cfg and Config(*cfg), form=form)  # None: 1st candidate
    ref = w.reference(x)
    out.append({"shape": list(y.shape), "dtype": str(y.dtype),
                "err": float((y.float() - ref).abs().max() / ref.abs().max())})
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def results():
    pytest.importorskip("triton")
    cases = [(m, c and [c.block_n, c.block_k, c.split_k], False, "float32") for m, c in CASES]
    cases += [(m, [c.block_n, c.block_k, c.split_k], False, "pairs") for m, c in PAIRS]
    cases.append((1, [16, 256, 1], True, "pairs"))  # the halves of each word swapped: another product
    cases.append((1, [16, 256, 1], True, "float32"))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", RUN, json.dumps(cases)], cwd=paths.ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def stream_results():
    pytest.importorskip("triton")
    cases = [list(c) + [False] for c in STREAM] + [[1, 40, 512, (16, 2, 1), True]]  # last: halves swapped
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    p = subprocess.run([sys.executable, "-c", RUN_STREAM, json.dumps(cases)], cwd=paths.ROOT, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("i", range(len(STREAM)))
def test_the_stream_form_matches_the_dequantized_product(stream_results, i):
    m, n = STREAM[i][:2]
    assert stream_results[i]["shape"] == [m, n] and stream_results[i]["dtype"] == "torch.bfloat16"
    assert stream_results[i]["err"] < 8e-3


def test_the_stream_form_catches_a_wrong_nibble_order(stream_results):
    assert stream_results[-1]["err"] > 0.05


def test_stream_tiles_split_k_into_whole_steps():
    for k in (640, 2560, 5120, 6144, 9216, 17408):
        cands = gemv_mod.stream_candidates(k)
        assert cands and all(gemv_mod.stream_fits(c, k) for c in cands)
        assert {c.block_n for c in cands} == {8, 16, 32, 64}
    assert {c.groups for c in gemv_mod.stream_candidates(5120) if c.split_k == 1} == {4, 8}  # 8: up to 32 rows
    assert {c.block_n for c in gemv_mod.stream_candidates(5120) if c.groups == 8} == {8, 16, 32}
    assert {c.ahead for c in gemv_mod.stream_candidates(5120)} == {1, 2}
    assert all(c.block_n <= 32 and c.split_k <= 2 for c in gemv_mod.stream_candidates(5120) if c.ahead == 2)
    assert {c.split_k for c in gemv_mod.stream_candidates(640)} == {1}  # 5 groups: no even split
    assert not gemv_mod.stream_fits(gemv_mod.StreamConfig(16, 4, 4), 5120)  # 40 groups are not 4 spans of 4-group steps
    torch = pytest.importorskip("torch")
    with pytest.raises(GemvError, match="whole steps"):
        gemv_mod.w4a16_gemv(torch.zeros((1, 640), dtype=torch.bfloat16), torch.zeros((16, 80), dtype=torch.int32),
                            torch.zeros((16, 5), dtype=torch.bfloat16), config=gemv_mod.StreamConfig(16, 2, 1),
                            form="stream")
    with pytest.raises(GemvError, match="takes a StreamConfig"):
        gemv_mod.w4a16_gemv(torch.zeros((1, 640), dtype=torch.bfloat16), torch.zeros((16, 80), dtype=torch.int32),
                            torch.zeros((16, 5), dtype=torch.bfloat16), config=Config(16, 128, 1), form="stream")


@pytest.mark.parametrize("i", range(len(CASES) + len(PAIRS)))
def test_matches_the_dequantized_product(results, i):
    m, _ = (CASES + PAIRS)[i]
    assert results[i]["shape"] == [m, 40] and results[i]["dtype"] == "torch.bfloat16"
    assert results[i]["err"] < 8e-3  # BF16 output rounding (2^-8 relative) over float32 sums


def test_a_wrong_nibble_order_is_caught(results):
    """The comparison can fail: weights packed with the halves of each word swapped give another product."""
    assert results[-1]["err"] > 0.05 and results[-2]["err"] > 0.05


def test_the_pairs_form_takes_bf16_only():
    torch = pytest.importorskip("torch")
    x = torch.zeros((1, 256), dtype=torch.float16)
    with pytest.raises(GemvError, match="BF16 inputs"):
        gemv_mod.w4a16_gemv(x, torch.zeros((16, 32), dtype=torch.int32), torch.zeros((16, 2)), form="pairs")
    with pytest.raises(GemvError, match="form 'half'"):
        gemv_mod.w4a16_gemv(x, torch.zeros((16, 32), dtype=torch.int32), torch.zeros((16, 2)), form="half")


def test_bad_shapes_are_one_line():
    with pytest.raises(GemvError, match="1 to 8 rows"):
        check(9, 16, 256, (16, 32), (16, 2))
    with pytest.raises(GemvError, match="multiple of the group size"):
        check(1, 16, 200, (16, 25), (16, 1))
    with pytest.raises(GemvError, match=r"weight_packed is \(16, 16\)"):
        check(1, 16, 256, (16, 16), (16, 2))
    with pytest.raises(GemvError, match=r"weight_scale is \(16, 4\)"):
        check(1, 16, 256, (16, 32), (16, 4))


def test_tiles_split_k_evenly():
    assert fits(Config(16, 256, 4), 5120) and fits(Config(32, 512, 2), 17408)
    assert not fits(Config(16, 512, 8), 5120)  # 5120 / 4096 is not whole
    assert all(fits(c, 17408) for c in gemv_mod.candidates(17408))
    assert gemv_mod.candidates(17408) and gemv_mod.candidates(2560)
    assert {c.block_k for c in gemv_mod.candidates(640)} == {128}  # not a multiple of 256: whole groups
    assert all(fits(c, 640) for c in gemv_mod.candidates(640))


def test_packed_weights_of_another_dtype_are_refused():
    torch = pytest.importorskip("torch")
    with pytest.raises(GemvError, match="expected torch.int32"):
        gemv_mod.w4a16_gemv(torch.zeros((1, 256), dtype=torch.bfloat16), torch.zeros((16, 32), dtype=torch.int64),
                            torch.zeros((16, 2), dtype=torch.bfloat16))


def test_the_autotuned_form_wraps_the_kernel_with_every_tile():
    """What a GPU call tunes over (built here without running: tuning needs a device)."""
    pytest.importorskip("triton")
    raw, tuned = gemv_mod._kernels()
    assert tuned.fn is raw and gemv_mod._kernels()[1] is tuned
    want = {(c.block_n, c.block_k, c.split_k) for k in (640, 2560, 5120, 6144, 9216, 17408)
            for c in gemv_mod.candidates(k)}
    got = {(c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.kwargs["SPLIT_K"]) for c in tuned.configs}
    assert got == want and len(got) >= 6


@pytest.mark.parametrize("pairs, m_pad, split_k", [(True, 1, 1), (True, 8, 4), (False, 1, 1), (False, 8, 4)])
def test_the_kernel_compiles_for_hopper(pairs, m_pad, split_k):
    """Triton compiles the kernel to an sm_90 cubin on a CPU (its own ptxas): the PTX blocks and the forms' constexpr
    branches, which the interpreter never compiles (2026-12-07: the first GPU run refused globals a jit function may
    not read)."""
    from scripts.levers.kernels import gemv_kernel

    sig = sass.gemv_signature(pairs)
    consts = {"M_PAD": m_pad, "BLOCK_N": 16, "BLOCK_K": 256, "SPLIT_K": split_k, "GROUP_K": 128, "PAIRS": pairs,
              "EMULATE": False}
    asm = compile_for_hopper(gemv_kernel.gemv, sig, consts)
    assert asm["cubin"]
    assert ("fma.rn.bf16x2" in asm["ptx"]) == pairs


def compile_for_hopper(fn, sig: dict, consts: dict, aligned: tuple[str, ...] = ()) -> dict:
    """sass.compile_sm90 (Triton's sm_90 compile on this CPU: ptx, cubin), skipped where this Triton cannot compile
    ahead of time or runs the interpreter."""
    pytest.importorskip("triton")
    if gemv_mod.interpreted():
        pytest.skip("TRITON_INTERPRET=1: Triton's jit runs the interpreter")
    try:
        return sass.compile_sm90(fn, sig, consts, aligned=aligned)
    except sass.SassError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("split_k", [1, 4])
def test_the_stream_form_compiles_for_hopper_with_wide_loads(split_k):
    """The stream form's cubin for sm_90, with the divisibility a GPU call specializes on (16-byte aligned pointers,
    strides and sizes that are multiples of 16): the weights must come in 128-bit loads and a step's products must be
    the PTX's (2026-12-07: without that specialization the pairs form loaded 32 bits a thread at a time)."""
    from scripts.levers.kernels import gemv_kernel

    sig = sass.stream_signature()
    consts = {"BLOCK_N": 64, "GROUPS": 4, "SPLIT_K": split_k, "AHEAD": 2 if split_k == 1 else 1, "EMULATE": False}
    ptx = compile_for_hopper(gemv_kernel.gemv_stream, sig, consts, aligned=sass.aligned(sig))["ptx"]
    assert "ld.global.v4.b32" in ptx and "fma.rn.bf16x2" in ptx
    assert ("add.noftz.bf16" in ptx) == (split_k > 1)  # split-K adds into the BF16 output: no float32 pass


def test_the_tuner_times_its_finalists_again_before_it_keeps_one():
    """The tile kept is the lowest median over both rounds of the finalists: a first round's lucky reading loses."""
    first = {"a": [1.0, 1.0, 1.0], "b": [1.1, 1.1, 1.1], "c": [1.2, 1.2, 1.2], "d": [5.0, 5.0, 5.0]}
    again = {"a": [2.0, 2.0, 2.0, 2.0], "b": [1.1, 1.1, 1.1], "c": [1.2, 1.2, 1.2]}
    asked = []

    def retime(tile):
        asked.append(tile)
        return again[tile]

    assert gemv_mod.fastest(first, retime, finalists=3) == "b"
    assert sorted(asked) == ["a", "b", "c"] and first["a"] == [1.0, 1.0, 1.0]  # "d" not again; the input kept
    assert gemv_mod.fastest(first, retime, finalists=0) == "a"
    assert gemv_mod.fastest({}, retime) is None
