"""The Triton screen's kernels (scripts.levers.vocab.tail_triton) run by Triton's CPU interpreter on a small head: the
approximate logits are the dequantized rows' products, the bound holds on every row, and the pass is the dense rule's
(up to the BF16 rounding the fused kernel does not do), for one position (the matrix-vector kernel) and for 3 and 8
(the tile). The same kernels on a GPU: test_tail_gpu.py."""

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


def test_triton_screen_kernels_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(paths.ROOT)}
    r = subprocess.run([sys.executable, "-c", CHECK], cwd=paths.ROOT, env=env, capture_output=True, text=True,
                       timeout=300, check=False)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout + r.stderr)[-2000:]
