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
|  (distributed)   | POST /collective_rpc asyncrl_staged (polled), then asyncrl_swap_weights {version} |
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

With `transport = "distributed"` (docs/weights-transfer.md) the server's workers receive each
version from the trainer while vLLM generates (the worker extension's weight-transfer engine,
`vllm_ext/asyncrl_vllm_receive.py`). An update then waits, without pausing, until every worker
holds the version (polling `asyncrl_staged`, which vLLM answers between two engine steps), and
only then pauses for the swap from memory. A version that does not arrive within the run's
`[weights] timeout_s` raises `ServerUnavailable` before any pause, the weights untouched; a swap
that fails leaves the server paused, as a failed reload does.
"""

from __future__ import annotations

import asyncio
import secrets
import time

import httpx

from asyncrl.client.backend import HttpBackend, InferenceError, ServerUnavailable
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

_STAGED_POLL_S = 0.05  # each poll is one collective RPC, served between two engine steps


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
        """Load `request.version` in place and label it so: HF safetensors from `request.path`, or
        (`transport = "distributed"`) the version the workers received from the trainer.

        The load always runs inside a pause of its own, which starts a new weights epoch. Outside
        a caller's pause, the server is paused in `request.mode` and resumed after a successful
        load, as the embedded server does; inside one (kept as `keep`, so that nothing the caller
        kept is aborted), the caller resumes it. A failed load raises and leaves the server
        paused either way: its weights may be half-loaded.
        """
        if request.transport == "distributed":
            return await self._swap_received(request)
        own_pause = not self._paused
        t0 = time.perf_counter()
        await self.pause(PauseRequest(mode=request.mode if own_pause else "keep"))
        t1 = time.perf_counter()
        # asyncrl's worker extension (launcher/vllm_ext): vLLM's reload_weights + a CPU MoE repair
        rpc = {"method": "asyncrl_reload_weights", "kwargs": {"weights_path": request.path}}
        await self._send_json("POST", "/collective_rpc", rpc)
        await self._label(request.version)
        load_seconds = time.perf_counter() - t1
        if own_pause:
            await self.resume()
        return UpdateWeightsResponse(
            version=request.version, load_seconds=load_seconds, paused_seconds=time.perf_counter() - t0
        )

    async def _swap_received(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Wait (serving) until every worker staged `request.version` or newer, then pause and swap.
        `load_seconds` is the wait and the swap, as the embedded server counts it."""
        start = time.perf_counter()
        await self._wait_staged(request.version)
        own_pause = not self._paused
        t0 = time.perf_counter()
        await self.pause(PauseRequest(mode=request.mode if own_pause else "keep"))
        rpc = {"method": "asyncrl_swap_weights", "kwargs": {"version": request.version}}
        results = await self._rpc_results(rpc)
        version = int(results[0]["version"])
        if any(int(r["version"]) != version for r in results):
            raise InferenceError(f"{self.url}: the workers swapped in different versions: {results}")
        await self._label(version)
        load_seconds = time.perf_counter() - start
        if own_pause:
            await self.resume()
        return UpdateWeightsResponse(
            version=version,
            load_seconds=load_seconds,
            paused_seconds=time.perf_counter() - t0,
            receive_seconds=max(float(r["receive_s"]) for r in results),
        )

    async def _wait_staged(self, version: int) -> None:
        """Return once every worker holds `version` or newer; ServerUnavailable past the run's
        transfer deadline (the server keeps its weights and is not paused)."""
        start = time.monotonic()
        while True:
            staged = await self._rpc_results({"method": "asyncrl_staged"})
            held = [r["version"] for r in staged]
            if None not in held and min(held) >= version:
                return
            timeout_s = float(staged[0]["timeout_s"])
            if time.monotonic() - start > timeout_s:
                raise ServerUnavailable(
                    f"{self.url}: version {version} did not arrive over the weights channel within "
                    f"{timeout_s:g} s (the workers hold {held}); the server keeps its weights"
                )
            await asyncio.sleep(_STAGED_POLL_S)

    async def _rpc_results(self, rpc: dict) -> list[dict]:
        """One result per worker (dicts); InferenceError for any other answer."""
        response = await self._send_json("POST", "/collective_rpc", rpc)
        try:
            results = response.json()["results"]
        except (ValueError, KeyError, TypeError):
            results = None
        if not (isinstance(results, list) and results and all(isinstance(r, dict) for r in results)):
            raise InferenceError(
                f"POST {self.url}/collective_rpc {rpc['method']}: unexpected answer {response.text[:300]}"
            )
        return results

    async def _label(self, version: int) -> None:
        await self._send_json("POST", "/update_weight_version", {"new_version": str(version)})
        self._version = version

    async def weights(self) -> WeightsInfo:
        response = await self._send_json("GET", "/weight_info", None)
        try:
            version = parse_version_label(str(response.json()["weight_version"]))
        except (KeyError, ValueError) as e:
            raise InferenceError(f"GET {self.url}/weight_info: unexpected answer: {e}") from None
        return WeightsInfo(version=version)
