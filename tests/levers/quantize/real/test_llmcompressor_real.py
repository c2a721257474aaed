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
