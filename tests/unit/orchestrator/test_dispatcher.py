"""The orchestrator against fake inference servers and a fake trainer: versions, staleness, failover."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import numpy as np
import pytest

from asyncrl.config.envs import EnvConfig, EnvsConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.orchestrator.checkpoint import load_latest_state
from asyncrl.orchestrator.main import run_orchestrator
from asyncrl.transport.rollouts import read_batch_part
from helpers import env_records

from .conftest import fake_trainer
from .fake_server import FakeServer


def _cfg(tmp_path, tokenizer_dir, servers, **kw) -> OrchestratorConfig:
    base = dict(
        run_dir=str(tmp_path / "run"),
        model=str(tokenizer_dir),
        servers=[s.url for s in servers],
        envs=EnvsConfig(envs=[EnvConfig(name="reverse-text")]),
        batch_size=8,
        group_size=4,
        max_steps=4,
        weights_poll_s=0.02,
        health_poll_s=0.1,
        server_ready_timeout_s=10,
    )
    return OrchestratorConfig(**(base | kw))


async def _run(cfg: OrchestratorConfig, step_time_s: float = 0.05, timeout_s: float = 60):
    seen: list = []
    trainer = asyncio.create_task(fake_trainer(cfg.run_dir, cfg.max_steps, seen, step_time_s))
    await asyncio.wait_for(run_orchestrator(cfg), timeout=timeout_s)
    await asyncio.wait_for(trainer, timeout=10)
    lines = Path(cfg.run_dir, "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    return seen, records


def _trained_versions(batch) -> np.ndarray:
    return np.concatenate([s.policy_versions[s.loss_mask] for s in batch.samples])


def test_synchronous_mode_trains_only_on_policy_tokens(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_async_steps=0, max_off_policy_steps=0)
    batches, records = asyncio.run(_run(cfg))
    assert [b.step for b in batches] == [1, 2, 3, 4]
    for b in batches:
        assert len(b.samples) >= cfg.batch_size
        assert set(_trained_versions(b).tolist()) == {b.step - 1}  # staleness 0
        for s in b.samples:  # group-relative advantages on sampled tokens only
            assert np.all(s.advantages[~s.loss_mask] == 0)
            assert s.routed_experts is not None and s.routed_experts.shape[0] == s.num_tokens
    assert [r["staleness/max"] for r in records] == [0, 0, 0, 0]
    # Synchronous: no update lands while requests run, so every salt names the weights that ran it,
    # and siblings (same prompt, same salt) hit the fake's prefix cache.
    assert all(seen.cache_salt == str(seen.version) for seen in server.seen)
    assert all(r["inference/prefix_hit_rate"] > 0 for r in records)
    assert server.version == 3  # v4 is published after the last batch; nobody needs it
    for b in batches:  # one advantage per episode; whole groups, so they sum to zero per batch
        per_sample = [np.unique(s.advantages[s.loss_mask]) for s in b.samples]
        assert all(len(a) == 1 for a in per_sample)
        assert sum(float(a[0]) for a in per_sample) == pytest.approx(0, abs=1e-5)


def test_batches_are_written_in_one_part_per_trainer_data_rank(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=2, trainer_dp_size=3)
    batches, _ = asyncio.run(_run(cfg))
    for b in batches:
        shares = [read_batch_part(cfg.run_dir, b.step, rank=r, num_ranks=3, timeout_s=0) for r in range(3)]
        assert shares[0].manifest.num_parts == 3
        ids = [s.episode_id for share in shares for s in share.batch.samples]
        assert sorted(ids) == sorted(s.episode_id for s in b.samples)
        loads = [share.batch.num_tokens for share in shares]
        assert max(loads) - min(loads) <= max(s.num_tokens for s in b.samples)


def test_heavy_tailed_latency_respects_max_off_policy_steps(tmp_path, tokenizer_dir, servers):
    # The first group never finishes: it must go stale and be dropped, while the heavy tail decides
    # which of the others land late.
    (server,) = servers(1, delay_median_s=0.02, delay_sigma=2.0, hang_first_prompt=True)
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [server],
        max_steps=6,
        max_async_steps=1,
        max_off_policy_steps=1,
        max_concurrent_groups=8,
    )
    batches, records = asyncio.run(_run(cfg, step_time_s=0.15))
    assert [b.step for b in batches] == list(range(1, 7))
    for b in batches:
        assert _trained_versions(b).min() >= b.step - 1 - cfg.max_off_policy_steps
    assert max(r["staleness/max"] for r in records) <= cfg.max_off_policy_steps
    last = records[-1]
    assert last["dropped/groups_stale_in_flight"] >= 1, "the group that never finishes is dropped as stale"


def test_the_last_batch_does_not_wait_for_a_straggler_group(tmp_path, tokenizer_dir, servers):
    # The group of the first prompt to reach the server (whichever group that is: several are
    # dispatched at once) never finishes. Every other batch is cut from the groups that finish first;
    # the last one must be too, from spare groups dispatched past max_steps, instead of waiting.
    (server,) = servers(1, hang_first_prompt=True)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=2, max_async_steps=1, max_off_policy_steps=2)
    batches, _ = asyncio.run(_run(cfg, timeout_s=20))
    assert [b.step for b in batches] == [1, 2]
    state = load_latest_state(cfg.run_dir)
    in_flight = {ref.index for ref in state.in_flight}
    assert in_flight and not in_flight & set(state.trained)  # the straggler is still in flight
    assert min(in_flight) < cfg.max_steps * cfg.groups_per_batch  # ... and it is not a spare
    assert max(state.trained) >= cfg.max_steps * cfg.groups_per_batch  # a spare filled batch 2


def test_killed_server_episodes_are_retried_and_restart_is_readmitted(tmp_path, tokenizer_dir, servers):
    (a,) = servers(1, delay_median_s=0.05, delay_sigma=0.5, hang_after=5)
    (b,) = servers(1, delay_median_s=0.05, delay_sigma=0.5)
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [a, b],
        max_steps=8,
        max_async_steps=1,
        max_off_policy_steps=2,
        request_timeout_s=3.0,
    )
    restarted: list[FakeServer] = []

    async def go():
        task = asyncio.create_task(_run(cfg, step_time_s=0.1))
        while a.num_requests <= a.hang_after:  # then a request is stuck on `a`
            await asyncio.sleep(0.01)
        await asyncio.to_thread(a.stop)
        while not Path(cfg.run_dir, "weights", "step_2", "STABLE").exists():
            await asyncio.sleep(0.01)
        # the same address comes back with fresh (v0) weights, like a restarted process
        restarted.append(FakeServer(seed=7, port=a.port, delay_median_s=0.05).start())
        try:
            return await task
        finally:
            restarted[0].stop()

    batches, records = asyncio.run(go())
    assert [x.step for x in batches] == list(range(1, 9))
    assert records[-1]["episodes/retried_total"] >= 1
    again = restarted[0]
    assert again.loaded_paths, "a re-admitted server must first be brought to the current weights"
    assert again.num_requests > 0, "the restarted server should be back in rotation"
    for batch in batches:  # nothing sampled with stale weights slipped in under the restart
        assert _trained_versions(batch).min() >= batch.step - 1 - cfg.max_off_policy_steps


def test_episodes_the_server_refuses_for_length_stay_in_training(tmp_path, tokenizer_dir, servers):
    # Reverse-text prompts are 31-36 tokens: with max_tokens 8, those over 33 (tasks 2 and 3 among the
    # first four) do not fit 41. The orchestrator is not told the limit (a standalone one without
    # max_model_len), so the server refuses them; each such episode is a length stop that keeps its
    # place in its group's baseline.
    (server,) = servers(1, max_model_len=41)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=2, sampling=SamplingParams(max_tokens=8))
    batches, records = asyncio.run(_run(cfg))
    assert [b.step for b in batches] == [1, 2]
    assert server.num_rejected > 0
    assert records[-1]["episodes/failed_total"] == 0 and records[-1]["dropped/groups_too_few_valid"] == 0


def test_a_known_context_limit_caps_every_request(tmp_path, tokenizer_dir, servers):
    # Every reverse-text prompt (31-36 tokens) + 8 new tokens exceeds 38: each request fits only
    # because the orchestrator caps its max_tokens by the limit it was told.
    (server,) = servers(1, max_model_len=38)
    envs = EnvsConfig(envs=[EnvConfig(name="reverse-text", max_total_tokens=38)])
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [server],
        max_steps=2,
        envs=envs,
        max_model_len=38,
        sampling=SamplingParams(max_tokens=8),
    )
    batches, records = asyncio.run(_run(cfg))
    assert [b.step for b in batches] == [1, 2]
    assert server.num_rejected == 0 and records[-1]["episodes/failed_total"] == 0
    assert all(s.num_tokens <= 38 for b in batches for s in b.samples)


def test_each_envs_named_rewards_and_episode_metrics_reach_the_step_record(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=2)
    _, records = asyncio.run(_run(cfg))
    # A step whose batch was cut from groups already buffered (the fake server can finish two
    # batches' worth before the first is written) has no episodes of its own: its record leaves
    # the per-env means out. Every episode trained was counted in some step's record.
    finished = env_records(records, "reverse-text")
    assert sum(r["env/reverse-text/episodes"] for r in finished) >= sum(r["batch/samples"] for r in records)
    for r in finished:
        episodes = r["env/reverse-text/episodes"]
        assert episodes >= cfg.group_size and episodes % cfg.group_size == 0
        # lcs is the env's one weighted reward, exact a weight-0 metric: both are named rewards
        assert r["env/reverse-text/lcs"] == pytest.approx(r["reward/reverse-text"])
        assert 0.0 <= r["env/reverse-text/exact"] <= r["env/reverse-text/lcs"]
        assert r["env/reverse-text/num_turns"] == 1.0 and r["env/reverse-text/num_tool_calls"] == 0.0
        assert r["env/reverse-text/failed"] == 0.0
        assert r["env/reverse-text/stop_done"] + r.get("env/reverse-text/stop_max_tokens", 0.0) == 1.0
