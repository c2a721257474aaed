"""verify_checkpoint on a tiny real checkpoint and corrupted copies of it (no vLLM)."""

from __future__ import annotations

import json
import shutil

import pytest

from scripts.common.checkpoint import CheckpointError, read_checkpoint
from scripts.weights import verify as verify_checkpoint


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A 2-layer random Llama with a byte-level BPE tokenizer, written by transformers itself."""
    import torch
    from tokenizers import ByteLevelBPETokenizer
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    out = tmp_path_factory.mktemp("tiny")
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["hello world " * 20, "the quick brown fox"], vocab_size=300, special_tokens=["<eos>"])
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<eos>")
    tok.save_pretrained(out)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), tie_word_embeddings=True)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def copy(src, tmp_path):
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    return dst


def run(capsys, *argv):
    code = verify_checkpoint.main([str(a) for a in argv])
    out = capsys.readouterr()
    return code, out.out, out.err


def test_good_checkpoint_passes_and_reports_size(tiny_checkpoint, capsys):
    code, out, err = run(capsys, tiny_checkpoint)
    assert code == 0, err
    assert "ok:" in out and "on disk" in out and "tokenizer round-trips" in out


def test_missing_dir(tmp_path, capsys):
    code, _, err = run(capsys, tmp_path / "nope")
    assert code == 1 and err.strip().count("\n") == 0 and "no such checkpoint directory" in err


def test_truncated_safetensors(tiny_checkpoint, tmp_path, capsys):
    ckpt = copy(tiny_checkpoint, tmp_path)
    f = ckpt / "model.safetensors"
    f.write_bytes(f.read_bytes()[:-100])
    code, _, err = run(capsys, ckpt)
    assert code == 1 and "truncated" in err


def test_garbage_header(tiny_checkpoint, tmp_path, capsys):
    ckpt = copy(tiny_checkpoint, tmp_path)
    (ckpt / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    code, _, err = run(capsys, ckpt)
    assert code == 1 and "corrupt safetensors header" in err


def test_config_weights_mismatch(tiny_checkpoint, tmp_path, capsys):
    ckpt = copy(tiny_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 256
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, ckpt)
    assert code == 1 and "do not match the config" in err and "mlp" in err


def test_missing_layer(tiny_checkpoint, tmp_path, capsys):
    ckpt = copy(tiny_checkpoint, tmp_path)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["num_hidden_layers"] = 3
    (ckpt / "config.json").write_text(json.dumps(cfg))
    code, _, err = run(capsys, ckpt)
    assert code == 1 and "missing, e.g. model.layers.2." in err


def test_bad_config_json_and_missing_config(tiny_checkpoint, tmp_path, capsys):
    ckpt = copy(tiny_checkpoint, tmp_path)
    (ckpt / "config.json").write_text("{not json")
    assert run(capsys, ckpt)[2].count("not valid JSON") == 1
    (ckpt / "config.json").unlink()
    assert "config.json is missing" in run(capsys, ckpt)[2]


def test_integer_tensors_without_quantization_config(tiny_checkpoint, tmp_path):
    import torch
    from safetensors.torch import save_file

    ckpt = copy(tiny_checkpoint, tmp_path)
    save_file({"x": torch.zeros(4, dtype=torch.int32)}, ckpt / "extra.safetensors")
    from scripts.common.checkpoint import check_dtypes

    with pytest.raises(CheckpointError, match="no quantization_config"):
        check_dtypes(read_checkpoint(ckpt))


def test_dropped_tensor_is_refused(tiny_checkpoint, tmp_path, capsys):
    import torch
    from safetensors.torch import load_file, save_file

    ckpt = copy(tiny_checkpoint, tmp_path)
    tensors = load_file(ckpt / "model.safetensors")
    tensors["model.extra_head.weight"] = torch.zeros(2, 2, dtype=torch.bfloat16)  # the source has one more
    src = copy(tiny_checkpoint, tmp_path / "src")
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    code, _, err = run(capsys, ckpt, "--source", src)
    assert code == 1 and "were dropped, e.g. model.extra_head.weight" in err


def test_broken_tokenizer_round_trip(tiny_checkpoint, tmp_path, capsys):
    ckpt = copy(tiny_checkpoint, tmp_path)
    tj = json.loads((ckpt / "tokenizer.json").read_text())
    tj["decoder"] = None  # byte-level tokens then decode to their mangled surface form
    (ckpt / "tokenizer.json").write_text(json.dumps(tj))
    code, _, err = run(capsys, ckpt)
    assert code == 1 and "does not round-trip" in err
