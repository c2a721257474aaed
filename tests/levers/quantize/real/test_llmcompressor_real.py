"""Real llm-compressor on a tiny real checkpoint (runs in .venv-quant: `make test` calls it there)."""

from __future__ import annotations

import hashlib
import json
import signal
import sys

import pytest

pytest.importorskip("llmcompressor")

from scripts.levers.quantize import calibrate as cal  # noqa: E402
from scripts.weights import verify as verify_checkpoint  # noqa: E402
from tests.conftest import assert_killed_cleanly, kill_midway  # noqa: E402


def tree_hash(path) -> str:
    h = hashlib.sha256()
    for f in sorted(path.rglob("*")):
        if f.is_file():
            h.update(f.name.encode() + f.read_bytes())
    return h.hexdigest()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer random Llama (hidden 64) with a byte-level BPE tokenizer and one tensor transformers will not
    load (an `mtp.` head, as Qwen3.5 checkpoints carry)."""
    import torch
    from safetensors.torch import load_file, save_file
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 20, "the quick brown fox"], vocab_size=300, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tok.chat_template = "{% for m in messages %}{{ m['content'] }}\n{% endfor %}"
    tok.save_pretrained(out)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    tensors = load_file(out / "model.safetensors")
    tensors["mtp.fc.weight"] = torch.randn(64, 128).to(torch.bfloat16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def test_int8_rtn_keeps_every_tensor_and_never_touches_the_source(tiny, tmp_path):
    before = tree_hash(tiny)
    out = tmp_path / "int8"
    assert cal.main(["int8-w8a8", "--model", str(tiny), "--out", str(out)]) == 0
    assert tree_hash(tiny) == before, "the source checkpoint was modified"
    report = verify_checkpoint.verify(out, source=tiny)
    assert report.quantization["quant_method"] == "compressed-tensors"
    assert "mtp.fc.weight" in report.tensors  # carried over unquantized
    prov = json.loads((out / "PROVENANCE.json").read_text())
    assert prov["recipe"] == "int8-w8a8" and prov["carried_over_unquantized"] == 1
    assert not list(tmp_path.glob(".*")), "temp output left behind"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_calibration_killed_midway_leaves_no_half_written_directory(tiny, tmp_path, sig):
    """llm-compressor stopped while it writes the checkpoint: no output directory, and a SIGKILL's staging
    directory is removed by the next run."""
    out = tmp_path / "int8"
    rc, log = kill_midway([sys.executable, "-m", "scripts.levers.quantize.calibrate", "int8-w8a8", "--model", str(tiny),
                           "--out", str(out)], out, sig)
    assert_killed_cleanly(rc, sig, out, None, log)


def test_awq_with_calibration_corpus_records_its_hash(tiny, tmp_path):
    out = tmp_path / "awq"
    assert cal.main(["awq-w4a16", "--model", str(tiny), "--out", str(out), "--samples", "4", "--seq-len", "32"]) == 0
    prov = json.loads((out / "PROVENANCE.json").read_text())
    assert prov["group_sizes"] == [64, 128] and len(prov["calibration"]["sha256"]) == 64
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert {g["weights"]["group_size"] for g in cfg["config_groups"].values()} == {64, 128}


@pytest.fixture(scope="module")
def tiny_qwen35(tiny, tmp_path_factory):
    """The toy-size Qwen3.5 of the shape proxy (Gated-DeltaNet + gated full attention, a vision tower), random
    weights (Qwen3.5's vocabulary size), with the tiny fixture's tokenizer."""
    import shutil

    import torch
    import transformers

    from scripts.weights.shape_proxy import build_config

    out = tmp_path_factory.mktemp("qwen35")
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, out / f.name)
    cfg = build_config("qwen35-tiny")
    torch.manual_seed(0)
    transformers.Qwen3_5ForConditionalGeneration(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def quantized_modules(out) -> dict[str, str]:
    """module name -> weight dtype of every tensor group the checkpoint stores compressed (weight_packed for int4,
    an F8 weight with a weight_scale for FP8)."""
    from scripts.common.checkpoint import read_checkpoint

    t = read_checkpoint(out).tensors
    mods = {n.rsplit(".", 1)[0] for n in t if n.endswith((".weight_packed", ".weight_scale"))}
    return {m: (t.get(f"{m}.weight_packed") or t.get(f"{m}.weight")).dtype for m in mods}


def families(mods) -> set[str]:
    import re

    return {re.sub(r".*layers\.\d+\.", "", m) for m in mods}


GDN = {f"linear_attn.{p}" for p in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj")}
ATTN = {f"self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")}
MLP = {f"mlp.{p}" for p in ("gate_proj", "up_proj", "down_proj")}


def test_w4a16_all_quantizes_mlp_attention_and_gdn_projections_of_qwen35(tiny_qwen35, tmp_path):
    out = tmp_path / "w4"
    assert cal.main(["rtn-w4a16", "--model", str(tiny_qwen35), "--out", str(out)]) == 0
    mods = quantized_modules(out)
    assert families(mods) == GDN | ATTN | MLP, families(mods)
    assert not [m for m in mods if "visual" in m or "lm_head" in m or "conv1d" in m or "mtp" in m]
    assert set(mods.values()) == {"I32"}  # int4 packed eight to an int32
    # the rtn-w4a16-mlp recipe, on the same model, still leaves every non-MLP layer in BF16
    mlp = tmp_path / "mlp"
    assert cal.main(["rtn-w4a16-mlp", "--model", str(tiny_qwen35), "--out", str(mlp)]) == 0
    assert families(quantized_modules(mlp)) == MLP


# the toy model's widths (64, 128) stand for the 4B's: its kernel demands scaled to them
TOY_KERNEL = ["--set", "kernel.in_multiple=32", "--set", "kernel.out_multiple=32", "--set", "kernel.group_size=32",
              "--set", "weights.group_size=32"]


def test_w4a8_fp8_keeps_in_proj_b_and_a_bf16(tiny_qwen35, tmp_path):
    out = tmp_path / "w4a8"
    assert cal.main(["rtn-w4a8-fp8", "--model", str(tiny_qwen35), "--out", str(out), *TOY_KERNEL]) == 0
    assert families(quantized_modules(out)) == (GDN - {"linear_attn.in_proj_b", "linear_attn.in_proj_a"}) | ATTN | MLP
    assert set(quantized_modules(out).values()) == {"I32"}  # packed, as vLLM's W4A8 scheme loads them
    assert json.loads((out / "config.json").read_text())["quantization_config"]["format"] == "pack-quantized"
    groups = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"]
    acts = {json.dumps(g["input_activations"], sort_keys=True) for g in groups.values()}
    assert all('"dynamic": true' in a and '"type": "float"' in a for a in acts)


def test_w4a8_without_its_ignore_fails_at_calibration_naming_the_layers_its_kernel_refuses(tiny_qwen35, tmp_path,
                                                                                          capsys):
    out = tmp_path / "w4a8"
    assert cal.main(["rtn-w4a8-fp8", "--model", str(tiny_qwen35), "--out", str(out), *TOY_KERNEL,
                     "--set", "ignore=[]"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]  # above it: transformers' loading progress bar
    assert err.startswith("error: recipe rtn-w4a8-fp8: ") and "cannot run on CutlassW4A8LinearKernel" in err
    assert "families linear_attn.in_proj_a, linear_attn.in_proj_b)" in err and "does not divide by 32" in err
    assert not out.exists()


def test_fp8_static_sets_one_activation_scale_per_layer_from_calibration_data(tiny_qwen35, tmp_path):
    from scripts.common.checkpoint import read_checkpoint

    out = tmp_path / "fp8s"
    assert cal.main(["fp8-w8a8-static", "--model", str(tiny_qwen35), "--out", str(out),
                     "--samples", "2", "--seq-len", "16"]) == 0
    t = read_checkpoint(out).tensors
    mods = quantized_modules(out)
    assert families(mods) == GDN | ATTN | MLP and set(mods.values()) == {"F8_E4M3"}
    assert all(t[f"{m}.input_scale"].shape in ((1,), ()) for m in mods)  # static per-tensor activation scale
    prov = json.loads((out / "PROVENANCE.json").read_text())
    assert len(prov["calibration"]["sha256"]) == 64  # the calibration corpus was used (rtn weights, static acts)


def test_w4_output_layer_unties_every_config_level_and_names_lm_head_for_vllm(tiny_qwen35, tmp_path):
    from scripts.common.checkpoint import read_checkpoint

    out = tmp_path / "lm"
    assert cal.main(["rtn-w4a16-lm", "--model", str(tiny_qwen35), "--out", str(out)]) == 0
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["tie_word_embeddings"] is False and cfg["text_config"]["tie_word_embeddings"] is False
    t = read_checkpoint(out).tensors
    assert "lm_head.weight_packed" in t and t["model.language_model.embed_tokens.weight"].dtype == "BF16"
    assert families(quantized_modules(out)) == GDN | ATTN | MLP | {"lm_head"}
