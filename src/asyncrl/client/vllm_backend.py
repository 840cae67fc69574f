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

vLLM's prefix cache knows nothing of weight versions, and a paused vLLM queues the requests it
receives. So the backend keys the salt it sends by its own weights epoch, `{cache_salt}|{epoch}`:
a new epoch starts each time a pause of this server takes effect, and weights are reloaded only
inside such a pause. vLLM computes no KV while paused, so every block salted with an epoch was
computed after that epoch's pause ended, by the weights loaded in it or newer ones. A request
sent once a reload's pause took effect can therefore never match a block of the weights it
replaced; one sent earlier keeps its epoch, like a request running across the update, and its
`context_version` says how old its KV may be. A keep pause is sent with `clear_cache=false`:
vLLM 0.32 would otherwise reset its prefix cache, preempting every running request so that each
recomputes its whole context after the update (its API documents the flag as ignored in keep
mode, but its code applies it). Running requests keep their KV, as on the embedded engine. A
failed reload leaves the server paused (its weights may be half-loaded): only a later successful
update and a `resume` serve again.
"""

from __future__ import annotations

import secrets
import time

import httpx

from asyncrl.client.backend import HttpBackend, InferenceError
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
        # Last version this backend loaded: the fallback stamp (see wire.vllm), and the context
        # floor of requests sent now. Before any load, the server's start-up weights count as v0:
        # never newer than what it holds, so the floor stays conservative.
        self._version = 0
        self._paused = False
        # Salts of earlier backends on the same server (a restarted orchestrator) must not match.
        self._instance = secrets.token_hex(4)
        self._epoch = 0

    @property
    def epoch_key(self) -> str:
        """The weights epoch that requests sent now are salted with (see the module docstring)."""
        return f"{self._instance}.{self._epoch}"

    def weights_loaded_behind(self, version: int) -> None:
        """The servers behind this URL (an external router's) have loaded `version`, paused and
        resumed by their own backends: requests sent from now on start a new epoch, with `version`
        as their context floor. Requests sent earlier keep their epoch and their older floor."""
        self._epoch += 1
        self._version = version

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        path = "/inference/v1/generate"
        salt = self.epoch_key if request.cache_salt is None else f"{request.cache_salt}|{self.epoch_key}"
        floor = self._version
        body = to_vllm_generate(request.model_copy(update={"cache_salt": salt}))
        response = await self._send_json("POST", path, body, generation=True)
        try:
            out = from_vllm_generate(response.json(), request, fallback_version=self._version)
        except (VLLMProtocolError, ValueError) as e:
            raise InferenceError(f"POST {self.url}{path}: response breaks the contract: {e}") from None
        # The oldest weights any of its KV can come from: prefix hits are on blocks of its own epoch,
        # all computed by the version this backend held when the request was sent or a newer one
        # (the one loaded in that epoch's pause, if sent during it); the rest it computed itself,
        # under the weights that sampled its first token or newer ones.
        return out.model_copy(update={"context_version": min([floor, *out.policy_versions[:1]])})

    async def pause(self, request: PauseRequest) -> PauseResponse:
        # vLLM's pause resets its prefix cache by default, and that preempts every running request:
        # each would recompute its whole context after the update. A keep pause keeps their KV, as
        # the embedded engine does; the epoch salt below is what keeps the cache safe.
        params = {"mode": request.mode} | ({"clear_cache": "false"} if request.mode == "keep" else {})
        await self._send_json("POST", "/pause", None, params=params)
        self._paused = True
        self._epoch += 1  # vLLM computes nothing until the resume: requests sent from now on start afresh
        # vLLM does not report how many requests an abort-mode pause ended.
        return PauseResponse(paused=True, mode=request.mode, num_aborted=0)

    async def resume(self) -> ResumeResponse:
        await self._send_json("POST", "/resume", None)
        self._paused = False
        return ResumeResponse(paused=False)

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Reload HF safetensors from `request.path` in place and label them `request.version`.

        The reload always runs inside a pause of its own, which starts a new weights epoch. Outside
        a caller's pause, the server is paused in `request.mode` and resumed after a successful
        reload, as the embedded server does; inside one (kept as `keep`, so that nothing the caller
        kept is aborted), the caller resumes it. A failed reload raises and leaves the server
        paused either way: its weights may be half-loaded.
        """
        own_pause = not self._paused
        t0 = time.perf_counter()
        await self.pause(PauseRequest(mode=request.mode if own_pause else "keep"))
        t1 = time.perf_counter()
        # asyncrl's worker extension (launcher/vllm_ext): vLLM's reload_weights + a CPU MoE repair
        rpc = {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": request.path}}
        await self._send_json("POST", "/collective_rpc", rpc)
        await self._send_json("POST", "/update_weight_version", {"new_version": str(request.version)})
        load_seconds = time.perf_counter() - t1
        self._version = request.version
        if own_pause:
            await self.resume()
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
