"""The W4A16 GEMM microbench's pure parts (hand-computed shapes and bytes, the tolerance, the model-level mean, the
CLI's refusals) and a functional run of the whole path on the CPU (times meaningless, record and schema real)."""

from __future__ import annotations

import json
import math

import pytest

from scripts.measure import gemm_bench as gb
from scripts.report import schemas as check_schemas
from scripts.weights.shape_proxy import QWEN35_4B_TEXT, QWEN35_27B_TEXT

# a Qwen3.5-shaped toy: every K a multiple of the group size 128 (hidden 256, MLP 512, 2 heads of 128, GDN 1/2 heads)
TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, full_attention_interval=4,
            num_attention_heads=2, num_key_value_heads=1, head_dim=128, linear_num_key_heads=1,
            linear_num_value_heads=2, linear_key_head_dim=128, linear_value_head_dim=128, vocab_size=1024)


def test_qwen35_4b_layer_shapes_by_hand():
    # 32 layers, every 4th full attention: 8 full, 24 Gated-DeltaNet; hidden 2560, MLP 9216
    assert gb.layer_shapes(QWEN35_4B_TEXT) == [
        ("qkv_proj", (2 * 16 + 4 + 4) * 256, 2560, 8),   # gated q (2 x 16 heads) + k + v (4 KV heads), head_dim 256
        ("o_proj", 2560, 16 * 256, 8),                   # 10240 x 2560 above, 2560 x 4096 here
        ("in_proj_qkvz", 2 * 2048 + 2 * 4096, 2560, 24),  # q, k: 16 x 128; v, z: 32 x 128 -> 12288
        ("in_proj_ba", 2 * 32, 2560, 24),                # b, a: one per value head -> 64
        ("out_proj", 2560, 4096, 24),
        ("gate_up_proj", 2 * 9216, 2560, 32),            # 18432
        ("down_proj", 2560, 9216, 32),
        ("lm_head", 248320, 2560, 1),                    # tied to the embedding, still one GEMM a step
    ]
    assert [n for _, n, _, _ in gb.layer_shapes(QWEN35_4B_TEXT)] == [10240, 2560, 12288, 64, 2560, 18432, 2560, 248320]


def test_qwen35_27b_layer_shapes_by_hand():
    # 64 layers: 16 full attention, 48 Gated-DeltaNet; hidden 5120, MLP 17408, 24/4 heads of 256, GDN 16/48 of 128
    assert gb.layer_shapes(QWEN35_27B_TEXT) == [
        ("qkv_proj", 14336, 5120, 16),       # (2 x 24 + 4 + 4) x 256
        ("o_proj", 5120, 6144, 16),          # 24 x 256 in
        ("in_proj_qkvz", 16384, 5120, 48),   # 2 x 16 x 128 + 2 x 48 x 128
        ("in_proj_ba", 96, 5120, 48),        # 2 x 48
        ("out_proj", 5120, 6144, 48),        # 48 x 128 in
        ("gate_up_proj", 34816, 5120, 64),   # 2 x 17408
        ("down_proj", 5120, 17408, 64),
        ("lm_head", 248320, 5120, 1),        # untied
    ]
    # vLLM's merged output shards, as create_weights gets them
    parts = {name: p for name, p, _, _ in gb.linear_layers(QWEN35_27B_TEXT)}
    assert parts["qkv_proj"] == [12288, 1024, 1024] and parts["in_proj_qkvz"] == [2048, 2048, 6144, 6144]
    assert parts["in_proj_ba"] == [48, 48] and parts["gate_up_proj"] == [17408, 17408]


def test_explicit_layer_types_and_a_dense_config():
    listed = {**QWEN35_4B_TEXT, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8}
    assert gb.layer_shapes(listed) == gb.layer_shapes(QWEN35_4B_TEXT)
    dense = {k: v for k, v in QWEN35_4B_TEXT.items() if k != "full_attention_interval"}
    assert [(n, c) for n, _, _, c in gb.layer_shapes(dense)] == [
        ("qkv_proj", 32), ("o_proj", 32), ("gate_up_proj", 32), ("down_proj", 32), ("lm_head", 1)]
    with pytest.raises(gb.BenchError, match="layer_types"):
        gb.layer_shapes({**QWEN35_4B_TEXT, "layer_types": ["sliding_attention"] * 32})


def test_w4a16_g128_bytes_per_call_by_hand():
    # the 4B's qkv_proj at M=1: 10240 x 2560 4-bit weights, 10240 x 20 BF16 scales, 2560 inputs, 10240 outputs
    assert gb.call_bytes(10240, 2560, 1) == 13_107_200 + 409_600 + 5_120 + 20_480 == 13_542_400
    assert gb.call_bytes(10240, 2560, 8) == 13_107_200 + 409_600 + 40_960 + 163_840 == 13_721_600
    assert gb.call_bytes(10240, 2560, 1, zero_bytes=2) == 13_542_400 + 409_600  # zero points cost as much as scales
    assert gb.bf16_call_bytes(10240, 2560, 1) == 52_428_800 + 5_120 + 20_480 == 52_454_400
    assert gb.row_bytes("bf16", 64, 2560, 2) == 64 * 2560 * 2 + 2 * 2560 * 2 + 2 * 64 * 2
    assert gb.row_bytes("vllm-marlin", 64, 2560, 2) == 64 * 1280 + 64 * 20 * 2 + 2 * 2560 * 2 + 2 * 64 * 2


def test_tolerance_fails_a_planted_error():
    torch = pytest.importorskip("torch")
    ref = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    peak = ref.abs().max().item()
    close = ref.to(torch.bfloat16)  # BF16 rounding: ~4e-3 relative at most
    assert gb.within_tolerance(gb.max_rel_error(close, ref), gb.TOLERANCE)
    planted = ref.clone()
    planted[2, 17] += 0.03 * peak  # 3% of the largest output, beyond 2e-2
    err = gb.max_rel_error(planted, ref)
    assert err == pytest.approx(0.03, rel=1e-3) and not gb.within_tolerance(err, gb.TOLERANCE)
    nan = ref.clone()
    nan[0, 0] = float("nan")
    assert not gb.within_tolerance(gb.max_rel_error(nan, ref), gb.TOLERANCE)
    assert gb.max_rel_error(ref[:, :32], ref) == math.inf  # a kernel that returns another shape fails too


LAYERS = {"s": [("a", 1024, 1024, 3), ("b", 512, 1024, 1)]}
A, B = gb.call_bytes(1024, 1024, 1), gb.call_bytes(512, 1024, 1)  # 544_768 and 273_408 bytes


def rows_of(kernel: str, times: dict[str, float | None]) -> list[dict]:
    return [{"kernel": kernel, "shape": "s", "layer": name, "m": 1, "count": c,
             "status": "ok" if times[name] else "failed", "time_us": times[name], "bytes": gb.row_bytes(kernel, n, k, 1)}
            for name, n, k, c in LAYERS["s"]]


def test_model_level_is_total_bytes_over_total_time():
    assert (A, B) == (524_288 + 16_384 + 2_048 + 2_048, 262_144 + 8_192 + 2_048 + 1_024)
    rows = rows_of("k1", {"a": 1.0, "b": 0.5}) + rows_of("k2", {"a": 0.5, "b": None}) + \
        rows_of("bf16", {"a": 4.0, "b": 2.0})
    models = {e["kernel"]: e for e in gb.model_level(rows, LAYERS, copy_bw=4e12)}
    k1 = models["k1"]
    # 3 calls of a (544,768 B in 1 us) + 1 of b (273,408 B in 0.5 us): 1,907,712 B in 3.5 us = 545.06 GB/s, not the
    # bytes-weighted arithmetic mean of the layers' 544.8 and 546.8 GB/s
    assert k1["bytes"] == 3 * A + B == 1_907_712 and k1["step_us"] == pytest.approx(3.5)
    assert k1["gbps"] == pytest.approx(1_907_712 / 3.5e-6 / 1e9) == pytest.approx(545.0606, rel=1e-6)
    assert k1["pct_copy"] == pytest.approx(100 * 545.0606e9 / 4e12, rel=1e-6)
    assert k1["complete"] and k1["coverage"] == pytest.approx(1.0)
    assert k1["x_bf16"] == pytest.approx((3 * 4.0 + 2.0) / 3.5)  # BF16's 14 us over the same calls
    k2 = models["k2"]  # b failed: partial, its bytes share, never the best even though faster on a
    assert not k2["complete"] and k2["missing"] == ["b"] and k2["coverage"] == pytest.approx(3 * A / (3 * A + B))
    assert k2["x_bf16"] == pytest.approx(3 * 4.0 / 1.5)
    best = gb.best_per_shape(list(models.values()))
    assert [(b["shape"], b["m"], b["kernel"]) for b in best] == [("s", 1, "k1")]
    comp = gb.composite(rows, LAYERS, copy_bw=4e12)[0]
    assert comp["per_layer"] == {"a": "k2", "b": "k1"} and comp["step_us"] == pytest.approx(3 * 0.5 + 0.5)
    table = gb.markdown(list(models.values()), best, [comp], gpu="GPU", copy_bw=4e12,
                        vllm_pick={"s": {"a": "MacheteLinearKernel", "b": "MarlinLinearKernel"}})
    assert "| k1 | 545 (14%) |" in table and "| k2 | " in table and "*" in table.split("| k2 |")[1].splitlines()[0]
    assert "| s | 1 | k1 | 545 | 14 | 4.00 |" in table and "Machete: a; Marlin: b" in table


def test_packing_matches_vllms_unpacking_rule():
    torch = pytest.importorskip("torch")
    w = gb.Weights(64, 256, [64], seed=3, device="cpu")
    assert int(w.q.min()) == -8 and int(w.q.max()) == 7 and bool((w.q[:, 0::128] == -8).all())
    packed = gb.pack_compressed_tensors(w.q)
    assert packed.shape == (64, 32) and packed.dtype == torch.int32
    # vLLM's TritonW4A16 repack reads the checkpoint this way: nibble j of each int32 is input 8i + j, stored q + 8
    shifts = torch.arange(8, dtype=torch.int32) * 4
    unpacked = ((packed.unsqueeze(-1) >> shifts) & 0xF).reshape(64, 256)
    assert torch.equal(unpacked, w.q.to(torch.int32) + 8)
    two = gb.pack_int4(w.q)  # MSLK / FBGEMM: the even input in the low nibble, signed
    assert torch.equal(((two.to(torch.int32) << 28) >> 28), w.q[:, ::2].to(torch.int32))
    assert torch.equal(two.to(torch.int32) >> 4, w.q[:, 1::2].to(torch.int32))
    ref = (w.q.float() * w.s.float().repeat_interleave(128, dim=1)).to(torch.bfloat16)
    assert torch.equal(w.bf16(), ref)


@pytest.mark.parametrize("argv, message", [
    (["--kernels", "bf16,no-such-kernel"], "unknown kernel 'no-such-kernel'"),
    (["--shapes", "qwen35-9b"], "unknown shape 'qwen35-9b'"),
    (["--m", "1,x"], "--m '1,x'"),
    (["--m", "0"], "at least 1"),
    (["--tolerance", "0"], "--tolerance"),
])
def test_cli_bad_input_is_one_line_and_exit_2(capsys, argv, message):
    assert gb.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1
    assert "Traceback" not in err


def test_list_needs_no_gpu(capsys):
    assert gb.main(["--list", "--shapes", "qwen35-27b"]) == 0
    out = capsys.readouterr().out
    assert "vllm-machete" in out and "in_proj_ba" in out and "qwen35-4b:" not in out
    assert gb.resolve_kernels("default") == [k.name for k in gb.KERNELS if k.default]
    assert "gemlite-gemm" in gb.resolve_kernels("all") and gb.resolve_kernels("bf16,bf16") == ["bf16"]


def cpu_run(tmp_path, monkeypatch, kernels: str) -> dict:
    monkeypatch.setitem(gb.SHAPES, "tiny", TINY)
    out = tmp_path / "out"
    rc = gb.main(["--device", "cpu", "--shapes", "tiny", "--m", "1,3", "--quick", "--l2-multiple", "0.01",
                  "--kernels", kernels, "--out", str(out)])
    (path,) = out.glob("gemm_*.json")
    assert rc == 0 and path.with_suffix(".md").exists() and not list(out.glob(".gemm_partial*"))
    assert check_schemas.check_file(path) == []
    return json.loads(path.read_text())


def test_a_cpu_run_writes_a_valid_record(tmp_path, monkeypatch):
    record = cpu_run(tmp_path, monkeypatch, "bf16,mslk-rowwise")
    rows = record["samples"]
    assert len(rows) == 2 * 8 * 2  # 2 kernels x 8 layers x M in (1, 3)
    bf16 = [r for r in rows if r["kernel"] == "bf16"]
    assert all(r["status"] == "ok" and r["max_rel_err"] < 1e-2 and r["copies"] >= 2 for r in bf16)
    assert {r["status"] for r in rows if r["kernel"] == "mslk-rowwise"} <= {"unavailable", "failed", "ok"}
    assert record["bandwidth"] is None and "CPU" in record["bandwidth_note"]
    assert record["inputs"]["shapes"]["tiny"][0] == ["qkv_proj", 2 * 2 * 128 + 2 * 128, 256, 1]
    models = {(e["kernel"], e["m"]): e for e in record["summary"]["models"]}
    assert models[("bf16", 1)]["complete"] and models[("bf16", 1)]["gbps"] > 0


def test_a_records_tables_again_over_chosen_layers(tmp_path, monkeypatch, capsys):
    record = cpu_run(tmp_path, monkeypatch, "bf16")
    path = next((tmp_path / "out").glob("gemm_*.json"))
    capsys.readouterr()
    assert gb.main(["--from-record", str(path), "--layers", "gate_up_proj,down_proj"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Only the layers gate_up_proj, down_proj.") and "| bf16 (reference) |" in out
    rows = [r for r in record["samples"] if r["m"] == 1 and r["layer"] in ("gate_up_proj", "down_proj")]
    counts = {name: c for name, _, _, c in record["inputs"]["shapes"]["tiny"]}
    again = json.loads(path.read_text())
    gb.summarize(again, ["gate_up_proj", "down_proj"])
    bf16 = next(e for e in again["summary"]["models"] if (e["kernel"], e["m"]) == ("bf16", 1))
    assert bf16["bytes"] == sum(r["bytes"] * counts[r["layer"]] for r in rows)  # the other six layers left out
    assert bf16["bytes"] < next(e for e in record["summary"]["models"] if (e["kernel"], e["m"]) == ("bf16", 1))["bytes"]
    assert json.loads(path.read_text())["summary"] == record["summary"]  # nothing written
    notes, nulls = tmp_path / "notes.json", tmp_path / "nulls.json"
    notes.write_text(json.dumps({"inputs": {"shapes": {}}, "samples": []}))  # no summary, no hardware
    nulls.write_text(json.dumps({**record, "hardware": None}))
    for argv, message in ((["--from-record", str(path), "--layers", "q_proj"], "q_proj is no layer of this record"),
                          (["--layers", "down_proj"], "--layers goes with --from-record"),
                          (["--from-record", str(tmp_path / "none.json")], "unreadable"),
                          (["--from-record", str(path), "--layers", ""], "--layers: empty list"),
                          (["--layers", ""], "--layers goes with --from-record"),
                          (["--from-record", str(notes)], "not a gemm_bench record"),
                          (["--from-record", str(nulls)], "not a gemm_bench record")):
        assert gb.main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and len(err.strip().splitlines()) == 1


def test_a_cpu_run_drives_vllms_own_kernel(tmp_path, monkeypatch):
    pytest.importorskip("vllm")
    # bf16 too: a run where no kernel times a row fails as a whole ("no kernel produced a timed row")
    record = cpu_run(tmp_path, monkeypatch, "bf16,vllm-cpu,vllm-marlin")
    rows = {(r["kernel"], r["layer"], r["m"]): r for r in record["samples"]}
    if not gb.cpu_wna16_built():  # the CPU build vLLM loads on an AVX2-only CPU has no W4A16 GEMM: refused, not failed
        assert {r["status"] for r in record["samples"] if r["kernel"] == "vllm-cpu"} == {"unsupported"}
        assert "cpu_gemm_wna16" in rows[("vllm-cpu", "gate_up_proj", 3)]["reason"]
        pytest.skip("vLLM's CPU build on this CPU has no _C.cpu_gemm_wna16")
    # vLLM's CPU kernel repacks the compressed-tensors weights this bench wrote and gets the reference product
    assert rows[("vllm-cpu", "gate_up_proj", 3)]["status"] == "ok"
    assert rows[("vllm-cpu", "gate_up_proj", 3)]["max_rel_err"] < gb.TOLERANCE
    # the refusals are vLLM's own words
    assert rows[("vllm-marlin", "down_proj", 1)]["status"] == "unsupported"
    assert "can_implement" in rows[("vllm-marlin", "down_proj", 1)]["reason"]
    assert record["summary"]["vllm_pick"]["tiny"]["gate_up_proj"].endswith("LinearKernel")


def test_the_labs_gemv_says_why_it_does_not_run_on_a_plain_cpu(tmp_path, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    rows = [r for r in cpu_run(tmp_path, monkeypatch, "bf16,lab-gemv")["samples"] if r["kernel"] == "lab-gemv"]
    assert rows and {r["status"] for r in rows} == {"unsupported"}
    assert "TRITON_INTERPRET=1" in rows[0]["reason"]
