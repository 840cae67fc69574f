"""`VLLMBackend`: the `InferenceBackend` seam over a vLLM (>= 0.32) OpenAI server.

    backend = VLLMBackend("http://127.0.0.1:8000")
    out = await backend.generate(GenerateRequest(prompt_token_ids=[1, 2], max_tokens=8))

Each method maps to vLLM's own endpoints. The one piece of asyncrl inside vLLM is the worker
extension that the launcher loads (asyncrl.launcher.vllm, `vllm_ext/asyncrl_vllm_ext.py`):

| seam             | vLLM                                                                        |
|------------------|-----------------------------------------------------------------------------|
| generate         | POST /inference/v1/generate (token ids in; ids, logprobs, weight versions out) |
| pause            | POST /pause?mode=keep / abort (keep: running requests and their KV stay)    |
| resume           | POST /resume                                                                |
| update_weights   | POST /collective_rpc asyncrl_reload_weights {weights_path}, then /update_weight_version |
| weights          | GET /weight_info (vLLM's "default" label = version 0)                      |
| health, metrics  | GET /health, GET /metrics                                                   |

The server must run with `VLLM_SERVER_DEV_MODE=1`, `--enable-scale-out` and the worker extension
(asyncrl's launcher starts it so). Per-token policy versions are exact: vLLM stamps each output
token with the label of the weights that sampled it, and asyncrl labels each version with its step.
Cancelling `generate` closes the connection, and vLLM aborts the request.
"""

from __future__ import annotations

import time

import httpx

from asyncrl.envs.backend import HttpBackend, InferenceError
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
from asyncrl.wire.vllm import VLLMProtocolError, from_vllm_generate, parse_version_label, to_vllm_generate

__all__ = ["VLLMBackend"]


class VLLMBackend(HttpBackend):
    """`InferenceBackend` over vLLM's HTTP API; HttpBackend's transport, errors, health and metrics."""

    def __init__(
        self,
        url: str,
        *,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        super().__init__(url, api_key=api_key, timeout_s=timeout_s, transport=transport)
        self._version = 0  # last version this backend loaded: the fallback stamp (see wire.vllm)
        self._paused = False

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        path = "/inference/v1/generate"
        response = await self._send_json("POST", path, to_vllm_generate(request), generation=True)
        try:
            return from_vllm_generate(response.json(), request, fallback_version=self._version)
        except (VLLMProtocolError, ValueError) as e:
            raise InferenceError(f"POST {self.url}{path}: response breaks the contract: {e}") from None

    async def pause(self, request: PauseRequest) -> PauseResponse:
        await self._send_json("POST", "/pause", None, params={"mode": request.mode})
        self._paused = True
        # vLLM does not report how many requests an abort-mode pause ended.
        return PauseResponse(paused=True, mode=request.mode, num_aborted=0)

    async def resume(self) -> ResumeResponse:
        await self._send_json("POST", "/resume", None)
        self._paused = False
        return ResumeResponse(paused=False)

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Reload HF safetensors from `request.path` in place and label them `request.version`.

        Outside a pause, the server is paused (in `request.mode`) around the reload, as the
        embedded server does; inside one, the caller's pause covers it.
        """
        own_pause = not self._paused
        t0 = time.perf_counter()
        if own_pause:
            await self.pause(PauseRequest(mode=request.mode))
        try:
            t1 = time.perf_counter()
            # asyncrl's worker extension (launcher/vllm_ext): vLLM's reload_weights + a CPU MoE repair
            rpc = {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": request.path}}
            await self._send_json("POST", "/collective_rpc", rpc)
            await self._send_json("POST", "/update_weight_version", {"new_version": str(request.version)})
            load_seconds = time.perf_counter() - t1
        finally:
            if own_pause:
                await self.resume()
        self._version = request.version
        return UpdateWeightsResponse(
            version=request.version, load_seconds=load_seconds, paused_seconds=time.perf_counter() - t0
        )

    async def weights(self) -> WeightsInfo:
        response = await self._send_json("GET", "/weight_info", None)
        try:
            version = parse_version_label(str(response.json()["weight_version"]))
        except (KeyError, ValueError) as e:
            raise InferenceError(f"GET {self.url}/weight_info: unexpected answer: {e}") from None
        return WeightsInfo(version=version)
