"""The config.env keys make optimize's candidate templates share, on a CPU (plan.py) and on a GPU (gpu.py)."""

from __future__ import annotations

# The project's tolerances for a lossy variant (the hand-built variants' config.env files set the same)
LOSSY_GATE = {"GATE_MAX_MEAN_KLD": "0.05", "GATE_MIN_TOP1": "0.90", "GATE_MAX_PPL_RATIO": "1.05",
              "GATE_MAX_SUITE_DROP": "1.0"}
# lossless: greedy token ids equal to the reference's, near-ties teacher-forced
IDENTITY = {"GATE_GREEDY_IDENTITY": "1"}
# vLLM's n-gram speculation: up to 4 tokens drafted from a 2-4 token match in the context
NGRAM_SPEC = {"SERVE_SPECULATIVE_CONFIG": '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, '
                                          '"prompt_lookup_max": 4}'}
