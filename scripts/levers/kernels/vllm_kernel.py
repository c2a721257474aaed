"""The lab's W4A16 GEMV serving in vLLM: LabStreamLinearKernel, a mixed-precision linear kernel class that runs the
stream form (w4a16_gemv.py) on decode steps of one token and Marlin on everything larger.

    ENV_LAB_W4A16_KERNEL=stream        # in a variant's config.env (without SERVE_LINEAR_BACKEND: vLLM's
                                       # --linear-backend keeps only its own classes)

The lab's vLLM plugin (plugin.py, entry point `lab_w4a16`) puts this class first in vLLM's CUDA list of W4A16 kernels
when LAB_W4A16_KERNEL=stream is in the server's environment; vLLM's own choice (choose_mp_linear_kernel) then takes it
for every compressed-tensors W4A16 layer it can implement (uint4b8, group 128, no zero points or act-order, BF16
activations, sm_80+, and what Marlin takes), and logs "Using LabStreamLinearKernel for CompressedTensorsWNA16".

Per layer at load (process_weights_after_loading):
- the checkpoint's tensors (weight_packed N x K/8, weight_scale N x K/128) are kept as the stream form reads them;
- the stream form's tile is tuned for M = 1 (once per N, K), before vLLM captures CUDA graphs; the tuning's weight
  copies (4x the L2 cache, at least two of the layer) are freed before the next layer loads;
- the stream form's output for a random input is checked against the float32 product of the dequantized weights on
  the layer's first and last 64 rows (w4a16_gemv.check_stream): above 0.02 the load fails with one line naming the
  layer and the error;
- Marlin repacks its own copy of the weights (vLLM's MarlinLinearKernel, unchanged): the 4-bit weights are held
  twice (the Qwen3.5-27B shape's gptq-w4a16-gdn checkpoint: 29.03 GiB at load against Marlin's 16.84 GiB,
  results/gpu-27b-20261207/).

At run time one custom op (`lab::w4a16_stream_or_marlin`, opaque to torch.compile, so the batch size is read when it
runs, not when vLLM traces the model) calls the stream form for one input row and Marlin for more. A batch re-reads
the weights in the stream form (results/gpu-kernels-20261207b/: 12 % of the copy bandwidth at M = 8, Marlin 50 %), so
STREAM_ROWS is 1.
"""

from __future__ import annotations

import torch
from vllm.model_executor.kernels.linear.mixed_precision.marlin import MarlinLinearKernel
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel, MPLinearLayerConfig
from vllm.model_executor.layers.quantization.utils.marlin_utils import apply_gptq_marlin_linear
from vllm.scalar_type import scalar_types

from scripts.levers.kernels import w4a16_gemv as gemv

STREAM_ROWS = 1  # input rows the stream form takes (w4a16_gemv's MAX_M is what it could take); more go to Marlin


@torch.library.custom_op("lab::w4a16_stream_or_marlin", mutates_args=())
def stream_or_marlin(x: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor, m_q: torch.Tensor, m_s: torch.Tensor,
                     m_zp: torch.Tensor, g_idx: torch.Tensor, g_perm: torch.Tensor, workspace: torch.Tensor, n: int,
                     k: int, is_k_full: bool) -> torch.Tensor:
    """y = x @ W^T for x (M x K, BF16): the stream form on the checkpoint's tensors (w_q, w_s) for 1 <= M <=
    STREAM_ROWS (shapes checked once, at load: no per-call checks), else Marlin on its repacked copy (m_*)."""
    if 1 <= x.shape[0] <= STREAM_ROWS:
        return gemv.stream_gemv(x.contiguous(), w_q, w_s)
    return apply_gptq_marlin_linear(input=x, weight=m_q, weight_scale=m_s, weight_zp=m_zp, g_idx=g_idx,
                                    g_idx_sort_indices=g_perm, workspace=workspace, wtype=scalar_types.uint4b8,
                                    input_size_per_partition=k, output_size_per_partition=n, is_k_full=is_k_full,
                                    input_global_scale=None, bias=None, input_dtype=torch.bfloat16)


@stream_or_marlin.register_fake
def _(x, w_q, w_s, m_q, m_s, m_zp, g_idx, g_perm, workspace, n, k, is_k_full):
    return x.new_empty((x.shape[0], n))


class LabStreamLinearKernel(MPLinearKernel):
    """The stream form at M = 1 and Marlin above it, on compressed-tensors W4A16 g128 symmetric layers."""

    @classmethod
    def get_min_capability(cls) -> int:
        return 80  # bf16x2 PTX

    @classmethod
    def can_implement(cls, c: MPLinearLayerConfig) -> tuple[bool, str | None]:
        k, n = c.partition_weight_shape
        if c.weight_type != scalar_types.uint4b8:
            return False, f"weight type {c.weight_type}: the stream form reads uint4b8 (symmetric 4-bit) only"
        if c.group_size != gemv.GROUP:
            return False, f"group size {c.group_size}: the stream form reads groups of {gemv.GROUP}"
        if c.zero_points or getattr(c, "has_g_idx", False):  # the lab's CPU vLLM build (0.32) has no such field
            return False, "zero points or act-order: the stream form reads symmetric weights in order"
        if c.act_type != torch.bfloat16:
            return False, f"activations {c.act_type}: the stream form's PTX multiplies BF16 pairs"
        if k % gemv.GROUP:
            return False, f"K={k} per partition is not whole groups of {gemv.GROUP}"
        return MarlinLinearKernel.can_implement(c)  # batches go to Marlin

    def __init__(self, c: MPLinearLayerConfig, w_q_param_name: str, w_s_param_name: str,
                 w_zp_param_name: str | None = None, w_gidx_param_name: str | None = None) -> None:
        super().__init__(c, w_q_param_name, w_s_param_name, w_zp_param_name, w_gidx_param_name)
        self.marlin = MarlinLinearKernel(c, w_q_param_name, w_s_param_name, w_zp_param_name, w_gidx_param_name)

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        k, n = self.config.partition_weight_shape
        w_q, w_s = getattr(layer, self.w_q_name), getattr(layer, self.w_s_name)
        name = getattr(layer, "prefix", "") or "a W4A16 layer"
        if tuple(w_q.shape) != (n, k // 8) or tuple(w_s.shape) != (n, k // gemv.GROUP):
            raise gemv.GemvError(f"{name}: weight_packed {tuple(w_q.shape)} / weight_scale "
                                 f"{tuple(w_s.shape)}, expected the checkpoint's ({n}, {k // 8}) / ({n}, "
                                 f"{k // gemv.GROUP})")
        layer.lab_w_q = w_q.data.contiguous().clone()
        layer.lab_w_s = w_s.data.to(torch.bfloat16).contiguous().clone()
        bias = getattr(layer, "bias", None)
        layer.lab_bias = None if bias is None else bias.data.clone()  # Marlin permutes its own
        if gemv.stream_tile(1, n, k) is None:  # once per (N, K), before vLLM captures its graphs
            gemv.tune_stream(1, layer.lab_w_q, layer.lab_w_s)
        gemv.check_stream(name, layer.lab_w_q, layer.lab_w_s)
        self.marlin.process_weights_after_loading(layer)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        k, n = self.config.partition_weight_shape
        m_q, m_s, m_zp, g_idx = self.marlin._get_weight_params(layer)
        y = torch.ops.lab.w4a16_stream_or_marlin(x.reshape(-1, k), layer.lab_w_q, layer.lab_w_s, m_q, m_s, m_zp, g_idx,
                                                 layer.g_idx_sort_indices, self.marlin.workspace, n, k,
                                                 self.marlin.is_k_full)
        if bias is not None:
            y = y + layer.lab_bias
        return y.reshape(*x.shape[:-1], n)
