"""Prometheus text exposition of the engine's counters and gauges (no client library needed)."""

from __future__ import annotations

__all__ = ["render_metrics"]

# stats key -> (metric name, type, help)
_METRICS = {
    "num_running": ("asyncrl_requests_running", "gauge", "Requests in the running batch"),
    "num_waiting": ("asyncrl_requests_waiting", "gauge", "Requests waiting for admission"),
    "kv_blocks_used": ("asyncrl_kv_blocks_used", "gauge", "KV-cache blocks holding live sequences"),
    "kv_blocks_free": ("asyncrl_kv_blocks_free", "gauge", "KV-cache blocks free or evictable"),
    "kv_blocks_cached": ("asyncrl_kv_blocks_cached", "gauge", "KV-cache blocks findable by prefix hash"),
    "prefix_cache_queries": ("asyncrl_prefix_cache_queries_total", "counter", "Prompt blocks looked up"),
    "prefix_cache_hits": ("asyncrl_prefix_cache_hits_total", "counter", "Prompt blocks found in the cache"),
    "generated_tokens": ("asyncrl_generated_tokens_total", "counter", "Tokens sampled"),
    "prompt_tokens": ("asyncrl_prompt_tokens_total", "counter", "Prompt tokens received"),
    "preemptions": ("asyncrl_preemptions_total", "counter", "Sequences preempted for recompute"),
    "steps": ("asyncrl_engine_steps_total", "counter", "Engine forward steps"),
    "weight_version": ("asyncrl_weight_version", "gauge", "Policy version of the loaded weights"),
    "kv_cache_tokens": ("asyncrl_kv_cache_tokens", "gauge", "Tokens the KV cache holds when full"),
    "kv_bytes_per_token": (
        "asyncrl_kv_bytes_per_token",
        "gauge",
        "KV-cache bytes per token over all layers (K/V or MLA latent, DSA index keys, routing)",
    ),
    "failed_requests": (
        "asyncrl_request_errors_total",
        "counter",
        "Requests the engine failed (error, not abort)",
    ),
    "step_errors": (
        "asyncrl_engine_step_errors_total",
        "counter",
        "Engine steps that raised (whole batch failed)",
    ),
}


# ServerState.counters key -> (metric name, help)
_HTTP_COUNTERS = {
    "tool_calls_parsed": ("asyncrl_tool_calls_parsed_total", "Chat tool calls returned as tool_calls"),
    "tool_calls_malformed": (
        "asyncrl_tool_calls_malformed_total",
        "<tool_call> blocks left in the content because they did not parse",
    ),
}


def render_metrics(stats: dict[str, float], *, paused: bool, counters: dict[str, int] | None = None) -> str:
    lines = []
    for key, value in (counters or {}).items():
        name, help_ = _HTTP_COUNTERS[key]
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} counter", f"{name} {value}"]
    for key, (name, kind, help_) in _METRICS.items():
        lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {stats[key]}"]
    queries = stats["prefix_cache_queries"]
    hit_rate = stats["prefix_cache_hits"] / queries if queries else 0.0
    lines += [
        "# HELP asyncrl_prefix_cache_hit_rate Fraction of looked-up prompt blocks served from the cache",
        "# TYPE asyncrl_prefix_cache_hit_rate gauge",
        f"asyncrl_prefix_cache_hit_rate {hit_rate:.6f}",
        "# HELP asyncrl_paused Whether generation is paused",
        "# TYPE asyncrl_paused gauge",
        f"asyncrl_paused {int(paused)}",
    ]
    return "\n".join(lines) + "\n"
