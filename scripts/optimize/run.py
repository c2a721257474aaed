"""make optimize: from a base checkpoint to its certified fastest variant on this machine, resumable.

    python -m scripts.optimize.run smollm2 --budget tiny          # `make optimize BASE=smollm2 BUDGET=tiny`
    make optimize BASE=myft BUDGET=normal CONCURRENCY=1,8 SLO_TPOT_MS=50

Phases, each step the make target a person would run (its log under .cache/optimize/<base>/logs/):
  plan      eval/optimize/<base>.yaml (scripts/optimize/plan.py) and the candidates' config.env files
  build     the weights each candidate needs (make export-gguf | calibrate)
  ladder    one latency ladder, reference first, every rung at CONCURRENCY, fixed length (make eval-latency)
  parity    KL divergence, top-1, perplexity of every lossy candidate (make eval-parity)
  identity  greedy identity of every lossless speculative candidate (make eval-identity)
  suite     BIG-bench Lite only for a candidate faster than the best certified so far at some concurrency whose
            parity passes: the 10% sample (make eval-quality), then every item where the sample does not decide
            and BUDGET=full (make eval-quality-full); the reference's own suite record first
  reliability  before a certified candidate is named a concurrency's winner (BUDGET=normal|full): the bounded soak
            (make soak) and the body fuzz (make fuzz) on its server; one that fails either (a 5xx, a hang, a broken
            stream, a server left busy or unhealthy, memory growing past the soak's limit) is not certified and the
            next candidate is tried; the reference too where it is named a level's winner (a failure said beside it)
  topology  on a machine with two GPUs or more: the winner at the highest concurrency on one GPU, as replicas behind
            vllm-router, and as vLLM's data and tensor parallel children, one ladder in alternating rounds (make
            scale; scripts/optimize/topology.py); the best topology per concurrency is the fastest whose interval
            over one GPU lies above 1.00
  report    results/optimize_<base>_<date>.{md,png} (scripts/optimize/report.py)
The gate (scripts/common/gate.py, the same verdicts as make gate and make compare) decides after each piece of
evidence. A step is skipped when .cache/optimize/<base>/state.json holds it with the same inputs: the variant's
config.env and those of every variant it derives from, the base's PROVENANCE.json, the lever's or measuring script's
files, the budget's arguments and this machine's hardware key. The state is rewritten after each step (temp file,
rename) and every record and weight is written atomically by its own script, so Ctrl-C or a kill loses at most the
step under way; the next run continues from there.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from scripts.common import paths
from scripts.common.hardware import hardware, hardware_key
from scripts.common.metrics import round_orders
from scripts.common.records import TRIAL_ENV, now_utc
from scripts.common.server import group_pids, last_error
from scripts.common.variants import (
    SHARED_SET_ENV,
    VariantError,
    build_target,
    list_variants,
    load_variant,
    reference_name,
    serving_target,
)
from scripts.optimize import evidence, report, topology
from scripts.optimize.plan import (
    BUDGETS,
    CONCURRENCY,
    Candidate,
    Plan,
    PlanError,
    plan_path,
    propose,
    read_plan,
    write_configs,
    write_plan,
)
from scripts.optimize.speeds import Speeds
from scripts.serve.launch import POOL_ENV
from scripts.serve.pool import Pool

# the pool's servers share one GPU: each vLLM server a fixed KV cache (2 GiB: ~90k tokens of SmolLM2, ~13k of the 4B
# proxy's full-attention layers; enough for c=8 x (prompt + answer) of the ladder and the suite) and a small memory
# share (0.05 x 141 GB = 7 GB: every start's free-memory check passes while the others hold theirs), so no start
# profiles memory the others are taking at the same moment; an SGLang server a share of the memory free at its start
# (SGLang's own rule), which the pool gives it first and alone (scripts/serve/pool.py): 0.15 of an H200 is 21 GB, the
# Qwen3.5-4B shape's weights (8.4 GB) with room for its KV and state caches
POOL_SET = "SERVE_GPU_MEMORY_UTILIZATION=0.05 SERVE_KV_CACHE_MEMORY_BYTES=2147483648 SGLANG_MEM_FRACTION_STATIC=0.15"

STATE = paths.CACHE / "optimize"
MACHINE_PROVENANCE = ("seconds", "registered")  # PROVENANCE.json keys of one machine's download
# PROVENANCE.json keys that name the weights' content (scripts/weights: register, download, shape_proxy)
CONTENT_PROVENANCE = {"files_sha256", "gguf_sha256", "shape_proxy", "config_only"}
STOP_GRACE_S = 60  # what an interrupted step gets to stop its servers before SIGKILL
PHASES = ("plan", "build", "pool", "ladder", "parity", "identity", "suite", "reliability", "topology", "report")
# the files a step's result depends on besides the variants: a lever's folder or a measuring script
STEP_CODE = {"export-gguf": "scripts/levers/gguf", "calibrate": "scripts/levers/quantize",
             "prune-vocab": "scripts/levers/vocab", "merge-lora": "scripts/levers/lora",
             "eval-latency": "scripts/measure/latency.py", "eval-parity": "scripts/measure/parity.py",
             "eval-identity": "scripts/measure/identity.py", "eval-quality": "scripts/measure/quality.py",
             "eval-quality-full": "scripts/measure/quality.py", "datasets": "scripts/data/bigbench_tasks.py",
             "soak": "scripts/measure/soak.py", "fuzz": "scripts/measure/fuzz.py", "scale": "scripts/measure/scale.py"}


class OptimizeError(RuntimeError):
    pass


def digest(*parts: str | bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


def code_hash(rel: str) -> str:
    """SHA-256 over a folder's (or one file's) contents: the lever's or script's code as it is now."""
    root = paths.ROOT / rel
    files = sorted(f for f in root.rglob("*.py")) if root.is_dir() else [root]
    return digest(*(f"{f.relative_to(paths.ROOT)}:{f.read_bytes().hex()}" for f in files))


def lineage(variant: str, seen: tuple[str, ...] = ()) -> str:
    """The variant's config.env and those of every variant it derives from or is judged by, and the base's
    PROVENANCE.json: what its weights and records depend on."""
    v = load_variant(variant)
    parts = [(v.path / "config.env").read_text()]
    for up in sorted({v.settings.get("PARENT"), v.settings.get("GATE_QUALITY_OF"), reference_name(v.settings)} - {None, variant}):
        if up not in seen:
            parts.append(lineage(up, (*seen, variant)))
    prov = paths.ROOT / v.settings["MODEL"] / "PROVENANCE.json"
    if not v.settings.get("PARENT") and prov.is_file():
        parts.append(weights_identity(prov))
    return digest(*parts)


def weights_identity(prov: Path) -> str:
    """What a base's PROVENANCE.json says its weights are, without how they came to this machine: the seconds the
    download took and whether a local folder was hard-linked or copied differ between two machines that hold the same
    files, and a run resumed on the second must reuse the first's steps. Only where the provenance names the content
    (file hashes, the GGUF's hash, a shape proxy's or config-only folder's spec): a hub snapshot records its repository
    alone, which a newer revision shares, so its whole text stays in the key (a new download measures again)."""
    text = prov.read_bytes().decode("utf-8", errors="replace")
    try:
        raw = json.loads(text)
    except ValueError:
        return text
    if not isinstance(raw, dict) or not CONTENT_PROVENANCE & raw.keys():
        return text
    return json.dumps({k: x for k, x in raw.items() if k not in MACHINE_PROVENANCE}, sort_keys=True)


@dataclass
class State:
    path: Path
    steps: dict[str, dict] = field(default_factory=dict)
    ladder_id: str | None = None
    ladder_args: list[str] | None = None  # what the ladder id was measured with (None: a state from before this key)
    ladder_hardware: str | None = None  # the machine (hardware key) the ladder id was measured on

    @classmethod
    def load(cls, base: str) -> State:
        path = STATE / base / "state.json"
        if path.is_file():
            raw = json.loads(path.read_text())
            return cls(path, raw.get("steps", {}), raw.get("ladder_id"), raw.get("ladder_args"),
                       raw.get("ladder_hardware"))
        return cls(path)

    def save(self) -> None:
        paths.write_text_atomic(self.path, json.dumps({"steps": self.steps, "ladder_id": self.ladder_id,
                                                       "ladder_args": self.ladder_args,
                                                       "ladder_hardware": self.ladder_hardware}, indent=1) + "\n")


@dataclass
class Runner:
    plan: Plan
    state: State
    hw: str
    log_dir: Path
    phase_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    notes: dict[str, list[str]] = field(default_factory=dict)  # variant -> what happened to it, in order
    reused: int = 0
    ran: int = 0
    no_suite: bool = False  # SUITE=0: certify on parity and identity alone, saying what waited on the suite
    gpu: bool = False  # vLLM's target is CUDA here: the GPU plan and the GPU's number of ladder rounds
    pool_rungs: list[str] | None = None  # POOL: these variants' servers start together before the first measuring step
    pool: Pool | None = None
    pending: set[str] | None = None  # the rungs with a ladder step still to run (None: not known yet, all of them)

    def pooled(self, phase: str, variant: str) -> str | None:
        """With POOL on, start the servers still needed at once before the first step that measures (not a build, not
        a reused step): every rung with a ladder step to run, the variant itself, and for parity and identity its
        reference (GATE_REFERENCE, else PARENT) that it is scored against (a run resumed after its ladder starts two
        servers, not the whole ladder's). A variant asked for later joins the running pool. Returns why the variant's
        server is not running when its start failed, else None."""
        if self.pool_rungs is None or phase in ("build", "topology"):  # the topology ladder starts its own servers
            return None
        if self.pool is None:
            self.pool = Pool(self.log_dir.parent / "pool")  # named before its start: an interrupted start is stopped
        wanted = {variant} | (self.pending if self.pending is not None else set(self.pool_rungs))
        if phase in ("parity", "identity"):  # scored against its reference's server
            wanted.add(reference_name(load_variant(variant).resolved) or self.plan.reference)
        new = [v for v in self.pool_rungs if v in wanted and v not in self.pool.servers and v not in self.pool.failed]
        if new:
            self.start_in_pool(new)
        return self.pool.failed.get(variant)

    def start_in_pool(self, rungs: list[str]) -> None:
        print(f"[pool] starting {len(rungs)} servers side by side: {', '.join(rungs)}", flush=True)
        t0 = time.monotonic()
        missing = {}
        for v in rungs:  # what `make serve` would fetch first: a committed draft head into weights/
            if why := make_weights(v, self.log_dir / f"weights_{v}.log"):
                missing[v] = why
        self.pool.start([load_variant(v) for v in rungs if v not in missing])
        self.pool.failed.update(missing)
        self.phase_s["pool"] += round(time.monotonic() - t0, 1)
        os.environ[POOL_ENV] = str(self.pool.file)
        for v in rungs:
            if v in self.pool.failed:
                self.note(v, f"its server failed to start beside the others: {self.pool.failed[v]}")

    def stop_pool(self) -> None:
        if self.pool is not None:
            self.pool.stop()
            os.environ.pop(POOL_ENV, None)

    @property
    def rounds(self) -> int:
        """The ladder's rounds: the plan's own number, else its budget's on this kind of machine."""
        return self.plan.rounds or BUDGETS[self.plan.budget].rounds(self.gpu)

    def note(self, variant: str, text: str) -> None:
        if text not in self.notes.setdefault(variant, []):
            self.notes[variant].append(text)

    def step_key(self, phase: str, target: str, variant: str, args: tuple[str, ...] = (), extra_key: str = "",
                 tag: str = "") -> tuple[str, str]:
        """(the step's id in the state, the digest of its inputs)."""
        # a measuring step names how its server ran: beside the others of a pool (and their shared memory settings) or
        # alone; nothing is added for a lone server, so the states of earlier runs keep their keys
        serving = [] if phase == "build" or self.pool_rungs is None else ["pool", os.environ.get(SHARED_SET_ENV, "")]
        key = digest(lineage(variant), code_hash(STEP_CODE[target]), self.hw, " ".join(args), extra_key, *serving)
        return f"{target}:{variant}{tag}", key

    def reusable(self, phase: str, sid: str, key: str, variant: str) -> dict | None:
        """The state's entry of the step when it holds it done with these inputs (and its weights and record are
        here), else None. A failed step is tried again (a package installed since, a server that had no memory
        beside another run)."""
        old = self.state.steps.get(sid)
        built = phase != "build" or (paths.ROOT / load_variant(variant).settings["MODEL"]).exists()  # another machine's
        if (old and old["key"] == key and old["status"] == "ok" and built
                and (old.get("record") is None or (paths.ROOT / old["record"]).is_file())):
            return old
        return None

    def step(self, phase: str, target: str, variant: str, args: tuple[str, ...] = (), extra_key: str = "",
             records: str | None = None, tag: str = "") -> dict:
        """Run `make <target> VARIANT=<variant>` (args through the target's *_ARGS variable) unless the state holds
        it with the same inputs. Returns its state entry: status ok | failed, record (the new record's path), error.
        `tag` tells apart steps of one target and variant (a ladder's rounds: "#r2")."""
        sid, key = self.step_key(phase, target, variant, args, extra_key, tag)
        if (old := self.reusable(phase, sid, key, variant)) is not None:
            self.reused += 1
            print(f"[{phase}] {sid}: reused ({old['status']}{', ' + old['record'] if old.get('record') else ''})")
            return old
        if why := self.pooled(phase, variant):
            entry = {"key": None, "phase": phase, "status": "failed", "seconds": 0, "command": "", "record": None,
                     "error": why}  # never reused: the next run starts it again
            print(f"[{phase}] {sid}: failed: {why}", flush=True)
            return entry
        var = {"eval-latency": "BENCH_ARGS", "eval-parity": "PARITY_ARGS", "eval-identity": "IDENTITY_ARGS",
               "soak": "SOAK_ARGS", "fuzz": "FUZZ_ARGS", "scale": "SCALE_ARGS"}.get(target)
        cmd = ["make", "--no-print-directory", target, f"VARIANT={variant}"]
        if var:
            cmd.append(f"{var}={' '.join(args)}")
        folder = paths.variant_dir(variant)
        before = set(folder.glob(f"{records}_*.json")) if records else set()
        log = self.log_dir / f"{sid.replace(':', '_')}.log"
        print(f"[{phase}] {sid}: {shlex.join(cmd)} (log {paths.shown(log)})", flush=True)
        t0 = time.monotonic()
        with log.open("w") as out:
            rc = run_step(cmd, out)
        seconds = round(time.monotonic() - t0, 1)
        self.phase_s[phase] += seconds
        self.ran += 1
        new = sorted(set(folder.glob(f"{records}_*.json")) - before) if records else []
        entry = {"key": key, "phase": phase, "status": "ok" if rc == 0 else "failed", "seconds": seconds,
                 "command": shlex.join(cmd),
                 "record": paths.shown(new[-1]) if new else None}
        if rc != 0:
            entry["error"] = last_error(log)
            print(f"[{phase}] {sid}: failed after {seconds} s: {entry['error']}", flush=True)
        else:
            print(f"[{phase}] {sid}: done in {seconds} s", flush=True)
        self.state.steps[sid] = entry
        self.state.save()
        return entry


def run_step(cmd: list[str], out) -> int:
    """The step in a process group of its own; when this run is interrupted (Ctrl-C, SIGTERM) the whole group gets
    SIGTERM, so the measuring script stops its servers and removes what it was writing, as when run by hand."""
    p = subprocess.Popen(cmd, cwd=paths.ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return p.wait()
    except BaseException:
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, sig)
            deadline = time.monotonic() + wait
            while group_pids(p.pid) and time.monotonic() < deadline:  # make exits first; its script stops its server
                p.poll()
                time.sleep(0.2)
            if not group_pids(p.pid):
                break
        p.wait()
        raise


# ------------------------------------------------------------------------------------------------------- the phases
def make_plan(args) -> tuple[Plan, list[str]]:
    path = plan_path(args.base, serving_target())
    hw = hardware_key(hardware())
    if path.is_file() and not args.replan:
        plan = read_plan(path)
        if plan.base != args.base:
            raise PlanError(f"{paths.shown(path)} is the plan of base {plan.base}, not {args.base}")
        changed = args.budget is not None and args.budget != plan.budget
        if not changed:
            plan.concurrency = args.concurrency or plan.concurrency
            plan.slo_tpot_ms = args.slo_tpot_ms if args.slo_tpot_ms is not None else plan.slo_tpot_ms
            plan.hardware = hw
            for c in plan.candidates:
                load_variant(c.variant)  # an edited plan naming a variant that does not exist: one line
            print(f"[plan] read {paths.shown(path)} ({len(plan.candidates)} candidates)")
            return plan, []
        print(f"[plan] BUDGET={args.budget} differs from the plan's {plan.budget}: proposing again")
    plan, configs = propose(args.base, args.budget or "normal", args.concurrency or list(CONCURRENCY), args.slo_tpot_ms, hw,
                            gpu=serving_target() == "cuda")
    levers = {c.variant: c.lever for c in plan.candidates}
    written = write_configs(configs, levers)
    write_plan(plan, path)
    print(f"[plan] wrote {paths.shown(path)}: {len(plan.candidates)} candidates, {len(plan.left_out)} levers left out"
          + (f"; new variants {', '.join(written)}" if written else ""))
    return plan, written


def build(r: Runner, c: Candidate) -> bool:
    for v in c.builds:
        settings = load_variant(v).resolved
        target = build_target(settings)
        model = paths.ROOT / settings["MODEL"]
        sid = f"{target}:{v}"
        if model.exists() and sid not in r.state.steps:
            r.note(c.variant, f"{v}'s weights were already here (built before this plan): used as they are")
            r.state.steps[sid] = {"key": None, "status": "ok", "seconds": 0, "record": None, "adopted": True}
            r.state.save()
            continue
        if model.exists() and r.state.steps[sid].get("adopted"):
            continue
        entry = r.step("build", target, v)
        if entry["status"] != "ok":
            r.note(c.variant, f"build of {v} failed: {entry['error']}")
            return False
    return True


def ladder(r: Runner, rungs: list[str]) -> Speeds:
    """The reference and every candidate, one server at a time, in `rounds` rounds of alternating order (ABBA: as
    listed, then reversed), so each candidate's ratio to the reference is paired round by round with its interval."""
    budget = BUDGETS[r.plan.budget]
    rounds = r.rounds
    args = ("--concurrency", ",".join(map(str, r.plan.concurrency)), "--modes", "fixed", *budget.ladder)
    out = Speeds({v: [None] * rounds for v in rungs})
    other_args = r.state.ladder_args is not None and r.state.ladder_args != list(args)  # another BUDGET's ladder
    other_machine = r.state.ladder_hardware not in (None, r.hw)
    if other_machine:  # a resumed run on another kind of machine: speed is only compared within one machine's ladder
        print(f"[ladder] ladder {r.state.ladder_id} was measured on {r.state.ladder_hardware}; this machine is {r.hw}: "
              "its speed records are not reused, a new ladder starts here", flush=True)
    if r.state.ladder_id is None or other_args or other_machine or not any(
            sid.startswith("eval-latency:") for sid in r.state.steps):
        r.state.ladder_id = f"{r.plan.base}-optimize-{now_utc():%Y%m%d-%H%M%S}"
    r.state.ladder_args, r.state.ladder_hardware = list(args), r.hw
    steps = [(k, v, (*args, "--ladder-id", r.state.ladder_id, "--round", str(k)))
             for k, order in enumerate(round_orders(rungs, rounds), start=1) for v in order]
    if r.pool_rungs is not None:  # the servers the pool starts: the rungs with a round still to measure
        r.pending = {v for k, v, a in steps
                     if r.reusable("ladder", *r.step_key("ladder", "eval-latency", v, a, tag=f"#r{k}"), v) is None}
    for k, v, a in steps:
        e = r.step("ladder", "eval-latency", v, a, records="latency", tag=f"#r{k}")
        out.rounds[v][k - 1] = e["record"] if e["status"] == "ok" else None
        if e["status"] != "ok":
            r.note(v, f"latency run failed (round {k}): {e.get('error')}")
    return out


def reference_weights(base: str) -> None:
    """`make weights` for the base's BF16 variant when its checkpoint is not here (a fresh clone): the plan reads it."""
    ref = load_variant(f"{base}-bf16")
    if (paths.ROOT / ref.settings["MODEL"] / "config.json").is_file():
        return
    log = STATE / base / "logs" / "weights.log"
    print(f"[plan] make weights VARIANT={ref.name} (log {paths.shown(log)})", flush=True)
    if why := make_weights(ref.name, log):
        raise OptimizeError(why)


def make_weights(variant: str, log: Path) -> str | None:
    """`make weights VARIANT=…` (its output in log); why it failed, else None."""
    with log.open("w") as out:
        if run_step(["make", "--no-print-directory", "weights", f"VARIANT={variant}"], out) != 0:
            return f"make weights VARIANT={variant} failed: {last_error(log)}"
    return None


def run(args) -> int:
    t0 = time.monotonic()
    STATE.joinpath(args.base, "logs").mkdir(parents=True, exist_ok=True)
    reference_weights(args.base)
    plan, _ = make_plan(args)
    if plan.budget == "tiny":  # a trial: its records are evidence for this run only, never the variants' (of_record)
        os.environ[TRIAL_ENV] = f"optimize-tiny-{plan.base}"
    gpu = serving_target() == "cuda"
    pool = args.pool == "on" or (args.pool == "auto" and gpu)
    if pool and gpu:
        os.environ[SHARED_SET_ENV] = POOL_SET
    r = Runner(plan, State.load(plan.base), plan.hardware, STATE / plan.base / "logs", no_suite=args.no_suite, gpu=gpu)
    r.phase_s["plan"] = round(time.monotonic() - t0, 1)
    ok = [c for c in plan.candidates if build(r, c)]
    if pool:
        r.pool_rungs = [plan.reference, *(c.variant for c in ok)]
    try:
        return certify_and_report(r, ok, t0)
    finally:
        r.stop_pool()


def certify_and_report(r: Runner, ok: list[Candidate], t0: float) -> int:
    plan = r.plan
    speeds = ladder(r, [plan.reference, *(c.variant for c in ok)])
    measured = [c for c in ok if speeds.measured(c.variant)]
    if not speeds.measured(plan.reference):
        raise OptimizeError(f"the reference {plan.reference} could not be measured: {r.notes.get(plan.reference, ['?'])[-1]}")
    verdicts = evidence.certify(r, measured, speeds)
    # on several GPUs: the winner at the highest concurrency (else the reference) on every topology they admit
    top = max(plan.concurrency)
    winner = next((v for v, o in verdicts.items() if top in o.winner_at), plan.reference)
    topo = topology.rung(r, winner)
    md = report.write(r, speeds, verdicts, time.monotonic() - t0, topo)
    print(f"wrote {paths.shown(md)} ({r.ran} steps run, {r.reused} reused)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("base", help="a base model: experiments/<base>-bf16/ exists (make download registers one)")
    p.add_argument("--budget", choices=sorted(BUDGETS), help="evidence per phase (default: the plan's, else normal)")
    p.add_argument("--concurrency", help="comma-separated levels (default: the plan's, else 1,8)")
    p.add_argument("--slo-tpot-ms", type=float, help="name the fastest certified variant whose TPOT p50 meets this")
    p.add_argument("--no-suite", action="store_true", help="buy no BIG-bench Lite evidence (SUITE=0): on a CPU without "
                   "native BF16 its sample of the reference alone takes hours; the report names what waited on it")
    p.add_argument("--replan", action="store_true", help="propose the candidates again (the plan file is rewritten)")
    p.add_argument("--pool", choices=("auto", "on", "off"), default="auto",
                   help="start every rung's server once, side by side, and measure them one at a time (POOL=1|0; "
                        "auto: on a GPU, where one start takes minutes; scripts/serve/pool.py)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.concurrency:
            args.concurrency = [int(x) for x in args.concurrency.split(",")]
            if any(c < 1 for c in args.concurrency):
                raise ValueError
    except ValueError:
        print(f"error: CONCURRENCY={args.concurrency}: expected comma-separated whole numbers >= 1, e.g. 1,8", file=sys.stderr)
        return 2
    if args.base not in {n.rsplit("-bf16", 1)[0] for n in list_variants() if n.endswith("-bf16")}:
        print(f"error: unknown BASE={args.base}: no experiments/{args.base}-bf16/config.env (register a checkpoint: "
              f"`make download MODEL=/path/to/hf-folder NAME={args.base}`)", file=sys.stderr)
        return 2
    try:
        with paths.terminate_raises():
            return run(args)
    except (PlanError, VariantError, OptimizeError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: every finished step is kept; run the same command again to continue", file=sys.stderr)
        return 130
    except SystemExit as e:
        if e.code == 143:
            print("terminated: every finished step is kept; run the same command again to continue", file=sys.stderr)
        raise
    finally:
        os.environ.pop(TRIAL_ENV, None)
        os.environ.pop(SHARED_SET_ENV, None)


if __name__ == "__main__":
    sys.exit(main())
