"""LoRA adapters: a variant's LORA_* settings, the training text, the adapter card, and the checks shared by
scripts.levers.lora.train (train), scripts.levers.lora.merge (merge into BF16) and the multi-adapter serving variants.

A variant with LORA_ADAPTER=weights/lora/<name> declares one adapter and how it is trained (LORA_RANK, LORA_ALPHA,
LORA_TARGETS, LORA_DATA, LORA_SPLIT, LORA_STEPS, LORA_LR, …); its MODEL is PARENT's BF16 weights with the adapter
merged (make merge-lora). A variant with SERVE_LORA_MODULES serves adapters by name on its base (vLLM multi-LoRA).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import read_safetensors_header, tokenizer_fingerprint
from scripts.data.corpus import EVAL_FRACTION, cpython_docs

CARD = "lora_card.json"  # what the adapter is: base, rank, targets, data, curve (next to PEFT's adapter files)
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
DEFAULTS = {
    "LORA_RANK": "16", "LORA_ALPHA": "32", "LORA_DROPOUT": "0.0",
    "LORA_TARGETS": "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj",
    "LORA_DATA": "cpython-docs", "LORA_SPLIT": "1/1", "LORA_STEPS": "60", "LORA_LR": "2e-4", "LORA_SEQ_LEN": "256",
    "LORA_BATCH": "4", "LORA_SEED": "0", "LORA_EVAL_EVERY": "10", "LORA_HELDOUT_FRACTION": "0.15",
    "LORA_HELDOUT_CHUNKS": "16", "LORA_MAX_RISE": "0.02",
}


class LoraError(ValueError):
    """A LoRA request that cannot be carried out; the message is one line."""


@dataclass(frozen=True)
class LoraSettings:
    adapter: Path
    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...]
    data: str
    split: tuple[int, int]
    steps: int
    lr: float
    seq_len: int
    batch: int
    seed: int
    eval_every: int
    heldout_fraction: float
    heldout_chunks: int
    max_rise: float


def settings(variant) -> LoraSettings:
    """The variant's LORA_* keys (defaults above); bad values are one LoraError."""
    raw = {**DEFAULTS, **{k: v for k, v in variant.resolved.items() if k.startswith("LORA_")}}
    where = f"{variant.path}/config.env"
    if not raw.get("LORA_ADAPTER", "").startswith("weights/"):
        raise LoraError(f"{where}: LORA_ADAPTER must name a folder under weights/ (e.g. weights/lora/{variant.name})")
    try:
        k, n = (int(x) for x in raw["LORA_SPLIT"].split("/"))
        s = LoraSettings(
            adapter=Path(paths.resolve_model(raw["LORA_ADAPTER"])), rank=int(raw["LORA_RANK"]),
            alpha=float(raw["LORA_ALPHA"]), dropout=float(raw["LORA_DROPOUT"]),
            targets=tuple(t.strip() for t in raw["LORA_TARGETS"].split(",") if t.strip()), data=raw["LORA_DATA"],
            split=(k, n), steps=int(raw["LORA_STEPS"]), lr=float(raw["LORA_LR"]), seq_len=int(raw["LORA_SEQ_LEN"]),
            batch=int(raw["LORA_BATCH"]), seed=int(raw["LORA_SEED"]), eval_every=int(raw["LORA_EVAL_EVERY"]),
            heldout_fraction=float(raw["LORA_HELDOUT_FRACTION"]), heldout_chunks=int(raw["LORA_HELDOUT_CHUNKS"]),
            max_rise=float(raw["LORA_MAX_RISE"]))
    except ValueError as e:
        raise LoraError(f"{where}: a LORA_* value is not a number or k/n split ({e})") from None
    if not 1 <= s.split[0] <= s.split[1]:
        raise LoraError(f"{where}: LORA_SPLIT={raw['LORA_SPLIT']}: k/n with 1 <= k <= n")
    if s.rank < 1 or s.steps < 1 or s.seq_len < 8 or s.batch < 1 or not s.targets:
        raise LoraError(f"{where}: LORA_RANK, LORA_STEPS, LORA_BATCH >= 1, LORA_SEQ_LEN >= 8 and LORA_TARGETS needed")
    return s


def check_targets(model, targets: tuple[str, ...], rank: int) -> None:
    """Every target names a linear layer of the model and the rank fits its smallest side."""
    import torch

    linears = {name.rsplit(".", 1)[-1]: mod for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)}
    missing = [t for t in targets if t not in linears]
    if missing:
        raise LoraError(f"LORA_TARGETS: the model has no linear layer named {', '.join(missing)} "
                        f"(it has: {', '.join(sorted(linears))})")
    limit = min(min(linears[t].in_features, linears[t].out_features) for t in targets)
    if rank > limit:
        raise LoraError(f"LORA_RANK={rank} exceeds the smallest side ({limit}) of the targeted layers")


def config_sha256(model_dir: Path) -> str:
    """Identity of a base checkpoint for an adapter: its config.json (architecture and every shape)."""
    cfg = Path(model_dir) / "config.json"
    if not cfg.exists():
        raise LoraError(f"{paths.shown(model_dir)} has no config.json")
    return hashlib.sha256(cfg.read_bytes()).hexdigest()


def quantized(model_dir: Path) -> bool:
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    return bool(cfg.get("quantization_config") or cfg.get("compression_config"))


def read_card(adapter: Path) -> dict:
    """The adapter's card; a folder without the adapter's files is one LoraError naming what is missing."""
    missing = [f for f in (*ADAPTER_FILES, CARD) if not (adapter / f).exists()]
    if missing:
        raise LoraError(f"{paths.shown(adapter)}: no {', '.join(missing)} (train it: make train-lora VARIANT=…)")
    return json.loads((adapter / CARD).read_text())


def check_base(card: dict, adapter: Path, base_dir: Path) -> None:
    """The adapter was trained on this base: the same config.json (shapes and architecture)."""
    if card.get("base_config_sha256") != config_sha256(base_dir):
        raise LoraError(f"{paths.shown(adapter)} was trained on {card.get('base_model')}, not on "
                        f"{paths.shown(base_dir)} (config.json differs): an adapter for another base")


def adapter_problem(adapter: Path, model_dir: Path, max_rank: int | None) -> tuple[int, str] | None:
    """Why a server of `model_dir` with --max-lora-rank `max_rank` must refuse this adapter, as (HTTP status, one
    line), or None: the folder or its files missing (404 / 400), a rank above the server's maximum (400), or weights
    whose shapes do not fit the base's layers — an adapter of another base (400). vLLM 0.32 answers these with 500
    or not at all (scripts/levers/lora/admission.py puts this check before its loader)."""
    adapter = Path(adapter)
    if not adapter.is_dir():
        return 404, f"no adapter folder at {adapter}"
    missing = [f for f in ADAPTER_FILES if not (adapter / f).exists()]
    if missing:
        return 400, f"{adapter}: no {', '.join(missing)} (a PEFT adapter folder holds {', '.join(ADAPTER_FILES)})"
    try:
        cfg = json.loads((adapter / "adapter_config.json").read_text())
        tensors = read_safetensors_header(adapter / "adapter_model.safetensors")
    except (OSError, ValueError) as e:
        return 400, f"{adapter}: unreadable adapter ({e})"
    rank = max([int(cfg.get("r", 0)), *(int(r) for r in (cfg.get("rank_pattern") or {}).values())])
    if max_rank is not None and rank > max_rank:
        return 400, f"{adapter}: LoRA rank {rank} is above this server's --max-lora-rank {max_rank}"
    base = {}
    for f in sorted(Path(model_dir).glob("*.safetensors")):
        base.update(read_safetensors_header(f))
    for name, info in tensors.items():
        module, _, kind = name.removeprefix("base_model.model.").rpartition(".lora_")
        target = base.get(f"{module}.weight")
        if target is None or len(target.shape) != 2 or kind not in ("A.weight", "B.weight"):
            continue  # a quantized or packed layer, or a tensor this check does not read
        out_dim, in_dim = target.shape
        side, want = (info.shape[1], in_dim) if kind == "A.weight" else (info.shape[0], out_dim)
        if side != want:
            return 400, (f"{adapter}: {name} has shape {list(info.shape)}, the base's {module} is {out_dim}x{in_dim}: "
                         "an adapter trained for another base")
    return None


def served_adapters(variant) -> dict[str, str]:
    """SERVE_LORA_MODULES (`name=weights/… name=…`) as adapter name -> the path as written."""
    out = {}
    for item in variant.resolved.get("SERVE_LORA_MODULES", "").split():
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise LoraError(f"{variant.path}/config.env: SERVE_LORA_MODULES item {item!r} is not name=path")
        out[name] = path
    return out


# ------------------------------------------------------------------------------------------------ training text
def training_tokens(data: str, split: tuple[int, int], tok) -> tuple[str, list[int]]:
    """(name, token ids) of the split. `cpython-docs`: the corpus after its first EVAL_FRACTION (parity's evaluated
    text is never trained on). Otherwise a JSONL file of {"text": …} rows, or of {"input_ids": […],
    "tokenizer_sha256": …} rows made by this model's tokenizer (ids of another tokenizer are refused). The pool is
    cut into n contiguous parts; part k is returned."""

    if data == "cpython-docs":
        corpus = cpython_docs()
        text = corpus.text[int(len(corpus.text) * EVAL_FRACTION):]
        name = f"{corpus.name} ({corpus.sha256[:12]}) after the first {EVAL_FRACTION:.0%}"
        ids = tok(text, add_special_tokens=False)["input_ids"]
    else:
        path = Path(paths.resolve_model(data) if data.startswith(("./", "weights/")) else data)
        if not path.exists():
            raise LoraError(f"LORA_DATA={data}: no such file (cpython-docs, or a JSONL file of {{\"text\": …}} rows)")
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        name = f"{paths.shown(path)} ({hashlib.sha256(path.read_bytes()).hexdigest()[:12]})"
        if rows and "input_ids" in rows[0]:
            mine = tokenizer_fingerprint(tok)
            other = {r.get("tokenizer_sha256") for r in rows} - {mine}
            if other:
                raise LoraError(f"LORA_DATA={data}: token ids made by another tokenizer (fingerprint "
                                f"{str(next(iter(other)))[:12]}, this model's {mine[:12]}): give the text instead")
            ids = [i for r in rows for i in r["input_ids"]]
        else:
            ids = tok("\n\n".join(r["text"] for r in rows), add_special_tokens=False)["input_ids"]
    k, n = split
    size = len(ids) // n
    return f"{name}, part {k}/{n}", ids[(k - 1) * size: k * size]


def general_text() -> str:
    """Text outside every adapter's training data: the start of cpython-docs (parity's evaluated region)."""
    corpus = cpython_docs()
    return corpus.text[: int(len(corpus.text) * EVAL_FRACTION)]
