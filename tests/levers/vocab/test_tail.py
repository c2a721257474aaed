"""The tail fallback's estimator (scripts.levers.vocab.tail): its decision rule, its fit on synthetic hidden states,
and the refusals at load (pure logic; the served fallback is tested with the real server in test_vocab.py)."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from scripts.levers.vocab import tail


def synthetic(n: int, seed: int, vocab: int = 400, hidden: int = 16, kept: int = 300):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
    h = torch.randn(n, hidden, generator=g) * 1.5
    z = h @ rows.T
    mask = torch.zeros(vocab, dtype=torch.bool)
    mask[:kept] = True
    k, d = z[:, mask], z[:, ~mask]
    return {"hidden": h, "max_kept": k.max(-1).values, "lse_kept": k.logsumexp(-1),
            "max_dropped": d.max(-1).values, "lse_dropped": d.logsumexp(-1)}, z, mask


def test_gap_is_the_margin_that_flags_a_position():
    est, mx, lse = torch.tensor([1.0, 3.0]), torch.tensor([2.0, 2.0]), torch.tensor([2.5, 2.5])
    assert tail.gap(est, mx, lse, "max_dropped").tolist() == [1.0, -1.0]
    # tail_mass: log p(best kept) - log tail mass, with p(best kept) = exp(mx - lse) * (1 - tail mass)
    q = torch.tensor([-0.5])
    want = (2.0 - 2.5) + torch.log1p(-torch.exp(q)) - q
    assert torch.allclose(tail.gap(q, torch.tensor([2.0]), torch.tensor([2.5]), "tail_mass"), want)


@pytest.mark.parametrize("target", tail.TARGETS)
def test_fitted_margin_flags_every_dropped_argmax_of_the_margin_set(target):
    fit_set, _, _ = synthetic(4000, 1)
    held, z, mask = synthetic(2000, 2)
    weight, bias = tail.ridge(fit_set, target)
    need = tail.gaps(held, weight, bias, target)[held["max_dropped"] > held["max_kept"]]
    assert len(need) > 10  # the synthetic head does drop some argmaxes
    margin = float(need.max())
    r = tail.flag_rate(held, weight, bias, target, margin)
    assert r["recall"] == 1.0 and r["argmax_dropped"] == len(need)
    assert r["full_row_rate"] < 1.0
    # the serving rule (flags, from kept logits) decides exactly as the fit's table did
    served = tail.flags(held["hidden"], z[:, mask], weight, bias, target, margin)
    assert int(served.sum()) == r["full_row_reads"]
    smaller = tail.flag_rate(held, weight, bias, target, margin - 1e-3)
    assert smaller["recall"] < 1.0


def write(path, keep_sha="k" * 64, rows_sha="r" * 64, **extra):
    meta = {"target": "max_dropped", "margin": "1.5", "keep_list_sha256": keep_sha, "rows_sha256": rows_sha, **extra}
    (path / tail.TAIL_FILE).parent.mkdir(exist_ok=True)
    save_file({"weight": torch.zeros(18), "bias": torch.zeros(1)}, path / tail.TAIL_FILE, metadata=meta)


def test_load_refuses_another_keep_list_naming_both_hashes(tmp_path):
    write(tmp_path, keep_sha="a" * 64)
    with pytest.raises(tail.TailError, match="keep list aaaaaaaaaaaa.*keeps bbbbbbbbbbbb"):
        tail.load(tmp_path, "b" * 64)
    assert tail.load(tmp_path, "a" * 64)["margin"] == 1.5


def test_load_names_a_missing_file(tmp_path):
    with pytest.raises(tail.TailError, match=f"{tail.TAIL_FILE} is missing.*pruned-only"):
        tail.load(tmp_path, "k" * 64)


def test_rows_of_another_checkpoint_are_refused_with_both_hashes(tmp_path):
    rows = torch.randn(8, 4).to(torch.bfloat16)
    write(tmp_path, rows_sha=tail.rows_sha256(rows))
    t = tail.load(tmp_path, "k" * 64)
    tail.check_rows(t, rows)
    other = rows.clone()
    other[0, 0] += 1
    with pytest.raises(tail.TailError, match=f"rows {tail.rows_sha256(rows)[:12]}.*is {tail.rows_sha256(other)[:12]}"):
        tail.check_rows(t, other)


def test_committed_estimator_is_reused_only_for_its_keep_list_and_rows(tmp_path, monkeypatch):
    monkeypatch.setattr(tail, "vocab_dir", lambda base: tmp_path)
    rows = torch.randn(8, 4).to(torch.bfloat16)
    fits = []

    def fake_fit(parent_dir, base, kept, keep_sha, rows_name):
        fits.append(keep_sha)
        meta = {"target": "max_dropped", "margin": "1.0", "keep_list_sha256": keep_sha,
                "rows_sha256": tail.rows_sha256(rows)}
        return {"tensors": {"weight": torch.zeros(6), "bias": torch.zeros(1)}, "metadata": meta}, {"target": "max_dropped"}

    monkeypatch.setattr(tail, "fit", fake_fit)
    args = (tmp_path, "b", "p", [0, 1, 2])
    _, report = tail.estimator(*args, "a" * 64, "tied", rows)
    assert fits == ["a" * 64] and (tmp_path / "tail-p-3.safetensors").exists()
    assert report["estimator"].endswith("tail-p-3.safetensors") and json_of(tmp_path / "tail-p-3.json") == report
    tail.estimator(*args, "a" * 64, "tied", rows)
    assert fits == ["a" * 64]  # reused
    tail.estimator(*args, "b" * 64, "tied", rows)  # another keep list: refitted
    other = rows.clone()
    other[0, 0] += 1
    tail.estimator(*args, "b" * 64, "tied", other)  # another checkpoint: refitted
    tail.estimator(*args, "b" * 64, "tied", other, refit=True)
    assert fits == ["a" * 64, "b" * 64, "b" * 64, "b" * 64]


def json_of(path):
    import json

    return json.loads(path.read_text())
