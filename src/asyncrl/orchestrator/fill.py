"""While one batch fills: how full it is, why finished groups were dropped, and when to give up.

A batch needs `batch_size` samples of groups with a learning signal. When the environment gives
the policy none (every episode of a group scores the same, so every advantage is zero), groups
are dropped one after another and the batch never fills. `FillTracker` counts what happened to
the groups finished since the last batch, reports it every `fill_status_interval_s` seconds, and
raises `FillStalledError` once `max_fill_groups` groups went by without filling the batch:

    [orchestrator] filling step 2: 0/16 samples | 37 groups in 20s: 37 zero advantage, 0 stale,
        0 with failed episodes | reward mean 0.000 | hint: every episode scored 0.000 ...
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from asyncrl.orchestrator.buffer import Group

__all__ = ["FillStalledError", "FillTracker"]

# Below this many finished groups a hint would guess from too little evidence.
_MIN_GROUPS_FOR_HINT = 8


class FillStalledError(RuntimeError):
    """A batch did not fill within `max_fill_groups` finished groups; the message says why."""


@dataclass
class FillTracker:
    """Counts of the groups finished since the last batch; `reset` at every written batch.

    `stale_total` arguments are the dispatcher's run totals of groups dropped as stale (queue plus
    in flight); the tracker keeps the value at the last reset to report the difference.
    """

    batch_size: int
    max_groups: int
    interval_s: float
    step: int = 1
    num_groups: int = 0
    num_zero_advantage: int = 0
    num_with_failed: int = 0
    rewards: list[float] = field(default_factory=list)
    _stale_at_reset: int = 0
    _started: float = field(default_factory=time.monotonic)
    _last_report: float = field(default_factory=time.monotonic)

    def reset(self, step: int, stale_total: int) -> None:
        self.step, self._stale_at_reset = step, stale_total
        self.num_groups = self.num_zero_advantage = self.num_with_failed = 0
        self.rewards = []
        self._started = self._last_report = time.monotonic()

    def add(self, group: Group) -> None:
        """A group finished; an empty one was dropped (zero advantage, or fewer than 2 valid episodes)."""
        self.num_groups += 1
        # an empty group with fewer than 2 valid episodes was dropped for its failures, not its advantages
        self.num_zero_advantage += not group.samples and len(group.rewards) >= 2
        self.num_with_failed += any(m.get("failed", 0) for m in group.episode_metrics)
        self.rewards.extend(group.rewards)

    def due(self) -> bool:
        """True every `interval_s` seconds while a batch fills (the caller then prints `status`)."""
        now = time.monotonic()
        if now - self._last_report < self.interval_s:
            return False
        self._last_report = now
        return True

    def status(self, num_buffered_samples: int, stale_total: int) -> str:
        """One console line: fill level, what happened to the finished groups, and a hint."""
        stale = stale_total - self._stale_at_reset
        mean = sum(self.rewards) / len(self.rewards) if self.rewards else 0.0
        line = (
            f"filling step {self.step}: {num_buffered_samples}/{self.batch_size} samples | "
            f"{self.num_groups} groups in {time.monotonic() - self._started:.0f}s: "
            f"{self.num_zero_advantage} zero advantage, {stale} stale, "
            f"{self.num_with_failed} with failed episodes | reward mean {mean:.3f}"
        )
        hint = self.hint(stale)
        return f"{line} | hint: {hint}" if hint else line

    def hint(self, stale: int) -> str | None:
        """Why the batch is not filling, when the counts say so clearly."""
        if self.num_groups + stale < _MIN_GROUPS_FOR_HINT:
            return None
        if self.num_with_failed * 2 > self.num_groups:
            return (
                "most groups have failed episodes (inference errors or env crashes); "
                "see RUN/logs/orchestrator.log and the inference logs"
            )
        if self.num_zero_advantage * 10 >= self.num_groups * 9 and self.num_groups:
            distinct = sorted(set(self.rewards))
            scored = (
                f"every episode scored {distinct[0]:.3f}"
                if len(distinct) == 1
                else ("the episodes of almost every group scored alike")
            )
            return (
                f"{scored}, so the env gives the policy no learning signal; start from a model that "
                "solves some tasks (SFT first), make the tasks easier, or raise sampling.temperature"
            )
        if stale * 2 > self.num_groups + stale:
            return (
                "most groups went stale before they could be trained; raise max_off_policy_steps "
                "or lower max_async_steps / max_concurrent_groups"
            )
        return None

    def check(self, num_buffered_samples: int, stale_total: int) -> None:
        """Raise `FillStalledError` once `max_groups` groups went by without filling the batch."""
        stale = stale_total - self._stale_at_reset
        if self.num_groups + stale < self.max_groups:
            return
        raise FillStalledError(
            f"step {self.step} did not fill: {self.num_groups + stale} groups finished or went stale "
            f"(orchestrator.max_fill_groups = {self.max_groups}) and the batch holds "
            f"{num_buffered_samples}/{self.batch_size} samples. "
            + self.status(num_buffered_samples, stale_total)
            + ". Raise orchestrator.max_fill_groups to wait longer."
        )
