"""Fixtures of the serving tests that several modules share."""

from __future__ import annotations

import pytest

from scripts.common import paths
from scripts.common.variants import load_variant


@pytest.fixture(scope="module")
def bf16_export(embedded_weights, tmp_path_factory):
    """smollm2-bf16 exported to BF16 GGUF (weights/smollm2-gguf-bf16; kept when present): llama-server's file."""
    from scripts.levers.gguf.export import export

    v = load_variant("smollm2-gguf-bf16")
    if not (paths.ROOT / v.resolved["MODEL"]).exists():
        export("smollm2-gguf-bf16", record_dir=tmp_path_factory.mktemp("export"))
    return v
