"""What the GPU ran at while a latency level ran: its SM and memory clocks, power, temperature and the reasons NVML
gives for clocks below their maximum, sampled every INTERVAL_S on every GPU NVML sees (a server's GPU on the bench's
host). A step time that changes between rounds of one unchanged server is then read beside the clocks of each round.

    sampler = start()          # None where NVML is missing or finds no GPU (a CPU host)
    ... the level's requests ...
    summary["gpu_clocks"] = sampler.stop(last_s)   # one entry a GPU: samples, SM MHz min / p50 / max, reasons' shares
                                                   # (last_s: of the level's request window only)

NVML comes from vLLM's bundled copy (vllm.third_party.pynvml, as vLLM itself reads it) or nvidia-ml-py's `pynvml`.
"""

from __future__ import annotations

import functools
import statistics
import threading
import time

INTERVAL_S = 0.1
# NVML's clocks-event (formerly throttle) reason bits, nvml.h nvmlClocksEventReason*
REASONS = {0x1: "gpu_idle", 0x2: "applications_clocks_setting", 0x4: "sw_power_cap", 0x8: "hw_slowdown",
           0x10: "sync_boost", 0x20: "sw_thermal_slowdown", 0x40: "hw_thermal_slowdown",
           0x80: "hw_power_brake_slowdown", 0x100: "display_clock_setting"}


def reason_names(bits: int) -> list[str]:
    """The named reasons set in an NVML reason mask (unknown bits as hex)."""
    names = [name for bit, name in REASONS.items() if bits & bit]
    rest = bits & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def summarize(samples: list[tuple[float, float, float, float, int]]) -> dict:
    """One GPU's samples (SM MHz, memory MHz, power W, temperature C, reason mask) as the level's figures."""
    if not samples:
        return {"samples": 0}
    sm, mem, power, temp, bits = zip(*samples, strict=True)
    seen: dict[str, int] = {}
    for b in bits:
        for name in reason_names(b):
            seen[name] = seen.get(name, 0) + 1
    return {"samples": len(samples),
            "sm_mhz": {"min": min(sm), "p50": statistics.median(sm), "max": max(sm)},
            "mem_mhz_p50": statistics.median(mem),
            "power_w": {"p50": round(statistics.median(power), 1), "max": round(max(power), 1)},
            "temperature_c_max": max(temp),
            "reasons": {name: round(n / len(samples), 3) for name, n in sorted(seen.items())}}


class Sampler:
    """Calls `read` (one tuple of reads a GPU) every `interval_s` on a thread until stop(), which returns one summary
    a GPU. A read that fails ends the sampling; what was read is kept."""

    def __init__(self, read, interval_s: float = INTERVAL_S) -> None:
        self.read, self.interval_s = read, interval_s
        self.samples: list[tuple[float, tuple]] = []  # (monotonic time, the GPUs' reads)
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            try:
                self.samples.append((time.monotonic(), self.read()))
            except Exception as e:  # noqa: BLE001 (NVML errors are its own exception class)
                self.error = f"{type(e).__name__}: {e}"
                return
            if self._stop.wait(self.interval_s):
                return

    def stop(self, last_s: float | None = None) -> list[dict]:
        """One summary a GPU; `last_s`: of the samples of the last last_s seconds only (a level whose requests took
        that long at the end of a longer call: vLLM's bench starts a process and checks the server first)."""
        self._stop.set()
        self._thread.join(timeout=5)
        end = time.monotonic()
        reads = [r for t, r in list(self.samples) if last_s is None or t >= end - last_s]
        gpus = min(map(len, reads)) if reads else 0
        out = [summarize([r[i] for r in reads]) for i in range(gpus)]
        if self.error:
            out = [{**g, "error": self.error} for g in out] or [{"samples": 0, "error": self.error}]
        return out


def nvml():
    """NVML's Python binding, initialised, or None where none imports or no driver answers."""
    try:
        from vllm.third_party import pynvml
    except ImportError:
        try:
            import pynvml
        except ImportError:
            return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 (no driver: a CPU host)
        return None
    return pynvml


def reader(nv):
    """A read of every GPU NVML sees: (SM MHz, memory MHz, power W, temperature C, reason mask) each; None where NVML
    lists no GPU or cannot read the first one (its reasons from the clocks-event call, else the older throttle one)."""
    try:
        handles = [nv.nvmlDeviceGetHandleByIndex(i) for i in range(nv.nvmlDeviceGetCount())]
        if not handles:
            return None
        reasons = nv.nvmlDeviceGetCurrentClocksEventReasons
        try:
            reasons(handles[0])
        except Exception:  # noqa: BLE001 (a driver without the clocks-event call)
            reasons = nv.nvmlDeviceGetCurrentClocksThrottleReasons

        def read() -> tuple:
            return tuple((nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM), nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_MEM),
                          nv.nvmlDeviceGetPowerUsage(h) / 1000, nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU),
                          int(reasons(h))) for h in handles)
        read()
        return read
    except Exception:  # noqa: BLE001 (no permission, a lost GPU: the bench goes on without clocks)
        return None


@functools.cache
def host_reader():
    """This host's reader (`reader`), set up once a process: NVML initialised and its GPUs listed once, not per level."""
    return None if (nv := nvml()) is None else reader(nv)


def start() -> Sampler | None:
    """A sampler of every GPU of this host, or None where NVML is missing, sees no GPU or cannot read one."""
    return None if (read := host_reader()) is None else Sampler(read)
