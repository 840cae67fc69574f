"""Group-relative advantages and the stale-group rule, on hand-computed cases."""

from __future__ import annotations

import numpy as np
import pytest

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.orchestrator.advantages import group_advantages, with_advantage
from asyncrl.orchestrator.buffer import Group, GroupBuffer
from asyncrl.wire import RolloutSample


def _sample(versions: list[int], mask: list[bool]) -> RolloutSample:
    n = len(versions)
    return RolloutSample(
        token_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.array(mask),
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.array(versions, np.int32),
    )


def test_group_advantages_hand_computed():
    assert group_advantages([1.0, 0.0, 0.5, 0.5]) == pytest.approx([0.5, -0.5, 0.0, 0.0])
    std = np.std([1.0, 0.0, 0.5, 0.5])
    assert group_advantages([1.0, 0.0, 0.5, 0.5], normalize_std=True) == pytest.approx(
        [0.5 / std, -0.5 / std, 0.0, 0.0], rel=1e-5
    )
    assert group_advantages([0.3, 0.3], normalize_std=True) == [0.0, 0.0]


def test_with_advantage_marks_only_sampled_tokens():
    s = with_advantage(_sample([0, 0, 1, 1], [False, False, True, True]), -0.25)
    assert s.advantages.tolist() == [0.0, 0.0, -0.25, -0.25]


def _group(oldest: int, n: int = 2) -> Group:
    # prompt tokens carry version 0 regardless; only sampled tokens count for staleness
    samples = [_sample([0, oldest, oldest + 1], [False, True, True]) for _ in range(n)]
    return Group(task_id="t", env="e", dispatch_version=oldest, samples=samples, rewards=[0.0] * n,
                 episode_metrics=[{}] * n)  # fmt: skip


def test_buffer_drops_groups_older_than_allowed():
    buf = GroupBuffer(batch_size=4, max_off_policy_steps=1)
    for v in (0, 1, 2, 3):
        buf.add(_group(v))
    # step 4 allows versions >= 4 - 1 - 1 = 2: the v0 and v1 groups go
    batch, groups = buf.cut(4)
    assert [g.dispatch_version for g in groups] == [2, 3]
    assert buf.num_dropped_groups == 2 and buf.num_dropped_samples == 4
    assert batch.step == 4 and len(batch.samples) == 4
    assert buf.cut(5) is None


def _spanning_sample(sampled_versions: list[int]) -> RolloutSample:
    # Two prompt tokens at version 0 (not sampled: never count), then the sampled tokens, whose
    # versions rise where a weight update landed mid-rollout.
    return _sample([0, 0, *sampled_versions], [False, False] + [True] * len(sampled_versions))


def test_buffer_uses_the_oldest_sampled_token_version_not_the_dispatch_version():
    """Step 4 with k = 1 trains only samples whose every sampled token is from v2 or newer."""
    groups = {
        # dispatched at v0, but the first update landed before its first sampled token: fresh
        "late_start": ([[2, 3], [2, 2, 3]], 0),
        # dispatched at v1 and still decoding at v3: one v1 token is one too old
        "spans_1_to_3": ([[1, 2, 3], [2, 3]], 1),
        # its second sample alone reaches back to v1
        "second_sample_old": ([[3, 3], [1, 3]], 1),
        # dispatched at v2, tokens from v2 and v3
        "fresh": ([[2, 3], [3]], 2),
    }
    buf = GroupBuffer(batch_size=4, max_off_policy_steps=1)
    for name, (versions, dispatch) in groups.items():
        buf.add(Group(task_id=name, env="e", dispatch_version=dispatch, rewards=[0.0, 0.0],
                      samples=[_spanning_sample(v) for v in versions], episode_metrics=[{}, {}]))  # fmt: skip
    batch, taken = buf.cut(4)
    assert [g.task_id for g in taken] == ["late_start", "fresh"]
    assert buf.num_dropped_groups == 2 and buf.num_dropped_samples == 4
    assert [s.policy_versions.tolist() for s in batch.samples] == [
        [0, 0, 2, 3],
        [0, 0, 2, 2, 3],
        [0, 0, 2, 3],
        [0, 0, 3],
    ]


def test_config_rejects_impossible_combinations():
    with pytest.raises(ValueError, match=r"batch_size \(10\) must be a multiple of group_size \(4\)"):
        OrchestratorConfig(model="m", batch_size=10, group_size=4)
    with pytest.raises(ValueError, match="group_size = 1 gives every group zero advantage"):
        OrchestratorConfig(model="m", batch_size=4, group_size=1)
