"""Group-relative advantages (pure functions over rewards and samples).

For a group of G rollouts of one task with rewards r_1..r_G:

    A_i = r_i - mean(r)                       (default)
    A_i = (r_i - mean(r)) / (std(r) + eps)    (normalize_std = true)

Every model-sampled token of rollout i gets A_i; prompt and environment tokens get 0.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.wire import RolloutSample

__all__ = ["group_advantages", "with_advantage"]


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
