"""The fill status while a batch fills, and the limit that turns an endless fill into an error."""

from __future__ import annotations

import asyncio

import pytest

from asyncrl.config.envs import EnvConfig, EnvsConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.orchestrator.buffer import Group
from asyncrl.orchestrator.fill import FillStalledError, FillTracker
from asyncrl.orchestrator.main import run_orchestrator


def _group(samples: int, rewards: list[float], failed: int = 0) -> Group:
    metrics = [{"failed": 1.0} if i < failed else {} for i in range(len(rewards))]
    return Group(
        task_id="t",
        env="e",
        dispatch_version=0,
        samples=[object()] * samples,  # type: ignore[list-item]
        rewards=rewards,
        episode_metrics=metrics,
    )


def test_status_counts_why_groups_dropped_and_hints_at_no_signal():
    fill = FillTracker(batch_size=16, max_groups=100, interval_s=10.0, step=3)
    fill.reset(3, stale_total=5)
    for _ in range(9):
        fill.add(_group(0, [0.0] * 4))
    fill.add(_group(0, [0.0] * 4, failed=1))
    line = fill.status(num_buffered_samples=0, stale_total=7)
    assert line.startswith("filling step 3: 0/16 samples | 10 groups in ")
    assert "10 zero advantage, 2 stale, 1 with failed episodes | reward mean 0.000" in line
    assert "hint: every episode scored 0.000, so the env gives the policy no learning signal" in line


def test_no_hint_while_groups_carry_signal():
    fill = FillTracker(batch_size=16, max_groups=100, interval_s=10.0)
    for _ in range(10):
        fill.add(_group(4, [0.0, 1.0, 0.0, 1.0]))
    assert fill.hint(stale=0) is None
    assert "hint" not in fill.status(num_buffered_samples=40, stale_total=0)


def test_stale_and_failed_hints():
    fill = FillTracker(batch_size=16, max_groups=100, interval_s=10.0)
    for _ in range(4):
        fill.add(_group(4, [0.0, 1.0, 0.0, 1.0]))
    assert "went stale" in fill.hint(stale=10)
    for _ in range(6):
        fill.add(_group(0, [0.0] * 4, failed=4))
    assert "failed episodes" in fill.hint(stale=0)


def test_check_raises_at_the_limit_and_reset_clears_it():
    fill = FillTracker(batch_size=8, max_groups=3, interval_s=10.0, step=2)
    fill.add(_group(0, [1.0] * 4))
    fill.add(_group(0, [1.0] * 4))
    fill.check(num_buffered_samples=0, stale_total=0)  # 2 < 3
    with pytest.raises(FillStalledError, match=r"step 2 did not fill: 3 groups .*max_fill_groups = 3"):
        fill.check(num_buffered_samples=0, stale_total=1)  # one went stale: 3
    fill.reset(3, stale_total=1)
    fill.check(num_buffered_samples=0, stale_total=1)


def test_due_waits_for_the_interval():
    fill = FillTracker(batch_size=8, max_groups=3, interval_s=3600.0)
    assert not fill.due()
    fill.interval_s = 0.0
    assert fill.due()


def test_default_limit_scales_with_groups_per_batch(tokenizer_dir):
    cfg = OrchestratorConfig(model=str(tokenizer_dir), batch_size=16, group_size=4)
    assert cfg.fill_group_limit == 200
    assert cfg.model_copy(update={"max_fill_groups": 7}).fill_group_limit == 7


def test_zero_advantage_env_reports_fill_status_then_stops_with_a_clear_error(
    tmp_path, tokenizer_dir, servers, capsys
):
    """max_tokens = 1: the fake server answers eos only, so every episode scores alike."""
    (server,) = servers(1)
    cfg = OrchestratorConfig(
        run_dir=str(tmp_path / "run"),
        model=str(tokenizer_dir),
        servers=[server.url],
        envs=EnvsConfig(envs=[EnvConfig(name="reverse-text")]),
        sampling=SamplingParams(max_tokens=1),
        batch_size=8,
        group_size=4,
        max_steps=2,
        max_fill_groups=24,
        fill_status_interval_s=0.001,
        weights_poll_s=0.02,
        health_poll_s=0.1,
        server_ready_timeout_s=10,
    )
    with pytest.raises(FillStalledError) as err:
        asyncio.run(asyncio.wait_for(run_orchestrator(cfg), timeout=60))
    message = str(err.value)
    assert "step 1 did not fill" in message and "max_fill_groups = 24" in message
    assert "0/8 samples" in message
    assert "hint: every episode scored" in message and "no learning signal" in message
    status = [line for line in capsys.readouterr().out.splitlines() if "filling step 1" in line]
    assert status and all(line.startswith("[orchestrator] filling step 1: 0/8 samples") for line in status)
    assert "zero advantage" in status[-1]
    assert not (tmp_path / "run" / "rollouts" / "step_1").exists()
