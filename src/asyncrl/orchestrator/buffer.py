"""Finished rollout groups waiting for a batch, with the staleness rule applied at cut time.

Policy versions (docs/architecture.md): trainer step n consumes batch n and produces v_n. With
`max_off_policy_steps` = k, a sample whose oldest token is older than v_{n-1-k} is never trained at
step n; such groups are dropped (and counted) here, and in flight by the dispatcher.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from asyncrl.wire import RolloutBatch, RolloutSample

__all__ = ["Group", "GroupBuffer", "oldest_allowed_version"]


def oldest_allowed_version(step: int, max_off_policy_steps: int) -> int:
    return step - 1 - max_off_policy_steps


@dataclass(frozen=True, kw_only=True)
class Group:
    """The samples of one task's rollouts, advantages assigned; `dispatch_version`: the version held
    at dispatch.

    `index` is the group's position in the run's task stream (its id across restarts; -1 if unset).
    """

    task_id: str
    env: str
    dispatch_version: int
    samples: list[RolloutSample]
    rewards: list[float]
    episode_metrics: list[dict[str, float]]
    index: int = -1

    @property
    def oldest_version(self) -> int:
        return min(
            int(s.policy_versions[s.loss_mask].min()) if s.loss_mask.any() else self.dispatch_version
            for s in self.samples
        )


class GroupBuffer:
    """FIFO of finished groups; `cut(step)` takes `batch_size` samples' worth of fresh groups."""

    def __init__(self, batch_size: int, max_off_policy_steps: int) -> None:
        self.batch_size, self.k = batch_size, max_off_policy_steps
        self._groups: deque[Group] = deque()
        self.num_dropped_groups = 0
        self.num_dropped_samples = 0
        self.dropped_indices: list[int] = []  # indices of stale-dropped groups; the owner drains it

    def add(self, group: Group) -> None:
        if group.samples:
            self._groups.append(group)

    def load(self, groups: list[Group], num_dropped_groups: int, num_dropped_samples: int) -> None:
        """Start from a checkpoint's buffered groups and drop counts."""
        self._groups = deque(groups)
        self.num_dropped_groups, self.num_dropped_samples = num_dropped_groups, num_dropped_samples

    @property
    def groups(self) -> list[Group]:
        """The buffered groups, oldest first (a copy: the checkpoint's view)."""
        return list(self._groups)

    @property
    def num_samples(self) -> int:
        return sum(len(g.samples) for g in self._groups)

    def drop_stale(self, step: int) -> int:
        """Drop groups too old to train at `step`; returns how many samples were dropped."""
        floor = oldest_allowed_version(step, self.k)
        kept, dropped = deque(), 0
        for g in self._groups:
            if g.oldest_version < floor:
                self.num_dropped_groups += 1
                self.dropped_indices.append(g.index)
                dropped += len(g.samples)
            else:
                kept.append(g)
        self._groups = kept
        self.num_dropped_samples += dropped
        return dropped

    def cut(self, step: int) -> tuple[RolloutBatch, list[Group]] | None:
        """The batch for `step` (whole groups, at least `batch_size` samples), or None if not enough."""
        self.drop_stale(step)
        if self.num_samples < self.batch_size:
            return None
        taken: list[Group] = []
        while sum(len(g.samples) for g in taken) < self.batch_size:
            taken.append(self._groups.popleft())
        samples = [s for g in taken for s in g.samples]
        return RolloutBatch(step=step, samples=samples), taken
