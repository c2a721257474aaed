"""Every lever's make target run before its input exists: one line naming the file and the command that builds it,
exit 2, nothing written. The variants live in a temporary experiments/ whose weights are absent."""

from __future__ import annotations

import importlib

import pytest

from scripts.common import paths

ABSENT = "weights/.absent-"  # never written: weights/ holds no such folder
SPEC = '{{"method": "{method}", "model": "' + ABSENT + '{name}", "num_speculative_tokens": 2}}'
VARIANTS = {
    "x-bf16": f"MODEL={ABSENT}x-bf16\nSOURCE=embedded\nBASE=x\n",
    "x-int8": f"MODEL={ABSENT}x-int8\nSOURCE=lever\nPARENT=x-bf16\nBASE=x\nCALIBRATE_RECIPE=int8-w8a8\n",
    "x-eagle4": f"MODEL={ABSENT}x-bf16\nSOURCE=embedded\nPARENT=x-bf16\nBASE=x\n"
                f"SERVE_SPECULATIVE_CONFIG={SPEC.format(method='eagle3', name='head')}\n",
    "x-draft6": f"MODEL={ABSENT}x-bf16\nSOURCE=embedded\nPARENT=x-bf16\nBASE=x\nDRAFT_LAYERS=6\n"
                f"SERVE_SPECULATIVE_CONFIG={SPEC.format(method='draft_model', name='draft')}\n",
    "x-lora": f"MODEL={ABSENT}x-lora\nSOURCE=lever\nPARENT=x-bf16\nBASE=x\nLORA_ADAPTER={ABSENT}x-adapter\n",
    "x-v16k": f"MODEL={ABSENT}x-v16k\nSOURCE=lever\nPARENT=x-bf16\nBASE=x\nPRUNE_KEEP=16384\n",
    "x-v16k-int8": f"MODEL={ABSENT}x-v16k-int8\nSOURCE=lever\nPARENT=x-v16k\nBASE=x\nCALIBRATE_RECIPE=int8-w8a8\n",
    "x-gguf-q8-0": f"MODEL={ABSENT}x-gguf/model.gguf\nSOURCE=lever\nPARENT=x-bf16\nBASE=x\nENGINE=llamacpp\n"
                   f"TOKENIZER={ABSENT}x-bf16\nGGUF_TYPE=Q8_0\n",
}
# (make target, its script, argv, the command the error must name)
TARGETS = [
    ("calibrate", "scripts.levers.quantize.calibrate", ["--variant", "x-int8"], "make weights VARIANT=x-bf16"),
    ("calibrate", "scripts.levers.quantize.calibrate", ["--variant", "x-v16k-int8"], "make prune-vocab VARIANT=x-v16k"),
    ("redistill", "scripts.levers.speculate.redistill", ["x-eagle4", "--budget", "tiny"], "make weights VARIANT=x-bf16"),
    ("draft", "scripts.levers.speculate.draft", ["x-draft6"], "make weights VARIANT=x-bf16"),
    ("train-lora", "scripts.levers.lora.train", ["x-lora"], "make weights VARIANT=x-bf16"),
    ("merge-lora", "scripts.levers.lora.merge", ["x-lora"], "make weights VARIANT=x-bf16"),
    ("prune-vocab", "scripts.levers.vocab.prune", ["x-v16k"], "make weights VARIANT=x-bf16"),
    ("export-gguf", "scripts.levers.gguf.export", ["x-gguf-q8-0"], "make weights VARIANT=x-bf16"),
    ("analyze-vocab", "scripts.levers.vocab.analyze", ["x-bf16"], "make weights VARIANT=x-bf16"),
    ("bake-cache", "scripts.levers.cache.bake", ["x-bf16"], "make weights VARIANT=x-bf16"),
]


@pytest.fixture
def absent_experiments(tmp_path, monkeypatch):
    for name, text in VARIANTS.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.env").write_text(text)
    monkeypatch.setattr(paths, "EXPERIMENTS", tmp_path)
    assert not list(paths.WEIGHTS.glob(".absent-*"))
    yield tmp_path
    assert not list(paths.WEIGHTS.glob("*.absent-*")), "a failed build left something under weights/"


@pytest.mark.parametrize("target, module, argv, command", TARGETS, ids=[f"{t[0]}-{t[2][-1]}" for t in TARGETS])
def test_a_lever_target_before_its_input_is_one_line_and_exit_2(absent_experiments, capsys, target, module, argv,
                                                               command):
    rc = importlib.import_module(module).main(argv)
    err = capsys.readouterr().err.strip()
    assert rc == 2, f"make {target}: exit {rc}: {err}"
    assert err.startswith("error: ") and "\n" not in err, f"make {target}: {err}"
    assert ABSENT in err and f"`{command}`" in err, f"make {target} names neither the file nor `{command}`: {err}"
