"""A server's load as it reports it: its Prometheus `/metrics` text read into a `ServerLoad`.

Both backends are read by the same parser; each names its gauges its own way:

| `ServerLoad`  | embedded engine (`asyncrl_*`)            | vLLM (`vllm:*`)                          |
|---------------|------------------------------------------|------------------------------------------|
| num_running   | `asyncrl_requests_running`               | `vllm:num_requests_running`              |
| num_waiting   | `asyncrl_requests_waiting`               | `vllm:num_requests_waiting`              |
| kv_usage      | used / (used + free) `asyncrl_kv_blocks` | `vllm:kv_cache_usage_perc` (a fraction)  |
| num_blocks    | used + free                              | `vllm:cache_config_info{num_gpu_blocks}` |
| block_size    | `asyncrl_kv_cache_tokens` / num_blocks   | `vllm:cache_config_info{block_size}`     |

A vLLM server with several data-parallel engines reports one series per engine (label `engine`):
requests and blocks are summed over them, KV usage is their mean.

    load = parse_metrics(await backend.metrics())
    load.kv_usage      # 0.42, or None when the server does not say
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

__all__ = ["ServerLoad", "parse_metrics"]

# name{labels} value  (the value may carry a timestamp after it, which is ignored)
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


@dataclass(frozen=True)
class ServerLoad:
    """One server's gauges at one poll; None where the server does not report the value."""

    num_running: float = 0.0
    num_waiting: float = 0.0
    kv_usage: float | None = None  # fraction of KV blocks held by live requests, in [0, 1]
    num_blocks: int | None = None
    block_size: int | None = None


def _samples(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """name -> [(labels, value)] of every sample line of a Prometheus text exposition."""
    out: dict[str, list[tuple[dict[str, str], float]]] = defaultdict(list)
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)].append((dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def _sum(samples: dict, name: str) -> float | None:
    values = [v for _, v in samples.get(name, [])]
    return sum(values) if values else None


def _mean(samples: dict, name: str) -> float | None:
    values = [v for _, v in samples.get(name, [])]
    return sum(values) / len(values) if values else None


def _embedded(s: dict) -> ServerLoad:
    used, free = _sum(s, "asyncrl_kv_blocks_used"), _sum(s, "asyncrl_kv_blocks_free")
    num_blocks = int(used + free) if used is not None and free is not None else None
    tokens = _sum(s, "asyncrl_kv_cache_tokens")
    block_size = int(tokens) // num_blocks if num_blocks and tokens else None
    return ServerLoad(
        num_running=_sum(s, "asyncrl_requests_running") or 0.0,
        num_waiting=_sum(s, "asyncrl_requests_waiting") or 0.0,
        kv_usage=used / num_blocks if num_blocks else None,
        num_blocks=num_blocks,
        block_size=block_size,
    )


def _info_int(s: dict, name: str, label: str) -> int | None:
    """Sum over engines of an integer label of an info gauge (None when absent or not a number)."""
    values = [labels.get(label, "") for labels, _ in s.get(name, [])]
    if not values or not all(v.isdigit() for v in values):
        return None
    return sum(int(v) for v in values) if label == "num_gpu_blocks" else int(values[0])


def _vllm(s: dict) -> ServerLoad:
    return ServerLoad(
        num_running=_sum(s, "vllm:num_requests_running") or 0.0,
        num_waiting=_sum(s, "vllm:num_requests_waiting") or 0.0,
        kv_usage=_mean(s, "vllm:kv_cache_usage_perc"),
        num_blocks=_info_int(s, "vllm:cache_config_info", "num_gpu_blocks"),
        block_size=_info_int(s, "vllm:cache_config_info", "block_size"),
    )


def parse_metrics(text: str) -> ServerLoad:
    """The load in a server's `/metrics` text, whichever backend wrote it."""
    samples = _samples(text)
    if any(name.startswith("vllm:") for name in samples):
        return _vllm(samples)
    return _embedded(samples)
