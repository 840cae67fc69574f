"""How environments reach a policy: the token-in/token-out `InferenceClient` protocol.

`InferenceClient` is what the rollout loop calls once per model turn. `RequestClient` adapts any
function that answers a `GenerateRequest` to it: `HttpInferenceClient` is one over a single
`HttpBackend` (asyncrl.client.backend, `POST <base_url>/v1/generate`), and the orchestrator's pool
hands out one per episode that routes to a server. Tests use in-process fakes (see
`asyncrl.envs.scripted`).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Protocol, runtime_checkable

import httpx

from asyncrl.client.backend import HttpBackend
from asyncrl.wire import GenerateRequest, GenerateResponse, SamplingParams

__all__ = ["HttpInferenceClient", "InferenceClient", "RequestClient"]


@runtime_checkable
class InferenceClient(Protocol):
    """One model turn: exact prompt token ids in, sampled token ids (+ logprobs, versions, routing) out.

    `routed_experts_start` asks the server to skip routing of tokens whose routing the caller
    already holds; the returned `routed_experts.start` says where the returned rows begin, counted
    over prompt + completion.
    """

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        cache_salt: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
    ) -> GenerateResponse: ...


class RequestClient:
    """`InferenceClient` over `send`, which answers one `GenerateRequest` (a backend, or a routed pool)."""

    def __init__(self, send: Callable[[GenerateRequest], Awaitable[GenerateResponse]]) -> None:
        self._send = send

    async def generate(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        *,
        cache_salt: str | None = None,
        return_routed_experts: bool = False,
        routed_experts_start: int = 0,
    ) -> GenerateResponse:
        request = GenerateRequest.build(
            prompt_token_ids,
            sampling,
            cache_salt=cache_salt,
            return_routed_experts=return_routed_experts,
            routed_experts_start=routed_experts_start,
        )
        return await self._send(request)


class HttpInferenceClient(RequestClient):
    """`InferenceClient` over one server's HTTP API. Close it with `aclose()` (or `async with`)."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.backend = HttpBackend(base_url, api_key=api_key, timeout_s=timeout_s, transport=transport)
        self.base_url = self.backend.url
        super().__init__(self.backend.generate)

    async def aclose(self) -> None:
        await self.backend.aclose()

    async def __aenter__(self) -> HttpInferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
