"""make optimize's topology rung: on a machine with several GPUs, how its winner is best served on all of them.

After the gate has named the winner, the runner measures it on every topology this machine and model admit, in one
scale ladder (scripts/measure/scale.py, `make scale`): one GPU (replica 0 alone), N replicas behind vllm-router's
cache_aware policy (a GPU each), vLLM's data parallel N and tensor parallel N (child variants of the winner, written
here: <winner>-dpN, <winner>-tpN), every server started once, side by side, then the ladder's concurrency levels in
alternating rounds. Each topology's ratio to one GPU at each level carries its 95% interval; the best topology at a
level is the fastest whose interval lies above 1.00, else one GPU (a second GPU buys nothing there).

What a topology cannot take is left out with its reason, as the plan's levers are: fewer than two GPUs, no router
installed, an engine other than vLLM (data and tensor parallel are vLLM's), attention heads the GPU count does not
divide (tensor parallel), a winner already split over GPUs.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass

from scripts.common import paths
from scripts.common.metrics import SpeedRatio

# GPUs of one host without NVLink multicast (the lent machines' rule); vLLM 0.26's FlashInfer all-reduce + RMSNorm
# fusion failed tensor parallel starts there (results/scale-gpu-20261127/README.md): the children turn it off
PARALLEL_ENV = {"ENV_NCCL_NVLS_ENABLE": "0"}
TP_PASS_OFF = {"fuse_allreduce_rms": False}  # pass_config keys of the compilation config


@dataclass(frozen=True)
class Topology:
    kind: str  # replicas | dp | tp
    size: int
    variant: str  # the variant that serves it: the winner itself (replicas) or its child


def heads_of(model_dir) -> tuple[int, int] | None:
    """(attention heads, key-value heads) from a checkpoint's config.json (a multimodal one's text_config)."""
    path = paths.ROOT / model_dir / "config.json"
    if not path.is_file():
        return None
    cfg = json.loads(path.read_text())
    cfg = cfg.get("text_config", cfg)
    if "num_attention_heads" not in cfg:
        return None
    return cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])


def propose(winner: str, settings: dict[str, str], gpus: int, heads: tuple[int, int] | None,
            router: bool | None = None) -> tuple[list[Topology], list[dict[str, str]], dict[str, dict[str, str]]]:
    """(topologies to measure, those left out with why, the child variants' settings by name). Pure but for the
    router check (router=None: is vllm-router importable here)."""
    if router is None:
        router = importlib.util.find_spec("vllm_router") is not None
    out: list[Topology] = []
    left: list[dict[str, str]] = []
    children: dict[str, dict[str, str]] = {}

    def leave(kind: str, why: str) -> None:
        left.append({"lever": f"topology: {kind}", "why": why})

    if gpus < 2:
        leave("every topology", f"{gpus} GPU(s) visible: a topology needs two or more")
        return out, left, children
    split = [k for k in ("SERVE_TENSOR_PARALLEL_SIZE", "SERVE_DATA_PARALLEL_SIZE", "SERVE_PIPELINE_PARALLEL_SIZE")
             if int(settings.get(k) or 1) > 1]
    if split:
        leave("every topology", f"{winner} is already split over GPUs ({', '.join(split)})")
        return out, left, children
    if not router:  # the ladder's one-GPU step is replica 0 of the replicas' start
        leave("every topology", "vllm-router is not installed (make install brings it): the topology ladder runs "
              "through make serve-replicas")
        return out, left, children
    out.append(Topology("replicas", gpus, winner))
    if (settings.get("ENGINE") or "vllm") != "vllm":
        leave("data / tensor parallel", f"{winner} is served by {settings['ENGINE']}: data and tensor parallel are vLLM's")
        return out, left, children
    base = {k: v for k, v in settings.items() if not k.startswith("GATE_")} | {"PARENT": winner}
    dp = f"{winner}-dp{gpus}"
    children[dp] = base | {"SERVE_DATA_PARALLEL_SIZE": str(gpus)} | PARALLEL_ENV
    out.append(Topology("dp", gpus, dp))
    if heads is None:
        leave(f"tensor parallel {gpus}", "the checkpoint's config.json names no attention heads")
    elif heads[0] % gpus or (heads[1] % gpus and gpus % heads[1]):
        leave(f"tensor parallel {gpus}", f"{heads[0]} attention heads / {heads[1]} key-value heads: vLLM needs the "
              f"heads divisible by {gpus} and the key-value heads divisible by it or dividing it")
    else:
        tp = f"{winner}-tp{gpus}"
        compile_cfg = json.loads(settings.get("SERVE_COMPILATION_CONFIG") or "{}")
        compile_cfg.setdefault("pass_config", {}).update(TP_PASS_OFF)
        children[tp] = base | {"SERVE_TENSOR_PARALLEL_SIZE": str(gpus),
                               "SERVE_COMPILATION_CONFIG": json.dumps(compile_cfg)} | PARALLEL_ENV
        out.append(Topology("tp", gpus, tp))
    return out, left, children


def best_per_level(ratios: list[dict], levels: list[int]) -> dict[int, dict | None]:
    """At each level, the topology whose ratio to one GPU is highest among those certified faster (the interval's
    lower end above 1.00); None where none is: one GPU serves that level as well as any topology measured."""
    out: dict[int, dict | None] = {}
    for lv in levels:
        faster = [x for x in ratios if x["level"] == lv and SpeedRatio.from_json(x["ratio"]).faster]
        out[lv] = max(faster, key=lambda x: x["ratio"]["ratio"], default=None)
    return out


def scale_args(topologies: list[Topology], levels: list[int], rounds: int, summary: str, sets: list[str]) -> list[str]:
    """`make scale` arguments (SCALE_ARGS) for one ladder over these topologies (the replicas' among them)."""
    lv = ",".join(map(str, levels))
    return ["--replicas", str(next(t.size for t in topologies if t.kind == "replicas")), "--single", "replica",
            "--policies", "cache_aware", *[a for t in topologies if t.kind != "replicas" for a in ("--with", t.variant)],
            "--rounds", str(rounds), "--round-levels", lv, "--concurrency", lv, "--request-rate", "none",
            "--overhead-rounds", "0", "--summary-json", summary, *[a for kv in sets for a in ("--set", kv)]]


def rung(r, winner: str) -> dict | None:
    """The topology ladder of `winner` on this machine's GPUs, in the optimize ladder's number of rounds (r: the
    optimize Runner; its pool is stopped first, the GPUs go to the ladder's servers, which take the run's shared
    memory settings, LAB_SERVE_SET, from the environment as every step does). Returns {gpus, winner, topologies, left_out, ratios, best, step} for the report,
    None on a machine with fewer than two GPUs."""
    from scripts.common.hardware import hardware
    from scripts.common.variants import load_variant
    from scripts.optimize.plan import write_configs

    gpus = (hardware().get("gpu") or {}).get("count", 0) if r.gpu else 0
    if gpus < 2:
        return None
    v = load_variant(winner)
    topologies, left, children = propose(winner, v.settings, gpus, heads_of(v.settings["MODEL"]))
    out = {"gpus": gpus, "winner": winner, "topologies": topologies, "left_out": left, "ratios": [], "best": {}}
    if not topologies:
        return out
    write_configs(children, {c: f"{winner} on {gpus} GPUs (make optimize's topology rung)" for c in children})
    r.stop_pool()
    summary = r.log_dir.parent / f"topology_{winner}.json"
    args = scale_args(topologies, r.plan.concurrency, r.rounds, paths.shown(summary), [])
    # the children's config.env files are inputs of the step too (a child edited by hand measures again)
    before = summary.stat().st_mtime_ns if summary.is_file() else None
    e = r.step("topology", "scale", winner, tuple(args), extra_key=" ".join(
        (paths.variant_dir(c) / "config.env").read_text() for c in sorted(children)), records="latency")
    out["step"] = e
    # a failed ladder's summary counts only when this run wrote it (one topology that never started, the others ran)
    if not summary.is_file() or (e["status"] != "ok" and summary.stat().st_mtime_ns == before):
        r.note(winner, f"its topology ladder failed: {e.get('error') or 'no summary written'}")
        return out
    got = json.loads(summary.read_text())  # a ladder with one topology that never started still ranks the others
    for name, why in got.get("unstarted", {}).items():
        out["left_out"].append({"lever": name, "why": f"its server did not start: {why}"})
        r.note(winner, f"topology {name} did not start: {why}")
    out["ratios"] = got["ratios"]
    out["best"] = best_per_level(got["ratios"], r.plan.concurrency)
    return out
