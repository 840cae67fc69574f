"""Evaluate any served model on an environment through its OpenAI-compatible chat endpoint.

    asyncrl eval-env --base-url http://127.0.0.1:8000 --env reverse-text --num 64
    asyncrl eval-env --base-url ... --env my_pkg.envs:make_env --env-args '{"level": 2}' --split train

Runs `--num` episodes of the split with up to `--concurrency` in flight and prints the mean reward,
each named reward, and the episode metrics. Text only: no token ids, so no training samples.
Without `--model`, the requests name the one model the server lists at `GET /v1/models`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
from collections.abc import Callable

import httpx

from asyncrl.client.backend import InferenceError
from asyncrl.config import ConfigError
from asyncrl.config.envs import EnvConfig
from asyncrl.envs.base import Environment, Split
from asyncrl.envs.policy import ChatPolicy, Policy
from asyncrl.envs.registry import build_env
from asyncrl.envs.rollout import Episode, run_episode
from asyncrl.wire import SamplingParams

__all__ = ["evaluate", "main", "served_model", "summarize"]


async def evaluate(
    env: Environment,
    make_policy: Callable[[], Policy],
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
            return await run_episode(env, task, make_policy(), config=config, episode_id=f"{split}-{index}")

    return list(await asyncio.gather(*(one(i) for i in range(num))))


def summarize(episodes: list[Episode]) -> dict[str, float]:
    """Means of the reward, every named reward and every metric; plus the failure rate."""
    out = {"reward": statistics.fmean(e.reward for e in episodes), "num_episodes": float(len(episodes))}
    for key in sorted({k for e in episodes for k in e.rewards}):
        out[f"rewards/{key}"] = statistics.fmean(e.rewards.get(key, 0.0) for e in episodes)
    for key in sorted({k for e in episodes for k in e.metrics}):
        out[f"metrics/{key}"] = statistics.fmean(e.metrics[key] for e in episodes)
    return out


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl eval-env", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", required=True, help="server root, e.g. http://127.0.0.1:8000")
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


async def _run(args: argparse.Namespace) -> tuple[str, dict[str, float]]:
    env = build_env(args.env, args.env_args, seed=args.seed)
    config = EnvConfig(name=args.env)
    sampling = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=600.0) as http:
        model = args.model or await served_model(http)
        episodes = await evaluate(
            env, lambda: ChatPolicy(http, model, sampling), config=config, num=args.num,
            split=args.split, concurrency=args.concurrency,
        )  # fmt: skip
    return model, summarize(episodes)


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        model, summary = asyncio.run(_run(args))
    except InferenceError as e:  # the server refused a request or failed: say so, without a traceback
        print(f"asyncrl eval-env: {e}", file=sys.stderr)
        return 1
    width = max(len(k) for k in summary)
    print(f"{args.env} ({args.split}, {args.num} episodes) on {args.base_url} [{model}]")
    for key, value in summary.items():
        print(f"  {key:<{width}}  {value:.4f}")
    return 0
