"""The rollout loop: one episode of an environment against a policy, with stop conditions and metrics.

    episode = await run_episode(env, task, policy, config=EnvConfig(name="calculator"), episode_id="ep-1")
    episode.reward, episode.samples, episode.metrics, episode.stop_reason

Per turn: the policy writes; tool calls in the text run (errors and timeouts go back to the model as
tool messages); a tool that sets `state.done` ends the episode after them; a turn without tool calls
asks the env to `respond` (None ends the episode). Stop
reasons: "done", "max_turns", "max_tokens" (the episode's token budget), "context_limit" (the
conversation fills the server's context), "deadline", "aborted" (the server aborted the request),
and "error": environment code raised, so the episode is marked failed with reward 0 and the error
recorded, and the caller keeps going. Inference failures (`InferenceError`) are not environment bugs:
they propagate to the caller, which owns retries; so does cancellation. Teardown runs in every case.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import random
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl.client import InferenceError
from asyncrl.config.envs import EnvConfig, LatencyConfig
from asyncrl.envs.base import Environment, EpisodeState, Task
from asyncrl.envs.policy import ContextLimitReached, EpisodeBudgetExhausted, Policy
from asyncrl.envs.tools import call_tool, parse_tool_calls
from asyncrl.wire import RolloutSample

__all__ = ["Episode", "run_episode", "sample_latency"]


@dataclass(frozen=True, kw_only=True)
class Episode:
    """The outcome of one episode.

    `samples` is empty for text-only policies. Failed episodes (`error` set) keep their samples with
    reward 0 for inspection; callers should not train on them. `metrics` holds floats only, with
    the stop reason one-hot as `stop_<reason>` so that it aggregates like any other metric.
    """

    episode_id: str
    env: str
    task_id: str
    reward: float
    rewards: dict[str, float]
    samples: list[RolloutSample]
    metrics: dict[str, float]
    stop_reason: str
    error: str | None = None
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.error is not None


@dataclass
class _Stats:
    num_turns: int = 0
    num_tool_calls: int = 0
    num_tool_errors: int = 0
    num_prompt_tokens: int = 0
    num_completion_tokens: int = 0
    num_truncated_turns: int = 0
    latency_s: float = 0.0


def sample_latency(cfg: LatencyConfig, rng: random.Random) -> float:
    """Heavy-tailed delay: lognormal with median `median_s`, capped at `max_s`."""
    if not cfg.enabled:
        return 0.0
    return min(cfg.max_s, cfg.median_s * math.exp(cfg.sigma * rng.gauss(0.0, 1.0)))


async def _loop(
    env: Environment,
    state: EpisodeState,
    policy: Policy,
    config: EnvConfig,
    stats: _Stats,
    rng: random.Random,
) -> str:
    tools = {t.name: t for t in env.tools(state)}
    schemas = [t.schema for t in tools.values()]
    max_turns = config.max_turns or env.max_turns
    while stats.num_turns < max_turns:
        try:
            turn = await policy.complete(state.messages, schemas)
        except ContextLimitReached:
            return "context_limit"
        except EpisodeBudgetExhausted:
            return "max_tokens"
        stats.num_turns += 1
        stats.num_prompt_tokens += turn.num_prompt_tokens
        stats.num_completion_tokens += turn.num_completion_tokens
        stats.num_truncated_turns += turn.finish_reason == "length"
        state.num_turns, state.final_text = stats.num_turns, turn.text
        state.messages.append({"role": "assistant", "content": turn.text})
        if turn.finish_reason == "abort":
            return "aborted"
        delay = sample_latency(config.latency, rng)
        stats.latency_s += delay
        await asyncio.sleep(delay)
        calls = parse_tool_calls(turn.text) if tools else []
        for call in calls:
            result = await call_tool(
                tools, call, timeout_s=config.tool_timeout_s, max_chars=config.max_tool_output_chars
            )
            stats.num_tool_calls += 1
            stats.num_tool_errors += result.is_error
            state.messages.append({"role": "tool", "name": result.name, "content": result.content})
        if state.done:
            return "done"
        if calls:
            continue
        reply = await env.respond(state, turn.text)
        if reply is None:
            return "done"
        state.messages.extend(reply)
    return "max_turns"


def _episode_rng(config: EnvConfig, episode_id: str) -> random.Random:
    return random.Random(
        int.from_bytes(hashlib.sha256(f"{config.name}/{episode_id}".encode()).digest()[:8], "little")
    )


async def run_episode(
    env: Environment, task: Task, policy: Policy, *, config: EnvConfig, episode_id: str
) -> Episode:
    """Run one episode to a stop condition; never raises for environment bugs (see module docstring)."""
    t0 = time.monotonic()
    stats, state, error, stop_reason = _Stats(), None, None, "done"
    label = config.label or config.name
    try:
        async with asyncio.timeout(config.deadline_s) as deadline:
            state = await env.setup(task)
            stop_reason = await _loop(env, state, policy, config, stats, _episode_rng(config, episode_id))
    except TimeoutError as e:
        if deadline.expired():
            stop_reason = "deadline"
        else:  # raised by environment code, not our deadline
            error, stop_reason = f"TimeoutError: {e}", "error"
    except (InferenceError, asyncio.CancelledError):  # the caller's business: retry or shut down
        await _teardown(env, state)
        raise
    except Exception as e:  # environment code is a plugin boundary: record, fail the episode, keep going
        error, stop_reason = f"{type(e).__name__}: {e}", "error"
    reward, rewards = 0.0, {}
    if error is None and state is not None:
        state.stop_reason = stop_reason  # rewards may read how the episode ended (cut or finished)
        try:
            reward, rewards = await env.rubric.score(state)
        except Exception as e:  # same boundary, for reward functions
            error, stop_reason = f"reward {type(e).__name__}: {e}", "error"
    teardown_error = await _teardown(env, state)  # always, also after an error
    error = error or teardown_error
    if error is not None:
        reward, rewards, stop_reason = 0.0, {}, "error"
    metrics = _metrics(stats, policy, t0, error) | {f"stop_{stop_reason}": 1.0}
    samples = policy.build_samples(reward=reward, env=label, episode_id=episode_id, metrics=metrics)
    return Episode(
        episode_id=episode_id,
        env=label,
        task_id=task.id,
        reward=reward,
        rewards=rewards,
        samples=samples,
        metrics=metrics,
        stop_reason=stop_reason,
        error=error,
        messages=state.messages if state else [],
    )


async def _teardown(env: Environment, state: EpisodeState | None) -> str | None:
    if state is None:
        return None
    try:
        await env.teardown(state)
    except Exception as e:  # a leaked resource must not take the caller down
        return f"teardown {type(e).__name__}: {e}"
    return None


def _metrics(stats: _Stats, policy: Policy, t0: float, error: str | None) -> dict[str, float]:
    return {
        "num_turns": float(stats.num_turns),
        "num_tool_calls": float(stats.num_tool_calls),
        "num_tool_errors": float(stats.num_tool_errors),
        "num_prompt_tokens": float(stats.num_prompt_tokens),
        "num_completion_tokens": float(stats.num_completion_tokens),
        "num_truncated_turns": float(stats.num_truncated_turns),
        "num_resets": float(policy.num_resets),
        "num_bridged_turns": float(policy.num_bridged_turns),
        "latency_s": stats.latency_s,
        "wall_s": time.monotonic() - t0,
        "failed": float(error is not None),
    }
