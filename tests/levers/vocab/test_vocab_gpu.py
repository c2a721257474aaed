"""Vocabulary pruning of a multimodal base (Qwen3_5ForConditionalGeneration, served on the GPU by vLLM 0.26): where
prune_vocab_v2 takes the output rows from and where the serving plugin puts the pruned head."""

from __future__ import annotations

import pytest

from scripts.levers.vocab import keep as vocab
from scripts.levers.vocab.plugin import HEAD_OWNER
from scripts.levers.vocab.prune import output_rows_name

QWEN35 = "Qwen3_5ForConditionalGeneration"
# tensor names of the shape proxy (scripts.weights.shape_proxy): the text model nested under model.language_model
QWEN35_NAMES = {"model.language_model.embed_tokens.weight", "model.language_model.norm.weight",
                "model.visual.blocks.0.attn.qkv.weight", "mtp.fc.weight"}


def test_every_head_owner_is_a_plugin_base():
    assert set(HEAD_OWNER) <= set(vocab.PLUGIN_BASES)
    assert QWEN35 in vocab.PLUGIN_BASES


def test_output_rows_of_a_nested_text_model():
    assert output_rows_name(QWEN35_NAMES, tied=True) == "model.language_model.embed_tokens.weight"
    assert output_rows_name(QWEN35_NAMES | {"lm_head.weight"}, tied=True) == "model.language_model.embed_tokens.weight"
    assert output_rows_name(QWEN35_NAMES | {"lm_head.weight"}, tied=False) == "lm_head.weight"


def test_pruned_head_loads_where_the_plugin_puts_it():
    """The pruned checkpoint's top-level lm_head.weight must map onto <HEAD_OWNER>.lm_head in the installed vLLM."""
    qwen3_5 = pytest.importorskip("vllm.model_executor.models.qwen3_5")
    cls = getattr(qwen3_5, QWEN35)
    assert cls.hf_to_vllm_mapper._map_name("lm_head.weight") == f"{HEAD_OWNER[QWEN35]}.lm_head.weight"
