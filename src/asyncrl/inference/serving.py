"""What the HTTP handlers share: the server state, and running one request to completion.

`collect` runs a request without streaming (the engine hands over one output, when it is done) and
aborts the request when the HTTP client disconnects before then.
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from fastapi import Request

from asyncrl.config.inference import InferenceConfig
from asyncrl.inference.async_engine import AsyncEngine
from asyncrl.inference.request import RequestOutput, SamplingOptions
from asyncrl.wire import GenerateRequest, GenerateResponse, RoutedExperts

__all__ = ["ClientDisconnected", "Collected", "ServerState", "collect"]


class ClientDisconnected(Exception):
    """The HTTP client went away; its request has been aborted."""


@dataclass(kw_only=True)
class ServerState:
    engine: AsyncEngine
    tokenizer: Any  # a transformers tokenizer; only the OpenAI endpoints use it
    config: InferenceConfig
    model_name: str
    max_token_chars: int = 256  # most text one token covers; bounds the token count from below
    # HTTP-level counters for /metrics (the engine keeps its own): tool_calls_parsed, tool_calls_malformed
    counters: dict[str, int] = field(
        default_factory=lambda: {"tool_calls_parsed": 0, "tool_calls_malformed": 0}
    )


@dataclass(kw_only=True)
class Collected:
    """A finished request, accumulated from its RequestOutput deltas."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    finish_reason: str = "abort"
    num_cached_tokens: int = 0
    routed_experts: np.ndarray | None = None
    context_version: int | None = None  # the oldest weights version in the request's KV context

    def add(self, out: RequestOutput) -> None:
        self.token_ids += out.new_token_ids
        self.logprobs += out.new_logprobs
        self.versions += out.new_versions
        if out.finished:
            self.finish_reason = out.finish_reason.value
            self.num_cached_tokens = out.num_cached_tokens
            self.routed_experts = out.routed_experts
            self.context_version = out.context_version

    def to_response(self, request: GenerateRequest) -> GenerateResponse:
        """The `/v1/generate` answer. It does not repeat the prompt's ids: a later turn's prompt is the
        whole context, which the client holds."""
        routed = None
        if self.routed_experts is not None:
            start = min(request.routed_experts_start, len(request.prompt_token_ids))
            routed = RoutedExperts.from_array(self.routed_experts, start=start)
        return GenerateResponse(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            policy_versions=self.versions,
            finish_reason=self.finish_reason,
            num_cached_tokens=self.num_cached_tokens,
            routed_experts=routed,
            context_version=self.context_version,
        )


async def collect(
    state: ServerState, http: Request, prompt: list[int], options: SamplingOptions, **kwargs: Any
) -> Collected:
    """Run one request to completion; abort it if the client disconnects meanwhile."""
    result = Collected()

    async def consume() -> None:
        # not streamed: the engine sends one output, at the end, with every token
        async for out in state.engine.generate(uuid.uuid4().hex, prompt, options, stream=False, **kwargs):
            result.add(out)

    task = asyncio.ensure_future(consume())
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.5)
        if done:
            task.result()  # re-raises InvalidRequestError
            return result
        if await http.is_disconnected():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ClientDisconnected
