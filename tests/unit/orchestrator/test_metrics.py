"""The orchestrator's per-batch metrics (asyncrl.orchestrator.metrics)."""

from __future__ import annotations

import dataclasses

import numpy as np

from asyncrl.orchestrator.metrics import Counters, StepMetrics, format_line, step_record
from asyncrl.wire import RolloutBatch, RolloutSample


def _sample(n: int) -> RolloutSample:
    return RolloutSample(
        token_ids=np.arange(n, dtype=np.int32),
        loss_mask=np.arange(n) >= 1,
        inference_logprobs=np.zeros(n, np.float32),
        advantages=np.zeros(n, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.full(n, 2, np.int32),
    )


def test_step_metrics_leave_out_episode_means_when_no_episode_finished():
    # A batch cut from groups already buffered: no episode finished since the previous batch, so
    # there is no finished-episode reward to report (a 0 would read as a reward and bias averages).
    batch = RolloutBatch(step=3, samples=[dataclasses.replace(_sample(3), reward=0.75)])
    kw = {"policy_version": 2, "num_dropped_stale_queue": 0, "step_seconds": 0.1, "inference": {}}
    empty = step_record(batch, StepMetrics(), Counters(), **kw)
    assert "reward/mean" not in empty and "episode/tokens" not in empty
    assert empty["reward/batch_mean"] == 0.75
    assert "| reward   -   | v2" in format_line(
        {**empty, "step": 3, "inference/prefix_hit_rate": 0.0, "inference/tokens_per_s": 0.0}
    )
    since = StepMetrics()
    since.rewards["e"].extend([1.0, 0.0])
    since.episodes.extend([{"num_prompt_tokens": 3, "num_completion_tokens": 2}] * 2)
    full = step_record(batch, since, Counters(), **kw)
    assert full["reward/mean"] == 0.5 and full["reward/e"] == 0.5 and full["episode/tokens"] == 5.0
