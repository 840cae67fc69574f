"""Evaluate any served model on an environment through its OpenAI-compatible chat endpoint, or a
scripted agent that needs no model.

    asyncrl eval-env --base-url http://127.0.0.1:8000 --env reverse-text --num 64
    asyncrl eval-env --base-url ... --env my_pkg.envs:make_env --env-args '{"level": 2}' --split train
    asyncrl eval-env --agent reference --env swe --num 32 \
        --env-args '{"tasks": "t.jsonl", "eval_tasks": "t.jsonl"}'

Runs `--num` episodes of the split with up to `--concurrency` in flight and prints the mean reward,
each named reward, the episode metrics and the wall time. Text only: no token ids, so no training
samples. Without `--model`, the requests name the one model the server lists at `GET /v1/models`.
`--agent reference` replays each task's reference solution (`env.reference(task)`, through
the env's tools): every task should score the env's maximum. `--agent noop` ends each episode at
once without a tool call: the task's untouched state, the score's floor.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import statistics
import sys
import time
from collections.abc import Callable

import httpx

from asyncrl.client.backend import InferenceError
from asyncrl.config import ConfigError
from asyncrl.config.envs import EnvConfig
from asyncrl.envs.base import Environment, Split, Task
from asyncrl.envs.policy import ChatPolicy, Policy, ReplayPolicy
from asyncrl.envs.registry import build_env
from asyncrl.envs.rollout import Episode, run_episode
from asyncrl.wire import SamplingParams

__all__ = ["AGENTS", "evaluate", "main", "scripted_agent", "served_model", "summarize"]

AGENTS = ("model", "reference", "noop")  # model: the endpoint at --base-url


async def evaluate(
    env: Environment,
    make_policy: Callable[[Task], Policy],
    *,
    config: EnvConfig,
    num: int,
    split: Split = "eval",
    concurrency: int = 8,
) -> list[Episode]:
    """`num` episodes of `split` (tasks 0..num-1), at most `concurrency` at once, in task order."""
    gate = asyncio.Semaphore(concurrency)

    async def one(index: int) -> Episode:
        async with gate:
            task = env.task(split, index)
            return await run_episode(
                env, task, make_policy(task), config=config, episode_id=f"{split}-{index}"
            )

    return list(await asyncio.gather(*(one(i) for i in range(num))))


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Means of the reward, every named reward and every metric (the failure rate among them); the
    lowest reward."""
    out = {
        "reward": statistics.fmean(e.reward for e in episodes),
        "reward_min": min(e.reward for e in episodes),
        "num_episodes": float(len(episodes)),
    }
    for key in sorted({k for e in episodes for k in e.rewards}):
        out[f"rewards/{key}"] = statistics.fmean(e.rewards.get(key, 0.0) for e in episodes)
    for key in sorted({k for e in episodes for k in e.metrics}):
        out[f"metrics/{key}"] = statistics.fmean(e.metrics[key] for e in episodes)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl eval-env", description=__doc__.splitlines()[0])
    p.add_argument("--agent", default="model", choices=AGENTS, help="who plays (see above; default: model)")
    p.add_argument("--base-url", help="server root, e.g. http://127.0.0.1:8000 (--agent model)")
    p.add_argument(
        "--model", default=None, help="model name in the requests (default: the server's only one)"
    )
    p.add_argument("--env", default="reverse-text", help="registered name or package.module:factory")
    p.add_argument("--env-args", default="{}", type=json.loads, help="JSON object of env factory arguments")
    p.add_argument("--split", default="eval", choices=["train", "eval"])
    p.add_argument("--num", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--api-key", default=None)
    return p


def scripted_agent(agent: str, env: Environment) -> Callable[[Task], Policy]:
    """A policy factory for `--agent reference` or `--agent noop` (see the module docstring)."""

    def make(task: Task) -> Policy:
        if agent == "noop":
            return ReplayPolicy([])
        return ReplayPolicy([m["content"] for m in env.reference(task) if m["role"] == "assistant"])

    return make


async def served_model(http: httpx.AsyncClient) -> str:
    """The one model the server lists at `GET /v1/models`; ConfigError when it lists none or several."""
    where = http.base_url.join("v1/models")
    try:
        response = await http.get("/v1/models")
    except httpx.HTTPError as e:
        raise ConfigError(f"cannot reach {where}: {type(e).__name__}: {e}") from None
    try:
        response.raise_for_status()
        names = [m["id"] for m in response.json()["data"]]
    except (httpx.HTTPStatusError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where} does not list the served models ({e}); name one with --model") from None
    if len(names) != 1:
        raise ConfigError(f"{where} lists {len(names)} models {names}; pick one with --model")
    return names[0]


async def _run(args: argparse.Namespace) -> tuple[str | None, dict[str, float]]:
    env = build_env(args.env, args.env_args, seed=args.seed)
    config = EnvConfig(name=args.env)
    run = functools.partial(
        evaluate, env, config=config, num=args.num, split=args.split, concurrency=args.concurrency
    )
    t0 = time.monotonic()
    if args.agent == "model":
        sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600.0) as http:
            model = args.model or await served_model(http)
            episodes = await run(lambda task: ChatPolicy(http, model, sampling))
    else:
        model, episodes = None, await run(scripted_agent(args.agent, env))
    return model, summarize(episodes) | {"wall_s": time.monotonic() - t0}


def main(argv: list[str]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.agent == "model" and not args.base_url:
        parser.error("--agent model (the default) evaluates a served model: pass --base-url")
    try:
        model, summary = asyncio.run(_run(args))
    except InferenceError as e:  # the server refused a request or failed: say so, without a traceback
        print(f"asyncrl eval-env: {e}", file=sys.stderr)
        return 1
    width = max(len(k) for k in summary)
    who = f"on {args.base_url} [{model}]" if args.agent == "model" else f"[agent: {args.agent}]"
    print(f"{args.env} ({args.split}, {args.num} episodes) {who}")
    for key, value in summary.items():
        print(f"  {key:<{width}}  {value:.4f}")
    return 0
