"""Interpreter start-up hook, active only for processes started with scripts/serve/shim/ on PYTHONPATH (scripts.serve adds it
for an imported compile cache that needs the device-name shim): applies scripts/serve/shim/cache_patch.py in every process,
vLLM's spawned engine and workers included."""

import os

if os.environ.get("LAB_CACHE_SHIM_NAME"):
    import cache_patch

    cache_patch.install()
