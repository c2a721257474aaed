"""GGUF export: a variant's PARENT checkpoint as one llama.cpp GGUF file, quantized by llama.cpp's own quantizer.

    python -m scripts.levers.gguf.export smollm2-gguf-q8-0        # `make export-gguf VARIANT=smollm2-gguf-q8-0`

The variant (ENGINE=llamacpp, SOURCE=lever) names its PARENT, a safetensors checkpoint, and GGUF_TYPE; GGUF_SOURCE
names another checkpoint directory of that base to export instead of the parent's (a draft model another lever built,
e.g. the layer-truncated SmolLM2 of `make draft`). A llama-architecture base that ships as a GGUF (SmolLM2) is written
here, with the tokenizer of its embedded GGUF; any other architecture llama.cpp converts (Gemma 3, ...) goes through
llama.cpp's own converter, convert_hf_to_gguf.py of the same release as llama-server (.cache/llamacpp-convert, from
its hash-checked sdist), with the parent's own tokenizer:

    embedded          the GGUF file the base ships as (SmolLM2: Q4_1, embedding Q8_0), copied byte for byte
    BF16 | F16 | F32  the parent's tensors as they are (norms F32), under llama.cpp's tensor names
    Q8_0, Q4_K_M, …   that BF16 file, then llama.cpp's quantizer (llama_model_quantize through .venv-llamacpp's
                      llama-cpp-python), which picks per-tensor types as `llama-quantize` does

Metadata (llama architecture): the tokenizer comes from the base's embedded GGUF, after checking that its token list
is the parent tokenizer's (same ids, so parity is scored on the same sequences); every architecture field is rewritten
from the parent's config.json. Q and K projections are permuted to llama.cpp's rotary layout (transformers' GGUF loader undoes
the same permutation). The file is written beside MODEL under a temporary name and renamed when whole; the parent is
only read; a record of the export (sizes, tensor types, seconds) lands in experiments/<variant>/.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path

from scripts.common import paths
from scripts.common.checkpoint import CheckpointError, embedded_gguf, read_checkpoint
from scripts.common.engines import LLAMACPP_VENV, EngineError, version
from scripts.common.hardware import hardware
from scripts.common.records import git_state, now_utc, versions, write_record
from scripts.common.variants import VariantError, load_variant, missing_model

PLAIN = {"F32": "F32", "F16": "F16", "BF16": "BF16"}
CONVERTER = paths.ROOT / ".cache" / "llamacpp-convert"  # the Makefile's GGUF_CONVERT
EMBEDDED = "embedded"
# config.json -> GGUF architecture fields of a llama-architecture model (llama.<field>)
ARCH_FIELDS = {
    "block_count": "num_hidden_layers", "context_length": "max_position_embeddings", "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size", "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads", "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "vocab_size": "vocab_size",
}


class ExportError(RuntimeError):
    pass


def permute_rotary(w, n_head: int):
    """transformers' (rotate-half) Q/K row order -> llama.cpp's interleaved pairs: within each head the rows
    [x0..x(d/2-1), y0..y(d/2-1)] become [x0, y0, x1, y1, …] (llama.cpp's convert permutes the same way)."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rotary(w, n_head: int):
    rows = w.shape[0]
    return w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_tensors(state: dict, cfg: dict) -> dict:
    """{llama.cpp name: array} from a llama checkpoint's {name: array} (tied output layer: no output.weight)."""
    import gguf

    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, cfg["num_hidden_layers"])
    out = {}
    for name, w in state.items():
        if name == "lm_head.weight" and cfg.get("tie_word_embeddings"):
            continue
        target = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if target is None:
            raise ExportError(f"{name}: no llama.cpp tensor name for it (llama architecture only)")
        if name.endswith("self_attn.q_proj.weight"):
            w = permute_rotary(w, cfg["num_attention_heads"])
        elif name.endswith("self_attn.k_proj.weight"):
            w = permute_rotary(w, cfg["num_key_value_heads"])
        out[target] = w
    return out


def check_tokenizer(reader, parent_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(parent_dir)
    mine = reader.fields["tokenizer.ggml.tokens"].contents()
    theirs = [t for t, _ in sorted(tok.get_vocab().items(), key=lambda kv: kv[1])]
    if mine != theirs[:len(mine)] or len(theirs) != len(mine):
        raise ExportError(f"the embedded GGUF's tokenizer ({len(mine)} tokens) is not {paths.shown(parent_dir)}'s "
                          f"({len(theirs)} tokens): its ids would not match")


def writes_itself(parent_dir: Path, embedded: Path | None = None) -> bool:
    """True where this module writes parent_dir itself: the llama architecture with the embedded GGUF's token list
    (SmolLM2); anything else goes to llama.cpp's converter."""
    import gguf

    if json.loads((parent_dir / "config.json").read_text()).get("model_type") != "llama":
        return False
    try:  # (no embedded GGUF at all is the CheckpointError of embedded_gguf(), for the caller)
        check_tokenizer(gguf.GGUFReader(embedded or embedded_gguf()), parent_dir)
    except ExportError:
        return False
    return True


def converter_archs() -> set[str]:
    """The Hugging Face architectures llama.cpp's converter registers (read from its source, not imported)."""
    import re

    names: set[str] = set()
    for f in sorted((CONVERTER / "conversion").glob("*.py")):
        for args in re.findall(r"ModelBase\.register\(([^)]*)\)", f.read_text()):
            names.update(re.findall(r"[\"']([A-Za-z0-9_]+)[\"']", args))
    return names


def check_exportable(parent_dir: Path, embedded: Path | None = None) -> None:
    """ExportError unless parent_dir can become a GGUF: written here (writes_itself), or an architecture that
    llama.cpp's converter registers."""
    if writes_itself(parent_dir, embedded):
        return
    script = CONVERTER / "convert_hf_to_gguf.py"
    if not script.is_file():
        raise ExportError(f"{paths.shown(script)} is missing: run `make {paths.shown(script)}` (make export-gguf "
                          f"fetches it)")
    archs = json.loads((parent_dir / "config.json").read_text()).get("architectures") or []
    if not set(archs) & converter_archs():
        raise ExportError(f"{paths.shown(parent_dir)} is {', '.join(archs) or 'no named architecture'}: llama.cpp's "
                          f"converter ({paths.shown(script)}) registers none of them")


def convert(parent_dir: Path, out: Path, dtype: str) -> None:
    """llama.cpp's convert_hf_to_gguf.py (the release llama-server is built from) on parent_dir: a plain GGUF."""
    check_exportable(parent_dir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(CONVERTER / "gguf-py"), str(CONVERTER)])}
    r = subprocess.run([sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), str(parent_dir), "--outtype",
                        dtype.lower(), "--outfile", str(out)], cwd=CONVERTER, env=env, capture_output=True, text=True,
                       check=False)
    if r.returncode != 0 or not out.is_file():
        lines = [x for x in (r.stderr or r.stdout).strip().splitlines() if x.strip()] or ["(no output)"]
        raise ExportError(f"llama.cpp's converter refused {paths.shown(parent_dir)}: {lines[-1].strip()[:300]}")


def write_plain(parent_dir: Path, embedded: Path, out: Path, dtype: str) -> dict[str, int]:
    """The parent's tensors as a GGUF of `dtype` (2-D weights; 1-D norms stay F32) with the embedded tokenizer."""
    import gguf
    import numpy as np
    import torch
    from safetensors.torch import load_file

    cfg = json.loads((parent_dir / "config.json").read_text())
    if not writes_itself(parent_dir, embedded):
        raise ExportError(f"{paths.shown(parent_dir)}: not a llama checkpoint with the embedded GGUF's tokenizer")
    reader = gguf.GGUFReader(embedded)
    state = {}
    for shard in sorted(parent_dir.glob("*.safetensors")):
        state.update(load_file(shard))
    writer = gguf.GGUFWriter(out, "llama")
    arch = {f"llama.{k}": cfg[v] for k, v in ARCH_FIELDS.items()}
    arch["llama.rope.freq_base"] = float(cfg.get("rope_parameters", {}).get("rope_theta", cfg.get("rope_theta", 10000.0)))
    arch["llama.rope.dimension_count"] = cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    ftype = {"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
             "BF16": gguf.LlamaFileType.MOSTLY_BF16}[dtype]
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name in ("general.architecture", "general.file_type"):
            continue
        value = field.contents()
        if field.name in arch:
            value = arch.pop(field.name)
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(field.name, value, field.types[0], sub_type=sub)
    for key, value in arch.items():  # fields the embedded file lacked
        writer.add_key_value(key, value, gguf.GGUFValueType.FLOAT32 if isinstance(value, float) else gguf.GGUFValueType.UINT32)
    writer.add_file_type(ftype)
    types: Counter = Counter()
    for name, w in gguf_tensors(state, cfg).items():
        w = w.to(torch.float32)
        if w.ndim == 1 or dtype == "F32":
            writer.add_tensor(name, w.numpy())
            types["F32"] += 1
        elif dtype == "F16":
            writer.add_tensor(name, w.to(torch.float16).numpy())
            types["F16"] += 1
        else:
            writer.add_tensor(name, w.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16),
                              raw_dtype=gguf.GGMLQuantizationType.BF16)
            types["BF16"] += 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dict(types)


def quantize(src: Path, dest: Path, gguf_type: str) -> None:
    """llama.cpp's quantizer, run by the Python that holds llama-cpp-python (scripts/levers/gguf/quantize.py)."""
    version("llamacpp")  # installed, else the target that installs it
    py = LLAMACPP_VENV / "bin" / "python"
    r = subprocess.run([str(py), "-m", "scripts.levers.gguf.quantize", str(src), str(dest), gguf_type], cwd=paths.ROOT,
                       capture_output=True, text=True, check=False)
    if r.returncode != 0:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise ExportError(f"llama.cpp could not quantize to {gguf_type}: {tail[0]}")


def tensor_types(path: Path) -> dict[str, int]:
    import gguf

    return dict(Counter(t.tensor_type.name for t in gguf.GGUFReader(path).tensors))


def export(variant_name: str, record_dir: Path | None = None) -> Path:

    var = load_variant(variant_name)
    gguf_type = var.resolved.get("GGUF_TYPE")
    if var.resolved.get("ENGINE") != "llamacpp" or not gguf_type:
        raise ExportError(f"{variant_name} is not a GGUF variant: it needs ENGINE=llamacpp and GGUF_TYPE in config.env")
    dest = Path(var.model)
    if dest.suffix != ".gguf":
        raise ExportError(f"{variant_name}: MODEL={var.resolved['MODEL']} must name a .gguf file")
    parent = load_variant(var.resolved["PARENT"]) if var.resolved.get("PARENT") else None
    if source := var.resolved.get("GGUF_SOURCE"):
        if not (paths.ROOT / source / "config.json").is_file():
            raise ExportError(f"{variant_name}: GGUF_SOURCE={source} is not a checkpoint here: build it first "
                              f"(a draft model: make draft VARIANT={parent.name if parent else '<parent>'})")
        parent_dir = paths.ROOT / source
    elif parent is None:
        raise ExportError(f"{var.path / 'config.env'}: no PARENT (the checkpoint to export)")
    elif not Path(parent.model).is_dir():
        raise ExportError(f"{variant_name}: PARENT {missing_model(parent)}")
    else:
        parent_dir = Path(parent.model)
    report = read_checkpoint(parent_dir)
    if report.quantization:
        raise ExportError(f"{parent.name} is quantized ({report.quantization.get('quant_method')}): export a BF16 "
                          f"parent; llama.cpp quantizes it itself")
    t0 = time.monotonic()
    embedded = None
    if writes_itself(parent_dir):
        embedded = embedded_gguf()
        write, tokenizer_from = partial(write_plain, parent_dir, embedded), embedded.name
    elif gguf_type == EMBEDDED:
        raise ExportError(f"{variant_name}: GGUF_TYPE={EMBEDDED} is the SmolLM2 base's own GGUF file; "
                          f"{paths.shown(parent_dir)} has none")
    else:
        write = partial(convert, parent_dir)
        tokenizer_from = f"{paths.shown(parent_dir)} (llama.cpp's convert_hf_to_gguf.py)"
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    plain = dest.with_name(f".{dest.name}.{os.getpid()}.bf16.tmp")
    try:
        if gguf_type == EMBEDDED:
            shutil.copyfile(embedded, tmp)
        elif gguf_type in PLAIN:
            write(tmp, gguf_type)
        else:
            write(plain, "BF16")
            quantize(plain, tmp, gguf_type)
        types = tensor_types(tmp)
        tmp.replace(dest)
    finally:
        tmp.unlink(missing_ok=True)
        plain.unlink(missing_ok=True)
    record = {"kind": "gguf-export", "variant": variant_name, "parent": parent.name,
              "parent_model": var.resolved.get("GGUF_SOURCE") or parent.resolved["MODEL"], "gguf_type": gguf_type, "gguf": var.resolved["MODEL"],
              "bytes": dest.stat().st_size, "parent_bytes": report.total_bytes, "tensor_types": types,
              "tokenizer_from": tokenizer_from, "quantizer": None if gguf_type in PLAIN or gguf_type == EMBEDDED
              else f"llama.cpp llama_model_quantize (llama-cpp-python {version('llamacpp')})",
              "seconds": round(time.monotonic() - t0, 1),
              "command": [sys.executable, "-m", "scripts.levers.gguf.export", *sys.argv[1:]], "git": git_state(),
              "versions": versions(), "hardware": hardware(), "finished_at": now_utc().isoformat(timespec="seconds")}
    path = write_record(record, record_dir or var.path, "gguf_export")
    print(f"wrote {paths.shown(dest)}: {gguf_type}, {dest.stat().st_size / 2**20:.1f} MiB "
          f"({', '.join(f'{k} x{v}' for k, v in sorted(types.items()))}); record {paths.shown(path)}")
    return dest


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("variant", help=f"a variant with ENGINE=llamacpp and GGUF_TYPE ({EMBEDDED}, BF16, Q8_0, Q4_K_M, …)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        export(args.variant)
    except (ExportError, VariantError, CheckpointError, EngineError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
