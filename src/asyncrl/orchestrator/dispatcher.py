"""The orchestrator's main loop: dispatch rollout groups, gate on policy versions, cut batches.

Reading order:
1. Dispatch groups of `group_size` episodes of one task while the lag bound allows: a new group
   would land in batch m (the step being filled plus what is in flight and buffered), which needs
   version >= m - 1 - max_async_steps. `max_async_steps = 0` is synchronous on-policy RL.
2. Each group's `cache_salt` is the version at dispatch. When a new version arrives, groups in
   flight whose dispatch version is already too old for the next batch are cancelled (counted).
3. Finished groups get group-relative advantages and enter the buffer; `cut(step)` drops stale
   groups, and a full batch is written atomically to `RUN/rollouts/step_n/`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs import EnvMixture
from asyncrl.envs.backend import InferenceError, ServerUnavailable
from asyncrl.envs.base import Environment, Task
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.policy import TokenPolicy
from asyncrl.envs.rollout import Episode, run_episode
from asyncrl.orchestrator.advantages import group_advantages, with_advantage
from asyncrl.orchestrator.buffer import Group, GroupBuffer, oldest_allowed_version
from asyncrl.orchestrator.metrics import Counters, StepMetrics, batch_metrics
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.transport.rollouts import write_batch
from asyncrl.wire import RolloutBatch

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)


@dataclass
class _InFlight:
    task: asyncio.Task
    dispatch_version: int


class Dispatcher:
    def __init__(
        self, cfg: OrchestratorConfig, pool: ServerPool, mixture: EnvMixture, tokenizer: ChatTokenizer
    ) -> None:
        self.cfg, self.pool, self.mixture, self.tokenizer = cfg, pool, mixture, tokenizer
        self.buffer = GroupBuffer(cfg.batch_size, cfg.max_off_policy_steps)
        self.version = 0
        self.step = cfg.start_step
        self.counters = Counters()
        self._in_flight: list[_InFlight] = []
        self._rng = random.Random(cfg.seed)
        self._task_index = (cfg.start_step - 1) * cfg.groups_per_batch
        self._wake = asyncio.Event()
        self._step_started = time.monotonic()

    # -- version events (called by the WeightUpdater) -------------------------------------------
    def on_version(self, version: int) -> None:
        self.version = version
        self._cancel_stale_in_flight()
        self._wake.set()

    def _cancel_stale_in_flight(self) -> None:
        floor = oldest_allowed_version(self.step, self.cfg.max_off_policy_steps)
        for f in self._in_flight:
            if f.dispatch_version < floor and not f.task.done():
                f.task.cancel()
                self.counters.groups_cancelled_stale += 1

    # -- dispatch ------------------------------------------------------------------------------
    def _target_step(self) -> int:
        """The batch a group dispatched now would most likely land in."""
        pending = len(self._in_flight) * self.cfg.group_size + self.buffer.num_samples
        return self.step + pending // self.cfg.batch_size

    def _may_dispatch(self) -> bool:
        target = self._target_step()
        return (
            len(self._in_flight) < self.cfg.concurrent_groups
            and target <= self.cfg.max_steps
            and self.version >= target - 1 - self.cfg.max_async_steps
        )

    def _dispatch(self) -> None:
        while self._may_dispatch():
            env_cfg, env = self.mixture.pick(self._rng)
            task = env.task("train", self._task_index)
            self._task_index += 1
            version = self.version
            coro = self._run_group(env_cfg, env, task, version)
            self._in_flight.append(_InFlight(asyncio.create_task(coro), version))
            self.counters.groups_dispatched += 1

    # -- one group -----------------------------------------------------------------------------
    async def _run_group(self, env_cfg, env: Environment, task: Task, version: int) -> Group:
        ids = [f"{task.id}/v{version}/{i}" for i in range(self.cfg.group_size)]
        episodes = await asyncio.gather(*(self._run_episode(env_cfg, env, task, version, e) for e in ids))
        return self._make_group(env_cfg.label or env_cfg.name, task, version, list(episodes))

    async def _run_episode(
        self, env_cfg, env: Environment, task: Task, version: int, episode_id: str
    ) -> Episode:
        for attempt in range(self.cfg.max_episode_retries + 1):
            policy = TokenPolicy(
                self.pool.session(episode_id),
                self.tokenizer,
                self.cfg.sampling,
                config=env_cfg,
                cache_salt=str(version),
                return_routed_experts=self.cfg.return_routed_experts,
            )
            try:
                return await run_episode(env, task, policy, config=env_cfg, episode_id=episode_id)
            except ServerUnavailable as e:
                error = e
                self.counters.episodes_retried += attempt < self.cfg.max_episode_retries
                log.warning("episode %s: %s (attempt %d)", episode_id, e, attempt + 1)
                await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
            except InferenceError as e:
                error = e
                break
            finally:
                self.pool.end_session(episode_id)
        return _failed_episode(env_cfg.label or env_cfg.name, task, episode_id, error)

    def _make_group(self, env_name: str, task: Task, version: int, episodes: list[Episode]) -> Group:
        failed = [e for e in episodes if e.failed or e.stop_reason == "aborted"]
        self.counters.episodes_failed += len(failed)
        if self.cfg.advantage.failed_episodes == "exclude":
            episodes = [e for e in episodes if e not in failed]
        rewards = [0.0 if e in failed else e.reward for e in episodes]
        adv = group_advantages(
            rewards, normalize_std=self.cfg.advantage.normalize_std, eps=self.cfg.advantage.std_eps
        )
        samples = [with_advantage(s, a) for e, a in zip(episodes, adv, strict=True) for s in e.samples]
        if self.cfg.advantage.filter_zero_advantage and all(abs(a) < 1e-9 for a in adv):
            self.counters.groups_zero_advantage += 1
            samples = []
        return Group(
            task_id=task.id,
            env=env_name,
            dispatch_version=version,
            samples=samples,
            rewards=rewards,
            episode_metrics=[e.metrics | {"reward": r} for e, r in zip(episodes, rewards, strict=True)],
        )

    # -- main loop -----------------------------------------------------------------------------
    async def run(self, on_batch: Callable[[int, dict[str, float | int]], None] | None = None) -> None:
        """Produce batches start_step..max_steps; `on_batch(step, metrics)` is called after each write."""
        pending_metrics = StepMetrics()
        while self.step <= self.cfg.max_steps:
            self._dispatch()
            idle_t0 = time.monotonic() if not self._in_flight else None
            await self._wait_for_event()
            if idle_t0 is not None:
                self.counters.inference_idle_s += time.monotonic() - idle_t0
            for group in self._collect_finished():
                pending_metrics.add_group(group)
                self.buffer.add(group)
            while self.version >= self.step - 1 - self.cfg.max_async_steps and (
                cut := self.buffer.cut(self.step)
            ):
                batch, _groups = cut
                path = write_batch(self.cfg.run_dir, batch)
                metrics = self._batch_metrics(batch, pending_metrics)
                pending_metrics = StepMetrics()
                log.info("wrote %s", path)
                if on_batch is not None:
                    on_batch(batch.step, metrics)
                self.step += 1
                self._step_started = time.monotonic()
        for f in self._in_flight:
            f.task.cancel()
        await asyncio.gather(*(f.task for f in self._in_flight), return_exceptions=True)

    def _batch_metrics(self, batch: RolloutBatch, since: StepMetrics) -> dict[str, float | int]:
        metrics = batch_metrics(
            batch,
            since,
            self.counters,
            policy_version=self.version,
            num_dropped_stale_queue=self.buffer.num_dropped_groups,
            step_seconds=time.monotonic() - self._step_started,
            inference=self.pool.stats.take(),
        )
        self.counters.inference_idle_s = 0.0  # per step; the other counters are run totals
        return metrics

    async def _wait_for_event(self) -> None:
        self._wake.clear()
        waiters = [f.task for f in self._in_flight]
        wake = asyncio.create_task(self._wake.wait())
        await asyncio.wait([*waiters, wake], return_when=asyncio.FIRST_COMPLETED, timeout=1.0)
        wake.cancel()

    def _collect_finished(self) -> list[Group]:
        done = [f for f in self._in_flight if f.task.done()]
        self._in_flight = [f for f in self._in_flight if not f.task.done()]
        groups = []
        for f in done:
            if f.task.cancelled():
                continue
            exc = f.task.exception()
            if exc is not None:
                raise exc  # a bug in our own code: surface it, the launcher names this process
            groups.append(f.task.result())
        return groups


def _failed_episode(env: str, task: Task, episode_id: str, error: Exception | None) -> Episode:
    return Episode(
        episode_id=episode_id,
        env=env,
        task_id=task.id,
        reward=0.0,
        rewards={},
        samples=[],
        metrics={"failed": 1.0, "num_turns": 0.0},
        stop_reason="error",
        error=f"{type(error).__name__}: {error}",
    )
