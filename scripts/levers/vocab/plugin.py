"""vLLM model plugin: serve a checkpoint whose output layer keeps only some vocabulary rows (scripts.levers.vocab.prune).

Registered through the `vllm.general_plugins` entry point of this project (pyproject.toml; `make install` installs the
project into .venv so vLLM finds it in every process). A pruned checkpoint's config.json names the architecture
`PrunedVocab<Base>` (e.g. PrunedVocabGemma3ForCausalLM) and carries

    "vocab_pruning": {"base_architecture": "Gemma3ForCausalLM", "kept": 32768, "id_map": "vocab_map.json", ...}

The model is the base architecture with one change: its lm_head has `kept` rows (the input embedding stays whole, so
every input id embeds exactly as before), and compute_logits scatters the kept logits back to their original ids in a
full-vocabulary row filled with -inf. Sampling, stop tokens, detokenization and the OpenAI API therefore see the
original vocabulary and tokenizer; a dropped token simply has probability 0. Nothing in vLLM is patched.

Where the output layer lives depends on the base: on the model itself (LlamaForCausalLM, Gemma3ForCausalLM), or on
its `language_model` in vLLM's multimodal wrapper (Qwen3_5ForConditionalGeneration, vLLM 0.26: the checkpoint's
`lm_head.weight` loads into `language_model.lm_head` through the model's hf_to_vllm_mapper, and the wrapper's
compute_logits calls the language model's). HEAD_OWNER names that submodule; the pruned head replaces it there.
"""

from __future__ import annotations

from scripts.levers.vocab.keep import PLUGIN_BASES as SUPPORTED
from scripts.levers.vocab.keep import PLUGIN_PREFIX as PREFIX
from scripts.levers.vocab.keep import kept_ids

# the submodule that holds lm_head and logits_processor, per base ("" = the model itself)
HEAD_OWNER = {"Qwen3_5ForConditionalGeneration": "language_model"}


def register() -> None:
    """The entry point: lazy registrations only (the module below is imported when a pruned checkpoint is served).

    vLLM also keys per-architecture config hooks by name (MODELS_CONFIG_MAP: Qwen3.5's sets the SSM cache dtype from
    the checkpoint's config); a pruned architecture gets its base's hook, so it is configured exactly as its parent."""
    from vllm import ModelRegistry
    from vllm.model_executor.models import config as model_configs

    hooks = getattr(model_configs, "MODELS_CONFIG_MAP", {})
    for base in SUPPORTED:
        if PREFIX + base not in ModelRegistry.get_supported_archs():
            ModelRegistry.register_model(PREFIX + base, f"scripts.levers.vocab.plugin:{PREFIX}{base}")
        if base in hooks:
            hooks.setdefault(PREFIX + base, hooks[base])


def _wrap(base_name: str):
    import torch
    from vllm.model_executor.layers.logits_processor import LogitsProcessor
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
    from vllm.model_executor.models.registry import ModelRegistry

    base = ModelRegistry._try_load_model_cls(base_name)
    if base is None:
        raise ImportError(f"vLLM has no model class {base_name}")

    owner_name = HEAD_OWNER.get(base_name, "")

    class Pruned(base):
        def __init__(self, *, vllm_config, prefix: str = ""):
            super().__init__(vllm_config=vllm_config, prefix=prefix)
            text = vllm_config.model_config.hf_text_config  # the config itself unless it nests a text_config
            kept = kept_ids(vllm_config.model_config.model)
            owner = self.get_submodule(owner_name)
            owner.lm_head = ParallelLMHead(len(kept), text.hidden_size,
                                           prefix=".".join(p for p in (prefix, owner_name, "lm_head") if p))
            old = owner.logits_processor
            owner.logits_processor = LogitsProcessor(len(kept), scale=old.scale, soft_cap=old.soft_cap)
            self.register_buffer("kept_ids", torch.tensor(kept, dtype=torch.long), persistent=False)
            self.full_vocab = text.vocab_size

        def compute_logits(self, hidden_states):
            owner = self.get_submodule(owner_name)  # (the model itself for owner_name "")
            kept = owner.logits_processor(owner.lm_head, hidden_states)
            if kept is None:  # a tensor-parallel rank other than 0
                return None
            full = kept.new_full((kept.shape[0], self.full_vocab), float("-inf"))
            return full.index_copy_(1, self.kept_ids, kept)

    Pruned.__name__ = Pruned.__qualname__ = PREFIX + base_name
    return Pruned


def __getattr__(name: str):
    if name.startswith(PREFIX) and name[len(PREFIX):] in SUPPORTED:
        cls = _wrap(name[len(PREFIX):])
        globals()[name] = cls
        return cls
    raise AttributeError(name)
