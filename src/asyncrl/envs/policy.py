"""Policies the rollout loop can drive: token-exact (`TokenPolicy`) or text-only (`ChatPolicy`).

`TokenPolicy` renders the conversation with the model's chat template, calls an `InferenceClient`
(`/v1/generate`) and stitches exact token trajectories into `RolloutSample`s. `ChatPolicy` talks to
any OpenAI-compatible `/v1/chat/completions` endpoint for evaluation: it yields rewards but no
trainable samples, because it never sees token ids. `ReplayPolicy` is a scripted agent with no
model at all (an env's reference solution, say), for checking an env's tasks and grading.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import httpx

from asyncrl.client import ContextLimitExceeded, InferenceClient, InferenceError
from asyncrl.config.envs import EnvConfig
from asyncrl.envs.chat import ChatTokenizer
from asyncrl.envs.trajectory import TrajectoryBuilder
from asyncrl.wire import RolloutSample, SamplingParams

__all__ = [
    "ChatPolicy",
    "ContextLimitReached",
    "EpisodeBudgetExhausted",
    "Policy",
    "ReplayPolicy",
    "TokenPolicy",
    "Turn",
]


class EpisodeBudgetExhausted(Exception):
    """The episode's token budget leaves no room for another completion (a stop condition, not an error)."""


class ContextLimitReached(EpisodeBudgetExhausted):
    """The conversation fills the server's context: a length stop like the budget, not a failure."""


@dataclass(frozen=True, kw_only=True)
class Turn:
    text: str  # what the model wrote, special tokens removed; tool calls are still in it
    finish_reason: str  # "stop" | "length" | "abort"
    num_prompt_tokens: int  # new prompt tokens this turn (env/tool tokens, or the whole first prompt)
    num_completion_tokens: int


class Policy(Protocol):
    """One per episode: produces assistant turns and, at the end, the episode's training samples."""

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Turn: ...

    def build_samples(
        self, *, reward: float, env: str, episode_id: str, metrics: dict[str, float]
    ) -> list[RolloutSample]: ...

    @property
    def num_resets(self) -> int: ...

    @property
    def num_bridged_turns(self) -> int: ...


class TokenPolicy:
    """Token-exact turns over an `InferenceClient`; see `asyncrl.envs.trajectory` for the stitching rules.

    Each turn samples at most what the turn cap, the episode's `max_total_tokens` and the server's
    context limit (`max_model_len`, when known) leave, so a request never outgrows the server. A
    server that refuses a request for its length anyway (its limit was unknown or lower) ends the
    episode as a length stop, `ContextLimitReached`: the turns so far are trained as a truncated
    episode, never dropped as a failure (that would bias training toward short episodes).
    """

    def __init__(
        self,
        client: InferenceClient,
        tokenizer: ChatTokenizer,
        sampling: SamplingParams,
        *,
        config: EnvConfig,
        cache_salt: str | None = None,
        return_routed_experts: bool = False,
        max_model_len: int | None = None,
    ) -> None:
        self.stitching = config.stitching
        self.num_bridged_turns = 0
        self.client, self.tokenizer, self.sampling = client, tokenizer, sampling
        self.max_total_tokens, self.max_model_len = config.max_total_tokens, max_model_len
        self.max_tokens_per_turn = config.max_tokens_per_turn or sampling.max_tokens
        self.cache_salt, self.return_routed_experts = cache_salt, return_routed_experts
        self.trajectory = TrajectoryBuilder()

    @property
    def num_resets(self) -> int:
        return self.trajectory.num_resets

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Turn:
        temperature = self.sampling.temperature
        rendered = self._render(messages, tools)
        max_tokens = self._max_tokens(len(rendered))  # checked first: no unused env tokens in the sample
        before = self.trajectory.num_tokens
        prompt = self.trajectory.extend_prompt(rendered, temperature=temperature)
        num_new_prompt = self.trajectory.num_tokens - before
        sampling = self.sampling.model_copy(update={"max_tokens": max_tokens})
        try:
            response = await self.client.generate(
                prompt,
                sampling,
                cache_salt=self.cache_salt,
                return_routed_experts=self.return_routed_experts,
                routed_experts_start=self.trajectory.routing_start if self.return_routed_experts else 0,
            )
        except ContextLimitExceeded as e:
            raise ContextLimitReached(f"the server refused {len(prompt)} prompt tokens: {e}") from e
        self.trajectory.add_completion(response, temperature=temperature)
        return Turn(
            text=self.tokenizer.decode(response.token_ids),
            finish_reason=response.finish_reason,
            num_prompt_tokens=num_new_prompt,
            num_completion_tokens=len(response.token_ids),
        )

    def _max_tokens(self, num_prompt_tokens: int) -> int:
        """What this turn may sample: the turn cap, the episode budget's rest and the context's rest."""
        room = self.max_total_tokens - num_prompt_tokens
        if room < 1:
            raise EpisodeBudgetExhausted(
                f"prompt has {num_prompt_tokens} tokens, max_total_tokens={self.max_total_tokens}"
            )
        if self.max_model_len is not None:
            if num_prompt_tokens >= self.max_model_len:
                raise ContextLimitReached(
                    f"prompt has {num_prompt_tokens} tokens, the server's max_model_len={self.max_model_len}"
                )
            room = min(room, self.max_model_len - num_prompt_tokens)
        return min(self.max_tokens_per_turn, room)

    def _render(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[int]:
        rendered = self.tokenizer.render(messages, tools)
        have = self.trajectory.token_ids
        if self.stitching == "bridge" and have and rendered[: len(have)] != have:
            bridged = self.tokenizer.render_bridged(have, messages, tools)
            if bridged is not None:
                self.num_bridged_turns += 1
                return bridged
        return rendered

    def build_samples(
        self, *, reward: float, env: str, episode_id: str, metrics: dict[str, float]
    ) -> list[RolloutSample]:
        return self.trajectory.build(reward=reward, env=env, episode_id=episode_id, metrics=metrics)


class ChatPolicy:
    """Text turns from an OpenAI-compatible `/v1/chat/completions` endpoint (evaluation of any served model).

    Tool schemas are sent as `tools`; structured `tool_calls` in the answer are folded back into
    the text format (`<tool_call>{...}</tool_call>`) so the rollout loop handles both alike. Tool
    results are sent back as plain `{"role": "tool"}` messages without `tool_call_id`, which some
    strict servers reject.
    """

    def __init__(
        self,
        http: httpx.AsyncClient,
        model: str,
        sampling: SamplingParams,
        *,
        send_tools: bool = True,
    ) -> None:
        self.http, self.model, self.sampling, self.send_tools = http, model, sampling, send_tools

    @property
    def num_resets(self) -> int:
        return 0

    @property
    def num_bridged_turns(self) -> int:
        return 0

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Turn:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.sampling.temperature,
            "top_p": self.sampling.top_p,
            "max_tokens": self.sampling.max_tokens,
        }
        if self.sampling.stop:
            body["stop"] = self.sampling.stop
        if tools and self.send_tools:
            body["tools"] = tools
        try:
            response = await self.http.post("/v1/chat/completions", json=body)
        except httpx.HTTPError as e:
            raise InferenceError(f"POST /v1/chat/completions failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise InferenceError(
                f"POST /v1/chat/completions -> {response.status_code}: {response.text[:500]}"
            )
        return _parse_chat_response(response.json())

    def build_samples(
        self, *, reward: float, env: str, episode_id: str, metrics: dict[str, float]
    ) -> list[RolloutSample]:
        return []


class ReplayPolicy:
    """Text turns from a script: each `complete` returns the next reply, then empty turns (a turn
    without a tool call ends an episode). No samples: it evaluates, it does not train.

        replies = [m["content"] for m in env.reference(task) if m["role"] == "assistant"]
        episode = await run_episode(env, task, ReplayPolicy(replies), config=config, episode_id="ref-0")
    """

    num_resets = 0
    num_bridged_turns = 0

    def __init__(self, replies: Sequence[str]) -> None:
        self._replies = list(replies)
        self._next = 0

    async def complete(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> Turn:
        text = self._replies[self._next] if self._next < len(self._replies) else ""
        self._next += 1
        return Turn(text=text, finish_reason="stop", num_prompt_tokens=0, num_completion_tokens=0)

    def build_samples(
        self, *, reward: float, env: str, episode_id: str, metrics: dict[str, float]
    ) -> list[RolloutSample]:
        return []


def _parse_chat_response(payload: dict[str, Any]) -> Turn:
    try:
        choice = payload["choices"][0]
        message = choice["message"]
    except (KeyError, IndexError, TypeError) as e:
        raise InferenceError(f"chat completion without choices[0].message: {e!r}") from None
    text = message.get("content") or ""
    for call in message.get("tool_calls") or []:
        fn = call.get("function", {})
        args = fn.get("arguments", "{}")
        try:
            args_obj = json.loads(args) if isinstance(args, str) and args.strip() else (args or {})
        except json.JSONDecodeError:
            args_obj = args  # left as text: the tool-call parser reports it to the model
        text += (
            "<tool_call>" + json.dumps({"name": fn.get("name", ""), "arguments": args_obj}) + "</tool_call>"
        )
    usage = payload.get("usage") or {}
    finish = choice.get("finish_reason") or "stop"
    return Turn(
        text=text,
        finish_reason="length" if finish == "length" else "stop",
        num_prompt_tokens=int(usage.get("prompt_tokens", 0)),
        num_completion_tokens=int(usage.get("completion_tokens", 0)),
    )
