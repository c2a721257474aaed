"""Vocabulary pruning, shared by its analysis (scripts.levers.vocab.analyze), its lever (scripts.levers.vocab.prune) and its
quality metrics: which ids are never dropped, keep lists and their checks."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import tokenizer_fingerprint

SAMPLE_CHAT = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "Hi"},
               {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
UNUSED = re.compile(r"^<unused\d+>$")
ID_MAP = "vocab_map.json"
# A pruned checkpoint's architecture is PLUGIN_PREFIX + its base architecture (scripts.levers.vocab.plugin serves it);
# the bases whose lm_head / logits_processor the plugin is known to drive.
PLUGIN_PREFIX = "PrunedVocab"
PLUGIN_BASES = ("LlamaForCausalLM", "Gemma3ForCausalLM", "Qwen3_5ForConditionalGeneration")


class VocabError(RuntimeError):
    """A bad keep list, id map or pruning request; the message is one line."""


def vocab_dir(base: str) -> Path:
    return paths.RESULTS / "vocab" / base


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte's printable stand-in in byte-level BPE vocabularies."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


def always_kept(tok) -> dict[str, list[int]]:
    """The ids no N may drop, by reason."""
    vocab = tok.get_vocab()
    special = set(tok.all_special_ids)
    special |= {i for i, t in tok.added_tokens_decoder.items() if t.special and not UNUSED.match(t.content)}
    chat: set[int] = set()
    if getattr(tok, "chat_template", None):
        chat = set(tok.apply_chat_template(SAMPLE_CHAT, tokenize=True, add_generation_prompt=True, return_dict=False))
    if "<0x00>" in vocab:  # SentencePiece byte fallback
        single = {vocab[f"<0x{b:02X}>"] for b in range(256)}
    else:  # byte-level BPE
        single = {vocab[c] for c in bytes_to_unicode().values() if c in vocab}
    if not single:  # (a byte-level vocabulary may lack bytes that never occur in UTF-8: SmolLM2 has 235 of 256)
        raise VocabError("found no single-byte tokens: unknown tokenizer layout")
    return {"special": sorted(special), "chat_template": sorted(chat - special), "single_byte": sorted(single - special - chat)}


def pruned_and_parent(name: str):
    """(the pruned variant, its PRUNE_KEEP, its parent variant, whose checkpoint is present), else VocabError."""
    from scripts.common.variants import load_variant

    v = load_variant(name)
    keep_n = int(v.resolved.get("PRUNE_KEEP") or 0)
    if not keep_n:
        raise VocabError(f"{name} is not a pruned variant (no PRUNE_KEEP in its config.env)")
    parent = load_variant(v.resolved["PARENT"])
    if not Path(parent.model, "config.json").exists():
        raise VocabError(f"{parent.model}: no checkpoint: run `make weights VARIANT={parent.name}`")
    return v, keep_n, parent


def keep_list_path(base: str, n: int) -> Path:
    return vocab_dir(base) / f"keep-{n}.json"


def load_keep_list(base: str, n: int, tok, vocab_size: int) -> dict:
    """keep-<n>.json of this BASE, checked against the tokenizer and vocabulary it will be applied to."""
    path = keep_list_path(base, n)
    if not path.exists():
        raise VocabError(f"{paths.shown(path)} does not exist: run `make analyze-vocab` (or python -m "
                         f"scripts.levers.vocab.analyze <{base} reference> --keep {n})")
    keep = json.loads(path.read_text())
    ids = keep["kept_ids"]
    if keep["tokenizer_sha256"] != tokenizer_fingerprint(tok):
        raise VocabError(f"{paths.shown(path)} was made for another tokenizer (fingerprint differs)")
    if n > vocab_size:
        raise VocabError(f"PRUNE_KEEP={n} is larger than the vocabulary ({vocab_size})")
    if len(ids) != n or len(set(ids)) != n or min(ids) < 0 or max(ids) >= vocab_size:
        raise VocabError(f"{paths.shown(path)}: {len(ids)} ids ({len(set(ids))} distinct, range "
                         f"{min(ids)}..{max(ids)}) is not {n} distinct ids below {vocab_size}")
    must = always_kept(tok)
    missing = {reason: [i for i in group if i not in set(ids)] for reason, group in must.items()}
    missing = {k: v for k, v in missing.items() if v}
    if missing:
        reason, group = next(iter(missing.items()))
        raise VocabError(f"{paths.shown(path)} lacks {sum(map(len, missing.values()))} always-kept tokens "
                         f"({reason}: {tok.convert_ids_to_tokens(group[:3])} …)")
    return {**keep, "path": paths.shown(path), "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}


def kept_ids(model_dir: str | Path) -> list[int] | None:
    """A vocabulary-pruned checkpoint's kept original ids, in lm_head row order (checked against its config.json's
    vocab_pruning block); None for a checkpoint that is not pruned."""
    model_dir = Path(model_dir)
    pruning = json.loads((model_dir / "config.json").read_text()).get("vocab_pruning")
    if pruning is None:
        return None
    data = json.loads((model_dir / pruning["id_map"]).read_text())
    kept = data["kept_ids"]
    if len(kept) != pruning["kept"] or len(set(kept)) != len(kept) or max(kept) >= data["vocab_size"]:
        raise VocabError(f"{model_dir}: {pruning['id_map']} does not match config.json's vocab_pruning "
                         f"({len(kept)} ids, {len(set(kept))} distinct, config says {pruning['kept']})")
    return kept
