"""Register a local Hugging Face folder as a new base: its weights under weights/<name>/, its BF16 variant
experiments/<name>-bf16/config.env written from the model's own config.

    python -m scripts.weights.download /data/my-finetune --name myft      # `make download MODEL=/data/my-finetune NAME=myft`
    make verify VARIANT=myft-bf16                                         # then: make optimize BASE=myft

The folder must hold config.json, safetensors weights and a tokenizer; it is never modified: its files are hard-linked
into weights/<name>/ where the folder shares this file system (copied elsewhere), staged and renamed into place, and
their SHA-256s go to PROVENANCE.json (what the derived variants' inputs are keyed on). The variant's SOURCE is
`local:<absolute path>`, so `make weights` on a fresh clone of this repository registers the same folder again.
Registering a name already taken by another source is refused; the same folder again is a no-op.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import sha256_file
from scripts.common.variants import NAME_RE

LOCAL = "local:"
TEMPLATE_MAX_LEN = 8192  # the built-in bases' SERVE_MAX_MODEL_LEN: the latency prompt sets fit it
TEMPLATE_MAX_SEQS = 8  # the highest concurrency the ladders measure
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class RegisterError(ValueError):
    """A folder that cannot become a base, or a name that cannot name one; one line, ready to print."""


def looks_local(source: str) -> bool:
    """A MODEL= value meant as a local folder: a path (absolute, ./ or ~), or an existing directory."""
    return source.startswith(("/", "./", "../", "~", LOCAL)) or Path(source).is_dir()


def checked_folder(source: str) -> Path:
    """The folder as an absolute path, after the checks a base needs (one line naming what is missing)."""
    folder = Path(source.removeprefix(LOCAL)).expanduser().resolve()
    if not folder.exists():
        raise RegisterError(f"MODEL={source}: no such folder")
    if not folder.is_dir():
        raise RegisterError(f"MODEL={source}: not a folder (a Hugging Face checkpoint folder holds config.json, "
                            f"*.safetensors and the tokenizer)")
    if not (folder / "config.json").is_file():
        raise RegisterError(f"{folder}: no config.json: not a Hugging Face checkpoint folder")
    if not list(folder.glob("*.safetensors")):
        bins = list(folder.glob("*.bin"))
        raise RegisterError(f"{folder}: no *.safetensors weights" + (
            " (only PyTorch .bin files: save it again with save_pretrained(..., safe_serialization=True))" if bins else ""))
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise RegisterError(f"{folder}: no tokenizer ({' / '.join(TOKENIZER_FILES)}): save the tokenizer beside the weights")
    try:
        json.loads((folder / "config.json").read_text())
    except json.JSONDecodeError as e:
        raise RegisterError(f"{folder / 'config.json'}: not JSON ({e.msg}, line {e.lineno})") from None
    return folder


def checked_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise RegisterError(f"NAME={name!r}: a base name is lower-case letters, digits, '.' and '-' (it starts every "
                            f"variant name: {name}-bf16)")
    return name


def link_or_copy(src: Path, dest: Path) -> str:
    """Every file of src into dest (sub-folders too): hard links where the file system allows, else copies."""
    how = "hard-linked"
    for f in sorted(src.rglob("*")):
        if f.is_dir() or ".cache" in f.relative_to(src).parts:
            continue
        out = dest / f.relative_to(src)
        out.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, out)
        except OSError:
            shutil.copy2(f, out)
            how = "copied"
    return how


def provenance(folder: Path, how: str) -> dict:
    files = sorted(f for f in folder.rglob("*") if f.is_file() and ".cache" not in f.relative_to(folder).parts)
    return {"local_folder": str(folder), "registered": how,
            "files_sha256": {str(f.relative_to(folder)): sha256_file(f) for f in files}}


def kv_gib(config: dict, max_len: int, seqs: int) -> tuple[int, int]:
    """(GiB, bytes a token): the CPU KV-cache budget, whole GiB, that holds `seqs` sequences of `max_len` tokens."""
    text = config.get("text_config", config)
    layers = text.get("num_hidden_layers", 0)
    heads = text.get("num_attention_heads", 1)
    kv_heads = text.get("num_key_value_heads", heads)
    head_dim = text.get("head_dim") or text.get("hidden_size", 0) // max(heads, 1)
    per_token = 2 * layers * kv_heads * head_dim * 2  # K and V, BF16
    return max(1, math.ceil(per_token * max_len * seqs / 2**30)), per_token


def config_env(name: str, folder: Path, config: dict, has_chat_template: bool) -> str:
    """experiments/<name>-bf16/config.env of a registered base, each value with the arithmetic behind it."""
    text = config.get("text_config", config)
    ctx = int(text.get("max_position_embeddings") or TEMPLATE_MAX_LEN)
    max_len = min(ctx, TEMPLATE_MAX_LEN)
    gib, per_token = kv_gib(config, max_len, TEMPLATE_MAX_SEQS)
    arch = ", ".join(config.get("architectures") or ["(none named)"])
    lines = [
        f"# {name}: the checkpoint registered from {folder} (`make download MODEL={folder} NAME={name}`), served in",
        f"# BF16 by vLLM: the reference every variant of base {name} is measured and judged against. Architecture: {arch}.",
        f"MODEL=weights/{name}",
        f"SOURCE={LOCAL}{folder}",
        f"BASE={name}",
        f"# min(the model's max_position_embeddings {ctx}, {TEMPLATE_MAX_LEN}): the latency prompt sets fit {TEMPLATE_MAX_LEN}",
        f"SERVE_MAX_MODEL_LEN={max_len}",
        "# the highest concurrency the ladders measure (c=8)",
        f"SERVE_MAX_NUM_SEQS={TEMPLATE_MAX_SEQS}",
        f"# KV cache on CPU: {per_token} B a token (2 x layers x KV heads x head dim x 2 B) x {max_len} x "
        f"{TEMPLATE_MAX_SEQS} sequences, rounded up to whole GiB",
        f"ENV_VLLM_CPU_KVCACHE_SPACE={gib}",
    ]
    if has_chat_template:
        lines.append("EVAL_TASKS=lab_arith_mc,lab_arith_gen,lab_ifeval")
    else:
        lines += ["# no chat template in the tokenizer (a base model): the messages' contents after <bos>, so the chat",
                  "# endpoint and the chat prompt sets reach it",
                  "SERVE_CHAT_TEMPLATE=./eval/templates/base-plain.jinja",
                  "EVAL_TASKS=lab_arith_mc,lab_arith_gen"]
    return "\n".join(lines) + "\n"


def chat_template_of(folder: Path) -> bool:
    cfg = folder / "tokenizer_config.json"
    if (folder / "chat_template.jinja").is_file():
        return True
    return cfg.is_file() and bool(json.loads(cfg.read_text()).get("chat_template"))


def existing_source(name: str) -> str | None:
    env = paths.variant_dir(f"{name}-bf16") / "config.env"
    if not env.is_file():
        return None
    return next((line.split("=", 1)[1] for line in env.read_text().splitlines() if line.startswith("SOURCE=")), "")


def copy_into(source: str, tmp: Path) -> dict:
    """Stage the folder's files into tmp (materialize's step for SOURCE=local:<path>); returns the provenance."""
    folder = checked_folder(source)
    how = link_or_copy(folder, tmp)
    return provenance(folder, how)


def write_variant(name: str, folder: Path) -> Path:
    """experiments/<name>-bf16/config.env, written once (an existing one is the user's: kept)."""
    env = paths.variant_dir(f"{name}-bf16") / "config.env"
    if env.exists():
        return env
    config = json.loads((folder / "config.json").read_text())
    readme = env.with_name("README.md")
    if not readme.exists():
        paths.write_text_atomic(readme, f"# {name}-bf16 — the registered checkpoint, BF16 on vLLM\n\n**Source:** {folder} "
                          f"(`make download MODEL={folder} NAME={name}`), hard-linked or copied into weights/{name}/, "
                          f"never modified. The reference of base {name}: `make optimize BASE={name}` measures and "
                          f"judges every variant against it.\n")
    return paths.write_text_atomic(env, config_env(name, folder, config, chat_template_of(folder)))


def register(source: str, name: str | None, materialize) -> Path:
    """Check the folder and the name, write the weights (materialize: scripts.weights.download's) and the variant."""
    folder = checked_folder(source)
    name = checked_name(name or folder.name.lower().replace("_", "-"))
    taken = existing_source(name)
    if taken is not None and taken != f"{LOCAL}{folder}":
        raise RegisterError(f"base {name} is taken (experiments/{name}-bf16/config.env: SOURCE={taken}): choose another NAME")
    dest = materialize(f"{LOCAL}{folder}", name)
    env = write_variant(name, folder)
    print(f"registered {folder} as base {name}: {paths.shown(dest)}, {paths.shown(env)}\n"
          f"next: `make verify VARIANT={name}-bf16`, `make optimize BASE={name}`")
    return env
