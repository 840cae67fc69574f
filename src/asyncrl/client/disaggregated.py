"""`DisaggregatedBackend`: a prefill server and a decode server (vLLM, a KV connector between them) as
one `InferenceBackend`, so that the pool routes over pairs as it routes over servers.

    pair = DisaggregatedBackend(KVHandoffBackend(prefill_url), KVHandoffBackend(decode_url))
    out = await pair.generate(GenerateRequest(prompt_token_ids=ids, max_tokens=256))

Each request takes two hops over vLLM's `POST /inference/v1/generate`:

1. prefill: the prompt with `max_tokens = 1` and `kv_transfer_params = {"do_remote_decode": true,
   ...}`; the server computes the prompt's KV, keeps it for the decode server, and answers with the
   `kv_transfer_params` that locate it (engine, blocks, host, port: the connector's business);
2. decode: the same request with those `kv_transfer_params`; the decode server pulls the KV through
   its connector instead of computing it, and samples the completion.

The answer is the decode hop's: its tokens, logprobs and per-token versions (the decode server's
stamps), with `num_cached_tokens` from the prefill hop (where the prompt's prefix cache lives) and
`context_version` the oldest of: the version the pair held when the request was sent, the
prefill's version (the stamp of its one token: the weights that computed the prompt's KV), and
the decode's first token's.

Salts: the pair keeps one weights epoch for both servers, as `VLLMBackend` does for one server
(a new epoch from each pause of the pair, and weights load only inside one), and both hops carry
the same salt, `{cache_salt}|{epoch}`: the prefill server's prefix cache and the blocks the decode
server receives are keyed alike. Pause, resume and weight updates go to both servers (an update
loads the same version into both inside one pause of the pair). Health needs both; `metrics` are
the decode server's, where the running requests and their KV live.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from typing import Any

from asyncrl.client.backend import InferenceError
from asyncrl.client.vllm_backend import VLLMBackend
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
from asyncrl.wire.vllm import VLLMProtocolError, from_vllm_generate, to_vllm_generate

__all__ = ["PREFILL_KV_TRANSFER_PARAMS", "DisaggregatedBackend", "KVHandoffBackend"]

# What a prefill hop asks of vLLM's connectors (NIXL, P2pNccl, Mooncake, ...): keep the prompt's KV
# for a remote decode and say where it is.
PREFILL_KV_TRANSFER_PARAMS: dict[str, Any] = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}

_PATH = "/inference/v1/generate"


class KVHandoffBackend(VLLMBackend):
    """A vLLM server that takes one hop of a prefill/decode request: the salt as given, the
    `kv_transfer_params` attached, and the answer's own `kv_transfer_params` returned."""

    async def generate_hop(
        self, request: GenerateRequest, *, salt: str, kv_transfer_params: dict[str, Any]
    ) -> tuple[GenerateResponse, dict[str, Any] | None]:
        body = to_vllm_generate(
            request.model_copy(update={"cache_salt": salt}), kv_transfer_params=kv_transfer_params
        )
        response = await self._send_json("POST", _PATH, body, generation=True)
        try:
            payload = response.json()
            out = from_vllm_generate(payload, request, fallback_version=self._version)
        except (VLLMProtocolError, ValueError) as e:
            raise InferenceError(f"POST {self.url}{_PATH}: response breaks the contract: {e}") from None
        return out, payload.get("kv_transfer_params")


class DisaggregatedBackend:
    """`InferenceBackend` over a prefill server and a decode server (see the module docstring)."""

    def __init__(self, prefill: KVHandoffBackend, decode: KVHandoffBackend) -> None:
        self.prefill, self.decode = prefill, decode
        self.url = decode.url  # the pair is known by its decode server, where requests run
        self._version = 0  # last version loaded into both; before any load the servers' count as v0
        self._paused = False
        self._instance = secrets.token_hex(4)
        self._epoch = 0

    @property
    def epoch_key(self) -> str:
        """The weights epoch that both hops of a request sent now are salted with."""
        return f"{self._instance}.{self._epoch}"

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        if request.return_routed_experts:
            raise InferenceError(
                f"{self.url}: a prefill/decode pair does not return routed experts (the prompt's routing "
                "is on the prefill server)"
            )
        salt = self.epoch_key if request.cache_salt is None else f"{request.cache_salt}|{self.epoch_key}"
        floor = self._version
        prefill = request.model_copy(update={"max_tokens": 1})
        first, params = await self.prefill.generate_hop(
            prefill, salt=salt, kv_transfer_params=PREFILL_KV_TRANSFER_PARAMS
        )
        if params is None:
            raise InferenceError(
                f"prefill server {self.prefill.url} answered without kv_transfer_params: start it with a "
                "KV connector ([inference.vllm] kv_transfer_config)"
            )
        out, _ = await self.decode.generate_hop(request, salt=salt, kv_transfer_params=params)
        context = min([floor, *first.policy_versions[:1], *out.policy_versions[:1]])
        cached = first.num_cached_tokens
        return out.model_copy(update={"context_version": context, "num_cached_tokens": cached})

    async def pause(self, request: PauseRequest) -> PauseResponse:
        answers = await asyncio.gather(self.prefill.pause(request), self.decode.pause(request))
        self._paused = True
        self._epoch += 1  # neither server computes until the resume: requests sent now start afresh
        return PauseResponse(paused=True, mode=request.mode, num_aborted=sum(a.num_aborted for a in answers))

    async def resume(self) -> ResumeResponse:
        await asyncio.gather(self.prefill.resume(), self.decode.resume())
        self._paused = False
        return ResumeResponse(paused=False)

    async def update_weights(self, request: UpdateWeightsRequest) -> UpdateWeightsResponse:
        """Both servers load `request.version` inside one pause of the pair: the pair's own (in
        `request.mode`, resumed after a successful load) or the caller's. A failure raises and
        leaves both paused, as `VLLMBackend.update_weights` leaves one."""
        own_pause = not self._paused
        t0 = time.perf_counter()
        await self.pause(PauseRequest(mode=request.mode if own_pause else "keep"))
        keep = request.model_copy(update={"mode": "keep"})
        done = await asyncio.gather(self.prefill.update_weights(keep), self.decode.update_weights(keep))
        self._version = request.version
        if own_pause:
            await self.resume()
        return UpdateWeightsResponse(
            version=request.version,
            load_seconds=max(d.load_seconds for d in done),
            paused_seconds=time.perf_counter() - t0,
        )

    async def weights(self) -> WeightsInfo:
        """The older of the two servers' versions: the pair serves a version once both hold it."""
        prefill, decode = await asyncio.gather(self.prefill.weights(), self.decode.weights())
        return min(prefill, decode, key=lambda w: w.version)

    async def health(self, timeout_s: float) -> bool:
        return all(await asyncio.gather(self.prefill.health(timeout_s), self.decode.health(timeout_s)))

    async def metrics(self) -> str:
        return await self.decode.metrics()

    async def aclose(self) -> None:
        await asyncio.gather(self.prefill.aclose(), self.decode.aclose())
