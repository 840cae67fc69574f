"""`asyncrl eval`: mean reward of a model on an environment's held-out tasks, in one process.

    asyncrl eval --model outputs/reverse_text/sft/final --env reverse-text --num 128 \
        --env-args '{"min_len": 3, "max_len": 6}' --temperature 0 --max-tokens 12

The embedded engine (`asyncrl.inference.Engine`) runs in this process behind a local
`InferenceClient`, and every task goes through the same episode loop the orchestrator uses
(`asyncrl.envs.rollout.run_episode` with a `TokenPolicy`), so the reward is the one RL optimises.
No server is started. Tasks are the env's "eval" split, disjoint from the "train" split that
`asyncrl sft-data` and the orchestrator draw from. `--temperature 0` (the default) is greedy.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import typing
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncrl.client import RequestClient
from asyncrl.config.envs import EnvConfig
from asyncrl.config.inference import InferenceConfig
from asyncrl.config.sampling import SamplingParams
from asyncrl.config.shared import Device
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.policy import TokenPolicy
from asyncrl.envs.registry import build_env
from asyncrl.envs.rollout import Episode, run_episode
from asyncrl.inference.async_engine import AsyncEngine
from asyncrl.inference.request import SamplingOptions
from asyncrl.tools.progress import progress_bar
from asyncrl.wire import GenerateRequest, GenerateResponse

__all__ = ["EvalResult", "LocalEngineClient", "evaluate", "main"]


class LocalEngineClient(RequestClient):
    """`InferenceClient` over an in-process `AsyncEngine` (no HTTP); routing is never returned."""

    def __init__(self, engine: AsyncEngine) -> None:
        super().__init__(self._answer)
        self.engine = engine

    async def _answer(self, request: GenerateRequest) -> GenerateResponse:
        prompt_token_ids, cache_salt = request.prompt_token_ids, request.cache_salt
        options = SamplingOptions(
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
            min_p=request.min_p,
            seed=request.seed,
            max_tokens=request.max_tokens,
            stop=tuple(request.stop),
            stop_token_ids=tuple(request.stop_token_ids),
            ignore_eos=request.ignore_eos,
        )
        token_ids: list[int] = []
        logprobs: list[float] = []
        versions: list[int] = []
        finish, cached = "abort", 0
        stream = self.engine.generate(uuid.uuid4().hex, prompt_token_ids, options, cache_salt=cache_salt)
        async for out in stream:
            token_ids += out.new_token_ids
            logprobs += out.new_logprobs
            versions += out.new_versions
            if out.finished:
                finish, cached = out.finish_reason.value, out.num_cached_tokens
        return GenerateResponse(
            token_ids=token_ids,
            logprobs=logprobs,
            policy_versions=versions,
            finish_reason=finish,
            num_cached_tokens=cached,
            prompt_token_ids=list(prompt_token_ids),
        )


@dataclass(frozen=True, kw_only=True)
class EvalResult:
    """Mean reward (and each rubric component) over `num_tasks` episodes; `examples` are a few of them."""

    model: str
    env: str
    num_tasks: int
    reward: float
    rewards: dict[str, float]
    num_failed: int
    seconds: float
    examples: list[dict[str, str]]


async def _run(
    env_cfg: EnvConfig, num: int, sampling: SamplingParams, engine_cfg: InferenceConfig
) -> list[Episode]:
    env = build_env(env_cfg.name, env_cfg.args, seed=engine_cfg.seed)
    tokenizer = ChatTokenizer.from_pretrained(engine_cfg.model)
    engine = AsyncEngine.load(engine_cfg)
    engine.start()
    bar = progress_bar(num, f"eval {env_cfg.label or env_cfg.name} (t={sampling.temperature:g})", "task")
    try:
        client = LocalEngineClient(engine)

        async def one(i: int) -> Episode:
            task = env.task("eval", i)
            policy = TokenPolicy(
                client, tokenizer, sampling, config=env_cfg, max_model_len=engine.engine.max_model_len
            )
            episode = await run_episode(env, task, policy, config=env_cfg, episode_id=f"eval/{i}")
            bar.update(1)
            return episode

        return list(await asyncio.gather(*(one(i) for i in range(num))))
    finally:
        bar.close()
        engine.stop()


def evaluate(
    model: str,
    env_cfg: EnvConfig,
    *,
    num: int = 128,
    sampling: SamplingParams | None = None,
    seed: int = 0,
    max_num_seqs: int = 64,
    device: Device = "auto",
) -> EvalResult:
    """Run `num` eval-split tasks of `env_cfg` against `model` and average the rewards."""
    sampling = sampling or SamplingParams(temperature=0.0, max_tokens=16)
    engine_cfg = InferenceConfig(model=model, device=device, max_num_seqs=max_num_seqs, seed=seed)
    t0 = time.monotonic()
    episodes = asyncio.run(_run(env_cfg, num, sampling, engine_cfg))
    keys = sorted({k for e in episodes for k in e.rewards})
    return EvalResult(
        model=model,
        env=env_cfg.label or env_cfg.name,
        num_tasks=len(episodes),
        reward=float(np.mean([e.reward for e in episodes])),
        rewards={k: float(np.mean([e.rewards.get(k, 0.0) for e in episodes])) for k in keys},
        num_failed=sum(e.failed for e in episodes),
        seconds=time.monotonic() - t0,
        examples=[_example(e) for e in episodes[:4]],
    )


def _example(episode: Episode) -> dict[str, str]:
    user = next((m["content"] for m in episode.messages if m.get("role") == "user"), "")
    answer = next((m["content"] for m in reversed(episode.messages) if m.get("role") == "assistant"), "")
    return {"prompt": str(user), "completion": str(answer)}


def _report(label: str, temperature: float, res: EvalResult, json_out: Path | None) -> None:
    parts = " ".join(f"{k} {v:.3f}" for k, v in res.rewards.items())
    print(
        f"eval {label} (temperature {temperature:g}): reward {res.reward:.3f} ({parts}) on {res.num_tasks} "
        f"{res.env} eval tasks, {res.num_failed} failed, {res.seconds:.1f}s"
    )
    for ex in res.examples:
        print(f"  {ex['prompt']!r} -> {ex['completion']!r}")
    if json_out is not None:
        json_out.parent.mkdir(parents=True, exist_ok=True)
        with json_out.open("a") as f:
            f.write(json.dumps({"label": label, "temperature": temperature, **res.__dict__}) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="asyncrl eval", description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True, help="HF model directory (e.g. RUN/weights/step_N)")
    p.add_argument("--env", required=True, help="registered environment name or 'package.module:factory'")
    p.add_argument("--env-args", default="{}", help="JSON object of env arguments")
    p.add_argument("--num", type=int, default=128, help="eval-split tasks 0..num-1")
    p.add_argument(
        "--temperature", type=float, nargs="+", default=[0.0], help="one or more; 0 = greedy, 1 = as in RL"
    )
    p.add_argument("--max-tokens", type=int, default=16, help="most tokens sampled per model turn")
    p.add_argument("--max-num-seqs", type=int, default=64, help="engine batch size")
    p.add_argument(
        "--device",
        choices=typing.get_args(Device),
        default="auto",
        help="auto = cuda when available, else cpu",
    )
    p.add_argument("--seed", type=int, default=0, help="env seed (must match training) and sampling seed")
    p.add_argument("--label", default=None, help="name printed with the result (default: the model path)")
    p.add_argument("--json-out", type=Path, default=None, help="append the result as one JSON line here")
    return p


def main(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    try:
        env_args: Any = json.loads(args.env_args)
    except json.JSONDecodeError as e:
        raise SystemExit(f"asyncrl eval: --env-args is not valid JSON ({e})") from None
    if not isinstance(env_args, dict):
        raise SystemExit(f"asyncrl eval: --env-args must be a JSON object, got {args.env_args!r}")
    if args.num < 1:
        raise SystemExit(f"asyncrl eval: --num must be >= 1, got {args.num}")
    if not (Path(args.model) / "config.json").is_file():
        raise SystemExit(f"asyncrl eval: --model {args.model} has no config.json (not an HF model directory)")
    env_cfg = EnvConfig(name=args.env, args=env_args)
    label = args.label or args.model
    for temperature in args.temperature:
        sampling = SamplingParams(temperature=temperature, max_tokens=args.max_tokens)
        res = evaluate(
            args.model,
            env_cfg,
            num=args.num,
            sampling=sampling,
            seed=args.seed,
            max_num_seqs=args.max_num_seqs,
            device=args.device,
        )
        _report(label, temperature, res, args.json_out)
    sys.stdout.flush()
    return 0
