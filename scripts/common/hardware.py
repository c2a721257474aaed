"""The machine a measurement runs on: CPU model and the flags that decide kernels, cores, memory, GPU; and the
dtype choices that follow from them. What makes two records comparable (hardware_key) is decided here, once.

    >>> hardware()["cpu_flags"]          # e.g. ['avx2', 'avx512f', 'avx512_bf16', 'avx512_vnni']
    >>> hardware_key(hardware())         # 'AMD EPYC (2 cores, avx2 avx512f avx512_bf16 avx512_vnni)'
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

# CPU flags with 8-bit dot products: oneDNN's int8 GEMM is exact only with them (scripts/levers/vocab/tail.py, step 2)
# and vLLM's W8A8 fast only with them (scripts/optimize/plan.py says where that was measured)
INT8_DOT_FLAGS = ("avx512_vnni", "avx_vnni", "amx_int8")
# CPU features that decide which vLLM-CPU kernels run (BF16 GEMM, INT8 VNNI, AMX tiles): CPUs of one model name differ.
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_bf16", "amx_int8", "amx_tile")


def _cpuinfo() -> tuple[str, set[str]]:
    """The first CPU's model name and every flag /proc/cpuinfo lists for it ("unknown", empty where unreadable)."""
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            elif line.startswith("flags"):
                return cpu, set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return cpu, set()


def all_cpu_flags() -> set[str]:
    """Every flag of the first CPU: what -march=native builds for."""
    return _cpuinfo()[1]


def cpu_model_and_flags() -> tuple[str, list[str]]:
    """The CPU's model name and which of CPU_FLAGS it has (from /proc/cpuinfo; "unknown", [] where unreadable)."""
    cpu, have = _cpuinfo()
    return cpu, [f for f in CPU_FLAGS if f in have]


def hardware() -> dict[str, Any]:
    """CPU model, cores and the CPU flags that matter always; GPU name, memory and driver where nvidia-smi answers."""
    cpu, flags = cpu_model_and_flags()
    hw: dict[str, Any] = {"cpu": cpu, "cores": os.cpu_count(), "cpu_flags": flags, "memory_gib": _mem_gib(),
                          "gpu": None}
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                           capture_output=True, text=True, check=False).stdout.strip().splitlines()
        if q:
            name, mem, driver = (x.strip() for x in q[0].split(","))
            hw["gpu"] = {"name": name, "memory": mem, "driver": driver, "count": len(q)}
    return hw


def visible_gpus(env: dict[str, str] | None = None) -> int | None:
    """How many GPUs a server started with `env` (over this process's environment) can use: nvidia-smi's count,
    narrowed by CUDA_VISIBLE_DEVICES where set; None without nvidia-smi (no GPU machine)."""
    gpu = hardware()["gpu"]
    if gpu is None:
        return None
    mask = {**os.environ, **(env or {})}.get("CUDA_VISIBLE_DEVICES")
    if mask is None:
        return gpu["count"]
    return len([d for d in mask.split(",") if d.strip() and not d.strip().startswith("-")])


def cpu_jiffies() -> tuple[int, int] | None:
    """(busy, total) time of all CPUs since boot, in clock ticks, from /proc/stat's first line (user nice system idle
    iowait irq softirq steal; busy is all but idle and iowait); None where there is no /proc/stat."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return sum(ticks) - ticks[3] - ticks[4], sum(ticks)


def busy_share(before: tuple[int, int] | None, after: tuple[int, int] | None) -> float | None:
    """The share of all CPUs' time spent busy between two cpu_jiffies() readings (None without both or time)."""
    if not before or not after or after[1] <= before[1]:
        return None
    return round((after[0] - before[0]) / (after[1] - before[1]), 4)


def _mem_gib() -> float | None:
    try:
        kb = int(next(x for x in Path("/proc/meminfo").read_text().splitlines() if x.startswith("MemTotal")).split()[1])
        return round(kb / 1024**2, 1)
    except (OSError, StopIteration, ValueError):
        return None


def hardware_key(hw: dict[str, Any]) -> str:
    """What makes two records comparable: the accelerator if any, else the CPU model, core count and the CPU flags
    that matter (records from before flags were recorded keep their old key)."""
    if hw.get("gpu"):
        return f"{hw['gpu']['name']} x{hw['gpu'].get('count', 1)}"
    flags = f", {' '.join(hw['cpu_flags'])}" if hw.get("cpu_flags") else ""
    return f"{hw['cpu']} ({hw['cores']} cores{flags})"


# CPU flags under which BF16 has native kernels (AVX512-BF16 dot products, AMX tiles); without them vLLM's CPU backend
# converts BF16 in software. Measured on CPUs without them (smollm2-bf16 vs smollm2-fp32, one ladder per machine, c=1 /
# c=8 tok/s): Intel Xeon AVX-512 + VNNI, ladder smollm2-20261123-053820: BF16 19.9 / 44.1, FP32 15.6 / 69.9; AMD EPYC
# AVX2, ladder smollm2-20261123-002347: BF16 16.4 / 22.5, FP32 16.2 / 63.5. FP32 wins at c=8 (1.6x, 2.8x) and loses
# or ties at c=1. BF16 stays the default: it is the dtype the parity and identity references are defined in.
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")


def native_bf16(cpu_flags: list[str]) -> bool:
    return any(f in cpu_flags for f in NATIVE_BF16_FLAGS)


def training_dtype(device: str = "cpu") -> str:
    """The dtype to train in (a LoRA adapter, a draft head): BF16 on CUDA and on a CPU with native BF16 kernels, FP32
    elsewhere. On a two-core AVX2 EPYC one LoRA step of SmolLM2 (2 x 64 tokens) took 2.5 s forward and 25 s backward
    under BF16 autocast, 0.4 s and 0.4 s in FP32."""
    if device == "cuda" or native_bf16(cpu_model_and_flags()[1]):
        return "bfloat16"
    return "float32"


def cpu_dtype_note(dtype: str, cpu_flags: list[str]) -> str | None:
    """A line for `make serve` where BF16 runs without native kernels on this CPU; None where it has them."""
    if dtype != "bfloat16" or native_bf16(cpu_flags):
        return None
    return ("note: this CPU has no native BF16 (no avx512_bf16 / amx_bf16): measured on two such CPUs, FP32 served "
            "1.6-2.8x more tok/s at c=8 and BF16 up to 1.3x more at c=1 (results/peers-cpu-20261123); for throughput "
            "serve the FP32 variant or pass --set SERVE_DTYPE=float32")


# NVIDIA A10G datasheet memory bandwidth (GDDR6, 24 GB): the target of the labelled projections (measure.profile,
# report.projection) of the reference project's GPU
A10G_GBS = 600.0
