"""Environments: tasks, tools, rewards, the rollout loop, exact token trajectories, and a sandbox.

Typical use, with `client` an `asyncrl.client.InferenceClient` (the orchestrator's routes each
episode to one of its servers and retries)::

    from asyncrl.envs import ChatTokenizer, TokenPolicy, build_env, run_episode
    env = build_env("calculator", seed=0)
    policy = TokenPolicy(client, ChatTokenizer.from_pretrained(model_dir), sampling, config=env_cfg)
    episode = await run_episode(env, env.task("train", 0), policy, config=env_cfg, episode_id="ep-0")

See docs/envs.md.
"""

from asyncrl.envs.base import (
    Environment,
    EpisodeState,
    ReferenceExample,
    Reward,
    Rubric,
    Split,
    Task,
    iter_reference_examples,
)
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.policy import ChatPolicy, Policy, ReplayPolicy, TokenPolicy, Turn
from asyncrl.envs.registry import EnvConfigError, EnvMixture, available_envs, build_env, register_env
from asyncrl.envs.rollout import Episode, run_episode, sample_latency
from asyncrl.envs.scripted import ScriptedClient
from asyncrl.envs.tools import Tool, ToolCall, ToolError, ToolResult, call_tool, parse_tool_calls
from asyncrl.envs.trajectory import NOT_SAMPLED_VERSION, TrajectoryBuilder

__all__ = [
    "NOT_SAMPLED_VERSION",
    "ChatPolicy",
    "ChatTokenizer",
    "EnvConfigError",
    "EnvMixture",
    "Environment",
    "Episode",
    "EpisodeState",
    "Policy",
    "ReferenceExample",
    "ReplayPolicy",
    "Reward",
    "Rubric",
    "ScriptedClient",
    "Split",
    "Task",
    "TokenPolicy",
    "Tool",
    "ToolCall",
    "ToolError",
    "ToolResult",
    "TrajectoryBuilder",
    "Turn",
    "available_envs",
    "build_env",
    "call_tool",
    "iter_reference_examples",
    "parse_tool_calls",
    "register_env",
    "run_episode",
    "sample_latency",
]
