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

Tail fallback (a `tail` entry in vocab_pruning; scripts.levers.vocab.tail): at load, the dropped rows of the whole
output matrix (the tied input embedding, which the model keeps anyway) become a 4-bit screen with a proven error
bound; per step, every dropped token that could beat the best kept logit gets its exact logit from its BF16 row, so
the greedy choice is the parent's at every position. A screen whose bound fails on exact products, or a checkpoint
whose tail entry is another method, fails the load. With LAB_VOCAB_TAIL_STATS=<path> in the server's environment
(relative: to the repository), the engine writes its counters (positions, positions with a row screened in, rows
recomputed, whole-matrix reads, positions whose argmax was a dropped id, seconds spent screening) there every
STATS_EVERY steps.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from scripts.common import paths
from scripts.levers.vocab.keep import PLUGIN_BASES as SUPPORTED
from scripts.levers.vocab.keep import PLUGIN_PREFIX as PREFIX
from scripts.levers.vocab.keep import VocabError, kept_ids

# Where a tail-fallback model writes its counters (positions scored, full rows read), every STATS_EVERY calls.
STATS_ENV = "LAB_VOCAB_TAIL_STATS"
STATS_EVERY = 32

# the submodule that holds lm_head and logits_processor, per base ("" = the model itself)
HEAD_OWNER = {"Qwen3_5ForConditionalGeneration": "language_model"}


def scatter_kept(kept_logits, kept_ids, full_vocab: int):
    """A pruned-only head's logits: each kept logit at its original id in a full-vocabulary row of -inf, so a dropped
    token has probability 0 and greedy decoding picks the best kept id."""
    full = kept_logits.new_full((kept_logits.shape[0], full_vocab), float("-inf"))
    return full.index_copy_(1, kept_ids, kept_logits)


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
            self.tail = tail_of(vllm_config.model_config.model)
            self.tail_counts = {"calls": 0}

        def load_weights(self, weights):
            loaded = super().load_weights(weights)
            if self.tail is not None:  # the whole output matrix the screen reads: the tied input embedding
                from scripts.levers.vocab import tail

                owner = self.get_submodule(owner_name)
                embed = getattr(getattr(owner, "model", None), "embed_tokens", None)
                if embed is None:
                    raise VocabError(f"{self.tail['where']}: the model has no input embedding to read full rows from")
                proc = owner.logits_processor
                if proc.soft_cap is not None or proc.scale != 1.0:
                    raise VocabError(f"{self.tail['where']}: the tail screen compares raw logits; this head is "
                                     f"soft-capped or scaled")
                self._rows_of = (embed,)  # a tuple: not registered as a parameter of this model (it is the embedding's)
                self.tail["screen"] = tail.build(embed.weight[:self.full_vocab].detach(), self.kept_ids)
            return loaded

        def _fallback(self, hidden_states, kept):
            """Dropped tokens screened on every position; the ones that could win get their exact logits."""
            from scripts.levers.vocab import tail

            t0 = time.perf_counter()
            full, step = tail.fill(hidden_states, kept, self.kept_ids, self.tail["screen"], self._rows_of[0].weight,
                                   self.full_vocab)
            c = self.tail_counts
            c["calls"] += 1
            c["seconds"] = c.get("seconds", 0.0) + time.perf_counter() - t0  # the screen's own cost on this engine
            for k, v in step.items():
                c[k] = c.get(k, 0) + v
            if c["calls"] % STATS_EVERY == 1 and os.environ.get(STATS_ENV):
                out = paths.ROOT / os.environ[STATS_ENV]  # (an absolute path stays itself)
                out.parent.mkdir(parents=True, exist_ok=True)
                tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
                sc = self.tail["screen"]
                online = {m: {k: round(sorted(t)[len(t) // 2] * 1e6, 1) for k, t in ts.items() if t}
                          for m, ts in sc.get("online", {}).items()}  # median µs a served step, per step size
                tmp.write_text(json.dumps({**c, "method": tail.METHOD, "kernel": sc["kernel"],
                                           "kernels_timed_us": sc.get("timed"), "online_us": online}) + "\n")
                tmp.replace(out)
            return full

        def compute_logits(self, hidden_states):
            owner = self.get_submodule(owner_name)  # (the model itself for owner_name "")
            kept = owner.logits_processor(owner.lm_head, hidden_states)
            if kept is None:  # a tensor-parallel rank other than 0
                return None
            if self.tail is not None:
                return self._fallback(hidden_states, kept)
            return scatter_kept(kept, self.kept_ids, self.full_vocab)

    Pruned.__name__ = Pruned.__qualname__ = PREFIX + base_name
    return Pruned


def tail_of(model_dir: str) -> dict | None:
    """{"where": config.json} when the checkpoint's vocab_pruning asks for the tail fallback, else None; a tail entry
    of another method fails the load (never a silent pruned-only model)."""
    config = Path(model_dir) / "config.json"
    pruning = json.loads(config.read_text()).get("vocab_pruning") or {}
    if not pruning.get("tail"):
        return None
    from scripts.levers.vocab import tail

    tail.check_config(pruning["tail"], str(config))
    return {"where": str(config)}


def __getattr__(name: str):
    if name.startswith(PREFIX) and name[len(PREFIX):] in SUPPORTED:
        cls = _wrap(name[len(PREFIX):])
        globals()[name] = cls
        return cls
    raise AttributeError(name)
