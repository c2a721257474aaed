"""Profile reduction (scripts/measure/profile.py) on small hand-made trace events, with hand-computed answers."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest

from scripts.common.checkpoint import TensorInfo
from scripts.measure.profile import (
    GAPS,
    LAB_W4A16_KERNELS,
    LAB_W4A16_OP,
    Family,
    ProfileError,
    SigAgg,
    analyze,
    busy_union_us,
    category_table,
    classify,
    find_steps,
    gpu_events,
    is_worker_trace,
    kernel_bits,
    launches_per_step,
    layer_kinds,
    load_trace,
    main,
    map_gemms,
    newest_trace,
    project,
    record_families,
    roofline_rows,
    roofline_us,
    signatures_of,
    split_family_time,
    state_bytes_per_step,
    step_annotations,
    step_model,
    weight_catalogue,
)


def kernel(name, ts, dur, grid=(1, 1, 1), block=(128, 1, 1), cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 0, "tid": 7,
            "args": {"grid": list(grid), "block": list(block)}}


@pytest.mark.parametrize(("name", "cat", "want"), [
    ("nvjet_tst_64x8_64x16_4x1_v_bz_TNN", "kernel", "gemm"),
    ("void marlin::Marlin<256, 1, 8, 8, 4, 8>(int4 const*)", "kernel", "gemm"),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<...>>>", "kernel", "attention"),
    ("flashinfer::sampling::TopKTopPSamplingFromProbKernel", "kernel", "sampling"),
    ("void vllm::reshape_and_cache_flash_kernel<__nv_bfloat16, unsigned char, (vllm::Fp8KVCacheDataType)1>", "kernel",
     "attention"),
    ("fused_recurrent_gated_delta_rule_fwd_kernel", "kernel", "gdn"),
    ("_causal_conv1d_update_kernel", "kernel", "gdn"),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "kernel", "norm"),
    ("_fused_qk_rmsnorm_rope_gate_kernel", "kernel", "norm"),
    ("triton_poi_fused_mul_silu_slice_1", "kernel", "activation"),
    ("void vllm::act_and_mul_kernel<c10::BFloat16, &vllm::silu_kernel>", "kernel", "activation"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "kernel",
     "sampling"),
    ("void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float>", "kernel", "sampling"),
    ("void vllm::dynamic_per_token_scaled_fp8_quant_kernel<c10::BFloat16>", "kernel", "quant"),
    ("void vllm::rotary_embedding_kernel<c10::BFloat16, true>", "kernel", "rope"),
    ("void at::native::index_elementwise_kernel<128, 4>", "kernel", "other"),
    ("Memcpy DtoD (Device -> Device)", "gpu_memcpy", "memcpy"),
    ("Memset (Device)", "gpu_memset", "memset"),
    # Inductor names fused kernels after their nodes' origins: these read a quantized GEMM's output, they are no GEMM
    ("triton_poi_fused_machete_mm_mul_silu_slice_4", "kernel", "activation"),
    ("triton_red_fused__to_copy_add_fused_add_rms_norm_machete_mm_3", "kernel", "norm"),
    ("triton_red_fused__to_copy_abs_clamp_cutlass_scaled_mm_div_max_mul_reciprocal_silu_slice_un", "kernel", "quant"),
    ("triton_tem_fused_mm_0", "kernel", "gemm"),
    # the lab's W4A16 op: its Triton GEMV is a GEMM, the Inductor kernels named after the op around it are not
    ("gemv_stream", "kernel", "gemm"),
    ("triton_red_fused__to_copy_add_fused_add_rms_norm_w4a16_stream_or_marlin_3", "kernel", "norm"),
    ("triton_poi_fused_mul_silu_slice_w4a16_stream_or_marlin_4", "kernel", "activation"),
    ("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<machete::MacheteCollectiveMma<...>>>", "kernel",
     "gemm"),
])
def test_classify(name, cat, want):
    assert classify(name, cat) == want


def test_busy_union_merges_overlaps_and_skips_contained():
    # [0,10) + [5,15) -> 15; [12,14) inside; [20,25) -> 5: 20 in all
    assert busy_union_us([(20, 25), (0, 10), (5, 15), (12, 14)]) == 20
    assert busy_union_us([]) == 0


def test_gpu_events_keep_gpu_complete_events_in_time_order():
    events = [kernel("b", 5, 1), {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 9},
              kernel("a", 1, 2), {"ph": "i", "cat": "kernel", "name": "instant", "ts": 3},
              kernel("Memset (Device)", 3, 1, cat="gpu_memset"), kernel("old", 4, 1, cat="Kernel")]
    got = gpu_events(events)
    assert [g.name for g in got] == ["a", "Memset (Device)", "old", "b"]
    assert got[0].signature == ("a", (1, 1, 1), (128, 1, 1))


def test_step_annotations_count_decode_only_steps():
    events = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_2(40)_generation_0(0)", "ts": 0, "dur": 1},
              {"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_2(2)", "ts": 1, "dur": 1},
              {"ph": "X", "cat": "user_annotation", "name": "execute_2_context_0(sq0sk0sqsq0sqsk0)_generation_2(sq2sk90"
               "sqsq2sqsk90)", "ts": 2, "dur": 1},
              {"ph": "X", "cat": "gpu_user_annotation", "name": "execute_context_0(0)_generation_2(2)", "ts": 1, "dur": 1}]
    assert step_annotations(events) == {"steps": 3, "decode_only": 2, "with_prefill": 1}


# A two-layer hybrid: layer 0 Gated-DeltaNet, layer 1 full attention (full_attention_interval 2), hidden 4, tied head.
CONFIG = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": {
    "num_hidden_layers": 2, "full_attention_interval": 2, "hidden_size": 4, "intermediate_size": 8,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 2, "linear_num_value_heads": 2,
    "linear_key_head_dim": 2, "linear_value_head_dim": 2, "vocab_size": 32, "dtype": "bfloat16"}}


def tensors(**extra):
    p = "model.language_model."
    shapes = {
        p + "embed_tokens.weight": (32, 4),
        p + "norm.weight": (4,),
        p + "layers.0.input_layernorm.weight": (4,),
        p + "layers.0.linear_attn.in_proj_qkv.weight": (12, 4), p + "layers.0.linear_attn.in_proj_z.weight": (4, 4),
        p + "layers.0.linear_attn.in_proj_b.weight": (2, 4), p + "layers.0.linear_attn.in_proj_a.weight": (2, 4),
        p + "layers.0.linear_attn.conv1d.weight": (12, 1, 4), p + "layers.0.linear_attn.A_log": (2,),
        p + "layers.0.linear_attn.out_proj.weight": (4, 4),
        p + "layers.1.self_attn.q_proj.weight": (8, 4), p + "layers.1.self_attn.k_proj.weight": (2, 4),
        p + "layers.1.self_attn.v_proj.weight": (2, 4), p + "layers.1.self_attn.o_proj.weight": (4, 4),
        p + "layers.1.self_attn.q_norm.weight": (2,),
        "mtp.layers.0.self_attn.q_proj.weight": (8, 4),  # left out: not served without speculation
        "model.visual.blocks.0.attn.qkv.weight": (12, 4),  # left out: text-only
        **extra,
    }
    for i in (0, 1):
        shapes |= {p + f"layers.{i}.mlp.gate_proj.weight": (8, 4), p + f"layers.{i}.mlp.up_proj.weight": (8, 4),
                   p + f"layers.{i}.mlp.down_proj.weight": (4, 8)}
    return {k: TensorInfo("BF16", v, "model.safetensors") for k, v in shapes.items()}


def test_layer_kinds_from_interval_and_from_layer_types():
    assert layer_kinds(CONFIG) == {"linear_attn": 1, "self_attn": 1, "mlp": 2}
    llama = {"num_hidden_layers": 3}
    assert layer_kinds(llama) == {"linear_attn": 0, "self_attn": 3, "mlp": 3}
    typed = {"num_hidden_layers": 4, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    assert layer_kinds(typed) == {"linear_attn": 3, "self_attn": 1, "mlp": 4}


def test_weight_catalogue_packs_like_vllm_and_merges_equal_shapes():
    fams, per_step = weight_catalogue(tensors(), CONFIG)
    by_label = {f.label: f for f in fams}
    # lm_head tied to the embedding: 32 x 4 x 2 B = 256 B, once per step
    assert by_label["lm_head"].bytes_per_call == 256 and by_label["lm_head"].kinds == {"lm_head": 1}
    # gate+up packed: (8 + 8) x 4 x 2 = 128 B, one per layer -> 2 calls per step
    assert by_label["mlp.gate_up_proj"].kinds == {"mlp": 2} and by_label["mlp.gate_up_proj"].bytes_per_call == 128
    # out_proj (GDN) and o_proj (attention) are both 4 x 4 BF16: one family, one call from each kind
    mixed = by_label["linear_attn.out_proj+self_attn.o_proj"]
    assert mixed.kinds == {"linear_attn": 1, "self_attn": 1} and mixed.count == 2 and mixed.bytes_per_call == 32
    assert by_label["linear_attn.in_proj_qkvz"].bytes_per_call == (12 + 4) * 4 * 2
    assert by_label["linear_attn.in_proj_ba"].bytes_per_call == (2 + 2) * 4 * 2
    assert by_label["self_attn.qkv_proj"].bytes_per_call == (8 + 2 + 2) * 4 * 2
    assert fams[0].label == "lm_head"  # largest first
    # per step: linear_attn 128 + 32 + 32 = 192; self_attn 96 + 32 = 128; mlp 2 x (128 + 64) = 384; lm_head 256
    assert per_step == {"linear_attn": 192, "self_attn": 128, "mlp": 384, "lm_head": 256,
                        # norms 4 x 2 x 2 (final + input_layernorm) = 16, conv1d 12*4*2 = 96, A_log 4, q_norm 4
                        "other_params": 16 + 96 + 4 + 4}


def test_weight_catalogue_online_fp8_halves_layer_weights_not_the_head():
    _, per_step = weight_catalogue(tensors(), CONFIG, serve_quantization="fp8")
    assert per_step["mlp"] == 192 and per_step["linear_attn"] == 96 and per_step["lm_head"] == 256


def test_weight_catalogue_untied_head_and_packed_int4():
    extra = {"lm_head.weight": (16, 4)}
    cfg = {**CONFIG, "tie_word_embeddings": False}
    t = tensors(**extra)
    p = "model.language_model."
    for i in (0, 1):  # W4A16 MLP: int32-packed weights (8 int4 per int32) + BF16 group scales
        for m, shape in (("gate_proj", (8, 4)), ("up_proj", (8, 4)), ("down_proj", (4, 8))):
            del t[p + f"layers.{i}.mlp.{m}.weight"]
            t[p + f"layers.{i}.mlp.{m}.weight_packed"] = TensorInfo("I32", (shape[0], shape[1] // 8 or 1), "m")
            t[p + f"layers.{i}.mlp.{m}.weight_scale"] = TensorInfo("BF16", (shape[0], 1), "m")
    fams, per_step = weight_catalogue(t, cfg)
    assert per_step["lm_head"] == 16 * 4 * 2
    # gate_up: packed 2 x (8 x 1 x 4 B) + scales 2 x (8 x 2 B) = 64 + 32 = 96; down: 4 x 1 x 4 + 4 x 2 = 24
    assert per_step["mlp"] == 2 * (96 + 24)


def test_the_lab_kernels_names_are_the_lever_modules():
    """The names profile.py reads the lab's W4A16 kernels by are those its lever defines (read as text: no GPU
    imports), and they count as 4-bit reads."""
    op = Path("scripts/levers/kernels/vllm_kernel.py").read_text()
    triton = Path("scripts/levers/kernels/gemv_kernel.py").read_text()
    assert f'"lab::{LAB_W4A16_OP}"' in op
    assert all(f"def {k}(" in triton and kernel_bits(k) == 4 for k in LAB_W4A16_KERNELS)
    assert kernel_bits("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT") == 16


def test_signature_rows_keep_the_trace_categories_and_are_classified_again():
    rows = [{"name": "Memcpy DtoD (Device -> Device)", "grid": [], "block": [], "category": "memcpy", "calls": 2,
             "total_us": 3.0},
            {"name": "triton_poi_fused_mul_silu_slice_w4a16_stream_or_marlin_4", "grid": [17, 1, 1], "block": [128, 1, 1],
             "category": "gemm", "calls": 4, "total_us": 6.0}]  # a record's row from before the rule
    memcpy, act = signatures_of(rows)
    assert (memcpy.category, memcpy.calls, memcpy.total_us) == ("memcpy", 2, 3.0)
    assert act.category == "activation" and act.grid == (17, 1, 1)


def test_bits_name_a_family_by_its_label_merged_families_too():
    record = {"weights": {"families": [
        {"units": ["linear_attn.out_proj", "self_attn.o_proj"], "calls_per_step": {"linear_attn": 3, "self_attn": 1},
         "bytes_per_call": 100, "bits": 16},
        {"units": ["lm_head"], "calls_per_step": {"lm_head": 1}, "bytes_per_call": 50, "bits": 16}]}}
    fams = record_families(record, None, {"linear_attn.out_proj+self_attn.o_proj": 4, "lm_head": 4})
    assert [f.bits for f in fams] == [4, 4]
    assert [f.bits for f in record_families(record, None)] == [16, 16]
    with pytest.raises(ProfileError, match="self_attn.o_proj: no such family"):
        record_families(record, None, {"self_attn.o_proj": 4})


def test_a_packed_output_layer_is_a_4_bit_family():
    t = tensors(**{"lm_head.weight_packed": (16, 1), "lm_head.weight_scale": (16, 1)})
    t["lm_head.weight_packed"] = TensorInfo("I32", (16, 1), "m")
    fams, per_step = weight_catalogue(t, {**CONFIG, "tie_word_embeddings": False})
    (head,) = [f for f in fams if f.units == ["lm_head"]]
    assert head.bits == 4 and per_step["lm_head"] == 16 * 4 + 16 * 2


def fake_model_trace(steps=3, step_us=150.0, with_prefill_sig=False):
    """`steps` decode steps of the two-layer model (GEMM time ordered like their weights), a 10 µs gap after each."""
    ev, t = [], 0.0
    plan = [("k_qkvz", 16, (4, 1, 1)), ("fused_recurrent_gated_delta_rule_fwd_kernel", 5, None),
            ("k_ba", 2, (2, 1, 1)), ("k_out", 4, (9, 1, 1)), ("triton_red_fused_add_mean_rsqrt_0", 3, None),
            ("k_gate_up", 13, (8, 1, 1)), ("triton_poi_fused_mul_silu_1", 2, None), ("k_down", 7, (3, 1, 1)),
            ("k_qkv", 9, (5, 1, 1)), ("flash_fwd_kernel", 6, None), ("k_out", 4, (9, 1, 1)),
            ("triton_red_fused_add_mean_rsqrt_0", 3, None), ("k_gate_up", 13, (8, 1, 1)),
            ("triton_poi_fused_mul_silu_1", 2, None), ("k_down", 7, (3, 1, 1)), ("k_lm_head", 20, (16, 1, 1)),
            ("argmax_kernel", 0.0, None)]
    for _ in range(steps):
        for name, dur, grid in plan:
            nm = f"gemm_{name}" if grid else name
            d = dur if name != "argmax_kernel" else step_us - 10 - sum(x[1] for x in plan[:-1])
            ev.append(kernel(nm, t, d, grid=grid or (1, 1, 1)))
            t += d
        t += 10  # CPU/launch gap
    if with_prefill_sig:
        ev.append(kernel("gemm_k_gate_up", t, 50, grid=(8, 2, 1)))  # a prefill-shaped call: 1 call, no family
    return ev


def test_find_steps_and_map_gemms_by_count_then_size():
    fams, _ = weight_catalogue(tensors(), CONFIG)
    table = category_table(gpu_events(fake_model_trace()), fams)
    assert table["steps"] == 3 and table["steps_signature"] == "gemm_k_lm_head"
    rows = {r["name"]: r for r in table["signatures"]}
    # 2 calls per step: gate_up (13 µs, 128 B), down (7 µs, 64 B), out+o (4 µs, 32 B) pair by size
    assert rows["gemm_k_gate_up"]["family"] == "mlp.gate_up_proj"
    assert rows["gemm_k_down"]["family"] == "mlp.down_proj"
    assert rows["gemm_k_out"]["family"] == "linear_attn.out_proj+self_attn.o_proj"
    # 1 call per step: lm_head (20 µs, 256 B) > qkvz (16, 128) > qkv (9, 96) > ba (2, 32)
    assert rows["gemm_k_qkvz"]["family"] == "linear_attn.in_proj_qkvz"
    assert rows["gemm_k_qkv"]["family"] == "self_attn.qkv_proj"
    assert rows["gemm_k_ba"]["family"] == "linear_attn.in_proj_ba"
    per = table["per_step_us"]
    assert per["gemm:mlp"] == pytest.approx(2 * (13 + 7))
    assert per["gemm:linear_attn"] == pytest.approx(16 + 2 + 4)  # qkvz + ba + its half of out/o
    assert per["gemm:self_attn"] == pytest.approx(9 + 4)
    assert per["gemm:lm_head"] == pytest.approx(20)
    assert per["gdn"] == pytest.approx(5) and per["attention"] == pytest.approx(6)
    assert per["norm"] == pytest.approx(6) and per["activation"] == pytest.approx(4)
    # every step is 150 µs of which 10 are a gap; the window ends with the last kernel, so 2 gaps in 3 steps
    assert per[GAPS] == pytest.approx(20 / 3)
    assert per["sampling"] == pytest.approx(150 - 10 - 116)  # argmax fills the step: 150 - gap - the other kernels


def test_unmapped_and_irregular_signatures():
    fams, _ = weight_catalogue(tensors(), CONFIG)
    table = category_table(gpu_events(fake_model_trace(with_prefill_sig=True)), fams)
    assert table["unmapped_gemm_signatures"] == 1
    assert table["per_step_us"]["gemm:unmapped"] == pytest.approx(50 / 3)


def test_map_gemms_leaves_extra_signatures_unmapped():
    fam = Family(["mlp.down_proj"], {"mlp": 2}, 64, ())
    a, b = SigAgg("big", (1,), (1,), "gemm", 20, 200.0), SigAgg("small", (1,), (1,), "gemm", 20, 20.0)
    got = map_gemms([a, b], [fam], steps=10)
    assert got[("big", (1,), (1,))] is fam and got[("small", (1,), (1,))] is None
    assert find_steps([a, b], [Family(["lm_head"], {"lm_head": 1}, 9, ()), fam]) == (20, a)


def test_split_family_time_by_layer_counts():
    fam = Family(["linear_attn.out_proj", "self_attn.o_proj"], {"linear_attn": 24, "self_attn": 8}, 1, ())
    assert split_family_time(320.0, fam) == {"gemm:linear_attn": 240.0, "gemm:self_attn": 80.0}
    assert split_family_time(5.0, None) == {"gemm:unmapped": 5.0}


def test_roofline_and_rows():
    assert roofline_us(3e9, 3000) == pytest.approx(1000.0)  # 3 GB at 3 TB/s = 1 ms
    rows = roofline_rows({"gemm:mlp": 30.0, GAPS: 10.0}, {"gemm:mlp": 60e6}, 3000)
    mlp = next(r for r in rows if r["category"] == "gemm:mlp")
    assert mlp["roofline_us"] == 20.0 and mlp["vs_roofline"] == 1.5 and mlp["share"] == 0.75
    assert rows[-1] == {"category": "total", "us_per_step": 40.0, "share": 1.0, "bytes_per_step": 60e6,
                        "roofline_us": 20.0, "vs_roofline": None}


def test_state_bytes():
    s = state_bytes_per_step(CONFIG, concurrency=2, context_tokens=10, kv_cache_dtype=None)
    # KV per token: 2 (K,V) x 1 layer x 1 head x 2 dim x 2 B = 8 -> 2 requests x 10 tokens = 160
    # GDN state: 2 (read+write) x 1 layer x 2 heads x 2 x 2 x 2 B = 32 per request -> 64
    assert s["attention"] == 160 and s["gdn"] == 64 and s["kv_bytes_per_token"] == 8
    assert state_bytes_per_step(CONFIG, 2, 10, "fp8_e4m3")["attention"] == 80


def test_step_model_fit_and_projection():
    # 9.0 GB of weights streamed in 3000 µs of GEMMs -> 3000 GB/s; step 4000 µs -> fixed 1000 µs
    m = step_model(step_us=4000, weight_gemm_us=3000, weight_bytes=9e9, device_gbs=3350, concurrency=8)
    assert m["fit"]["fixed_us"] == 1000 and m["fit"]["bandwidth_gbs"] == 3000.0
    eff = 3000 / 3350
    assert m["fit"]["efficiency_vs_device"] == round(eff, 3)
    assert m["projection"]["step_us"] == pytest.approx(1000 + 9e9 / (600e9 * eff) * 1e6, abs=0.01)
    assert m["projection"]["step_us_at_peak"] == pytest.approx(16000.0)  # 1000 + 9 GB / 600 GB/s
    assert m["projection"]["tokens_per_s_at_peak"] == pytest.approx(500.0)  # 8 / 16 ms
    assert "projection" in m["projection"]["label"]


def test_launches_per_step_tell_graph_replays_from_eager_kernels():
    ev = [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "ts": i, "dur": 1} for i in range(4)]
    ev += [{"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": i, "dur": 1} for i in range(6)]
    ev += [{"ph": "X", "cat": "cuda_driver", "name": "cuLaunchKernel", "ts": 0, "dur": 1},
           {"ph": "X", "cat": "cuda_runtime", "name": "cudaMemcpyAsync", "ts": 0, "dur": 1},
           kernel("k", 0, 1)]
    assert launches_per_step(ev, 2) == {"cuLaunchKernel": 0.5, "cudaGraphLaunch": 2.0, "cudaLaunchKernel": 3.0}
    assert launches_per_step(ev, 0) == {}


def test_projection_takes_the_unprofiled_tpot_and_every_gemm_row(tmp_path, capsys):
    # weight GEMMs 2000 µs mapped + 1000 µs unmapped for 9 GB; unprofiled TPOTs 3.9 / 4.0 / 4.4 ms -> median 4000 µs
    table = [{"category": "gemm:mlp", "us_per_step": 2000.0}, {"category": "gemm:unmapped", "us_per_step": 1000.0},
             {"category": "attention", "us_per_step": 400.0}]
    prof = {"variant": "v", "inputs": {"bandwidth_gbs": 3350.0},
            "summary": {"1": {"table": table, "step_model": {"fit": {"weight_bytes": 9e9}}}}}
    m = project(prof, [3.9, 4.4, 4.0])
    assert m["fit"]["step_us"] == 4000 and m["fit"]["fixed_us"] == 1000 and m["fit"]["bandwidth_gbs"] == 3000.0
    assert m["projection"]["step_us_at_peak"] == pytest.approx(16000.0)
    assert "split" not in m  # a profile without its GPU-busy union: no three-way split
    with pytest.raises(ProfileError, match="not above the profiled weight GEMMs"):
        project(prof, [2.5])
    # with the busy union (3 steps, 3300 µs of GPU work each): 4000 = 3000 GEMMs + 300 other kernels + 700 host
    split = project({**prof, "summary": {"1": {**prof["summary"]["1"], "busy_us": 9900.0, "steps": 3}}},
                    [3.9, 4.4, 4.0])["split"]
    assert (split["weight_gemms_us"], split["other_kernels_us"], split["host_us"], split["gpu_busy_us"]) == \
        (3000, 300, 700, 3300)
    # the command: records of the named variant only, one JSON answer
    (tmp_path / "p.json").write_text(json.dumps(prof))
    lat = {"variant": "v", "summary": {"fixed": {"1": {"p50_tpot_ms": 4.0}}}}
    (tmp_path / "l.json").write_text(json.dumps(lat))
    assert main(["v", "--project", str(tmp_path / "p.json"), "--tpot-from", str(tmp_path / "l.json"),
                 "--concurrency", "1"]) == 0
    assert json.loads(capsys.readouterr().out)["c=1"]["fit"]["fixed_us"] == 1000
    assert main(["w", "--project", str(tmp_path / "p.json"), "--tpot-from", str(tmp_path / "l.json"),
                 "--concurrency", "1"]) == 1
    assert capsys.readouterr().err.strip() == "error: every record must be of w"
    with pytest.raises(ProfileError, match=r"no level c=8 \(it has c=1\)"):
        project(prof, [4.0], concurrency=8)
    (tmp_path / "null.json").write_text(json.dumps({"variant": "v", "summary": {"fixed": {"1": {"p50_tpot_ms": None}}}}))
    assert main(["v", "--project", str(tmp_path / "p.json"), "--tpot-from", str(tmp_path / "null.json"),
                 "--concurrency", "1"]) == 1
    assert "no latency record has a fixed-length level c=1 with a TPOT" in capsys.readouterr().err


def test_analyze_end_to_end_on_the_fake_trace():
    fams, per_step = weight_catalogue(tensors(), CONFIG)
    ann = [{"ph": "X", "cat": "user_annotation", "name": "execute_context_0(0)_generation_1(1)", "ts": 0, "dur": 1}] * 3
    res = analyze(fake_model_trace() + ann, families=fams, bytes_per_step=per_step, config=CONFIG, concurrency=1,
                  context_tokens=10, kv_cache_dtype=None, bandwidth_gbs=1e-6)  # 1 kB/s: 1 B reads in 1000 µs
    assert res["steps"] == 3 and res["steps_from"]["annotations"]["decode_only"] == 3
    assert res["step_us"] == pytest.approx((3 * 150 - 10) / 3)
    rows = {r["category"]: r for r in res["table"]}
    assert rows["gemm:mlp"]["bytes_per_step"] == 384 and rows["gemm:mlp"]["roofline_us"] == pytest.approx(384e3)
    assert rows["attention"]["bytes_per_step"] == 80  # 10 tokens x 8 B
    assert res["step_model"]["fit"]["weight_bytes"] == 192 + 128 + 384 + 256


def test_no_events_is_an_error():
    with pytest.raises(ProfileError):
        category_table([], [])


def test_trace_files(tmp_path):
    events = fake_model_trace(steps=1)
    gz = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1700000000000.pt.trace.json.gz"
    with gzip.open(gz, "wt") as f:
        json.dump({"traceEvents": events, "deviceProperties": []}, f)
    assert load_trace(gz) == events
    front = tmp_path / "host_123.async_llm.1700000000001.pt.trace.json.gz"
    front.write_bytes(gz.read_bytes())
    old = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1600000000000.pt.trace.json"
    old.write_text(json.dumps(events))
    os.utime(old, (1, 1))
    assert not is_worker_trace(front) and is_worker_trace(old)
    assert newest_trace(tmp_path, since=1000, wait_s=5) == gz
    with pytest.raises(ProfileError):
        newest_trace(tmp_path, since=gz.stat().st_mtime + 10, wait_s=1.5)


def test_main_analyses_a_trace_of_the_real_smollm2_checkpoint(embedded_weights, tmp_path, capsys):
    """The CLI on a trace shaped like SmolLM2's decode (30 llama layers, tied head), against its real safetensors."""
    ev, t = [], 0.0
    for _ in range(4):
        for _layer in range(30):
            for name, dur in (("qkv", 3), ("flash_fwd_splitkv_kernel", 2), ("o", 2), ("rms_norm_kernel", 1),
                              ("gate_up", 8), ("silu_and_mul", 1), ("down", 5)):
                ev.append(kernel(f"nvjet_{name}" if name in ("qkv", "o", "gate_up", "down") else name, t, dur))
                t += dur
        ev += [kernel("nvjet_lm_head", t, 40), kernel("argmax_kernel", t + 40, 2)]
        t += 42 + 20
    trace = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json"
    trace.write_text(json.dumps({"traceEvents": ev}))
    rc = main(["smollm2-bf16", "--trace", str(trace), "--concurrency", "1", "--bandwidth-gbs", "1000",
               "--out-dir", str(tmp_path / "out")])
    assert rc == 0
    (record_path,) = (tmp_path / "out").glob("profile_*.json")
    rec = json.loads(record_path.read_text())
    assert rec["schema"]["kind"] == "profile" and rec["status"] == "ok"
    r = rec["summary"]["1"]
    assert r["steps"] == 4 and r["steps_from"]["lm_head_signature"] == "nvjet_lm_head"
    rows = {x["category"]: x for x in r["table"]}
    assert rows["gemm:mlp"]["us_per_step"] == 30 * (8 + 5)
    assert rows["gemm:self_attn"]["us_per_step"] == 30 * (3 + 2)
    assert rows["gemm:lm_head"]["us_per_step"] == 40 and rows["gemm:unmapped"]["us_per_step"] == 0
    # the tied head: 49152 x 576 x 2 B read once per step, 56.6 µs at 1000 GB/s
    assert rows["gemm:lm_head"]["bytes_per_step"] == 49152 * 576 * 2 and rows["gemm:lm_head"]["roofline_us"] == 56.62
    assert rows[GAPS]["us_per_step"] == 15.0  # three 20 µs gaps in four steps
    # every weight GEMM mapped, all 16-bit: the bytes of a step over their time, against the 1000 GB/s given
    read = r["gemm_by_bits"]["16"]
    weights = sum(rows[f"gemm:{k}"]["bytes_per_step"] for k in ("self_attn", "mlp", "lm_head"))
    assert read["us_per_step"] == 30 * (3 + 2 + 8 + 5) + 40 and read["bytes_per_step"] == weights
    assert read["gbs"] == round(weights / 580 / 1e3, 1) and read["of_bandwidth"] == round(weights / 580 / 1e6, 4)
    assert r["step_model"]["projection"]["label"].startswith("projection")
    sig = {s["name"]: s["family"] for s in rec["samples"][0]["signatures"]}
    assert sig["nvjet_gate_up"] == "mlp.gate_up_proj" and sig["nvjet_o"] == "self_attn.o_proj"
    assert "| gemm:mlp | 390.0 |" in record_path.with_suffix(".md").read_text()
    # the same traces analysed again from the record alone (no checkpoint, no server): same table, both named
    assert main(["smollm2-bf16", "--reanalyze", str(record_path), "--trace-dir", str(tmp_path),
                 "--out-dir", str(tmp_path / "re")]) == 0
    (again,) = (tmp_path / "re").glob("profile_*.json")
    re_rec = json.loads(again.read_text())
    assert re_rec["reanalysis"]["of"] == record_path.name and re_rec["hardware"] == rec["hardware"]
    assert re_rec["summary"]["1"]["table"] == r["table"]
    assert main(["smollm2-fp32", "--reanalyze", str(record_path), "--trace-dir", str(tmp_path)]) == 1  # not its record
    # the trace left behind on the GPU machine: the record's signature rows give the same table
    assert main(["smollm2-bf16", "--reanalyze", str(record_path), "--out-dir", str(tmp_path / "rows")]) == 0
    (rows_rec,) = (tmp_path / "rows").glob("profile_*.json")
    again = json.loads(rows_rec.read_text())["summary"]["1"]
    assert again["from_signature_rows"] and again["table"] == r["table"] and again["steps"] == 4
    # --bits: a family's served bits over the record's; the output layer read as 4-bit leaves the 16-bit
    # nvjet_lm_head signature with no family to take it
    assert main(["smollm2-bf16", "--reanalyze", str(record_path), "--bits", "lm_head=4",
                 "--out-dir", str(tmp_path / "bits")]) == 0
    (bits_rec,) = (tmp_path / "bits").glob("profile_*.json")
    head = {x["category"]: x for x in json.loads(bits_rec.read_text())["summary"]["1"]["table"]}
    assert head["gemm:lm_head"]["us_per_step"] == 0 and head["gemm:unmapped"]["us_per_step"] == 40
    assert json.loads(bits_rec.read_text())["summary"]["1"]["gemm_by_bits"]["16"]["us_per_step"] == 540
    capsys.readouterr()
    for bad, says in ((["--bits", "no_such=4"], "no such family"), (["--bits", "lm_head=4", "--bits", "lm_head=16"],
                                                                    "names lm_head twice"),
                      (["--trace-dir", str(tmp_path / "x")], "leave it out to use the record's signature rows")):
        assert main(["smollm2-bf16", "--reanalyze", str(record_path), *bad, "--out-dir", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err
        assert says in err and len(err.splitlines()) == 1, err
    for usage, says in ((["--reanalyze", str(record_path), "--bits", "lm_head=5"], "BITS one of 4, 8, 16"),
                        (["--trace", "t.json", "--bits", "lm_head=4"], "--bits needs --reanalyze")):
        with pytest.raises(SystemExit) as stop:  # a usage error before any file is read
            main(["smollm2-bf16", *usage])
        assert stop.value.code == 2 and says in capsys.readouterr().err
    capsys.readouterr()
    assert not (tmp_path / "x").exists()
    broken = json.loads(record_path.read_text())
    broken["samples"][0]["signatures"][0]["grid"] = None
    (tmp_path / "b").mkdir()  # a folder without the trace: the rows are read
    (tmp_path / "b" / "broken.json").write_text(json.dumps(broken))
    assert main(["smollm2-bf16", "--reanalyze", str(tmp_path / "b" / "broken.json"), "--out-dir", str(tmp_path / "x")]) == 1
    err = capsys.readouterr().err
    assert "broken.json: a malformed field" in err and len(err.splitlines()) == 1, err
    (tmp_path / "b" / "not-json.json").write_text("{")  # files that do not read are named, the trace too
    (tmp_path / "b" / trace.name).write_text('{"no": "events"}')
    for bad, says in ((["--reanalyze", str(tmp_path / "b" / "not-json.json")], "not-json.json: the record does not read"),
                      (["--reanalyze", str(record_path), "--trace-dir", str(tmp_path / "b")],
                       f"{trace.name}: not a trace this version reads")):
        assert main(["smollm2-bf16", *bad, "--out-dir", str(tmp_path / "x")]) == 1
        err = capsys.readouterr().err
        assert says in err and len(err.splitlines()) == 1, err


def test_map_gemms_by_weight_bits_and_one_kernel_serving_two_families():
    """W4A16 MLP on Hopper: one persistent-grid Machete signature runs gate_up and down (64 calls per step); the BF16
    out/o projection is a split-K nvjet GEMM of 32 calls whose reduction kernel has 32 calls too."""
    gate_up = Family(["mlp.gate_up_proj"], {"mlp": 32}, 2400, (), 4)
    down = Family(["mlp.down_proj"], {"mlp": 32}, 1200, (), 4)
    out_o = Family(["linear_attn.out_proj", "self_attn.o_proj"], {"linear_attn": 24, "self_attn": 8}, 2100, (), 16)
    machete = SigAgg("void cutlass::device_kernel<machete::MacheteCollectiveMma<...>>", (1, 132, 1), (384,), "gemm",
                     640, 640 * 18.0)
    nvjet = SigAgg("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", (4, 20, 1), (384,), "gemm", 320, 320 * 7.8)
    reduce = SigAgg("void cublasLt::splitKreduce_kernel<32, 16>", (80, 1, 1), (32,), "gemm", 320, 320 * 1.7)
    assert (kernel_bits(machete.name), kernel_bits(nvjet.name)) == (4, 16)
    got = map_gemms([machete, nvjet, reduce], [gate_up, down, out_o], steps=10)
    both = got[(machete.name, machete.grid, machete.block)]
    assert sorted(both.units) == ["mlp.down_proj", "mlp.gate_up_proj"] and both.count == 64
    assert got[(nvjet.name, nvjet.grid, nvjet.block)] is out_o  # by bits: not the larger 4-bit gate_up
    assert got[(reduce.name, reduce.grid, reduce.block)] is None
    assert split_family_time(300.0, both) == {"gemm:mlp": 300.0}
    assert split_family_time(320.0, out_o) == {"gemm:linear_attn": 240.0, "gemm:self_attn": 80.0}


def test_annotated_steps_win_over_the_output_layer_signature():
    fams, _ = weight_catalogue(tensors(), CONFIG)
    events = gpu_events(fake_model_trace())
    assert category_table(events, fams)["steps"] == 3  # no annotations: the head's signature counts the steps
    table = category_table(events, fams, annotated_steps=6)  # e.g. a pruned head made another signature look like it
    assert table["steps"] == 6 and table["steps_by_signature"] == 3


def test_stepsplit_reduces_runner_scopes_per_step():
    from scripts.measure.stepsplit import scope_split

    def ev(name, ts, dur, cat="user_annotation"):
        return {"ph": "X", "name": name, "ts": ts, "dur": dur, "cat": cat}

    step = "execute_context_0(0)_generation_1(1)"
    events = [ev(step, 0, 9_000), ev(step, 12_000, 9_000), ev(step, 24_000, 9_000),  # a step every 12 ms
              ev("gpu_model_runner: forward", 1_000, 7_000), ev("gpu_model_runner: forward", 13_000, 7_000),
              ev("gpu_model_runner: draft", 9_500, 2_000), ev("gpu_model_runner: draft", 21_500, 2_000),
              ev("gpu_model_runner: forward", 25_000, 7_000),  # the last step's: its period is unknown, left out
              ev("aten::mm", 2_000, 500, "cpu_op")]
    s = scope_split(events)
    assert s["periods"] == 2 and s["step_ms"] == 12.0
    assert s["scopes_ms_per_step"] == {"forward": 7.0, "draft": 2.0} and s["other_ms_per_step"] == 3.0
    with pytest.raises(Exception, match="fewer than two engine step annotations"):
        scope_split([ev(step, 0, 1.0)])
