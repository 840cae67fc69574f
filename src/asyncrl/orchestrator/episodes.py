"""One episode on the server pool, re-run elsewhere when its server fails: what training groups
and evals both run.

    runner = EpisodeRunner(
        pool, tokenizer, cache_salt=lambda: str(version), max_retries=3, max_model_len=None
    )
    episode = await runner.run(env_cfg, env, task, sampling, "reverse-text/train/7/v2/0")

A transport failure (`ServerUnavailable`: the pool took the server out of rotation) re-runs the
episode from its start on another server, at most `max_retries` times; any other inference error
(a 4xx) fails the episode at once. Either way a failed episode comes back, never an exception,
so one bad request costs its episode and nothing more (docs/orchestrator.md, Failed episodes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from asyncrl.client import InferenceError, ServerUnavailable
from asyncrl.config.envs import EnvConfig
from asyncrl.envs.base import Environment, Task
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.policy import TokenPolicy
from asyncrl.envs.rollout import Episode, run_episode
from asyncrl.orchestrator.pool import ServerPool
from asyncrl.wire import SamplingParams

__all__ = ["EpisodeRunner", "failed_episode"]

log = logging.getLogger(__name__)


class EpisodeRunner:
    """Runs episodes on `pool`; `cache_salt()` is read as each request is sent."""

    def __init__(
        self,
        pool: ServerPool,
        tokenizer: ChatTokenizer,
        *,
        cache_salt: Callable[[], str],
        max_retries: int,
        max_model_len: int | None,
    ) -> None:
        self.pool, self.tokenizer, self.cache_salt = pool, tokenizer, cache_salt
        self.max_retries, self.max_model_len = max_retries, max_model_len

    async def run(
        self,
        env_cfg: EnvConfig,
        env: Environment,
        task: Task,
        sampling: SamplingParams,
        episode_id: str,
        *,
        return_routed_experts: bool = False,
        count: bool = True,
        on_retry: Callable[[], None] | None = None,
    ) -> Episode:
        """The episode, or a failed one. `count`: its tokens go into the pool's per-step statistics
        (training rollouts; an eval's do not). `on_retry` is called before each re-run."""
        error: Exception | None = None
        for attempt in range(self.max_retries + 1):
            policy = TokenPolicy(
                self.pool.session(episode_id, cache_salt=self.cache_salt, count=count),
                self.tokenizer,
                sampling,
                config=env_cfg,
                return_routed_experts=return_routed_experts,
                max_model_len=self.max_model_len,
            )
            try:
                return await run_episode(env, task, policy, config=env_cfg, episode_id=episode_id)
            except ServerUnavailable as e:
                error = e
                if attempt < self.max_retries and on_retry is not None:
                    on_retry()
                log.warning("episode %s: %s (attempt %d)", episode_id, e, attempt + 1)
                await asyncio.sleep(min(0.2 * 2**attempt, 2.0))
            except InferenceError as e:
                error = e
                break
            finally:
                self.pool.end_session(episode_id)
        return failed_episode(env_cfg.label or env_cfg.name, task, episode_id, error)


def failed_episode(env: str, task: Task, episode_id: str, error: Exception | None) -> Episode:
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
