"""Faults around the orchestrator (fake servers, fake trainer): failing and slow envs, a full rollouts
disk, half-published weights. Each run must finish with every group trained or dropped with a reason."""

from __future__ import annotations

import asyncio
import errno
import logging

from asyncrl.config.envs import EnvConfig, EnvsConfig
from asyncrl.envs.builtin.reverse_text import ReverseTextEnv
from asyncrl.envs.registry import available_envs, register_env
from asyncrl.orchestrator import dispatcher as dispatcher_module
from asyncrl.orchestrator.main import run_orchestrator
from asyncrl.run_dir import weights_dir
from asyncrl.transport.metrics import read_metrics
from integration.faults.audit import audit_run

from .conftest import fake_trainer
from .test_dispatcher import _cfg


class _RaisingEnv(ReverseTextEnv):
    """reverse-text whose set-up raises on every odd task: an environment bug."""

    async def setup(self, task):
        if int(task.id.rsplit("/", 1)[1]) % 2:
            raise RuntimeError(f"env bug on {task.id}")
        return await super().setup(task)


if "raising-reverse-text" not in available_envs():
    register_env("raising-reverse-text", lambda seed=0, **kw: _RaisingEnv(seed=seed, **kw))


def _run(cfg) -> list:
    seen: list = []

    async def go():
        trainer = asyncio.create_task(fake_trainer(cfg.run_dir, cfg.max_steps, seen))
        await asyncio.wait_for(run_orchestrator(cfg), timeout=90)
        await asyncio.wait_for(trainer, timeout=10)

    asyncio.run(go())
    return seen


def test_an_env_that_raises_fails_episodes_not_the_run(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    envs = EnvsConfig(envs=[EnvConfig(name="raising-reverse-text")])
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=3, envs=envs)
    seen = _run(cfg)
    assert [b.step for b in seen] == [1, 2, 3]
    assert all(int(s.episode_id.split("/")[2]) % 2 == 0 for b in seen for s in b.samples)
    last = read_metrics(cfg.run_dir, "orchestrator")[-1]
    assert last["episodes/failed_total"] >= 2 * cfg.group_size  # odd tasks fail, whole groups
    audit = audit_run(cfg.run_dir, max_steps=3, roles=("orchestrator",))
    audit.check()
    assert audit.dropped["no_samples"] >= 2  # failed groups: zero advantage, dropped and counted


def test_a_slow_heavy_tailed_env_still_finishes_within_the_staleness_bound(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    slow = EnvConfig(name="reverse-text", latency={"median_s": 0.02, "sigma": 1.5, "max_s": 0.4})
    cfg = _cfg(
        tmp_path,
        tokenizer_dir,
        [server],
        max_steps=4,
        envs=EnvsConfig(envs=[slow]),
        max_async_steps=1,
        max_off_policy_steps=1,
    )
    _run(cfg)
    records = read_metrics(cfg.run_dir, "orchestrator")
    assert max(r["staleness/max"] for r in records) <= 1
    audit_run(cfg.run_dir, max_steps=4, roles=("orchestrator",)).check()


def test_weights_without_stable_are_never_loaded(tmp_path, tokenizer_dir, servers):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=3)
    half = weights_dir(cfg.run_dir, 7)  # a publisher that died between rename and STABLE
    half.mkdir(parents=True)
    (half / "config.json").write_text("{}")
    _run(cfg)
    assert server.loaded_paths and not any("step_7" in p for p in server.loaded_paths)
    audit_run(cfg.run_dir, max_steps=3, roles=("orchestrator",)).check()


def test_a_full_disk_blocks_and_retries_without_losing_groups(
    tmp_path, tokenizer_dir, servers, monkeypatch, caplog
):
    (server,) = servers(1)
    cfg = _cfg(tmp_path, tokenizer_dir, [server], max_steps=3, max_async_steps=1)
    real_write, refused = dispatcher_module.write_batch, []

    def full_disk(run_dir, batch, attachments=None, **kwargs):
        if batch.step == 2 and len(refused) < 3:
            refused.append(batch.step)
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(run_dir, batch, attachments, **kwargs)

    monkeypatch.setattr(dispatcher_module, "write_batch", full_disk)
    with caplog.at_level(logging.ERROR, logger="asyncrl.orchestrator.dispatcher"):
        seen = _run(cfg)
    assert refused == [2, 2, 2] and [b.step for b in seen] == [1, 2, 3]
    assert (
        sum("cannot write batch 2" in r.message and "No space left" in r.message for r in caplog.records) == 3
    )
    audit_run(cfg.run_dir, max_steps=3, roles=("orchestrator",)).check()
