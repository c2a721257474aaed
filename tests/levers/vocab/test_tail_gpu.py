"""The exact tail's screen on a GPU (torch._int_mm, and the Triton int8 and 5-bit kernels where Triton is installed),
on the synthetic output matrices of test_tail.py: the bound holds on every row, the pass is the dense rule's, and the
served argmax is the full product's at every position, dropped winners included. Skipped where no CUDA device is
present."""

from __future__ import annotations

import pytest
import torch

from scripts.levers.vocab import tail
from tests.levers.vocab.test_tail import head, hidden_states

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device: the GPU screen is not run")]


@pytest.fixture(params=[tail.INT_MM, tail.TRITON, tail.TRITON5])
def gpu_kernel(request, monkeypatch):
    if request.param not in tail.exact_kernels(device="cuda"):
        pytest.skip(f"{request.param}: not on this machine (Triton missing)")
    monkeypatch.setenv("LAB_VOCAB_TAIL_KERNEL", request.param)
    return request.param


def test_gpu_screen_bound_pass_and_argmax(gpu_kernel):
    rows, kept_ids = head(vocab=4096, hidden=128, kept=517)
    rows = rows.cuda()
    s = tail.build(rows, kept_ids.tolist())
    assert s["kernel"] == gpu_kernel and s["dropped"].is_cuda
    h = hidden_states(rows.cpu(), kept_ids, 64, 3).cuda()
    a, bound = tail.approx_and_bound(h, s)
    exact = h.float() @ rows[s["dropped"]].float().T
    assert ((exact - a).abs() <= bound).all()
    kept = torch.as_tensor(kept_ids, device="cuda")
    opened = 0
    for part in h.split(8):
        best = (part @ rows[kept].T).float().max(-1).values
        a, passed = tail.screen(part, s, best)
        a2, bound2 = tail.approx_and_bound(part, s)
        dense = a2 + bound2 >= (best - tail.ARITH * best.abs())[:, None]
        # no row that could win is missed; the fused kernel compares its float32 logits, not their BF16 rounding
        exact = (part.float() @ rows[s["dropped"]].float().T) >= best[:, None]
        assert passed[exact].all()
        opened += int(dense.sum())
        assert torch.equal(passed, dense) if gpu_kernel == tail.INT_MM else (passed != dense).float().mean() < 0.01
        full, counts = tail.fill(part, part @ rows[kept].T, kept, s, rows, rows.shape[0])
        assert torch.equal(full.float().argmax(-1), (part @ rows.T).float().argmax(-1))
    assert opened  # the dropped-pointing states open rows: the screen is tested on rows that could win
