"""Roofline accounting: bytes a decode step reads (hand-computed answers), the ratio, and the CLI's refusals."""

from __future__ import annotations

import json

import pytest

from scripts.measure import roofline as rl
from scripts.weights.shape_proxy import QWEN35_4B_TEXT

QWEN35_TEXT = {**QWEN35_4B_TEXT, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 8}


def test_qwen35_4b_kv_and_gdn_state_by_hand():
    c = rl.cache_bytes(QWEN35_TEXT)
    # 8 full-attention layers x K and V x 4 KV heads x 256 x 2 B
    assert c["kv_bytes_per_token"] == 8 * 2 * 4 * 256 * 2 == 32768
    # 24 GDN layers x (conv: 3 x (2 x 16 x 128 + 32 x 128) x 2 B + temporal: 32 x 128 x 128 x 2 B)
    assert c["state_bytes_per_sequence"] == 24 * (49152 + 1048576) == 26345472
    assert (c["full_attention_layers"], c["linear_attention_layers"]) == (8, 24)
    assert rl.cache_bytes(QWEN35_TEXT, kv_dtype="fp8")["kv_bytes_per_token"] == 16384
    fp32 = rl.cache_bytes(QWEN35_TEXT, ssm_dtype="float32")["state_bytes_per_sequence"]
    assert fp32 == 24 * (49152 + 2097152)  # the temporal state in FP32, the conv state stays BF16


def test_dense_config_without_layer_types_is_all_full_attention():
    c = rl.cache_bytes({"num_hidden_layers": 30, "hidden_size": 576, "num_attention_heads": 9,
                        "num_key_value_heads": 3})  # SmolLM2-135M: head_dim 64
    assert c == {"kv_bytes_per_token": 30 * 2 * 3 * 64 * 2, "state_bytes_per_sequence": 0,
                 "full_attention_layers": 30, "linear_attention_layers": 0}


def test_weights_grouped_by_dtype_and_what_a_text_step_skips():
    tensors = {"model.language_model.embed_tokens.weight": ("BF16", (100, 8)),       # 1600 B
               "model.language_model.layers.0.mlp.up_proj.weight_packed": ("I32", (16, 1)),   # 64 B
               "model.language_model.layers.0.mlp.up_proj.weight_scale": ("BF16", (16, 1)),   # 32 B
               "model.language_model.layers.0.self_attn.q_proj.weight": ("F8_E4M3", (8, 8)),  # 64 B
               "model.visual.blocks.0.attn.qkv.weight": ("BF16", (24, 8)),                    # 384 B
               "mtp.fc.weight": ("BF16", (8, 16))}                                            # 256 B
    tied = rl.step_weight_bytes(tensors, tied=True)
    assert tied["by_dtype"] == {"BF16": 1632, "F8_E4M3": 64, "I32": 64} and tied["total"] == 1760
    assert sum(tied["skipped"].values()) == 640
    untied = rl.step_weight_bytes({**tensors, "lm_head.weight": ("BF16", (50, 8))}, tied=False)
    assert untied["by_dtype"]["BF16"] == 32 + 800 and untied["total"] == 960
    with pytest.raises(rl.RooflineError, match="Q4_K"):
        rl.step_weight_bytes({"x": ("Q4_K", (1,))}, tied=True)


def test_step_bytes_and_ratio():
    # 8 GB of weights, 2 sequences of 1000 tokens at 32 kB/token plus 26 MB of state each
    assert rl.step_bytes(8e9, 32768, 26345472, 1000, 2) == 8e9 + 2 * (32768e3 + 26345472)
    r = rl.roofline(4.2e9, 4.2e12, 3.0)   # 4.2 GB at 4.2 TB/s = 1 ms; TPOT 3 ms
    assert r["roofline_ms"] == pytest.approx(1.0) and r["tpot_over_roofline"] == pytest.approx(3.0)
    assert rl.roofline(4.2e9, None, 3.0) == {"roofline_ms": None, "tpot_over_roofline": None}


def test_online_quantization_gets_bytes_but_no_ratio():
    facts = {"weights": {"total": 1000}, "kv_bytes_per_token": 10, "state_bytes_per_sequence": 0,
             "online_quantization": "fp8"}
    lv = rl.level_roofline(facts, 1e6, 10, 1, 2.0)
    assert lv["step_bytes"] == 1100 and lv["tpot_over_roofline"] is None
    lv8 = rl.level_roofline({**facts, "state_bytes_per_sequence": 5}, None, 10, 8, 2.0)
    assert (lv8["weight_bytes"], lv8["kv_bytes"], lv8["state_bytes"], lv8["step_bytes"]) == (1000, 800, 40, 1840)
    lv = rl.level_roofline({**facts, "online_quantization": None}, 1.1e6, 10, 1, 2.0)
    assert lv["roofline_ms"] == pytest.approx(1.0) and lv["tpot_over_roofline"] == pytest.approx(2.0)


def test_bandwidth_without_cuda_is_refused_not_assumed(monkeypatch):
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(rl.RooflineError, match="not measured"):
        rl.copy_bandwidth()


def test_checkpoint_bytes_from_headers(tmp_path):
    """A written checkpoint: the BF16 tied embedding and one layer read whole, online FP8 flagged."""
    import torch
    from safetensors.torch import save_file

    save_file({"model.embed_tokens.weight": torch.zeros(100, 8, dtype=torch.bfloat16),
               "model.layers.0.mlp.up_proj.weight": torch.zeros(16, 8, dtype=torch.bfloat16)},
              tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(
        {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1, "hidden_size": 8, "num_attention_heads": 2,
         "num_key_value_heads": 1, "tie_word_embeddings": True, "torch_dtype": "bfloat16"}))
    facts = rl.checkpoint_bytes(tmp_path, {})
    assert facts["weights"]["by_dtype"] == {"BF16": 1600 + 256} and facts["kv_bytes_per_token"] == 2 * 1 * 4 * 2
    assert facts["online_quantization"] is None
    assert rl.checkpoint_bytes(tmp_path, {"SERVE_QUANTIZATION": "fp8"})["online_quantization"] == "fp8"


def test_cli_refuses_an_unknown_variant(capsys):
    assert rl.main(["no-such-variant"]) == 2
    assert "no-such-variant" in capsys.readouterr().err


def test_mean_decode_context():
    # a request decodes from its prompt to prompt + output: on average prompt + output / 2
    assert rl.mean_decode_context([(100, 120), (300, 120)]) == (160 + 360) / 2
    assert rl.mean_decode_context([]) is None


def test_for_bench_on_a_cpu_names_what_it_could_not_count(tmp_path):
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    out = rl.for_bench(tmp_path / "m.gguf", {}, gpu=False)
    assert out["bytes"] is None and "not a checkpoint directory" in out["bytes_note"]
    assert out["bandwidth"] is None and out["bandwidth_note"] == "not measured: CPU record"
    d = tmp_path / "gemma"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "gemma3_text", "num_hidden_layers": 2, "hidden_size": 8,
                                                 "num_attention_heads": 2,
                                                 "layer_types": ["chunked_attention", "full_attention"]}))
    import torch
    from safetensors.torch import save_file

    save_file({"model.norm.weight": torch.zeros(8, dtype=torch.bfloat16)}, d / "model.safetensors")
    out = rl.for_bench(d, {}, gpu=False)
    assert out["bytes"] is None and "chunked_attention" in out["bytes_note"]


def test_several_gpus_bound_one_gpus_share():
    facts = {"weights": {"total": 8000}, "kv_bytes_per_token": 10, "state_bytes_per_sequence": 100}
    one = rl.level_roofline(facts, 1000.0, 50, 4, 10.0)                     # 8000 + 4 x (500 + 100) = 10400 B
    assert one["step_bytes"] == 10400 and one["roofline_ms"] == pytest.approx(10400.0) and "gpus" not in one
    tp2 = rl.level_roofline(facts, 1000.0, 50, 4, 10.0, {"tensor_parallel": 2, "data_parallel": 1, "replicas": 1,
                                                         "gpus": 2})
    assert tp2["step_bytes"] == 10400 / 2 and tp2["weight_bytes"] == 8000     # every GPU reads half of everything
    dp2 = rl.level_roofline(facts, 1000.0, 50, 4, 10.0, {"tensor_parallel": 1, "data_parallel": 2, "replicas": 1,
                                                         "gpus": 2})
    assert dp2["step_bytes"] == 8000 + 2 * 600 and (dp2["engines"], dp2["gpus"]) == (2, 2)  # whole weights, half the batch
    shared = rl.level_roofline(facts, 1000.0, 50, 4, 10.0, {"data_parallel": 1, "replicas": 2, "gpus": 1})
    assert shared["step_bytes"] == 2 * 8000 + 4 * 600                        # two replicas on one GPU: weights twice


def test_refresh_recomputes_a_records_levels_from_its_samples(tmp_path, capsys):
    facts = {"weights": {"total": 8000}, "kv_bytes_per_token": 10, "state_bytes_per_sequence": 100}
    rec = {"roofline": {"bytes": facts, "bandwidth": {"bytes_per_s": 1000.0}},
           "topology": {"tensor_parallel": 2, "data_parallel": 1, "replicas": 1, "gpus": 2},
           "samples": [{"mode": "fixed", "concurrency": 1, "requests": [
               {"ok": True, "prompt_tokens": 40, "output_tokens": 20}, {"ok": False, "prompt_tokens": 9, "output_tokens": 0}]},
               {"mode": "fixed", "request_rate": 8.0, "requests": []}],
           "summary": {"fixed": {"1": {"median_tpot_ms": 4.0, "roofline": {"step_bytes": 1.0}}}}}
    path = tmp_path / "latency_x.json"
    path.write_text(json.dumps(rec))
    assert rl.main(["--refresh", str(path)]) == 0
    got = json.loads(path.read_text())
    lvl = got["summary"]["fixed"]["1"]["roofline"]
    assert lvl["context_tokens"] == 50 and lvl["step_bytes"] == (8000 + 500 + 100) / 2   # the failed request left out
    assert lvl["tpot_over_roofline"] == pytest.approx(4.0 / 4300.0)
    assert "commit" in got["roofline"]["levels_recomputed_by"]
    bad = tmp_path / "latency_y.json"
    bad.write_text(json.dumps({**rec, "roofline": {"bytes": None, "bandwidth": None}}))
    assert rl.main(["--refresh", str(path), str(bad)]) == 2 and "no bytes counted" in capsys.readouterr().err


def test_sliding_window_layers_read_at_most_their_window():
    """Gemma 3 270M's text config (18 layers, 5 of 6 sliding over 512 tokens, 1 KV head of 256): by hand, 2 x 1 x 256 x
    2 bytes = 1,024 bytes a token a layer; at 2,000 tokens of context the 15 sliding layers read 512 tokens each."""
    types = (["sliding_attention"] * 5 + ["full_attention"]) * 3
    text = {"num_hidden_layers": 18, "hidden_size": 640, "num_attention_heads": 4, "num_key_value_heads": 1,
            "head_dim": 256, "layer_types": types, "sliding_window": 512}
    c = rl.cache_bytes(text)
    assert (c["kv_bytes_per_token"], c["window_kv_bytes_per_token"], c["sliding_window"]) == (3 * 1024, 15 * 1024, 512)
    assert rl.step_bytes(1000, c["kv_bytes_per_token"], 0, 2000, 1, c["window_kv_bytes_per_token"], 512) == \
        1000 + 3 * 1024 * 2000 + 15 * 1024 * 512
    lv = rl.level_roofline({"weights": {"total": 1000}, **c}, None, 100, 2, None)  # context below the window
    assert lv["kv_bytes"] == 2 * 18 * 1024 * 100
    with pytest.raises(rl.RooflineError, match="sliding_attention"):
        rl.cache_bytes({**text, "layer_types": ["chunked_attention"] * 18})
