"""The numbers of an eval during training: pass@k, the eval line, its schedule and the best version.

Pure functions over finished episodes and metrics.jsonl records; `asyncrl.orchestrator.evaluator`
runs the episodes and writes the line. An eval of version v holds, per env, `k` episodes sampled
at the training temperature for each task, and one greedy episode per task where asked:

    record = eval_record(7, {"reverse-text": EnvEval(sampled=[[e1, e2], ...], greedy=[g, ...])},
                         k=2, pass_threshold=1.0, seconds=3.2)
    record["eval/reverse-text/pass@2"]    # share of tasks solved by at least one of 2 samples

An episode passes when its reward is at least `pass_threshold`; a failed episode scores 0.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asyncrl.envs.rollout import Episode

__all__ = [
    "EnvEval",
    "best_version",
    "eval_record",
    "format_eval_line",
    "next_due",
    "pass_at_k",
    "token_versions",
]

_LENGTH_STOPS = ("max_tokens", "context_limit")


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c passed: 1 - C(n-c, k) / C(n, k).

    The chance that k samples drawn without replacement from the n include a pass; computed as a
    product, so large n neither overflows nor loses precision.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - j) / (n - j) for j in range(k))


@dataclass(frozen=True, kw_only=True)
class EnvEval:
    """One env's episodes of one eval: `sampled[t]` holds the k samples of task t, `greedy[t]` its
    greedy one."""

    sampled: list[list[Episode]]
    greedy: list[Episode] = field(default_factory=list)

    @property
    def episodes(self) -> list[Episode]:
        return [e for task in self.sampled for e in task] + self.greedy


def _env_metrics(ev: EnvEval, k: int, pass_threshold: float) -> dict[str, float]:
    sampled = [e for task in ev.sampled for e in task]
    passes = [sum(e.reward >= pass_threshold for e in task) for task in ev.sampled]
    every = ev.episodes
    out = {
        "reward": float(np.mean([e.reward for e in sampled])),
        "pass@1": float(np.mean([pass_at_k(len(t), c, 1) for t, c in zip(ev.sampled, passes, strict=True)])),
        f"pass@{k}": float(
            np.mean([pass_at_k(len(t), c, k) for t, c in zip(ev.sampled, passes, strict=True)])
        ),
        "length": float(np.mean([e.metrics.get("num_completion_tokens", 0.0) for e in sampled])),
        "failed": float(np.mean([e.failed for e in every])),
        "truncated": float(np.mean([_truncated(e) for e in every])),
    }
    if ev.greedy:
        out["greedy_reward"] = float(np.mean([e.reward for e in ev.greedy]))
    return out


def _truncated(episode: Episode) -> bool:
    """Cut by a length limit: a turn stopped at its max_tokens, or the episode at its token budget."""
    return episode.stop_reason in _LENGTH_STOPS or episode.metrics.get("num_truncated_turns", 0.0) > 0


def token_versions(episodes: Iterable[Episode], version: int) -> tuple[float, int]:
    """(share of the sampled tokens that `version` sampled, the newest version that sampled one):
    (1.0, version) when no update landed mid-eval."""
    versions = [s.policy_versions[s.loss_mask] for e in episodes for s in e.samples]
    flat = np.concatenate(versions) if versions else np.zeros(0, np.int32)
    if not flat.size:
        return 1.0, version
    return float(np.mean(flat == version)), int(flat.max())


def eval_record(
    version: int, envs: Mapping[str, EnvEval], *, k: int, pass_threshold: float, seconds: float
) -> dict[str, Any]:
    """The eval line of `version` (all but role, step and time: the metrics writer's)."""
    every = [e for ev in envs.values() for e in ev.episodes]
    on_version, newest = token_versions(every, version)
    record: dict[str, Any] = {
        "version": version,
        "eval/episodes": len(every),
        "eval/seconds": seconds,
        "eval/tokens_on_version": on_version,
        "eval/newest_version": newest,
    }
    for label, ev in envs.items():
        record |= {f"eval/{label}/{name}": v for name, v in _env_metrics(ev, k, pass_threshold).items()}
    return record


def next_due(last_done: int | None, interval: int, max_steps: int) -> int | None:
    """The version the next eval waits for: the next multiple of `interval`, and the final version
    `max_steps` always; None once the final version was evaluated. Nothing done yet: v0."""
    if last_done is None:
        return 0
    if last_done >= max_steps:
        return None
    return min((last_done // interval + 1) * interval, max_steps)


def best_version(
    records: Iterable[Mapping[str, Any]], metric: str, available: Callable[[int], bool]
) -> tuple[int, float] | None:
    """(version, value) of the eval line with the highest `metric` among the versions still
    `available` on disk; the earliest wins a tie. None when no such line has the metric."""
    best: tuple[int, float] | None = None
    for r in sorted(records, key=lambda r: r["version"]):
        value = r.get(metric)
        if not isinstance(value, int | float) or not math.isfinite(value) or not available(r["version"]):
            continue
        if best is None or value > best[1]:
            best = (int(r["version"]), float(value))
    return best


def format_eval_line(record: Mapping[str, Any], labels: Iterable[str], k: int) -> str:
    """The console line of an eval: each env's sampled reward, pass@1, pass@k and greedy reward."""
    cells = dict.fromkeys(["reward", "pass@1", f"pass@{k}", "greedy_reward"])
    parts = []
    for label in labels:
        text = " ".join(
            f"{m.removesuffix('_reward')} {record[key]:.3f}"
            for m in cells
            if (key := f"eval/{label}/{m}") in record
        )
        parts.append(f"{label}: {text}")
    return (
        f"[orchestrator] eval v{record['version']} | {' | '.join(parts)} | "
        f"{record['eval/episodes']} episodes in {record['eval/seconds']:.1f}s"
    )
