"""The Triton screen's kernels (scripts.levers.vocab.tail_triton) run by Triton's CPU interpreter on a small head: the
approximate logits are the dequantized rows' products, the bound holds on every row, and the pass is the dense rule's
(up to the BF16 rounding the fused kernel does not do), for one position (the matrix-vector kernel) and for 3 and 8
(the tile); the 5-bit screen's kernels likewise, and its layout against the CPU screen's values. The same kernels on a
GPU: test_tail_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from scripts.common import paths

pytest.importorskip("triton")

CHECK = r"""
import torch
from scripts.levers.vocab import tail, tail_triton
g = torch.Generator().manual_seed(0)
rows = (torch.randn(300, 64, generator=g) * 0.05).to(torch.bfloat16)
kept = list(range(0, 300, 7))
s = tail.build(rows, kept, kernel="torch-int-mm", check=False)  # float32 scales, as the GPU screen's
s["acc"] = tail.ACC_PER_TERM * 64
deq = s["q"].float() * s["scale"][:, None]
for m in (1, 3, 8):
    h = torch.randn(m, 64, generator=g) * 4
    h[: m // 2 + 1] += rows[s["dropped"][: m // 2 + 1]].float() * 400  # states pointed at dropped rows: some pass
    best = (h.to(torch.bfloat16) @ rows[kept].T).float().max(-1).values
    a, passed = tail_triton.run(h, s, best, tail.ARITH)
    ref = h.to(torch.bfloat16).float() @ deq.T
    assert (a.float() - ref).abs().max() <= 0.01 * ref.abs().max(), m
    exact = h.float() @ rows[s["dropped"]].float().T
    hn = h.float().norm(dim=1)
    hq = (h.float() - h.to(torch.bfloat16).float()).norm(dim=1) + s["acc"] * hn
    bound = hn[:, None] * s["err"] + hq[:, None] * s["qnorm"] + tail.ARITH * ref.abs()
    assert ((exact - ref).abs() <= bound).all(), m
    dense = ref + bound >= (best - tail.ARITH * best.abs())[:, None]
    assert passed.bool()[exact >= best[:, None]].all() and dense.any(), m
    assert (passed.bool() != dense).float().mean() < 0.01, m
    never = torch.full((m,), float("inf"))
    assert not tail_triton.run(h, s, never, tail.ARITH)[1].any(), m
print("ok")
"""



CHECK5 = r"""
import torch
from scripts.levers.vocab import tail, tail_lowbit, tail_triton
g = torch.Generator().manual_seed(1)
rows = (torch.randn(300, 96, generator=g) * 0.05).to(torch.bfloat16)
rows[8, :32] *= 40  # one group of a dropped row far larger than the others: its own scale
kept = list(range(0, 300, 7))
dropped = torch.tensor([i for i in range(300) if i not in kept])
s = tail_triton.pack5(rows[dropped].float())
s16, q = tail_lowbit.group_values(rows[dropped].float(), 5)
deq = (q * s16.float()[..., None]).reshape(len(dropped), 96)
assert torch.equal(tail_triton.dequantize5(s), deq)  # the layout holds the CPU screen's values
assert s["bytes"] == len(dropped) * 96 * 11 // 16  # 0.6875 bytes a value
# the worst state for row 5: every value's rounding error counts with the same sign (|w . h - est| near half the
# bound, so a bound half as large fails here)
worst = 4 * torch.sign(rows[dropped[5]].float() - deq[5])
for m, adversarial in ((1, False), (1, True), (3, True), (8, True)):
    h = torch.randn(m, 96, generator=g) * 4
    h[: m // 2 + 1] += rows[dropped[: m // 2 + 1]].float() * 400  # states pointed at dropped rows: some pass
    if adversarial:
        h[-1] = worst
    best = (h.to(torch.bfloat16) @ rows[kept].T).float().max(-1).values
    a, passed, bound = tail_triton.run5(h, s, best, tail.ARITH, want_bound=True)
    hk = h.float() if m == 1 else h.to(torch.bfloat16).float()  # one position: h as it is; a tile: h in BF16
    ref = hk @ deq.T
    assert (a.float() - ref).abs().max() <= 0.01 * ref.abs().max(), m
    exact = h.float() @ rows[dropped].float().T
    assert ((exact - a.float()).abs() <= bound).all(), m
    if adversarial:
        assert (exact - a.float()).abs()[-1, 5] >= 0.4 * bound[-1, 5], m
    assert passed.bool()[exact >= best[:, None]].all() and (passed.any() or adversarial), m
    never = torch.full((m,), float("inf"))
    assert not tail_triton.run5(h, s, never, tail.ARITH)[1].any(), m
print("ok")
"""


@pytest.mark.parametrize("check", [CHECK, CHECK5], ids=["int8", "5bit"])
def test_triton_screen_kernels_in_the_interpreter(check):
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(paths.ROOT)}
    r = subprocess.run([sys.executable, "-c", check], cwd=paths.ROOT, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout + r.stderr)[-2000:]
