"""vLLM plugin: log the linear kernel vLLM chose for each layer family of a quantized checkpoint, once per family.

    LAB_KERNEL_LOG=1 vllm serve …        # (`scripts.serve` passes ENV_LAB_KERNEL_LOG=1 from a variant's config.env)
    kernels_by_family(Path("server.log").read_text())   # {"linear_attn.in_proj_ba": ["MarlinLinearKernel"], …}

vLLM 0.26 logs its choice once per kernel class and scheme ("Using MacheteLinearKernel for CompressedTensorsWNA16"),
never per layer: a checkpoint whose layers land on two kernels does not say which layers got which. Registered
through the `vllm.general_plugins` entry point (pyproject.toml) and active only with LAB_KERNEL_LOG=1, this wraps
`create_weights` of every compressed-tensors scheme class; after each call it finds the kernel object the scheme
built (an attribute whose class name ends in "Kernel") and prints `lab-kernel: <family> <Kernel> <Scheme>` the
first time a family meets a kernel. The family is the layer's prefix without its layer index
(`language_model.model.layers.3.linear_attn.in_proj_ba` -> `linear_attn.in_proj_ba`). Nothing is changed in what
vLLM computes.
"""

from __future__ import annotations

import functools
import os
import re
import sys

from scripts.common.checkpoint import layer_family

LINE = re.compile(r"lab-kernel: (\S+) (\S+) (\S+)")
ENV = "LAB_KERNEL_LOG"


def kernel_of(scheme) -> str | None:
    """The class name of the kernel object a scheme built (None where it keeps none, e.g. an unquantized layer)."""
    for value in vars(scheme).values():
        name = type(value).__name__
        if name.endswith("Kernel") and not isinstance(value, type):
            return name
    return None


def instrument(classes, emit=None) -> int:
    """Wrap create_weights of each class (once); emit(line) gets one line per (family, kernel). Returns how many
    classes were wrapped."""
    emit = emit or (lambda line: print(line, file=sys.stderr, flush=True))
    seen: set[tuple[str, str]] = set()
    n = 0
    for cls in classes:
        original = cls.__dict__.get("create_weights")
        if original is None or getattr(original, "_lab_kernel_log", False):
            continue

        @functools.wraps(original)
        def create_weights(self, layer, *args, _original=original, **kwargs):
            out = _original(self, layer, *args, **kwargs)
            kernel = kernel_of(self)
            prefix = getattr(self, "layer_name", None) or getattr(layer, "prefix", None) or "?"
            if kernel and (fam := layer_family(prefix), kernel) not in seen:
                seen.add((fam, kernel))
                emit(f"lab-kernel: {fam} {kernel} {type(self).__name__}")
            return out

        create_weights._lab_kernel_log = True
        cls.create_weights = create_weights
        n += 1
    return n


def subclasses(cls) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *subclasses(sub)]
    return out


def register() -> None:
    """vLLM general-plugin hook: wrap every compressed-tensors scheme when LAB_KERNEL_LOG=1."""
    if os.environ.get(ENV) != "1":
        return
    # vLLM 0.26 calls general plugins unguarded: whatever fails here is logged and the server runs unchanged
    try:
        from vllm.model_executor.layers.quantization.compressed_tensors.schemes import CompressedTensorsScheme

        instrument(subclasses(CompressedTensorsScheme))
    except Exception as e:  # noqa: BLE001 - e.g. another vLLM layout
        print(f"lab-kernel: plugin inactive ({type(e).__name__}: {e})", file=sys.stderr, flush=True)


def kernels_by_family(log_text: str) -> dict[str, list[str]]:
    """{family: sorted kernels} from the plugin's lines in a server log (empty where it wrote none)."""
    out: dict[str, set[str]] = {}
    for fam, kernel, _scheme in LINE.findall(log_text):
        out.setdefault(fam, set()).add(kernel)
    return {f: sorted(k) for f, k in sorted(out.items())}
