"""The screens compared by scripts.levers.vocab.screens: every upper bound holds on exact products (random rows), the
quantizers and k-means do what they say, and bad input is one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from scripts.levers.vocab import screens, tail  # noqa: E402


@pytest.fixture(scope="module")
def rows_and_h():
    gen = torch.Generator().manual_seed(0)
    full = (torch.randn(600, 64, generator=gen) * 0.05).to(torch.bfloat16)
    kept = list(range(0, 600, 3))
    h = (torch.randn(12, 64, generator=gen) * 4).to(torch.bfloat16)
    return full, kept, h


@pytest.mark.parametrize("method", ["int8-row", "int4-row", "int4-g32", "lowrank-32", "cluster-16"])
def test_every_bound_holds_on_exact_products(rows_and_h, method):
    full, kept, h = rows_and_h
    s = tail.build(full, kept, kernel=tail.WEIGHT_ONLY)
    rows = full[s["dropped"]].float()
    prep = screens.prepare(method, rows, s)
    bound = screens.upper_bounds(method, prep, h)
    exact = h.float() @ rows.T
    assert bound.shape == exact.shape
    assert bool((bound >= exact - 1e-4).all()), f"{method}: a bound below its exact logit"
    assert prep["bytes"] > 0


def test_group_quantizer_is_finer_than_one_scale_per_row():
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(50, 64, generator=gen)
    rows[:, 0] *= 20  # one large value per row: a row scale wastes levels on the rest
    per_row = (rows - screens.quantize_groups(rows, 4, None)).norm(dim=1).mean()
    per_group = (rows - screens.quantize_groups(rows, 4, 32)).norm(dim=1).mean()
    assert per_group < per_row
    assert torch.equal(screens.quantize_groups(rows, 8, None).abs().amax(1), rows.abs().amax(1))  # extremes exact


def test_kmeans_finds_separated_groups():
    gen = torch.Generator().manual_seed(2)
    a = torch.randn(40, 8, generator=gen) * 0.01 + 5
    b = torch.randn(40, 8, generator=gen) * 0.01 - 5
    centres, assign = screens.kmeans(torch.cat([a, b]), 2)
    assert len(set(assign[:40].tolist())) == 1 and len(set(assign[40:].tolist())) == 1
    assert assign[0] != assign[-1]


def test_unknown_screen_and_unpruned_variant_are_one_line(capsys):
    with pytest.raises(screens.VocabError, match="unknown screen"):
        screens.prepare("int3-row", torch.zeros(2, 4))
    assert screens.main(["smollm2-bf16"]) == 2
    assert "not a pruned variant" in capsys.readouterr().err
    assert screens.main(["gemma3-270m-v32k-tail", "--methods", "int8-row,magic"]) == 2


def test_hidden_stats_measure_spread_and_gaps():
    gen = torch.Generator().manual_seed(3)
    h = torch.randn(400, 256, generator=gen) * 3
    h[:, 0] += 100  # one huge coordinate: almost all of |h|^2, and a principal direction
    st = screens.hidden_stats(h, [torch.arange(1000.0)])
    assert st["top128_coordinate_energy_mean"] > 0.9 and st["norm_mean"] > 100
    assert st["norm_outside_top128_pcs_mean"] < 1.2 * 3 * 128 ** 0.5  # noise outside 128 directions, not the 100
    q = list(st["gap_quantiles"].values())
    assert q == sorted(q) and q[-1] == pytest.approx(500, abs=1)
