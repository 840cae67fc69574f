"""The inference-server seam: `InferenceBackend`, and `HttpBackend` for asyncrl's HTTP API.

One backend object is one server. It speaks the typed messages of `asyncrl.wire` on both sides:
requests are built from wire models, and every answer is validated into a wire model before it
is returned, so a caller never sees a malformed answer.

    backend = HttpBackend("http://127.0.0.1:8000")
    out = await backend.generate(GenerateRequest(prompt_token_ids=[1, 2], max_tokens=8))
    await backend.pause(PauseRequest(mode="keep"))
    await backend.update_weights(UpdateWeightsRequest(path="/run/weights/step_3", version=3))
    await backend.resume()

The orchestrator's `ServerPool` routes over a list of backends and drives weight updates through
them; `HttpInferenceClient` (asyncrl.client.inference_client) is one backend behind the
environments' `InferenceClient` protocol. A second server kind (vLLM, asyncrl.client.vllm_backend)
is a second class with these methods; `build_backends` picks the class.

Errors: `ServerUnavailable` when the server cannot be reached or fails (transport error, timeout,
5xx): the pool takes it out of rotation. `InferenceError` when it answers outside the contract
(4xx, malformed body): the request was at fault, and the server stays. `ContextLimitExceeded`, an
`InferenceError`, when the server refused a request because it does not fit its context limit:
the caller has reached the server's limit (a length stop), not made a mistake.
"""

from __future__ import annotations

from typing import Protocol, TypeVar, runtime_checkable

import httpx
from pydantic import BaseModel, ValidationError

from asyncrl.wire import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)
from asyncrl.wire.binary import GENERATE_MEDIA_TYPE, BinaryBodyError, decode_generate

__all__ = ["ContextLimitExceeded", "HttpBackend", "InferenceBackend", "InferenceError", "ServerUnavailable"]

_Answer = TypeVar("_Answer", bound=BaseModel)

# How the servers word a 400 for a request that does not fit their context: the embedded engine
# "... exceeds the context limit N" / "the context limit is N"; vLLM "... longer than the maximum
# model length of N" (token prompts) or "This model's maximum context length is N" (text prompts).
# Neither gives the refusal a code of its own, so the message is the only signal.
_CONTEXT_LIMIT_PHRASES = ("context limit", "maximum model length", "maximum context length")


class InferenceError(RuntimeError):
    """The inference server failed or answered outside the contract (not an environment bug)."""


class ServerUnavailable(InferenceError):
    """The server failed at the transport level (or 5xx); the request may be retried elsewhere."""


class ContextLimitExceeded(InferenceError):
    """The server refused the request (400) because prompt + max_tokens do not fit its context limit."""


@runtime_checkable
class InferenceBackend(Protocol):
    """One inference server, as the orchestrator and the environments use it."""

    url: str

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Token-in/token-out sampling: one `GenerateResponse`, per-token lists of equal length."""
        ...

    async def pause(self, request: PauseRequest) -> PauseResponse:
        """Stop scheduling; `keep` holds running requests (and their KV), `abort` ends them."""
        ...

    async def resume(self) -> ResumeResponse: ...

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Load the HF-format weights at `request.path` as policy version `request.version`."""
        ...

    async def weights(self) -> WeightsInfo:
        """The policy version the server holds now."""
        ...

    async def health(self, timeout_s: float) -> bool:
        """True when the server answers its health check within `timeout_s`; never raises."""
        ...

    async def metrics(self) -> str:
        """Prometheus text of the server's counters."""
        ...

    async def aclose(self) -> None: ...


class HttpBackend:
    """`InferenceBackend` over asyncrl's inference HTTP API (docs/architecture.md); one connection pool."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = url.rstrip("/")
        kw = {"base_url": self.url, "headers": headers, "timeout": timeout_s, "transport": transport}
        # Two connection pools. Generation gets an unbounded one: the orchestrator bounds how many
        # requests are in flight, and a paused server holds them all open. Admin calls (pause,
        # update_weights, resume, health) get their own, so they never queue behind held requests:
        # with one shared pool, 100 requests held by a pause starved the update that would end it.
        self._gen = httpx.AsyncClient(limits=httpx.Limits(max_connections=None), **kw)
        self._http = httpx.AsyncClient(**kw)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Asks for the binary body (routed experts as raw bytes); a server that answers JSON is read too."""
        payload = request.model_dump(exclude_none=True)
        response = await self._send_json("POST", "/v1/generate", payload, generation=True, binary=True)
        if not response.headers.get("content-type", "").startswith(GENERATE_MEDIA_TYPE):
            return self._validate(response, "POST", "/v1/generate", GenerateResponse)
        try:
            return decode_generate(response.content)
        except BinaryBodyError as e:
            raise InferenceError(f"POST {self.url}/v1/generate: response breaks the contract: {e}") from None

    async def pause(self, request: PauseRequest) -> PauseResponse:
        return await self._call("POST", "/pause", PauseResponse, request)

    async def resume(self) -> ResumeResponse:
        return await self._call("POST", "/resume", ResumeResponse)

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        return await self._call("POST", "/update_weights", UpdateWeightsResponse, request)

    async def weights(self) -> WeightsInfo:
        return await self._call("GET", "/weights", WeightsInfo)

    async def health(self, timeout_s: float) -> bool:
        try:
            return (await self._http.get("/health", timeout=timeout_s)).status_code == 200
        except httpx.HTTPError:
            return False

    async def metrics(self) -> str:
        return (await self._send("GET", "/metrics", None)).text

    async def aclose(self) -> None:
        await self._gen.aclose()
        await self._http.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        answer: type[_Answer],
        body: BaseModel | None = None,
        *,
        generation: bool = False,
    ) -> _Answer:
        response = await self._send(method, path, body, generation=generation)
        return self._validate(response, method, path, answer)

    def _validate(self, response: httpx.Response, method: str, path: str, answer: type[_Answer]) -> _Answer:
        try:
            return answer.model_validate_json(response.content)
        except ValidationError as e:
            raise InferenceError(f"{method} {self.url}{path}: response breaks the contract: {e}") from None

    async def _send(
        self, method: str, path: str, body: BaseModel | None, *, generation: bool = False
    ) -> httpx.Response:
        payload = body.model_dump(exclude_none=True) if body is not None else {}
        return await self._send_json(
            method, path, payload if method == "POST" else None, generation=generation
        )

    async def _send_json(
        self,
        method: str,
        path: str,
        payload: dict | None,
        params: dict[str, str] | None = None,
        *,
        generation: bool = False,
        binary: bool = False,
    ) -> httpx.Response:
        """One request; transport errors and 5xx raise ServerUnavailable, other non-200 InferenceError.
        `binary`: accept the binary generate body as well as JSON."""
        where = f"{method} {self.url}{path}"
        headers = {"Accept": f"{GENERATE_MEDIA_TYPE}, application/json;q=0.5"} if binary else None
        try:
            client = self._gen if generation else self._http
            response = await client.request(method, path, json=payload, params=params, headers=headers)
        except httpx.HTTPError as e:
            raise ServerUnavailable(f"{where} failed: {type(e).__name__}: {e}") from e
        if response.status_code >= 500:
            raise ServerUnavailable(f"{where} -> {response.status_code}: {response.text[:500]}")
        if response.status_code == 400 and any(p in response.text for p in _CONTEXT_LIMIT_PHRASES):
            raise ContextLimitExceeded(f"{where} -> 400: {response.text[:500]}")
        if response.status_code != 200:
            raise InferenceError(f"{where} -> {response.status_code}: {response.text[:500]}")
        return response
