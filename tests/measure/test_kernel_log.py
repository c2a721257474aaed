"""The kernel_log plugin: one line per (layer family, kernel), parsed back per family; inactive without its switch."""

from __future__ import annotations

import pytest

from scripts.measure import kernel_log as kl


class MarlinLinearKernel:
    pass


class MacheteLinearKernel:
    pass


class FakeWNA16:
    """A scheme as vLLM 0.26 builds it: create_weights(layer=…, …) picks a kernel by the layer's output width."""

    def __init__(self, layer_name):
        self.layer_name = layer_name

    def create_weights(self, layer, output_size, **kwargs):
        self.kernel = MacheteLinearKernel() if output_size % 128 == 0 else MarlinLinearKernel()
        return "made"


class Layer:
    pass


def test_one_line_per_family_and_kernel_parsed_back():
    lines = []
    assert kl.instrument([FakeWNA16], lines.append) == 1
    assert kl.instrument([FakeWNA16], lines.append) == 0  # never wrapped twice
    for i in range(3):
        for name, n in (("linear_attn.in_proj_qkvz", 12288), ("linear_attn.in_proj_ba", 64), ("mlp.down_proj", 2560)):
            assert FakeWNA16(f"language_model.model.layers.{i}.{name}").create_weights(layer=Layer(), output_size=n,
                                                                                       input_size=2560) == "made"
    assert len(lines) == 3
    log = "INFO … Using MacheteLinearKernel for CompressedTensorsWNA16\n" + "\n".join(lines)
    assert kl.kernels_by_family(log) == {"linear_attn.in_proj_ba": ["MarlinLinearKernel"],
                                         "linear_attn.in_proj_qkvz": ["MacheteLinearKernel"],
                                         "mlp.down_proj": ["MacheteLinearKernel"]}
    assert kl.kernels_by_family("no plugin lines") == {}


@pytest.mark.slow  # imports vLLM (~70 s on two cores)
def test_register_wraps_vllms_schemes_only_with_its_switch(monkeypatch):
    schemes = pytest.importorskip("vllm.model_executor.layers.quantization.compressed_tensors.schemes")
    wna16 = schemes.CompressedTensorsWNA16
    monkeypatch.delenv(kl.ENV, raising=False)
    kl.register()
    assert not getattr(wna16.__dict__["create_weights"], "_lab_kernel_log", False)
    monkeypatch.setenv(kl.ENV, "1")
    original = wna16.__dict__["create_weights"]
    monkeypatch.setattr(wna16, "create_weights", original)  # restored after the test
    kl.register()
    assert wna16.__dict__["create_weights"]._lab_kernel_log
