"""Held-out evals while the run trains: every `interval` policy versions, on the same servers.

Reading order:
1. `on_version(v)` (the weight updater's callback, as the dispatcher's) starts the eval that is
   due: v0, then the first version the servers hold at or past each multiple of `interval`, and
   the final version `max_steps` (`eval_metrics.next_due`). One eval runs at a time; a version
   that comes due meanwhile is evaluated when it ends, at the version the servers hold then.
2. An eval of v rolls out tasks 0..num_tasks-1 of each eval env's eval split: `k` episodes at the
   training temperature and one greedy episode per task. Its requests go through the pool like
   the training rollouts' (same routing, salts and retries), under episode ids `eval/v<v>/...`,
   uncounted in the step's inference stats; they never reach the dispatcher, so no eval sample
   enters a batch, a training metric or the lag bound. Training goes on meanwhile.
3. Pinned to one version, by record: the servers are never held at v, since that would stall
   training. Every token carries the version that sampled it, and the line records the share of
   the eval's sampled tokens that v sampled (`eval/tokens_on_version`: 1.0 unless an update landed
   mid-eval; the rest came from newer versions, up to `eval/newest_version`).
4. The line, role "eval" and step = version = v, goes to RUN/metrics.jsonl (`eval_metrics.eval_record`)
   and to the console. Then the keep-set (`weights/keep.json`) is rewritten: the version being
   evaluated and the best version by `keep_best` stay on disk whatever the trainer prunes.

The eval's state is durable of itself, not in the batch checkpoint (an eval starts and ends
between batches): its lines in metrics.jsonl say which versions were evaluated, and the keep-set
names the version whose eval was under way. `resume` redoes that eval, at that version, before
training goes on: it loads the version's weights (kept on disk as the eval's) into the servers,
evaluates, and the orchestrator then loads the newest weights. A version whose weights were
retracted (newer than the trainer's checkpoint; `asyncrl rl --resume` removes their eval lines
too) is evaluated when the trainer publishes it again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl.config.envs import EnvConfig
from asyncrl.config.orchestrator import OrchestratorConfig
from asyncrl.envs import EnvMixture
from asyncrl.envs.base import Environment, Task
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.registry import build_env
from asyncrl.envs.rollout import Episode
from asyncrl.orchestrator.episodes import EpisodeRunner
from asyncrl.orchestrator.eval_metrics import EnvEval, best_version, eval_record, format_eval_line, next_due
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.orchestrator.weights import WeightUpdater
from asyncrl.run_dir import weights_dir
from asyncrl.transport.metrics import MetricsWriter, read_metrics
from asyncrl.transport.weights import STABLE_MARKER, holds_tensors, read_keep_set, write_keep_set
from asyncrl.wire import SamplingParams

__all__ = ["Evaluator", "best_weights", "version_weights"]

log = logging.getLogger(__name__)


class Evaluator:
    def __init__(
        self,
        cfg: OrchestratorConfig,
        pool: ServerPool,
        tokenizer: ChatTokenizer,
        mixture: EnvMixture,
        *,
        on_line: Callable[[str], None] = print,
    ) -> None:
        self.cfg, self.ev, self.pool, self.on_line = cfg, cfg.eval, pool, on_line
        self.run_dir = Path(cfg.run_dir)
        self.envs = _eval_envs(cfg, mixture)
        # drawn once, at start: an env without an eval split fails here, and every eval sees the same tasks
        self.tasks = {
            label: [env.task("eval", i) for i in range(self.ev.num_tasks)]
            for label, (_, env) in self.envs.items()
        }
        self.episodes = EpisodeRunner(
            pool,
            tokenizer,
            cache_salt=lambda: str(self.version),
            max_retries=cfg.max_episode_retries,
            max_model_len=cfg.max_model_len,
        )
        self.writer = MetricsWriter(self.run_dir, "eval")
        self.version = 0  # what the servers hold
        # a fresh run starts its schedule over, whatever an earlier attempt left in the run dir
        history = read_metrics(self.run_dir, "eval") if cfg.resume else []
        self.records = {int(r["version"]): r for r in history}
        self.next_due = next_due(max(self.records, default=None), self.ev.interval, cfg.max_steps)
        pinned = read_keep_set(self.run_dir) if cfg.resume else {}
        interrupted = sorted(v for v in pinned if v not in self.records)
        self.interrupted = interrupted[0] if interrupted else None
        if self.interrupted is not None:
            self.next_due = self.interrupted  # the eval a crash cut short is owed at its own version
        self.best = self._best()
        self._running: tuple[int, asyncio.Task] | None = None
        self._error: BaseException | None = None
        self._changed = asyncio.Event()

    # -- schedule ------------------------------------------------------------------------------
    def on_version(self, version: int) -> None:
        """The servers hold `version` now: start the eval that is due, unless one runs."""
        self.version = version
        self._maybe_start()
        self._changed.set()

    def _maybe_start(self) -> None:
        due = self.next_due
        if self._running is not None or self._error is not None or due is None or self.version < due:
            return
        version = self.version
        task = asyncio.create_task(self._evaluate(version))
        self._running = (version, task)
        self._write_keep_set()
        task.add_done_callback(self._finished)

    def _finished(self, task: asyncio.Task) -> None:
        self._running = None
        self._changed.set()
        if task.cancelled():  # the orchestrator stops: its keep-set still names the version
            return
        if task.exception() is not None:
            self._error = task.exception()
            log.error("the eval failed; no further evals run", exc_info=self._error)
        self._maybe_start()

    async def resume(self, updater: WeightUpdater) -> None:
        """At start: rewrite the keep-set, and redo at its own version an eval that a crash cut short."""
        self._write_keep_set()
        version = self.interrupted
        if version is None:
            return
        held = await self.pool.call_all(lambda b: b.weights())
        if {getattr(info, "version", None) for info in held.values()} != {version}:  # fresh servers: v0
            if version == 0 or not self._on_disk(version):
                log.warning(
                    "the eval of v%d was interrupted and its weights cannot be loaded now (retracted for "
                    "a resume); it runs when the servers get v%d again",
                    version,
                    version,
                )
                return
            log.info("redoing the eval of v%d, interrupted by a crash: loading its weights first", version)
            await updater.update(version)
        self.on_version(version)
        await self._wait_until(lambda: self._running is None)

    async def finish(self) -> None:
        """At the end of the run: wait for the evals still due (up to the final version), name the best."""
        await self._wait_until(lambda: self._running is None and self.next_due is None)
        if self.best is not None:
            version, value = self.best
            self.on_line(
                f"[orchestrator] best version by {self.ev.keep_best}: v{version} ({value:.4f}), "
                f"{self._path(version)}"
            )

    async def aclose(self) -> None:
        """Stop the eval under way, if any; it is redone on resume."""
        if self._running is not None:
            task = self._running[1]
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _wait_until(self, done: Callable[[], bool]) -> None:
        while not done():
            if self._error is not None:
                raise self._error
            self._changed.clear()
            await self._changed.wait()
        if self._error is not None:
            raise self._error

    # -- one eval ------------------------------------------------------------------------------
    async def _evaluate(self, version: int) -> None:
        t0 = time.monotonic()
        labels = list(self.envs)
        results = await asyncio.gather(*(self._evaluate_env(version, label) for label in labels))
        record = eval_record(
            version,
            dict(zip(labels, results, strict=True)),
            k=self.ev.k,
            pass_threshold=self.ev.pass_threshold,
            seconds=time.monotonic() - t0,
        )
        self.writer.write(version, record)
        self.records[version] = record
        self.on_line(format_eval_line(record, labels, self.ev.k))
        self.next_due = next_due(version, self.ev.interval, self.cfg.max_steps)
        self.best = self._best()
        self._running = None  # the keep-set below no longer names this version as being evaluated
        self._write_keep_set()

    async def _evaluate_env(self, version: int, label: str) -> EnvEval:
        env_cfg, env = self.envs[label]
        sampling = self.cfg.sampling
        greedy = sampling.model_copy(update={"temperature": 0.0})

        def run(task: Task, name: str, params: SamplingParams) -> asyncio.Task[Episode]:
            episode_id = f"eval/v{version}/{task.id}/{name}"
            return asyncio.create_task(self.episodes.run(env_cfg, env, task, params, episode_id, count=False))

        tasks = self.tasks[label]
        sampled = [[run(t, str(j), sampling) for j in range(self.ev.k)] for t in tasks]
        greedies = [run(t, "greedy", greedy) for t in tasks] if self.ev.greedy else []
        every = [*(f for fs in sampled for f in fs), *greedies]
        try:
            await asyncio.gather(*every)
        finally:  # cancelled (the run stops) or a bug: no episode outlives its eval
            for f in every:
                f.cancel()
        return EnvEval(
            sampled=[[f.result() for f in fs] for fs in sampled], greedy=[f.result() for f in greedies]
        )

    # -- the best version and the keep-set -----------------------------------------------------
    def _on_disk(self, version: int) -> bool:
        return version_weights(self.run_dir, self.cfg.model, version) is not None

    def _path(self, version: int) -> Path:
        return Path(self.cfg.model) if version == 0 else weights_dir(self.run_dir, version)

    def _best(self) -> tuple[int, float] | None:
        if self.ev.keep_best is None:
            return None
        return best_version(self.records.values(), self.ev.keep_best, self._on_disk)

    def _write_keep_set(self) -> None:
        steps: dict[int, str] = {}
        if self.best is not None and self.best[0] > 0:
            steps[self.best[0]] = f"best by {self.ev.keep_best} ({self.best[1]:.4f})"
        if self._running is not None:
            steps[self._running[0]] = "eval in progress"
        elif self.interrupted is not None and self.interrupted not in self.records:
            steps[self.interrupted] = "eval interrupted, to be redone"
        write_keep_set(self.run_dir, steps)


def version_weights(run_dir: str | Path, model: str | Path, version: int) -> Path | None:
    """Where the weights of `version` are: the base model for v0, a published step after; None once
    pruned or retracted, or when the version was only sent to the servers (the distributed
    transport writes files at checkpoint steps and the last step only)."""
    if version == 0:
        return Path(model)
    path = weights_dir(run_dir, version)
    return path if (path / STABLE_MARKER).is_file() and holds_tensors(path) else None


def best_weights(run_dir: str | Path, model: str | Path, metric: str) -> tuple[int, float, Path] | None:
    """(version, value, path) of the best evaluated version by `metric` whose weights are on disk."""
    best = best_version(
        read_metrics(run_dir, "eval"), metric, lambda v: version_weights(run_dir, model, v) is not None
    )
    if best is None:
        return None
    path = version_weights(run_dir, model, best[0])
    assert path is not None
    return (*best, path)


def _eval_envs(cfg: OrchestratorConfig, mixture: EnvMixture) -> dict[str, tuple[EnvConfig, Environment]]:
    """label -> (config, env): the named eval envs, else the training envs themselves."""
    if not cfg.eval.envs:
        return {c.label or c.name: (c, env) for c, env in zip(mixture.configs, mixture.envs, strict=True)}
    return {c.label or c.name: (c, build_env(c.name, c.args, seed=cfg.envs.seed)) for c in cfg.eval.envs}
