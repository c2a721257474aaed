"""The GGUF export's route for architectures it does not write itself (scripts.levers.gguf.export): llama.cpp's own
converter, whose registered architectures are read from its source; what it does not register is refused in one
line before anything is written. The real conversion of Gemma 3 runs in `make export-gguf` (its record)."""

from __future__ import annotations

import json

import pytest

import scripts.levers.gguf.export as ex


@pytest.fixture
def converter(tmp_path, monkeypatch):
    """A converter folder whose conversion package registers two architectures."""
    conv = tmp_path / "llamacpp-convert"
    (conv / "conversion").mkdir(parents=True)
    (conv / "convert_hf_to_gguf.py").write_text("raise SystemExit('not run here')\n")
    (conv / "conversion" / "gemma.py").write_text(
        '@ModelBase.register("Gemma3ForCausalLM", "Gemma3ForConditionalGeneration")\nclass G: pass\n'
        "@ModelBase.register('Qwen3ForCausalLM')\nclass Q: pass\n")
    monkeypatch.setattr(ex, "CONVERTER", conv)
    return conv


def checkpoint(tmp_path, model_type: str, arch: str):
    d = tmp_path / arch
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": model_type, "architectures": [arch]}))
    return d


def test_registered_architectures_are_read_from_the_converters_source(converter):
    assert ex.converter_archs() == {"Gemma3ForCausalLM", "Gemma3ForConditionalGeneration", "Qwen3ForCausalLM"}


def test_a_registered_architecture_is_exportable_and_an_unknown_one_refused(converter, tmp_path):
    assert not ex.writes_itself(checkpoint(tmp_path, "gemma3_text", "Gemma3ForCausalLM"))
    ex.check_exportable(tmp_path / "Gemma3ForCausalLM")
    with pytest.raises(ex.ExportError, match="is MysteryForCausalLM: llama.cpp's converter .* registers none"):
        ex.check_exportable(checkpoint(tmp_path, "mystery", "MysteryForCausalLM"))


def test_a_missing_converter_names_the_target_that_fetches_it(converter, tmp_path):
    (converter / "convert_hf_to_gguf.py").unlink()
    with pytest.raises(ex.ExportError, match=r"convert_hf_to_gguf.py is missing: run `make .*convert_hf_to_gguf.py`"):
        ex.check_exportable(checkpoint(tmp_path, "gemma3_text", "Gemma3ForCausalLM"))


def test_a_converter_that_fails_leaves_nothing_and_says_why_in_one_line(converter, tmp_path):
    out = tmp_path / "out.gguf"
    with pytest.raises(ex.ExportError, match="llama.cpp's converter refused .*: not run here"):
        ex.convert(checkpoint(tmp_path, "gemma3_text", "Gemma3ForCausalLM"), out, "BF16")
    assert not out.exists()
