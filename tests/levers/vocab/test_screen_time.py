"""The exact tail's per-step timer (scripts.levers.vocab.screen_time) on a small random head with the real kernels:
every piece is timed at every position count, the bytes are the pieces' own, and bad input ends in one line."""

from __future__ import annotations

import json

import pytest

from scripts.levers.vocab import screen_time, tail


def test_every_piece_is_timed_with_its_bytes(tmp_path):
    matrix, kept = screen_time.random_head("4096x64", 512, "cpu")
    kernels = screen_time.available_kernels("cpu")
    assert tail.WEIGHT_ONLY in kernels and set(kernels) <= set(tail.KERNELS)
    result = screen_time.time_pieces(matrix, kept, kernels, positions=(1, 8), recompute=(4,), iters=3, warmup=1)
    pieces = {(r["piece"], r["positions"]): r for r in result["pieces"]}
    expected = {"full", "pruned", "recompute:4", "screen:int4-g32-l1",
                *(f"{p}:{k}" for k in kernels for p in ("products", "screen"))}
    assert {p for p, _ in pieces} == expected and {n for _, n in pieces} == {1, 8}
    assert pieces[("full", 1)]["bytes"] == 4096 * 64 * 2 and pieces[("pruned", 8)]["bytes"] == 512 * 64 * 2
    assert pieces[(f"screen:{tail.WEIGHT_ONLY}", 1)]["bytes"] == (4096 - 512) * (64 + 4)
    assert tail.INT5 in kernels  # 5 bits a value and an fp16 scale per 32 values
    assert pieces[(f"screen:{tail.INT5}", 8)]["bytes"] == (4096 - 512) * (64 * 5 // 8 + 2 * 2)
    assert pieces[("screen:int4-g32-l1", 1)]["bytes"] == (4096 - 512) * (64 * 4 // 8 + 2 * 2)
    assert all(r["median_ms"] >= r["min_ms"] > 0 for r in result["pieces"])
    assert result["dropped"] == 4096 - 512 and result["copy_bandwidth"]["bytes_per_s"] > 0
    assert "| screen:" in screen_time.markdown(result, "t")


def test_main_writes_the_record_and_its_table(tmp_path):
    out = tmp_path / "t.json"
    assert screen_time.main(["--shape", "2048x32", "--keep", "256", "--name", "t", "--iters", "2",
                             "--kernels", tail.WEIGHT_ONLY, "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["source"]["rows"].startswith("random") and rec["git"]["commit"] and rec["hardware"]["cpu_flags"]
    assert out.with_suffix(".md").read_text().startswith("# Exact tail pieces per step")


@pytest.mark.parametrize("argv, message", [
    ([], "name a pruned variant, or give --shape"),
    (["--shape", "2048by32", "--keep", "2", "--name", "t"], "--shape '2048by32': give VOCABxHIDDEN"),
    (["--shape", "2048x32", "--keep", "4096", "--name", "t"], "--keep 4096: must lie between"),
    (["--shape", "2048x32", "--keep", "8", "--name", "t", "--kernels", "int4"], "--kernels: unknown"),
    (["smollm2-bf16"], "smollm2-bf16 is not a pruned variant"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys, tmp_path):
    assert screen_time.main([*argv, "--out", str(tmp_path / "x.json")]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
    assert not list(tmp_path.iterdir())
