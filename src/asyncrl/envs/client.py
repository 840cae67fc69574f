"""How environments reach a policy: the token-in/token-out inference client protocol.

`InferenceClient` is what the rollout loop calls once per model turn. `HttpInferenceClient` speaks
`POST <base_url>/v1/generate` (ARCHITECTURE.md, Inference HTTP API); the orchestrator wraps it with
routing and retries. Tests use in-process fakes (see `asyncrl.envs.scripted`).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import httpx
from pydantic import ValidationError

from asyncrl.wire import GenerateRequest, GenerateResponse, SamplingParams

__all__ = ["HttpInferenceClient", "InferenceClient", "InferenceError", "parse_generate_response"]


class InferenceError(RuntimeError):
    """The inference server failed or answered outside the contract (not an environment bug)."""


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


class HttpInferenceClient:
    """`InferenceClient` over HTTP. One instance shares a connection pool; close it with `aclose()`."""

    def __init__(
        self,
        base_url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )

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
        try:
            response = await self._http.post("/v1/generate", json=request.model_dump(exclude_none=True))
        except httpx.HTTPError as e:
            raise InferenceError(f"POST {self.base_url}/v1/generate failed: {type(e).__name__}: {e}") from e
        if response.status_code != 200:
            raise InferenceError(
                f"POST {self.base_url}/v1/generate -> {response.status_code}: {response.text[:500]}"
            )
        return parse_generate_response(response.content, f"POST {self.base_url}/v1/generate")

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> HttpInferenceClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def parse_generate_response(content: bytes, where: str) -> GenerateResponse:
    """Decode a 200 answer of /v1/generate, checking the schema and the per-token list lengths."""
    try:
        out = GenerateResponse.model_validate_json(content)
    except ValidationError as e:
        raise InferenceError(f"{where}: response breaks the contract: {e}") from None
    _check_lengths(out)
    return out


def _check_lengths(out: GenerateResponse) -> None:
    n = len(out.token_ids)
    if len(out.logprobs) != n or len(out.policy_versions) != n:
        raise InferenceError(
            f"/v1/generate returned {n} token_ids but {len(out.logprobs)} logprobs and "
            f"{len(out.policy_versions)} policy_versions"
        )
