"""The exact tail fallback's screen (scripts.levers.vocab.tail) on synthetic output matrices, with the real kernels
(vLLM's oneDNN int8 GEMM where this CPU has 8-bit dot products, torch's int8 weight-only kernel and the 5-bit C
kernel everywhere): the
bound holds on every row, the served row's argmax is the full product's at every position (dropped winners
included), and the refusals (the served fallback is tested with the real server in test_vocab.py)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from scripts.common.hardware import INT8_DOT_FLAGS, cpu_model_and_flags
from scripts.levers.vocab import plugin, tail

INT8_DOT_HERE = any(f in cpu_model_and_flags()[1] for f in INT8_DOT_FLAGS)
# torch._int_mm on a CPU may take the same saturating u8 x s8 path as oneDNN where there are no 8-bit dot products
EXACT_HERE = {"torch-w8a16", "onednn-w8a8", "torch-int-mm"} if INT8_DOT_HERE else {"torch-w8a16"}
EXACT_HERE.add("int5-g32")  # its AVX2 pair sums cannot saturate (test_tail_lowbit.py builds every path)


@pytest.fixture(params=list(tail.KERNELS))
def kernel(request, monkeypatch):
    """Each kernel this CPU computes exactly (oneDNN's int8 GEMM saturates without VNNI or AMX)."""
    if request.param in tail.TRITON_KERNELS:
        pytest.skip(f"{request.param} runs on a GPU (test_tail_gpu.py; in Triton's interpreter: test_tail_triton.py)")
    if request.param not in EXACT_HERE:
        pytest.skip(f"{request.param}: this CPU has none of {', '.join(INT8_DOT_FLAGS)}")
    monkeypatch.setenv("LAB_VOCAB_TAIL_KERNEL", request.param)
    return request.param


def head(vocab: int = 2000, hidden: int = 64, kept: int = 301, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    rows = (torch.randn(vocab, hidden, generator=g) * 0.05).to(torch.bfloat16)
    kept_ids = torch.randperm(vocab, generator=g)[:kept].sort().values
    return rows, kept_ids


def hidden_states(rows, kept_ids, n: int, seed: int):
    """Random states pointed at a row each, as a confident model's are: a dropped one for half of them (a held-out
    task's word), a kept one for the rest."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(n, rows.shape[1], generator=g) * 4
    mask = torch.ones(rows.shape[0], dtype=torch.bool)
    mask[kept_ids] = False
    dropped = mask.nonzero().squeeze(1)
    pick = torch.cat([dropped[torch.randint(len(dropped), (n // 2,), generator=g)],
                      kept_ids[torch.randint(len(kept_ids), (n - n // 2,), generator=g)]])
    h += rows[pick].float() * 400
    return h.to(torch.bfloat16)


def served(rows, kept_ids, h, batch: int = 8):
    """The served rows of these states, `batch` positions a step (as the engine's decode steps are), summed counts."""
    s = tail.build(rows, kept_ids)
    out, counts = [], {}
    for part in h.split(batch):
        full, c = tail.fill(part, part @ rows[kept_ids].T, kept_ids, s, rows, rows.shape[0])
        out.append(full)
        counts = {k: counts.get(k, 0) + v for k, v in c.items()}
    return torch.cat(out), counts


def test_bound_holds_on_every_row_for_bf16_and_float32_states(kernel):
    rows, kept_ids = head()
    s = tail.build(rows, kept_ids)
    assert s["kernel"] == kernel
    for h in (hidden_states(rows, kept_ids, 64, 1), torch.randn(64, rows.shape[1]) * 3):
        a, bound = tail.approx_and_bound(h, s)
        exact = h.float() @ rows[s["dropped"]].float().T
        assert ((exact - a).abs() <= bound).all()
        assert float(bound.mean()) < float(exact.std())  # and it is a screen, not everything
        # the two-pass screen passes exactly the rows the dense rule passes
        best = (h.to(torch.bfloat16) @ rows[kept_ids].T).float().max(-1).values
        dense = a + bound >= (best - tail.ARITH * best.abs())[:, None]
        assert torch.equal(tail.screen(h, s, best)[1], dense) and dense.any()


def test_served_argmax_is_the_full_products_including_dropped_winners(kernel):
    rows, kept_ids = head()
    h = hidden_states(rows, kept_ids, 64, 2)
    full, counts = served(rows, kept_ids, h)
    exact = (h @ rows.T).float()
    assert torch.equal(full.float().argmax(-1), exact.argmax(-1))
    kept_set = set(kept_ids.tolist())
    winners = sum(int(i) not in kept_set for i in exact.argmax(-1))
    assert winners >= 16 and counts["dropped_argmax"] == winners
    assert counts["positions"] == 64 and counts["rows_recomputed"] > 0
    assert counts["whole_matrix_reads"] == 0
    # kept logits are the kept product's; every dropped logit is within its bound (none is -inf)
    assert torch.equal(full[:, kept_ids], h @ rows[kept_ids].T)
    assert torch.isfinite(full).all()


def test_many_rows_screened_in_read_the_whole_matrix_and_stay_exact(kernel, monkeypatch):
    monkeypatch.setattr(tail, "FULL_FRACTION", 0.0)
    rows, kept_ids = head()
    h = hidden_states(rows, kept_ids, 8, 3)
    full, counts = served(rows, kept_ids, h)
    assert counts["whole_matrix_reads"] == 1
    assert torch.equal(full.float().argmax(-1), (h @ rows.T).float().argmax(-1))


def test_a_step_of_many_positions_reads_the_whole_matrix_and_is_exact(kernel):
    rows, kept_ids = head()
    h = hidden_states(rows, kept_ids, 32, 4)
    full, counts = served(rows, kept_ids, h, batch=tail.SCREEN_MAX_POSITIONS + 8)
    assert counts["whole_matrix_reads"] == 2 and counts["rows_recomputed"] == 0
    assert torch.equal(full.float().argmax(-1), (h @ rows.T).float().argmax(-1))


def test_a_kernel_that_breaks_the_bound_is_refused(kernel, monkeypatch):
    products = tail.KERNELS[kernel].products

    factor = 2.0 if kernel == tail.INT5 else 1.05  # the 5-bit bound is looser: a kernel with twice the scales

    def other_scales(h, s):  # a kernel that computes with other scales than the bound assumes
        out, hq = products(h, s)
        return out * factor, hq

    monkeypatch.setitem(tail.KERNELS, kernel, tail.KERNELS[kernel]._replace(products=other_scales))
    rows, kept_ids = head()
    with pytest.raises(tail.TailError, match=f"bound fails on exact products.*the {kernel} kernel"):
        tail.build(rows, kept_ids)


@pytest.mark.skipif(INT8_DOT_HERE, reason="this CPU has 8-bit dot products: oneDNN's int8 GEMM is exact here")
def test_onednn_without_int8_dot_products_breaks_the_bound_and_is_refused():
    """Why the screen does not use oneDNN everywhere: on AVX2 alone its u8 x s8 pair sums saturate at 16 bits."""
    rows, kept_ids = head()
    with pytest.raises(tail.TailError, match="bound fails on exact products.*the onednn-w8a8 kernel"):
        tail.build(rows, kept_ids, kernel="onednn-w8a8")


def test_the_kernel_follows_the_cpus_int8_dot_products(monkeypatch):
    monkeypatch.delenv("LAB_VOCAB_TAIL_KERNEL", raising=False)
    assert tail.exact_kernels(["avx2", "avx512f", "avx512_vnni"]) == ["int5-g32", "onednn-w8a8", "torch-int-mm",
                                                                      "torch-w8a16"]
    assert tail.exact_kernels(["avx2", "amx_int8"])[:2] == ["int5-g32", "onednn-w8a8"]
    assert tail.exact_kernels(["avx2"]) == ["int5-g32", "torch-w8a16"]
    assert tail.kernel_name(["avx2"], device="cuda") == "torch-int-mm"
    gpu = ["torch-int-mm", "triton-w8a16", "triton-int5"] if importlib.util.find_spec("triton") else ["torch-int-mm"]
    assert tail.exact_kernels(device="cuda") == gpu
    monkeypatch.setenv("LAB_VOCAB_TAIL_KERNEL", "torch-w8a16")
    assert tail.kernel_name(["avx512_vnni"]) == "torch-w8a16"
    monkeypatch.setenv("LAB_VOCAB_TAIL_KERNEL", "int8")  # the int8 kernels this CPU computes exactly, no 5-bit one
    assert tail.exact_kernels(["avx512_vnni"]) == ["onednn-w8a8", "torch-int-mm", "torch-w8a16"]
    assert tail.exact_kernels(["avx2"]) == ["torch-w8a16"]
    assert tail.exact_kernels(device="cuda") == [k for k in gpu if k != "triton-int5"]
    monkeypatch.setenv("LAB_VOCAB_TAIL_KERNEL", "int4")
    with pytest.raises(tail.TailError, match="LAB_VOCAB_TAIL_KERNEL='int4'.*onednn-w8a8, torch-w8a16"):
        tail.kernel_name()


def test_without_a_kernel_named_build_keeps_the_fastest_exact_one(monkeypatch):
    monkeypatch.delenv("LAB_VOCAB_TAIL_KERNEL", raising=False)
    monkeypatch.setattr(tail, "exact_kernels", lambda **_: ["torch-w8a16", "torch-int-mm"])
    fake = {"torch-w8a16": {"batch_1": 30.0, "batch_8": 90.0}, "torch-int-mm": {"batch_1": 40.0, "batch_8": 50.0}}
    monkeypatch.setattr(tail, "step_time_us", lambda s, hidden: fake[s["kernel"]])
    rows, kept_ids = head()
    s = tail.build(rows, kept_ids)
    assert s["kernel"] == "torch-int-mm" and s["timed"] == fake
    # a kernel whose bound fails on this CPU is left out, with the reason
    products = tail.KERNELS["torch-int-mm"].products
    monkeypatch.setitem(tail.KERNELS, "torch-int-mm", tail.KERNELS["torch-int-mm"]._replace(
        products=lambda h, s: (products(h, s)[0] * 1.05, products(h, s)[1])))
    s = tail.build(rows, kept_ids)
    assert s["kernel"] == "torch-w8a16" and "bound fails" in s["timed"]["torch-int-mm"]["refused"]
    # and one that cannot run here at all (a missing op, a compile that fails) is left out, not fatal

    def broken(h, s):
        raise RuntimeError("no kernel image is available for execution on the device")

    monkeypatch.setitem(tail.KERNELS, "torch-int-mm", tail.KERNELS["torch-int-mm"]._replace(products=broken))
    s = tail.build(rows, kept_ids)
    assert s["kernel"] == "torch-w8a16" and s["timed"]["torch-int-mm"]["refused"].startswith("RuntimeError: no kernel")


def test_the_fastest_kernel_is_timed_for_real():
    rows, kept_ids = head()
    s = tail.build(rows, kept_ids, kernel="torch-w8a16")
    t = tail.step_time_us(s, rows.shape[1], repeat=2)
    assert set(t) == {"batch_1", "batch_8"} and all(v > 0 for v in t.values())


def test_a_cpu_kernel_on_another_device_is_refused_naming_the_one_that_runs_there():
    rows = torch.empty(64, 8, dtype=torch.bfloat16, device="meta")
    with pytest.raises(tail.TailError, match="torch-w8a16 screen runs on the CPU only.*torch-int-mm, triton-w8a16 and "
                                             "triton-int5 screens run"):
        tail.build(rows, [0, 1], kernel="torch-w8a16")
    for gpu_only in ("triton-w8a16", "triton-int5"):
        with pytest.raises(tail.TailError, match=f"{gpu_only} screen runs on a GPU"):
            tail.build(torch.zeros(64, 8, dtype=torch.bfloat16), [0, 1], kernel=gpu_only)


def test_checkpoint_asking_for_another_tail_method_fails_to_load(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"vocab_pruning": {"tail": "vocab_tail/estimator.safetensors"}}))
    with pytest.raises(tail.TailError, match="estimator.safetensors.*rebuild with `make prune-vocab`"):
        plugin.tail_of(str(tmp_path))
    for entry in (tail.config(), {"method": "int8-screen"}):  # the method's older name: the same screen
        cfg.write_text(json.dumps({"vocab_pruning": {"tail": entry}}))
        assert plugin.tail_of(str(tmp_path)) == {"where": str(cfg)}
    cfg.write_text(json.dumps({"vocab_pruning": {}}))
    assert plugin.tail_of(str(tmp_path)) is None


def test_report_refuses_an_unknown_held_out_set():
    with pytest.raises(tail.TailError, match="no held-out set nope: the sets are text/held_out"):
        tail.held_out_sequences(None, "smollm2", 10, sets=("nope",))


def test_the_5_bit_screen_and_its_runner_up_are_timed_on_served_steps(monkeypatch):
    """The load-time timings open no row; the 5-bit screen opens more than an int8 one, so each serves
    ONLINE_TRIALS steps of each step size and the faster of the two (median, whole step) serves from then on."""
    import time

    monkeypatch.delenv("LAB_VOCAB_TAIL_KERNEL", raising=False)
    monkeypatch.setattr(tail, "exact_kernels", lambda **_: [tail.INT5, "torch-w8a16"])
    fake = {tail.INT5: {"batch_1": 10.0, "batch_8": 20.0}, "torch-w8a16": {"batch_1": 30.0, "batch_8": 90.0}}
    monkeypatch.setattr(tail, "step_time_us", lambda s, hidden: fake[s["kernel"]])
    rows, kept_ids = head()
    s = tail.build(rows, kept_ids)
    assert s["kernel"] == tail.INT5 and s["runner_up"]["kernel"] == "torch-w8a16"
    screen5 = tail.KERNELS[tail.INT5].screen

    def slow(h, s, max_kept):  # the 5-bit screen opening many rows, as on SmolLM2 at 8 positions
        time.sleep(0.01)
        return screen5(h, s, max_kept)

    monkeypatch.setitem(tail.KERNELS, tail.INT5, tail.KERNELS[tail.INT5]._replace(screen=slow))
    h = hidden_states(rows, kept_ids, 2 * tail.ONLINE_TRIALS + 4, 5)
    used = []
    for part in h.split(1):
        full, c = tail.fill(part, part @ rows[kept_ids].T, kept_ids, s, rows, rows.shape[0])
        used.append(next(k for k in c if k.startswith("calls:")))
        assert int(full.float().argmax()) == int((part @ rows.T).float().argmax())
    n = tail.ONLINE_TRIALS
    assert used == [f"calls:{tail.INT5}"] * n + ["calls:torch-w8a16"] * (n + 4)
    assert set(s["online"]) == {1} and all(len(t) == n for t in s["online"][1].values())
