"""Per-step orchestrator metrics: rewards, episode shape, staleness, drops, inference load.

`step_record` is a pure function of the batch, the episodes finished since the last batch, and
the dispatcher's counters; the dispatcher passes them in and resets what is per step. One line per
written batch goes to `RUN/metrics.jsonl` (through `asyncrl.transport.MetricsWriter`, role
"orchestrator"), and one line to the console. Per env, `env/<env>/episodes` counts the episodes
finished since the last batch and `env/<env>/<name>` the mean over them of each named reward
(`episode.rewards`: the `swe` env's resolved, fail_to_pass, sandbox_start_s, ...) and episode
metric (num_tool_calls, num_turns, failed, stop_<reason>, ...); an episode that does not report a
value (a failed one has no named rewards, stop_<reason> is set for its own reason only) counts 0.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from asyncrl.orchestrator.buffer import Group
from asyncrl.wire import RolloutBatch

__all__ = ["Counters", "StepMetrics", "format_line", "step_record"]


@dataclass
class Counters:
    """Run totals of the dispatcher, except `inference_idle_s`, which is per step."""

    groups_dispatched: int = 0
    groups_cancelled_stale: int = 0
    groups_zero_advantage: int = 0
    groups_too_few_valid: int = 0  # fewer than two valid episodes: no baseline
    groups_error: int = 0  # the group's own code raised; logged and dropped
    episodes_failed: int = 0
    episodes_retried: int = 0
    inference_idle_s: float = 0.0


@dataclass
class StepMetrics:
    """Episode statistics of every group finished since the last batch (trained or not)."""

    rewards: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))
    episodes: list[dict[str, float]] = field(default_factory=list)
    episodes_by_env: dict[str, list[dict[str, float]]] = field(default_factory=lambda: defaultdict(list))

    def add_group(self, group: Group) -> None:
        self.rewards[group.env].extend(group.rewards)
        self.episodes.extend(group.episode_metrics)
        self.episodes_by_env[group.env].extend(group.episode_metrics)


def _env_means(episodes_by_env: Mapping[str, list[dict[str, float]]]) -> dict[str, float]:
    """`env/<env>/episodes`, and `env/<env>/<name>`: the mean of each value, 0 where an episode lacks it."""
    out: dict[str, float] = {}
    for env, episodes in episodes_by_env.items():
        out[f"env/{env}/episodes"] = float(len(episodes))
        for name in sorted({k for e in episodes for k in e}):
            out[f"env/{env}/{name}"] = _mean([e.get(name, 0.0) for e in episodes])
    return out


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def _num_without_routing(batch: RolloutBatch) -> int:
    """Samples trained without router replay in a batch that carries routing (0 when none does)."""
    missing = sum(s.routed_experts is None for s in batch.samples)
    return missing if missing < len(batch.samples) else 0


def step_record(
    batch: RolloutBatch,
    since: StepMetrics,
    counters: Counters,
    *,
    policy_version: int,
    num_dropped_stale_queue: int,
    step_seconds: float,
    inference: Mapping[str, float],
) -> dict[str, float | int]:
    """The orchestrator's record of step n, logged with batch n (all but role, step and time: the writer's).

    `since` holds the episodes finished since the previous batch (trained or not); `inference`
    is the pool's token counters of the same period (`PoolStats.take()`).
    """
    floor = batch.step - 1
    versions = np.concatenate([s.policy_versions[s.loss_mask] for s in batch.samples])
    staleness = floor - versions if versions.size else np.zeros(1)
    all_rewards = [r for rs in since.rewards.values() for r in rs]
    ep = since.episodes
    c = counters
    # Means over the episodes finished since the previous batch: absent when none finished (a batch
    # cut from groups already buffered), rather than a 0 that reads as a reward or a length.
    finished: dict[str, float] = {}
    if all_rewards:
        finished["reward/mean"] = _mean(all_rewards)
    finished |= {f"reward/{env}": _mean(rs) for env, rs in since.rewards.items() if rs}
    if ep:
        finished |= {
            "episode/tokens": _mean(
                [e.get("num_prompt_tokens", 0) + e.get("num_completion_tokens", 0) for e in ep]
            ),
            "episode/completion_tokens": _mean([e.get("num_completion_tokens", 0) for e in ep]),
            "episode/turns": _mean([e.get("num_turns", 0) for e in ep]),
            "episode/tool_errors": _mean([e.get("num_tool_errors", 0) for e in ep]),
        }
    finished |= _env_means(since.episodes_by_env)
    return {
        "policy_version": policy_version,
        "reward/batch_mean": _mean([s.reward for s in batch.samples]),
        **finished,
        "episode/failed": float(sum(e.get("failed", 0) for e in ep)),
        "batch/samples": len(batch.samples),
        "batch/tokens": batch.num_tokens,
        "staleness/mean": float(staleness.mean()),
        "staleness/max": int(staleness.max()),
        "groups/dispatched_total": c.groups_dispatched,
        "dropped/groups_stale_queue": num_dropped_stale_queue,
        "dropped/groups_stale_in_flight": c.groups_cancelled_stale,
        "dropped/groups_zero_advantage": c.groups_zero_advantage,
        "dropped/groups_too_few_valid": c.groups_too_few_valid,
        "dropped/groups_error": c.groups_error,
        "batch/samples_without_routing": _num_without_routing(batch),
        "episodes/failed_total": c.episodes_failed,
        "episodes/retried_total": c.episodes_retried,
        "inference/idle_s": c.inference_idle_s,
        "orchestrator/step_s": step_seconds,
        **inference,
    }


def _fmt(value: float | None) -> str:
    return "  -  " if value is None else f"{value:.3f}"


def format_line(m: dict) -> str:
    return (
        f"[orchestrator] step {m['step']:>4} | reward {_fmt(m.get('reward/mean'))} | v{m['policy_version']} "
        f"| stale {m['staleness/mean']:.2f}/{m['staleness/max']} | drop q{m['dropped/groups_stale_queue']} "
        f"f{m['dropped/groups_stale_in_flight']} | cache {m['inference/prefix_hit_rate']:.2f} "
        f"| {m['inference/tokens_per_s']:.0f} tok/s | idle {m['inference/idle_s']:.1f}s"
    )
