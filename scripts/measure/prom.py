"""Read vLLM's Prometheus /metrics (or another page of Prometheus text): KV capacity, KV usage, preemptions,
prefix-cache and speculative counters, and the mean time of each request phase."""

from __future__ import annotations

from scripts.common.server import http_get

Samples = dict[str, float]

# vLLM's per-request phase histograms (vllm/v1/metrics/stats.py): time to first token from the request's arrival (taken
# before tokenizing) to the front end's receipt of its first output; queue = scheduled - queued and prefill = first token
# - scheduled, both the engine core's timestamps; decode = last token - first token. A client's TTFT less the server's is
# the HTTP request's parsing before arrival, then detokenizing, streaming and the network. TTFT is observed at the first
# token, the others when a request finishes: their counts (phase_requests) say which requests each mean covers.
PHASES = {"ttft": "vllm:time_to_first_token_seconds", "queue": "vllm:request_queue_time_seconds",
          "prefill": "vllm:request_prefill_time_seconds", "decode": "vllm:request_decode_time_seconds"}


def parse(text: str) -> tuple[Samples, dict[str, dict[str, str]]]:
    """Sum every sample of a metric over its labels; keep the labels of *_info gauges (e.g. cache_config_info)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: Samples = {}
    infos: dict[str, dict[str, str]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            values[s.name] = values.get(s.name, 0.0) + float(s.value)
            if "position" in s.labels:  # per-position series (speculative acceptance) are also kept apart
                key = f"{s.name}[{s.labels['position']}]"
                values[key] = values.get(key, 0.0) + float(s.value)
            if s.name.endswith("_info"):
                infos[s.name] = dict(s.labels)
    return values, infos


def scrape(base_url: str, path: str = "/metrics") -> tuple[Samples, dict[str, dict[str, str]]] | None:
    """The server's Prometheus text at `path`, parsed; None where it does not answer 200."""
    try:
        status, body = http_get(f"{base_url}{path}", timeout=10)
    except OSError:
        return None
    return parse(body.decode()) if status == 200 else None


def _delta(before: Samples, after: Samples, name: str) -> float | None:
    if name not in after:
        return None
    return after[name] - before.get(name, 0.0)


def phase_means_ms(before: Samples, after: Samples) -> tuple[dict[str, float | None], dict[str, float | None]]:
    """Mean ms of each request phase (PHASES) between two scrapes, from its histogram's sum and count deltas (None where
    no request passed the phase in between or the server keeps no such histogram), and those counts."""
    means: dict[str, float | None] = {}
    counts: dict[str, float | None] = {}
    for key, name in PHASES.items():
        n, total = _delta(before, after, f"{name}_count"), _delta(before, after, f"{name}_sum")
        means[key] = round(1000.0 * total / n, 3) if n and total is not None else None
        counts[key] = n
    return means, counts


def server_counters(before, after) -> dict:
    """What the server says about a run: counter deltas between two scrapes plus KV capacity."""
    if before is None or after is None:
        return {"available": False}
    (b, _), (a, infos) = before, after
    cache = infos.get("vllm:cache_config_info", {})
    blocks = cache.get("num_gpu_blocks")
    block_size = cache.get("block_size")
    out = {
        "available": True,
        "kv_cache_blocks": int(blocks) if blocks not in (None, "None") else None,
        "kv_block_size": int(block_size) if block_size not in (None, "None") else None,
        "kv_cache_usage_perc_end": a.get("vllm:kv_cache_usage_perc"),
        "preemptions": _delta(b, a, "vllm:num_preemptions_total"),
        "prefix_cache_queries": _delta(b, a, "vllm:prefix_cache_queries_total"),
        "prefix_cache_hits": _delta(b, a, "vllm:prefix_cache_hits_total"),
        "prompt_tokens": _delta(b, a, "vllm:prompt_tokens_total"),
        "generation_tokens": _delta(b, a, "vllm:generation_tokens_total"),
        "spec_decode_drafts": _delta(b, a, "vllm:spec_decode_num_drafts_total"),
        "spec_decode_draft_tokens": _delta(b, a, "vllm:spec_decode_num_draft_tokens_total"),
        "spec_decode_accepted_tokens": _delta(b, a, "vllm:spec_decode_num_accepted_tokens_total"),
    }
    out["phase_ms"], out["phase_requests"] = phase_means_ms(b, a)
    out["kv_cache_tokens"] = (out["kv_cache_blocks"] * out["kv_block_size"]
                              if out["kv_cache_blocks"] and out["kv_block_size"] else None)
    q, h = out["prefix_cache_queries"], out["prefix_cache_hits"]
    out["prefix_cache_hit_rate"] = h / q if q else None
    drafts, dtoks, acc = out["spec_decode_drafts"], out["spec_decode_draft_tokens"], out["spec_decode_accepted_tokens"]
    out["spec_decode_acceptance_rate"] = acc / dtoks if dtoks else None
    out["spec_decode_mean_acceptance_length"] = 1 + acc / drafts if drafts else None
    # acceptance rate of draft position i = accepted at i / drafts (vLLM counts a position only after all before it)
    per_pos, i = [], 0
    while (d := _delta(b, a, f"vllm:spec_decode_num_accepted_tokens_per_pos_total[{i}]")) is not None:
        per_pos.append(d / drafts if drafts else None)
        i += 1
    out["spec_decode_acceptance_per_position"] = per_pos or None
    return out
