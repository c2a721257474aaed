"""Interpreter start-up hook, active only for processes started with scripts/ on PYTHONPATH (scripts.serve adds it
for an imported compile cache that needs the device-name shim): applies scripts/_cache_patch.py in every process,
vLLM's spawned engine and workers included."""

import os

if os.environ.get("LAB_CACHE_SHIM_NAME"):
    import _cache_patch

    _cache_patch.install()
