"""The orchestrator's main loop: dispatch rollout groups, gate on policy versions, cut batches.

Reading order:
1. Dispatch groups of `group_size` episodes of one task while the lag bound allows: a new group
   would land in batch m (the step being filled plus what is in flight and buffered), which needs
   version >= m - 1 - max_async_steps. `max_async_steps = 0` is synchronous on-policy RL. Up to
   one batch's worth of groups may land past `max_steps`: spares, so that the last batch is cut
   from the first groups to finish, as every other batch is, rather than waiting for the slowest
   group of the tail (spares still in flight at the end are cancelled).
2. Each request's `cache_salt` is the version the servers hold when it is sent (every turn and
   every retry reads it anew), so siblings share prefix-cache blocks and a later turn never asks
   for KV of older weights; each server keeps KV of different weights apart as well (the engine
   keys cached blocks by the weights that computed them, VLLMBackend adds a weights epoch to the
   salt), so nothing old is served to a request sent inside an update either. When a new version
   arrives, groups in flight whose dispatch version is already too old for the next batch are
   cancelled (counted).
3. Finished groups get group-relative advantages over their valid episodes (failed ones are
   counted, never trained; see `advantages`) and enter the buffer; `cut(step)` drops stale
   groups, and a full batch is written atomically to `RUN/rollouts/step_n/`, together with the
   orchestrator's checkpoint (`snapshot`; `restore` continues from it, see checkpoint.py). A write
   the disk refuses is retried, with the groups kept, until it succeeds. No sample longer than the
   trainer's `seq_len` ever enters a batch: the trainer could not pack it, and a written batch is
   re-read on every resume. The config check (every env's max_total_tokens <= seq_len) keeps such
   samples from being sampled; should one appear anyway, its group fails (`SampleTooLongError`,
   logged and counted as a group error) before it reaches the buffer.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from pathlib import Path

from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs import EnvMixture
from asyncrl.envs.base import Environment, Task
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.rollout import Episode
from asyncrl.orchestrator.advantages import is_valid, valid_group_samples
from asyncrl.orchestrator.buffer import Group, GroupBuffer, oldest_allowed_version
from asyncrl.orchestrator.checkpoint import GroupRef, OrchestratorState, encode_state
from asyncrl.orchestrator.episodes import EpisodeRunner
from asyncrl.orchestrator.fill import FillTracker
from asyncrl.orchestrator.metrics import Counters, StepMetrics, step_record
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.run_dir import rollouts_root
from asyncrl.transport.rollouts import write_batch
from asyncrl.wire import RolloutBatch

__all__ = ["Dispatcher", "SampleTooLongError"]

log = logging.getLogger(__name__)


class SampleTooLongError(RuntimeError):
    """A finished group holds a sample longer than the trainer's seq_len: it must never be written."""


@dataclass
class _InFlight:
    task: asyncio.Task
    dispatch_version: int
    ref: GroupRef
    cancelled: bool = False  # cancelled as stale: already counted as dropped


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
        self.fill = FillTracker(
            batch_size=cfg.batch_size,
            max_groups=cfg.fill_group_limit,
            interval_s=cfg.fill_status_interval_s,
            step=cfg.start_step,
        )
        self._consecutive_errors = 0
        self._redispatch: deque[GroupRef] = deque()  # in flight at the checkpoint we resumed from
        self._dropped: list[tuple[int, str]] = []  # (group index, reason) since the last batch
        self.episodes = EpisodeRunner(
            pool,
            tokenizer,
            cache_salt=self._cache_salt,
            max_retries=cfg.max_episode_retries,
            max_model_len=cfg.max_model_len,
        )

    # -- checkpoint ----------------------------------------------------------------------------
    def restore(self, state: OrchestratorState) -> None:
        """Continue after batch `state.step`: its buffer, task stream, counters; re-run its in-flight
        groups."""
        self.step = state.step + 1
        self._task_index = state.next_index
        self._rng.setstate(state.rng_state)
        known = {f.name for f in fields(Counters)}
        self.counters = Counters(**{k: v for k, v in state.counters.items() if k in known})
        self.buffer.load(
            state.buffered,
            int(state.counters.get("buffer_dropped_groups", 0)),
            int(state.counters.get("buffer_dropped_samples", 0)),
        )
        self._redispatch.extend(state.in_flight)
        self.fill.reset(self.step, self._num_stale_groups)

    def snapshot(self, step: int, trained: list[Group], metrics: dict) -> OrchestratorState:
        """The state right after cutting batch `step` out of the buffer."""
        counters = asdict(self.counters) | {
            "buffer_dropped_groups": self.buffer.num_dropped_groups,
            "buffer_dropped_samples": self.buffer.num_dropped_samples,
        }
        in_flight = [*self._redispatch, *(f.ref for f in self._in_flight if not f.cancelled)]
        return OrchestratorState(
            step=step,
            next_index=self._task_index,
            rng_state=self._rng.getstate(),
            version=self.version,
            counters=counters,
            buffered=self.buffer.groups,
            in_flight=in_flight,
            trained=[g.index for g in trained],
            dropped=list(self._dropped),
            metrics=metrics,
        )

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
                f.cancelled = True
                self._dropped.append((f.ref.index, "stale_in_flight"))
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
            and target <= self.cfg.max_steps + 1  # one batch of spares for the last batch
            and self.version >= target - 1 - self.cfg.max_async_steps
        )

    def _dispatch(self) -> None:
        while self._may_dispatch():
            ref = self._redispatch.popleft() if self._redispatch else self._next_group()
            env_cfg, env = self.mixture.configs[ref.env_index], self.mixture.envs[ref.env_index]
            task = env.task("train", ref.index)
            version = self.version
            coro = self._run_group(env_cfg, env, task, version, ref.index)
            self._in_flight.append(_InFlight(asyncio.create_task(coro), version, ref))
            self.counters.groups_dispatched += 1

    def _cache_salt(self) -> str:
        """The salt of a request sent now: the version the servers hold (read per turn and retry)."""
        return str(self.version)

    def _next_group(self) -> GroupRef:
        """The next group of the task stream: an env picked by the seeded RNG, the next task index."""
        env_cfg, _ = self.mixture.pick(self._rng)
        env_index = next(i for i, c in enumerate(self.mixture.configs) if c is env_cfg)
        self._task_index += 1
        return GroupRef(index=self._task_index - 1, env_index=env_index)

    # -- one group -----------------------------------------------------------------------------
    async def _run_group(self, env_cfg, env: Environment, task: Task, version: int, index: int) -> Group:
        ids = [f"{task.id}/v{version}/{i}" for i in range(self.cfg.group_size)]
        episodes = await asyncio.gather(*(self._run_episode(env_cfg, env, task, version, e) for e in ids))
        return self._make_group(env_cfg.label or env_cfg.name, task, version, list(episodes), index)

    async def _run_episode(
        self, env_cfg, env: Environment, task: Task, version: int, episode_id: str
    ) -> Episode:
        return await self.episodes.run(
            env_cfg,
            env,
            task,
            self.cfg.sampling,
            episode_id,
            return_routed_experts=self.cfg.return_routed_experts,
            on_retry=self._count_retry,
        )

    def _count_retry(self) -> None:
        self.counters.episodes_retried += 1

    def _make_group(
        self, env_name: str, task: Task, version: int, episodes: list[Episode], index: int = -1
    ) -> Group:
        """Advantages over the valid episodes (see `advantages`); failed ones are counted, never trained."""
        valid = [e for e in episodes if is_valid(e)]
        self._check_sample_lengths(valid)
        self.counters.episodes_failed += len(episodes) - len(valid)
        scored = valid_group_samples(
            episodes, normalize_std=self.cfg.advantage.normalize_std, eps=self.cfg.advantage.std_eps
        )
        samples: list = []
        if scored is None:
            self.counters.groups_too_few_valid += 1
        elif self.cfg.advantage.filter_zero_advantage and all(abs(a) < 1e-9 for a in scored[1]):
            self.counters.groups_zero_advantage += 1
        else:
            samples = scored[0]
        return Group(
            task_id=task.id,
            env=env_name,
            dispatch_version=version,
            samples=samples,
            rewards=[e.reward for e in valid],
            episode_metrics=[e.rewards | e.metrics | {"reward": e.reward} for e in episodes],
            index=index,
        )

    def _check_sample_lengths(self, episodes: list[Episode]) -> None:
        for e in episodes:
            longest = max((s.num_tokens for s in e.samples), default=0)
            if longest > self.cfg.seq_len:
                raise SampleTooLongError(
                    f"episode {e.episode_id} has a sample of {longest} tokens, more than seq_len "
                    f"({self.cfg.seq_len}), the trainer's packed row, although its env's max_total_tokens "
                    "fits seq_len; its group is dropped so that no batch the trainer cannot pack is written"
                )

    # -- main loop -----------------------------------------------------------------------------
    async def run(
        self,
        on_batch: Callable[[int, dict[str, float | int]], None] | None = None,
        on_fill_status: Callable[[str], None] | None = None,
    ) -> None:
        """Produce batches start_step..max_steps; `on_batch(step, metrics)` is called after each write,
        `on_fill_status(line)` every `fill_status_interval_s` while a batch fills.

        Raises `FillStalledError` when `max_fill_groups` groups go by without filling a batch.
        """
        pending_metrics = StepMetrics()
        while self.step <= self.cfg.max_steps:
            self._dispatch()
            idle_t0 = time.monotonic() if not self._in_flight else None
            await self._wait_for_event()
            if idle_t0 is not None:
                self.counters.inference_idle_s += time.monotonic() - idle_t0
            for group in self._collect_finished():
                pending_metrics.add_group(group)
                if not group.samples:
                    self._dropped.append((group.index, "no_samples"))  # zero advantage or all failed
                self.buffer.add(group)
                self.fill.add(group)
            # bounded by max_steps here too: a buffer can hold more than one batch (a resume, or
            # the spares of the last batch), and cutting past the run's end writes a batch too many
            while (
                self.step <= self.cfg.max_steps
                and self.version >= self.step - 1 - self.cfg.max_async_steps
                and (cut := self.buffer.cut(self.step))
            ):
                batch, groups = cut
                metrics = self._step_record(batch, pending_metrics)
                path = await self._write(batch, groups, metrics)
                pending_metrics = StepMetrics()
                log.info("wrote %s", path)
                if on_batch is not None:
                    on_batch(batch.step, metrics)
                self.step += 1
                self._step_started = time.monotonic()
                self.fill.reset(self.step, self._num_stale_groups)
            self._report_fill(on_fill_status)
        for f in self._in_flight:
            f.task.cancel()
        await asyncio.gather(*(f.task for f in self._in_flight), return_exceptions=True)

    @property
    def _num_stale_groups(self) -> int:
        return self.buffer.num_dropped_groups + self.counters.groups_cancelled_stale

    def _report_fill(self, on_fill_status: Callable[[str], None] | None) -> None:
        if self.step > self.cfg.max_steps:
            return
        if on_fill_status is not None and self.fill.due():
            on_fill_status(self.fill.status(self.buffer.num_samples, self._num_stale_groups))
        self.fill.check(self.buffer.num_samples, self._num_stale_groups)

    async def _write(self, batch: RolloutBatch, groups: list[Group], metrics: dict) -> Path:
        """Write batch + checkpoint; while the disk refuses (full, read-only), keep the groups and retry."""
        self._dropped += [(i, "stale_queue") for i in self.buffer.dropped_indices]
        self.buffer.dropped_indices.clear()
        attempt = 0
        while True:
            state = self.snapshot(batch.step, groups, metrics)  # in flight may change while we wait
            try:
                path = write_batch(
                    self.cfg.run_dir, batch, encode_state(state), num_parts=self.cfg.trainer_dp_size
                )
            except FileExistsError:
                raise  # two writers on one run dir: never overwrite a batch
            except OSError as e:
                delay = min(0.5 * 2**attempt, 30.0)
                log.error(
                    "cannot write batch %d under %s (%s); its groups are kept, retrying in %.1fs",
                    batch.step,
                    rollouts_root(self.cfg.run_dir),
                    e,
                    delay,
                )
                await asyncio.sleep(delay)
                attempt += 1
                continue
            self._dropped.clear()
            return path

    def _step_record(self, batch: RolloutBatch, since: StepMetrics) -> dict[str, float | int]:
        metrics = step_record(
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
            if f.cancelled or f.task.cancelled():  # a stale group that finished anyway stays dropped
                continue
            exc = f.task.exception()
            if exc is not None:  # one group's failure is counted and logged; the run goes on
                self.counters.groups_error += 1
                self._dropped.append((f.ref.index, "error"))
                self._consecutive_errors += 1
                log.error("group dispatched at v%d failed", f.dispatch_version, exc_info=exc)
                if self._consecutive_errors >= 2 * self.cfg.concurrent_groups:
                    raise RuntimeError(  # every group fails: a bug, not bad luck; the launcher names us
                        f"{self._consecutive_errors} rollout groups in a row failed; last error: {exc!r}"
                    ) from exc
                continue
            self._consecutive_errors = 0
            groups.append(f.task.result())
        return groups
