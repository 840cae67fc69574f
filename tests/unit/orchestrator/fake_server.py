"""A stand-in inference server speaking the asyncrl HTTP API, for orchestrator tests without torch.

It "samples" random lowercase letters then eos, one token at a time, and stamps each token with
the weight version current when it was sampled: an update that lands mid-response (pause keep,
update, resume) changes the versions within one response. While paused it samples nothing.
It keeps a prefix cache the way the engine does: keyed by (`cache_salt`, the version that computed
the tokens), reporting `num_cached_tokens`; every request is logged in `seen` (salt, version on
arrival, cached tokens, per-token versions). It can add a heavy-tailed delay per request, hold a
response after its first tokens (`hold_after_tokens`, released by `release()`), fail updates, and
refuse requests that do not fit a context limit (`max_model_len`) with the engine's 400, and
answer with a length that depends on the version (`reply_len`).
`update_weights` only records the version and path.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse

from asyncrl.wire import (
    GenerateRequest,
    GenerateResponse,
    PauseRequest,
    PauseResponse,
    ResumeResponse,
    RoutedExperts,
    UpdateWeightsRequest,
    UpdateWeightsResponse,
    WeightsInfo,
)
from helpers import free_port

EOS = 258
NUM_LAYERS, TOP_K = 2, 2


def _context_limit_error(num_prompt: int, max_tokens: int, limit: int) -> JSONResponse:
    """The embedded engine's answer to a request that does not fit its context (asyncrl.inference)."""
    message = f"prompt ({num_prompt} tokens) + max_tokens ({max_tokens}) exceeds the context limit {limit}"
    body = {
        "error": {"message": message, "type": "invalid_request_error", "param": "max_tokens", "code": 400}
    }
    return JSONResponse(body, status_code=400)


@dataclass
class Seen:
    """One /v1/generate request as the fake server saw it."""

    cache_salt: str | None
    version: int  # weight version on arrival
    num_cached_tokens: int
    policy_versions: list[int] = field(default_factory=list)


class FakeServer:
    def __init__(
        self,
        *,
        seed: int = 0,
        delay_median_s: float = 0.0,
        delay_sigma: float = 0.0,
        port: int | None = None,
        hang_after: int | None = None,
        hang_first_prompt: bool = False,
        hold_after_tokens: int | None = None,
        fail_updates: int = 0,
        max_model_len: int | None = None,
        reply_len: Callable[[int], int] | None = None,
    ) -> None:
        """`hang_after`: requests after the first N never answer (a server that stops responding).
        `hang_first_prompt`: requests with the first request's prompt never answer (one straggler group).
        `hold_after_tokens`: every response waits after that many tokens until `release()`.
        `fail_updates`: the next N `/update_weights` calls answer 500 (the weights stay as they are).
        `max_model_len`: requests whose prompt + max_tokens exceed it get the engine's 400 (counted in
        `num_rejected`).
        `reply_len(version)`: the letters of every reply (before eos), by the version on arrival.
        """
        self.version = 0
        self.seen: list[Seen] = []
        self.hold_after_tokens = hold_after_tokens
        self.fail_updates = fail_updates
        self.max_model_len, self.num_rejected = max_model_len, 0
        self.reply_len = reply_len
        self._cache: set[tuple[str | None, int, tuple[int, ...]]] = set()  # cached block-free prefixes
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._released = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self.loaded_paths: list[str] = []
        self.num_requests = 0
        self.paused = False
        self.rng = random.Random(seed)
        self.delay_median_s, self.delay_sigma = delay_median_s, delay_sigma
        self.hang_after = hang_after
        self.hang_first_prompt = hang_first_prompt
        self._first_prompt: list[int] | None = None
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.app = self._build_app()
        self._server: uvicorn.Server | None = None
        self._thread: threading.Thread | None = None

    def _build_app(self) -> FastAPI:
        app = FastAPI()

        @app.get("/health")
        async def health():
            return {"status": "ok", "paused": self.paused}

        @app.post("/v1/generate", response_model=None)
        async def generate(req: GenerateRequest) -> GenerateResponse | JSONResponse:
            self._loop = asyncio.get_running_loop()
            self.num_requests += 1
            if (
                self.max_model_len is not None
                and len(req.prompt_token_ids) + req.max_tokens > self.max_model_len
            ):
                self.num_rejected += 1
                return _context_limit_error(len(req.prompt_token_ids), req.max_tokens, self.max_model_len)
            if self.hang_after is not None and self.num_requests > self.hang_after:
                await asyncio.Event().wait()
            if self._first_prompt is None:
                self._first_prompt = req.prompt_token_ids
            if self.hang_first_prompt and req.prompt_token_ids == self._first_prompt:
                await asyncio.Event().wait()
            if self.delay_median_s:
                await asyncio.sleep(
                    self.delay_median_s * float(np.exp(self.delay_sigma * self.rng.gauss(0, 1)))
                )
            await self._unpaused.wait()
            prompt = req.prompt_token_ids
            seen = Seen(req.cache_salt, self.version, self._cached_prefix(req.cache_salt, prompt))
            self.seen.append(seen)
            self._store(req.cache_salt, seen.version, prompt)
            n = self.rng.randint(1, min(6, req.max_tokens))
            if self.reply_len is not None:
                n = min(self.reply_len(seen.version) + 1, req.max_tokens)
            tokens = [self.rng.randint(97, 122) for _ in range(n - 1)] + [EOS]
            for i in range(n):
                if i == self.hold_after_tokens:
                    await self._released.wait()
                await self._unpaused.wait()  # pause keep: the request holds, later tokens get the new version
                seen.policy_versions.append(self.version)
                await asyncio.sleep(0)
            self._store(req.cache_salt, seen.version, [*prompt, *tokens])
            routing = None
            if req.return_routed_experts:
                total = len(req.prompt_token_ids) + len(tokens)
                arr = np.zeros((total - req.routed_experts_start, NUM_LAYERS, TOP_K), np.uint8)
                arr[..., 1] = 1
                routing = RoutedExperts.from_array(arr, start=req.routed_experts_start)
            return GenerateResponse(
                token_ids=tokens,
                logprobs=[-1.0] * len(tokens),
                policy_versions=list(seen.policy_versions),
                finish_reason="stop",
                num_cached_tokens=seen.num_cached_tokens,
                routed_experts=routing,
            )

        @app.get("/weights")
        async def weights() -> WeightsInfo:
            return WeightsInfo(
                version=self.version, path=self.loaded_paths[-1] if self.loaded_paths else None
            )

        @app.post("/pause")
        async def pause(req: PauseRequest) -> PauseResponse:
            self.paused = True
            self._unpaused.clear()
            return PauseResponse(paused=True, mode=req.mode, num_aborted=0)

        @app.post("/resume")
        async def resume() -> ResumeResponse:
            self.paused = False
            self._unpaused.set()
            return ResumeResponse(paused=False)

        @app.post("/update_weights")
        async def update(req: UpdateWeightsRequest) -> UpdateWeightsResponse:
            if self.fail_updates > 0:
                self.fail_updates -= 1
                raise HTTPException(500, "fake: update failed")
            self.version = req.version
            self.loaded_paths.append(req.path)
            return UpdateWeightsResponse(version=req.version, load_seconds=0.0, paused_seconds=0.0)

        return app

    def _cached_prefix(self, salt: str | None, prompt: list[int]) -> int:
        """Longest cached prefix of `prompt` (the last token always recomputed), as the engine reports it."""
        n = len(prompt) - 1
        while n > 0 and (salt, self.version, tuple(prompt[:n])) not in self._cache:
            n -= 1
        return n

    def _store(self, salt: str | None, version: int, tokens: list[int]) -> None:
        # Keyed by the version on arrival, as the engine keys a request's blocks by its admission.
        self._cache.update((salt, version, tuple(tokens[:n])) for n in range(1, len(tokens) + 1))

    def release(self) -> None:
        """Let responses held by `hold_after_tokens` go on (callable from any thread)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._released.set)

    def start(self) -> FakeServer:
        config = uvicorn.Config(
            self.app, host="127.0.0.1", port=self.port, log_level="warning", lifespan="off"
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if time.monotonic() > deadline:
                raise RuntimeError("fake server did not start")
            time.sleep(0.02)
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._server.force_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10)
