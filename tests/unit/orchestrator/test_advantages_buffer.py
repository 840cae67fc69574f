"""Group-relative advantages and the stale-group rule, on hand-computed cases."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs.base import Task
from asyncrl.envs.rollout import Episode
from asyncrl.orchestrator.advantages import group_advantages, with_advantage
from asyncrl.orchestrator.buffer import Group, GroupBuffer
from asyncrl.orchestrator.checkpoint import GroupRef
from asyncrl.orchestrator.dispatcher import Dispatcher, SampleTooLongError, _InFlight
from asyncrl.wire import BatchFormatError, RolloutSample


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
    return Group(
        task_id="t",
        env="e",
        dispatch_version=oldest,
        samples=samples,
        rewards=[0.0] * n,
        episode_metrics=[{}] * n,
    )


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
        buf.add(
            Group(
                task_id=name,
                env="e",
                dispatch_version=dispatch,
                rewards=[0.0, 0.0],
                samples=[_spanning_sample(v) for v in versions],
                episode_metrics=[{}, {}],
            )
        )
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


def _episode(reward: float, *, error: str | None = None, stop: str = "done") -> Episode:
    return Episode(
        episode_id=f"e{reward}",
        env="e",
        task_id="t",
        reward=reward,
        rewards={},
        samples=[_sample([0, 1, 1], [False, True, True])],
        metrics={"failed": float(error is not None)},
        stop_reason="error" if error else stop,
        error=error,
    )


def _make_group(episodes: list[Episode]) -> tuple[Group, Dispatcher]:
    dispatcher = Dispatcher(OrchestratorConfig(model="m", batch_size=4, group_size=4), None, None, None)
    return dispatcher._make_group("e", Task(id="t", prompt=[]), 1, episodes), dispatcher


def test_failed_episodes_never_train_and_stay_out_of_the_baseline():
    # An env error (samples kept for inspection), an aborted request, and two valid rollouts.
    episodes = [
        _episode(1.0),
        _episode(0.0, error="RuntimeError: env bug"),
        _episode(0.0),
        _episode(0.7, stop="aborted"),
    ]
    group, dispatcher = _make_group(episodes)
    advantages = [float(s.advantages[s.loss_mask][0]) for s in group.samples]
    assert advantages == pytest.approx([0.5, -0.5])  # baseline over the two valid episodes only
    assert sum(advantages) == pytest.approx(0.0)
    assert group.rewards == [1.0, 0.0] and len(group.episode_metrics) == 4
    assert dispatcher.counters.episodes_failed == 2 and dispatcher.counters.groups_too_few_valid == 0


def test_a_group_with_fewer_than_two_valid_episodes_is_dropped_and_counted():
    group, dispatcher = _make_group([_episode(1.0), _episode(0.0, error="InferenceError: down")])
    assert group.samples == [] and dispatcher.counters.groups_too_few_valid == 1
    assert dispatcher.counters.episodes_failed == 1


def test_a_sample_longer_than_seq_len_fails_its_group_before_any_batch_holds_it():
    # The config keeps every env's budget within seq_len; should a sample outgrow it anyway, the
    # trainer could not pack it, and a written batch is re-read on every resume.
    cfg = OrchestratorConfig(
        model="m",
        batch_size=4,
        group_size=4,
        seq_len=2,
        envs={"envs": [{"name": "e", "max_total_tokens": 2}]},
    )
    dispatcher = Dispatcher(cfg, None, None, None)
    with pytest.raises(
        SampleTooLongError, match=r"episode e1\.0 has a sample of 3 tokens, more than seq_len \(2\)"
    ):
        dispatcher._make_group("e", Task(id="t", prompt=[]), 1, [_episode(1.0), _episode(0.0)])
    ok = Dispatcher(cfg.model_copy(update={"seq_len": 3}), None, None, None)
    assert len(ok._make_group("e", Task(id="t", prompt=[]), 1, [_episode(1.0), _episode(0.0)]).samples) == 2


def test_a_failing_group_is_counted_and_the_run_goes_on():
    dispatcher = Dispatcher(OrchestratorConfig(model="m", batch_size=4, group_size=4), None, None, None)

    async def finish(results: list) -> list:
        async def one(r):
            if isinstance(r, Exception):
                raise r
            return r

        tasks = [asyncio.create_task(one(r)) for r in results]
        await asyncio.gather(*tasks, return_exceptions=True)
        dispatcher._in_flight = [_InFlight(t, 0, GroupRef(index=i, env_index=0)) for i, t in enumerate(tasks)]
        return dispatcher._collect_finished()

    assert asyncio.run(finish([BatchFormatError("bad routing"), "group"])) == ["group"]
    assert dispatcher.counters.groups_error == 1
    # Every group failing is a bug, not bad luck: after 2 x concurrent_groups in a row the run stops.
    many = [RuntimeError(f"bug {i}") for i in range(2 * dispatcher.cfg.concurrent_groups)]
    with pytest.raises(RuntimeError, match="rollout groups in a row failed"):
        asyncio.run(finish(many))
