"""The lab's vLLM W4A16 kernel class and its plugin, on a CPU: the plugin's registration, the class's refusals, the
dequantization and the load check it runs per layer (the check's comparison on a faked wrong kernel; the stream form
itself run by Triton's interpreter in its own process). Its speed and its serving are the GPU's (gemm_bench's
lab-stream-vllm row, the qwen35-27b-dummy-w4a16-stream variant)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest

from scripts.common import paths

pytest.importorskip("vllm")
torch = pytest.importorskip("torch")


def config(**kw):
    """vLLM's config of a compressed-tensors W4A16 g128 layer (K = 5120, N = 6144), with `kw` changed."""
    from scripts.measure.gemm_bench import mp_config

    return dataclasses.replace(mp_config(6144, 5120), **kw)


def test_the_plugin_puts_the_class_first_only_when_asked(monkeypatch):
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    from scripts.levers.kernels import plugin

    before = list(linear._POSSIBLE_KERNELS.get(PlatformEnum.CUDA, []))
    monkeypatch.setitem(linear._POSSIBLE_KERNELS, PlatformEnum.CUDA, list(before))
    monkeypatch.delenv(plugin.ENV, raising=False)
    plugin.register()
    assert linear._POSSIBLE_KERNELS[PlatformEnum.CUDA] == before
    monkeypatch.setenv(plugin.ENV, "stream")
    plugin.register()
    plugin.register()  # once, however often vLLM calls it
    got = linear._POSSIBLE_KERNELS[PlatformEnum.CUDA]
    assert got[0].__name__ == "LabStreamLinearKernel" and got[1:] == before
    monkeypatch.setenv(plugin.ENV, "fast")
    with pytest.raises(ValueError, match="LAB_W4A16_KERNEL=fast: the lab's W4A16 kernels are stream"):
        plugin.register()


def test_the_class_refuses_what_the_stream_form_does_not_read(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.scalar_type import scalar_types

    from scripts.levers.kernels.vllm_kernel import LabStreamLinearKernel as K

    assert K.get_min_capability() == 80
    assert K.can_implement(config(group_size=64)) == (False, "group size 64: the stream form reads groups of 128")
    assert "zero points" in K.can_implement(config(zero_points=True))[1]
    assert "uint4b8" in K.can_implement(config(weight_type=scalar_types.uint8b128))[1]
    assert "activations torch.float16" in K.can_implement(config(act_type=torch.float16))[1]
    assert "not whole groups" in K.can_implement(config(partition_weight_shape=(5000, 6144)))[1]
    monkeypatch.setattr(current_platform, "is_cuda", lambda: False, raising=False)
    ok, why = K.can_implement(config())  # what it reads: then Marlin's verdict (not CUDA: refused by Marlin)
    assert not ok and "Marlin" in why


def test_dequantize_matches_the_benchs_weights():
    from scripts.levers.kernels.w4a16_gemv import dequantize
    from scripts.measure.gemm_bench import Weights, pack_compressed_tensors

    w = Weights(40, 512, [40], seed=3, device="cpu")
    x = torch.randn((2, 512), generator=torch.Generator().manual_seed(1))
    got = x @ dequantize(pack_compressed_tensors(w.q), w.s).T
    assert torch.allclose(got, w.reference(x.to(torch.bfloat16)), rtol=1e-2, atol=1e-2)


def test_the_load_check_names_the_layer_when_the_kernel_is_wrong(monkeypatch):
    from scripts.levers.kernels import w4a16_gemv as gemv
    from scripts.measure.gemm_bench import Weights, pack_compressed_tensors

    w = Weights(200, 512, [200], seed=5, device="cpu")
    wq = pack_compressed_tensors(w.q)
    right = lambda x, q, s, form: (x.float() @ gemv.dequantize(q, s).T).to(x.dtype)  # noqa: E731
    monkeypatch.setattr(gemv, "w4a16_gemv", right)
    assert gemv.check_stream("model.layers.3.mlp.down_proj", wq, w.s) < 1e-2
    monkeypatch.setattr(gemv, "w4a16_gemv", lambda x, q, s, form: right(x, q, s, form) * 1.05)
    want = (r"model.layers.3.mlp.down_proj \(N=200, K=512\): the stream form differs from the dequantized product by "
            r"0.0\d+ > 0.02; the lab's kernel is not used for it")
    with pytest.raises(gemv.GemvError, match=want):
        gemv.check_stream("model.layers.3.mlp.down_proj", wq, w.s)


RUN = """
import json
from scripts.levers.kernels.w4a16_gemv import check_stream
from scripts.measure.gemm_bench import Weights, pack_compressed_tensors
w = Weights(130, 256, [130], seed=5, device="cpu")  # both ends of 64 rows, two groups
print(json.dumps(check_stream("layer", pack_compressed_tensors(w.q), w.s)))
"""


def test_the_load_check_passes_the_stream_form():
    """The check itself on the interpreted stream form: its error on the first and last 64 rows of a layer."""
    pytest.importorskip("triton")
    p = subprocess.run([sys.executable, "-c", RUN], cwd=paths.ROOT, env={**os.environ, "TRITON_INTERPRET": "1"},
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout.strip().splitlines()[-1]) < 8e-3
