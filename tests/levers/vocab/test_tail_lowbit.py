"""The low-bit screen's C kernel (scripts.levers.vocab.tail_lowbit): its layout (5 and 4 bits) against a plain
product, every code path this CPU can run (AVX-512 VNNI, AVX2, plain C, each built here) giving the same answer, the
served screen missing no row that could win, and its refusals."""

from __future__ import annotations

import pytest
import torch

from scripts.common.hardware import all_cpu_flags
from scripts.levers.vocab import tail, tail_lowbit

FLAGS = all_cpu_flags()


def rows_and_states(n: int = 1000, d: int = 96, m: int = 8, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(n, d, generator=g) * 0.05).to(torch.bfloat16).float()
    h = torch.randn(m, d, generator=g) * 3
    h[:, :4] *= 40  # a few large coordinates, as a final norm's output has
    return rows, h.to(torch.bfloat16)


@pytest.mark.parametrize("bits", [5, 4])
def test_packed_rows_round_trip_within_half_a_step_and_the_kernel_multiplies_them(bits):
    rows, h = rows_and_states()  # 1,000 rows: the last block of 16 is padded
    s = tail_lowbit.pack(rows, bits)
    deq = tail_lowbit.dequantize(s)
    step = rows.reshape(len(rows), -1, 32).abs().amax(-1) / tail_lowbit.LEVELS[bits]
    assert ((rows - deq).abs().reshape(len(rows), -1, 32) <= step[..., None] * 0.5 * (1 + 2 ** -9)).all()
    assert s["bytes"] == 1008 * 96 * bits // 8 + 1008 * 3 * 2
    hq = tail_lowbit.rounded(h, bits)
    for m in (1, 3, 8, 11):  # 11: two calls of the kernel
        est, passed, bound = tail_lowbit.run(h[:m].repeat(2, 1)[:m], s, torch.zeros(m), want_bound=True)
        ref = hq[:m].repeat(2, 1)[:m].double() @ deq.double().T
        assert torch.allclose(est.double(), ref, rtol=1e-5, atol=1e-4)
        assert torch.equal(passed, est + bound >= 0)
        exact = h[:m].repeat(2, 1)[:m].float() @ rows.T
        assert ((exact - est).abs() <= bound).all()


@pytest.mark.parametrize("march, isa, needs", [("native", None, set()), ("x86-64-v3", "avx2", {"avx2", "fma", "f16c"}),
                                               ("x86-64", "c", set())])
@pytest.mark.parametrize("bits", [5, 4])
def test_every_code_path_gives_the_same_estimates_and_passes(march, isa, needs, bits, monkeypatch):
    if not needs <= FLAGS:
        pytest.skip(f"this CPU lacks {sorted(needs - FLAGS)}")
    rows, h = rows_and_states(n=333, d=64)
    s = tail_lowbit.pack(rows, bits)
    ref = tail_lowbit.run(h, s, torch.full((len(h),), 0.5), want_bound=True)
    monkeypatch.setattr(tail_lowbit, "MARCH", march)
    monkeypatch.setattr(tail_lowbit, "_LIB", None)
    if isa:
        assert tail_lowbit.isa() == isa
    est, passed, bound = tail_lowbit.run(h, s, torch.full((len(h),), 0.5), want_bound=True)
    assert torch.allclose(est, ref[0], rtol=1e-6, atol=1e-5) and torch.allclose(bound, ref[2], rtol=1e-6)
    assert (passed != ref[1]).sum() <= 1  # a row exactly at the threshold may round either way


def test_the_served_screen_passes_every_row_that_could_win():
    rows, h = rows_and_states(n=3000, d=128, m=8, seed=1)
    full = rows.to(torch.bfloat16)
    kept = torch.arange(0, 3000, 3)
    h = (h.float() + 300 * full[torch.tensor([1, 2, 4, 5, 0, 3, 7, 8])].float()).to(torch.bfloat16)  # dropped winners
    s = tail.build(full, kept.tolist(), kernel=tail.INT5)
    best = (h @ full[kept].T).float().max(-1).values
    exact = h.float() @ full[s["dropped"]].float().T
    _, passed = tail.screen(h, s, best)
    assert passed[exact >= best[:, None]].all() and (exact.max(-1).values > best).sum() >= 6
    assert passed.float().mean() < 0.05  # and it is a screen


def test_no_compiler_is_one_line_and_the_int8_screens_serve(monkeypatch):
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setattr(tail_lowbit, "_LIB", None)
    with pytest.raises(tail_lowbit.LowbitError, match="/nonexistent/cc.*failed"):
        tail_lowbit.library()
    monkeypatch.setattr(tail, "exact_kernels", lambda **_: [tail.INT5, tail.WEIGHT_ONLY])
    rows, _ = rows_and_states(n=200, d=64)
    s = tail.build(rows.to(torch.bfloat16), list(range(0, 200, 2)))
    assert s["kernel"] == tail.WEIGHT_ONLY and "/nonexistent/cc" in s["timed"][tail.INT5]["refused"]


def test_a_hidden_size_off_the_group_is_refused():
    with pytest.raises(tail.TailError, match="multiple of 32, not 72"):
        tail.build(torch.zeros(64, 72, dtype=torch.bfloat16), [0, 1], kernel=tail.INT5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_a_served_step_writes_the_estimates_at_their_ids_and_lists_the_passing_rows(dtype):
    rows, h = rows_and_states(n=500, d=64, m=8, seed=2)
    s = {"dropped": torch.arange(3, 1003, 2), **tail_lowbit.pack(rows)}  # rows at odd ids of a 1,010-id vocabulary
    thr = torch.full((8,), 1.0)
    est, passed, _ = tail_lowbit.run(h, s, thr)
    out = torch.full((8, 1010), -7.0, dtype=dtype)
    pos, row, pair_est = tail_lowbit.serve(h, s, thr, out)
    assert torch.equal(out[:, s["dropped"]], est.to(dtype)) and (out[:, ::2] == -7).all()
    assert sorted(map(list, zip(pos.tolist(), row.tolist(), strict=True))) == passed.nonzero().tolist() and len(pos)
    assert torch.equal(pair_est, est[pos, row])
    assert tail_lowbit.serve(h, s, thr, out, max_pairs=len(pos) - 1) is None  # too many: the caller reads them all
