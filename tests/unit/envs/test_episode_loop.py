"""The rollout loop's failure handling and stop conditions: env errors, deadlines, latency, inference
errors."""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time

import pytest

from asyncrl.client import InferenceError
from asyncrl.config import EnvConfig, LatencyConfig
from asyncrl.envs import (
    Environment,
    Reward,
    Rubric,
    ScriptedClient,
    Task,
    TokenPolicy,
    Tool,
    build_env,
    run_episode,
    sample_latency,
)
from asyncrl.wire import SamplingParams


class FlakyEnv(Environment):
    """Multi-turn echo env that raises on a chosen turn (or in its reward)."""

    name = "flaky"
    max_turns = 5

    def __init__(self, *, seed: int = 0, fail_on_turn: int | None = 2, fail_in_reward: bool = False) -> None:
        super().__init__(seed=seed)
        self.fail_on_turn, self.fail_in_reward = fail_on_turn, fail_in_reward
        self.teardowns = 0
        self.rubric = Rubric(rewards=(Reward(name="one", fn=self._reward),))

    def _reward(self, state) -> float:
        if self.fail_in_reward:
            raise ZeroDivisionError("reward bug")
        return 1.0

    def task(self, split, index):
        return Task(id=f"flaky/{index}", prompt=[{"role": "user", "content": "go"}])

    def reference(self, task):
        return []

    async def respond(self, state, text):
        if state.num_turns == self.fail_on_turn:
            raise RuntimeError("env bug on turn 2")
        return None if state.num_turns >= 3 else [{"role": "user", "content": "again"}]

    async def teardown(self, state):
        self.teardowns += 1


def _policy(tokenizer, replies, cfg):
    return TokenPolicy(
        ScriptedClient(tokenizer, replies), tokenizer, SamplingParams(max_tokens=256), config=cfg
    )


def test_env_raising_mid_episode_fails_the_episode_and_the_caller_keeps_going(tokenizer):
    cfg = EnvConfig(name="flaky")
    bad, good, bad_reward = (
        FlakyEnv(),
        FlakyEnv(fail_on_turn=None),
        FlakyEnv(fail_on_turn=None, fail_in_reward=True),
    )

    async def both():
        return await asyncio.gather(
            run_episode(
                bad,
                bad.task("train", 0),
                _policy(tokenizer, ["a", "b", "c"], cfg),
                config=cfg,
                episode_id="e1",
            ),
            run_episode(
                good,
                good.task("train", 0),
                _policy(tokenizer, ["a", "b", "c"], cfg),
                config=cfg,
                episode_id="e2",
            ),
            run_episode(
                bad_reward,
                bad_reward.task("train", 0),
                _policy(tokenizer, ["a"] * 3, cfg),
                config=cfg,
                episode_id="e3",
            ),
        )

    failed, ok, failed_reward = asyncio.run(both())
    assert failed.failed and failed.reward == 0.0 and failed.stop_reason == "error"
    assert failed.error == "RuntimeError: env bug on turn 2" and failed.metrics["failed"] == 1.0
    assert failed.metrics["stop_error"] == 1.0 and ok.metrics["stop_done"] == 1.0
    assert failed.metrics["num_turns"] == 2 and bad.teardowns == 1
    assert all(s.reward == 0.0 for s in failed.samples)  # kept for inspection, reward 0
    assert not ok.failed and ok.reward == 1.0 and ok.stop_reason == "done" and ok.metrics["num_turns"] == 3
    assert failed_reward.failed and failed_reward.error == "reward ZeroDivisionError: reward bug"
    assert failed_reward.reward == 0.0 and failed_reward.rewards == {}


def test_deadline_and_max_turns(tokenizer):
    async def slow_tool(seconds: float) -> str:
        """Sleep."""
        await asyncio.sleep(seconds)
        return "slept"

    class SlowEnv(FlakyEnv):
        def tools(self, state):
            return [Tool.from_function(slow_tool)]

    env = SlowEnv(fail_on_turn=None)
    call = '<tool_call>{"name": "slow_tool", "arguments": {"seconds": 5}}</tool_call>'
    cfg = EnvConfig(name="slow", deadline_s=0.3, tool_timeout_s=10)
    t0 = time.monotonic()
    ep = asyncio.run(
        run_episode(
            env, env.task("train", 0), _policy(tokenizer, [call] * 5, cfg), config=cfg, episode_id="d"
        )
    )
    assert ep.stop_reason == "deadline" and not ep.failed and time.monotonic() - t0 < 3
    assert ep.samples and ep.samples[0].loss_mask.sum() > 0 and env.teardowns == 1

    cfg = EnvConfig(name="slow", max_turns=2, tool_timeout_s=0.05)
    ep = asyncio.run(
        run_episode(
            env, env.task("train", 0), _policy(tokenizer, [call] * 5, cfg), config=cfg, episode_id="m"
        )
    )
    assert ep.stop_reason == "max_turns" and ep.metrics["num_tool_errors"] == 2
    assert "timed out after 0.05s" in ep.messages[-1]["content"] and ep.messages[-1]["role"] == "tool"


def test_inference_errors_propagate_after_teardown(tokenizer):
    class DownClient:
        async def generate(self, *args, **kwargs):
            raise InferenceError("server down")

    env = FlakyEnv(fail_on_turn=None)
    cfg = EnvConfig(name="flaky")
    policy = TokenPolicy(DownClient(), tokenizer, SamplingParams(), config=cfg)
    with pytest.raises(InferenceError, match="server down"):
        asyncio.run(run_episode(env, env.task("train", 0), policy, config=cfg, episode_id="x"))
    assert env.teardowns == 1


def test_cancelled_episode_is_torn_down(tokenizer):
    env = FlakyEnv(fail_on_turn=None)
    cfg = EnvConfig(name="flaky", latency=LatencyConfig(median_s=30.0, sigma=0.0))

    async def go():
        episode = asyncio.create_task(
            run_episode(env, env.task("train", 0), _policy(tokenizer, ["a"], cfg), config=cfg, episode_id="c")
        )
        await asyncio.sleep(0.1)
        episode.cancel()
        with pytest.raises(asyncio.CancelledError):
            await episode

    asyncio.run(go())
    assert env.teardowns == 1


def test_latency_is_heavy_tailed_lognormal():
    cfg = LatencyConfig(median_s=0.2, sigma=1.5, max_s=1000.0)
    rng = random.Random(0)
    draws = sorted(sample_latency(cfg, rng) for _ in range(20000))
    assert statistics.median(draws) == pytest.approx(0.2, rel=0.05)
    p99 = draws[int(0.99 * len(draws))]
    assert p99 / statistics.median(draws) == pytest.approx(math.exp(1.5 * 2.326), rel=0.15)
    assert sample_latency(LatencyConfig(), rng) == 0.0
    assert sample_latency(LatencyConfig(median_s=1.0, sigma=3.0, max_s=2.0), random.Random(1)) <= 2.0


def test_latency_knob_applies_to_any_env(tokenizer):
    env = build_env("reverse-text")
    task = env.task("train", 0)
    cfg = EnvConfig(name="reverse-text", latency=LatencyConfig(median_s=0.02, sigma=0.5))
    ep = asyncio.run(
        run_episode(env, task, _policy(tokenizer, [task.answer], cfg), config=cfg, episode_id="l")
    )
    assert (
        ep.reward == 1.0 and ep.metrics["latency_s"] > 0.0 and ep.metrics["wall_s"] >= ep.metrics["latency_s"]
    )


class StopToolEnv(FlakyEnv):
    """A `stop` tool sets state.done: the episode ends after that turn's tool calls."""

    def tools(self, state):
        def stop() -> str:
            """End the episode."""
            state.done = True
            return "stopping"

        def note() -> str:
            """Do nothing."""
            return "noted"

        return [Tool.from_function(stop), Tool.from_function(note)]


def test_a_tool_that_sets_done_ends_the_episode_after_its_turn(tokenizer):
    cfg = EnvConfig(name="flaky", max_turns=5)
    env = StopToolEnv(fail_on_turn=None)
    call = '<tool_call>{{"name": "{}", "arguments": {{}}}}</tool_call>'
    replies = [call.format("note"), call.format("stop") + call.format("note"), "never sent"]
    ep = asyncio.run(
        run_episode(env, env.task("train", 0), _policy(tokenizer, replies, cfg), config=cfg, episode_id="e")
    )
    assert ep.stop_reason == "done" and ep.error is None and ep.reward == 1.0
    assert ep.metrics["num_turns"] == 2 and ep.metrics["num_tool_calls"] == 3  # the turn's calls all ran
    assert [m["content"] for m in ep.messages if m["role"] == "tool"] == ["noted", "stopping", "noted"]
