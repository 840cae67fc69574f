"""The eval's numbers: pass@k against brute force, the eval line, its schedule, the best version."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from asyncrl.envs.rollout import Episode
from asyncrl.orchestrator.eval_metrics import (
    EnvEval,
    best_version,
    eval_record,
    format_eval_line,
    next_due,
    pass_at_k,
)
from asyncrl.wire import RolloutSample


def _brute_pass_at_k(outcomes: list[bool], k: int) -> float:
    """Share of the k-subsets of the samples that hold at least one pass."""
    subsets = list(itertools.combinations(outcomes, k))
    return sum(any(s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_is_the_share_of_k_subsets_with_a_pass(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            outcomes = [True] * c + [False] * (n - c)
            assert pass_at_k(n, c, k) == pytest.approx(_brute_pass_at_k(outcomes, k), abs=1e-12), (n, c, k)


def test_pass_at_k_stays_exact_for_many_samples_and_rejects_impossible_counts():
    assert pass_at_k(200, 1, 1) == pytest.approx(1 / 200)
    assert pass_at_k(200, 10, 100) == pytest.approx(1 - np.prod([(190 - j) / (200 - j) for j in range(100)]))
    with pytest.raises(ValueError, match="k <= n"):
        pass_at_k(4, 1, 5)
    with pytest.raises(ValueError, match="c <= n"):
        pass_at_k(4, 5, 1)


def _episode(reward: float, *, versions=(3, 3), completion=2, stop="done", truncated_turns=0, failed=False):
    n = 2 + len(versions)
    sample = RolloutSample(
        token_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.arange(n) >= 2,
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.array([0, 0, *versions], np.int32),
        reward=reward,
        episode_id="e",
    )
    return Episode(
        episode_id="e",
        env="rt",
        task_id="t",
        reward=reward,
        rewards={},
        samples=[] if failed else [sample],
        metrics={"num_completion_tokens": float(completion), "num_truncated_turns": float(truncated_turns)},
        stop_reason="error" if failed else stop,
        error="boom" if failed else None,
    )


def test_the_eval_line_has_each_envs_numbers_and_the_version():
    rt = EnvEval(
        sampled=[
            [_episode(1.0), _episode(0.5), _episode(0.0, failed=True)],  # task 0: 1 of 3 passes
            [_episode(0.2, completion=6, truncated_turns=1), _episode(0.2), _episode(0.2)],  # task 1: none
        ],
        greedy=[_episode(1.0), _episode(0.4, stop="max_tokens")],
    )
    calc = EnvEval(
        sampled=[[_episode(1.0, versions=(3, 4)), _episode(1.0), _episode(1.0)]]
    )  # v4 landed mid-eval
    record = eval_record(3, {"rt": rt, "calc": calc}, k=3, pass_threshold=1.0, seconds=2.5)
    assert record["version"] == 3 and record["eval/episodes"] == 11 and record["eval/seconds"] == 2.5
    assert record["eval/rt/reward"] == pytest.approx((1.0 + 0.5 + 0.0 + 0.6) / 6)
    assert record["eval/rt/pass@1"] == pytest.approx((1 / 3 + 0) / 2)
    assert record["eval/rt/pass@3"] == pytest.approx((1 + 0) / 2)
    assert record["eval/rt/greedy_reward"] == pytest.approx(0.7)
    assert record["eval/rt/length"] == pytest.approx((2 * 5 + 6) / 6)
    assert record["eval/rt/failed"] == pytest.approx(1 / 8)  # over sampled and greedy episodes
    assert record["eval/rt/truncated"] == pytest.approx(2 / 8)  # a cut turn, a budget stop
    assert record["eval/calc/pass@3"] == 1.0 and "eval/calc/greedy_reward" not in record
    assert record["eval/tokens_on_version"] == pytest.approx(19 / 20)  # 10 episodes x 2 tokens, one of v4
    assert record["eval/newest_version"] == 4
    line = format_eval_line(record, ["rt", "calc"], k=3)
    assert line.startswith("[orchestrator] eval v3 | rt: reward 0.350 pass@1 0.167 pass@3 0.500 greedy 0.700")
    assert line.endswith("| calc: reward 1.000 pass@1 1.000 pass@3 1.000 | 11 episodes in 2.5s")


def test_k_of_one_writes_pass_at_1_once():
    record = eval_record(
        0, {"rt": EnvEval(sampled=[[_episode(1.0)], [_episode(0.0)]])}, k=1, pass_threshold=0.5, seconds=1.0
    )
    assert record["eval/rt/pass@1"] == 0.5
    assert "pass@1 0.500 |" in format_eval_line(record, ["rt"], k=1)


def test_the_schedule_is_every_interval_versions_from_v0_and_the_final_version():
    due, seen = next_due(None, 10, 35), []
    for version in range(36):  # every version reaches the servers
        if due is not None and version >= due:
            seen.append(version)
            due = next_due(version, 10, 35)
    assert seen == [0, 10, 20, 30, 35] and due is None
    # versions the servers skip (a slow update, a publish interval): the first one past the mark
    assert next_due(0, 10, 35) == 10 and next_due(13, 10, 35) == 20 and next_due(33, 10, 35) == 35


def test_the_best_version_is_the_highest_still_on_disk_and_the_first_of_a_tie():
    records = [
        {"version": 0, "eval/rt/pass@1": 0.2},
        {"version": 2, "eval/rt/pass@1": 0.6},
        {"version": 4, "eval/rt/pass@1": 0.9},
        {"version": 6, "eval/rt/pass@1": 0.6},
        {"version": 8},
    ]
    assert best_version(records, "eval/rt/pass@1", lambda v: True) == (4, 0.9)
    assert best_version(records, "eval/rt/pass@1", lambda v: v != 4) == (2, 0.6)
    assert best_version(records, "eval/rt/reward", lambda v: True) is None
