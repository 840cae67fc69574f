"""Per-step orchestrator metrics: rewards, episode shape, staleness, drops, inference load.

One record per written batch goes to `RUN/metrics.jsonl` (with `"role": "orchestrator"`), and one
line to the console.
"""

from __future__ import annotations

import json
import os
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from asyncrl.orchestrator.buffer import Group
from asyncrl.wire import RolloutBatch

if TYPE_CHECKING:
    from asyncrl.orchestrator.dispatcher import Dispatcher

__all__ = ["StepMetrics", "append_jsonl", "batch_metrics", "format_line"]


@dataclass
class StepMetrics:
    """Episode statistics of every group finished since the last batch (trained or not)."""

    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    episodes: list[dict[str, float]] = field(default_factory=list)

    def add_group(self, group: Group) -> None:
        self.rewards[group.env].extend(group.rewards)
        self.episodes.extend(group.episode_metrics)


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def batch_metrics(d: Dispatcher, batch: RolloutBatch, groups: list[Group], since: StepMetrics) -> dict:
    floor = batch.step - 1
    versions = np.concatenate([s.policy_versions[s.loss_mask] for s in batch.samples])
    staleness = floor - versions if versions.size else np.zeros(1)
    all_rewards = [r for rs in since.rewards.values() for r in rs]
    ep = since.episodes
    c = d.counters
    out = {
        "role": "orchestrator",
        "step": batch.step,
        "time": time.time(),
        "policy_version": d.version,
        "reward/mean": _mean(all_rewards),
        "reward/batch_mean": _mean([s.reward for s in batch.samples]),
        **{f"reward/{env}": _mean(rs) for env, rs in since.rewards.items()},
        "episode/tokens": _mean(
            [e.get("num_prompt_tokens", 0) + e.get("num_completion_tokens", 0) for e in ep]
        ),
        "episode/completion_tokens": _mean([e.get("num_completion_tokens", 0) for e in ep]),
        "episode/turns": _mean([e.get("num_turns", 0) for e in ep]),
        "episode/tool_errors": _mean([e.get("num_tool_errors", 0) for e in ep]),
        "episode/failed": float(sum(e.get("failed", 0) for e in ep)),
        "batch/samples": len(batch.samples),
        "batch/tokens": batch.num_tokens,
        "staleness/mean": float(staleness.mean()),
        "staleness/max": int(staleness.max()),
        "dropped/groups_stale_queue": d.buffer.num_dropped_groups,
        "dropped/groups_stale_in_flight": c.groups_cancelled_stale,
        "dropped/groups_zero_advantage": c.groups_zero_advantage,
        "episodes/failed_total": c.episodes_failed,
        "episodes/retried_total": c.episodes_retried,
        "inference/idle_s": c.inference_idle_s,
        "orchestrator/step_s": time.monotonic() - d._step_started,
        **d.pool.stats.take(),
    }
    c.inference_idle_s = 0.0
    return out


def format_line(m: dict) -> str:
    return (
        f"[orchestrator] step {m['step']:>4} | reward {m['reward/mean']:.3f} | v{m['policy_version']} "
        f"| stale {m['staleness/mean']:.2f}/{m['staleness/max']} | drop q{m['dropped/groups_stale_queue']} "
        f"f{m['dropped/groups_stale_in_flight']} | cache {m['inference/prefix_cache_hit_rate']:.2f} "
        f"| {m['inference/tokens_per_s']:.0f} tok/s | idle {m['inference/idle_s']:.1f}s"
    )


def append_jsonl(path: str | Path, record: dict) -> None:
    """Append one JSON line with a single O_APPEND write, so concurrent writers never interleave."""
    data = (json.dumps(record) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)
