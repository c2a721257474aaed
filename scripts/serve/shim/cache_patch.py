"""Device-name shim: a compile cache baked on one GPU model is hit on another model of the same architecture.

Inductor's FX-graph cache (and through it vLLM's compile-cache hash) keys on `torch.cuda.get_device_properties().name`
(torch._inductor.codecache.CacheBase.get_system); Triton keys on the architecture only. When LAB_CACHE_SHIM_NAME and
LAB_CACHE_SHIM_ARCH are set (scripts.serve does it for an imported cache whose manifest differs from this machine only
by the GPU's name, with LAB_CACHE_SHIM=1), `install()` wraps get_device_properties so that, on a GPU of the baked
architecture, the properties report the baked name; every other attribute is the real one. On another architecture it
changes nothing and says so once: kernels built for one architecture must not run on another.

scripts/serve/shim/sitecustomize.py calls install() at interpreter start, so vLLM's engine and worker subprocesses (spawned, with
PYTHONPATH=scripts/) get the same shim. Nothing happens unless the variables are set.
"""

from __future__ import annotations

import os
import sys

NAME_VAR, ARCH_VAR = "LAB_CACHE_SHIM_NAME", "LAB_CACHE_SHIM_ARCH"


def decide(baked_name: str, baked_arch: str, actual_name: str, actual_arch: str) -> str:
    """The name the caches should see: the baked one on the same architecture, else the real one."""
    if actual_arch != baked_arch:
        return actual_name
    return baked_name


class _Props:
    """Real device properties with another name."""

    def __init__(self, real, name: str):
        self._real, self.name = real, name

    def __getattr__(self, attr):
        return getattr(self._real, attr)

    def __repr__(self):
        return f"_CudaDeviceProperties(name='{self.name}', shimmed from '{self._real.name}')"


def wrap(get_props, baked_name: str, baked_arch: str, warn=None):
    """get_device_properties reporting `baked_name` wherever the architecture matches."""
    warned = []

    def shimmed(*args, **kwargs):
        real = get_props(*args, **kwargs)
        arch = f"sm_{real.major}{real.minor}"
        name = decide(baked_name, baked_arch, real.name, arch)
        if name == real.name:
            if arch != baked_arch and not warned:
                warned.append(1)
                (warn or (lambda m: print(m, file=sys.stderr)))(
                    f"cache shim: this GPU is {arch}, the cache was baked for {baked_arch}: not shimmed")
            return real
        return _Props(real, name)

    shimmed.__wrapped__ = get_props
    return shimmed


def install() -> bool:
    name, arch = os.environ.get(NAME_VAR), os.environ.get(ARCH_VAR)
    if not (name and arch):
        return False
    import torch.cuda

    if not hasattr(torch.cuda.get_device_properties, "__wrapped__"):
        torch.cuda.get_device_properties = wrap(torch.cuda.get_device_properties, name, arch)
    return True
