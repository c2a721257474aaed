"""CUDA-graph timing shared by the GEMM microbench (scripts/measure/gemm_bench.py) and the lab GEMV's tile tuner
(scripts/levers/kernels/w4a16_gemv.py): a body of launches captured once, then replayed between two CUDA events, so
the time is the GPU's alone (no Python or launch overhead)."""

from __future__ import annotations


def capture(body):
    """body() captured as one CUDA graph (torch.cuda.graph's own side stream), replayed once and synchronized."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def replay_ms(graph, reps: int) -> list[float]:
    """The time of each of `reps` replays of a captured graph, in ms (CUDA events around each replay)."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = []
    for _ in range(reps):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        out.append(start.elapsed_time(end))
    return out
