"""The GPU plan (scripts/optimize/gpu.py) for compute capabilities 8.0, 8.6, 8.9 and 9.0: vLLM's own scheme capabilities
and kernel checks run for real; only the capability query (vLLM's current platform: is it CUDA, which capability) is
faked, after vLLM's modules are imported on this machine's real platform."""

from __future__ import annotations

import json

import pytest

from scripts.optimize import gpu

pytest.importorskip("vllm")


@pytest.fixture
def device(monkeypatch):
    """set(cc): vLLM's current platform answers as a CUDA device of that capability (90 for 9.0)."""
    gpu._kernel_table()  # vLLM's kernel and scheme modules imported on the real platform first: some run
    gpu.scheme_capabilities()  # device queries at import time that a faked CUDA platform would send to missing ops
    from vllm.platforms import current_platform as cp
    from vllm.platforms.interface import DeviceCapability

    def set_cc(cc: int) -> None:
        for name, fn in {"is_cuda": lambda: True, "is_cuda_alike": lambda: True,
                         "get_device_capability": lambda device_id=0: DeviceCapability(cc // 10, cc % 10),
                         "is_device_capability": lambda c, device_id=0: (c if isinstance(c, int) else c[0] * 10 + c[1]) == cc,
                         "has_device_capability": lambda c, device_id=0: cc >= (c if isinstance(c, int) else c[0] * 10 + c[1]),
                         }.items():
            monkeypatch.setattr(cp, name, fn, raising=False)

    return set_cc


def checkpoint(tmp_path, kv_out: int, mtp: bool = False, vocab: int = 1000, tied: bool = False):
    """A two-layer checkpoint: attention q/k/v/o and the MLP, hidden 256, MLP 512; k_proj's and v_proj's N = kv_out;
    an output layer of `vocab` rows (none stored where tied: the embedding is)."""
    import torch
    from safetensors.torch import save_file

    t = {}
    for i in range(2):
        p = f"model.layers.{i}"
        t |= {f"{p}.self_attn.q_proj.weight": torch.zeros(256, 256), f"{p}.self_attn.k_proj.weight": torch.zeros(kv_out, 256),
              f"{p}.self_attn.v_proj.weight": torch.zeros(kv_out, 256), f"{p}.self_attn.o_proj.weight": torch.zeros(256, 256),
              f"{p}.mlp.gate_proj.weight": torch.zeros(512, 256), f"{p}.mlp.up_proj.weight": torch.zeros(512, 256),
              f"{p}.mlp.down_proj.weight": torch.zeros(256, 512)}
    t |= {"model.embed_tokens.weight": torch.zeros(vocab, 256), **({} if tied else {"lm_head.weight": torch.zeros(vocab, 256)})}
    if mtp:
        t["mtp.layers.0.mlp.down_proj.weight"] = torch.zeros(256, 512)
    save_file({k: v.to(torch.bfloat16) for k, v in t.items()}, str(tmp_path / "model.safetensors"))
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": vocab, **({"mtp_num_hidden_layers": 1} if mtp else {})}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path, config


REF = {"MODEL": "weights/m", "SOURCE": "local:/x", "BASE": "m", "SERVE_MAX_MODEL_LEN": "4096", "SERVE_MAX_NUM_SEQS": "8",
       "ENV_VLLM_CPU_KVCACHE_SPACE": "4"}


def plan_for(cc: int, folder, config, device) -> tuple[dict, dict[str, str]]:
    device(cc)
    out, left = gpu.templates("m", REF, folder, config, cc, [1, 8])
    return out, {x["lever"]: x["why"] for x in left}


def test_shapes_come_from_the_checkpoint(tmp_path):
    folder, _ = checkpoint(tmp_path, 192, mtp=True)
    assert gpu.linear_shapes(folder) == {"self_attn.q_proj": (256, 256), "self_attn.k_proj": (192, 256),
                                         "self_attn.v_proj": (192, 256), "self_attn.o_proj": (256, 256),
                                         "mlp.gate_proj": (512, 256), "mlp.up_proj": (512, 256),
                                         "mlp.down_proj": (256, 512)}  # no lm_head, embedding or MTP layer


@pytest.mark.parametrize("cc", [80, 86])
def test_ampere(tmp_path, device, cc):
    out, left = plan_for(cc, *checkpoint(tmp_path, 256), device)
    assert {"graphs", "fp8kv", "ngram4", "w4a16", "w4a16-marlin", "fp8", "int8"} <= set(out)
    assert not {"fp8-static", "w4a8", "w4a16-machete", "mtp3"} & set(out)
    assert "CompressedTensorsW8A16Fp8" in out["fp8"][0] and out["fp8"][2]["CALIBRATE_RECIPE"] == "fp8-w8a8"
    assert left["W4A16 on the machete kernel"] == f"MacheteLinearKernel requires capability 90, this GPU's is {cc}"
    assert left["W4A8 (4-bit weights, FP8 activations)"].startswith("vLLM's CompressedTensorsW4A8Fp8 needs capability 90")
    assert "declares no MTP layer" in left["the model's own MTP head"]
    g = out["graphs"][2]
    assert g["SERVE_MAX_NUM_SEQS"] == "8" and json.loads(g["SERVE_COMPILATION_CONFIG"]) == {"cudagraph_capture_sizes": [1, 8]}
    assert "ENV_VLLM_CPU_KVCACHE_SPACE" not in g and g["GATE_GREEDY_IDENTITY"] == "1"
    assert out["fp8kv"][2]["SERVE_KV_CACHE_DTYPE"] == "fp8" and out["fp8kv"][2]["GATE_MAX_MEAN_KLD"] == "0.05"
    marlin = out["w4a16-marlin"]
    assert marlin[2]["SERVE_LINEAR_BACKEND"] == "marlin" and marlin[3] == ["w4a16"]
    assert marlin[2]["GATE_QUALITY_OF"] == "m-w4a16" and "CALIBRATE_RECIPE" not in marlin[2]
    stream = out["w4a16-stream"]  # the lab's kernel class: no --linear-backend (vLLM's would keep only its own)
    assert stream[2]["ENV_LAB_W4A16_KERNEL"] == "stream" and "SERVE_LINEAR_BACKEND" not in stream[2]
    assert stream[2]["PARENT"] == "m-w4a16" and stream[3] == ["w4a16"] and "CALIBRATE_RECIPE" not in stream[2]


def test_ada(tmp_path, device):
    out, left = plan_for(89, *checkpoint(tmp_path, 256), device)
    assert {"fp8-static", "w4a16-marlin", "w4a16-stream"} <= set(out)
    assert not {"fp8", "int8", "w4a8", "w4a16-machete"} & set(out)
    assert out["fp8-static"][2]["CALIBRATE_RECIPE"] == "fp8-w8a8-static"
    assert "capability 89, this GPU's is 89" in left["W8A8 INT8"]


def test_hopper(tmp_path, device):
    out, left = plan_for(90, *checkpoint(tmp_path, 256, mtp=True), device)
    assert {"fp8-static", "w4a8", "w4a16", "w4a16-marlin", "w4a16-machete", "w4a16-stream", "mtp3"} <= set(out)
    assert json.loads(out["mtp3"][2]["SERVE_SPECULATIVE_CONFIG"]) == {"method": "mtp", "num_speculative_tokens": 3}


def test_hopper_refuses_what_the_shape_cannot_take(tmp_path, device):
    # k_proj with N = 192: vLLM's Machete and CUTLASS W4A8 kernels refuse N not divisible by 128, Marlin takes it
    out, left = plan_for(90, *checkpoint(tmp_path, 192), device)
    assert "w4a16-marlin" in out and "w4a16-machete" not in out and "w4a8" not in out
    assert left["W4A16 on the machete kernel"] == ("MacheteLinearKernel cannot implement self_attn.k_proj (N=192, "
                                                   "K=256): Output features size must be divisible by 128")
    assert "cutlass: CutlassW4A8LinearKernel cannot implement self_attn.k_proj (N=192, K=256):" in \
        left["W4A8 (4-bit weights, FP8 activations)"]


def test_only_the_layers_a_recipe_quantizes_are_checked(tmp_path, device):
    """rtn-w4a8-fp8 leaves Qwen3.5's in_proj_a / in_proj_b (N = 64 / 96) in BF16 and gptq-w4a16 every Gated-DeltaNet
    projection: a layer no kernel could take does not keep the lever out when the recipe does not quantize it."""
    shapes = {"linear_attn.in_proj_qkvz": (12288, 2560), "linear_attn.in_proj_a": (96, 2560),
              "self_attn.qkv_proj": (10240, 2560), "mlp.down_proj": (2560, 9216)}
    assert set(gpu.targeted(shapes, "gptq-w4a16")) == {"self_attn.qkv_proj", "mlp.down_proj"}
    assert set(gpu.targeted(shapes, "rtn-w4a8-fp8")) == {"linear_attn.in_proj_qkvz", "self_attn.qkv_proj",
                                                         "mlp.down_proj"}
    device(90)
    assert gpu.kernel_verdicts(gpu.targeted(shapes, "gptq-w4a16"), 90)["machete"] is None
    assert gpu.kernel_verdicts(shapes, 90)["machete"].endswith("Output features size must be divisible by 128")


def test_no_cuda_device_is_one_line(monkeypatch):
    from vllm.platforms import current_platform as cp

    monkeypatch.setattr(cp, "is_cuda", lambda: False, raising=False)
    assert gpu.capability() is None
    assert gpu.main(["smollm2-bf16"]) == 2


def test_w4a8_is_left_out_where_its_recipe_would_refuse_the_build():
    # SmolLM2's widths (576, 1536): the recipe's kernel (CUTLASS W4A8) needs multiples of 128; a plan that proposed it
    # on another kernel's word got a failed build (H200, 2026-11-28)
    smollm2 = {"self_attn.q_proj": (576, 576), "self_attn.k_proj": (192, 576), "mlp.gate_proj": (1536, 576),
               "mlp.down_proj": (576, 1536)}
    why = gpu.w4a8_recipe_refusals(smollm2)
    assert why.startswith("recipe rtn-w4a8-fp8 is served on CutlassW4A8LinearKernel, which takes 4 of its layers not:")
    assert "input width 576 does not divide by 128" in why
    assert gpu.w4a8_recipe_refusals({"self_attn.q_proj": (256, 256), "mlp.down_proj": (256, 512)}) is None


def test_a_shape_proxy_gets_config_only_forms_and_no_speculation(tmp_path, device):
    """A shape proxy (random weights: a speed ladder only): its 4-bit and FP8 forms are written config-only from the
    named shape (no calibration of random weights) and served with vLLM's random weights; speculation, whose speed is
    its acceptance, is left out with that reason."""
    device(90)
    folder, config = checkpoint(tmp_path, 256, mtp=True)
    ref = {**REF, "SOURCE": "shape-proxy:qwen35-4b", "SHAPE_PROXY": "1"}
    out, left = gpu.templates("p", ref, folder, config, 90, [1, 8])
    why = {x["lever"]: x["why"] for x in left}
    assert not {"ngram4", "mtp3"} & set(out)
    assert "acceptance" in why["n-gram speculation (K=4)"] and "acceptance" in why["the model's own MTP head"]
    w4 = out["w4a16"][2]
    assert w4["SOURCE"] == "config-only:qwen35-4b:gptq-w4a16" and w4["SERVE_LOAD_FORMAT"] == "dummy"
    assert "CALIBRATE_RECIPE" not in w4 and w4["SHAPE_PROXY"] == "1" and w4["MODEL"] == "weights/p-w4a16"
    marlin = out["w4a16-marlin"]
    assert marlin[3] == [] and marlin[2]["SOURCE"] == w4["SOURCE"] and marlin[2]["SERVE_LINEAR_BACKEND"] == "marlin"
    assert out["fp8-static"][2]["SOURCE"] == "config-only:qwen35-4b:fp8-w8a8-static"
    assert out["w4a8"][2]["SOURCE"] == "config-only:qwen35-4b:rtn-w4a8-fp8"
    assert gpu.proxy_shape({"SOURCE": "config-only:qwen35-27b", "SHAPE_PROXY": "1"}) == "qwen35-27b"
    assert gpu.proxy_shape({"SOURCE": "local:/x", "SHAPE_PROXY": "1"}) is None  # a proxy of unknown shape: calibrated
    assert gpu.proxy_shape({"SOURCE": "shape-proxy:qwen35-4b"}) is None


def test_gated_deltanet_projections_go_to_4_bits_where_the_model_has_them(tmp_path, device, monkeypatch):
    """A Qwen3.5-like checkpoint (Gated-DeltaNet layers): W4A16 takes the recipe that quantizes their projections too
    (gptq-w4a16-gdn, in_proj_a/b kept BF16), and its kernels are checked on those layers; a model without them keeps
    gptq-w4a16."""
    device(90)
    folder, config = checkpoint(tmp_path, 256)
    qwen = {"linear_attn.in_proj_qkvz": (12288, 2560), "linear_attn.in_proj_a": (32, 2560),
            "linear_attn.out_proj": (2560, 4096), "self_attn.qkv_proj": (6144, 2560), "mlp.down_proj": (2560, 9216)}
    own = gpu.linear_shapes
    monkeypatch.setattr(gpu, "linear_shapes", lambda _: qwen)
    out, _ = gpu.templates("q", REF, folder, config, 90, [1, 8])
    assert out["w4a16"][2]["CALIBRATE_RECIPE"] == "gptq-w4a16-gdn" and "Gated-DeltaNet" in out["w4a16"][0]
    assert "w4a16-machete" in out  # in_proj_a (N=32) is not quantized, so Machete's N % 128 does not keep it out
    monkeypatch.setattr(gpu, "linear_shapes", own)  # the checkpoint's own layers: attention and MLP only
    out, _ = gpu.templates("m", REF, folder, config, 90, [1, 8])
    assert out["w4a16"][2]["CALIBRATE_RECIPE"] == "gptq-w4a16" and "Gated-DeltaNet" not in out["w4a16"][0]


@pytest.mark.parametrize("tied", [False, True])
def test_the_output_layer_in_4_bits_on_the_labs_kernel(tmp_path, device, tied):
    """w4a16-stream-head: the recipe's -head form (its own checkpoint, the output layer untied where tied) on the lab's
    kernel class, calibrated from BF16 and judged against it; proposed only where the class (Marlin for batches)
    takes the output layer's shape, read from lm_head or, tied, from the embedding."""
    device(90)
    out, left = plan_for(90, *checkpoint(tmp_path, 256, vocab=1024, tied=tied), device)
    lever, engine, cfg, needs = out["w4a16-stream-head"]
    assert "(1024 x 256)" in lever and engine == "vllm" and needs == []
    assert cfg["CALIBRATE_RECIPE"] == "gptq-w4a16-head" and cfg["MODEL"] == "weights/m-w4a16-head"
    # calibrated from the BF16 weights: make calibrate reads its source from PARENT's MODEL (the stream rung's is 4-bit)
    assert cfg["PARENT"] == "m-bf16" and cfg["GATE_REFERENCE"] == "m-bf16" and cfg["ENV_LAB_W4A16_KERNEL"] == "stream"
    assert out["w4a16-stream"][2]["MODEL"] == "weights/m-w4a16" and "CALIBRATE_RECIPE" not in out["w4a16-stream"][2]
    assert "SERVE_LINEAR_BACKEND" not in cfg and cfg["GATE_MAX_MEAN_KLD"] == "0.05"
    assert gpu.HEAD_4BIT not in left


def test_the_output_layer_stays_bf16_where_the_labs_kernel_refuses_it(tmp_path, device, monkeypatch):
    """An output layer whose K the calibrate lever gives a group below 128 (K = 320), or a GPU the lab's class does not
    take: the lever is left out with the reason. A shape proxy's head rung is written config-only."""
    folder, config = checkpoint(tmp_path, 256, vocab=1024)
    out, left = plan_for(75, folder, config, device)
    assert "w4a16-stream-head" not in out and "lab's stream kernel" in left[gpu.HEAD_4BIT]
    monkeypatch.setattr(gpu, "output_layer_shape", lambda _: (1024, 320))
    out, left = plan_for(90, folder, config, device)
    assert "w4a16-stream-head" not in out and "w4a16-stream" in out
    assert left[gpu.HEAD_4BIT] == ("LabStreamLinearKernel cannot implement lm_head (N=1024, K=320): group size 64: the "
                                   "stream form reads groups of 128")
    monkeypatch.undo()
    device(90)
    out, _ = gpu.templates("p", {**REF, "SOURCE": "config-only:qwen35-4b", "SHAPE_PROXY": "1"}, folder, config, 90, [1])
    cfg = out["w4a16-stream-head"][2]
    assert cfg["SOURCE"] == "config-only:qwen35-4b:gptq-w4a16-head" and cfg["SERVE_LOAD_FORMAT"] == "dummy"
    assert "CALIBRATE_RECIPE" not in cfg and cfg["PARENT"] == "p-w4a16-stream"  # nothing calibrated: one lever on it


def test_the_labs_kernel_is_judged_by_its_own_check(device):
    """LabStreamLinearKernel's minimum capability and its group: a layer whose K the calibrate lever gives a group
    below 128 keeps the lever out, with the class's reason."""
    device(75)
    assert gpu.lab_kernel_verdict({"mlp.down_proj": (256, 512)}, 75) == \
        "LabStreamLinearKernel requires capability 80, this GPU's is 75"
    device(90)
    assert gpu.lab_kernel_verdict({"mlp.down_proj": (256, 512)}, 90) is None
    assert gpu.lab_kernel_verdict({"mlp.down_proj": (256, 320)}, 90) == (
        "LabStreamLinearKernel cannot implement mlp.down_proj (N=256, K=320): group size 64: the stream form reads "
        "groups of 128")
