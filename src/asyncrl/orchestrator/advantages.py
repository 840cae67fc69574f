"""Group-relative advantages (pure functions over rewards and samples).

For a group of G rollouts of one task with rewards r_1..r_G:

    A_i = r_i - mean(r)                       (default)
    A_i = (r_i - mean(r)) / (std(r) + eps)    (normalize_std = true)

Every model-sampled token of rollout i gets A_i; prompt and environment tokens get 0.

Failed episodes (an environment or reward error, an inference failure that outlived its retries,
a request the server aborted) are not rollouts of the policy: they never contribute loss tokens,
and the mean (and std) are taken over the valid episodes only, so the valid advantages of a group
sum to zero. A group with fewer than two valid episodes has no baseline and is dropped
(`advantage_groups`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.envs.rollout import Episode
from asyncrl.wire import RolloutSample

__all__ = ["MIN_VALID_EPISODES", "group_advantages", "is_valid", "valid_group_samples", "with_advantage"]

MIN_VALID_EPISODES = 2  # a baseline needs at least two rollouts


def group_advantages(rewards: list[float], *, normalize_std: bool = False, eps: float = 1e-6) -> list[float]:
    if not rewards:
        return []
    r = np.asarray(rewards, dtype=np.float64)
    adv = r - r.mean()
    if normalize_std:
        adv = adv / (r.std() + eps)
    return adv.tolist()


def with_advantage(sample: RolloutSample, advantage: float) -> RolloutSample:
    """A copy of `sample` whose sampled tokens carry `advantage` (others 0)."""
    advantages = np.where(sample.loss_mask, np.float32(advantage), np.float32(0.0)).astype(np.float32)
    return dataclasses.replace(sample, advantages=advantages)


def is_valid(episode: Episode) -> bool:
    """A rollout of the policy that ran to a stop condition (a deadline counts; errors and aborts don't)."""
    return not episode.failed and episode.stop_reason != "aborted"


def valid_group_samples(
    episodes: list[Episode], *, normalize_std: bool = False, eps: float = 1e-6
) -> tuple[list[RolloutSample], list[float]] | None:
    """The valid episodes' samples with group-relative advantages, and their advantages (one per
    valid episode); None when fewer than `MIN_VALID_EPISODES` episodes are valid."""
    valid = [e for e in episodes if is_valid(e)]
    if len(valid) < MIN_VALID_EPISODES:
        return None
    adv = group_advantages([e.reward for e in valid], normalize_std=normalize_std, eps=eps)
    samples = [with_advantage(s, a) for e, a in zip(valid, adv, strict=True) for s in e.samples]
    return samples, adv
