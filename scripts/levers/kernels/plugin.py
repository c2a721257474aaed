"""vLLM plugin (entry point `lab_w4a16`): with LAB_W4A16_KERNEL=stream in the server's environment, the lab's W4A16
kernel class (vllm_kernel.LabStreamLinearKernel) goes first in vLLM's CUDA list of mixed-precision linear kernels, so
vLLM's own choice takes it wherever it can implement a layer. Without the variable nothing is imported or changed.

    ENV_LAB_W4A16_KERNEL=stream     # a variant's config.env (scripts.serve passes ENV_ keys to the server)
"""

from __future__ import annotations

import os

ENV = "LAB_W4A16_KERNEL"
KERNELS = {"stream": "LabStreamLinearKernel"}  # the variable's values: the class each puts first


def register() -> None:
    """vLLM calls this in every process it starts; it puts the chosen class first in the CUDA list (once)."""
    choice = os.environ.get(ENV, "")
    if not choice:
        return
    if choice not in KERNELS:
        raise ValueError(f"{ENV}={choice}: the lab's W4A16 kernels are {', '.join(KERNELS)}")
    from vllm.model_executor.kernels import linear
    from vllm.platforms import PlatformEnum

    from scripts.levers.kernels import vllm_kernel

    cls = getattr(vllm_kernel, KERNELS[choice])
    kernels = linear._POSSIBLE_KERNELS.setdefault(PlatformEnum.CUDA, [])
    if cls not in kernels:
        kernels.insert(0, cls)
