"""The lab's SGLang launcher (scripts/gpu/sglang_text_only.py): a keep list as SGLang's draft token map, and the
tied draft's head given its own rows. SGLang itself needs a GPU; what is tested here is the launcher's own logic on the
real Qwen3.5 tokenizer and keep list, and the head swap on a stand-in that ties its head to its embedding as SGLang's
Qwen3_5ForCausalLMMTP does (lm_head *is* model.embed_tokens)."""

from __future__ import annotations

import json

import pytest
import torch

from scripts.gpu import sglang_text_only as launcher
from scripts.weights.shape_proxy import write_config_only

KEEP = "results/vocab/qwen35-4b/keep-65536.json"


@pytest.fixture(scope="module")
def qwen_tiny(tmp_path_factory):
    """A config-only Qwen3.5 folder: the real tokenizer, a 248,320-row vocabulary, no weights."""
    out = tmp_path_factory.mktemp("m") / "qwen35-tiny"
    write_config_only("qwen35-tiny", out)
    return out


def test_a_keep_list_becomes_sglangs_token_map(qwen_tiny, tmp_path):
    ids = json.loads((launcher.Path(launcher.ROOT) / KEEP).read_text())["kept_ids"]
    argv = ["--model-path", str(qwen_tiny), launcher.TOKEN_MAP_FLAG, KEEP, "--port", "9"]
    out = launcher.token_map_argv(argv, tmp_path)
    assert out[:2] == argv[:2] and out[4:] == argv[4:] and out[3].endswith("keep-65536.pt")
    assert torch.tensor(torch.load(out[3], weights_only=True)).tolist() == ids  # as spec_utils.load_token_map reads it
    eq = launcher.token_map_argv(["--model-path", str(qwen_tiny), f"{launcher.TOKEN_MAP_FLAG}={KEEP}"], tmp_path)
    assert eq[2] == f"{launcher.TOKEN_MAP_FLAG}={tmp_path / 'keep-65536.pt'}"
    for kept in (["--port", "9"], [launcher.TOKEN_MAP_FLAG, "maps/hot.pt"]):  # no map, or SGLang's own file: as given
        assert launcher.token_map_argv(kept, tmp_path) == kept


def test_a_bad_keep_list_is_refused_in_one_line(qwen_tiny, tmp_path):
    good = json.loads((launcher.Path(launcher.ROOT) / KEEP).read_text())
    cases = {"missing.json": None, "notjson.json": "{", "noids.json": {"kept": 3},
             "past.json": {**good, "kept_ids": [0, 1, 248320]}, "twice.json": {**good, "kept_ids": [5, 5]},
             "othertok.json": {**good, "tokenizer_sha256": "0" * 64}}
    expect = {"missing.json": "no such keep list", "notjson.json": "not a keep list", "noids.json": "not a keep list",
              "past.json": r"not a list of distinct ids below the model's vocabulary \(248320\)",
              "twice.json": "not a list of distinct ids", "othertok.json": "made for another tokenizer"}
    for name, body in cases.items():
        path = tmp_path / name
        if body is not None:
            path.write_text(body if isinstance(body, str) else json.dumps(body))
        with pytest.raises(SystemExit, match=expect[name]) as e:
            launcher.token_map_argv(["--model-path", str(qwen_tiny), launcher.TOKEN_MAP_FLAG, str(path)], tmp_path)
        assert "\n" not in str(e.value)
    assert not list(tmp_path.glob("*.pt"))  # nothing written for a refused list


class TiedDraft(torch.nn.Module):
    """SGLang 0.5.17's Qwen3_5ForCausalLMMTP as far as its head goes: tied, lm_head is the embedding module, and
    set_embed_and_head assigns the embedding and then the head to it."""

    class Config:
        tie_word_embeddings = True

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.config = self.Config()
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(vocab, hidden)
        self.lm_head = self.model.embed_tokens

    def set_embed_and_head(self, embed, head):
        del self.model.embed_tokens.weight
        self.model.embed_tokens.weight = embed
        self.lm_head.weight = head


def test_a_tied_draft_keeps_its_whole_embedding_beside_the_kept_head_rows():
    embed = torch.randn(16, 4)
    hot = torch.tensor([0, 3, 7])
    plain = TiedDraft(16, 4)
    plain.set_embed_and_head(embed, embed[hot])  # SGLang's own method: the embedding shrinks with the head
    assert plain.model.embed_tokens.weight.shape[0] == 3

    class Patched(TiedDraft):
        pass

    launcher.separate_draft_head(Patched)
    launcher.separate_draft_head(Patched)  # twice (a re-imported launcher) wraps once
    draft = Patched(16, 4)
    draft.set_embed_and_head(embed, embed[hot])
    assert torch.equal(draft.model.embed_tokens.weight, embed)  # every id still embeds
    assert torch.equal(draft.lm_head.weight, embed[hot]) and draft.lm_head is not draft.model.embed_tokens
    whole = Patched(16, 4)
    whole.set_embed_and_head(embed, embed)  # no token map: SGLang's own path, still tied
    assert whole.lm_head is whole.model.embed_tokens and torch.equal(whole.lm_head.weight, embed)


def test_every_spawned_process_patches_the_draft_head_only_when_asked(tmp_path):
    """SGLang spawns its scheduler with multiprocessing's spawn, which runs the launcher again as __mp_main__ (as
    runpy does here): with DRAFT_HEAD_ENV set there, the MTP class is patched; without it, or run as the launcher
    itself, it is not. A stand-in sglang package holds the class (SGLang itself needs a GPU)."""
    import os
    import subprocess
    import sys

    models = tmp_path / "sglang" / "srt" / "models"
    models.mkdir(parents=True)
    for d in (tmp_path / "sglang", tmp_path / "sglang" / "srt", models):
        (d / "__init__.py").write_text("")
    (models / "qwen3_5_mtp.py").write_text(
        "class Qwen3_5ForCausalLMMTP:\n    def set_embed_and_head(self, embed, head):\n        pass\n")
    script = launcher.Path(launcher.__file__)
    probe = ("import runpy, sys; runpy.run_path(sys.argv[1], run_name=sys.argv[2]); "
             "from sglang.srt.models.qwen3_5_mtp import Qwen3_5ForCausalLMMTP as C; "
             "print(getattr(C.set_embed_and_head, 'separates_head', False))")
    for env_set, run_name, patched in ((True, "__mp_main__", "True"), (False, "__mp_main__", "False")):
        env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{launcher.ROOT}"}
        env.pop(launcher.DRAFT_HEAD_ENV, None)
        if env_set:
            env[launcher.DRAFT_HEAD_ENV] = "1"
        out = subprocess.run([sys.executable, "-c", probe, str(script), run_name], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.strip() == patched, (env_set, run_name, out.stdout, out.stderr[-500:])
