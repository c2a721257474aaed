"""The GPU clock sampler's pure parts (scripts/measure/gpu_clocks.py): NVML's reads are faked, as a GPU's query."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from scripts.measure import gpu_clocks
from scripts.measure.latency import clock_line


def test_reason_masks_are_named():
    assert gpu_clocks.reason_names(0x1 | 0x4) == ["gpu_idle", "sw_power_cap"]
    assert gpu_clocks.reason_names(0x20 | 0x1000) == ["sw_thermal_slowdown", "0x1000"]
    assert gpu_clocks.reason_names(0) == []


def test_a_level_is_summarised_per_gpu_with_the_reasons_shares():
    """Two GPUs read four times: one held by its power cap half the time, one idle once; SM clocks min / p50 / max."""
    reads = iter([((1980, 2619, 650.0, 60, 0), (345, 2619, 70.0, 40, 0x1)),
                  ((1755, 2619, 699.0, 62, 0x4), (345, 2619, 70.0, 40, 0)),
                  ((1980, 2619, 640.0, 61, 0), (345, 2619, 70.0, 41, 0)),
                  ((1710, 2619, 700.0, 63, 0x4), (345, 2619, 70.0, 41, 0))])
    done = []

    def read():
        try:
            return next(reads)
        except StopIteration:
            done.append(1)
            raise RuntimeError("no more reads") from None

    s = gpu_clocks.Sampler(read, interval_s=0.001)
    while not done:
        time.sleep(0.001)
    first, second = s.stop()
    assert first["samples"] == 4 and first["sm_mhz"] == {"min": 1710, "p50": 1867.5, "max": 1980}
    assert first["reasons"] == {"sw_power_cap": 0.5} and first["power_w"] == {"p50": 674.5, "max": 700.0}
    assert second["reasons"] == {"gpu_idle": 0.25} and second["temperature_c_max"] == 41
    assert first["error"] == "RuntimeError: no more reads"  # a read that fails ends the sampling, the reads kept
    assert clock_line([first, second]) == "  sm MHz p50 1868 (sw_power_cap)  sm MHz p50 345 (gpu_idle)"
    assert clock_line(None) == "" and gpu_clocks.summarize([]) == {"samples": 0}


def test_a_sampler_stops_between_reads():
    s = gpu_clocks.Sampler(lambda: ((1000, 2000, 100.0, 50, 0),), interval_s=0.01)
    out = s.stop()
    assert out[0]["samples"] >= 1 and "error" not in out[0] and not s._thread.is_alive()


@pytest.mark.skipif(Path("/dev/nvidiactl").exists(), reason="a GPU host: NVML answers")
def test_a_host_without_a_gpu_gets_no_sampler():
    assert gpu_clocks.start() is None


def test_a_window_keeps_only_the_last_seconds():
    """stop(last_s): the samples of the level's request window only (vLLM's bench starts its process first)."""
    s = gpu_clocks.Sampler(lambda: ((300, 2000, 70.0, 40, 0x1),), interval_s=0.005)
    time.sleep(0.3)
    s.read = lambda: ((1980, 2619, 650.0, 60, 0),)
    time.sleep(0.1)
    busy, = s.stop(last_s=0.05)
    assert busy["samples"] >= 1 and busy["sm_mhz"]["min"] == 1980 and busy["reasons"] == {}


class FakeNvml:
    """NVML's calls as the binding names them; `event` False: a driver without the clocks-event call."""
    NVML_CLOCK_SM, NVML_CLOCK_MEM, NVML_TEMPERATURE_GPU = 1, 2, 0

    def __init__(self, count: int = 1, event: bool = True):
        self.count, self.event = count, event

    def nvmlDeviceGetCount(self):
        if self.count is None:
            raise PermissionError("Insufficient Permissions")
        return self.count

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetCurrentClocksEventReasons(self, h):
        if not self.event:
            raise RuntimeError("Function Not Found")
        return 0x4

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return 0x20

    def nvmlDeviceGetClockInfo(self, h, kind):
        return 1980 if kind == self.NVML_CLOCK_SM else 2619

    def nvmlDeviceGetPowerUsage(self, h):
        return 650_000

    def nvmlDeviceGetTemperature(self, h, kind):
        return 60


def test_the_reader_falls_back_to_the_throttle_call_and_gives_up_quietly():
    assert gpu_clocks.reader(FakeNvml())() == ((1980, 2619, 650.0, 60, 0x4),)
    assert gpu_clocks.reader(FakeNvml(count=2, event=False))() == ((1980, 2619, 650.0, 60, 0x20),) * 2
    assert gpu_clocks.reader(FakeNvml(count=0)) is None  # no GPU listed
    assert gpu_clocks.reader(FakeNvml(count=None)) is None  # no permission: the bench goes on without clocks


def test_the_summary_is_what_the_latency_schema_takes():
    import json

    import jsonschema

    from scripts.common import paths

    schema = json.loads((paths.ROOT / "schemas" / "latency.schema.json").read_text())
    clocks = schema["$defs"]["level"]["properties"]["gpu_clocks"]
    jsonschema.validate([gpu_clocks.summarize([(1980, 2619, 650.0, 60, 0x4)]), {"samples": 0, "error": "X: y"}], clocks)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"samples": 1, "sm_mhz": {"min": 1}}], clocks)
