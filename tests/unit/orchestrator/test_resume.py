"""The orchestrator's checkpoint: round trip, and crash + resume without losing a group."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest

from asyncrl.orchestrator.buffer import Group
from asyncrl.orchestrator.checkpoint import (
    STATE_FILE,
    GroupRef,
    OrchestratorState,
    encode_state,
    load_latest_state,
    load_state,
)
from asyncrl.orchestrator.main import run_orchestrator
from asyncrl.run_dir import batch_dir
from asyncrl.transport.metrics import read_metrics
from asyncrl.transport.rollouts import write_batch
from asyncrl.wire import RolloutBatch, RolloutSample
from integration.faults.audit import audit_run

from .conftest import fake_trainer
from .test_dispatcher import _cfg


def _sample(n: int, seed: int) -> RolloutSample:
    rng = np.random.default_rng(seed)
    return RolloutSample(
        token_ids=rng.integers(0, 256, n).astype(np.int32),
        loss_mask=np.arange(n) >= 2,
        inference_logprobs=-rng.random(n).astype(np.float32),
        advantages=np.full(n, 0.5, np.float32),
        temperatures=np.ones(n, np.float32),
        policy_versions=np.full(n, 1, np.int32),
        reward=float(seed),
        episode_id=f"ep-{seed}",
    )


def _group(index: int, env: str, version: int, samples: list[RolloutSample]) -> Group:
    """A finished group of two samples (rewards 1 and 0), task t<index>."""
    return Group(
        task_id=f"t{index}",
        env=env,
        dispatch_version=version,
        samples=samples,
        rewards=[1.0, 0.0],
        episode_metrics=[{"reward": 1.0}, {"reward": 0.0}],
        index=index,
    )


def test_state_round_trip_keeps_buffer_stream_position_and_in_flight(tmp_path):
    rng = random.Random(7)
    rng.random()
    groups = [_group(i, "e", 1, [_sample(5 + i, i), _sample(4, 10 + i)]) for i in (3, 5)]
    state = OrchestratorState(
        step=2,
        next_index=9,
        rng_state=rng.getstate(),
        version=1,
        counters={"groups_dispatched": 9},
        buffered=groups,
        in_flight=[GroupRef(index=7, env_index=0)],
        trained=[0, 1, 2],
        dropped=[(4, "stale_queue")],
        metrics={"reward/mean": 0.5},
    )
    batch = RolloutBatch(step=2, samples=[_sample(6, 99)])
    write_batch(tmp_path, batch, encode_state(state))
    back = load_latest_state(tmp_path)
    assert back is not None and back.step == 2 and back.next_index == 9 and back.version == 1
    assert [g.index for g in back.buffered] == [3, 5]
    for a, b in zip(groups, back.buffered, strict=True):
        assert [s.num_tokens for s in a.samples] == [s.num_tokens for s in b.samples]
        assert all(
            np.array_equal(x.token_ids, y.token_ids) for x, y in zip(a.samples, b.samples, strict=True)
        )
    assert back.in_flight == [GroupRef(index=7, env_index=0)] and back.dropped == [(4, "stale_queue")]
    resumed = random.Random()
    resumed.setstate(back.rng_state)
    assert resumed.random() == rng.random()  # the env picker continues where it was
    assert back.trained == [0, 1, 2] and back.metrics == {"reward/mean": 0.5}


def test_an_empty_buffer_round_trips(tmp_path):
    state = OrchestratorState(
        step=1,
        next_index=2,
        rng_state=random.Random(0).getstate(),
        version=0,
        counters={},
        buffered=[],
        in_flight=[],
    )
    write_batch(tmp_path, RolloutBatch(step=1, samples=[_sample(4, 0)]), encode_state(state))
    back = load_state(batch_dir(tmp_path, 1) / STATE_FILE)
    assert back.buffered == [] and back.in_flight == [] and back.next_index == 2


async def _crash_after(cfg, step: int) -> None:
    """Run the orchestrator until rollouts/step_{step} exists, then kill it (cancel: no clean-up runs)."""
    task = asyncio.create_task(run_orchestrator(cfg))
    while not batch_dir(cfg.run_dir, step).is_dir():
        assert not task.done(), task.exception()
        await asyncio.sleep(0.005)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _crash_and_resume(cfg, crash_after: int) -> list:
    seen: list = []
    trainer = asyncio.create_task(fake_trainer(cfg.run_dir, cfg.max_steps, seen, 0.05))
    await asyncio.wait_for(_crash_after(cfg, crash_after), timeout=60)
    await asyncio.wait_for(run_orchestrator(cfg.model_copy(update={"resume": True})), timeout=60)
    await asyncio.wait_for(trainer, timeout=10)
    return seen


@pytest.mark.parametrize("crash_after", [1, 2])
def test_crash_and_resume_loses_no_group_and_continues_the_stream(
    tmp_path, tokenizer_dir, servers, crash_after
):
    (server,) = servers(1, delay_median_s=0.01, delay_sigma=1.0)
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [server],
        max_steps=5,
        max_async_steps=2,
        max_off_policy_steps=2,
        advantage={"filter_zero_advantage": False},
    )
    seen = asyncio.run(_crash_and_resume(cfg, crash_after))
    assert [b.step for b in seen] == [1, 2, 3, 4, 5]
    before = load_state(batch_dir(cfg.run_dir, crash_after) / STATE_FILE)
    assert before.in_flight or before.buffered, "the crash point must leave work to resume"
    audit = audit_run(cfg.run_dir, max_steps=5, roles=("orchestrator",))
    audit.check()
    # what the checkpoint held (buffered, or in flight: re-run) was trained after the restart
    redone = {r.index for r in before.in_flight} | {g.index for g in before.buffered}
    assert redone & set(audit.trained)
    assert min(audit.trained[i] for i in redone if i in audit.trained) > crash_after
    # the orchestrator's metric line of every step appears once, also the one of the crash step
    assert sorted(r["step"] for r in read_metrics(cfg.run_dir, "orchestrator")) == [1, 2, 3, 4, 5]


def test_resume_after_the_last_batch_writes_nothing(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=2)
    seen: list = []

    async def go():
        trainer = asyncio.create_task(fake_trainer(cfg.run_dir, 2, seen))
        await asyncio.wait_for(run_orchestrator(cfg), timeout=60)
        await trainer
        await asyncio.wait_for(run_orchestrator(cfg.model_copy(update={"resume": True})), timeout=30)

    asyncio.run(go())
    assert len(read_metrics(cfg.run_dir, "orchestrator")) == 2


def test_a_fresh_start_over_existing_batches_is_refused(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=2)
    write_batch(cfg.run_dir, RolloutBatch(step=1, samples=[_sample(4, 0)]))
    with pytest.raises(ValueError, match="resume = true"):
        asyncio.run(run_orchestrator(cfg))


def test_a_resumed_buffer_of_two_batches_writes_no_batch_past_max_steps(tmp_path, tokenizer_dir, servers):
    """Resumed after batch 1 of 2 with two batches' worth buffered and the async bound allowing a
    second cut at once: batch 2 is written, and no batch 3 (the cut loop stops at max_steps)."""
    (server,) = servers(1)
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [server],
        max_steps=2,
        max_async_steps=2,
        max_off_policy_steps=4,
        advantage={"filter_zero_advantage": False},
    )
    groups = [_group(i, "reverse-text", 0, [_sample(6, 2 * i), _sample(6, 2 * i + 1)]) for i in range(2, 10)]
    state = OrchestratorState(
        step=1,
        next_index=10,
        rng_state=random.Random(0).getstate(),
        version=0,
        counters={},
        buffered=groups,  # 16 samples: two batches of 8
        in_flight=[],
        trained=[0, 1],
    )
    write_batch(cfg.run_dir, RolloutBatch(step=1, samples=[_sample(4, 0)]), encode_state(state))
    asyncio.run(asyncio.wait_for(run_orchestrator(cfg.model_copy(update={"resume": True})), timeout=60))
    assert batch_dir(cfg.run_dir, 2).is_dir()
    assert not batch_dir(cfg.run_dir, 3).exists()
