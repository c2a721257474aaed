"""make optimize's topology rung as pure logic: what a machine of N GPUs and a model's heads admit (a fake GPU count,
never a fake of vLLM), the best topology per concurrency from hand-made ratios, and the scale ladder's arguments."""

from __future__ import annotations

import json

from scripts.common.metrics import speed_ratio
from scripts.measure.scale import build_parser
from scripts.optimize.report import topology_lines
from scripts.optimize.topology import Topology, best_per_level, propose, scale_args

SMOLLM2 = {"MODEL": "weights/SmolLM2-135M-Instruct", "BASE": "smollm2", "SERVE_MAX_NUM_SEQS": "8",
           "GATE_MAX_MEAN_KLD": "0.05", "PARENT": "smollm2-bf16"}


def test_one_gpu_or_no_router_leaves_every_topology_out():
    for gpus, router, why in ((1, True, "1 GPU(s) visible"), (0, True, "0 GPU(s) visible"),
                              (2, False, "vllm-router is not installed")):
        topologies, left, children = propose("w", SMOLLM2, gpus, (9, 3), router=router)
        assert topologies == [] and children == {} and why in left[0]["why"]


def test_two_gpus_smollm2_gets_replicas_and_dp_but_not_tp_its_nine_heads_refuse():
    topologies, left, children = propose("w", SMOLLM2, 2, (9, 3), router=True)
    assert topologies == [Topology("replicas", 2, "w"), Topology("dp", 2, "w-dp2")]
    assert "9 attention heads / 3 key-value heads" in left[0]["why"] and left[0]["lever"] == "topology: tensor parallel 2"
    dp = children["w-dp2"]
    assert dp["PARENT"] == "w" and dp["SERVE_DATA_PARALLEL_SIZE"] == "2" and dp["ENV_NCCL_NVLS_ENABLE"] == "0"
    assert not any(k.startswith("GATE_") for k in dp)  # a topology child is speed only: its quality is its parent's


def test_tensor_parallel_where_the_heads_divide_keeps_the_winners_compilation_settings():
    own = {**SMOLLM2, "SERVE_COMPILATION_CONFIG": '{"cudagraph_capture_sizes": [1, 8]}'}
    topologies, left, children = propose("w", own, 2, (4, 1), router=True)  # Gemma 3 270M: 4 heads, 1 kv head
    assert Topology("tp", 2, "w-tp2") in topologies and left == []
    assert json.loads(children["w-tp2"]["SERVE_COMPILATION_CONFIG"]) == {
        "cudagraph_capture_sizes": [1, 8], "pass_config": {"fuse_allreduce_rms": False}}
    # 16 heads over 8 GPUs: the 4 kv heads divide 8 (vLLM replicates them); 12 heads do not divide by 8
    assert any(t.kind == "tp" for t in propose("w", SMOLLM2, 8, (16, 4), router=True)[0])
    assert not any(t.kind == "tp" for t in propose("w", SMOLLM2, 8, (12, 3), router=True)[0])


def test_other_engines_and_split_winners():
    topologies, left, _ = propose("w", {**SMOLLM2, "ENGINE": "llamaserver"}, 2, (9, 3), router=True)
    assert topologies == [Topology("replicas", 2, "w")] and "data and tensor parallel are vLLM's" in left[0]["why"]
    topologies, left, _ = propose("w", {**SMOLLM2, "SERVE_TENSOR_PARALLEL_SIZE": "2"}, 2, (4, 1), router=True)
    assert topologies == [] and "already split over GPUs" in left[0]["why"]


def ratio_row(label: str, level: int, pairs: list[tuple[float, float]]) -> dict:
    sr = speed_ratio(pairs)
    return {"label": label, "variant": "w", "level": level, "gpus": 2, "tok_s": pairs[0][0], "ratio": sr.to_json(),
            "hit_rate": 0.5, "reference_hit_rate": 0.5}


def test_best_per_level_is_the_fastest_certified_else_one_gpu():
    rows = [ratio_row("2 replicas, cache_aware", 8, [(150, 100), (160, 100), (155, 100)]),  # 1.55, faster
            ratio_row("w-dp2", 8, [(190, 100), (120, 100), (150, 100)]),  # wide: a tie despite a higher mean
            ratio_row("2 replicas, cache_aware", 1, [(99, 100), (101, 100), (100, 100)]),  # a tie
            ratio_row("w-tp2", 1, [(90, 100), (91, 100), (89, 100)])]  # slower
    best = best_per_level(rows, [1, 8])
    assert best[1] is None and best[8]["label"] == "2 replicas, cache_aware"
    text = "\n".join(topology_lines({"gpus": 2, "winner": "w", "ratios": rows, "best": best, "left_out": [
        {"lever": "topology: tensor parallel 2", "why": "9 attention heads"}]}, [1, 8]))
    assert "- c=1: one GPU: no topology's interval lies above 1.00 here" in text
    assert "make serve-replicas VARIANT=w REPLICAS=2 POLICY=cache_aware" in text and "9 attention heads" in text


def test_scale_args_parse_as_the_scale_ladder_reads_them():
    args = scale_args([Topology("replicas", 2, "w"), Topology("dp", 2, "w-dp2"), Topology("tp", 2, "w-tp2")],
                      [1, 8], 3, ".cache/optimize/x/topology_w.json", ["SERVE_GPU_MEMORY_UTILIZATION=0.05"])
    ns = build_parser().parse_args(["w", *args])
    assert ns.beside == ["w-dp2", "w-tp2"] and ns.single == "replica" and ns.rounds == 3 and ns.request_rate == "none"
    assert ns.round_levels == ns.concurrency == "1,8" and ns.set == ["SERVE_GPU_MEMORY_UTILIZATION=0.05"]


def test_the_rung_writes_the_children_frees_the_gpus_and_reads_its_ladder(tmp_path, monkeypatch):
    """rung()'s glue with a fake of the GPU count only; the step it would run (make scale) is stood in for by one that
    writes the summary the scale ladder writes."""
    import shutil
    from pathlib import Path
    from types import SimpleNamespace

    from scripts.common import paths
    from scripts.optimize.topology import rung

    exp = tmp_path / "experiments"
    (exp / "smollm2-bf16").mkdir(parents=True)
    shutil.copy(paths.EXPERIMENTS / "smollm2-bf16" / "config.env", exp / "smollm2-bf16" / "config.env")
    monkeypatch.setattr(paths, "EXPERIMENTS", exp)
    monkeypatch.setattr("scripts.common.hardware.hardware", lambda: {"gpu": {"name": "fake", "count": 2}})

    class Runner:
        gpu, plan, log_dir, stopped, calls, rounds = True, SimpleNamespace(concurrency=[1, 8]), tmp_path / "logs", False, [], 3

        def stop_pool(self):
            self.stopped = True

        def note(self, variant, text):
            raise AssertionError(text)

        def step(self, phase, target, variant, args, extra_key="", records=None):
            assert self.stopped, "the pool holds the GPUs until the topology ladder starts"
            self.calls.append((phase, target, variant, args, extra_key))
            summary = Path(args[args.index("--summary-json") + 1])
            summary = summary if summary.is_absolute() else paths.ROOT / summary
            summary.parent.mkdir(parents=True, exist_ok=True)
            summary.write_text(json.dumps({"ratios": [ratio_row("2 replicas, cache_aware", 8, [(150, 100), (160, 100),
                                                                                               (155, 100)])]}))
            return {"status": "ok"}

    r = Runner()
    out = rung(r, "smollm2-bf16")
    (phase, target, variant, args, key) = r.calls[0]
    assert (phase, target, variant) == ("topology", "scale", "smollm2-bf16")
    assert args[args.index("--with") + 1] == "smollm2-bf16-dp2" and "SERVE_DATA_PARALLEL_SIZE=2" in key
    assert (exp / "smollm2-bf16-dp2" / "config.env").is_file() and (exp / "smollm2-bf16-dp2" / "README.md").is_file()
    assert out["gpus"] == 2 and out["best"][1] is None and out["best"][8]["label"] == "2 replicas, cache_aware"
    assert any("tensor parallel 2" in x["lever"] for x in out["left_out"])  # 9 heads, or no config.json here

    class OneDidNotStart(Runner):  # the DP2 server never started: make scale exits 1, its summary names it
        notes: list[str] = []

        def note(self, variant, text):
            self.notes.append(text)

        def step(self, phase, target, variant, args, extra_key="", records=None):
            super().step(phase, target, variant, args, extra_key, records)
            summary = paths.ROOT / args[args.index("--summary-json") + 1]
            got = json.loads(summary.read_text())
            summary.write_text(json.dumps({**got, "unstarted": {"smollm2-bf16-dp2": "CUDA out of memory"}}))
            return {"status": "failed", "error": "make scale exited 1"}

    r = OneDidNotStart()
    out = rung(r, "smollm2-bf16")
    assert out["best"][8]["label"] == "2 replicas, cache_aware", "the topologies that ran are still ranked"
    assert {"lever": "smollm2-bf16-dp2", "why": "its server did not start: CUDA out of memory"} in out["left_out"]
    assert r.notes == ["topology smollm2-bf16-dp2 did not start: CUDA out of memory"]

    class NoNewSummary(OneDidNotStart):  # failed before writing one: the previous run's summary is not read
        def step(self, phase, target, variant, args, extra_key="", records=None):
            self.stopped = True
            return {"status": "failed", "error": "make scale exited 2"}

    r = NoNewSummary()
    r.notes = []
    out = rung(r, "smollm2-bf16")
    assert out["ratios"] == [] and r.notes == ["its topology ladder failed: make scale exited 2"]
    r.gpu = False  # a CPU machine: no rung at all
    assert rung(r, "smollm2-bf16") is None
